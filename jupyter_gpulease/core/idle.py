"""The idle rule: when a kernel's GPU counts as idle, and how long idleness is tolerated.

Pure: no clock, no I/O. The server extension applies it to each kernel at every sample; the
trace simulator applies it to each replayed session. Both call the same two pieces:

* :func:`gpu_idle` — is a kernel's GPU idle right now? Its processes keep the GPU's compute
  under ``threshold_pct`` and it is not executing a cell (unless ``reclaim_busy``: a kernel
  executing without using the GPU counts as idle too).
* :meth:`IdleRule.timeout` — how long an idle period may last before the GPU is taken back:
  a fixed timeout, or one learnt from the user's own earlier idle gaps (the time from the
  GPU falling idle to its next use), bounded by an admin minimum and maximum.

A *regretted* reclaim is one after which the GPU is needed again within
:data:`REGRET_WINDOW_S`: the learnt timeout weighs idle holding against those.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

REGRET_WINDOW_S = 600.0  # a reclaim is regretted when the GPU is needed again within this

# bins of a population gap histogram (seconds); the last bin holds session ends (inf)
GAP_EDGES: tuple[float, ...] = (30, 60, 90, 120, 180, 240, 300, 420, 600, 780, 900, 1200, 1500, 1800, 2400, 2700, 3000, 3600, 5400,
                                7200, 14400, 86400)
GAP_MID: tuple[float, ...] = (15.0, *((a + b) / 2 for a, b in itertools.pairwise(GAP_EDGES)), math.inf)


def gpu_idle(sm_util_pct: float | None, *, executing: bool, threshold_pct: float, reclaim_busy: bool = False) -> bool:
    """Whether a kernel's GPU is idle now.

    ``sm_util_pct``: the compute its processes keep busy (0–100; None: unknown — then only the
    execution state decides). A kernel that is executing a cell is busy unless
    ``reclaim_busy`` says that executing without using the GPU counts as idle.
    """
    if sm_util_pct is not None and sm_util_pct >= threshold_pct:
        return False
    # executing counts as work unless reclaim_busy says otherwise (and only where use is known)
    return not (executing and (not reclaim_busy or sm_util_pct is None))


@dataclass
class GapHistogram:
    """Idle gaps of many users (``math.inf``: a session that ended), for a learnt timeout's prior."""

    counts: list[int] = field(default_factory=lambda: [0] * (len(GAP_EDGES) + 1))
    n: int = 0

    def add(self, gap: float) -> None:
        self.counts[bisect.bisect_right(GAP_EDGES, gap)] += 1
        self.n += 1


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated ``q``-th percentile (0–100); None for no values."""
    if not values:
        return None
    xs = sorted(values)
    k = (len(xs) - 1) * q / 100.0
    lo = math.floor(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


@dataclass(frozen=True)
class IdleRule:
    """How long a GPU may sit idle before it is taken back.

    ``timeout_s``: fixed idle timeout (None: never). ``learn``: instead, learn each user's
    timeout from their own earlier gaps:

    - ``method="cost"`` (default): the timeout T from ``candidates_s`` (within ``min_s`` and
      ``max_s``) that minimises expected idle holding E[min(gap, T)] plus ``regret_cost_s`` ×
      P(T < gap <= T + 10 min), over the user's own gaps mixed with ``prior_weight``
      pseudo-gaps drawn from a population histogram when one is given. ``regret_cost_s`` says
      what one regretted reclaim is worth in seconds of idle holding.
    - ``method="quantile"``: the ``quantile`` of the earlier gaps times ``factor``, within
      [``min_s``, ``max_s``]; ``default_s`` until ``min_gaps`` gaps have been seen.
    """

    timeout_s: float | None = None
    learn: bool = False
    method: str = "cost"
    regret_cost_s: float = 1800.0
    prior_weight: float = 2.0
    candidates_s: tuple[float, ...] = (60, 120, 180, 300, 420, 600, 900, 1200, 1800, 2700, 3600)
    quantile: float = 90.0
    factor: float = 1.5
    min_s: float = 0.0
    max_s: float = math.inf
    min_gaps: int = 3
    default_s: float = 15 * 60.0

    def __post_init__(self):
        if self.method not in ("cost", "quantile"):
            raise ValueError(f"idle rule method must be 'cost' or 'quantile', got {self.method!r}")
        if self.timeout_s is not None and self.timeout_s < 0:
            raise ValueError(f"idle timeout must be at least 0 s, got {self.timeout_s:g}")
        if self.min_s > self.max_s:
            raise ValueError(f"idle timeout minimum {self.min_s:g} s is above the maximum {self.max_s:g} s")

    @property
    def active(self) -> bool:
        return self.learn or self.timeout_s is not None

    def _bounded(self, t: float) -> float:
        return min(self.max_s, max(self.min_s, t))

    def timeout(self, gaps: Sequence[float] = (), prior: GapHistogram | None = None) -> float | None:
        """The idle timeout in seconds for a user whose earlier gaps were ``gaps`` (None: never)."""
        if not self.learn:
            return self.timeout_s
        if self.method == "cost":
            return self._cost_timeout(gaps, prior)
        if len(gaps) < self.min_gaps:
            return self._bounded(self.timeout_s if self.timeout_s is not None else self.default_s)
        return self._bounded((percentile(gaps, self.quantile) or 0.0) * self.factor)

    def _cost_timeout(self, own: Sequence[float], prior: GapHistogram | None) -> float:
        w_prior = self.prior_weight if prior is not None and prior.n else 0.0
        n = len(own) + w_prior
        if n == 0:
            return self._bounded(self.default_s)
        candidates = [t for t in self.candidates_s if self.min_s <= t <= self.max_s] or [self._bounded(self.default_s)]
        best_t, best_c = candidates[-1], math.inf
        for t in candidates:
            hold = sum(min(g, t) for g in own)
            regret = sum(1 for g in own if t < g <= t + REGRET_WINDOW_S)
            if w_prior:
                h = r = 0.0
                for i, c in enumerate(prior.counts):
                    if not c:
                        continue
                    g = GAP_MID[i]
                    h += c * min(g, t)
                    if t < g <= t + REGRET_WINDOW_S:
                        r += c
                hold += w_prior * h / prior.n
                regret += w_prior * r / prior.n
            cost = (hold + self.regret_cost_s * regret) / n
            if cost < best_c - 1e-9:
                best_t, best_c = t, cost
        return best_t

    def describe(self) -> str:
        if self.learn and self.method == "cost":
            return (f"learnt per user: T minimising idle holding + {self.regret_cost_s / 60:g} GPU-min per regretted reclaim, "
                    f"over their own earlier gaps")
        if self.learn:
            return f"learnt per user: p{self.quantile:g} of their earlier gaps x {self.factor:g}"
        if self.timeout_s is None:
            return "never"
        return f"fixed {self.timeout_s / 60:g} min"
