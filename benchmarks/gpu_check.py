#!/usr/bin/env python3
"""Check the NVML device backend on a real GPU machine and save what it saw as JSON.

    python benchmarks/gpu_check.py [--out gpu_check.json] [--seconds 8] [--mib 2048] [--no-torch]

What it checks:
  1. NVML starts; every GPU is listed with UUID, model and memory; MIG instances with profiles.
  2. A sample has memory figures for every device, utilization where the device reports it.
  3. Every device reports temperature, power draw and limit, and health (figures a device does
     not support are listed under "not_reported", not failed).
  4. With torch importable: a child process allocates ``--mib`` MiB on GPU 0 (or on the first
     MIG instance when GPU 0 is in MIG mode) and multiplies matrices; the sample taken while it
     runs must list that PID on that device holding at least the allocation, with its own SM
     utilization above zero where the driver reports it, and the server extension's attribution
     must give those figures to the worker as it would to a kernel. Inside a container NVML may
     report host PIDs: then the PID checks are reported as "pid namespace differs" rather than
     failed.
  5. The worker stops computing but keeps its memory: the extension's idle rule must see it
     GPU-idle (its SM utilization under the 5% threshold) within a few seconds.
  6. Where NVIDIA's ``cuda-checkpoint`` is installed (``--cuda-checkpoint``, default on PATH): the
     idle worker is suspended the way the extension does it (lock, checkpoint), NVML must then
     show its memory gone from the GPU; it is restored (restore, unlock), its memory must be back,
     and the worker checks that its tensors still hold their values. Times and the memory moved
     are reported.
  7. Sampling cost: the mean wall time of a full sample, printed (a figure, not a pass mark).

Exit status: 0 all checks passed, 1 a check failed, 2 no usable NVIDIA driver (the message says why).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import textwrap
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))

from jupyter_gpulease.devices import DeviceUnavailable, get_backend

WORKER = textwrap.dedent("""
    import sys, time, torch
    mib, seconds = int(sys.argv[1]), float(sys.argv[2])
    x = torch.empty(mib * 1024 * 1024 // 4, dtype=torch.float32, device="cuda")
    x.fill_(1.0)
    a = torch.randn(4096, 4096, device="cuda")
    print("ready", flush=True)
    end = time.time() + seconds
    while time.time() < end:
        a = (a @ a).clamp_(-1, 1)
    torch.cuda.synchronize()
    print("idle", flush=True)  # holds its memory, computes nothing, until told
    sys.stdin.readline()
    ok = float(x.sum().item()) == float(x.numel())  # its data survived (a suspend/restore round trip)
    a = (a @ a).clamp_(-1, 1)
    torch.cuda.synchronize()
    print("verified" if ok else "corrupted", flush=True)
""")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="gpu_check.json", help="where to save the JSON report (default: %(default)s)")
    ap.add_argument("--seconds", type=float, default=8.0, help="how long the torch worker computes (default: %(default)s)")
    ap.add_argument("--mib", type=int, default=2048, help="MiB the torch worker allocates (default: %(default)s)")
    ap.add_argument("--no-torch", action="store_true", help="skip the process-attribution, idle and cuda-checkpoint checks")
    ap.add_argument("--cuda-checkpoint", default="cuda-checkpoint", help="the cuda-checkpoint executable (default: on PATH)")
    args = ap.parse_args(argv)

    report: dict = {"checks": {}, "host": os.uname().nodename}
    backend = get_backend("nvml", {})
    try:
        gpus = backend.inventory()
    except DeviceUnavailable as e:
        print(f"gpu_check: {e}", file=sys.stderr)
        return 2
    checks = report["checks"]
    report["devices"] = [g.to_dict() for g in gpus]
    checks["found_gpus"] = bool(gpus)
    checks["every_gpu_has_uuid_model_memory"] = all(g.uuid and g.model and g.memory_mib > 0 for g in gpus)
    checks["mig_instances_have_profiles"] = all(m.profile != "unknown" and m.memory_mib > 0 for g in gpus for m in g.mig)

    t0 = time.perf_counter()
    samples = backend.sample()
    n = 5
    for _ in range(n - 1):
        samples = backend.sample()
    report["sample_seconds_mean"] = (time.perf_counter() - t0) / n
    report["idle_sample"] = {u: s.to_dict() for u, s in samples.items()}
    checks["every_device_sampled"] = all(g.uuid in samples and all(m.uuid in samples for m in g.mig) for g in gpus)
    checks["memory_figures_present"] = all(s.memory_total_mib for s in samples.values())
    whole = [s for s in samples.values() if not s.is_mig]
    report["not_reported"] = sorted({f"{name} ({s.uuid})" for s in whole for name in ("temperature_c", "power_w", "power_limit_w")
                                     if getattr(s, name) is None})
    report["health"] = {s.uuid: s.health.to_dict() for s in whole}
    checks["health_reported"] = all(isinstance(s.health.ok, bool) for s in whole)

    if gpus and not args.no_torch:
        report["torch"] = _torch_check(backend, gpus, args, checks)

    backend.close()
    report["ok"] = all(v is True or v == "pid namespace differs" for v in checks.values())
    text = json.dumps(report, indent=1, default=str)
    print(text)
    with open(args.out, "w", encoding="utf-8") as f:
        f.write(text)
    print(f"gpu_check: {'all checks passed' if report['ok'] else 'FAILED'}; "
          f"sample took {report['sample_seconds_mean'] * 1000:.1f} ms; report in {args.out}", file=sys.stderr)
    return 0 if report["ok"] else 1


def _torch_check(backend, gpus, args, checks) -> dict:
    try:
        import torch  # noqa: F401
    except ImportError:
        return {"skipped": "torch is not importable"}
    from jupyter_gpulease.core.idle import gpu_idle
    from jupyter_gpulease.server.attribution import KernelProcess, ProcessTree, attribute

    target = gpus[0].mig[0].uuid if gpus[0].mig else gpus[0].uuid
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=target)
    proc = subprocess.Popen([sys.executable, "-c", WORKER, str(args.mib), str(args.seconds)], env=env, start_new_session=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out: dict = {"device": target, "pid": proc.pid, "mib": args.mib}
    worker = [KernelProcess("worker", proc.pid, proc.pid)]  # what the extension knows of a kernel
    tree = ProcessTree()
    try:
        line = proc.stdout.readline().strip()
        if line != "ready":
            out["error"] = (line + proc.stderr.read())[-2000:]
            checks["torch_worker_started"] = False
            return out
        checks["torch_worker_started"] = True
        time.sleep(min(2.0, args.seconds / 2))  # let utilization build up over NVML's sample period
        s = backend.sample()
        dev = s.get(target)
        out["sample"] = dev.to_dict() if dev else None
        mine = [p for p in (dev.processes if dev else ()) if p.pid == proc.pid]
        if mine:
            checks["worker_pid_on_device"] = True
            used = mine[0].used_memory_mib
            checks["worker_memory_at_least_allocation"] = used is None or used >= args.mib
            if mine[0].sm_util_pct is not None:
                checks["worker_sm_utilization_while_busy"] = mine[0].sm_util_pct > 0
            else:
                out["sm_util_not_reported"] = True
            att = attribute({target: dev}, worker, tree)
            k = att.kernels["worker"]
            out["attributed"] = k.to_dict()
            checks["attributed_to_the_worker"] = k.pids == [proc.pid] and (k.memory_mib is None or k.memory_mib >= args.mib)
        elif dev and dev.processes:
            checks["worker_pid_on_device"] = "pid namespace differs"  # host PIDs inside a container
            out["seen_pids"] = [p.pid for p in dev.processes]
        else:
            checks["worker_pid_on_device"] = False
        if dev and not dev.is_mig:
            checks["utilization_reported_while_busy"] = dev.utilization_pct is not None and dev.utilization_pct > 0
        out["memory_used_mib_while_busy"] = dev.memory_used_mib if dev else None

        # it stops computing, keeps its memory: seen idle
        if proc.stdout.readline().strip() != "idle":
            checks["worker_went_idle"] = False
            return out
        seen_idle_after = None
        t_idle = time.monotonic()
        while time.monotonic() - t_idle < 15:
            time.sleep(0.5)
            dev = backend.sample().get(target)
            att = attribute({target: dev}, worker, tree) if dev else None
            k = att.kernels["worker"] if att else None
            if k is not None and k.holds_memory and gpu_idle(k.sm_util_pct, executing=False, threshold_pct=5.0):
                seen_idle_after = time.monotonic() - t_idle
                out["idle_figures"] = k.to_dict()
                break
        out["seen_idle_after_s"] = seen_idle_after
        checks["seen_idle_after_it_stops"] = seen_idle_after is not None
        out["cuda_checkpoint"] = _checkpoint_round_trip(backend, target, proc, args, checks)
        proc.stdin.write("go\n")
        proc.stdin.flush()
        result = proc.stdout.readline().strip()
        checks["worker_data_intact_after_all"] = result == "verified"
    finally:
        try:
            proc.wait(timeout=args.seconds + 120)
        except subprocess.TimeoutExpired:
            proc.kill()
    return out


def _checkpoint_round_trip(backend, target, proc, args, checks) -> dict:
    """Suspend and restore the idle worker with cuda-checkpoint, as the extension does."""
    import asyncio

    from jupyter_gpulease.server.checkpoint import CheckpointError, CudaCheckpoint, find_cuda_checkpoint, unavailable_reason

    path = find_cuda_checkpoint(args.cuda_checkpoint)
    reason = unavailable_reason(path, args.cuda_checkpoint, mig=target.startswith("MIG-"))
    if reason:
        return {"skipped": reason}
    cc = CudaCheckpoint(path, timeout_s=120)
    out: dict = {"executable": path}

    def held() -> int | None:
        dev = backend.sample().get(target)
        mine = [p for p in (dev.processes if dev else ()) if p.pid == proc.pid]
        return (mine[0].used_memory_mib or 0) if mine else 0

    out["memory_before_mib"] = held()
    try:
        out["device_map_supported"] = asyncio.run(cc.supports_device_map())
        t0 = time.perf_counter()
        asyncio.run(cc.suspend([proc.pid]))
        out["suspend_s"] = round(time.perf_counter() - t0, 3)
        out["state_after_suspend"] = asyncio.run(cc.state(proc.pid))
        out["memory_while_suspended_mib"] = held()
        checks["checkpoint_frees_the_gpu"] = out["memory_while_suspended_mib"] == 0
        t0 = time.perf_counter()
        asyncio.run(cc.restore([proc.pid]))
        out["restore_s"] = round(time.perf_counter() - t0, 3)
        out["memory_after_restore_mib"] = held()
        checks["restore_brings_the_memory_back"] = (out["memory_after_restore_mib"] or 0) >= (out["memory_before_mib"] or 0) * 0.9
    except CheckpointError as e:
        out["error"] = str(e)
        checks["cuda_checkpoint_round_trip"] = False
    out["memory_moved_mib"] = out.get("memory_before_mib")
    return out


if __name__ == "__main__":
    sys.exit(main())
