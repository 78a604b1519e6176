"""What the hub's own pages say about a server's GPU lease: the home page and the spawn page.

The pages are JupyterHub's templates with a few blocks added; they ship in this package::

    from jupyter_gpulease.hub.pages import TEMPLATE_PATH
    c.JupyterHub.template_paths = [TEMPLATE_PATH]

The home page asks the spawner (:meth:`GPULeaseSpawner.lease_status`) for the status of the
default server's lease; :func:`lease_status` turns the broker's lease JSON and the end the
spawner remembers into the words shown: what the server holds and for how long, its place in
the queue while it waits, and after an end why the lease ended and what to do next.
"""

from __future__ import annotations

import time
from datetime import datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from ..core.text import format_duration, format_time_left
from .placement import describe_request

TEMPLATE_PATH = str(Path(__file__).resolve().parent / "templates")

# what the user can do after each kind of end (the broker's end_message says why)
NEXT_STEP = {
    "expired": "It reached its time limit. Start your server again for a new lease; to keep a lease longer, "
               "extend it before it ends (My GPU leases, or jupyter gpulease extend).",
    "preempted": "A request of a higher tier needed the GPU. Start again to queue for a new lease, pick a smaller "
                 "slice that is free now, or a tier that cannot be preempted if you may use one.",
    "reclaimed": "Its GPU was given back while idle. Start a GPU server again when you need one.",
    "revoked": "An administrator or the broker's checks ended it. Start again, or ask your administrator if the reason is unclear.",
    "failed": "The lease could not be kept. Start again; if it happens again, tell your administrator.",
}


def _when(t: float | None, now: float) -> str:
    """A point in time in local words: '14:05' today, 'Tue 14:05' within a week, else the date."""
    if t is None:
        return ""
    dt, today = datetime.fromtimestamp(float(t)), datetime.fromtimestamp(now)
    if dt.date() == today.date():
        return dt.strftime("%H:%M")
    if abs(float(t) - now) < 6 * 86400:
        return dt.strftime("%a %H:%M")
    return dt.strftime("%Y-%m-%d %H:%M")


def holding_words(lease: dict) -> str:
    """What an active lease holds: '2 × L4 on gpu-02', 'a 0.5 share of A100 on gpu-01', 'MIG 3g.40gb of A100 on gpu-01'."""
    slices = (lease.get("placement") or {}).get("slices") or []
    if not slices:
        return describe_request(lease.get("request") or {})
    models: dict[tuple[str, str, str], int] = {}
    for s in slices:
        if s.get("mig_uuid"):
            key = (f"MIG {s.get('mig_profile')} of {s['model']}", s.get("node", ""), "mig")
        elif float(s.get("share", 1)) < 1:
            key = (f"a {float(s['share']):g} share of {s['model']}", s.get("node", ""), "share")
        else:
            key = (s["model"], s.get("node", ""), "gpu")
        models[key] = models.get(key, 0) + 1
    parts = []
    for (what, node, kind), n in models.items():
        text = f"{n} × {what}" if kind == "gpu" else what if n == 1 else f"{n} × {what}"
        parts.append(f"{text} on {node}" if node else text)
    return ", ".join(parts)


def end_words(lease: dict) -> str:
    """Why a lease ended, in one sentence: the broker's ``end_message`` when it has one."""
    if lease.get("end_message"):
        return str(lease["end_message"])
    state = lease.get("state") or "ended"
    by = lease.get("ended_by") or {}
    if not isinstance(by, dict):  # the actor of the feed's event: 'admin:<name>', 'broker', a user
        actor = str(by)
        by = ({"kind": "admin", "user": actor.split(":", 1)[1]} if actor.startswith("admin:")
              else {"kind": "broker"} if actor == "broker" else {"kind": actor})
    reason = (lease.get("end_reason") or "").strip()
    if state == "preempted":
        who = f" for {by['user']}'s" if by.get("user") else " for a"
        tier = f" {by['tier']!r}" if by.get("tier") else " higher-tier"
        return f"It was preempted{who}{tier} request." + (f" ({reason})" if reason else "")
    if state == "expired":
        return "It reached the end of its time."
    words = {"reclaimed": "Its GPU was reclaimed", "revoked": "It was revoked", "failed": "It failed",
             "released": "It was released", "withdrawn": "It was withdrawn"}.get(state, f"It ended ({state})")
    if by.get("kind") == "admin" and by.get("user"):
        words += f" by {by['user']} (admin)"
    elif by.get("kind") == "broker" and state in ("revoked", "failed"):
        words += " by the broker"
    return f"{words}: {reason}." if reason else f"{words}."


def leases_page(broker_url: str) -> str:
    """The broker's pages as the browser reaches them through the hub: the path of its service URL."""
    path = urlparse(broker_url or "").path
    return path if path.startswith("/services/") else ""


def lease_status(*, lease: dict | None, last_end: dict | None, server_active: bool, server_ready: bool, cpu_only: bool,
                 broker_url: str = "", warning: dict | None = None, now: float | None = None,
                 server_stopping: bool = False) -> dict[str, Any]:
    """The home page's lease panel as data (the template only lays it out).

    ``lease``: the broker's JSON of the server's current lease (None: none); ``last_end``: the
    lease JSON of the last lease that ended without the user ending it (the spawner remembers
    it). Returns ``{"kind": "active"|"queued"|"cpu"|"ended"|"none", "headline", "lines",
    "expires_at", "time_left", "until", "next_step", "leases_url", "lease_id"}``.
    """
    now = time.time() if now is None else now
    out: dict[str, Any] = {"kind": "none", "headline": "", "lines": [], "expires_at": None, "time_left": "", "until": "",
                           "next_step": "", "leases_url": leases_page(broker_url), "lease_id": ""}
    state = (lease or {}).get("state")
    if lease and state == "active" and server_active:
        out.update(kind="active", lease_id=lease.get("id", ""), headline=f"Your server holds {holding_words(lease)}")
        if lease.get("tier"):
            out["lines"].append(f"Tier: {lease['tier']}")
        exp = lease.get("expires_at")
        if exp is not None:
            out["expires_at"] = float(exp)
            out["time_left"] = format_time_left(float(exp) - now)
            out["until"] = _when(float(exp), now)
        if warning and warning.get("kind") in ("warned", "preempt-warned"):
            out["lines"].append(str(warning.get("reason") or "The broker warned that this lease ends soon."))
        return out
    if lease and state == "queued":
        q = lease.get("queue") or {}
        out.update(kind="queued", lease_id=lease.get("id", ""),
                   headline=f"Waiting for {describe_request(lease.get('request') or {})}")
        if q.get("position"):
            out["lines"].append(f"Position {q['position']} of {q.get('length') or q['position']} in the queue")
        eta = q.get("eta")
        if eta is None:
            out["lines"].append("No estimate of the start yet")
        elif float(eta) - now < 60:
            out["lines"].append("Expected to start within a minute")
        else:
            out["lines"].append(f"Expected to start in about {format_duration(float(eta) - now)} (at {_when(float(eta), now)})")
        return out
    if last_end and last_end.get("state") not in (None, "active", "queued", "released", "withdrawn"):
        ended_at = last_end.get("ended_at")
        when = f" at {_when(float(ended_at), now)}" if ended_at else ""
        server = ("Your server is being stopped." if server_active and server_stopping
                  else "Your server keeps running without a GPU." if server_active else "Your server was stopped.")
        held = holding_words(last_end) if last_end.get("placement") or last_end.get("request") else ""
        out.update(kind="ended", lease_id=last_end.get("id") or last_end.get("lease_id") or "",
                   headline=f"Your GPU lease ({held}) ended{when}" if held else f"Your GPU lease ended{when}",
                   lines=[end_words(last_end), server],
                   next_step=NEXT_STEP.get(last_end.get("state"), "Start your server again for a new lease."))
        return out
    if server_active and (cpu_only or not lease):
        out.update(kind="cpu", headline="Your server runs without a GPU" if server_ready else "Your server is starting without a GPU")
    return out
