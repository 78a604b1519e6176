"""The price of short lease steps on the contended Alibaba replay.

A lease of a tier runs at most ``max_duration_s`` before it must be extended, and an extension
is refused while someone entitled to it waits for its GPUs. That step length is what lets a
node drain for a multi-GPU request: with the default 24 h production step, work on a node can
hold it for a day; with a 1 h step every node drains within about an hour once a large request
reserves it. The price is work cut at its step end and queued again (the replay's assumption:
its user resubmits the rest). This script replays the same workload and pool as
``alibaba_8x8_c4`` (8 nodes x 8 GPUs, seed 0, trace days 115-, arrivals compressed 4x) with the
production and experiment tiers' step set to each value in turn (the learning tier is
preemptible and keeps its 4 h step), each with aging off, 30 (the default), 60 and 90 min,
then the replayed setting (1 h, 30 min) without short grants and with other multi-GPU aging,
and the replayed setting at other loads, and prints,
beside static+backfill, the first wait of each pod (what the targets are stated on) and every
wait of a pod added up (first wait plus the waits after each cut or preemption). Run from the
repository root:

    python benchmarks/sim/step_sweep.py > benchmarks/sim/step_sweep.txt
"""

from __future__ import annotations

import os
import sys
from dataclasses import replace

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.dirname(__file__))

from setting import alibaba_contended

from jupyter_gpulease.core.policy import DEFAULT_TIERS, HOUR
from jupyter_gpulease.sim import policies as P
from jupyter_gpulease.sim.replay import replay
from jupyter_gpulease.sim.report import summarize

STEPS_H = (1, 2, 4, 8, None)  # None: the default steps
AGING_MIN = (None, 30, 60, 90)  # None: aging off; 30: the default
LOADS = (3, 3.5, 4.5, 5)  # arrival compressions for the load check


def stepped(step_h: float | None, aging_min: float | None, **flags) -> P.SimPolicy:
    """The batch policy with the non-preemptible tiers' step set (None: the core default, up to
    24 h) and aging set (None: off); ``flags`` set other core Policy fields."""
    base = P.gpulease_batch()
    tiers = {
        n: t if t.preemptible else (DEFAULT_TIERS[n] if step_h is None else replace(t, max_duration_s=step_h * HOUR, default_duration_s=min(step_h * HOUR, DEFAULT_TIERS[n].default_duration_s)))
        for n, t in base.policy.tiers.items()
    }
    name = f"{'default' if step_h is None else f'{step_h:g} h'} step, aging {'off' if aging_min is None else f'{aging_min:g} min'}"
    name += "".join(f", {k} {('on' if v else 'off') if isinstance(v, bool) else f'{v:g}'}" for k, v in flags.items())
    return replace(base, name=name, policy=replace(base.policy, tiers=tiers, aging_s=None if aging_min is None else aging_min * 60.0, **flags))


def main() -> None:
    wl, pool = alibaba_contended()
    print(f"trace: Alibaba v2023 shared sample, {len(wl.jobs)} pods; pool 8 nodes x 8 GPUs (seed 0); arrivals 4x; a cut or preempted pod is resubmitted")
    print("default steps: production 24 h, experiment 8 h, learning 4 h (preemptible, 30 s grace); the sweep sets production and experiment")
    print("aging: a lease queued this long is considered before newer leases of higher tiers, and may then refuse their extensions;")
    print("  multi_gpu_aging: a request for several whole GPUs ages after aging x this (0.5 in the batch policy; the core default is 1);")
    print("  short_grants: a preemptible lease may start on promised GPUs until the promise begins (default on).")
    print("  The replayed gpulease (batch pods) is '1 h step, aging 30 min' with the defaults.")
    print()
    hdr = (
        f"{'policy':<62}{'1st mean':>9}{'1st p95':>9}{'1st<=10m':>9}{'multi p95':>10}"
        f"{'| cuts':>7}{'preempt':>8}{'all mean':>9}{'all p95':>9}{'all<=10m':>9}{'multi p95':>10}  targets met"
    )
    print(" " * 62 + f"{'first wait of each pod':^45}| {'every wait of a pod added up, and what was cut':^50}")
    print(hdr)
    print("-" * len(hdr))
    base = summarize(replay(wl, pool, P.static_backfill()))
    bm, bp = base["wait"]["mean_s"], base["wait"]["p95_s"]
    variants = [P.static_backfill()] + [stepped(h, a) for h in STEPS_H for a in AGING_MIN]
    # what each mechanism adds, at the replayed setting (1 h steps, 30-min aging)
    variants += [
        stepped(1, 30, short_grants=False),
        stepped(1, 30, multi_gpu_aging=1.0),
        stepped(1, 30, multi_gpu_aging=0.25),
        stepped(1, 30, short_grants=False, multi_gpu_aging=1.0),
        stepped(None, 30, short_grants=False, multi_gpu_aging=1.0),
    ]
    for sp in variants:
        s = base if sp.name == "static+backfill" else summarize(replay(wl, pool, sp))
        w, t = s["wait"], s["wait_total"]
        met = []
        if sp.name != "static+backfill":
            first = [w["mean_s"] <= bm / 3, w["p95_s"] <= bp / 3, s["started_within_10min"] >= 0.99, s["wait_multi_gpu"]["p95_s"] < 3600]
            every = [t["mean_s"] <= bm / 3, t["p95_s"] <= bp / 3, s["total_wait_within_10min"] >= 0.99, s["wait_total_multi_gpu"]["p95_s"] < 3600]
            met = [f"first {sum(first)}/4", f"all {sum(every)}/4"]
        print(
            f"{sp.name:<62}{w['mean_s'] / 60:8.1f}m{w['p95_s'] / 60:8.1f}m{100 * s['started_within_10min']:8.1f}%{s['wait_multi_gpu']['p95_s'] / 3600:9.2f}h"
            f"{s['expired_before_done']:>7}{s['preemptions']:>8}{t['mean_s'] / 60:8.1f}m{t['p95_s'] / 60:8.1f}m{100 * s['total_wait_within_10min']:8.1f}%"
            f"{s['wait_total_multi_gpu']['p95_s'] / 3600:9.2f}h  {', '.join(met)}",
            flush=True,
        )
    print()
    print("targets (against static+backfill): mean and p95 at most a third, >= 99% within 10 min, multi-GPU p95 < 1 h")
    print()
    print("the replayed setting against static+backfill at other arrival compressions (same pool):")
    for c in LOADS:
        wl_c, _ = alibaba_contended(c)
        b = summarize(replay(wl_c, pool, P.static_backfill()))
        g = summarize(replay(wl_c, pool, P.gpulease_batch()))
        print(
            f"  {c:g}x: static+backfill mean {b['wait']['mean_s'] / 60:.1f}m p95 {b['wait']['p95_s'] / 60:.1f}m within 10 min {100 * b['started_within_10min']:.1f}% "
            f"multi p95 {b['wait_multi_gpu']['p95_s'] / 3600:.1f}h | gpulease mean {g['wait']['mean_s'] / 60:.1f}m p95 {g['wait']['p95_s'] / 60:.1f}m "
            f"within 10 min {100 * g['started_within_10min']:.1f}% multi p95 {g['wait_multi_gpu']['p95_s'] / 3600:.2f}h; every wait added up: "
            f"within 10 min {100 * g['total_wait_within_10min']:.1f}% multi p95 {g['wait_total_multi_gpu']['p95_s'] / 3600:.2f}h",
            flush=True,
        )


if __name__ == "__main__":
    main()
