"""GPULeaseDockerSpawner: GPU leases for servers in Docker containers (DockerSpawner).

The lease is asked for before the container starts; the container gets exactly the lease's GPUs,
and every later change of its leases (an end, a reclaim, a revoke, a kernel resumed onto another
GPU, a ``%gpu request`` from inside) changes what it may open **without restarting it**.

Docker cannot add a device to a running container, so every container is made with a node for
each GPU of the pool (and the driver's control nodes that exist on the host), all with
permission ``m`` only: the node exists inside, but opening it fails (EPERM). The container's own
device cgroup (cgroup v1, ``devices`` controller, found from its first process's
``/proc/<pid>/cgroup``) then allows the nodes of the server's leases: the hub's
:class:`~.cgroups.DeviceGuard` moves these rules as for local servers, through
:class:`ContainerDevices`. A container without a lease opens no GPU.

On hosts with NVIDIA's container toolkit (``gpu_device_requests``), the lease's GPUs also go in as
Docker's ``DeviceRequest`` with the leased UUIDs, which the toolkit reads to mount the driver's
libraries into the container; the toolkit acts only when the container starts, so the other GPUs
of the pool still come in as ``m``-only nodes, for a later lease.

Environments (``environments``): the admin's images, each with the CUDA version it needs and the
GPU models it suits; the spawn form shows them with the GPU choice, an image that needs a newer
driver than the host's is not offered (with the reason), and the form says whether an image is
on the host or how much its first start downloads. The image is pulled **before the lease is
asked for**, with its progress on the spawn page, so a lease's time limit never runs while its
image downloads; ``warm_images`` pulls every environment's image at hub start and on a schedule.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import socket
import time
from typing import Any

from docker.errors import APIError, ImageNotFound, NotFound
from dockerspawner import DockerSpawner
from traitlets import Bool, Dict, Enum, Float, List, TraitError, Unicode, default, observe, validate

from ..tasks import BackgroundTasks
from . import cgroups, devaccess
from .cgroups import DeviceStart, Mechanism, write_v1_rules
from .devaccess import DeviceNode
from .options import OptionsError
from .spawner import GPULeaseSpawner, spawn_error

DEVICE_REQUEST_MODES = ("auto", "always", "never")


# --------------------------------------------------------------------------- the lock in a container
def container_cgroup(pid: int, mount: str, *, proc: str = "/proc") -> str:
    """The v1 device cgroup folder of the container whose process is ``pid``."""
    with open(os.path.join(proc, str(int(pid)), "cgroup")) as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            if "devices" in controllers.split(","):
                return os.path.join(mount, path.lstrip("/"))
    raise OSError(f"process {pid} is in no v1 devices cgroup")


def container_device_args(nodes: list[DeviceNode], *, exists=os.path.exists) -> list[str]:
    """Docker's ``devices`` entries for ``nodes``: each node at its own path inside, permission
    ``m`` only (the node is there, opening it is up to the container's device cgroup). Nodes the
    host does not have (a driver without nvidia-uvm) are left out."""
    out = []
    for n in dict.fromkeys(nodes):
        if n.resolved and exists(n.path):
            out.append(f"{n.path}:{n.path}:m")
    return out


class ContainerDevices:
    """The device guard's backend for containers: each server's rules written into its
    container's own device cgroup (cgroup v1). See :class:`~.cgroups.V1Devices` for the
    interface; ``mount`` is the v1 devices controller's mount point."""

    kind = "docker"

    def __init__(self, mount: str, *, proc: str = "/proc"):
        self.mount = mount
        self.proc = proc
        self.rules: dict[str, tuple[list[DeviceNode], list[DeviceNode]]] = {}  # server -> its rules now
        self.cgroups: dict[str, tuple[int, str]] = {}  # server -> (its container's first pid, cgroup folder)

    def start(self, name: str, allowed: list[DeviceNode], denied: list[DeviceNode], unit: Any = None) -> DeviceStart:
        """The container about to be made: every node of the pool, ``m`` only (its rules follow
        once it runs, :meth:`attach`)."""
        self.rules[name] = (list(allowed), list(denied))
        self.cgroups.pop(name, None)
        return DeviceStart(devices=tuple(container_device_args([*allowed, *denied])))

    def apply(self, name: str, allowed: list[DeviceNode], denied: list[DeviceNode]) -> None:
        self.rules[name] = (list(allowed), list(denied))
        found = self.cgroups.get(name)
        if found is not None:
            write_v1_rules(found[1], allowed, denied)

    def adopt(self, name: str, allowed: list[DeviceNode], denied: list[DeviceNode], unit: Any = None) -> None:
        """A running container, again (the hub restarted): its rules are written once its process
        is known (:meth:`attach`, which the guard calls as :meth:`holds` says no)."""
        self.rules[name] = (list(allowed), list(denied))

    def retire(self, name: str, denied: list[DeviceNode]) -> None:
        found = self.cgroups.get(name)
        if found is not None and os.path.isdir(found[1]):
            self.apply(name, [], denied)

    def attach(self, name: str, pid: int) -> None:
        """The container runs, its first process is ``pid``: its cgroup, with the rules now."""
        path = container_cgroup(pid, self.mount, proc=self.proc)
        self.cgroups[name] = (int(pid), path)
        allowed, denied = self.rules.get(name, ([], []))
        write_v1_rules(path, allowed, denied)

    def holds(self, name: str, pid: int) -> bool:
        found = self.cgroups.get(name)
        return found is not None and found[0] == int(pid)

    def remove(self, name: str) -> bool:
        self.cgroups.pop(name, None)
        self.rules.pop(name, None)
        return True  # Docker removes the container's cgroup with it


def detect_containers(*, mountinfo: str = cgroups.MOUNTINFO, euid: int | None = None) -> Mechanism:
    """How this host locks containers to their leases: the v1 devices controller, as root."""
    euid = os.geteuid() if euid is None else euid
    mount = cgroups.v1_devices_mount(mountinfo)
    if mount is None:
        return Mechanism("none", "no cgroup v1 devices controller is mounted (on cgroup v2 Docker keeps a container's "
                                 "device rules in a BPF program of its own, which nothing else may change)")
    if euid != 0:
        return Mechanism("none", f"writing containers' device cgroups at {mount} needs root (the hub runs as uid {euid})")
    return Mechanism(ContainerDevices.kind, f"each container's own device cgroup (cgroup v1 at {mount})", ContainerDevices(mount))


def split_reference(image: str) -> tuple[str, str]:
    """``(repository, tag or digest)`` as Docker's pull takes them (``latest`` when none)."""
    if "@" in image:
        repo, digest = image.split("@", 1)
        return repo, digest
    if ":" in image.rsplit("/", 1)[-1]:
        repo, tag = image.rsplit(":", 1)
        return repo, tag
    return image, "latest"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --------------------------------------------------------------------------- the spawner
class GPULeaseDockerSpawner(GPULeaseSpawner, DockerSpawner):
    """DockerSpawner with GPU leases (entry point ``gpulease-docker``): the lease's GPUs open in the
    container, and only they, for as long as the lease holds them."""

    enforces_devices = True

    environments = List(
        Dict(),
        help="""The images users choose from on the spawn form, each a dict: ``name`` (a slug),
        ``display_name``, ``image`` (a Docker reference), ``cuda`` (the CUDA version the image
        needs, "12.4"; empty for none), ``models`` (glob patterns of the GPU models it suits;
        empty: any), ``description``, ``size_bytes`` (its download size, where the registry cannot
        be asked), ``default`` (checked on the form). An image that needs a newer CUDA than the
        host's driver supports is not offered. Empty: the spawner's ``image`` for everyone, no
        choice. Example::

            [{"name": "torch", "display_name": "PyTorch 2.5", "image": "lab/torch:2.5-cuda12.4",
              "cuda": "12.4", "default": True},
             {"name": "jax", "display_name": "JAX", "image": "lab/jax:0.4-cuda12.8", "cuda": "12.8",
              "models": ["H100*", "H200*"]}]""",
    ).tag(config=True)

    gpu_device_requests = Enum(
        DEVICE_REQUEST_MODES,
        "auto",
        help="""Give the lease's GPUs to the container as Docker ``DeviceRequest`` s with their
        UUIDs as well (what NVIDIA's container toolkit reads to mount the driver's libraries):
        ``"auto"``: where the Docker daemon has the ``nvidia`` runtime; ``"always"``; ``"never"``
        (device nodes only: the image brings the driver's user-space libraries itself, or the
        pool is simulated).""",
    ).tag(config=True)

    docker_node = Unicode(
        "",
        help="""The name of this Docker host in the broker's pool (its GPUs' ``node``), for the
        driver check of environments. Empty: the pool's only node, or this host's name.""",
    ).tag(config=True)

    warm_images = Bool(
        True,
        help="""Pull every environment's image when the hub starts and every
        ``image_refresh_interval`` seconds, so first starts do not wait for a download (like
        Zero to JupyterHub's image puller).""",
    ).tag(config=True)

    image_refresh_interval = Float(
        6 * 3600.0,
        help="Seconds between two pulls of the environments' images (``warm_images``); 0: at hub start only.",
    ).tag(config=True)

    @default("remove")
    def _default_remove(self):
        # a container is made for each start: its device nodes and, on NVIDIA hosts, its device
        # requests come from the lease of that start, never from an earlier one
        return True

    @default("use_internal_ip")
    def _default_use_internal_ip(self):
        # on the host's network a container has no port of its own to publish: its server listens
        # on a port of the host (one per server, chosen at each start), reached on 127.0.0.1
        return self.network_name != "bridge"

    @default("ip")
    def _default_ip(self):
        return "127.0.0.1" if self.network_name == "host" else "0.0.0.0"

    @observe("image")
    def _image_changed(self, change):
        # DockerSpawner renders the container's name again when the image changes, which needs a
        # user; the hub's start-up check of the broker makes a spawner from the config alone
        if self.user is not None:
            super()._image_changed(change)

    @validate("environments")
    def _check_environments(self, proposal):
        from .environments import parse_environments

        try:
            parse_environments(proposal.value)
        except ValueError as e:
            raise TraitError(f"GPULeaseDockerSpawner.environments: {e}") from None
        return proposal.value

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._container_pid = 0
        self._host_port = 0
        self._environment = None
        self._device_requests: list[dict] = []
        self._static_devices: list[str] = []  # enforce_devices = "off": the lease's nodes, open from the start

    # ------------------------------------------------------------------ environments
    @property
    def environment_list(self):
        from .environments import parse_environments

        return parse_environments(self.environments)

    def lease_choice(self, user_options, pool=None):
        # the environment is this engine's option; the lease's options are the rest
        opts = dict(user_options or {})
        opts.pop("environment", None)
        return super().lease_choice(opts, pool)

    async def _driver_of_host(self, pool: dict | None) -> tuple[str | None, str]:
        devices = (pool or {}).get("devices") or []
        nodes = sorted({d.get("node") for d in devices if d.get("node")})
        node = self.docker_node or (nodes[0] if len(nodes) == 1 else socket.gethostname())
        mine = [d for d in devices if d.get("node") == node]
        cuda = next((d.get("cuda_version") for d in mine if d.get("cuda_version")), None)
        version = next((d.get("driver_version") for d in mine if d.get("driver_version")), "")
        return cuda, version

    async def images_present(self) -> set[str]:
        """The environments' images this Docker host holds now."""
        present = set()
        for env in self.environment_list:
            try:
                await self.docker("inspect_image", env.image)
                present.add(env.image)
            except (ImageNotFound, NotFound):
                pass
            except APIError as e:
                self.log.debug("Image %s: %s", env.image, e)
        return present

    async def environment_offers(self, pool: dict | None, model: str | None = None):
        from .environments import offers, registry_download_size

        envs = self.environment_list
        if not envs:
            return None
        cuda, version = await self._driver_of_host(pool)
        present = await self.images_present()
        sizes: dict[str, int] = {}
        missing = [e for e in envs if e.image not in present]
        got = await asyncio.gather(*(registry_download_size(e.image) for e in missing))
        for e, size in zip(missing, got, strict=True):
            if size:
                sizes[e.image] = size
        return offers(envs, driver_cuda=cuda, driver_version=version, present=present, sizes=sizes, model=model)

    async def render_options_form(self) -> str:
        from . import form as spawn_form

        if not self.environments:
            return await super().render_options_form()
        orm_spawner = self.orm_spawner
        previous = dict((orm_spawner.user_options if orm_spawner is not None else self.user_options) or {})
        pool = None
        if self.broker_url:
            try:
                pool = await self.fetch_pool()
            except Exception as e:
                self.log.warning("Spawn form of %s: the pool for the environments' driver check: %s", self._log_name, e)
        return await spawn_form.render_for(
            self.broker if self.broker_url else None,
            user=self.user.name,
            groups=self._user_groups(),
            presets=self.presets,
            allow_custom=self.allow_custom_request,
            allow_cpu_only=self.allow_cpu_only,
            previous=previous,
            log=self.log,
            environments=await self.environment_offers(pool),
        )

    async def _choose_environment(self):
        """The spawn's environment (checked against the host's driver and the GPU model asked
        for), or None where the admin lists none."""
        from .environments import check_choice

        envs = self.environment_list
        if not envs:
            return None
        opts = self.user_options or {}
        choice = self.lease_choice(opts)
        model = ((choice.request or {}).get("model") or None) if choice.request else None
        if isinstance(model, list | tuple):
            model = model[0] if len(model) == 1 else None
        pool = None
        if self.broker_url:
            try:
                pool = await self.fetch_pool()
            except Exception as e:
                self.log.warning("Environment check of %s without the pool: %s", self._log_name, e)
        cuda, version = await self._driver_of_host(pool)
        try:
            return check_choice(envs, opts.get("environment") or "", model=model, driver_cuda=cuda,
                                driver_version=version, cpu_only=choice.cpu_only)
        except OptionsError as e:
            raise spawn_error(f"Invalid environment: {e.message}", reason="gpulease_options") from None

    async def before_lease_request(self) -> None:
        devices = self._server_devices()
        if devices is not None and not devices.guard.active and not self.lease_choice(self.user_options).cpu_only:
            # without the lock a container would keep its GPUs after its lease: no GPU containers
            raise spawn_error("GPU servers cannot start on this Docker host: the hub cannot keep a container to its "
                              f"lease's GPUs here ({devices.guard.mechanism.why}). Choose a CPU-only server, or ask the "
                              "administrator.", reason="gpulease_devices", status_code=500)
        env = self._environment = await self._choose_environment()
        if env is not None:
            self.image = env.image
        await self.pull_with_progress(self.image)

    async def pull_with_progress(self, image: str) -> None:
        """Pull ``image`` where this host lacks it (DockerSpawner's ``pull_policy``), each step on
        the spawn page; before the lease is asked for, so the download costs no lease time."""
        from .environments import PullProgress, image_parts

        if self.pull_policy.lower() == "skip":
            return
        if self.pull_policy.lower() != "always":
            try:
                await self.docker("inspect_image", image)
                return
            except (ImageNotFound, NotFound):
                if self.pull_policy.lower() == "never":
                    raise spawn_error(f"The image {image} is not on this host and the hub does not pull images "
                                      "(pull_policy = 'never'); tell the administrator.", reason="gpulease_image",
                                      status_code=500) from None
        repo, tag = split_reference(image)
        progress = PullProgress(image_parts(image)[1])
        self.emit_progress(f"Downloading the image {image}: starting", 2)
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        def pull() -> None:
            try:
                for event in self.client.pull(repo, tag=tag, stream=True, decode=True):
                    loop.call_soon_threadsafe(queue.put_nowait, event)
            except Exception as e:  # reported on the page below
                loop.call_soon_threadsafe(queue.put_nowait, {"error": str(e)})
            finally:
                loop.call_soon_threadsafe(queue.put_nowait, None)

        started = time.monotonic()
        task = loop.run_in_executor(self.executor, pull)
        while True:
            event = await queue.get()
            if event is None:
                break
            message = progress.feed(event)
            if message:
                self.emit_progress(message, 2 + int(3 * (progress.percent or 0) / 100))
        await task
        if progress.error:
            raise spawn_error(f"Could not download the image {image}: {progress.error}", reason="gpulease_image",
                              status_code=500)
        self.log.info("%s: pulled %s in %.1f s", self._log_name, image, time.monotonic() - started)
        self.emit_progress(f"Downloaded the image {image} in {time.monotonic() - started:.0f} s", 5)

    async def pull_image(self, image):
        # the image was pulled before the lease (pull_with_progress); DockerSpawner's own pull
        # (without progress) would only look again
        return

    # ------------------------------------------------------------------ the lease becomes the container
    def _use_device_requests(self) -> bool:
        if self.gpu_device_requests != "auto":
            return self.gpu_device_requests == "always"
        try:
            return "nvidia" in (self.client.info().get("Runtimes") or {})
        except Exception as e:
            self.log.debug("docker info: %s", e)
            return False

    def apply_placement(self, lease: dict) -> None:
        super().apply_placement(lease)
        slices = (lease.get("placement") or {}).get("slices") or []
        uuids = list(dict.fromkeys(s.get("mig_uuid") or s["gpu_uuid"] for s in slices))
        self._device_requests = []
        if uuids and self._use_device_requests():
            self._device_requests = [{"Driver": "nvidia", "DeviceIDs": uuids, "Capabilities": [["gpu"]]}]
        self._lease_env["GPULEASE_ENGINE"] = "docker"
        self._static_devices = []
        if self.enforce_devices == "off":
            # no lock: the lease's nodes open from the start, and stay open until the container stops
            nodes = devaccess.pool_gpu_nodes(self._spawn_pool or {}, stat=os.stat)
            allowed = devaccess.lease_nodes(lease, nodes, uvm=devaccess.uvm_major())
            self._static_devices = [f"{n.path}:{n.path}:rwm" for n in allowed if n.resolved and os.path.exists(n.path)]

    async def start(self):
        self._device_requests = []
        self._static_devices = []
        self._container_pid = 0
        if self.network_name == "host":
            # every container shares the host's ports: each server its own
            self._host_port = self.port = free_port()
        return await super().start()

    async def create_object(self):
        # DockerSpawner has no hook for one start's host config: create_object() reads
        # extra_host_config (the admin's) and builds the container in one step; so the devices of
        # this start go into that trait for the call, and the admin's value is back after it
        # (tests/test_docker_spawner.py runs it through DockerSpawner's own create_object()).
        admin = self.extra_host_config
        extra = admin(self) if callable(admin) else admin
        if inspect.isawaitable(extra):
            extra = await extra
        extra = dict(extra or {})
        devices = [*(extra.get("devices") or []), *(self.device_start.devices or self._static_devices)]
        if devices:
            extra["devices"] = devices
        if self._device_requests:
            extra["device_requests"] = [*(extra.get("device_requests") or []), *self._device_requests]
        self.extra_host_config = extra
        try:
            return await super().create_object()
        finally:
            self.extra_host_config = admin

    async def start_object(self):
        await super().start_object()
        info = await self.docker("inspect_container", self.container_id)
        self._container_pid = int((info.get("State") or {}).get("Pid") or 0)

    async def get_object(self):
        obj = await super().get_object()
        if obj is not None:
            state = obj.get("State") or {}
            self._container_pid = int(state.get("Pid") or 0) if state.get("Running") else 0
        return obj

    async def get_ip_and_port(self):
        if self.network_name == "host":
            return "127.0.0.1", self.port
        return await super().get_ip_and_port()

    def get_state(self):
        state = super().get_state()
        if self.network_name == "host" and self.object_id and self.port:
            state["host_port"] = self.port
        return state

    def load_state(self, state):
        super().load_state(state)
        if (state or {}).get("host_port"):
            self.port = int(state["host_port"])

    def _engine_pid(self) -> int:
        return self._container_pid

    # ------------------------------------------------------------------ device access
    def find_device_mechanism(self) -> Mechanism:
        return detect_containers()

    @classmethod
    def log_device_access_at_hub_start(cls, hub) -> None:
        mode = cgroups._config_value(cls, hub.config, "enforce_devices")
        mech = Mechanism("none", "off") if mode == "off" else detect_containers()
        line = cgroups.hub_start_line(mode, mech)
        (hub.log.warning if mech.kind == "none" and mode != "off" else hub.log.info)(line)

    @classmethod
    def device_access_at_hub_stop(cls, hub) -> None:
        pass  # a container's device cgroup goes with the container

    @classmethod
    def engine_at_hub_start(cls, hub) -> None:
        if not cgroups._config_value(cls, hub.config, "warm_images"):
            return
        images = []
        from .environments import parse_environments

        for env in parse_environments(cgroups._config_value(cls, hub.config, "environments") or []):
            images.append(env.image)
        if not images:
            return
        puller = ImagePuller(dict(cgroups._config_value(cls, hub.config, "client_kwargs") or {}), images,
                             interval=float(cgroups._config_value(cls, hub.config, "image_refresh_interval")),
                             logger=hub.log)
        puller.start()
        hub.gpulease_image_puller = puller  # referenced for the hub's life


class ImagePuller:
    """Keeps images on the Docker host warm: pulls each now and every ``interval`` seconds (0:
    once), one at a time, off the event loop."""

    def __init__(self, client_kwargs: dict, images: list[str], *, interval: float = 6 * 3600.0, logger=None):
        import logging

        self.client_kwargs = client_kwargs
        self.images = list(dict.fromkeys(images))
        self.interval = interval
        self.log = logger or logging.getLogger(__name__)
        self.pulled: dict[str, float] = {}  # image -> when its last pull ended (monotonic)
        self._tasks = BackgroundTasks(self.log)
        self.task: asyncio.Task | None = None

    def start(self) -> asyncio.Task:
        """Start pulling, on the running loop (the hub's); returns the task."""
        self.task = self._tasks.start(self.run(), what="keeping the environments' images warm")
        return self.task

    def _client(self):
        import docker

        kw = dict(self.client_kwargs)
        kw.setdefault("version", "auto")
        return docker.APIClient(**kw) if kw.get("base_url") else docker.APIClient(version="auto")

    def pull(self, image: str) -> None:
        repo, tag = split_reference(image)
        for event in self._client().pull(repo, tag=tag, stream=True, decode=True):
            if "error" in event:
                raise RuntimeError(event["error"])

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            for image in self.images:
                started = time.monotonic()
                try:
                    await loop.run_in_executor(None, self.pull, image)
                    self.pulled[image] = time.monotonic()
                    self.log.info("Image %s is on this host (pulled in %.1f s)", image, time.monotonic() - started)
                except Exception as e:
                    self.log.warning("Could not pull the image %s to keep it warm: %s", image, e)
            if self.interval <= 0:
                return
            await asyncio.sleep(self.interval)


