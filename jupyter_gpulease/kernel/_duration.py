"""Durations as people write them, until the project's shared parser/formatter replaces this module."""

from __future__ import annotations

import re

_UNITS = {"d": 86400, "h": 3600, "m": 60, "min": 60, "s": 1}
_PART = re.compile(r"(\d+(?:\.\d+)?)\s*(d|h|min|m|s)")


def parse_duration(text: str) -> float:
    """'90m', '2h', '1h30m', '45s', '1.5h', '3600' -> seconds; ValueError for anything else."""
    t = str(text).strip().lower().replace(" ", "")
    if re.fullmatch(r"\d+(\.\d+)?", t):
        return float(t)
    pos, total = 0, 0.0
    for m in _PART.finditer(t):
        if m.start() != pos:
            break
        total += float(m.group(1)) * _UNITS[m.group(2)]
        pos = m.end()
    if not t or pos != len(t):
        raise ValueError(f"not a duration: {text!r} (write it as 90m, 2h, 1h30m or 45s)")
    return total


def format_duration(seconds: float) -> str:
    """Seconds -> '1 h 12 min', '14 min', '40 s'."""
    s = round(seconds)
    if s < 0:
        return "-" + format_duration(-s)
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min"
    h, m = divmod(s // 60, 60)
    if h < 48:
        return f"{h} h {m} min" if m else f"{h} h"
    d, h = divmod(h, 24)
    return f"{d} d {h} h" if h else f"{d} d"
