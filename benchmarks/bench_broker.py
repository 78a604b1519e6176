"""Broker benchmarks: REST request-to-grant latency on loopback, and memory holding many leases.

    python benchmarks/bench_broker.py [--requests 2000] [--leases 100000] [--out benchmarks/results/broker.json]

1. Latency: an in-process broker (SQLite file, WAL, synchronous=FULL) on 127.0.0.1; one
   client POSTs a lease that is granted at once, then releases it; p50/p99 of the POST
   (request to grant, including the commit) and of the release. The hub's token check is
   left out (the broker caches it per token; with a hub it adds one lookup per new token).
   Baselines, interleaved in the same loop so both see the same machine: a read of the same
   lease (``GET api/leases/{id}``: HTTP, auth and JSON without a commit), and the same grant
   on a broker whose SQLite commits skip the fsync (``synchronous=OFF``), which shows what
   durability costs.
2. Memory: the broker's process RSS before and after holding ``--leases`` live leases
   (1 000 active on 1 000 GPUs, the rest queued), and the time of one scheduling pass over them.

Figures are printed and saved as JSON; nothing here asserts on them.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from brokerutil import _fake_authenticate, broker_url, make_broker
from jupyter_gpulease.broker import handlers
from jupyter_gpulease.broker.manager import SystemClock
from jupyter_gpulease.client import BrokerClient
from jupyter_gpulease.core.request import Ask, parse_request


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(p / 100 * (len(xs) - 1)))]


async def latency(tmp: Path, n: int) -> dict:
    handlers.APIHandler.authenticate = _fake_authenticate  # no hub in this benchmark
    pool = [{"node": "n1", "model": "A100-SXM4-80GB", "count": 8, "memory_mib": 81920}]
    app = make_broker(tmp, SystemClock(), pool=pool, db_name="latency.sqlite")
    fast = make_broker(tmp, SystemClock(), pool=pool, db_name="latency-nosync.sqlite", sqlite_synchronous="OFF")
    await app.start_async()
    await fast.start_async()
    c = BrokerClient(broker_url(app), "alice")
    cf = BrokerClient(broker_url(fast), "alice")
    grant, release, read, grant_nosync = [], [], [], []
    try:
        for _ in range(50):  # warm up
            for cl in (c, cf):
                lease = await cl.request_lease({"gpus": 1})
                await cl.release(lease["id"])
        for _ in range(n):
            t0 = time.perf_counter()
            lease = await c.request_lease({"gpus": 1})
            t1 = time.perf_counter()
            assert lease["state"] == "active"
            await c.get_lease(lease["id"])
            t2 = time.perf_counter()
            await c.release(lease["id"])
            t3 = time.perf_counter()
            lf = await cf.request_lease({"gpus": 1})
            t4 = time.perf_counter()
            await cf.release(lf["id"])
            grant.append((t1 - t0) * 1000)
            read.append((t2 - t1) * 1000)
            release.append((t3 - t2) * 1000)
            grant_nosync.append((t4 - t3) * 1000)
    finally:
        await app.stop_async()
        await fast.stop_async()
    return {
        "requests": n,
        "grant_ms_p50": round(statistics.median(grant), 3),
        "grant_ms_p99": round(pct(grant, 99), 3),
        "release_ms_p50": round(statistics.median(release), 3),
        "release_ms_p99": round(pct(release, 99), 3),
        "baseline_read_ms_p50": round(statistics.median(read), 3),
        "baseline_read_ms_p99": round(pct(read, 99), 3),
        "baseline_grant_without_fsync_ms_p50": round(statistics.median(grant_nosync), 3),
        "baseline_grant_without_fsync_ms_p99": round(pct(grant_nosync, 99), 3),
    }


async def memory(tmp: Path, n: int) -> dict:
    gpus = 1000
    app = make_broker(tmp, SystemClock(), pool=[{"node": f"n{i}", "model": "A100-SXM4-80GB", "count": 8, "memory_mib": 81920} for i in range(gpus // 8)], db_name="memory.sqlite")
    m = app.manager
    await m.start()
    before = rss_mib()
    sched, now = m.scheduler, m.now()
    t0 = time.perf_counter()
    events = []
    for i in range(n):
        lease = sched.new_lease(Ask(user=f"user{i % 500}", request=parse_request({"gpus": 1})), now, lease_id=f"bench{i:06d}")
        events += sched.submit(lease, now)
    t_submit = time.perf_counter() - t0
    t0 = time.perf_counter()
    events += sched.tick(now)
    t_tick = time.perf_counter() - t0
    t0 = time.perf_counter()
    for i in range(0, len(events), 5000):
        await m._persist(events[i : i + 5000])
    t_store = time.perf_counter() - t0
    del events  # measure what the broker holds, not this script's list
    gc.collect()
    t0 = time.perf_counter()
    sched.tick(now + 1)
    t_tick2 = time.perf_counter() - t0
    after = rss_mib()
    active = sum(1 for lease in sched.leases.values() if lease.state.value == "active")
    await m.close()
    return {
        "leases": n,
        "active": active,
        "queued": n - active,
        "rss_before_mib": round(before, 1),
        "rss_after_mib": round(after, 1),
        "rss_per_1000_leases_mib": round((after - before) / n * 1000, 2),
        "submit_s": round(t_submit, 2),
        "first_pass_s": round(t_tick, 3),
        "next_pass_s": round(t_tick2, 3),
        "persist_s": round(t_store, 2),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--leases", type=int, default=100_000)
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "broker.json"))
    args = p.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="bench-broker-"))
    cmd = "python benchmarks/bench_broker.py" + "".join(f" {a}" for a in (argv if argv is not None else sys.argv[1:]))
    result = {"command": cmd, "python": sys.version.split()[0], "cpus": os.cpu_count()}
    result["latency"] = asyncio.run(latency(tmp, args.requests))
    print(json.dumps(result["latency"], indent=2))
    result["memory"] = asyncio.run(memory(tmp, args.leases))
    print(json.dumps(result["memory"], indent=2))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"saved {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
