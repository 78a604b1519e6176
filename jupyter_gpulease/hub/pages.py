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

from ..core.lease import LeaseState, LeaseView
from ..core.text import format_duration, format_time_left
from ..core.words import NEXT_STEP, NEXT_STEP_DEFAULT, end_words, holding_words, request_words

__all__ = ["NEXT_STEP", "TEMPLATE_PATH", "end_words", "holding_words", "lease_status", "leases_page", "server_lease"]

TEMPLATE_PATH = str(Path(__file__).resolve().parent / "templates")

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


def leases_page(broker_url: str) -> str:
    """The broker's pages as the browser reaches them through the hub: the path of its service URL."""
    path = urlparse(broker_url or "").path
    return path if path.startswith("/services/") else ""


def server_lease(leases: list[dict], server: str) -> dict | None:
    """Of a user's live leases (the broker's list), the one server ``server`` took itself (``%gpu
    request`` in it: ``meta.taken_by == "server"``), active first; None when it took none."""
    mine = [d for d in leases or [] if (d.get("server") or "") == (server or "") and (d.get("meta") or {}).get("taken_by") == "server"
            and d.get("state") in (LeaseState.ACTIVE.value, LeaseState.QUEUED.value)]
    mine.sort(key=lambda d: d.get("state") != LeaseState.ACTIVE.value)
    return mine[0] if mine else None


def lease_status(*, lease: dict | None, last_end: dict | None, server_active: bool, server_ready: bool, cpu_only: bool,
                 broker_url: str = "", warning: dict | None = None, now: float | None = None,
                 server_stopping: bool = False) -> dict[str, Any]:
    """The home page's lease panel as data (the template only lays it out).

    ``lease``: the broker's JSON of the server's current lease (None: none); ``last_end``: the
    lease JSON of the last lease that ended without the user ending it (the spawner remembers
    it). Returns ``{"kind": "active"|"queued"|"cpu"|"stopping"|"ended"|"none", "headline", "lines",
    "expires_at", "time_left", "until", "next_step", "leases_url", "lease_id"}``.
    """
    now = time.time() if now is None else now
    out: dict[str, Any] = {"kind": "none", "headline": "", "lines": [], "expires_at": None, "time_left": "", "until": "",
                           "next_step": "", "leases_url": leases_page(broker_url), "lease_id": ""}
    view = LeaseView.maybe(lease)
    if view is not None and view.active and server_active:
        out.update(kind="active", lease_id=view.id, headline=f"Your server holds {holding_words(view)}")
        if view.tier:
            out["lines"].append(f"Tier: {view.tier}")
        if view.expires_at is not None:
            out["expires_at"] = view.expires_at
            out["time_left"] = format_time_left(view.expires_at - now)
            out["until"] = _when(view.expires_at, now)
        if warning and warning.get("kind") in ("warned", "preempt-warned"):
            out["lines"].append(str(warning.get("reason") or "The broker warned that this lease ends soon."))
        return out
    if view is not None and view.queued:
        q = view.queue
        out.update(kind="queued", lease_id=view.id, headline=f"Waiting for {request_words(view.request)}")
        if q is not None and q.position:
            out["lines"].append(f"Position {q.position} of {q.length or q.position} in the queue")
        eta = q.eta if q is not None else None
        if eta is None:
            out["lines"].append("No estimate of the start yet")
        elif eta - now < 60:
            out["lines"].append("Expected to start within a minute")
        else:
            out["lines"].append(f"Expected to start in about {format_duration(eta - now)} (at {_when(eta, now)})")
        return out
    try:
        ended = LeaseView.maybe(last_end) if last_end and last_end.get("state") else None
    except ValueError:  # a state this version does not know: nothing to say about it
        ended = None
    if ended is not None and ended.state not in (LeaseState.ACTIVE, LeaseState.QUEUED, LeaseState.RELEASED, LeaseState.WITHDRAWN):
        when = f" at {_when(ended.ended_at, now)}" if ended.ended_at else ""
        server = ("Your server is being stopped." if server_active and server_stopping
                  else "Your server keeps running without a GPU." if server_active else "Your server was stopped.")
        held = holding_words(ended) if ended.slices or ended.request else ""
        out.update(kind="ended", lease_id=ended.id or str(last_end.get("lease_id") or ""),
                   headline=f"Your GPU lease ({held}) ended{when}" if held else f"Your GPU lease ended{when}",
                   lines=[end_words(ended), server], next_step=NEXT_STEP.get(ended.state, NEXT_STEP_DEFAULT))
        return out
    if server_active and server_stopping:
        out.update(kind="stopping", headline="Your server is being stopped")
    elif server_active and (cpu_only or not lease):
        out.update(kind="cpu", headline="Your server runs without a GPU" if server_ready else "Your server is starting without a GPU")
    return out
