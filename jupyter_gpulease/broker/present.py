"""Leases in words, for people: the command line and the broker's pages share these.

Durations are core's (:func:`jupyter_gpulease.core.text.format_duration`: "45 s", "12 min",
"1 h 12 min", "3 d 4 h"); ``local_time`` gives the reader's local date and time ("2024-05-02 14:05", "14:05" today).
"""

from __future__ import annotations

import time
from typing import Any

from ..core.text import format_duration


def local_time(t: float | None, now: float | None = None) -> str:
    """``t`` on the local clock: the time alone when it is today, else date and time."""
    if t is None:
        return "-"
    now = time.time() if now is None else now
    lt, ln = time.localtime(t), time.localtime(now)
    if lt[:3] == ln[:3]:
        return time.strftime("%H:%M", lt)
    return time.strftime("%Y-%m-%d %H:%M", lt)


def relative(t: float | None, now: float | None = None) -> str:
    """'in 12 min' or '3 h 05 min ago'."""
    if t is None:
        return "-"
    now = time.time() if now is None else now
    d = t - now
    return f"in {format_duration(d)}" if d >= 0 else f"{format_duration(d)} ago"


def describe_request(r: dict[str, Any]) -> str:
    """'2 GPUs (A100*)', 'a 0.25 share of one GPU, 20480 MiB', 'MIG 1g.10gb'."""
    models = "|".join(r.get("model") or [])
    where = f" ({models})" if models else ""
    if r.get("kind") == "share":
        mem = f", {r['memory_mib']} MiB" if r.get("memory_mib") else ""
        return f"a {r.get('share', 0):g} share of one GPU{mem}{where}"
    if r.get("kind") == "mig":
        return f"MIG {r.get('mig_profile')}{where}"
    n = r.get("gpus", 1)
    return f"{n} GPU{'s' if n != 1 else ''}{where}"


def describe_slice(s: dict[str, Any]) -> str:
    what = s.get("model", "GPU")
    if s.get("mig_profile"):
        what += f" MIG {s['mig_profile']}"
    elif float(s.get("share", 1)) != 1:
        what += f" ({float(s['share']):g} share, {s.get('memory_mib', 0)} MiB)"
    return f"{what} #{s.get('index')} on {s.get('node')}"


def describe_placement(p: dict[str, Any] | None) -> str:
    """'A100-SXM4-80GB #0 on gpu-1, A100-SXM4-80GB #1 on gpu-1' (or '-' before a grant)."""
    if not p or not p.get("slices"):
        return "-"
    return ", ".join(describe_slice(s) for s in p["slices"])
