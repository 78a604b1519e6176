"""What one check for unleased GPU use costs the broker.

A real broker application (in this process, SQLite file, the tests' token-names-the-user auth)
on 8 simulated GPUs whose state file lists N real processes (``sleep``, each with a
``JUPYTERHUB_USER`` of its own among 20 users, half of the users holding a lease); every
process is on a GPU, so the check reads every owner from /proc and compares them with the leases.
Reported, per N, the median over the rounds of:

* the sample: the device backend's sample and every owner read from /proc (a worker thread);
* the decision: the rule and the tracker, on the event loop (what the loop pays per check);
* the whole check, as the periodic callback runs it (the sample, the decision, and the commit of
  the events of the first check).

    .venv/bin/python benchmarks/bench_unleased.py [--processes 50 200] [--rounds 20]

Saves the figures to benchmarks/results/unleased.json.
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

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

from brokerutil import _fake_authenticate, broker_url, make_broker  # noqa: E402
from jupyter_gpulease.broker import handlers  # noqa: E402
from jupyter_gpulease.broker.manager import SystemClock  # noqa: E402
from jupyter_gpulease.client import BrokerClient  # noqa: E402
from jupyter_gpulease.core.unleased import find_unleased  # noqa: E402
from serverutil import SimGPUs  # noqa: E402

POOL = [{"node": "n1", "model": "L4", "count": 8, "memory_mib": 23034}]
USERS = [f"user{i}" for i in range(20)]


async def measure(n: int, rounds: int, folder: Path) -> dict:
    sim = SimGPUs(str(folder / f"sim-{n}.json"), POOL)
    app = make_broker(folder, SystemClock(), pool=POOL, db_name=f"b-{n}.sqlite", devices=sim.config, unleased_check_interval=3600)
    await app.start_async()
    procs = []
    try:
        for u in USERS[:8]:
            await BrokerClient(broker_url(app), u).request_lease({"gpus": 1, "duration_s": 3600})
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
        for i in range(n):
            p = subprocess.Popen(["sleep", "600"], env={**env, "JUPYTERHUB_USER": USERS[i % len(USERS)]})
            procs.append(p)
            sim.backend.add_process(sim.uuids[i % len(sim.uuids)], p.pid, 256)
        det = app.unleased
        t0 = time.perf_counter()
        await det.check()  # the first: every finding is new, its events committed
        first = time.perf_counter() - t0
        sample, decide, whole = [], [], []
        for _ in range(rounds):
            t0 = time.perf_counter()
            processes, seen = det.sample(det.devices())
            sample.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            det.tracker.observe(app.manager.now(), find_unleased(processes, app.manager.live()), seen)
            decide.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            await det.check()
            whole.append(time.perf_counter() - t0)
        return {"processes": n, "findings": len(app.unleased.findings), "first_check_ms": round(1000 * first, 2),
                "sample_ms_median": round(1000 * statistics.median(sample), 2),
                "decision_on_loop_ms_median": round(1000 * statistics.median(decide), 3),
                "check_ms_median": round(1000 * statistics.median(whole), 2)}
    finally:
        for p in procs:
            p.kill()
            p.wait()
        await app.stop_async()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--processes", type=int, nargs="+", default=[50, 200])
    ap.add_argument("--rounds", type=int, default=20)
    args = ap.parse_args()
    handlers.APIHandler.authenticate = _fake_authenticate
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in args.processes:
            folder = Path(tmp) / str(n)
            folder.mkdir()
            r = asyncio.run(measure(n, args.rounds, folder))
            print(json.dumps(r))
            out.append(r)
    result = {"what": "one check for unleased GPU use: 8 simulated GPUs, N real processes of 20 users, 8 of them holding a lease",
              "cpus": os.cpu_count(), "rounds": args.rounds, "results": out}
    path = HERE / "results" / "unleased.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"saved {path}")


if __name__ == "__main__":
    main()
