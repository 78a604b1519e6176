"""Is the notebook idle-reclaim target attainable at all? The oracle frontier.

Evaluates idle-reclaim rules on the notebook sessions of the trace sample, under the same
session model as ``jupyter gpulease simulate --trace notebook`` (sessions from
``notebook_sessions``, a session keeps its GPU ``LINGER`` after its last burst, a reclaim is
regretted when the next burst comes within 10 min of it). It leaves out the queue: under
gpulease a returning session waits about a minute on average, so session timing is nearly
that of the trace. Three kinds of rule:

- fixed timeout T (what the replay's sweep runs);
- ORACLE X: reclaim at the start of an idle gap exactly when that gap will exceed X
  (knows the future; an upper bound for any predictor);
- HINDSIGHT TABLE: one timeout per (burst index 0/1/2/3+, length of the burst just ended
  short <=5 min / mid <=30 min / long), chosen on the very sessions it is scored on, for a
  range of trade-offs. It uses more than an online rule may (the whole trace), so it bounds
  what a predictor with these features could reach.

Run from the repository root: ``python benchmarks/sim/idle_oracle.py > benchmarks/sim/idle_oracle.txt``
"""

from __future__ import annotations

import math
import os
import statistics as st
from collections import Counter

from jupyter_gpulease.core.idle import REGRET_WINDOW_S
from jupyter_gpulease.sim.traces import SAMPLE_FILES, default_traces_dir, load_notebook_events
from jupyter_gpulease.sim.workload import _merge, notebook_sessions

LINGER = 3600.0
REGRET = REGRET_WINDOW_S
CANDIDATES = [0, 30, 60, 120, 180, 300, 600, 900, 1800, 3600]


def sessions():
    path = os.path.join(os.environ.get("GPULEASE_TRACES") or default_traces_dir(), SAMPLE_FILES["notebook"])
    wl = notebook_sessions(load_notebook_events(path), session_gap_s=LINGER)
    out = []  # per session: busy seconds, [(feature key, gap after the burst; inf = session over)]
    for j in wl.jobs:
        iv = [(s, s + d) for s, d in _merge(j.bursts)]
        busy = sum(e - s for s, e in iv)
        items = []
        for k, (s, e) in enumerate(iv):
            gap = iv[k + 1][0] - e if k + 1 < len(iv) else math.inf
            length = e - s
            items.append(((min(k, 3), "short" if length <= 300 else ("mid" if length <= 1800 else "long")), gap))
        out.append((busy, items))
    return out


def score(sess, timeout_of):
    """(median busy/held per session, regretted share of reclaims, reclaims) of a rule."""
    per, reclaims, regretted = [], 0, 0
    for busy, items in sess:
        idle = 0.0
        for key, gap in items:
            t = timeout_of(key, gap)
            if gap == math.inf:
                if t < LINGER:
                    idle += t
                    reclaims += 1
                else:
                    idle += LINGER
            elif t < gap:
                idle += t
                reclaims += 1
                regretted += gap <= t + REGRET
            else:
                idle += gap
        per.append(busy / (busy + idle))
    return st.median(per), (regretted / reclaims if reclaims else 0.0), reclaims


def hindsight_table(sess, lam):
    keys = sorted({k for _, items in sess for k, _ in items})
    cost = {k: Counter() for k in keys}
    for busy, items in sess:
        for key, gap in items:
            for t in CANDIDATES:
                held = min(t, LINGER) if gap == math.inf else min(gap, t)
                cost[key][t] += held / busy + lam * (t < gap <= t + REGRET)
    return {k: min(CANDIDATES, key=lambda t: cost[k][t]) for k in keys}


def main() -> None:
    sess = sessions()
    print(f"notebook sessions: {len(sess)}; median bursts per session: {st.median(len(i) for _, i in sess):g}")
    print("targets: median busy/held per session >= 0.75 AND regretted reclaims < 10%\n")
    print(f"{'rule':<34}{'busy/held med':>14}{'regretted':>11}{'reclaims':>10}  both targets")

    def row(label, r):
        ok = r[0] >= 0.75 and r[1] < 0.10
        print(f"{label:<34}{r[0]:>14.3f}{100 * r[1]:>10.1f}%{r[2]:>10}  {'MET' if ok else 'no'}")

    for m in (2, 5, 10, 15, 20, 30, 45):
        row(f"fixed {m} min", score(sess, lambda k, g, t=m * 60: t))
    for m in (5, 10, 20, 30):
        row(f"oracle: reclaim iff gap > {m} min", score(sess, lambda k, g, x=m * 60: 0 if g > x else math.inf))
    for lam in (0.5, 1, 2, 4, 8, 16, 64):
        tab = hindsight_table(sess, lam)
        row(f"hindsight table (lambda {lam:g})", score(sess, lambda k, g, tab=tab: tab[k]))


if __name__ == "__main__":
    main()
