"""What the long waits of gpulease on the contended Alibaba replay wait for.

Same workload and pool as ``alibaba_8x8_c4`` (8 nodes x 8 GPUs, seed 0, days 115-, arrivals
compressed 4x). Each queued lease's time is split, pass by pass, into what held it back:

- ``grace``: lower-tier leases are being preempted for it; it waits out their grace
- ``reserved``: it would fit now, but the free slices are promised to a lease ahead (backfill guard)
- ``no room``: nothing fits even ignoring promises (``fragmented``: enough free share in the pool
  but on no single GPU; ``split``: enough idle GPUs but on no single node)

Variants: the batch-pod policy the replay uses (1-hour steps, 30 s grace), the same with the
core's 10-min grace, and, for the trade-off only, the batch policy without aging. Run from the repository root:

    python benchmarks/sim/alibaba_causes.py > benchmarks/sim/alibaba_causes.txt
"""

from __future__ import annotations

import os
import statistics
import sys
from collections import Counter, defaultdict
from dataclasses import replace

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.dirname(__file__))

from setting import alibaba_contended

from jupyter_gpulease.core import scheduler as core_scheduler
from jupyter_gpulease.core.model import LeaseState, SliceKind
from jupyter_gpulease.sim import policies as P
from jupyter_gpulease.sim.replay import replay
from jupyter_gpulease.sim.report import summarize

TEN_MIN = 600.0


def shape(job) -> str:
    return "multi-GPU" if job.multi_gpu else ("share" if job.gpu_milli < 1000 else "1 GPU")


class Probe:
    """Wraps the core scheduler's tick to note, after each pass, what every queued lease waits for."""

    def __init__(self):
        self.time = defaultdict(Counter)  # lease id -> state -> seconds
        self.last: dict[str, tuple[float, str]] = {}
        self.first_lease: dict[str, str] = {}  # job id -> its first lease id
        self.node_samples: list[int] = []  # emptiest node's GPUs with non-preemptible work, while a multi-GPU lease waits
        self._last_sample = -1e18
        probe = self
        base = core_scheduler.Scheduler

        class Probed(base):
            def submit(self, lease, now, actor=""):
                probe.first_lease.setdefault(lease.user, lease.id)
                return super().submit(lease, now, actor)

            def tick(self, now):
                for lid, (t0, st) in probe.last.items():
                    probe.time[lid][st] += now - t0
                probe.last.clear()
                out = super().tick(now)
                multi_waits = False
                for lease in self.leases.values():
                    if lease.state is not LeaseState.QUEUED:
                        continue
                    req = lease.request
                    if req.kind is SliceKind.GPU and req.gpus > 1:
                        multi_waits = True
                    if self.pool.place(req) is not None:
                        st = "reserved"
                    elif self.preempting_for(lease.id) is not None:
                        st = "grace"
                    elif req.kind is SliceKind.SHARE and sum(self.pool.free_milli_by_model.values()) >= req.share_milli:
                        st = "no room (fragmented)"
                    elif req.kind is SliceKind.GPU and sum(self.pool.idle_by_model.values()) >= req.gpus:
                        st = "no room (split)"
                    else:
                        st = "no room"
                    probe.last[lease.id] = (now, st)
                if multi_waits and now - probe._last_sample >= 1800:
                    probe._last_sample = now
                    pre = self.pool.preemptible_of
                    probe.node_samples.append(
                        min(sum(1 for s in lst if any(not pre.get(h, False) for h in s.holders)) for lst in self.pool.by_node.values())
                    )
                return out

        self.cls = Probed


def main() -> int:
    wl, pool = alibaba_contended()
    batch = P.gpulease_batch()
    variants = [
        ("gpulease, 10-min grace (core default)", replace(batch, policy=replace(batch.policy, tiers={**batch.policy.tiers, "learning": P.gpulease().policy.tiers["learning"]}))),
        (f"gpulease, {P.BATCH_GRACE_S:g} s grace (batch pods; as replayed)", batch),
        ("  same, aging off (trade-off only)", replace(batch, policy=replace(batch.policy, aging_s=None))),
    ]
    print(f"trace: Alibaba v2023 shared sample, {len(wl.jobs)} pods; pool 8 nodes x 8 GPUs (seed 0); arrivals 4x; a cut pod is resubmitted")
    orig = core_scheduler.Scheduler
    for label, sp in variants:
        probe = Probe()
        core_scheduler.Scheduler = probe.cls
        try:
            r = replay(wl, pool, sp)
        finally:
            core_scheduler.Scheduler = orig
        s = summarize(r)
        recs = r.records
        n = len(recs)
        print()
        print(label)
        print(
            f"  wait mean {s['wait']['mean_s'] / 60:.1f} min, p95 {s['wait']['p95_s'] / 60:.1f} min, started within 10 min {100 * s['started_within_10min']:.1f}% "
            f"({sum(1 for x in recs if x.first_wait > TEN_MIN)} pods over 10 min; 1% is {n // 100}), multi-GPU p95 {s['wait_multi_gpu']['p95_s'] / 3600:.1f} h"
        )
        print(
            f"  preemptions {r.counters['preempted']}, time-limit cuts {r.counters['expired']} (all resubmitted), "
            f"waits of resubmitted/preempted pods: {s.get('resubmit_waits', 0)}, mean {s.get('resubmit_wait_mean_s', 0) / 60:.1f} min"
        )
        for title, cut in (("first waits over the 3.1-min p95 target", 186.0), ("first waits over 10 min", TEN_MIN)):
            groups: dict[tuple, Counter] = defaultdict(Counter)
            count: Counter = Counter()
            for x in recs:
                if x.first_wait is None or x.first_wait <= cut:
                    continue
                k = (x.job.qos, shape(x.job))
                count[k] += 1
                groups[k].update(probe.time[probe.first_lease[x.job.id]])
            print(f"  {title}: {sum(count.values())} pods; minutes spent per cause:")
            for k in sorted(groups, key=lambda k: -count[k]):
                parts = ", ".join(f"{st} {v / 60:.0f}" for st, v in groups[k].most_common())
                print(f"    {k[0]:<10} {k[1]:<9} {count[k]:>4} pods: {parts}")
        if probe.node_samples:
            print(
                f"  while a multi-GPU pod waited (half-hourly, {len(probe.node_samples)} samples): the emptiest node held non-preemptible work on "
                f"median {statistics.median(probe.node_samples):g} of 8 GPUs (0 in {sum(1 for v in probe.node_samples if v == 0)} samples)"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
