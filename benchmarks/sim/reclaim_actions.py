"""Idle reclaim that keeps work: suspend (cuda-checkpoint) against restart and fixed timeouts.

The notebook replay of ``notebook_24x8`` (24 nodes x 8 GPUs, the Adobe notebook trace, one hour
of linger), with the idle reclaim's effect on the kernel modelled: after a *suspend* the
returning cell waits for a GPU (its former one first, ahead of new requests of its tier) plus a
restore; after a *restart* it waits for a GPU plus a reload of the kernel's state. The
assumptions (restore and reload times, which kernels can be suspended) are printed with the
results. Targets: per-session median busy/held >= 0.75 (static: 0.30) with a returning cell's
extra delay (wait for a GPU + restore) <= 30 s mean and <= 2 min p95, and no kernel state lost
where suspend applies.

    python benchmarks/sim/reclaim_actions.py > benchmarks/sim/reclaim_actions.txt
"""

from __future__ import annotations

import os
import sys
from dataclasses import replace

from jupyter_gpulease.core.idle import IdleRule, IdleSettings
from jupyter_gpulease.sim import policies as P
from jupyter_gpulease.sim.replay import replay
from jupyter_gpulease.sim.report import summarize
from jupyter_gpulease.sim.traces import SAMPLE_FILES, default_traces_dir, load_notebook_events
from jupyter_gpulease.sim.workload import notebook_sessions, uniform_pool

LINGER_S = 3600.0


def policies() -> list[P.SimPolicy]:
    fixed = lambda make, minutes, tag: replace(make(IdleRule(timeout_s=minutes * 60)), name=f"{tag} fixed {minutes:g} min")  # noqa: E731
    server = IdleSettings()
    return [
        P.static(),
        P.gpulease(),  # the server extension's default configuration (learnt, suspend)
        P.gpulease_release(),  # the GPU taken back, the kernel's state not modelled
        P.gpulease_restart(),  # the default idle settings with reclaim_action = "restart": a regret weighs 30 min
        *(fixed(P.gpulease_restart, m, "restart") for m in (2, 5, 10, 30)),
        P.gpulease_suspend(),  # the default, and the broker's resume_priority on
        replace(P.gpulease(server.changed(gpu_idle_regret_suspend=600)), name="gpulease, regret 10 min"),
        replace(P.gpulease(server.changed(gpu_idle_timeout=1800)), name="gpulease, 30 min until first gap"),
        *(fixed(P.gpulease, m, "suspend") for m in (1, 2, 5, 10, 30)),
        P.gpulease_suspend(multi_gpu=False),
    ]


def main() -> int:
    events = load_notebook_events(os.path.join(default_traces_dir(), SAMPLE_FILES["notebook"]))
    wl = notebook_sessions(events, session_gap_s=LINGER_S)
    pool = uniform_pool(24, 8)
    multi = sum(1 for j in wl.jobs if j.gpu_milli > 1000)
    print(f"notebook trace: {len(wl.jobs)} sessions ({multi} on more than one GPU), pool 24 x 8 GPUs, linger {LINGER_S / 60:g} min (as notebook_24x8)")
    print(f"ASSUMPTION: restore after a suspend {P.RESTORE_S:g} s per kernel; reload after a restart {P.RELOAD_S / 60:g} min (state lost)")
    print("gpulease: the server extension's default configuration (" + IdleSettings().describe() + "); "
          "its learnt timeout weighs a regretted reclaim by what the reclaim really does (suspend 2 min, restart 30 min)")
    for sp in policies():
        print(f"policy {sp.name}: idle {sp.describe_idle()}; reclaim {sp.reclaim_action}"
              + (f", multi-GPU kernels {'suspended' if sp.suspend_multi_gpu else 'restarted'}" if sp.reclaim_action == "suspend" else "")
              + ("; resume priority" if sp.policy.resume_priority else ""))
    print()
    head = f"{'policy':40s} {'busy/held':>9s} {'reclaims':>8s} {'regretted':>9s} {'back: mean':>10s} {'p95':>7s} {'state lost':>10s} {'wait/cell':>9s}  targets"
    print(head)
    print("-" * len(head))
    for sp in policies():
        nb = summarize(replay(wl, pool, sp, linger_s=LINGER_S))["notebook"]
        bh, mean_d, p95_d, lost = nb["busy_held_per_session_median"], nb["resume_delay_mean_s"], nb["resume_delay_p95_s"], nb["kernel_state_lost"]
        met = []
        if bh >= 0.75:
            met.append("busy/held")
        if nb["reclaims"] and mean_d <= 30 and p95_d <= 120:
            met.append("delay")
        if sp.reclaim_action == "suspend" and lost == 0:
            met.append("no state lost")
        print(
            f"{sp.name:40s} {bh:9.3f} {nb['reclaims']:8d} {nb['regretted_share']:9.1%} {mean_d:9.1f}s {p95_d:6.0f}s {lost:10d} {nb['wait_per_burst_mean_s']:8.1f}s  {', '.join(met) or '-'}",
            flush=True,
        )
    print()
    print("back: a cell that comes back after an idle reclaim: its wait for a GPU plus the restore (suspend) or reload (restart);")
    print("state lost: reclaims after which the kernel had to start again; wait/cell: every wait for a GPU spread over all cells.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
