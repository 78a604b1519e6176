"""The lease manager in process, no HTTP: its CPU per heartbeat (through the group commit) and
per lease read as the API shows it, side by side with a baseline build in the same run.

    python benchmarks/bench_manager.py [--base 2cef64c] [--leases 2000] [--heartbeats 20000] [--rounds 3]

Each build (``--base``: a ``git archive`` of that revision in a temporary folder; and this tree,
or ``--this-rev``) runs in its own process, alternately, ``--rounds`` times. A round: a manager
over a SQLite file (``synchronous=OFF``, so the figure is the broker's CPU, not the disk's) with
``--leases`` active leases on a pool of quarter-GPU shares, then ``--heartbeats`` heartbeats
from 200 concurrent callers (the group commit batches them), each with the usage a server
extension sends (its device and two kernels, as ``bench_broker.py``'s guard), then every live
lease read as the API shows it (``get``, ``lease_json``, ``warnings``) ``--reads`` times. A build
whose manager keeps usage records and durable counters does so here as in the broker (the
broker's own ``UsageRecorder`` and ``count_events``). The process's CPU time per call is
printed (median of the rounds); nothing is asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


async def one_round(leases: int, heartbeats: int, reads: int, folder: str) -> dict:
    from bench_broker import heartbeat_body

    from jupyter_gpulease.broker.manager import LeaseManager, SystemClock
    from jupyter_gpulease.core.policy import Policy
    from jupyter_gpulease.core.request import Ask, parse_request
    from jupyter_gpulease.core.scheduler import Scheduler
    from jupyter_gpulease.devices import get_backend
    from jupyter_gpulease.store import LeaseStore

    gpus = get_backend("simulated", {"gpus": [{"node": f"n{i}", "model": "A100", "count": 8, "memory_mib": 81920} for i in range(leases // 32 + 1)]}).inventory()
    sched = Scheduler(gpus, Policy(confirm_timeout_s=None))
    store = LeaseStore(f"sqlite:///{folder}/bench.sqlite", sqlite_synchronous="OFF")
    try:  # what the broker's manager records besides the leases, where this build has it
        from jupyter_gpulease.broker.metrics import count_events
        from jupyter_gpulease.broker.usage import UsageRecorder

        manager = LeaseManager(sched, store, clock=SystemClock(), count_totals=count_events, usage_recorder=UsageRecorder(write_s=300.0))
    except (ImportError, TypeError):
        manager = LeaseManager(sched, store, clock=SystemClock())
    await manager.start()
    granted = [await manager.request(Ask(user=f"u{i % 500}", request=parse_request({"share": 0.25}), duration_s=3600)) for i in range(leases)]
    ids = [d["id"] for d in granted]

    async def caller(k: int) -> None:
        for j in range(k, heartbeats, 200):
            i = j % leases
            await manager.heartbeat(ids[i], heartbeat_body(granted[i], time.time(), i)["usage"])

    t = time.process_time()
    await asyncio.gather(*(caller(k) for k in range(200)))
    hb = (time.process_time() - t) / heartbeats
    t = time.process_time()
    for _ in range(reads):
        for lid in ids:
            d = await manager.get(lid)
            manager.lease_json(d, viewer=d["user"], admin=False)
            manager.warnings(d)
    rd = (time.process_time() - t) / (reads * leases)
    await manager.close()
    return {"heartbeat_us": hb * 1e6, "read_us": rd * 1e6, "commits": manager.commits}


def child(args) -> None:
    with tempfile.TemporaryDirectory() as folder:
        print(json.dumps(asyncio.run(one_round(args.leases, args.heartbeats, args.reads, folder))))


def build(rev: str, into: Path) -> Path:
    into.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "jupyter_gpulease"], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base", default="2cef64c", help="git revision of the baseline build (default: the manager before it was split in parts)")
    p.add_argument("--this-rev", default=None, help="a git revision to measure instead of the working tree")
    p.add_argument("--leases", type=int, default=2000)
    p.add_argument("--heartbeats", type=int, default=20000)
    p.add_argument("--reads", type=int, default=5)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        child(args)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        builds = {f"base {args.base}": build(args.base, Path(tmp) / "base")}
        builds[f"this {args.this_rev}" if args.this_rev else "this tree"] = build(args.this_rev, Path(tmp) / "this") if args.this_rev else ROOT
        results: dict[str, list[dict]] = {name: [] for name in builds}
        for r in range(args.rounds):
            for name, src in (builds.items() if r % 2 == 0 else reversed(builds.items())):
                env = dict(os.environ, PYTHONPATH=str(src))
                out = subprocess.run([sys.executable, __file__, "--child", f"--leases={args.leases}", f"--heartbeats={args.heartbeats}",
                                      f"--reads={args.reads}"], check=False, env=env, cwd=tmp, capture_output=True, text=True)
                if out.returncode:
                    raise SystemExit(f"{name} failed:\n{out.stderr}")
                out = out.stdout
                results[name].append(json.loads(out.strip().splitlines()[-1]))
                f = results[name][-1]
                print(f"{name:>20} round {r + 1}: heartbeat {f['heartbeat_us']:.0f} µs CPU/call ({f['commits']} commits), "
                      f"read as the API shows it {f['read_us']:.1f} µs CPU/lease")
    for name, rows in results.items():
        print(f"{name:>20} (median of {len(rows)}): heartbeat {statistics.median(r['heartbeat_us'] for r in rows):.0f} µs, "
              f"read {statistics.median(r['read_us'] for r in rows):.1f} µs")
    print("python benchmarks/bench_manager.py " + " ".join(argv if argv is not None else sys.argv[1:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
