"""Declared inventories: GPUs written down in config, for the simulated and static backends.

One entry describes ``count`` identical GPUs on one node::

    {"node": "node-a", "model": "A100-SXM4-80GB", "count": 2, "memory_mib": 81920}
    {"node": "node-a", "model": "A100-SXM4-80GB", "memory_mib": 81920, "mig": ["3g.40gb", "3g.40gb"]}
    {"node": "node-b", "model": "A100-SXM4-80GB", "memory_mib": 81920, "mig": {"1g.10gb": 7}}
    {"node": "node-b", "model": "L4", "count": 4, "memory_mib": 23034}

``mig`` (a list of profiles, or ``{profile: count}``) puts every GPU of the entry in MIG mode
with those instances; the memory of an instance comes from its profile name ("3g.40gb" →
40 GiB). GPUs are numbered per node in declaration order. UUIDs are derived from node and
index, so they stay the same across restarts; ``uuids`` (one per GPU) sets them explicitly.
``devices`` (one per GPU) names each GPU's character device, for device enforcement: a path
(``"/dev/nvidia0"``), or ``{"device": "/dev/nvidia0", "mig": [["/dev/nvidia-caps/nvidia-cap21", "/dev/nvidia-caps/nvidia-cap22"], ...]}``
to name its MIG instances' nodes too: per instance its GPU instance's and its compute
instance's access nodes, or the first alone; without it a GPU's node is ``/dev/nvidia{index}``.
``driver_version`` (``"550.54.15"``) and ``cuda_version`` (the highest CUDA version that driver
supports, as nvidia-smi's "CUDA Version" says it: ``"12.4"``) declare the node's driver, so that
a pool can have a node with an older driver than the others::

    {"node": "node-c", "model": "L4", "count": 2, "memory_mib": 23034, "driver_version": "535.104.05", "cuda_version": "12.2"}
"""

from __future__ import annotations

import re
import uuid as uuidlib
from typing import Any

from ..core.model import CUDA_VERSION_RE, DRIVER_VERSION_RE, GPU, MigInstance

# Compute slices of a MIG-capable GPU (A100, H100, H200); A30 has 4.
MAX_MIG_SLICES = 7

_PROFILE_RE = re.compile(r"^(?:(\d+)c\.)?(\d+)g\.(\d+)gb(\+\w+)?$", re.IGNORECASE)
_ENTRY_KEYS = {"node", "model", "count", "memory_mib", "mig", "uuids", "devices", "healthy", "driver_version", "cuda_version"}
_NAMESPACE = uuidlib.UUID("6f1c1a52-6a0e-4f1e-9a58-6770756c6561")  # fixed: UUIDs must not change between runs


def parse_mig_profile(profile: str) -> tuple[int, int]:
    """``"3g.40gb"`` → ``(3, 40960)``: GPU-instance slices and memory in MiB.

    Raises ``ValueError`` for a name that is not a MIG profile.
    """
    m = _PROFILE_RE.match(profile.strip()) if isinstance(profile, str) else None
    if not m:
        raise ValueError(f"{profile!r} is not a MIG profile name such as '1g.10gb' or '3g.40gb'")
    slices, gb = int(m.group(2)), int(m.group(3))
    if slices < 1 or gb < 1:
        raise ValueError(f"{profile!r} is not a MIG profile name such as '1g.10gb' or '3g.40gb'")
    return slices, gb * 1024


def simulated_gpu_uuid(node: str, index: int, prefix: str = "sim") -> str:
    """A stable GPU UUID in NVIDIA's shape: ``GPU-sim-<uuid>``."""
    return f"GPU-{prefix}-{uuidlib.uuid5(_NAMESPACE, f'{node}/{index}')}"


def simulated_mig_uuid(node: str, index: int, mig_index: int, prefix: str = "sim") -> str:
    """A stable MIG UUID in NVIDIA's shape: ``MIG-sim-<uuid>``."""
    return f"MIG-{prefix}-{uuidlib.uuid5(_NAMESPACE, f'{node}/{index}/mig/{mig_index}')}"


def max_mig_slices(model: str) -> int:
    """Compute slices of one GPU of ``model`` in MIG mode (an A30 has 4, the others 7)."""
    return 4 if model.upper().startswith("A30") else MAX_MIG_SLICES


def distribute_mig(node: str, first_index: int, gpus: int, profiles: dict[str, tuple[int, int]], model: str, memory: int, *,
                   prefix: str) -> list[GPU]:
    """``profiles`` {profile: (instances on the node, MiB each)} spread over ``gpus`` MIG GPUs.

    A node's labels (Kubernetes) or GRES (Slurm) give totals per profile, not which GPU holds
    which instance; the device plugin or Slurm chooses the instance anyway, so any split that
    fits every GPU's slices counts right. ``prefix``: the pool's names for the GPUs and instances.
    """
    budget = [max_mig_slices(model)] * gpus
    held: list[list[tuple[str, int]]] = [[] for _ in range(gpus)]
    # biggest profiles first, each on the GPU with the most room left
    order = sorted(profiles.items(), key=lambda kv: -parse_mig_profile(kv[0])[0])
    for profile, (count, mem) in order:
        slices = parse_mig_profile(profile)[0]
        for _ in range(count):
            k = max(range(gpus), key=lambda i: (budget[i], -i)) if gpus else -1
            if k < 0 or budget[k] < slices:
                k = min(range(gpus), key=lambda i: len(held[i])) if gpus else -1
                if k < 0:
                    break
            budget[k] -= slices
            held[k].append((profile, mem))
    out = []
    for i in range(gpus):
        index = first_index + i
        mig = tuple(MigInstance(uuid=simulated_mig_uuid(node, index, j, prefix), profile=p, memory_mib=m, index=j)
                    for j, (p, m) in enumerate(held[i]))
        gpu_memory = memory or sum(m for _, m in held[i])
        out.append(GPU(simulated_gpu_uuid(node, index, prefix), node, index, model, gpu_memory, mig))
    return out


def _whole(value: Any, *, minimum: int) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        return None
    return value


def parse_inventory(entries: Any, *, default_node: str = "localhost", uuid_prefix: str = "sim", what: str = "gpus") -> list[GPU]:
    """Turn a list of declaration entries into GPUs. Raises ``ValueError`` naming the bad entry."""
    if not isinstance(entries, list):
        raise ValueError(f"device config: '{what}' must be a list of GPU entries such as "
                         f"{{'node': 'node-a', 'model': 'L4', 'count': 2, 'memory_mib': 23034}}, got {type(entries).__name__}")
    gpus: list[GPU] = []
    next_index: dict[str, int] = {}
    seen_uuids: set[str] = set()
    for n, entry in enumerate(entries, start=1):
        where = f"device config: {what} entry {n}"
        if not isinstance(entry, dict):
            raise ValueError(f"{where} must be an object with 'model' and 'memory_mib', got {entry!r}")
        where += f" ({entry.get('model', '?')} on {entry.get('node', default_node)})"
        unknown = sorted(set(entry) - _ENTRY_KEYS)
        if unknown:
            raise ValueError(f"{where}: unknown key(s) {', '.join(map(repr, unknown))}; allowed: {', '.join(sorted(_ENTRY_KEYS))}")
        node = entry.get("node", default_node)
        if not isinstance(node, str) or not node.strip():
            raise ValueError(f"{where}: 'node' must be a non-empty string, got {node!r}")
        node = node.strip()
        model = entry.get("model")
        if not isinstance(model, str) or not model.strip():
            raise ValueError(f"{where}: 'model' must name the GPU model, e.g. 'A100-SXM4-80GB', got {model!r}")
        model = model.strip()
        count = _whole(entry.get("count", 1), minimum=1)
        if count is None:
            raise ValueError(f"{where}: 'count' must be a whole number of at least 1, got {entry.get('count')!r}")
        memory = _whole(entry.get("memory_mib"), minimum=1)
        if memory is None:
            raise ValueError(f"{where}: 'memory_mib' must be the GPU's memory in MiB as a positive whole number "
                             f"(e.g. 81920 for 80 GB), got {entry.get('memory_mib')!r}")
        healthy = entry.get("healthy", True)
        if not isinstance(healthy, bool):
            raise ValueError(f"{where}: 'healthy' must be true or false, got {healthy!r}")
        driver_version, cuda_version = _parse_driver(entry, where)
        profiles = _parse_mig_list(entry.get("mig"), where, memory)
        uuids = entry.get("uuids")
        if uuids is not None and (not isinstance(uuids, list) or len(uuids) != count
                                  or not all(isinstance(u, str) and u.strip() for u in uuids)):
            raise ValueError(f"{where}: 'uuids' must list one UUID string per GPU ({count}), got {uuids!r}")
        nodes = _parse_devices(entry.get("devices"), where, count, len(profiles))
        for k in range(count):
            index = next_index.get(node, 0)
            next_index[node] = index + 1
            gpu_uuid = uuids[k].strip() if uuids else simulated_gpu_uuid(node, index, uuid_prefix)
            mig = tuple(
                MigInstance(uuid=simulated_mig_uuid(node, index, i, uuid_prefix), profile=p, memory_mib=mem, index=i,
                            device=nodes[k][1][i][0] if nodes and nodes[k][1] else "",
                            compute_device=nodes[k][1][i][1] if nodes and nodes[k][1] else "")
                for i, (p, mem) in enumerate(profiles)
            )
            for u in (gpu_uuid, *(m.uuid for m in mig)):
                if u in seen_uuids:
                    raise ValueError(f"{where}: UUID {u!r} is declared twice")
                seen_uuids.add(u)
            gpus.append(GPU(uuid=gpu_uuid, node=node, index=index, model=model, memory_mib=memory, mig=mig, healthy=healthy,
                            device=nodes[k][0] if nodes else "", driver_version=driver_version, cuda_version=cuda_version))
    return gpus


def _parse_driver(entry: dict, where: str) -> tuple[str, str]:
    """An entry's ``driver_version`` and ``cuda_version``, checked; "" where not declared."""
    driver = entry.get("driver_version", "")
    if driver != "" and not (isinstance(driver, str) and DRIVER_VERSION_RE.match(driver.strip())):
        raise ValueError(f"{where}: 'driver_version' must be an NVIDIA driver version such as '550.54.15', got {driver!r}")
    cuda = entry.get("cuda_version", "")
    if cuda != "" and not (isinstance(cuda, str) and CUDA_VERSION_RE.match(cuda.strip())):
        hint = " (write it as a string: a number loses digits, 12.10 reads as 12.1)" if isinstance(cuda, (int, float)) else ""
        raise ValueError(f"{where}: 'cuda_version' must be the highest CUDA version the node's driver supports, "
                         f"major.minor as nvidia-smi shows it, such as '12.4'{hint}; got {cuda!r}")
    return driver.strip(), cuda.strip()


def _parse_devices(raw: Any, where: str, count: int, n_mig: int) -> list[tuple[str, list[tuple[str, str]]]] | None:
    """``devices`` of an entry: one per GPU, a path or ``{"device": path, "mig": [...]}`` with, per
    MIG instance, its GPU instance's access node or the pair ``[GPU instance's, compute instance's]``."""
    if raw is None:
        return None
    shape = (f"{where}: 'devices' must list one device node per GPU ({count}), each a path such as "
             f"'/dev/nvidia0' or {{'device': '/dev/nvidia0', 'mig': [['/dev/nvidia-caps/nvidia-cap21', "
             f"'/dev/nvidia-caps/nvidia-cap22'], ...]}}")
    if not isinstance(raw, list) or len(raw) != count:
        raise ValueError(f"{shape}, got {raw!r}")
    out: list[tuple[str, list[tuple[str, str]]]] = []
    for d in raw:
        if isinstance(d, dict):
            if set(d) - {"device", "mig"}:
                raise ValueError(f"{shape}; unknown key(s) in {d!r}")
            path, mig = d.get("device"), d.get("mig", [])
        else:
            path, mig = d, []
        if not isinstance(path, str) or not path.startswith("/"):
            raise ValueError(f"{shape}; {path!r} is not an absolute path")
        pairs = [_mig_nodes(m) for m in mig] if isinstance(mig, list) else [None]
        if any(p is None for p in pairs) or (mig and len(mig) != n_mig):
            raise ValueError(f"{where}: 'mig' of device {path!r} must list, per MIG instance ({n_mig}), its access node "
                             f"or the pair [GPU instance's node, compute instance's node], absolute paths; got {mig!r}")
        out.append((path, pairs))
    return out


def _mig_nodes(m: Any) -> tuple[str, str] | None:
    """One MIG instance's nodes: a path (its GPU instance's) or a pair of paths; None when malformed."""
    if isinstance(m, str) and m.startswith("/"):
        return (m, "")
    if isinstance(m, list) and len(m) == 2 and all(isinstance(x, str) and x.startswith("/") for x in m):
        return (m[0], m[1])
    return None


def _parse_mig_list(raw: Any, where: str, memory_mib: int) -> list[tuple[str, int]]:
    if raw is None or raw == [] or raw == {}:
        return []
    if isinstance(raw, dict):
        names: list[str] = []
        for profile, n in raw.items():
            if _whole(n, minimum=1) is None:
                raise ValueError(f"{where}: 'mig' count for {profile!r} must be a whole number of at least 1, got {n!r}")
            names.extend([profile] * n)
    elif isinstance(raw, list):
        names = list(raw)
    else:
        raise ValueError(f"{where}: 'mig' must be a list of profiles like ['3g.40gb', '3g.40gb'] or {{'1g.10gb': 7}}, got {raw!r}")
    out: list[tuple[str, int]] = []
    slices = 0
    for p in names:
        try:
            s, mem = parse_mig_profile(p)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
        slices += s
        out.append((p.strip().lower(), mem))
    if slices > MAX_MIG_SLICES:
        raise ValueError(f"{where}: MIG profiles {names} need {slices} compute slices; a GPU has at most {MAX_MIG_SLICES}")
    total = sum(mem for _, mem in out)
    # Profile names round up ("7g.80gb" on an H100 with 81559 MiB): allow that, refuse real overcommit.
    if total > memory_mib * 1.1:
        raise ValueError(f"{where}: MIG profiles {names} need {total} MiB but the GPU has {memory_mib} MiB")
    return out
