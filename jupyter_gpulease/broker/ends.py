"""A lease's end in words: who or what ended it, as a viewer may see it, and one sentence."""

from __future__ import annotations

from typing import Any

from ..core.model import LeaseState


def ended_by(d: dict[str, Any], *, viewer: str | None, admin: bool) -> dict[str, Any]:
    """Who or what ended a lease, as ``viewer`` may see it."""
    info = d.get("end_info") or {}
    actor = info.get("actor", "")
    state = d["state"]
    if state == LeaseState.PREEMPTED.value:
        out: dict[str, Any] = {"kind": "preemption"}
        pf = info.get("preempted_for") or {}
        if pf.get("tier"):
            out["tier"] = pf["tier"]
        if pf.get("user") and (admin or pf["user"] == viewer):
            out["user"] = pf["user"]
        if admin and pf.get("lease"):
            out["lease"] = pf["lease"]
        return out
    if actor == "broker" or actor.startswith("broker:"):
        return {"kind": "idle" if state == LeaseState.RECLAIMED.value else "broker"}
    if actor.startswith("admin:"):
        return {"kind": "admin", "user": actor.split(":", 1)[1]}
    if actor.startswith("service:"):
        return {"kind": "service", "name": actor.split(":", 1)[1]}
    if actor == d["user"] or not actor:
        return {"kind": "idle" if state == LeaseState.RECLAIMED.value else "holder"}
    return {"kind": "user", "user": actor}


_STATE_WORDS = {
    "released": "Released",
    "expired": "Expired",
    "reclaimed": "Reclaimed because its GPUs sat idle",
    "preempted": "Preempted",
    "revoked": "Revoked",
    "withdrawn": "Withdrawn",
    "failed": "Failed",
}


def _unrepeated(state: str, reason: str) -> tuple[str, bool]:
    """The reason less a first word that repeats what the head already says, and whether what is
    left continues the head's sentence: 'released from the notebook' under 'Released' gives
    ('from the notebook', True); 'idle: …' under 'Reclaimed because its GPUs sat idle' gives
    ('…', False)."""
    low = reason.lower()
    for word in (state, "idle") if state == LeaseState.RECLAIMED.value else (state,):
        rest = reason[len(word) + 1:].strip()
        if low == word:
            return "", False
        if low.startswith(word + ":"):
            return rest, False
        if low.startswith(word + " ") and rest:
            return rest, word == state
    return reason, False


def end_message(d: dict[str, Any], by: dict[str, Any]) -> str:
    """One sentence a user understands: what happened, by whom, why."""
    state = d["state"]
    head = _STATE_WORDS.get(state, state.capitalize())
    reason, continues = _unrepeated(state, (d.get("end_reason") or "").strip().rstrip("."))
    kind = by.get("kind")
    if state == LeaseState.PREEMPTED.value:
        whom = f" of {by['user']}" if by.get("user") else ""
        tier = f"a waiting {by['tier']!r} request{whom}" if by.get("tier") else "a waiting higher-tier request"
        return f"Preempted: its GPUs were needed for {tier}."
    if kind == "admin":
        head += f" by {by['user']} (admin)"
    elif kind == "service" and by.get("name"):
        head += f" by the service {by['name']}"
    elif kind == "user":
        head += f" by {by['user']}"
    elif kind == "broker" and state not in ("expired", "withdrawn"):
        head += " by the broker"
    if reason and continues:
        return f"{head} {reason}."
    return f"{head}: {reason}." if reason else f"{head}."
