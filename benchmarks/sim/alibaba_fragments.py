"""Where the free compute is while a 0.81-GPU share waits for room on the Alibaba replay.

Same workload and pool as ``alibaba_8x8_c4`` (8 nodes x 8 GPUs, seed 0, days 115-, arrivals
compressed 4x, gpulease with the 30 s batch-pod grace), once per share placement. After every
scheduling pass in which a 0.81 share waits while the pool has at least 0.81 GPU free in total
but no GPU with that much, it notes the total free compute, the largest free hole and how the
free compute of each GPU with any is spread. Run from the repository root:

    python benchmarks/sim/alibaba_fragments.py > benchmarks/sim/alibaba_fragments.txt
"""

import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.dirname(__file__))

from collections import Counter
from dataclasses import replace

from setting import alibaba_contended

from jupyter_gpulease.core import scheduler as cs
from jupyter_gpulease.core.model import LeaseState, SliceKind
from jupyter_gpulease.sim import policies as P
from jupyter_gpulease.sim.replay import replay

wl, pool = alibaba_contended()
for mode in ("best_fit", "fragmentation"):
    samples = []

    class S(cs.Scheduler):
        def tick(self, now, samples=samples):
            out = super().tick(now)
            w = [lease for lease in self.leases.values() if lease.state is LeaseState.QUEUED and lease.request.kind is SliceKind.SHARE and lease.request.share_milli == 810]
            if w:
                frees = [s.free_milli for s in self.pool.gpus.values() if not s.gpu.mig and s.gpu.healthy]
                if max(frees) < 810 and sum(frees) >= 810:
                    samples.append((sum(frees), max(frees), sum(1 for f in frees if f > 0), Counter(min(f // 100, 9) for f in frees if f > 0)))
            return out
    cs.Scheduler = S
    sp = P.gpulease_batch()
    sp = replace(sp, policy=replace(sp.policy, share_placement=mode))
    replay(wl, pool, sp, requeue_expired=True)
    cs.Scheduler = S.__mro__[1]
    print(f"share_placement={mode}: {len(samples)} passes with a 0.81 share waiting on fragmented room; median free compute {statistics.median(s[0] for s in samples) / 1000:g} GPU over {statistics.median(s[2] for s in samples):g} GPUs, largest hole {statistics.median(s[1] for s in samples) / 1000:g} GPU")
    agg = Counter()
    for s in samples:
        agg.update(s[3])
    tot = sum(agg.values())
    print("  GPUs with free compute, by how much (GPU), share of them:", ", ".join(f"{k / 10:.1f}-{(k + 1) / 10:.1f}: {v / tot:.0%}" for k, v in sorted(agg.items())))
