#!/usr/bin/env python3
"""Check the NVML device backend on a real GPU machine and save what it saw as JSON.

    python benchmarks/gpu_check.py [--out gpu_check.json] [--seconds 8] [--mib 2048] [--no-torch]

What it checks:
  1. NVML starts; every GPU is listed with UUID, model and memory; MIG instances with profiles.
  2. A sample has memory figures for every device, utilization where the device reports it.
  3. With torch importable: a child process allocates ``--mib`` MiB on GPU 0 (or on the first
     MIG instance when GPU 0 is in MIG mode) and multiplies matrices; the sample taken while it
     runs must list that PID on that device holding at least the allocation, and (whole GPUs)
     utilization above zero. Inside a container NVML may report host PIDs: then the PID check
     is reported as "pid namespace differs" rather than failed.
  4. Sampling cost: the mean wall time of a full sample, printed (a figure, not a pass mark).

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
""")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="gpu_check.json", help="where to save the JSON report (default: %(default)s)")
    ap.add_argument("--seconds", type=float, default=8.0, help="how long the torch worker computes (default: %(default)s)")
    ap.add_argument("--mib", type=int, default=2048, help="MiB the torch worker allocates (default: %(default)s)")
    ap.add_argument("--no-torch", action="store_true", help="skip the process-attribution check")
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
    target = gpus[0].mig[0].uuid if gpus[0].mig else gpus[0].uuid
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=target)
    proc = subprocess.Popen([sys.executable, "-c", WORKER, str(args.mib), str(args.seconds)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out: dict = {"device": target, "pid": proc.pid, "mib": args.mib}
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
        elif dev and dev.processes:
            checks["worker_pid_on_device"] = "pid namespace differs"  # host PIDs inside a container
            out["seen_pids"] = [p.pid for p in dev.processes]
        else:
            checks["worker_pid_on_device"] = False
        if dev and not dev.is_mig:
            checks["utilization_reported_while_busy"] = dev.utilization_pct is not None and dev.utilization_pct > 0
        out["memory_used_mib_while_busy"] = dev.memory_used_mib if dev else None
    finally:
        proc.wait(timeout=args.seconds + 60)
    return out


if __name__ == "__main__":
    sys.exit(main())
