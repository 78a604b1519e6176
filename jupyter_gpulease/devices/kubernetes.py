"""The GPUs of a Kubernetes cluster: its nodes' GPU capacity and labels, followed as they change.

The pool comes from what the cluster already publishes, so an admin declares nothing twice:

* **NVIDIA GPU feature discovery (GFD) labels and the device plugin's capacity** — the usual
  GPU operator setup. ``nvidia.com/gpu.product`` names the model, ``nvidia.com/gpu.count`` the
  physical GPUs, ``nvidia.com/gpu.memory`` their memory (MiB). Time-slicing and MPS
  (``nvidia.com/gpu.replicas``, ``nvidia.com/gpu.sharing-strategy``, a ``-SHARED`` product
  suffix, or the renamed ``nvidia.com/gpu.shared`` resource) are seen through: the pool holds
  the physical GPUs, and the broker's shares are placed on them. MIG with the ``mixed``
  strategy (``nvidia.com/mig-<profile>.count`` / ``.memory`` labels, ``nvidia.com/mig-<profile>``
  resources) and the ``single`` strategy (``<product>-MIG-<profile>``) become MIG instances.
* **HAMi** (``hami.io/node-nvidia-register`` node annotation): real GPU UUIDs, memory and health.
* **Dynamic Resource Allocation** (``dra``: ResourceSlices of NVIDIA's DRA driver,
  ``gpu.nvidia.com``): real GPU and MIG UUIDs, so the Kubernetes spawner can pin the exact
  leased devices with a ResourceClaim.

Node state follows the cluster: a cordoned node (``spec.unschedulable``) and a node that is not
Ready keep their GPUs in the pool as unhealthy (running leases go on, nothing new is granted
there); a node not Ready for ``lost_after_s`` (Kubernetes evicts its pods after 300 s by
default) or deleted from the cluster leaves the pool, and the broker ends the leases on it. GPUs
the device plugin reports unhealthy (allocatable below capacity) are marked unhealthy.

Without DRA or HAMi the device plugin, not the broker, picks which GPU of the node a pod gets;
the pool numbers a node's GPUs 0..n-1 and names them ``GPU-k8s-<uuid>`` (stable per node and
index). The broker still counts them exactly, per node and model.

Config::

    {"label_selector": "nvidia.com/gpu.present=true",  # which nodes to read (default: all)
     "dra": False,                 # also read ResourceSlices of driver "gpu.nvidia.com"
     "lost_after_s": 300,          # a node not Ready this long leaves the pool
     "memory_mib": {"A100-SXM4-80GB": 81920},   # for nodes without the nvidia.com/gpu.memory label
     "kubeconfig": "~/.kube/config", "context": "",   # default: in-cluster, else ~/.kube/config
     "refresh_s": 15,              # how often the broker re-reads the pool
     "nodes_file": "nodes.json",   # read a saved `kubectl get nodes -o json` instead of the API
     "resource_slices_file": "slices.json"}   # ... and `kubectl get resourceslices -o json`

With the API (no ``nodes_file``) the backend lists the nodes once, then, when its host calls
:meth:`KubernetesBackend.start` on its event loop (the broker does), watches them in a task on that
loop (like kubespawner's reflector), so :meth:`KubernetesBackend.inventory` answers from memory.
Without a watch (a one-off check, a host that never starts it) ``inventory`` lists again once the
last list is ``refresh_s`` old. Reading the documents is :mod:`.kubenodes` (pure). The service
account needs ``get``,
``list`` and ``watch`` on ``nodes`` (and ``list`` on ``resourceslices.resource.k8s.io`` with
``dra``). deploy/ has the RBAC manifest.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
import time
from typing import Any

from ..core.model import GPU
from ..tasks import BackgroundTasks
from .base import Clock, DeviceBackend, DeviceSample, DeviceUnavailable, check_config_keys
from .kubenodes import DRA_DRIVER, apply_node_event, inventory_from_nodes, items_of

log = logging.getLogger(__name__)

_CONFIG_KEYS = {"label_selector", "dra", "dra_driver", "lost_after_s", "memory_mib", "kubeconfig", "context",
                "refresh_s", "nodes_file", "resource_slices_file", "request_timeout_s"}


class KubernetesBackend(DeviceBackend):
    """The cluster's GPU nodes as the pool; no telemetry (the servers report their own usage)."""

    name = "kubernetes"

    def __init__(self, config: dict[str, Any] | None = None, *, clock: Clock | None = None):
        config = dict(config or {})
        check_config_keys("kubernetes", config, sorted(_CONFIG_KEYS))
        self.label_selector = str(config.get("label_selector") or "")
        self.dra = bool(config.get("dra", False))
        self.dra_driver = str(config.get("dra_driver") or DRA_DRIVER)
        self.lost_after_s = float(config.get("lost_after_s", 300))
        if self.lost_after_s < 0:
            raise ValueError("kubernetes device backend: 'lost_after_s' must be 0 or more seconds, e.g. 300")
        mem = config.get("memory_mib") or {}
        if not isinstance(mem, dict) or not all(isinstance(v, int) and v > 0 for v in mem.values()):
            raise ValueError("kubernetes device backend: 'memory_mib' maps model names to MiB, e.g. {'A100-SXM4-80GB': 81920}")
        self.memory_overrides = dict(mem)
        self.inventory_refresh_s = float(config.get("refresh_s", 15))
        self.request_timeout_s = float(config.get("request_timeout_s", 30))
        self.kubeconfig = os.path.expanduser(str(config.get("kubeconfig") or "")) or None
        self.context = str(config.get("context") or "") or None
        self.nodes_file = config.get("nodes_file") or None
        self.slices_file = config.get("resource_slices_file") or None
        self._clock = clock or time.time
        # the cache: written by the watch on the host's loop, read by inventory() in a worker thread
        self._lock = threading.Lock()
        self._nodes: dict[str, dict] = {}
        self._slices: list[dict] = []
        self._resource_version = ""
        self._listed_at: float | None = None  # monotonic time of the last complete list
        self._file_stamp: tuple | None = None
        self._error: str = ""
        self._tasks = BackgroundTasks(log)
        self._watch_task: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._warned: set[str] = set()
        self._last: list[GPU] = []
        self._parsed: dict = {}  # node name -> ((resourceVersion, slices' versions), NodeGPUs)

    # ------------------------------------------------------------------ the interface
    def inventory(self) -> list[GPU]:
        if self.nodes_file:
            self._read_files()
        elif not self.watching and (self._listed_at is None or time.monotonic() - self._listed_at >= self.inventory_refresh_s):
            self._list_now()
        with self._lock:
            nodes, slices = list(self._nodes.values()), list(self._slices)
        problems: list[str] = []
        if len(self._parsed) > 2 * len(nodes) + 100:  # forget nodes that left
            self._parsed.clear()
        gpus = inventory_from_nodes(nodes, now=self._clock(), slices=slices if self.dra else (), lost_after_s=self.lost_after_s,
                                    memory_overrides=self.memory_overrides, dra_driver=self.dra_driver, problems=problems,
                                    cache=self._parsed)
        for p in problems:
            if p not in self._warned:  # once per distinct problem, not every refresh
                self._warned.add(p)
                log.warning("Kubernetes GPU pool: %s", p)
        self._last = gpus
        return gpus

    def sample(self) -> dict[str, DeviceSample]:
        now = self._clock()
        out: dict[str, DeviceSample] = {}
        for g in self._last or self.inventory():
            out[g.uuid] = DeviceSample(uuid=g.uuid, timestamp=now, memory_total_mib=g.memory_mib)
            for m in g.mig:
                out[m.uuid] = DeviceSample(uuid=m.uuid, timestamp=now, memory_total_mib=m.memory_mib, parent_uuid=g.uuid)
        return out

    def start(self) -> None:
        """Watch the nodes in a task on the running event loop (the host's), from the last list on."""
        if self.nodes_file or self._watch_task is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._watch_task = self._tasks.start(self._follow(), what="the Kubernetes node watch")

    @property
    def watching(self) -> bool:
        """Whether a watch keeps the cache current (it runs, and its last list succeeded)."""
        return self._watch_task is not None and not self._watch_task.done() and self._listed_at is not None

    def close(self) -> None:
        task, loop = self._watch_task, self._loop
        self._watch_task = None
        if task is None or loop is None or loop.is_closed():
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            task.cancel()
        else:
            loop.call_soon_threadsafe(task.cancel)

    # ------------------------------------------------------------------ recorded documents
    def _read_files(self) -> None:
        paths = [p for p in (self.nodes_file, self.slices_file) if p]
        try:
            stamp = tuple(os.stat(p).st_mtime_ns for p in paths)
        except OSError as e:
            raise DeviceUnavailable(f"kubernetes device backend: cannot read {e.filename}: {e.strerror}") from None
        if stamp == self._file_stamp:
            return
        try:
            with open(self.nodes_file) as f:
                nodes = items_of(json.load(f), "Node")
            slices = []
            if self.slices_file:
                with open(self.slices_file) as f:
                    slices = items_of(json.load(f), "ResourceSlice")
        except (OSError, ValueError) as e:
            raise DeviceUnavailable(f"kubernetes device backend: {self.nodes_file} is not a `kubectl get nodes -o json` document: {e}") from None
        with self._lock:
            self._nodes = {(n.get("metadata") or {}).get("name", ""): n for n in nodes}
            self._slices = slices
            self._file_stamp = stamp

    # ------------------------------------------------------------------ the API: list, then watch
    def _list_now(self) -> None:
        """One complete list, in the calling thread (never on a running loop: the broker calls
        ``inventory`` in a worker thread); DeviceUnavailable when the API server does not answer."""
        async def list_once() -> None:
            client = await self._api_client()
            async with client.ApiClient() as api:
                await self._list(api, client.CoreV1Api(api))

        try:
            asyncio.run(asyncio.wait_for(list_once(), self.request_timeout_s))
        except DeviceUnavailable:
            raise
        except Exception as e:
            self._error = f"{type(e).__name__}: {e}" if str(e) else "no answer from the API server"
            raise DeviceUnavailable(f"kubernetes device backend: could not list the cluster's nodes within "
                                    f"{self.request_timeout_s:g} s: {self._error}") from None

    async def _api_client(self):
        try:
            from kubernetes_asyncio import client, config
        except ImportError:
            raise DeviceUnavailable("kubernetes device backend: the 'kubernetes_asyncio' package is missing; "
                                    "install jupyter-gpulease[kube]") from None
        if self.kubeconfig or not os.environ.get("KUBERNETES_SERVICE_HOST"):
            await config.load_kube_config(config_file=self.kubeconfig, context=self.context)
        else:
            config.load_incluster_config()
        return client

    async def _follow(self) -> None:
        """List (where the last list is not fresh), then watch from its resourceVersion; again on
        any error, with a back-off up to a minute."""
        backoff = 1.0
        while True:
            try:
                client = await self._api_client()
                async with client.ApiClient() as api:
                    v1 = client.CoreV1Api(api)
                    if not self._resource_version or self._listed_at is None:
                        await self._list(api, v1)
                    backoff = 1.0
                    await self._watch(v1, api)
            except asyncio.CancelledError:
                raise
            except DeviceUnavailable as e:
                self._error = str(e)
            except Exception as e:
                self._error = f"{type(e).__name__}: {e}"
                log.warning("Kubernetes GPU pool: %s; retrying in %.0f s", self._error, backoff)
            self._resource_version = ""  # after an error: list again, then watch
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 60)

    async def _list(self, api, v1) -> None:
        resp = await v1.list_node(label_selector=self.label_selector, _preload_content=False,
                                  _request_timeout=self.request_timeout_s)
        doc = json.loads(await resp.read())
        slices = await self._list_slices(api) if self.dra else []
        with self._lock:
            self._nodes = {(n.get("metadata") or {}).get("name", ""): n for n in items_of(doc, "Node")}
            self._slices = slices
        self._resource_version = (doc.get("metadata") or {}).get("resourceVersion", "")
        self._error = ""
        self._listed_at = time.monotonic()

    async def _list_slices(self, api) -> list[dict]:
        from kubernetes_asyncio import client

        resp = await client.CustomObjectsApi(api).list_cluster_custom_object(
            "resource.k8s.io", "v1", "resourceslices", _preload_content=False, _request_timeout=self.request_timeout_s)
        return items_of(json.loads(await resp.read()), "ResourceSlice")

    async def _set_slices(self, api) -> None:
        slices = await self._list_slices(api)
        with self._lock:
            self._slices = slices

    async def _watch(self, v1, api) -> None:
        """Apply node events until the watch fails; re-list DRA slices every refresh period. A
        watch that ends normally (its server-side timeout) starts again from the last version."""
        from kubernetes_asyncio import watch
        from kubernetes_asyncio.client.exceptions import ApiException

        last_slices = time.monotonic()
        while True:
            w = watch.Watch()
            try:
                async with w.stream(v1.list_node, label_selector=self.label_selector, resource_version=self._resource_version,
                                    timeout_seconds=max(int(self.inventory_refresh_s * 4), 60),
                                    allow_watch_bookmarks=True) as stream:
                    async for event in stream:
                        kind, obj = event.get("type"), event.get("raw_object") or {}
                        self._resource_version = (obj.get("metadata") or {}).get("resourceVersion", self._resource_version)
                        with self._lock:
                            apply_node_event(self._nodes, kind, obj)
                        if self.dra and time.monotonic() - last_slices > self.inventory_refresh_s:
                            await self._set_slices(api)
                            last_slices = time.monotonic()
            except ApiException as e:
                if e.status == 410:  # our resourceVersion is too old: list again
                    self._listed_at = None
                    return
                raise
            if self.dra:
                await self._set_slices(api)
                last_slices = time.monotonic()
