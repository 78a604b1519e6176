"""Right-sizing: what a user or group asked for against what they used, and what would do.

Pure rules over accounting rows (one dict per ended lease: the slice asked for, the memory it
allowed, the asked and held duration, the memory peak, busy GPU-seconds per device) and the
cards the pool offers (MIG profiles, shares, whole GPUs). Each rule needs ``min_leases`` leases
of evidence and says what it saw:

* **memory**: a card whose memory is more than twice what 95% of the leases peaked at (with
  10% headroom) → the smallest MIG instance and share of the same model that hold that peak
  ("asks 1 × A100-SXM4-80GB (80 GB), peak memory 9 GB in 95% of leases: a 1g.10gb slice or a
  0.25 share would do");
* **duration**: leases held for at most half the asked duration at the median → the duration
  that 90% of the leases needed, in half hours ("asks 8 h, uses 2 h at the median");
* **gpus**: several whole GPUs of which at least one was never busy in most leases → that
  many fewer ("holds 2 GPUs, one is never busy").

A suggestion is a hint; nothing here changes what anybody asks for.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

HEADROOM = 1.1
P_MEMORY = 0.95
P_DURATION = 0.9


def _pct(vals: list[float], q: float) -> float:
    s = sorted(vals)
    k = (len(s) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def gb(mib: float) -> str:
    """'80 GB', '9 GB', '0.5 GB'."""
    v = mib / 1024
    return f"{v:.0f} GB" if v >= 10 or abs(v - round(v)) < 0.05 else f"{v:.1f} GB"


def hours(s: float) -> str:
    """'8 h', '2.5 h', '45 min'."""
    if s < 3600:
        return f"{round(s / 60):.0f} min"
    h = s / 3600
    return f"{h:.0f} h" if abs(h - round(h)) < 0.05 else f"{h:.1f} h"


def card_words(r: dict[str, Any]) -> str:
    """The card a lease asked for: '1 × A100-SXM4-80GB (80 GB)', 'a 0.5 share of A100 (40 GB)', 'MIG 3g.40gb (A100)'."""
    model = r.get("model") or "GPU"
    if r["slice_kind"] == "mig":
        return f"MIG {r['slice']} ({model})"
    if r["slice_kind"] == "share":
        return f"a {r['slice']} share of {model} ({gb(r['mem_mib'])})"
    return f"{r['gpus']} × {model} ({gb(r['mem_mib'] / max(1, r['gpus']))})"


def offer_words(o: dict[str, Any]) -> str:
    if o["kind"] == "mig":
        return f"a {o['mig_profile']} slice"
    if o["kind"] == "share":
        return f"a {o['share']:g} share"
    return f"{o.get('gpus', 1)} × {o['model']}"


def _card(o: dict[str, Any]) -> dict[str, Any]:
    """The card as the spawn form can match it."""
    c: dict[str, Any] = {"kind": o["kind"], "model": o["model"], "memory_mib": o["memory_mib"]}
    if o["kind"] == "mig":
        c["mig_profile"] = o["mig_profile"]
    elif o["kind"] == "share":
        c["share"] = o["share"]
    else:
        c["gpus"] = o.get("gpus", 1)
    return c


def _asked_card(r: dict[str, Any]) -> dict[str, Any]:
    kind = {"gpu": "whole"}.get(r["slice_kind"], r["slice_kind"])
    c: dict[str, Any] = {"kind": kind, "model": r["model"], "memory_mib": r["mem_mib"]}
    if kind == "mig":
        c["mig_profile"] = r["slice"]
    elif kind == "share":
        c["share"] = float(r["slice"])
    else:
        c["gpus"] = r["gpus"]
    return c


def suggest(rows: list[dict[str, Any]], offers: list[dict[str, Any]], *, min_leases: int = 3) -> list[dict[str, Any]]:
    """Suggestions for one user's or group's leases: ``[{kind, text, suggested, evidence}]``."""
    out: list[dict[str, Any]] = []
    if len(rows) < min_leases:
        return out
    # the card asked for most often: the rules speak about it
    shape = Counter((r["model"], r["slice_kind"], r["slice"], r["gpus"], r["mem_mib"]) for r in rows).most_common(1)[0][0]
    same = [r for r in rows if (r["model"], r["slice_kind"], r["slice"], r["gpus"], r["mem_mib"]) == shape]
    if len(same) < min_leases:
        return out
    asked = same[0]
    out += _memory(same, asked, offers)
    out += _gpus(same, asked)
    out += _duration(same, asked, min_leases)
    return out


def _memory(same: list[dict[str, Any]], asked: dict[str, Any], offers: list[dict[str, Any]]) -> list[dict[str, Any]]:
    if asked["gpus"] > 1 or not asked["mem_mib"]:
        return []
    peaks = [r["mem_peak_mib"] for r in same if r["mem_peak_mib"] > 0]
    if len(peaks) < max(1, len(same) // 2):
        return []  # most leases said nothing about memory
    p95 = _pct(peaks, P_MEMORY)
    need = p95 * HEADROOM
    if need * 2 > asked["mem_mib"]:
        return []
    fits = [o for o in offers if o["model"] == asked["model"] and o["kind"] != "whole" and o["memory_mib"] >= need and o["fraction"] < asked["fraction"]]
    if not fits:
        return []
    best: dict[str, dict[str, Any]] = {}
    for o in sorted(fits, key=lambda o: (o["fraction"], o["memory_mib"])):
        best.setdefault(o["kind"], o)
    choice = sorted(best.values(), key=lambda o: (o["fraction"], o["kind"] != "mig"))
    text = (f"asks {card_words(asked)}, peak memory {gb(p95)} in {P_MEMORY:.0%} of leases: "
            + " or ".join(offer_words(o) for o in choice) + " would do")
    return [{"kind": "memory", "text": text, "suggested": _card(choice[0]), "alternatives": [_card(o) for o in choice[1:]],
             "asked": _asked_card(asked),
             "evidence": {"leases": len(same), "with_memory": len(peaks), "mem_peak_p95_mib": round(p95), "asked_mem_mib": asked["mem_mib"],
                          "suggested_fraction": choice[0]["fraction"], "asked_fraction": asked["fraction"]}}]


def _duration(same: list[dict[str, Any]], asked: dict[str, Any], min_leases: int) -> list[dict[str, Any]]:
    asks = [r["asked_s"] for r in same if r["asked_s"] > 0]
    held = [r["held_s"] for r in same]
    if len(asks) < min_leases:
        return []
    ask50, held50 = _pct(asks, 0.5), _pct(held, 0.5)
    if ask50 < 3600 or held50 * 2 > ask50:
        return []
    need = max(1800.0, math.ceil(_pct(held, P_DURATION) / 1800) * 1800)
    if need >= ask50:
        return []
    card = _asked_card(asked)
    card["duration_s"] = need
    return [{"kind": "duration", "text": f"asks {hours(ask50)}, uses {hours(held50)} at the median: {hours(need)} would do for {P_DURATION:.0%} of leases",
             "suggested": card, "asked": _asked_card(asked) | {"duration_s": ask50},
             "evidence": {"leases": len(same), "asked_s_p50": round(ask50), "held_s_p50": round(held50), "held_s_p90": round(_pct(held, P_DURATION))}}]


def _gpus(same: list[dict[str, Any]], asked: dict[str, Any]) -> list[dict[str, Any]]:
    n = asked["gpus"]
    if n < 2 or asked["slice_kind"] != "gpu":
        return []
    idle_counts = []
    for r in same:
        devs = r.get("devices") or {}
        if len(devs) < n:
            continue  # heartbeats did not name every GPU
        idle_counts.append(sum(1 for d in devs.values() if d.get("busy_gpu_s", 0.0) <= 0.0))
    if len(idle_counts) < max(1, len(same) // 2):
        return []
    never = sorted(idle_counts)[len(idle_counts) // 2]  # in at least half of the leases
    never = min(never, n - 1)
    if never < 1:
        return []
    words = {1: "one is", 2: "two are", 3: "three are"}.get(never, f"{never} are")
    card = _asked_card(asked)
    card["gpus"] = n - never
    card["memory_mib"] = asked["mem_mib"] // n * (n - never)
    return [{"kind": "gpus", "text": f"holds {n} GPUs, {words} never busy in most leases: {n - never} × {asked['model']} would do",
             "suggested": card, "asked": _asked_card(asked),
             "evidence": {"leases": len(same), "with_devices": len(idle_counts), "never_busy_median": never}}]
