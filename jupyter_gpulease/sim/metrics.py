"""Metric arithmetic: percentiles, Jain's fairness index, time-weighted means of step series."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100) with linear interpolation between closest ranks
    (numpy's default); None for no values."""
    if not 0 <= q <= 100:
        raise ValueError("q must be within 0..100")
    xs = sorted(values)
    if not xs:
        return None
    if len(xs) == 1:
        return float(xs[0])
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = math.ceil(pos)
    if lo == hi:
        return float(xs[lo])
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def mean(values: Iterable[float]) -> float | None:
    xs = list(values)
    return sum(xs) / len(xs) if xs else None


def median(values: Sequence[float]) -> float | None:
    return percentile(values, 50)


def jain(values: Iterable[float]) -> float | None:
    """Jain's fairness index (sum x)^2 / (n * sum x^2): 1 when all equal, 1/n when one gets all.
    None for no values; 1.0 when all are zero."""
    xs = list(values)
    if not xs:
        return None
    sq = sum(x * x for x in xs)
    if sq == 0:
        return 1.0
    s = sum(xs)
    return s * s / (len(xs) * sq)


def share_within(values: Iterable[float], limit: float) -> float | None:
    """Fraction of values <= limit."""
    xs = list(values)
    if not xs:
        return None
    return sum(1 for x in xs if x <= limit) / len(xs)


def wait_summary(waits: Sequence[float]) -> dict[str, float | int | None]:
    """Mean, p50, p95, p99 and max of waits (seconds), and how many."""
    return {
        "n": len(waits),
        "mean_s": mean(waits),
        "p50_s": percentile(waits, 50),
        "p95_s": percentile(waits, 95),
        "p99_s": percentile(waits, 99),
        "max_s": max(waits) if waits else None,
    }


class StepSeries:
    """A piecewise-constant quantity over time (GPUs allocated, queue length, …).

    ``set(t, v)`` records that the value is ``v`` from ``t`` on; times must not go back.
    """

    def __init__(self, t0: float = 0.0, v0: float = 0.0):
        self.times: list[float] = [t0]
        self.values: list[float] = [v0]

    def set(self, t: float, v: float) -> None:
        if t < self.times[-1]:
            raise ValueError("StepSeries times must not go back")
        if v == self.values[-1]:
            return
        if t == self.times[-1]:
            self.values[-1] = v
            if len(self.values) > 1 and self.values[-2] == v:
                self.times.pop()
                self.values.pop()
            return
        self.times.append(t)
        self.values.append(v)

    def add(self, t: float, dv: float) -> None:
        self.set(t, self.values[-1] + dv)

    @property
    def value(self) -> float:
        return self.values[-1]

    def integral(self, start: float, end: float) -> float:
        """Integral of the series over [start, end]."""
        if end <= start:
            return 0.0
        total = 0.0
        n = len(self.times)
        for i in range(n):
            a = self.times[i]
            b = self.times[i + 1] if i + 1 < n else math.inf
            lo, hi = max(a, start), min(b, end)
            if hi > lo:
                total += self.values[i] * (hi - lo)
        return total

    def time_mean(self, start: float, end: float) -> float | None:
        if end <= start:
            return None
        return self.integral(start, end) / (end - start)

    def sample(self, start: float, end: float, points: int = 500) -> tuple[list[float], list[float]]:
        """Values at ``points`` evenly spaced times (for plots)."""
        if points < 2 or end <= start:
            return [start], [self.at(start)]
        import bisect

        ts = [start + (end - start) * i / (points - 1) for i in range(points)]
        vs = []
        for t in ts:
            i = bisect.bisect_right(self.times, t) - 1
            vs.append(self.values[max(i, 0)] if i >= 0 else 0.0)
        return ts, vs

    def at(self, t: float) -> float:
        import bisect

        i = bisect.bisect_right(self.times, t) - 1
        return self.values[i] if i >= 0 else 0.0
