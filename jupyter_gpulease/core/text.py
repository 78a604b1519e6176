"""Durations and tables as people read and write them: one parser, one formatter, one table.

Every layer uses these (the scheduler's messages, the CLI, the spawn form, the admin page,
the simulator's report), so that a duration reads the same everywhere and whatever one part
prints, another accepts. No I/O, nothing of the project imported.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

MINUTE = 60.0
HOUR = 3600.0
DAY = 86400.0

_UNITS = {
    "s": 1.0, "sec": 1.0, "secs": 1.0, "second": 1.0, "seconds": 1.0,
    "m": MINUTE, "min": MINUTE, "mins": MINUTE, "minute": MINUTE, "minutes": MINUTE,
    "h": HOUR, "hr": HOUR, "hrs": HOUR, "hour": HOUR, "hours": HOUR,
    "d": DAY, "day": DAY, "days": DAY,
}  # fmt: skip
_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)\s*([a-z]+)")
_NUMBER = re.compile(r"\d+(?:\.\d*)?|\.\d+")
EXAMPLES = "90, 90s, 30m, 2h, 1h30m, 1.5h, 1d"


def parse_duration(text: str | float | int, *, negative: bool = False, unit: float = 1.0) -> float:
    """Seconds from what people write: ``90``, ``90s``, ``30m``, ``2h``, ``1h30m``, ``1.5 h``, ``1 h 12 min``, ``1d``.

    A bare number is in ``unit`` seconds (1: seconds; 60: minutes; 3600: hours). ``negative``
    allows a leading minus (``-1h``) where a negative amount makes sense, such as moving a
    time earlier. Raises ``ValueError`` with a message that shows what is accepted.
    """
    if isinstance(text, bool):
        raise ValueError(f"not a duration: {text!r} (examples: {EXAMPLES})")
    if isinstance(text, (int, float)):
        seconds = float(text) * unit
    else:
        s = str(text).strip().lower()
        sign = 1.0
        if s[:1] in "+-" and s[:1]:
            sign = -1.0 if s[0] == "-" else 1.0
            s = s[1:].strip()
        if _NUMBER.fullmatch(s):
            seconds = sign * float(s) * unit
        else:
            pos, total = 0, 0.0
            for m in _PART.finditer(s):
                if s[pos : m.start()].strip(" ,") or m.group(2) not in _UNITS:
                    break
                total += float(m.group(1)) * _UNITS[m.group(2)]
                pos = m.end()
            else:
                if pos and not s[pos:].strip():
                    seconds = sign * total
                    return _checked(seconds, text, negative)
            raise ValueError(f"not a duration: {text!r} (examples: {EXAMPLES})")
    return _checked(seconds, text, negative)


def _checked(seconds: float, text, negative: bool) -> float:
    if not math.isfinite(seconds):
        raise ValueError(f"not a duration: {text!r} (examples: {EXAMPLES})")
    if seconds < 0 and not negative:
        raise ValueError(f"not a duration here: {text!r} cannot be negative (examples: {EXAMPLES})")
    return seconds


def format_duration(seconds: float, *, compact: bool = False) -> str:
    """A duration for people: '45 s', '14 min', '1 h 12 min', '3 d 4 h' (``compact``: '45s', '14m', '1h12m', '3d4h').

    Rounded to the unit people care about at that size: seconds under a minute, minutes under
    an hour, hours and minutes under two days, then days and hours. The compact form is what
    :func:`parse_duration` reads back (and what tables such as ``kubectl``'s show).
    """
    if seconds != seconds:
        return "-"
    if seconds in (math.inf, -math.inf):
        return "never" if seconds > 0 else "-never"
    sign = "-" if seconds < 0 and round(abs(seconds)) else ""
    s = round(abs(seconds))
    if s < 60:
        parts = [(s, "s")]
    else:
        m = round(s / 60)
        if m < 60:
            parts = [(m, "min")]
        elif m < 48 * 60:
            parts = [(m // 60, "h"), (m % 60, "min")]
        else:
            h = round(m / 60)
            parts = [(h // 24, "d"), (h % 24, "h")]
    parts = [p for p in parts if p[0]] or parts[:1]
    if compact:
        return sign + "".join(f"{n}{'m' if u == 'min' else u}" for n, u in parts)
    return sign + " ".join(f"{n} {u}" for n, u in parts)


def format_time_left(seconds: float, *, compact: bool = False) -> str:
    """What is left of a lease or a wait, rounded *down* to the unit shown ('1 h 59 min', not '2 h').

    A countdown must never promise more than there is: 1 h 59 min 50 s left reads '1 h 59 min'
    where :func:`format_duration` would round it up to '2 h'. Negative values read as '0 s'.
    """
    s = max(0.0, float(seconds))
    if s >= 48 * 3600:
        s = 3600 * math.floor(s / 3600)
    elif s >= 60:
        s = 60 * math.floor(s / 60)
    else:
        s = math.floor(s)
    return format_duration(s, compact=compact)


def format_gpus(x: float | None) -> str:
    """GPU counts and GPU-hours as people read them: '2', '0.5', '299.9', '1,250' ('-' for None)."""
    if x is None:
        return "-"
    x = float(x)
    if abs(x - round(x)) < 0.05:
        return f"{round(x):,}"
    return f"{x:,.1f}" if abs(x) >= 10 else f"{x:.2g}" if abs(x) < 1 else f"{x:.1f}"


def usage_words(usage: dict) -> str:
    """The caller's use of the pool (the ``usage`` of the broker's ``GET api/pool``) in one
    clause: 'you hold 2 GPUs of your 4; 299.9 of 300 GPU-hours left this 7 d'."""
    held = float(usage.get("gpus_held") or 0)
    out = f"you hold {format_gpus(held)} GPU{'' if held == 1 else 's'}"
    if usage.get("max_gpus") is not None:
        out += f" of your {format_gpus(usage['max_gpus'])}"
    if usage.get("gpu_hours_left") is not None:
        out += f"; {format_gpus(usage['gpu_hours_left'])} of {format_gpus(usage.get('gpu_hours'))} GPU-hours left"
        if usage.get("period_s"):
            out += f" this {format_duration(float(usage['period_s']))}"
    return out


def format_figure(seconds: float | None) -> str:
    """A measured duration in one unit with one decimal, for tables that compare figures: '30s', '7.4m', '1.8h', '2.5d'."""
    if seconds is None:
        return "-"
    if seconds == math.inf:
        return "inf"
    if seconds < 60:
        return f"{seconds:.0f}s"
    if seconds < 3600:
        return f"{seconds / 60:.1f}m"
    if seconds < 86400 * 2:
        return f"{seconds / 3600:.1f}h"
    return f"{seconds / 86400:.1f}d"


def format_table(
    rows: Sequence[Sequence[object]],
    headers: Sequence[str] | None = None,
    *,
    align: str = "",
    min_width: int | Sequence[int] = 0,
    rule: bool = False,
    gap: int = 2,
) -> str:
    """Plain-text columns, as ``kubectl get`` and ``squeue`` print them.

    ``align`` gives one character per column, ``<`` (left, the default) or ``>`` (right, for
    figures); missing columns repeat its last character. ``min_width`` is one width for every
    column or one per column. ``rule`` draws a line of dashes under the headers. Lines carry no
    trailing spaces.
    """
    all_rows = [list(map(str, r)) for r in ([headers] if headers is not None else []) + list(rows)]
    if not all_rows:
        return ""
    ncol = max(len(r) for r in all_rows)
    for r in all_rows:
        r.extend([""] * (ncol - len(r)))
    mins = [min_width] * ncol if isinstance(min_width, int) else list(min_width) + [0] * (ncol - len(min_width))
    widths = [max(mins[i], *(len(r[i]) for r in all_rows)) for i in range(ncol)]
    aligns = [(align[i] if i < len(align) else (align[-1] if align else "<")) for i in range(ncol)]
    sep = " " * gap
    lines = [sep.join(v.rjust(w) if a == ">" else v.ljust(w) for v, w, a in zip(r, widths, aligns)).rstrip() for r in all_rows]
    if rule and headers is not None:
        lines.insert(1, "-" * (sum(widths) + gap * (ncol - 1)))
    return "\n".join(lines)
