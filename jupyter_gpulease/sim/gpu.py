"""GPU work on the demo's simulated GPUs, from a notebook: what a training cell looks like to the monitor.

    from jupyter_gpulease.sim.gpu import use_gpu
    use_gpu(util=80, memory_gb=6, seconds=20)

puts this kernel's process on its leased simulated GPU(s) in the simulated backend's state file,
holding ``memory_gb`` of GPU memory and keeping ``util`` percent of the GPU busy for ``seconds``
(the cell runs that long), then leaves the memory held and the GPU idle, as a real notebook does
after a training cell: the idle warning, the suspend and the resume follow from there.

The state file and the leased devices come from the kernel's environment, as the server gives
it (``GPULEASE_DEVICE_BACKEND=simulated``, ``GPULEASE_DEVICE_CONFIG``'s ``state_file``,
``CUDA_VISIBLE_DEVICES``). On real GPUs it refuses: run real CUDA work there.
"""

from __future__ import annotations

import json
import math
import os
import time

__all__ = ["SimulatedGPUError", "release_gpu", "use_gpu"]


class SimulatedGPUError(RuntimeError):
    """use_gpu cannot run here (real GPUs, no lease, bad arguments); the message says why."""


def _backend_and_devices(environ=None):
    env = os.environ if environ is None else environ
    backend = env.get("GPULEASE_DEVICE_BACKEND", "").strip().lower()
    if backend != "simulated":
        raise SimulatedGPUError(
            "use_gpu drives the demo's simulated GPUs only; this server's GPUs are "
            f"{'real (' + (backend or 'nvml') + ')' if backend != 'static' else 'declared (static)'}: run real GPU work instead")
    try:
        config = json.loads(env.get("GPULEASE_DEVICE_CONFIG") or "{}")
    except ValueError:
        config = {}
    state_file = config.get("state_file") if isinstance(config, dict) else None
    if not state_file:
        raise SimulatedGPUError("the simulated GPUs have no state file here (GPULEASE_DEVICE_CONFIG names none), "
                                "so no other process would see this work")
    devices = [d.strip() for d in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    if not devices or devices == ["-1"] or not any(d.startswith(("GPU-", "MIG-")) for d in devices):
        raise SimulatedGPUError("this kernel has no leased GPU (CUDA_VISIBLE_DEVICES names none): ask for one with "
                                "%gpu request --wait in this kernel (it takes the GPU at once), then run this again")
    from ..devices.simulated import SimulatedBackend

    return SimulatedBackend({**config, "state_file": state_file}), devices


def use_gpu(util: float = 80, memory_gb: float = 6, seconds: float = 20, *, quiet: bool = False) -> None:
    """Use this kernel's leased simulated GPU(s): ``memory_gb`` GB held on each, ``util`` % busy for
    ``seconds`` (the call returns after that), then idle with the memory still held."""
    for name, value, top in (("util", util, 100), ("memory_gb", memory_gb, None), ("seconds", seconds, None)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0 \
                or (top is not None and value > top):
            raise SimulatedGPUError(f"{name} must be a number from 0{f' to {top}' if top else ' up'}, got {value!r}")
    sim, devices = _backend_and_devices()
    pid = os.getpid()
    from ..devices.simulated import process_started

    started = process_started(pid)  # on the GPU only while this process runs: a stopped kernel leaves it
    # where this process already is (a resume may have put it on another GPU than it started with)
    here = [uuid for uuid, s in sim.sample().items() for p in s.processes if p.pid == pid and (p.device_uuid or uuid) == uuid]
    devices = here or devices
    mib = round(memory_gb * 1024)
    try:
        for dev in devices:
            sim.add_process(dev, pid, mib, sm_util_pct=float(util), started=started)
    except ValueError as e:
        raise SimulatedGPUError(f"the leased GPU is not one of the simulated pool's: {e}") from None
    what = ", ".join(devices)
    if not quiet:
        print(f"Using the simulated GPU {what}: {util:g}% busy, {memory_gb:g} GB held, for {seconds:g} s ...", flush=True)
    try:
        time.sleep(seconds)
    finally:
        for dev in devices:
            try:
                # done computing; the memory stays, as PyTorch keeps its cache
                sim.add_process(dev, pid, mib, sm_util_pct=0.0, started=started)
            except ValueError:
                pass
    if not quiet:
        print(f"Done: the GPU is idle now; this kernel still holds {memory_gb:g} GB on it.", flush=True)


def release_gpu() -> bool:
    """Free this kernel's simulated GPU memory (as ``del model; torch.cuda.empty_cache()`` would)."""
    sim, _ = _backend_and_devices()
    return sim.remove_process(os.getpid())
