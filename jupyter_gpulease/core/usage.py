"""Usage accounting: fair-share usage with exponential decay, and GPU-hours in a rolling window."""

from __future__ import annotations

import math
from collections import defaultdict

from .model import MILLI


class FairShare:
    """Per-user GPU-seconds, decaying with a half-life: old use counts less.

    ``value(user, now) = Σ gpu_seconds_i · 2^(-(now - t_i) / half_life)``, kept as one
    (value, time) pair per user so that adding and reading are O(1).
    """

    def __init__(self, half_life_s: float):
        self.half_life_s = half_life_s
        self._v: dict[str, tuple[float, float]] = {}

    def _decay(self, dt: float) -> float:
        if self.half_life_s <= 0:
            return 0.0
        return math.exp(-math.log(2) * max(dt, 0.0) / self.half_life_s)

    def add(self, user: str, gpu_seconds: float, at: float) -> None:
        v, t = self._v.get(user, (0.0, at))
        if at >= t:
            self._v[user] = (v * self._decay(at - t) + gpu_seconds, at)
        else:  # an older record (history replay): decay it to the stored time
            self._v[user] = (v + gpu_seconds * self._decay(t - at), t)

    def value(self, user: str, now: float) -> float:
        v, t = self._v.get(user, (0.0, now))
        return v * self._decay(now - t)


class UsageWindow:
    """GPU-seconds per key (user or group) within a rolling period, from held intervals."""

    def __init__(self):
        self._intervals: dict[str, list[tuple[float, float, int]]] = defaultdict(list)

    def add(self, key: str, start: float, end: float, gpu_milli: int) -> None:
        if end > start and gpu_milli > 0:
            self._intervals[key].append((start, end, gpu_milli))

    def used_s(self, key: str, now: float, period_s: float) -> float:
        """GPU-seconds of ``key`` inside [now - period_s, now]; prunes what fell out of it."""
        lst = self._intervals.get(key)
        if not lst:
            return 0.0
        lo = now - period_s
        kept = [iv for iv in lst if iv[1] > lo]
        if len(kept) != len(lst):
            self._intervals[key] = kept
        return sum((min(e, now) - max(s, lo)) * m for s, e, m in kept if min(e, now) > max(s, lo)) / MILLI
