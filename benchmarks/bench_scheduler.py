"""Time of one scheduling pass over large pools and long queues.

Run:  python benchmarks/bench_scheduler.py [--quick] [--out benchmarks/results/scheduler.json]

For each (GPUs, queued) size it builds a full pool (every GPU held by an active lease, a mix
of whole GPUs and shares like Alibaba's 2023 trace: 43% fractional), queues requests of the
same mix across three tiers and 200 users, then times:
- ``idle pass``: a pass where nothing frees up (the steady state of a saturated pool);
- ``churn pass``: a pass right after 1% of the active leases ended (grants + backfill);
- ``order``: materialising the full queue order (what positions for every lease cost).
Each figure is the median of several passes. The baseline, run side by side in the same
process, is the same pass with fair share off (plain arrival order within a tier).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import resource
import statistics
import sys
import time

from jupyter_gpulease.core.model import GPU, LeaseState
from jupyter_gpulease.core.policy import HOUR, Policy
from jupyter_gpulease.core.request import Ask, parse_request
from jupyter_gpulease.core.scheduler import Scheduler

MODELS = [("A100-SXM4-80GB", 81920), ("V100-SXM2-32GB", 32768), ("T4", 15360), ("L4", 24576)]
TIERS = ["production", "experiment", "learning"]


def make_pool(n_gpus: int) -> list[GPU]:
    out = []
    per_node = 8
    for node in range(n_gpus // per_node):
        model, mem = MODELS[node % len(MODELS)]
        for i in range(per_node):
            out.append(GPU(f"GPU-{node:05d}-{i}", f"node-{node:05d}", i, model, mem))
    return out


def random_request(rng: random.Random) -> dict:
    r = rng.random()
    if r < 0.43:
        return {"share": rng.choice([0.1, 0.25, 0.5, 0.75])}
    if r < 0.44:
        return {"gpus": rng.choice([2, 4, 8])}
    if r < 0.50:
        return {"gpus": 1, "model": rng.choice([m for m, _ in MODELS])}
    return {"gpus": 1}


def build(n_gpus: int, n_queued: int, fair: bool, seed: int = 1) -> tuple[Scheduler, float]:
    rng = random.Random(seed)
    pol = Policy(fair_share=fair, confirm_timeout_s=None)
    s = Scheduler(make_pool(n_gpus), pol)
    now = 1_000_000.0
    # fill the pool: submit until nothing more fits, then tick once
    for i in range(int(n_gpus * 1.3)):
        lease = s.new_lease(Ask(user=f"u{i % 200}", request=parse_request(random_request(rng)), tier=rng.choice(TIERS), duration_s=rng.uniform(0.5, 4) * HOUR), now)
        s.submit(lease, now)
    s.tick(now)
    for lease in list(s.leases.values()):
        if lease.state is LeaseState.QUEUED:
            s.release(lease.id, now)
    for lease in s.leases.values():  # fair share has history to work with
        lease.granted_at -= rng.uniform(0, HOUR)
    for _ in range(n_queued):
        lease = s.new_lease(Ask(user=f"u{rng.randrange(200)}", request=parse_request(random_request(rng)), tier=rng.choice(TIERS), duration_s=rng.uniform(0.25, 4) * HOUR), now + 1)
        s.submit(lease, now + 1)
    return s, now + 2


def bench(n_gpus: int, n_queued: int, fair: bool, repeat: int) -> dict:
    s, now = build(n_gpus, n_queued, fair)
    idle, order = [], []
    for _ in range(repeat):  # a pass, then the full queue order as of that pass (what positions for every lease cost)
        t = time.perf_counter()
        s.schedule(now)
        idle.append(time.perf_counter() - t)
        t = time.perf_counter()
        s.queue()
        order.append(time.perf_counter() - t)
    idle, order = statistics.median(idle), statistics.median(order)
    # churn: end 1% of active leases, then one pass grants into the room
    churn = []
    grants = 0
    rng = random.Random(7)
    for k in range(repeat):
        active = [lease for lease in s.leases.values() if lease.state is LeaseState.ACTIVE]
        for lease in rng.sample(active, max(1, len(active) // 100)):
            s.release(lease.id, now + k)
        t = time.perf_counter()
        evs = s.schedule(now + k)
        churn.append(time.perf_counter() - t)
        grants += sum(1 for e in evs if e.kind == "granted")
    return {
        "gpus": n_gpus,
        "queued": n_queued,
        "fair_share": fair,
        "active_leases": sum(1 for lease in s.leases.values() if lease.state is LeaseState.ACTIVE),
        "idle_pass_ms": round(idle * 1000, 2),
        "churn_pass_ms": round(statistics.median(churn) * 1000, 2),
        "grants_per_churn_pass": round(grants / repeat, 1),
        "full_order_ms": round(order * 1000, 2),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small sizes only (a smoke run)")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--out", default="benchmarks/results/scheduler.json")
    a = ap.parse_args(argv)
    sizes = [(1000, 10_000), (1000, 100_000), (10_000, 10_000), (10_000, 100_000)]
    if a.quick:
        sizes = [(1000, 10_000)]
    rows = []
    for g, q in sizes:
        for fair in (True, False):
            r = bench(g, q, fair, a.repeat)
            rows.append(r)
            print(
                f"{g:>6} GPUs {q:>7} queued fair_share={fair!s:<5}  idle pass {r['idle_pass_ms']:>8.2f} ms   "
                f"churn pass {r['churn_pass_ms']:>8.2f} ms ({r['grants_per_churn_pass']:.0f} grants)   full order {r['full_order_ms']:>8.2f} ms",
                flush=True,
            )
    rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    cmd = "python benchmarks/bench_scheduler.py" + (" --quick" if a.quick else "")
    result = {
        "command": cmd,
        "python": sys.version.split()[0],
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "max_rss_mib": round(rss_mib, 1),
        "rows": rows,
    }
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"max RSS of the process: {rss_mib:.0f} MiB")
    print(f"saved {a.out}  (command: {cmd})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
