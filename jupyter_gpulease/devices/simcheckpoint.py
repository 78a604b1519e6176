"""A simulated ``cuda-checkpoint`` for the simulated GPUs (the demo's): suspend and resume without a driver.

It takes the real tool's command line (``--action lock|checkpoint|restore|unlock --pid PID``,
``--timeout MS``, ``--device-map OLD=NEW,...``, ``--get-state --pid PID``, ``--help``) and does
to the simulated GPUs what NVIDIA's tool does to real ones: a checkpoint takes the process's GPU
memory off its device in the simulated backend's state file (kept aside, as the real tool keeps
it in host memory), a restore puts it back (onto the mapped device) and the process goes on idle.
The process itself keeps running with everything it holds: a kernel's variables stay.

The server extension uses it by itself when its device backend is ``simulated`` (and
``GPULeaseExtension.cuda_checkpoint`` is not set); it says everywhere that the suspend is
simulated. It refuses to run without a simulated backend: real GPUs need the real tool.

Where the state file is: ``GPULEASE_DEVICE_CONFIG`` (JSON, its ``state_file``), as the extension
and the kernels get it (its ``gpus`` too: the pool the restore maps onto). What it keeps aside
(per process: its state and memory) is in ``<state file>.checkpoints.json`` next to it, under a
lock, or, for an account that does not own the state file, in its own
``<state file>.d/<uid>.checkpoints.json`` (it takes and puts back that account's processes only,
in that account's file of the folder). A process is kept there by its pid and pid namespace
(``"PID@NAMESPACE"``): the tool runs in the namespace of the process it acts on (in its container,
where that store may be shared with other containers and the host, whose pids are others). Run as
``python -m jupyter_gpulease.devices.simcheckpoint ARGS``.
"""

from __future__ import annotations

import fcntl
import json
import os
import sys
from typing import Any

from ..files import write_atomically

NOTE = "simulated: the demo's simulated GPUs, no NVIDIA driver"
_NEXT = {"lock": "locked", "checkpoint": "checkpointed", "restore": "locked", "unlock": "running"}
_NEEDS = {"lock": "running", "checkpoint": "locked", "restore": "checkpointed", "unlock": "locked"}
USAGE = ("usage: cuda-checkpoint (simulated) --action {lock,checkpoint,restore,unlock} --pid PID [--timeout MS] "
         "[--device-map OLD=NEW,...]\n       cuda-checkpoint (simulated) --get-state --pid PID")


class SimCheckpointError(Exception):
    pass


def simulated_config(environ: dict[str, str] | None = None) -> dict[str, Any]:
    """The simulated backend's config from the environment (its pool and state file); raises
    when it names no state file."""
    env = os.environ if environ is None else environ
    if env.get("GPULEASE_DEVICE_BACKEND", "").strip().lower() != "simulated":
        raise SimCheckpointError("the simulated cuda-checkpoint works on simulated GPUs only "
                                 f"(this server's device backend is {env.get('GPULEASE_DEVICE_BACKEND') or 'nvml'!r})")
    try:
        config = json.loads(env.get("GPULEASE_DEVICE_CONFIG") or "{}")
    except ValueError:
        config = None
    state = config.get("state_file") if isinstance(config, dict) else None
    if not isinstance(state, str) or not state:
        raise SimCheckpointError("the simulated GPUs have no state file (GPULEASE_DEVICE_CONFIG has no 'state_file')")
    return {k: v for k, v in config.items() if k in ("gpus", "node", "state_file")}


def _load(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (FileNotFoundError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _save(path: str, data: dict[str, Any]) -> None:
    write_atomically(path, json.dumps(data), mode=0o644)


def _parse(argv: list[str]) -> dict[str, str]:
    args: dict[str, str] = {}
    for i, a in enumerate(argv):
        if a.startswith("--"):
            nxt = argv[i + 1] if i + 1 < len(argv) else ""
            args[a] = "" if nxt.startswith("--") else nxt
    return args


def run(argv: list[str], environ: dict[str, str] | None = None) -> str:
    """One call, as the command line gives it; returns what the tool prints, raises on failure."""
    if "--help" in argv:
        return USAGE
    args = _parse(argv)
    action = args.get("--action") or ("get-state" if "--get-state" in argv else "")
    if action not in (*_NEXT, "get-state"):
        raise SimCheckpointError(f"unknown action {action!r}; {USAGE}")
    try:
        pid = int(args.get("--pid") or "")
    except ValueError:
        raise SimCheckpointError("--pid needs a process id") from None
    config = simulated_config(environ)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        raise SimCheckpointError(f"no process {pid}") from None
    except PermissionError:
        pass
    from .simulated import SimulatedBackend, pid_namespace

    sim = SimulatedBackend(config)
    store_path = sim.checkpoint_store
    ns = pid_namespace()
    key = f"{pid}@{ns}" if ns is not None else str(pid)  # (the same pid in another container is another process)
    with open(store_path + ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        store = _load(store_path)
        if key not in store and str(pid) in store:  # kept by an earlier version, by pid alone
            store[key] = store.pop(str(pid))
        entry = store.get(key) or {"state": "running", "memory": []}
        if action == "get-state":
            return entry["state"]
        if entry["state"] != _NEEDS[action]:
            raise SimCheckpointError(f"process {pid} is {entry['state']}, cannot {action}")
        if action in ("checkpoint", "restore"):
            if action == "checkpoint":  # GPU memory -> host memory: the device no longer lists the process
                # (a GPU's sample lists its MIG instances' processes too: each entry once, on its own device)
                entry["memory"] = [{"device": uuid, "used_memory_mib": p.used_memory_mib}
                                   for uuid, s in sim.sample().items() for p in s.processes
                                   if p.pid == pid and (p.device_uuid or uuid) == uuid]
                entry["started"] = sim.started_at(pid)  # back with it: the restored process leaves the GPU when it exits
                sim.remove_process(pid)
            else:
                mapping = dict(kv.split("=", 1) for kv in args.get("--device-map", "").split(",") if "=" in kv)
                for m in entry["memory"]:
                    # back on its (mapped) device, idle: the process's next CUDA call goes on from here
                    sim.add_process(mapping.get(m["device"], m["device"]), pid, m["used_memory_mib"], sm_util_pct=0.0,
                                    started=entry.get("started"))
                entry["memory"] = []
                entry.pop("started", None)
        entry["state"] = _NEXT[action]
        if entry["state"] == "running" and not entry["memory"]:
            store.pop(key, None)
        else:
            store[key] = entry
        _save(store_path, store)
    return ""


def main(argv: list[str] | None = None) -> int:
    try:
        out = run(list(sys.argv[1:] if argv is None else argv))
    except (SimCheckpointError, ValueError, OSError) as e:
        print(f"cuda-checkpoint (simulated): {e}", file=sys.stderr)
        return 1
    if out:
        print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
