"""A stand-in for NVIDIA's ``cuda-checkpoint``, written for the tests (no GPU here).

It takes the real tool's command line (``--action lock|checkpoint|restore|unlock --pid PID``,
``--timeout MS``, ``--device-map OLD=NEW,...``, ``--get-state --pid PID``, ``--help``), records
every call, and does to the *simulated* GPUs what the real one does to real ones: a checkpoint
takes the process's memory off its device in the simulated backend's state file (kept aside),
a restore puts it back (onto the mapped device). It fails on request.

Configured by environment variables (the server extension runs it with the server's env):

``STANDIN_CUDA_CHECKPOINT_DIR``       folder for its call log (``calls.jsonl``) and saved state
``STANDIN_CUDA_CHECKPOINT_SIM_STATE`` the simulated backend's state file
``STANDIN_CUDA_CHECKPOINT_FAIL``      comma-separated actions that fail (e.g. ``restore``)
``STANDIN_CUDA_CHECKPOINT_FAIL_ONCE`` comma-separated actions that fail the first time only, as
                                      an open the device cgroup still refuses does
``STANDIN_CUDA_CHECKPOINT_REMAP``     ``1``: ``--help`` lists ``--device-map`` (driver 580)

Run it as ``python standin_cuda_checkpoint.py ARGS``; :func:`install` writes an executable
wrapper named ``cuda-checkpoint`` that does so.
"""

from __future__ import annotations

import fcntl
import json
import os
import stat
import sys
import tempfile
import time


def install(folder: str) -> str:
    """Write an executable ``cuda-checkpoint`` in ``folder`` that runs this stand-in; returns its path."""
    path = os.path.join(folder, "cuda-checkpoint")
    with open(path, "w") as f:
        f.write(f"#!/bin/sh\n# a stand-in for NVIDIA's cuda-checkpoint, for tests\nexec {sys.executable} {os.path.abspath(__file__)} \"$@\"\n")
    os.chmod(path, os.stat(path).st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


def calls(folder: str) -> list[dict]:
    """Every call recorded so far, in order."""
    try:
        with open(os.path.join(folder, "calls.jsonl")) as f:
            return [json.loads(line) for line in f if line.strip()]
    except FileNotFoundError:
        return []


def _load(path: str, default):
    try:
        with open(path) as f:
            return json.load(f)
    except (FileNotFoundError, ValueError):
        return default


def _save(path: str, data) -> None:
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".standin-")
    with os.fdopen(fd, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)


def main(argv: list[str]) -> int:
    folder = os.environ.get("STANDIN_CUDA_CHECKPOINT_DIR") or tempfile.gettempdir()
    fail = {a for a in os.environ.get("STANDIN_CUDA_CHECKPOINT_FAIL", "").split(",") if a}
    sim = os.environ.get("STANDIN_CUDA_CHECKPOINT_SIM_STATE", "")
    args: dict[str, str] = {}
    for i, a in enumerate(argv):
        if a.startswith("--"):
            nxt = argv[i + 1] if i + 1 < len(argv) else ""
            args[a] = "" if nxt.startswith("--") else nxt
    if "--help" in argv:
        print("usage: cuda-checkpoint --action {lock,checkpoint,restore,unlock} --pid PID [--timeout MS]"
              + (" [--device-map OLD=NEW,...]" if os.environ.get("STANDIN_CUDA_CHECKPOINT_REMAP") == "1" else "")
              + "\n       cuda-checkpoint --get-state --pid PID")
        return 0
    action = args.get("--action") or ("get-state" if "--get-state" in argv else "")
    pid = int(args.get("--pid", "0") or 0)
    with open(os.path.join(folder, "standin.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        with open(os.path.join(folder, "calls.jsonl"), "a") as log:
            log.write(json.dumps({"time": time.time(), "action": action, "pid": pid, "argv": argv}) + "\n")
        if action in fail:
            print(f"cuda-checkpoint: {action} failed for process {pid} (the stand-in was asked to fail)", file=sys.stderr)
            return 1
        once = {a for a in os.environ.get("STANDIN_CUDA_CHECKPOINT_FAIL_ONCE", "").split(",") if a}
        failed_path = os.path.join(folder, "failed-once.json")
        failed = _load(failed_path, [])
        if action in once and f"{action}:{pid}" not in failed:
            _save(failed_path, [*failed, f"{action}:{pid}"])
            print(f"cuda-checkpoint: {action} failed for process {pid}: Operation not permitted (the stand-in fails it once)", file=sys.stderr)
            return 1
        try:
            os.kill(pid, 0)
        except OSError:
            print(f"cuda-checkpoint: no process {pid}", file=sys.stderr)
            return 1
        states_path = os.path.join(folder, "states.json")
        states = _load(states_path, {})
        state = states.get(str(pid), {"state": "running", "memory": []})
        if action == "get-state":
            print(state["state"])
            return 0
        want = {"lock": "running", "checkpoint": "locked", "restore": "checkpointed", "unlock": "locked"}.get(action)
        if want is None:
            print(f"cuda-checkpoint: unknown action {action!r}", file=sys.stderr)
            return 2
        if state["state"] != want:
            print(f"cuda-checkpoint: process {pid} is {state['state']}, cannot {action}", file=sys.stderr)
            return 1
        if action in ("checkpoint", "restore") and sim:
            gpus = _load(sim, {"utilization": {}, "processes": {}})
            procs = gpus.setdefault("processes", {})
            if action == "checkpoint":  # GPU memory -> host memory: the device no longer lists the process
                state["memory"] = []
                for dev, plist in procs.items():
                    state["memory"] += [{"device": dev, **p} for p in plist if p.get("pid") == pid]
                    plist[:] = [p for p in plist if p.get("pid") != pid]
            else:
                mapping = dict(kv.split("=", 1) for kv in args.get("--device-map", "").split(",") if "=" in kv)
                for entry in state["memory"]:
                    dev = mapping.get(entry["device"], entry["device"])
                    procs.setdefault(dev, []).append({k: v for k, v in entry.items() if k != "device"})
                state["memory"] = []
            _save(sim, gpus)
        state["state"] = {"lock": "locked", "checkpoint": "checkpointed", "restore": "locked", "unlock": "running"}[action]
        states[str(pid)] = state
        _save(states_path, states)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
