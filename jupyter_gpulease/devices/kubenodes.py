"""The GPUs a Kubernetes node publishes, read from its object: pure functions, no API client.

What the cluster already publishes becomes the pool (see :mod:`.kubernetes` for the backend that
lists and watches the nodes): NVIDIA GPU feature discovery labels with the device plugin's
capacity (whole GPUs, time-slicing and MPS seen through, MIG with the ``mixed`` and ``single``
strategies), HAMi's node annotation, and DRA ResourceSlices of NVIDIA's driver. Node state
(cordoned, not Ready, lost) comes from the node's spec and Ready condition. Everything here takes
the documents (dicts as ``kubectl get -o json`` writes them) and returns the pool's GPUs, so
recorded documents test it and the benchmark times it without a cluster.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime
from decimal import Decimal, InvalidOperation
from typing import Any

from ..core.model import GPU, MigInstance
from .declared import distribute_mig, max_mig_slices, parse_mig_profile, simulated_gpu_uuid, simulated_mig_uuid

GPU_RESOURCE = "nvidia.com/gpu"
SHARED_GPU_RESOURCE = "nvidia.com/gpu.shared"
MIG_RESOURCE_PREFIX = "nvidia.com/mig-"
LABEL_PRODUCT = "nvidia.com/gpu.product"
LABEL_COUNT = "nvidia.com/gpu.count"
LABEL_MEMORY = "nvidia.com/gpu.memory"
LABEL_REPLICAS = "nvidia.com/gpu.replicas"
LABEL_SHARING = "nvidia.com/gpu.sharing-strategy"
LABEL_MIG_STRATEGY = "nvidia.com/mig.strategy"
LABEL_SLICES_GI = "nvidia.com/gpu.slices.gi"
HAMI_REGISTER = "hami.io/node-nvidia-register"
DRA_DRIVER = "gpu.nvidia.com"
UUID_PREFIX = "k8s"  # GPU-k8s-<uuid>: the pool's own names where the cluster does not say

_MIG_LABEL_RE = re.compile(r"^nvidia\.com/mig-(\d+(?:c\.\d+)?g\.\d+gb(?:\+\w+)?)\.count$")
_MIG_RESOURCE_RE = re.compile(r"^nvidia\.com/mig-(\d+(?:c\.\d+)?g\.\d+gb(?:\+\w+)?)$")
_GB_RE = re.compile(r"(\d+)GB", re.IGNORECASE)

_QUANTITY_RE = re.compile(r"^([+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+))((?:[KMGTPE]i)|[numkMGTPE]|[eE][+-]?[0-9]+|)$")
_BINARY_SUFFIXES = {"Ki": 1, "Mi": 2, "Gi": 3, "Ti": 4, "Pi": 5, "Ei": 6}
_DECIMAL_SUFFIXES = {"n": -9, "u": -6, "m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}


def model_name(product: str) -> tuple[str, str]:
    """A GFD/DRA/HAMi product name as the pool's model, and the MIG profile it names (single strategy).

    ``"NVIDIA-A100-SXM4-80GB"`` → ``("A100-SXM4-80GB", "")``; ``"Tesla-T4-SHARED"`` → ``("T4", "")``;
    ``"NVIDIA-H100-80GB-HBM3-MIG-1g.10gb"`` → ``("H100-80GB-HBM3", "1g.10gb")``;
    ``"NVIDIA A100-SXM4-80GB"`` (DRA, NVML) → ``("A100-SXM4-80GB", "")``. The prefixes go as the
    ``nvml`` backend drops them, so one model pattern ("A100*") matches on every backend.
    """
    name = "-".join(product.strip().split()).removesuffix("-SHARED")
    profile = ""
    if "-MIG-" in name:
        name, profile = name.split("-MIG-", 1)
        profile = profile.lower()
    stripped = True
    while stripped:  # HAMi writes "NVIDIA-" + the driver's name: "NVIDIA-NVIDIA A10"
        stripped = False
        for prefix in ("NVIDIA-", "Tesla-"):
            if name.startswith(prefix):
                name, stripped = name[len(prefix):], True
    return name or "unknown GPU", profile


def product_label_values(model: str, *, mig_profile: str = "", shared: bool = False) -> tuple[str, ...]:
    """The ``nvidia.com/gpu.product`` label values GFD may give a node with GPUs of ``model``.

    The inverse of :func:`model_name`: GFD writes the driver's name with spaces as dashes
    (``NVIDIA-A100-SXM4-80GB``, ``Tesla-T4``), adds ``-SHARED`` under time-slicing/MPS and
    ``-MIG-<profile>`` under the single MIG strategy.
    """
    bases = [model, f"NVIDIA-{model}", f"Tesla-{model}"]
    out: list[str] = []
    for b in bases:
        if mig_profile:
            out.append(f"{b}-MIG-{mig_profile}")
        else:
            out.append(b)
            if shared:
                out.append(f"{b}-SHARED")
    return tuple(dict.fromkeys(out))


def parse_quantity(value: Any) -> Decimal:
    """A Kubernetes resource quantity as a number: ``"80Gi"``, ``"81920Mi"``, ``"1.5G"``,
    ``"500m"``, ``"1e3"``, ``"85899345920"`` (the API's grammar: a signed decimal with a binary
    suffix Ki..Ei, a decimal suffix n, u, m, k, M..E, or a decimal exponent). ValueError if it
    is not one."""
    if isinstance(value, bool):
        raise ValueError(f"not a Kubernetes quantity: {value!r}")
    if isinstance(value, (int, float)):
        return Decimal(str(value))
    if not isinstance(value, str):
        raise ValueError(f"not a Kubernetes quantity: {value!r}")
    m = _QUANTITY_RE.match(value.strip())
    if not m:
        raise ValueError(f"not a Kubernetes quantity: {value!r}")
    number, suffix = m.group(1), m.group(2)
    try:
        if suffix in _BINARY_SUFFIXES:
            return Decimal(number) * (1024 ** _BINARY_SUFFIXES[suffix])
        if suffix in _DECIMAL_SUFFIXES:
            return Decimal(number) * (Decimal(10) ** _DECIMAL_SUFFIXES[suffix])
        return Decimal(number) * (Decimal(10) ** int(suffix[1:]))  # a decimal exponent: e3, E-2
    except (InvalidOperation, ValueError):
        raise ValueError(f"not a Kubernetes quantity: {value!r}") from None


def quantity_mib(value: Any) -> int | None:
    """A Kubernetes quantity (``"80Gi"``, ``"81920Mi"``, ``"85899345920"``) in whole MiB; None if unreadable."""
    try:
        return int(parse_quantity(value) // 2**20)
    except ValueError:
        return None


def _int(value: Any, default: int | None = None) -> int | None:
    try:
        n = int(str(value).strip())
    except (TypeError, ValueError):
        return default
    return n if n >= 0 else default


def _timestamp(value: Any) -> float | None:
    if not isinstance(value, str) or not value:
        return None
    try:
        return datetime.fromisoformat(value).timestamp()
    except ValueError:
        return None


@dataclass(frozen=True)
class NodeState:
    """How a node stands: ``ready``, ``cordoned``, ``not-ready`` (GPUs unhealthy) or ``lost`` (GPUs gone)."""

    state: str
    why: str = ""

    @property
    def schedulable(self) -> bool:
        return self.state == "ready"


def node_state(node: dict, now: float, lost_after_s: float) -> NodeState:
    """Ready, cordoned, not Ready (for how long) — from the node's spec and Ready condition."""
    conditions = (node.get("status") or {}).get("conditions") or []
    ready = next((c for c in conditions if c.get("type") == "Ready"), None)
    if ready is None or ready.get("status") != "True":
        since = _timestamp((ready or {}).get("lastTransitionTime"))
        reason = (ready or {}).get("reason") or "no Ready condition"
        if since is not None and now - since >= lost_after_s:
            return NodeState("lost", f"not Ready for {now - since:.0f} s ({reason})")
        return NodeState("not-ready", f"not Ready ({reason})")
    if (node.get("spec") or {}).get("unschedulable"):
        return NodeState("cordoned", "cordoned (spec.unschedulable)")
    return NodeState("ready")


@dataclass
class NodeGPUs:
    """The GPUs one node brings to the pool, where they were read from, and anything odd about it."""

    node: str
    gpus: list[GPU] = field(default_factory=list)
    source: str = ""  # "gfd", "hami", "dra"
    problems: list[str] = field(default_factory=list)


def _gpu(node: str, index: int, model: str, memory: int, mig: tuple[MigInstance, ...] = (), uuid: str = "", healthy: bool = True) -> GPU:
    return GPU(uuid=uuid or simulated_gpu_uuid(node, index, UUID_PREFIX), node=node, index=index, model=model,
               memory_mib=memory, mig=mig, healthy=healthy)


def _gpu_memory(model: str, raw: str, labels: dict, memory_overrides: dict[str, int]) -> int | None:
    if model in memory_overrides:
        return int(memory_overrides[model])
    mem = _int(labels.get(LABEL_MEMORY))
    if mem:
        return mem
    m = _GB_RE.search(raw)  # "A100-SXM4-80GB": 80 GiB as the name says
    return int(m.group(1)) * 1024 if m else None


def _mark_unhealthy_tail(gpus: list[GPU], n: int) -> list[GPU]:
    """The device plugin reports ``n`` GPUs unhealthy (allocatable below capacity) without saying
    which to us: mark that many, from the end, so the broker grants no more than the node can run."""
    if n <= 0:
        return gpus
    out = list(gpus)
    plain = [i for i, g in enumerate(out) if not g.mig]
    for i in plain[-n:]:
        g = out[i]
        out[i] = GPU(g.uuid, g.node, g.index, g.model, g.memory_mib, g.mig, healthy=False)
    return out


def gpus_from_labels(node: dict, memory_overrides: dict[str, int] | None = None) -> NodeGPUs | None:
    """A node's GPUs from GFD labels and the device plugin's resources; None for a node without GPUs."""
    meta, status = node.get("metadata") or {}, node.get("status") or {}
    name = meta.get("name") or ""
    labels = meta.get("labels") or {}
    capacity = status.get("capacity") or {}
    allocatable = status.get("allocatable") or capacity
    memory_overrides = memory_overrides or {}
    raw = labels.get(LABEL_PRODUCT) or ""
    replicas = max(_int(labels.get(LABEL_REPLICAS), 1) or 1, 1)
    res_name = SHARED_GPU_RESOURCE if SHARED_GPU_RESOURCE in capacity else GPU_RESOURCE
    cap_units = _int(capacity.get(res_name), 0) or 0
    if res_name == SHARED_GPU_RESOURCE:
        cap_units += _int(capacity.get(GPU_RESOURCE), 0) or 0
    alloc_units = (_int(allocatable.get(res_name), 0) or 0) + (
        (_int(allocatable.get(GPU_RESOURCE), 0) or 0) if res_name == SHARED_GPU_RESOURCE else 0)
    mig_counts = _mig_counts(labels, capacity)
    if not raw and not cap_units and not mig_counts:
        return None
    out = NodeGPUs(name, source="gfd")
    model, single_profile = model_name(raw) if raw else ("unknown GPU", "")
    if not raw:
        out.problems.append(f"no {LABEL_PRODUCT} label (is GPU feature discovery running?); model unknown")
    memory = _gpu_memory(model, raw, labels, memory_overrides)
    strategy = (labels.get(LABEL_MIG_STRATEGY) or "none").lower()

    if single_profile:  # MIG, single strategy: every GPU of the node in one profile, exposed as nvidia.com/gpu
        out.gpus = _single_strategy_gpus(name, model, raw, labels, single_profile, cap_units, memory_overrides)
        return out

    if memory is None:
        out.problems.append(f"GPU memory unknown: no {LABEL_MEMORY} label and no 'memory_mib' for model {model!r} in the "
                            "device config; the node's GPUs are left out of the pool")
        return out
    whole = cap_units // replicas
    if mig_counts:  # MIG, mixed strategy: nvidia.com/gpu counts only the GPUs not in MIG mode
        _mixed_strategy_gpus(out, labels, model, memory, mig_counts, whole, cap_units - alloc_units, replicas)
        if strategy != "mixed":
            out.problems.append(f"MIG instance labels with {LABEL_MIG_STRATEGY}={strategy!r}; read as 'mixed'")
        return out

    if cap_units == 0:
        out.problems.append(f"GPU labels but no {GPU_RESOURCE} capacity: the device plugin does not serve this node "
                            "(with NVIDIA's DRA driver, set 'dra': true in the device config); its GPUs are left out")
        return out
    physical = _int(labels.get(LABEL_COUNT))
    if physical is None or physical > cap_units:
        physical = whole
    out.gpus = [_gpu(name, i, model, memory) for i in range(physical)]
    out.gpus = _mark_unhealthy_tail(out.gpus, math.ceil(max(cap_units - alloc_units, 0) / replicas))
    return out


def _mig_counts(labels: dict, capacity: dict) -> dict[str, int]:
    """MIG profile -> instances, from the ``nvidia.com/mig-<profile>.count`` labels, else the resources."""
    counts: dict[str, int] = {}
    for k, v in labels.items():
        m = _MIG_LABEL_RE.match(k)
        if m and _int(v):
            counts[m.group(1).lower()] = _int(v) or 0
    if not counts:
        for k, v in capacity.items():
            m = _MIG_RESOURCE_RE.match(k)
            if m and _int(v):
                counts[m.group(1).lower()] = _int(v) or 0
    return counts


def _single_strategy_gpus(name: str, model: str, raw: str, labels: dict, profile: str, cap_units: int,
                          memory_overrides: dict[str, int]) -> list[GPU]:
    """MIG with the ``single`` strategy: every GPU of the node split into instances of one profile."""
    slices, profile_mem = parse_mig_profile(profile)
    slices = _int(labels.get(LABEL_SLICES_GI), slices) or slices
    instance_mem = _int(labels.get(LABEL_MEMORY)) or profile_mem
    instances = _int(labels.get(LABEL_COUNT)) or cap_units
    per_gpu = max(max_mig_slices(model) // max(slices, 1), 1)
    physical = math.ceil(instances / per_gpu) if instances else 0
    gb = _GB_RE.search(raw)
    gpu_mem = memory_overrides.get(model) or (int(gb.group(1)) * 1024 if gb else instance_mem * per_gpu)
    gpus, left = [], instances
    for i in range(physical):
        n = min(per_gpu, left)
        left -= n
        mig = tuple(MigInstance(uuid=simulated_mig_uuid(name, i, j, UUID_PREFIX), profile=profile, memory_mib=instance_mem, index=j)
                    for j in range(n))
        gpus.append(_gpu(name, i, model, gpu_mem, mig))
    return gpus


def _mixed_strategy_gpus(out: NodeGPUs, labels: dict, model: str, memory: int, mig_counts: dict[str, int], whole: int,
                         unhealthy_units: int, replicas: int) -> None:
    """MIG with the ``mixed`` strategy: ``whole`` plain GPUs, the rest split as the labels count."""
    name = out.node
    physical = _int(labels.get(LABEL_COUNT))
    if physical is None:
        physical = whole + max(1, math.ceil(sum(parse_mig_profile(p)[0] * n for p, n in mig_counts.items()) / max_mig_slices(model)))
    mig_gpus = max(physical - whole, 0)
    if mig_gpus == 0:
        out.problems.append(f"MIG instances {sorted(mig_counts)} but no GPU left for them (gpu.count {physical}, whole {whole})")
    profiles = {p: (n, _int(labels.get(f"nvidia.com/mig-{p}.memory")) or parse_mig_profile(p)[1]) for p, n in mig_counts.items()}
    plain = _mark_unhealthy_tail([_gpu(name, i, model, memory) for i in range(whole)], math.ceil(max(unhealthy_units, 0) / replicas))
    out.gpus = plain + distribute_mig(name, whole, mig_gpus, profiles, model, memory, prefix=UUID_PREFIX)


def gpus_from_hami(node: dict) -> NodeGPUs | None:
    """A node's GPUs from HAMi's ``hami.io/node-nvidia-register`` annotation (JSON list); None if absent."""
    meta = node.get("metadata") or {}
    raw = (meta.get("annotations") or {}).get(HAMI_REGISTER)
    if not raw:
        return None
    name = meta.get("name") or ""
    out = NodeGPUs(name, source="hami")
    try:
        devices = json.loads(raw)
    except ValueError:
        out.problems.append(f"{HAMI_REGISTER} is not JSON (HAMi older than 2.4 writes another format); GPUs left out")
        return out
    if not isinstance(devices, list):
        out.problems.append(f"{HAMI_REGISTER} is not a list of devices; GPUs left out")
        return out
    for i, d in enumerate(devices):
        if not isinstance(d, dict) or not d.get("id") or not _int(d.get("devmem")):
            out.problems.append(f"{HAMI_REGISTER} device {i} lacks id or devmem; left out")
            continue
        model, _ = model_name(str(d.get("type") or "unknown GPU"))
        index = _int(d.get("index"), i)
        out.gpus.append(_gpu(name, index if index is not None else i, model, _int(d["devmem"]) or 0, uuid=str(d["id"]),
                             healthy=bool(d.get("health", True))))
    return out


def _attr(device: dict, key: str) -> Any:
    attrs = device.get("attributes") or {}
    a = attrs.get(key) or attrs.get(f"{DRA_DRIVER}/{key}") or {}
    for kind in ("string", "int", "bool", "version"):
        if kind in a:
            return a[kind]
    return None


def gpus_from_resource_slices(node_name: str, slices: Iterable[dict], driver: str = DRA_DRIVER) -> NodeGPUs | None:
    """A node's GPUs and MIG devices from the DRA driver's ResourceSlices; None if it publishes none.

    Reads ``resource.k8s.io`` v1 and v1beta2 slices (devices with ``attributes``/``capacity``)
    and v1beta1 (the same under ``basic``). Only the newest generation of each pool counts.
    """
    mine = [s for s in slices if (s.get("spec") or {}).get("driver") == driver and (s.get("spec") or {}).get("nodeName") == node_name]
    if not mine:
        return None
    newest: dict[str, int] = {}
    for s in mine:
        pool = (s["spec"].get("pool") or {})
        newest[pool.get("name", "")] = max(newest.get(pool.get("name", ""), 0), _int(pool.get("generation"), 0) or 0)
    devices = []
    for s in mine:
        pool = (s["spec"].get("pool") or {})
        if (_int(pool.get("generation"), 0) or 0) != newest[pool.get("name", "")]:
            continue
        for d in s["spec"].get("devices") or []:
            devices.append(d.get("basic", d) | {"name": d.get("name", "")})
    out = NodeGPUs(node_name, source="dra")
    parents: dict[str, dict] = {}
    migs: dict[str, list[dict]] = {}
    for d in devices:
        kind = _attr(d, "type") or "gpu"
        uuid = _attr(d, "uuid")
        if not uuid:
            out.problems.append(f"DRA device {d.get('name')!r} has no uuid attribute; left out")
            continue
        if kind == "mig":
            migs.setdefault(_attr(d, "parentUUID") or "", []).append(d)
        elif kind == "gpu":
            parents[uuid] = d
    def index_of(d: dict, fallback: int) -> int:
        m = re.match(r"^gpu-(\d+)$", d.get("name") or "")
        got = _int(_attr(d, "index"))
        if got is None:
            got = _int(_attr(d, "minor"))
        return got if got is not None else (int(m.group(1)) if m else fallback)
    for n, (uuid, d) in enumerate(sorted(parents.items(), key=lambda kv: index_of(kv[1], 0))):
        model, _ = model_name(str(_attr(d, "productName") or "unknown GPU"))
        mem = quantity_mib(((d.get("capacity") or {}).get("memory") or {}).get("value")) or 0
        mig = tuple(
            MigInstance(uuid=_attr(m, "uuid"), profile=str(_attr(m, "profile") or "").lower(),
                        memory_mib=quantity_mib(((m.get("capacity") or {}).get("memory") or {}).get("value")) or parse_mig_profile(str(_attr(m, "profile")))[1],
                        index=j)
            for j, m in enumerate(migs.pop(uuid, []))
        )
        out.gpus.append(_gpu(node_name, index_of(d, n), model, mem, mig, uuid=uuid))
    # MIG devices whose parent GPU is not published as a device of its own (MIG mode on)
    for parent_uuid, ms in sorted(migs.items()):
        model, _ = model_name(str(_attr(ms[0], "productName") or "unknown GPU"))
        mig = tuple(
            MigInstance(uuid=_attr(m, "uuid"), profile=str(_attr(m, "profile") or "").lower(),
                        memory_mib=quantity_mib(((m.get("capacity") or {}).get("memory") or {}).get("value")) or parse_mig_profile(str(_attr(m, "profile")))[1],
                        index=j)
            for j, m in enumerate(ms)
        )
        m = _GB_RE.search(model)
        mem = int(m.group(1)) * 1024 if m else sum(i.memory_mib for i in mig)
        index = len(out.gpus)
        out.gpus.append(_gpu(node_name, index, model, mem, mig, uuid=parent_uuid or simulated_gpu_uuid(node_name, index, UUID_PREFIX)))
    return out


def node_gpus(node: dict, *, slices: Iterable[dict] = (), memory_overrides: dict[str, int] | None = None,
              dra_driver: str = DRA_DRIVER) -> NodeGPUs | None:
    """A node's GPUs from the best source it has: DRA slices, then HAMi, then GFD labels."""
    name = (node.get("metadata") or {}).get("name") or ""
    return (gpus_from_resource_slices(name, slices, dra_driver) if slices else None) or gpus_from_hami(node) \
        or gpus_from_labels(node, memory_overrides)


def _with_health(gpus: list[GPU], healthy: bool) -> list[GPU]:
    if healthy:
        return gpus
    return [GPU(g.uuid, g.node, g.index, g.model, g.memory_mib, g.mig, healthy=False) for g in gpus]


def inventory_from_nodes(nodes: Iterable[dict], *, now: float, slices: Iterable[dict] = (), lost_after_s: float = 300,
                         memory_overrides: dict[str, int] | None = None, dra_driver: str = DRA_DRIVER,
                         problems: list[str] | None = None, cache: dict | None = None) -> list[GPU]:
    """The pool from node objects (``kubectl get nodes -o json`` items) and, with DRA, ResourceSlices.

    Problems worth an admin's attention (a node without a memory label…) are appended to
    ``problems`` when given. Nodes are sorted by name so the pool's order is stable. ``cache``
    (a dict the caller keeps) remembers each node's GPUs by its ``resourceVersion`` and its
    slices' versions, so a refresh parses only the nodes that changed.
    """
    slices = list(slices)
    by_node: dict[str, list[dict]] = {}
    for s in slices:
        by_node.setdefault((s.get("spec") or {}).get("nodeName") or "", []).append(s)
    out: list[GPU] = []
    seen: dict[str, str] = {}  # device UUID -> node
    for node in sorted(nodes, key=lambda n: (n.get("metadata") or {}).get("name") or ""):
        meta = node.get("metadata") or {}
        own = by_node.get(meta.get("name") or "", ())
        key = (meta.get("resourceVersion"), tuple((s.get("metadata") or {}).get("resourceVersion") for s in own))
        hit = cache.get(meta.get("name")) if cache is not None and key[0] else None
        if hit is not None and hit[0] == key:
            found = hit[1]
        else:
            found = node_gpus(node, slices=own, memory_overrides=memory_overrides, dra_driver=dra_driver)
            if cache is not None and key[0]:
                cache[meta.get("name")] = (key, found)
        if found is None:
            continue
        if problems is not None:
            problems.extend(f"node {found.node}: {p}" for p in found.problems)
        state = node_state(node, now, lost_after_s)
        if state.state == "lost":
            if problems is not None and found.gpus:
                problems.append(f"node {found.node}: {state.why}; its {len(found.gpus)} GPU(s) left the pool")
            continue
        for g in _with_health(found.gpus, state.schedulable):
            ids = [g.uuid, *(m.uuid for m in g.mig)]
            dup = next((u for u in ids if u in seen), None)
            if dup is not None:  # a copied annotation, a renamed node: never two GPUs with one UUID
                if problems is not None:
                    problems.append(f"node {g.node}: device {dup} is already in the pool (on node {seen[dup]}); left out")
                continue
            seen.update((u, g.node) for u in ids)
            out.append(g)
    return out


def items_of(document: Any, kind: str) -> list[dict]:
    """The objects of a ``kubectl get … -o json`` document: a List, or one object of ``kind``."""
    if isinstance(document, dict) and isinstance(document.get("items"), list):
        return [i for i in document["items"] if isinstance(i, dict)]
    if isinstance(document, dict) and document.get("kind") == kind:
        return [document]
    if isinstance(document, list):
        return [i for i in document if isinstance(i, dict)]
    raise ValueError(f"expected a {kind}List (kubectl get … -o json), got {type(document).__name__}")


def apply_node_event(nodes: dict[str, dict], kind: str, obj: dict) -> None:
    """One watch event (ADDED, MODIFIED, DELETED, BOOKMARK) applied to a node cache (name -> node)."""
    name = (obj.get("metadata") or {}).get("name")
    if not name or kind == "BOOKMARK":
        return
    if kind == "DELETED":
        nodes.pop(name, None)
    elif kind in ("ADDED", "MODIFIED"):
        nodes[name] = obj
