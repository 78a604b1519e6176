"""A granted lease turned into what a single-user server sees, and the words the spawn page shows.

Pure functions. The environment is the contract with the server extension and the kernels:

``CUDA_VISIBLE_DEVICES``   the leased devices by UUID (MIG instances by their MIG UUID); empty
                           for a CPU-only server, so that no GPU is visible at all
``GPULEASE_LEASE_ID``      the lease's id ("" for a CPU-only server)
``GPULEASE_BROKER_URL``    the broker's base URL (the server extension talks to it with the
                           server's own JUPYTERHUB_API_TOKEN)
``GPULEASE_EXPIRES_AT``    POSIX seconds when the lease was due to end *when the server
                           started*. It is not updated: an extension moves the lease's end, a
                           preemption brings it forward. The live value is the lease's
                           ``expires_at`` in the broker's API (``GET api/leases/<id>``, what
                           ``jupyter gpulease leases`` shows)
``GPULEASE_SHARE``         compute share of each slice (1 = whole GPU, 0.5 = half)
``GPULEASE_MEMORY_MIB``    memory cap of each slice in MiB (comma-separated, one per device)
``GPULEASE_MEMORY_FRACTION`` the same cap as a fraction of each device's memory (``0.5``):
                           what a framework's own cap takes, e.g. PyTorch's
                           ``torch.cuda.set_per_process_memory_fraction``
``GPULEASE_GPU_UUIDS``     physical GPU UUIDs (for a MIG slice: its parent GPU)
``GPULEASE_TIER``          the lease's tier
``GPULEASE_PLACEMENT``     the whole placement as JSON

What a share's limits mean depends on the GPU (say so to users as it is):

* **MIG slice**: isolated by the hardware (memory and compute); nothing to enforce.
* **Share of a GPU served by CUDA MPS** (``GPULeaseSpawner.cuda_mps``): the MPS server
  enforces ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` (the share of the GPU's SMs, e.g. 50) and
  ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`` (a hard cap on the memory the server's processes may
  allocate, e.g. ``0=11517M``), both set here for every process of the server.
* **Share of a GPU without MPS**: nothing stops a process from using the whole GPU. The limits
  are in the environment for cooperating code (a framework's memory cap at kernel start), and
  the server extension's monitor watches the share's memory and acts on a share over it.
"""

from __future__ import annotations

import json
import time
from typing import Any

from ..core.text import format_duration

ENV_PREFIX = "GPULEASE_"


def lease_environment(lease: dict[str, Any], *, broker_url: str = "", gpu_memory_mib: dict[str, int] | None = None,
                      cuda_mps: bool = False) -> dict[str, str]:
    """The environment of a server that holds the active ``lease`` (a lease JSON of the broker).

    ``gpu_memory_mib``: each GPU's whole memory by UUID (the pool's devices), for
    ``GPULEASE_MEMORY_FRACTION``. ``cuda_mps``: the GPUs are served by CUDA MPS, so a share
    gets its MPS client limits (a slice marked ``"mps": true`` in the placement gets them too).
    """
    placement = lease.get("placement") or {}
    slices = placement.get("slices") or []
    if not slices:
        raise ValueError(f"lease {lease.get('id')} has no placement (state {lease.get('state')!r})")
    devices = [s.get("mig_uuid") or s["gpu_uuid"] for s in slices]
    gpu_memory_mib = gpu_memory_mib or {}
    env = {
        "CUDA_VISIBLE_DEVICES": ",".join(devices),
        # CUDA numbers devices by PCI bus so that indices match nvidia-smi's.
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        "GPULEASE_LEASE_ID": str(lease["id"]),
        "GPULEASE_BROKER_URL": broker_url,
        "GPULEASE_EXPIRES_AT": "" if lease.get("expires_at") is None else f"{float(lease['expires_at']):.0f}",
        "GPULEASE_SHARE": ",".join(f"{float(s.get('share', 1.0)):g}" for s in slices),
        "GPULEASE_MEMORY_MIB": ",".join(str(int(s["memory_mib"])) for s in slices),
        "GPULEASE_GPU_UUIDS": ",".join(s["gpu_uuid"] for s in slices),
        "GPULEASE_TIER": str(lease.get("tier") or ""),
        "GPULEASE_PLACEMENT": json.dumps(placement, separators=(",", ":"), sort_keys=True),
    }
    fractions = [_memory_fraction(s, gpu_memory_mib) for s in slices]
    env["GPULEASE_MEMORY_FRACTION"] = ",".join(f"{f:.4g}" for f in fractions)
    shares = [s for s in slices if not s.get("mig_uuid") and float(s.get("share", 1.0)) < 1]
    if shares and (cuda_mps or all(s.get("mps") for s in shares)):
        env.update(mps_environment(slices))
    return env


def _memory_fraction(slice_: dict[str, Any], gpu_memory_mib: dict[str, int]) -> float:
    """The slice's memory cap as a fraction of its device's memory (1 for a whole GPU or a MIG slice)."""
    if slice_.get("mig_uuid") or float(slice_.get("share", 1.0)) >= 1:
        return 1.0
    total = gpu_memory_mib.get(slice_["gpu_uuid"]) or slice_.get("gpu_memory_mib")
    if total:
        return max(0.0, min(1.0, int(slice_["memory_mib"]) / int(total)))
    return float(slice_.get("share", 1.0))


def mps_environment(slices: list[dict[str, Any]]) -> dict[str, str]:
    """CUDA MPS client limits for the server's processes: the compute share as a percentage of
    the SMs (the smallest share when there are several slices: the limit is per process) and
    a pinned memory limit per device, numbered as the server sees them (0, 1, ...)."""
    pct = min(max(1, round(100 * float(s.get("share", 1.0)))) for s in slices)
    mem = ",".join(f"{i}={int(s['memory_mib'])}M" for i, s in enumerate(slices))
    return {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": str(pct), "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": mem}


def cpu_only_environment(*, broker_url: str = "") -> dict[str, str]:
    """A server without a lease: no GPU visible, and the broker URL so the user can ask for one."""
    return {"CUDA_VISIBLE_DEVICES": "", "GPULEASE_LEASE_ID": "", "GPULEASE_BROKER_URL": broker_url}


# --------------------------------------------------------------------------- words
def display_model(name: str, memory_mib: int | None) -> str:
    """'L4' + 23034 MiB → 'L4 (22 GB)'; a name that already says its memory stays as it is."""
    if not memory_mib or "gb" in name.lower():
        return name
    return f"{name} ({round(memory_mib / 1024)} GB)"


def _model_words(patterns: list[str], pool: dict | None) -> str:
    import fnmatch

    devices = (pool or {}).get("devices") or []
    mem: dict[str, int] = {}
    for d in devices:
        mem[d["model"]] = max(mem.get(d["model"], 0), int(d.get("memory_mib") or 0))
    if patterns:
        matching = [m for m in mem if any(fnmatch.fnmatchcase(m.lower(), p.lower()) for p in patterns)]
    else:
        matching = list(mem)
    if len(matching) == 1:
        return display_model(matching[0], mem[matching[0]])
    return " or ".join(patterns) if patterns else "GPU"


def describe_request(request: dict[str, Any], pool: dict | None = None) -> str:
    """A lease request (``Request.to_dict()``) in words: '1 × A100-SXM4-80GB', 'a 0.5 share of L4 (22 GB)'."""
    models = request.get("model") or []
    if isinstance(models, str):
        models = [models]
    what = _model_words(list(models), pool)
    kind = request.get("kind") or ("mig" if request.get("mig_profile") else "share" if request.get("share") else "gpu")
    if kind == "share":
        share = request.get("share")
        mem = request.get("memory_mib")
        part = f"a {float(share):g} share" if share else f"{mem} MiB"
        return f"{part} of one {what}"
    if kind == "mig":
        return f"MIG {request.get('mig_profile')} of {what}" if what != "GPU" else f"MIG {request.get('mig_profile')}"
    return f"{int(request.get('gpus', 1))} × {what}"


def describe_wait(eta: float | None, now: float) -> str:
    if eta is None:
        return "no estimate yet"
    left = eta - now
    if left < 60:
        return "any moment now"
    return f"about {format_duration(left)}"


def sooner_words(queue: dict[str, Any], now: float) -> str:
    """', or sooner: the GPU it waits for is idle and goes back by 14:05 if it stays idle' (the
    broker's ``may_start_sooner_at``: the holders' idle-reclaim deadline), or ''."""
    at = queue.get("may_start_sooner_at")
    if at is None or float(at) <= now:
        return ""
    return f", or sooner: the GPU it waits for is idle and goes back by {time.strftime('%H:%M', time.localtime(float(at)))} if it stays idle"


def queue_message(lease: dict[str, Any], pool: dict | None = None, now: float | None = None, *, gives_up_at: float | None = None) -> str:
    """'Waiting for 1 × A100 (80 GB): position 2 of 5, about 14 min'.

    ``gives_up_at``: when the spawn stops waiting (POSIX seconds); an ETA beyond it says that
    the spawn will give up first (so does the broker's ``eta_after_wait_limit`` flag, and its
    ``gives_up_at`` stands in for ``gives_up_at`` when not given)."""
    now = time.time() if now is None else now
    q = lease.get("queue") or {}
    what = describe_request(lease.get("request") or {}, pool)
    if not q:
        return f"Waiting for {what}"
    text = f"Waiting for {what}: position {q.get('position')} of {q.get('length')}, {describe_wait(q.get('eta'), now)}"
    text += sooner_words(q, now)
    eta = q.get("eta")
    if gives_up_at is None and q.get("gives_up_at") is not None:
        gives_up_at = float(q["gives_up_at"])
    beyond = q.get("eta_after_wait_limit")
    if beyond is None and eta is not None and gives_up_at is not None:
        beyond = float(eta) > gives_up_at
    if beyond:
        limit = f" (in {format_duration(max(0.0, gives_up_at - now))})" if gives_up_at is not None else ""
        text += (f". That is after this spawn stops waiting{limit}: unless GPUs free up sooner it will give up; "
                 "a smaller request (a share, another model) may start sooner")
    return text


def granted_message(lease: dict[str, Any], now: float | None = None) -> str:
    """'GPU lease granted: 1 × A100-SXM4-80GB (GPU-…), for 2 h'."""
    now = time.time() if now is None else now
    slices = (lease.get("placement") or {}).get("slices") or []
    parts = []
    for s in slices:
        if s.get("mig_uuid"):
            parts.append(f"MIG {s.get('mig_profile')} of {s['model']} ({s['mig_uuid']})")
        elif float(s.get("share", 1)) < 1:
            parts.append(f"a {float(s['share']):g} share of {s['model']} ({s['gpu_uuid']})")
        else:
            parts.append(f"{s['model']} ({s['gpu_uuid']})")
    until = ""
    if lease.get("expires_at"):
        until = f", for {format_duration(float(lease['expires_at']) - now)}"
        granted, asked = lease.get("granted_at"), lease.get("duration_s")
        if granted is not None and asked and float(lease["expires_at"]) - float(granted) < float(asked) - 1:
            # a short grant: a preemptible lease started on GPUs promised to someone waiting
            until += f" (you asked for {format_duration(float(asked))}; these GPUs are promised to a waiting request after that)"
    return f"GPU lease {lease.get('id')} granted: {', '.join(parts)}{until}"
