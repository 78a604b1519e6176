"""What the per-device figures cost a scrape of the broker's /metrics, and the broker's event loop
per device sample.

Run:  python benchmarks/bench_metrics.py [--gpus 8,64,1024] [--rounds 20]

The broker samples devices itself only where its backend sees them from its own machine (``nvml``
on the GPU node, ``simulated``): a node's GPUs, 8 or 16; the larger sizes show how the cost grows.
A device sample lands between every two scrapes here, so every scrape rebuilds the sampled
families (their cache does not hit: the worst case).

For each pool size (simulated GPUs, eight per node, every GPU held by an active lease whose
server sent a heartbeat, a few XIDs counted) it times, in the same process and alternately:

- ``scrape, without device figures``: a broker with ``device_sample_interval = 0`` (the baseline:
  leases, queue, pool, counters, as before);
- ``scrape, with device figures``: the same pool and leases with the broker's own device sample
  (utilization, memory, temperature and slowdown, power, driver health, XIDs, cordons,
  maintenance, lease idle time);
- ``on the loop``: of a scrape, the gathering of the figures (the rest, the text, is written in a
  worker thread);
- ``a device sample on the loop``: the part of one device sample that runs on the event loop (keeping the
  sample, counting XIDs, the listeners: the health keeper's judgement is started there); the
  backend's own sample runs in a worker thread and is not counted.

A scrape is :meth:`BrokerMetrics.render` (gathering on the loop, the text written in a thread);
the figure is its median and 95th percentile wall time.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

from traitlets.config import Config

from jupyter_gpulease.broker.app import GPULeaseBroker


class Clock:
    def __init__(self):
        self.t = 1_700_000_000.0

    def now(self):
        return self.t


def make(tmp: Path, n: int, interval: float) -> GPULeaseBroker:
    c = Config()
    c.GPULeaseBroker.db_url = f"sqlite:///{tmp / f'b-{n}-{interval}.sqlite'}"
    c.GPULeaseBroker.device_backend = "simulated"
    c.GPULeaseBroker.devices = {"gpus": [{"node": f"n{i}", "model": "A100-SXM4-80GB", "count": 8, "memory_mib": 81920} for i in range(n // 8)]}
    c.GPULeaseBroker.bind_url = "http://127.0.0.1:0"
    c.GPULeaseBroker.base_url = "/services/gpulease/"
    c.GPULeaseBroker.config_file = ""
    c.GPULeaseBroker.tick_interval = 3600
    c.GPULeaseBroker.device_sample_interval = interval
    c.GPULeaseBroker.unleased_check_interval = 0
    c.GPULeaseBroker.reconcile_interval = 0
    app = GPULeaseBroker(config=c, clock=Clock())
    app.initialize([])
    return app


async def fill(app: GPULeaseBroker, n: int) -> None:
    from jupyter_gpulease.core.request import Ask, parse_request

    m = app.manager
    for i in range(n):
        d = await m.request(Ask(request=parse_request({"gpus": 1, "model": "A100*"}), user=f"user{i % 200}", groups=("physics",),
                                duration_s=3600), actor=f"user{i % 200}")
        await m.heartbeat(d["id"], {"t": 100.0, "gpu_busy": False, "last_gpu_activity": 40.0, "devices": {}})
    active = sum(1 for d in m.committed.values() if d["state"] == "active")
    assert active == n, f"{active} of {n} leases active"
    if app.telemetry is not None:
        gpus = m.inventory()
        for g in gpus[: max(1, n // 100)]:
            app.backend.inject_xid(g.uuid, 79 if g.index % 2 else 13)
        await app.telemetry.sample()


async def run(sizes: list[int], rounds: int) -> list[dict]:
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in sizes:
            base, full = make(Path(tmp), n, 0), make(Path(tmp), n, 15.0)
            for app in (base, full):
                await app.manager.start()
                await fill(app, n)
            times = {"without": [], "with": [], "gather_without": [], "gather_with": [], "loop": []}
            samples = await asyncio.get_running_loop().run_in_executor(None, full.backend.sample)
            for _ in range(rounds):
                for name, app in (("without", base), ("with", full)):
                    if app.telemetry is not None:
                        app.telemetry.observe(samples)  # a new sample since the last scrape
                    t0 = time.perf_counter()
                    body = await app.metrics.render()
                    times[name].append(time.perf_counter() - t0)
                    if app.telemetry is not None:
                        t0 = time.perf_counter()
                        app.telemetry.observe(samples)
                        times["loop"].append(time.perf_counter() - t0)
                    t0 = time.perf_counter()
                    list(app.metrics.registry.collect())  # the part on the event loop
                    times["gather_" + name].append(time.perf_counter() - t0)
            sizes_kb = {}
            for name, app in (("without", base), ("with", full)):
                sizes_kb[name] = len(await app.metrics.render()) / 1024
            for app in (base, full):
                await app.manager.close()
            row = {"gpus": n, **{k: (statistics.median(v) * 1000, sorted(v)[int(0.95 * (len(v) - 1))] * 1000) for k, v in times.items()}, "kb": sizes_kb}
            out.append(row)
            print(f"{n:>6} GPUs  scrape without device figures {row['without'][0]:7.1f} ms (p95 {row['without'][1]:6.1f}; on the loop {row['gather_without'][0]:6.1f}; "
                  f"{sizes_kb['without']:5.0f} KiB)   with {row['with'][0]:7.1f} ms (p95 {row['with'][1]:6.1f}; on the loop {row['gather_with'][0]:6.1f}; "
                  f"{sizes_kb['with']:5.0f} KiB)   a device sample on the loop {row['loop'][0]:5.2f} ms", flush=True)
            del body
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpus", default="8,64,1024")
    ap.add_argument("--rounds", type=int, default=20)
    args = ap.parse_args()
    print(f"command: python benchmarks/bench_metrics.py --gpus {args.gpus} --rounds {args.rounds}")
    asyncio.run(run([int(x) for x in args.gpus.split(",")], args.rounds))


if __name__ == "__main__":
    main()
