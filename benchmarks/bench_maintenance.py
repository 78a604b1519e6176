"""What maintenance windows cost a scheduling pass: the same saturated pool and queue with no
window and with windows on 10% of the nodes (half under way, half starting in an hour), side by
side in one run.

Run:  python benchmarks/bench_maintenance.py [--quick] [--out benchmarks/results/maintenance.json]

Reuses the pool, the request mix and the queue of benchmarks/bench_scheduler.py. Figures are
the median of ``--repeat`` passes: an idle pass (nothing frees up) and a churn pass (1% of the
active leases ended just before: grants and backfill around the windows).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_scheduler import build

from jupyter_gpulease.core.maintenance import MaintenanceWindow
from jupyter_gpulease.core.model import LeaseState


def windows_for(s, now: float) -> list[MaintenanceWindow]:
    nodes = sorted({g.node for g in s.inventory.values()})[::10]
    return [MaintenanceWindow(f"w{i}", now - 600 if i % 2 else now + 3600, now + 3 * 3600, "bench", nodes=frozenset({n})) for i, n in enumerate(nodes)]


def bench(n_gpus: int, n_queued: int, with_windows: bool, repeat: int) -> dict:
    s, now = build(n_gpus, n_queued, True)
    if with_windows:
        s.set_maintenance(windows_for(s, now))
    idle = []
    for _ in range(repeat):
        t = time.perf_counter()
        s.schedule(now)
        idle.append(time.perf_counter() - t)
    churn, grants = [], 0
    rng = random.Random(7)
    for k in range(repeat):
        active = [lease for lease in s.leases.values() if lease.state is LeaseState.ACTIVE]
        for lease in rng.sample(active, max(1, len(active) // 100)):
            s.release(lease.id, now + k)
        t = time.perf_counter()
        evs = s.schedule(now + k)
        churn.append(time.perf_counter() - t)
        grants += sum(1 for e in evs if e.kind == "granted")
    return {"gpus": n_gpus, "queued": n_queued, "windows": len(s.windows), "idle_pass_ms": round(statistics.median(idle) * 1000, 2),
            "churn_pass_ms": round(statistics.median(churn) * 1000, 2), "grants_per_churn_pass": round(grants / repeat, 1)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--out", default="benchmarks/results/maintenance.json")
    a = ap.parse_args(argv)
    sizes = [(1000, 10_000)] if a.quick else [(1000, 10_000), (10_000, 10_000)]
    rows = []
    for g, q in sizes:
        for with_windows in (False, True):
            r = bench(g, q, with_windows, a.repeat)
            rows.append(r)
            print(f"{g:>6} GPUs {q:>7} queued {r['windows']:>4} windows  idle pass {r['idle_pass_ms']:>8.2f} ms   "
                  f"churn pass {r['churn_pass_ms']:>8.2f} ms ({r['grants_per_churn_pass']:.0f} grants)", flush=True)
    cmd = "python benchmarks/bench_maintenance.py" + (" --quick" if a.quick else "") + (f" --repeat {a.repeat}" if a.repeat != 5 else "")
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w") as f:
        json.dump({"command": cmd, "python": sys.version.split()[0], "machine": f"{platform.machine()}, {os.cpu_count()} CPUs", "rows": rows}, f, indent=2)
    print(f"saved {a.out}  (command: {cmd})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
