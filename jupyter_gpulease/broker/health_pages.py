"""The admin page's health and maintenance section: cordoned GPUs and nodes with their reasons,
maintenance windows, and the forms to cordon, drain, uncordon and set or remove a window (read,
confirmed and applied here; the page's handler is :class:`.pages.AdminHealthHandler`).

Every action asks for a confirmation first (a second page with the action spelled out and a
Confirm button), so a stray click changes nothing.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from ..core.model import BadRequest
from .inputs import short_text
from .present import format_duration, local_time

ACTIONS = ("cordon", "drain", "uncordon", "window", "unwindow")


def health_view(keeper, now: float) -> dict[str, Any] | None:
    """What the section shows of the health ``keeper``; None when this broker keeps none."""
    if keeper is None:
        return None
    state = keeper.state_json()
    cordons = []
    for c in state["cordons"]:
        v = dict(c)
        v["since_text"] = local_time(c["since"], now)
        v["mode_text"] = {"cordon": "cordoned", "drain": "drained", "drain_when_idle": "drain when idle"}[c["mode"]]
        v["by_text"] = "its health" if c["source"] == "health" else c["actor"].removeprefix("admin:")
        if c.get("healthy_since") is not None:
            left = max(0.0, keeper.settle_s - (now - c["healthy_since"]))
            v["back_text"] = f"reset; back in {format_duration(left)} if it stays healthy"
        elif c["source"] == "health" and not c["hold"]:
            v["back_text"] = "back by itself after a reset and " + format_duration(keeper.settle_s) + " healthy"
        else:
            v["back_text"] = "held out until an admin uncordons it"
        cordons.append(v)
    windows = []
    for w in state["maintenance"]:
        v = dict(w)
        v["start_text"], v["end_text"] = local_time(w["start"], now), local_time(w["end"], now)
        v["on_text"] = ", ".join([f"node {n}" for n in w["nodes"]] + w["devices"])
        v["when_text"] = "under way" if w["under_way"] else f"in {format_duration(w['start'] - now)}"
        windows.append(v)
    nodes = sorted({g.node for g in keeper.raw})
    devices = [{"uuid": g.uuid, "label": f"{g.node} #{g.index} {g.model}"} for g in sorted(keeper.raw, key=lambda g: (g.node, g.index))]
    return {"cordons": cordons, "windows": windows, "nodes": nodes, "devices": devices, "drain_action": keeper.drain_action}


def _local_input(text: str, name: str) -> float:
    """A ``datetime-local`` field (the admin's local clock), or epoch seconds."""
    text = (text or "").strip()
    try:
        return float(text)
    except ValueError:
        pass
    try:
        return dt.datetime.fromisoformat(text).timestamp()
    except ValueError:
        raise BadRequest(f"'{name}' must be a date and time, e.g. 2026-12-01T12:00", field=name) from None


def read_form(action: str, fields: dict[str, str], reason_chars: int) -> tuple[str, str, float | None, float | None]:
    """The target (kind, name) and window (start, end) of a health form's ``fields``, its reason
    checked; :class:`BadRequest` naming the field that is wrong."""
    kind, _, name = fields["target"].partition(":")
    if action in ("cordon", "drain", "uncordon", "window") and (kind not in ("node", "device") or not name):
        raise BadRequest("choose a node or a GPU", field="target")
    if action in ("cordon", "drain", "window"):
        if not fields["reason"]:
            raise BadRequest("say why: users read the reason on the spawn form and in their notebooks", field="reason")
        fields["reason"] = short_text({"reason": fields["reason"]}, "reason", reason_chars)
    start = end = None
    if action == "window":
        start, end = _local_input(fields["start"], "start"), _local_input(fields["end"], "end")
    return kind, name, start, end


async def apply_action(keeper, action: str, fields: dict[str, str], kind: str, name: str, start: float | None, end: float | None,
                       *, actor: str) -> str:
    """Do what the confirmed form asks of the health ``keeper``; what the page then says."""
    if action in ("cordon", "drain"):
        out = await keeper.cordon(kind, name, reason=fields["reason"], actor=actor, drain=action == "drain")
        return f"{'Drained' if action == 'drain' else 'Cordoned'} {kind} {out['name']}: {out['reason']}."
    if action == "uncordon":
        out = await keeper.uncordon(kind, name, actor=actor)
        return f"{kind.capitalize()} {out['name']} is back in the pool."
    if action == "window":
        out = await keeper.add_window(start=start, end=end, reason=fields["reason"], devices=[name] if kind == "device" else [],
                                      nodes=[name] if kind == "node" else [], actor=actor)
        return f"Maintenance window set: {local_time(out['start'])} to {local_time(out['end'])} ({out['reason']})."
    out = await keeper.delete_window(fields["window"], actor=actor)
    return f"Maintenance window removed ({out['reason']})."


def confirmation(action: str, fields: dict[str, str], kind: str, name: str, start: float | None, end: float | None) -> dict[str, Any]:
    """The second page of an action: what it will do, spelled out, and the fields to send again."""
    what = {
        "cordon": f"Cordon {kind} {name}: nothing new is granted there; the leases on it run to their end. Users read: “{fields['reason']}”.",
        "drain": f"Drain {kind} {name}: nothing new is granted there, and every lease on it moves to a healthy GPU "
                 f"(its kernels are suspended first). Users read: “{fields['reason']}”.",
        "uncordon": f"Put {kind} {name} back into the pool.",
        "window": f"Set a maintenance window on {kind} {name} from {local_time(start) if start else ''} to {local_time(end) if end else ''}: "
                  f"no lease is granted that would run into it; holders of leases that would are warned now. Users read: “{fields['reason']}”.",
        "unwindow": "Remove this maintenance window.",
    }[action]
    return {"action": action, "text": what, "fields": {k: v for k, v in fields.items() if v}}
