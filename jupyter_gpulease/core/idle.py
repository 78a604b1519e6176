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
:data:`REGRET_WINDOW_S`: the learnt timeout weighs idle holding against those, and what one
weighs depends on what the reclaim really does to the kernel (:data:`STATE_KEPT`).

Every parameter an admin sets is declared once, on :class:`IdleSettings`: the server
extension's options (``c.GPUIdleRule.<name>``, jupyter_gpulease.server.idletimeout) and the
simulator's policy keys are derived from those declarations, and :meth:`IdleSettings.rule`
turns them into the :class:`IdleRule` for the reclaim action that will really happen.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any

from .settings import setting, settings_of

REGRET_WINDOW_S = 600.0  # a reclaim is regretted when the GPU is needed again within this

# reclaim actions after which the kernel's state is still there when its user comes back
# (suspend: restored from host memory; interrupt and notify leave the kernel as it was);
# every other action (restart, shutdown) throws the kernel's state away
STATE_KEPT = frozenset({"suspend", "interrupt", "notify"})

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


# CHOICE (benchmarks/sim/idle_defaults.txt): the defaults are the configuration whose replay of
# the notebook trace, with suspend, reaches the targets (per-session median busy/held >= 0.75, a
# returning cell's extra delay <= 30 s mean) on the shared window and on the other windows.
DEFAULT_CANDIDATES_S: tuple[float, ...] = (60.0, 120.0, 180.0, 300.0, 420.0, 600.0, 900.0, 1200.0, 1800.0, 2700.0, 3600.0)


@dataclass(frozen=True)
class IdleSettings:
    """The idle rule as an admin sets it: each field declared once (name, unit, default, help, range).

    The server extension has one option per field (same name); a simulator policy file has
    one key per field (same name). :meth:`rule` gives the :class:`IdleRule` for an action.
    """

    gpu_idle_threshold: float = setting(
        5.0, "A kernel's GPU counts as idle while its processes keep under this many percent of the GPU's compute busy "
        "(NVML per-process SM utilization). Example: 5.", unit="percent", minimum=0, maximum=100,
    )  # fmt: skip
    gpu_idle_timeout: float | None = setting(
        120.0, "Seconds a kernel may hold GPU memory while GPU-idle before it is reclaimed (and a lease no kernel uses, before "
        "it goes back); 0: never reclaim. With gpu_idle_timeout_learn this is the timeout until the user's first idle gap "
        "has been seen. Example: 120 (2 min).", unit="seconds", minimum=0, zero_is_off=True,
    )  # fmt: skip
    gpu_idle_timeout_learn: bool = setting(
        True, "Learn the timeout per user from their own earlier idle gaps (the time from the GPU falling idle to its next "
        "use): the candidate timeout that costs least in idle GPU holding plus the weight of each regretted reclaim (the GPU "
        "needed again within 10 min), between gpu_idle_timeout_min and gpu_idle_timeout_max. The gaps are kept in the "
        "user's Jupyter data directory. False: gpu_idle_timeout, fixed.",
    )  # fmt: skip
    gpu_idle_regret_suspend: float = setting(
        120.0, "What a regretted reclaim weighs in the learnt timeout, in seconds of idle GPU holding, when the reclaim keeps "
        "the kernel's state (suspend; also interrupt and notify): its user waits for a GPU and the restore. Example: 120.",
        unit="seconds", minimum=0,
    )  # fmt: skip
    gpu_idle_regret_restart: float = setting(
        1800.0, "What a regretted reclaim weighs in the learnt timeout, in seconds of idle GPU holding, when the reclaim throws "
        "the kernel's state away (restart or shutdown, also when suspend is not available and fallback_action restarts): its "
        "user reloads data and models. Example: 1800.", unit="seconds", minimum=0,
    )  # fmt: skip
    gpu_idle_timeout_candidates: tuple[float, ...] = setting(
        DEFAULT_CANDIDATES_S, "The timeouts the learnt rule chooses from, seconds (those within gpu_idle_timeout_min and "
        "gpu_idle_timeout_max). Example: [60, 120, 300, 600, 1800].", unit="seconds", above=0,
    )  # fmt: skip
    gpu_idle_timeout_min: float = setting(60.0, "Shortest learnt timeout, seconds (admin bound). Example: 60.", unit="seconds", minimum=0)
    gpu_idle_timeout_max: float = setting(4 * 3600.0, "Longest learnt timeout, seconds (admin bound). Example: 14400 (4 h).", unit="seconds", minimum=0)

    def __post_init__(self):
        for s in IDLE_SETTINGS:
            object.__setattr__(self, s.name, s.check(getattr(self, s.name)))
        if self.gpu_idle_timeout_min > self.gpu_idle_timeout_max:
            raise ValueError(f"gpu_idle_timeout_min ({self.gpu_idle_timeout_min:g} s) is above gpu_idle_timeout_max ({self.gpu_idle_timeout_max:g} s)")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> IdleSettings:
        """From a mapping of declared names (others: ValueError naming them)."""
        unknown = sorted(set(d) - set(IDLE_NAMES))
        if unknown:
            raise ValueError(f"unknown idle setting(s) {unknown}; known: {', '.join(IDLE_NAMES)}")
        return cls(**d)

    def to_dict(self) -> dict[str, Any]:
        return {s.name: list(v) if isinstance(v := getattr(self, s.name), tuple) else v for s in IDLE_SETTINGS}

    def changed(self, **kw) -> IdleSettings:
        return replace(self, **kw)

    def regret_cost_s(self, action: str) -> float:
        """What one regretted reclaim weighs when the reclaim really does ``action``."""
        return self.gpu_idle_regret_suspend if action in STATE_KEPT else self.gpu_idle_regret_restart

    def rule(self, action: str = "suspend") -> IdleRule:
        """The idle rule for a reclaim that really does ``action`` (after any fallback)."""
        t = self.gpu_idle_timeout
        if t is None:
            return IdleRule(timeout_s=None)
        if not self.gpu_idle_timeout_learn:
            return IdleRule(timeout_s=t)
        return IdleRule(
            timeout_s=t,
            learn=True,
            regret_cost_s=self.regret_cost_s(action),
            prior_weight=0.0,
            candidates_s=self.gpu_idle_timeout_candidates,
            min_s=self.gpu_idle_timeout_min,
            max_s=self.gpu_idle_timeout_max,
            default_s=t,
        )

    def describe(self, action: str = "suspend") -> str:
        r = self.rule(action)
        if r.learn:
            return (f"learnt per user: the timeout among {_minutes(r.candidates_s, r.min_s, r.max_s)} min minimising idle holding "
                    f"+ {r.regret_cost_s / 60:g} GPU-min per regretted reclaim ({action}), over their own earlier gaps; "
                    f"{r.default_s / 60:g} min until the first gap")
        return r.describe()


def _minutes(cands: Sequence[float], lo: float, hi: float) -> str:
    xs = [c for c in cands if lo <= c <= hi]
    return f"{xs[0] / 60:g}-{xs[-1] / 60:g}" if xs else "none"


IDLE_SETTINGS = settings_of(IdleSettings)
IDLE_NAMES = tuple(s.name for s in IDLE_SETTINGS)
IDLE_SETTING = {s.name: s for s in IDLE_SETTINGS}
assert {f.name for f in fields(IdleSettings)} == set(IDLE_NAMES)
