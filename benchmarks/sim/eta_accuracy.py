"""How good is a waiting lease's first ETA? (Is refusing a request whose ETA is past its wait
limit safe, or would it turn away requests that would have started in time?)

For every lease that had to wait in the contended Alibaba replay (the setting of
``alibaba_8x8_c4``, gpulease as replayed) and in the notebook replay (24 x 8, gpulease), compares
the ETA the scheduler gave right after the request with when the lease really started.

    python benchmarks/sim/eta_accuracy.py > benchmarks/sim/eta_accuracy.txt
"""

from __future__ import annotations

import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(__file__))

from setting import DESCRIPTION, alibaba_contended

from jupyter_gpulease.core import events as ev
from jupyter_gpulease.core import scheduler as core_scheduler
from jupyter_gpulease.sim import policies as P
from jupyter_gpulease.sim.replay import replay
from jupyter_gpulease.sim.traces import SAMPLE_FILES, default_traces_dir, load_notebook_events
from jupyter_gpulease.sim.workload import notebook_sessions, uniform_pool


def first_etas(wl, pool, sp, **kw):
    """(requested at, first ETA or None, granted at or None) of every lease that did not start at once."""
    first: dict[str, tuple[float, float | None]] = {}
    granted: dict[str, float] = {}
    base = core_scheduler.Scheduler

    class Probed(base):
        def tick(self, now):
            out = super().tick(now)
            for lease in self.leases.values():
                if lease.id not in first and lease.state.value == "queued":
                    first[lease.id] = (lease.created_at, self.eta(lease.id))
            return out

    def on_event(e):
        if e.kind == ev.GRANTED:
            granted[e.lease_id] = e.time

    core_scheduler.Scheduler = Probed
    try:
        replay(wl, pool, sp, on_event=on_event, **kw)
    finally:
        core_scheduler.Scheduler = base
    return [(t0, eta, granted.get(lid)) for lid, (t0, eta) in first.items()]


def report(name, rows):
    with_eta = [(t0, eta, g) for t0, eta, g in rows if eta is not None and g is not None]
    early = [eta - g for t0, eta, g in with_eta if g < eta - 1]
    late = [g - eta for t0, eta, g in with_eta if g > eta + 1]
    print(f"{name}: {len(rows)} leases waited; {len(with_eta)} had an ETA and started")
    if not with_eta:
        return
    print(f"  started before their first ETA: {len(early) / len(with_eta):.1%} (median {statistics.median(early) / 60 if early else 0:.0f} min early)")
    print(f"  started within a minute of it:  {1 - (len(early) + len(late)) / len(with_eta):.1%}")
    print(f"  started after it:               {len(late) / len(with_eta):.1%} (median {statistics.median(late) / 60 if late else 0:.0f} min late)")
    for limit in (600, 1800, 3600):
        past = [(t0, eta, g) for t0, eta, g in with_eta if eta - t0 > limit]
        if past:
            in_time = sum(1 for t0, eta, g in past if g - t0 <= limit)
            print(f"  first ETA more than {limit // 60} min away: {len(past)} leases; {in_time / len(past):.1%} of them started within {limit // 60} min anyway")


def main() -> int:
    wl, pool = alibaba_contended()
    print(f"Alibaba: {DESCRIPTION}; gpulease as replayed (batch-pod policy)")
    report("Alibaba", first_etas(wl, pool, P.gpulease_batch(), requeue_expired=True))
    events = load_notebook_events(os.path.join(default_traces_dir(), SAMPLE_FILES["notebook"]))
    nb = notebook_sessions(events, session_gap_s=3600)
    print("notebook: 24 nodes x 8 GPUs; gpulease")
    report("notebook", first_etas(nb, uniform_pool(24, 8), P.gpulease(), linger_s=3600))
    return 0


if __name__ == "__main__":
    sys.exit(main())
