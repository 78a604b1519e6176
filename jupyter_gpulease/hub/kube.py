"""GPULeaseKubeSpawner: on Kubernetes, the lease's placement becomes the pod.

KubeSpawner builds the pod; :func:`pod_gpu_spec` turns a granted lease into what that pod must
ask for, and :func:`apply_gpu_spec` writes it into the pod KubeSpawner made:

* **the node** — a required node affinity on ``metadata.name`` (the default; it goes through the
  scheduler, so taints and capacity still count), or a ``kubernetes.io/hostname`` node selector,
  or ``spec.nodeName`` (``node_pinning``). The term is ANDed into every node-selector term the
  admin configured, so pinning never widens where a pod may go.
* **the GPU model** — a ``nvidia.com/gpu.product`` node affinity on the label values GPU feature
  discovery gives that model (with ``-SHARED`` under time-slicing/MPS and ``-MIG-<profile>``
  under the single MIG strategy).
* **the devices** — whole GPUs as ``nvidia.com/gpu``; MIG instances as
  ``nvidia.com/mig-<profile>`` (``mig_strategy="mixed"``) or ``nvidia.com/gpu`` (``"single"``);
  shares the way the cluster offers them (``gpu_share_mode``): one time-slicing/MPS replica of
  ``shared_gpu_resource`` (``"replicas"``), or HAMi's ``nvidia.com/gpumem`` (MiB) and
  ``nvidia.com/gpucores`` (percent) (``"hami"``; whole GPUs then ask for 100% so HAMi keeps
  them exclusive). With ``use_dra`` (Kubernetes ≥ 1.34 with NVIDIA's DRA driver, and the
  ``kubernetes`` device backend reading ResourceSlices) whole GPUs and MIG instances are a
  ResourceClaim whose CEL selectors name the leased devices' UUIDs: the pod gets exactly them.
* **tolerations** for GPU nodes' taints (``gpu_tolerations``), only on pods that hold a lease.

Where the device plugin (not a claim, not HAMi's UUID annotation) picks the device inside the
node, the leased UUIDs are the broker's names, not the driver's: the pod then gets no
``CUDA_VISIBLE_DEVICES`` (the container sees exactly its allocated devices) and
``GPULEASE_DEVICE_CHOICE=engine``. A CPU-only pod gets ``NVIDIA_VISIBLE_DEVICES=void`` so that an
image with ``NVIDIA_VISIBLE_DEVICES=all`` (every CUDA base image) sees no GPU on a GPU node.

Containers' devices are fixed when the pod starts: a lease that ends stops the server (after
the broker's warning), whatever ``on_lease_end`` says.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from kubernetes_asyncio import client as k8s_client
from kubernetes_asyncio.client import models as k8s
from kubernetes_asyncio.client.exceptions import ApiException
from kubespawner import KubeSpawner
from traitlets import Bool, Enum, List, Unicode

from ..devices.kubenodes import UUID_PREFIX, product_label_values
from .spawner import GPULeaseSpawner, spawn_error
from .spawner_settings import stop_at_lease_end

SHARE_MODES = ("replicas", "hami", "none")
MIG_STRATEGIES = ("mixed", "single")
NODE_PINNING = ("affinity", "hostname", "node_name")
GPU_TOLERATION = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
CLAIM_NAME = "gpulease-gpus"  # the pod's name for its ResourceClaim
LEASE_ANNOTATION = "gpulease.jupyter.org/lease-id"
HAMI_UUID_ANNOTATION = "nvidia.com/use-gpuuuid"


class PlacementError(ValueError):
    """A lease this cluster setup cannot express as a pod (a share where shares are off…)."""


@dataclass(frozen=True)
class KubeGPUOptions:
    """The admin's choices about how leases map onto pods (the spawner's traits, as data)."""

    share_mode: str = "replicas"
    shared_resource: str = "nvidia.com/gpu"
    mig_strategy: str = "mixed"
    dra: bool = False
    dra_gpu_class: str = "gpu.nvidia.com"
    dra_mig_class: str = "mig.nvidia.com"
    dra_driver: str = "gpu.nvidia.com"
    tolerations: tuple[dict, ...] = (GPU_TOLERATION,)
    select_product: bool = True
    scheduler_name: str = ""


@dataclass(frozen=True)
class PodGPUSpec:
    """What one lease adds to a pod. Empty (``node == ""``) for a CPU-only server."""

    node: str = ""
    resources: dict[str, str] = field(default_factory=dict)  # extended resource -> quantity (limits = requests)
    product_values: tuple[str, ...] = ()  # allowed nvidia.com/gpu.product values
    tolerations: tuple[dict, ...] = ()
    annotations: dict[str, str] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)  # set in the notebook container
    drop_env: tuple[str, ...] = ()  # removed from it
    claim: dict | None = None  # a ResourceClaim manifest to create before the pod (DRA)
    scheduler_name: str = ""


def _engine_named(uuid: str) -> bool:
    """True for UUIDs the broker made up (``GPU-k8s-…``), which no driver knows."""
    return uuid.startswith((f"GPU-{UUID_PREFIX}-", f"MIG-{UUID_PREFIX}-"))


def resource_claim(name: str, namespace: str, slices: list[dict], opts: KubeGPUOptions, *, lease_id: str = "",
                   labels: dict[str, str] | None = None) -> dict:
    """A ``resource.k8s.io/v1`` ResourceClaim that allocates exactly the leased devices, by UUID."""
    requests = []
    for i, s in enumerate(slices):
        uuid = s.get("mig_uuid") or s["gpu_uuid"]
        requests.append({
            "name": f"gpu-{i}",
            "exactly": {
                "deviceClassName": opts.dra_mig_class if s.get("mig_uuid") else opts.dra_gpu_class,
                "allocationMode": "ExactCount",
                "count": 1,
                "selectors": [{"cel": {"expression": f'device.attributes["{opts.dra_driver}"].uuid == "{uuid}"'}}],
            },
        })
    meta: dict[str, Any] = {"name": name, "namespace": namespace}
    if labels:
        meta["labels"] = dict(labels)
    if lease_id:
        meta["annotations"] = {LEASE_ANNOTATION: lease_id}
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": meta, "spec": {"devices": {"requests": requests}}}


def pod_gpu_spec(lease: dict, opts: KubeGPUOptions, *, claim_name: str = "", namespace: str = "default",
                 labels: dict[str, str] | None = None) -> PodGPUSpec:
    """What the pod of a server holding the active ``lease`` (broker lease JSON) must ask for.

    Raises :class:`PlacementError` with a message for the spawn page when this cluster setup
    cannot give the lease (a share with ``share_mode="none"``).
    """
    placement = lease.get("placement") or {}
    slices = list(placement.get("slices") or [])
    if not slices:
        raise PlacementError(f"lease {lease.get('id')} has no placement (state {lease.get('state')!r})")
    node = placement.get("node") or slices[0]["node"]
    model = slices[0]["model"]
    lease_id = str(lease.get("id") or "")
    mig = [s for s in slices if s.get("mig_uuid")]
    shares = [s for s in slices if not s.get("mig_uuid") and float(s.get("share", 1)) < 1]
    resources: dict[str, str] = {}
    annotations: dict[str, str] = {LEASE_ANNOTATION: lease_id} if lease_id else {}
    claim = None
    exact = False  # the pod gets exactly the leased devices (their UUIDs are the driver's)
    shared = False
    mig_profile = ""

    if mig:
        profile = mig[0].get("mig_profile") or ""
        if opts.dra and not any(_engine_named(s["mig_uuid"]) for s in mig):
            claim, exact = resource_claim(claim_name, namespace, mig, opts, lease_id=lease_id, labels=labels), True
        elif opts.mig_strategy == "single":
            resources["nvidia.com/gpu"] = str(len(mig))
            mig_profile = profile
        else:
            resources[f"nvidia.com/mig-{profile}"] = str(len(mig))
    elif shares:
        s = shares[0]
        share, memory = float(s.get("share", 1)), int(s["memory_mib"])
        if opts.share_mode == "hami":
            resources.update({"nvidia.com/gpu": "1", "nvidia.com/gpumem": str(memory),
                              "nvidia.com/gpucores": str(max(1, min(100, round(share * 100))))})
            if not _engine_named(s["gpu_uuid"]):
                annotations[HAMI_UUID_ANNOTATION] = s["gpu_uuid"]
                exact = True
        elif opts.share_mode == "replicas":
            resources[opts.shared_resource] = "1"
            shared = True
        else:
            raise PlacementError(f"This hub does not offer shares of a GPU on Kubernetes (lease {lease_id} is a "
                                 f"{share:g} share); ask for a whole GPU or a MIG profile, or ask the administrator "
                                 "to set GPULeaseKubeSpawner.gpu_share_mode.")
    else:
        if opts.dra and not any(_engine_named(s["gpu_uuid"]) for s in slices):
            claim, exact = resource_claim(claim_name, namespace, slices, opts, lease_id=lease_id, labels=labels), True
        elif opts.share_mode == "hami":
            resources.update({"nvidia.com/gpu": str(len(slices)), "nvidia.com/gpucores": "100", "nvidia.com/gpumem-percentage": "100"})
            if not any(_engine_named(s["gpu_uuid"]) for s in slices):
                annotations[HAMI_UUID_ANNOTATION] = ",".join(s["gpu_uuid"] for s in slices)
                exact = True
        else:
            resources["nvidia.com/gpu"] = str(len(slices))

    # the engine fixes the devices when the pod starts: a lease that ends stops the server
    env = {"GPULEASE_DEVICE_CHOICE": "broker" if exact else "engine", "GPULEASE_ENGINE": "kubernetes"}
    drop = () if exact else ("CUDA_VISIBLE_DEVICES",)
    # the model by GFD's product label where the device plugin picks the GPU; a claim or HAMi's
    # UUID annotation names the device itself (and HAMi nodes often run no GFD)
    by_product = opts.select_product and model and not exact and opts.share_mode != "hami"
    products = product_label_values(model, mig_profile=mig_profile, shared=shared) if by_product else ()
    return PodGPUSpec(node=node, resources=resources, product_values=products, tolerations=tuple(opts.tolerations),
                      annotations=annotations, env=env, drop_env=drop, claim=claim,
                      scheduler_name=opts.scheduler_name)


# --------------------------------------------------------------------------- the pod object
def _get(obj: Any, name: str) -> Any:
    return obj.get(name) if isinstance(obj, dict) else getattr(obj, name, None)


def apply_gpu_spec(pod, spec: PodGPUSpec, *, pinning: str = "affinity", hide_gpus: bool = True):
    """Write ``spec`` into a pod from KubeSpawner's ``make_pod`` (kubernetes_asyncio models); returns it."""
    container = pod.spec.containers[0]
    env = [e for e in (container.env or []) if e.name not in spec.drop_env and e.name not in spec.env]
    env += [k8s.V1EnvVar(name=k, value=v) for k, v in spec.env.items()]
    if not spec.node:  # CPU only
        if hide_gpus:
            env = [e for e in env if e.name != "NVIDIA_VISIBLE_DEVICES"] + [k8s.V1EnvVar(name="NVIDIA_VISIBLE_DEVICES", value="void")]
        container.env = env
        return pod
    container.env = env

    res = container.resources or k8s.V1ResourceRequirements()
    res.limits = {**(res.limits or {}), **spec.resources}
    res.requests = {**(res.requests or {}), **spec.resources}  # extended resources: requests must equal limits
    if spec.claim is not None:
        res.claims = [*(c for c in (res.claims or []) if _get(c, "name") != CLAIM_NAME), k8s.CoreV1ResourceClaim(name=CLAIM_NAME)]
        pod.spec.resource_claims = [*(c for c in (pod.spec.resource_claims or []) if _get(c, "name") != CLAIM_NAME),
                                    k8s.V1PodResourceClaim(name=CLAIM_NAME, resource_claim_name=spec.claim["metadata"]["name"])]
    container.resources = res

    # where: ANDed into every required node-selector term (terms are ORed by Kubernetes)
    fields, exprs = [], []
    if pinning == "affinity":
        fields.append(k8s.V1NodeSelectorRequirement(key="metadata.name", operator="In", values=[spec.node]))
    elif pinning == "hostname":
        pod.spec.node_selector = {**(pod.spec.node_selector or {}), "kubernetes.io/hostname": spec.node}
    elif pinning == "node_name":
        pod.spec.node_name = spec.node
    else:
        raise ValueError(f"node pinning must be one of {', '.join(NODE_PINNING)}, got {pinning!r}")
    if spec.product_values:
        exprs.append(k8s.V1NodeSelectorRequirement(key="nvidia.com/gpu.product", operator="In", values=list(spec.product_values)))
    if fields or exprs:
        affinity = pod.spec.affinity or k8s.V1Affinity()
        na = affinity.node_affinity or k8s.V1NodeAffinity()
        required = na.required_during_scheduling_ignored_during_execution or k8s.V1NodeSelector(node_selector_terms=[])
        terms = list(required.node_selector_terms or []) or [k8s.V1NodeSelectorTerm()]
        new_terms = []
        for term in terms:
            t = term
            if isinstance(term, dict):  # KubeSpawner passes configured terms through as dicts
                t = k8s.V1NodeSelectorTerm(match_expressions=term.get("matchExpressions") or term.get("match_expressions"),
                                           match_fields=term.get("matchFields") or term.get("match_fields"))
            t.match_fields = [*(t.match_fields or []), *fields] or None
            t.match_expressions = [*(t.match_expressions or []), *exprs] or None
            new_terms.append(t)
        required.node_selector_terms = new_terms
        na.required_during_scheduling_ignored_during_execution = required
        affinity.node_affinity = na
        pod.spec.affinity = affinity

    have = {(_get(t, "key"), _get(t, "operator"), _get(t, "value"), _get(t, "effect")) for t in (pod.spec.tolerations or [])}
    tolerations = list(pod.spec.tolerations or [])
    for t in spec.tolerations:
        key = (t.get("key"), t.get("operator"), t.get("value"), t.get("effect"))
        if key not in have:
            tolerations.append(k8s.V1Toleration(key=t.get("key"), operator=t.get("operator"), value=t.get("value"),
                                                effect=t.get("effect"), toleration_seconds=t.get("tolerationSeconds")))
            have.add(key)
    pod.spec.tolerations = tolerations or None
    if spec.annotations:
        pod.metadata.annotations = {**(pod.metadata.annotations or {}), **spec.annotations}
    if spec.scheduler_name:
        pod.spec.scheduler_name = spec.scheduler_name
    return pod


# --------------------------------------------------------------------------- the spawner
class GPULeaseKubeSpawner(GPULeaseSpawner, KubeSpawner):
    """KubeSpawner with GPU leases (entry point ``gpulease-kube``): the lease's placement becomes the pod."""

    server_changes_gpus = False  # a pod keeps the devices it was given

    gpu_share_mode = Enum(
        SHARE_MODES,
        "replicas",
        help="""How the cluster shares one GPU between pods, so a share lease asks for the right thing:

        - ``"replicas"``: NVIDIA's device plugin with time-slicing or MPS; a share is one replica
          of ``shared_gpu_resource``. Offer shares that match the replicas (with 4 replicas per
          GPU, a 0.25 share); MPS limits each replica to its part of memory and compute,
          time-slicing limits nothing.
        - ``"hami"``: HAMi; a share asks for ``nvidia.com/gpumem`` (its memory, MiB) and
          ``nvidia.com/gpucores`` (its compute share in percent), a whole GPU for 100% of both.
        - ``"none"``: the cluster cannot share GPUs; share requests fail at once with a message.

        Example: ``"hami"``.""",
    ).tag(config=True)

    shared_gpu_resource = Unicode(
        "nvidia.com/gpu",
        help="""Extended resource of one GPU replica, for ``gpu_share_mode="replicas"``:
        ``"nvidia.com/gpu"`` (the device plugin's default) or ``"nvidia.com/gpu.shared"`` when
        its sharing config sets ``renameByDefault: true``.""",
    ).tag(config=True)

    mig_strategy = Enum(
        MIG_STRATEGIES,
        "mixed",
        help="""The NVIDIA device plugin's MIG strategy: ``"mixed"`` (a MIG lease asks for
        ``nvidia.com/mig-<profile>``) or ``"single"`` (it asks for ``nvidia.com/gpu`` on nodes
        whose product label names the profile).""",
    ).tag(config=True)

    use_dra = Bool(
        False,
        help="""Pin the exact leased GPUs and MIG instances with a ResourceClaim (Dynamic Resource
        Allocation, Kubernetes 1.34 or newer, NVIDIA's DRA driver for GPUs). Needs the broker's
        ``kubernetes`` device backend with ``"dra": true`` (so leases carry the devices' real
        UUIDs) and RBAC for the hub to create and delete ``resourceclaims`` in the namespace.
        Shares still use ``gpu_share_mode``.""",
    ).tag(config=True)

    dra_device_class = Unicode("gpu.nvidia.com", help="DeviceClass of whole GPUs for ``use_dra``.").tag(config=True)
    dra_mig_device_class = Unicode("mig.nvidia.com", help="DeviceClass of MIG instances for ``use_dra``.").tag(config=True)
    dra_driver = Unicode("gpu.nvidia.com", help="DRA driver whose ``uuid`` attribute the claim's selectors match.").tag(config=True)

    node_pinning = Enum(
        NODE_PINNING,
        "affinity",
        help="""How the pod is kept on the leased node: ``"affinity"`` (a required node affinity on
        ``metadata.name``; the scheduler still checks taints and room), ``"hostname"`` (a node
        selector on the ``kubernetes.io/hostname`` label, for clusters where it equals the node
        name) or ``"node_name"`` (``spec.nodeName``: skips the scheduler).""",
    ).tag(config=True)

    gpu_tolerations = List(
        [dict(GPU_TOLERATION)],
        help="""Tolerations added to pods that hold a lease, for GPU nodes' taints. Default: the
        GPU operator's ``nvidia.com/gpu:NoSchedule`` (GKE adds the same taint). Example:
        ``[{"key": "sku", "operator": "Equal", "value": "gpu", "effect": "NoSchedule"}]`` (AKS).""",
    ).tag(config=True)

    select_gpu_product = Bool(
        True,
        help="Require the leased GPU model through the ``nvidia.com/gpu.product`` label (GPU feature discovery).",
    ).tag(config=True)

    gpu_scheduler_name = Unicode(
        "",
        help="""Scheduler for pods that hold a lease, e.g. ``"hami-scheduler"`` where HAMi's
        webhook does not set it. Empty: the pod's usual scheduler.""",
    ).tag(config=True)

    hide_gpus_without_lease = Bool(
        True,
        help="""Give CPU-only pods ``NVIDIA_VISIBLE_DEVICES=void``, so that images that set
        ``NVIDIA_VISIBLE_DEVICES=all`` (CUDA base images) see no GPU when they land on a GPU node.""",
    ).tag(config=True)

    _check_on_lease_end = stop_at_lease_end("Kubernetes", "a pod keeps its GPUs until it stops")

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._gpu_spec: PodGPUSpec = PodGPUSpec()

    def gpu_options(self) -> KubeGPUOptions:
        return KubeGPUOptions(
            share_mode=self.gpu_share_mode, shared_resource=self.shared_gpu_resource, mig_strategy=self.mig_strategy,
            dra=self.use_dra, dra_gpu_class=self.dra_device_class, dra_mig_class=self.dra_mig_device_class,
            dra_driver=self.dra_driver, tolerations=tuple(self.gpu_tolerations), select_product=self.select_gpu_product,
            scheduler_name=self.gpu_scheduler_name,
        )

    @property
    def claim_name(self) -> str:
        return f"{self.pod_name}-gpus"

    def lease_choice(self, user_options, pool=None):
        choice = super().lease_choice(user_options, pool)
        if choice.request and choice.request.get("kind") == "share" and self.gpu_share_mode == "none":
            raise spawn_error("This hub does not offer shares of a GPU on Kubernetes; ask for a whole GPU or a MIG "
                              "profile.", reason="gpulease_options")
        return choice

    def apply_placement(self, lease: dict) -> None:
        super().apply_placement(lease)
        try:
            spec = pod_gpu_spec(lease, self.gpu_options(), claim_name=self.claim_name, namespace=self.namespace,
                                labels=self._build_common_labels({}))
        except PlacementError as e:
            raise spawn_error(str(e), reason="gpulease_placement") from None
        for name in spec.drop_env:
            self._lease_env.pop(name, None)
        self._lease_env.update(spec.env)
        self._gpu_spec = spec

    async def start(self):
        self._gpu_spec = PodGPUSpec()  # a CPU-only spawn after a GPU one asks for nothing
        url = await super().start()
        if self._gpu_spec.claim is not None:
            await self._own_claim()  # the pod exists now (KubeSpawner waited for it to run)
        return url

    async def before_engine_start(self) -> None:
        # the lease spawner's hook between the grant and KubeSpawner's start(): the pod's claim
        # must exist before KubeSpawner creates the pod that names it
        await super().before_engine_start()
        claim = self._gpu_spec.claim
        if claim is not None:
            await self._create_claim(claim)

    async def get_pod_manifest(self):
        pod = await super().get_pod_manifest()
        return apply_gpu_spec(pod, self._gpu_spec, pinning=self.node_pinning, hide_gpus=self.hide_gpus_without_lease)

    async def stop(self, now=False):
        try:
            return await super().stop(now=now)
        finally:
            if self.use_dra:
                await self._delete_claim()

    # -------------------------------------------------------------- the claim (DRA)
    def _resource_api(self):
        return k8s_client.ResourceV1Api(self.api.api_client)

    async def _create_claim(self, claim: dict) -> None:
        api = self._resource_api()
        name = claim["metadata"]["name"]
        for _ in range(2):
            try:
                await asyncio.wait_for(api.create_namespaced_resource_claim(self.namespace, claim), self.k8s_api_request_timeout)
                self.log.info("Created ResourceClaim %s/%s for lease %s", self.namespace, name, self.lease_id)
                return
            except ApiException as e:
                if e.status != 409:
                    raise
                await self._delete_claim()  # left by an earlier spawn of this server
        raise RuntimeError(f"ResourceClaim {self.namespace}/{name} exists and could not be replaced")

    async def _own_claim(self) -> None:
        """Make the pod own its claim, so Kubernetes deletes the claim with the pod even if the hub is gone."""
        ref = {"apiVersion": "v1", "kind": "Pod", "name": self.pod_name, "uid": self.pod_id, "blockOwnerDeletion": True}
        try:
            await asyncio.wait_for(self._resource_api().patch_namespaced_resource_claim(
                self.claim_name, self.namespace, {"metadata": {"ownerReferences": [ref]}}), self.k8s_api_request_timeout)
        except Exception as e:
            self.log.warning("Could not make pod %s own ResourceClaim %s: %s", self.pod_name, self.claim_name, e)

    async def _delete_claim(self) -> None:
        try:
            await asyncio.wait_for(self._resource_api().delete_namespaced_resource_claim(self.claim_name, self.namespace),
                                   self.k8s_api_request_timeout)
        except ApiException as e:
            if e.status != 404:
                self.log.warning("Could not delete ResourceClaim %s/%s: %s", self.namespace, self.claim_name, e.reason)
        except Exception as e:
            self.log.warning("Could not delete ResourceClaim %s/%s: %s", self.namespace, self.claim_name, e)
