"""A month of GPU use written into a broker's store by the broker itself, for the usage pages' tests.

A real broker (in-process, fake hub auth: the token names the user) on a clock moved by hand
grants leases asked through its REST API, receives heartbeats with the server extension's usage
(cumulative busy and idle seconds per device and per kernel, memory peaks, the notebook's path)
and ends them; its recorder writes the usage records in the same commits. The store is then
left for the test's own broker (a real hub's service, the demo's) to read.

* alice (group physics) asks for a whole A100 80 GB for 8 h, 20 times over the last 20 days;
  each lease lasts 2 h, computes 30 min and never holds more than 9 GB: she over-asks.
* bob (group chemistry) asks for 1 × L4 for 2 h, 6 times; each lasts 2 h and is busy 1.5 h at
  20 GB: he uses what he asks for.
* carol asks for half an L4 twice, 1 h each, busy 15 min.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path

import pytest

from brokerutil import ManualClock, broker_url, make_broker, patch_auth
from jupyter_gpulease.client import BrokerClient

A100 = "A100-SXM4-80GB"
POOL = [
    {"node": "n1", "model": A100, "count": 2, "memory_mib": 81920},
    {"node": "n2", "model": "L4", "count": 2, "memory_mib": 23034},
]
DAY = 86400.0


@dataclass(frozen=True)
class Plan:
    user: str
    ask: dict
    count: int
    every_s: float  # between the starts of two leases
    held_s: float
    busy_s: float
    mem_mib: int
    notebook: str


PLANS = (
    Plan("alice", {"gpus": 1, "model": A100, "duration_s": 8 * 3600}, 20, DAY, 2 * 3600, 1800, 9000, "thesis/train.ipynb"),
    Plan("bob", {"gpus": 1, "model": "L4", "duration_s": 2 * 3600}, 6, 3 * DAY, 2 * 3600, 1.5 * 3600, 20000, "md/run.ipynb"),
    Plan("carol", {"share": 0.5, "model": "L4", "duration_s": 3600}, 2, 7 * DAY, 3600, 900, 4000, "course/lab1.ipynb"),
)
HEARTBEATS = 4  # per lease, evenly over its time


def seed(store_dir: Path, now: float, *, db_name: str = "gpulease.sqlite") -> dict[str, dict[str, float]]:
    """Write the history into ``store_dir/db_name``; returns each user's GPU-seconds held and busy
    as the seed means them ({user: {"held": s, "busy": s}}, GPU-equivalents)."""
    clock = ManualClock(now - 21 * DAY)
    expected: dict[str, dict[str, float]] = {}

    async def main():
        app = make_broker(store_dir, clock, pool=POOL, db_name=db_name, confirm_timeout_s=0, heartbeat_timeout_s=DAY)
        await app.start_async()
        try:
            starts = sorted((now - 20.5 * DAY + i * p.every_s + n * 600, p) for n, p in enumerate(PLANS) for i in range(p.count))
            for t, p in starts:
                clock.t = max(clock.t, t)
                who = BrokerClient(broker_url(app), p.user)
                lease = await who.request_lease(dict(p.ask))
                assert lease["state"] == "active", lease
                slices = lease["placement"]["slices"]
                fraction = sum(s.get("share", 1.0) for s in slices)
                device = slices[0].get("mig_uuid") or slices[0]["gpu_uuid"]
                t0 = clock.t
                for k in range(1, HEARTBEATS + 1):
                    clock.t = t0 + p.held_s * k / HEARTBEATS
                    elapsed = p.held_s * k / HEARTBEATS
                    busy = min(elapsed, p.busy_s)  # computes first, then sits idle
                    mem = p.mem_mib
                    usage = {
                        "devices": {device: {"busy_s": busy, "idle_s": elapsed - busy, "mem_peak_mib": mem}},
                        "kernels": {f"{lease['id']}-k": {"busy_s": busy, "idle_s": elapsed - busy, "mem_peak_mib": mem,
                                                         "path": p.notebook, "name": Path(p.notebook).name}},
                    }
                    await who.heartbeat(lease["id"], usage)
                await who.release(lease["id"])
                e = expected.setdefault(p.user, {"held": 0.0, "busy": 0.0})
                e["held"] += p.held_s * fraction
                e["busy"] += p.busy_s * fraction
        finally:
            await app.stop_async()

    with pytest.MonkeyPatch.context() as mp:
        patch_auth(mp)
        asyncio.run(main())
    return expected
