"""A lease in words: the one module that turns a :class:`~.lease.LeaseView` into sentences.

The hub's spawn progress and home page, the ``%gpu`` magics, the widget and the server
extension's status (whose ``summary``, ``queue_words`` and ``holding`` the JupyterLab status bar
shows) all say a lease with these functions, so that it reads the same everywhere. Pure: no
I/O, no clock (``now`` is always given), nothing of the project outside ``core``.
"""

from __future__ import annotations

import fnmatch
import math
import time
from collections.abc import Mapping
from typing import Any

from .lease import LeaseState, LeaseView, QueueView, SliceView, WarningKind
from .text import format_duration, format_time_left

# a warning's title line (a notification's first words)
WARNING_TITLES: dict[WarningKind, str] = {
    WarningKind.EXPIRING: "GPU lease ends soon",
    WarningKind.RECLAIM: "Idle GPU will be reclaimed",
    WarningKind.LEASE_RECLAIM: "Idle GPU will be reclaimed",
    WarningKind.PREEMPTION: "GPU lease preempted",
    WarningKind.SHARE_MEMORY: "GPU share over its memory",
    WarningKind.UNLEASED_USE: "GPU used without a lease",
    WarningKind.ENDED: "GPU lease ended",
    WarningKind.GPU_UNHEALTHY: "Your GPU is failing or taken out",
    WarningKind.MAINTENANCE: "GPU maintenance ahead",
}
WARNING_TITLE_DEFAULT = "GPU lease"

# A notification's one line, short enough for JupyterLab's (it cuts a notification after 140
# characters); the rest is in the panel. The browser fills in {kernel} (a kernel's short id), {at}
# (a deadline's time of day, the browser's clock), {action} (RECLAIM_PARTICIPLES), {position},
# {state}, {pid}, {reason} (a message's first sentence), {holding}; a {reason} that would make the
# line too long is cut at a clause and ends "see the details". One key per state the notifications
# show (warnings by their kind).
NOTIFICATION_LINES: dict[str, str] = {
    WarningKind.RECLAIM.value: "Idle GPU: kernel {kernel} is {action} at {at} unless it computes again.",
    WarningKind.LEASE_RECLAIM.value: "Unused GPU: the lease goes back at {at} unless a kernel uses it.",
    WarningKind.EXPIRING.value: "GPU lease ends at {at}.",
    WarningKind.PREEMPTION.value: "GPU lease preempted: it ends at {at}.",
    WarningKind.SHARE_MEMORY.value: "Kernel {kernel} uses more GPU memory than this server's share: free some by {at}.",
    WarningKind.UNLEASED_USE.value: "GPU used without a lease: process {pid} is stopped at {at} unless it lets go of the GPU.",
    "unleased_use_not_stopped": "GPU used without a lease: {reason}",
    WarningKind.GPU_UNHEALTHY.value: "Your GPU is failing or taken out: {reason}",
    WarningKind.MAINTENANCE.value: "GPU maintenance ahead: {reason}",
    WarningKind.ENDED.value: "GPU lease ended: {reason}",
    "warning": "GPU lease: {reason}",
    "suspended": "Kernel {kernel} is suspended: its next cell gets a GPU back, its variables kept.",
    "asking": "Kernel {kernel} asks for a GPU.",
    "waiting": "Kernel {kernel} waits for a GPU: number {position} in the queue.",
    "restoring": "Kernel {kernel} has a GPU: its memory is being restored.",
    "back": "Kernel {kernel} has its GPU back.",
    "not_back": "Kernel {kernel}: {reason}",
    "acted": "Kernel {kernel} was {action} to free its GPU: {reason}",
    "given_back": "The unused GPU went back to the pool; the next cell you run asks for one again.",
    "lease_ended": "GPU lease {state}: {reason}",
    "granted": "GPU lease granted: {holding}.",
}
# what happens to an idle kernel, as NOTIFICATION_LINES say it ('is suspended at 14:05')
RECLAIM_PARTICIPLES: dict[str, str] = {"suspend": "suspended", "restart": "restarted", "interrupt": "interrupted",
                                       "shutdown": "shut down", "notify": "asked to free it"}

# what a suspended kernel means for the user (the status line, the widget)
SUSPENDED_WORDS = "suspended: the GPU state of an idle kernel was put aside; its next cell resumes it"

# what the user can do after each kind of end (the broker's end_message says why)
NEXT_STEP: dict[LeaseState, str] = {
    LeaseState.EXPIRED: "It reached its time limit. Start your server again for a new lease; to keep a lease longer, "
                        "extend it before it ends (My GPU leases, or jupyter gpulease extend).",
    LeaseState.PREEMPTED: "A request of a higher tier needed the GPU. Start again to queue for a new lease, pick a smaller "
                          "slice that is free now, or a tier that cannot be preempted if you may use one.",
    LeaseState.RECLAIMED: "Its GPU was given back while idle. Start a GPU server again when you need one.",
    LeaseState.REVOKED: "An administrator or the broker's checks ended it. Start again, or ask your administrator if the reason is unclear.",
    LeaseState.FAILED: "The lease could not be kept. Start again; if it happens again, tell your administrator.",
}  # fmt: skip
NEXT_STEP_DEFAULT = "Start your server again for a new lease."


def warning_title(kind: str) -> str:
    """'GPU lease ends soon' for an ``expiring`` warning, 'GPU lease' for a kind without a title."""
    try:
        return WARNING_TITLES.get(WarningKind(kind), WARNING_TITLE_DEFAULT)
    except ValueError:
        return WARNING_TITLE_DEFAULT


def _view(lease: LeaseView | Mapping[str, Any]) -> LeaseView:
    return lease if isinstance(lease, LeaseView) else LeaseView.from_json(lease)


def hhmm(t: float) -> str:
    """POSIX seconds → '14:05' (local time): the minute in which ``t`` falls ('at 14:05')."""
    return time.strftime("%H:%M", time.localtime(float(t)))


def hhmm_by(t: float) -> str:
    """POSIX seconds → the first minute at which ``t`` has passed: 14:05:56 → '14:06'. A time
    something happens *by* never reads earlier than it comes."""
    return hhmm(math.ceil(float(t) / 60) * 60)


# --------------------------------------------------------------------------- what is asked for
def display_model(name: str, memory_mib: int | None) -> str:
    """'L4' + 23034 MiB → 'L4 (22 GB)'; a name that already says its memory stays as it is."""
    if not memory_mib or "gb" in name.lower():
        return name
    return f"{name} ({round(memory_mib / 1024)} GB)"


def _model_words(patterns: list[str], pool: Mapping[str, Any] | None) -> str:
    mem: dict[str, int] = {}
    for d in (pool or {}).get("devices") or []:
        mem[d["model"]] = max(mem.get(d["model"], 0), int(d.get("memory_mib") or 0))
    matching = [m for m in mem if any(fnmatch.fnmatchcase(m.lower(), p.lower()) for p in patterns)] if patterns else list(mem)
    if len(matching) == 1:
        return display_model(matching[0], mem[matching[0]])
    return " or ".join(patterns) if patterns else "GPU"


def request_words(request: Mapping[str, Any], pool: Mapping[str, Any] | None = None) -> str:
    """A lease request (``Request.to_dict()``) in words: '1 × A100-SXM4-80GB', 'a 0.5 share of one L4 (22 GB)',
    'MIG 3g.40gb of A100'. ``pool``: the broker's pool JSON, to name a model pattern by the one model it matches."""
    models = request.get("model") or []
    if isinstance(models, str):
        models = [models]
    what = _model_words(list(models), pool)
    kind = request.get("kind") or ("mig" if request.get("mig_profile") else "share" if request.get("share") else "gpu")
    if kind == "share":
        share = request.get("share")
        part = f"a {float(share):g} share" if share else f"{request.get('memory_mib')} MiB"
        return f"{part} of one {what}"
    if kind == "mig":
        return f"MIG {request.get('mig_profile')} of {what}" if what != "GPU" else f"MIG {request.get('mig_profile')}"
    return f"{int(request.get('gpus') or 1)} × {what}"


# --------------------------------------------------------------------------- what is held
def slice_words(s: SliceView, *, name: str = "index") -> str:
    """One slice: 'L4 #0', 'a 0.5 share of L4 #0', 'MIG 3g.40gb of A100 #0' (``name="index"``);
    'L4 (GPU-…)', with the device's UUID (``name="uuid"``); 'L4' (``name=""``)."""
    what = f"MIG {s.mig_profile} of {s.model}" if s.is_mig else f"a {s.share:g} share of {s.model}" if s.is_share else s.model
    if name == "index":
        return f"{what} #{'?' if s.index is None else s.index}"
    if name == "uuid":
        return f"{what} ({s.device})"
    return what


def placement_words(lease: LeaseView | Mapping[str, Any], *, name: str = "index", none: str = "-") -> str:
    """Every slice of the lease (:func:`slice_words`), or ``none``."""
    return ", ".join(slice_words(s, name=name) for s in _view(lease).slices) or none


def holding_words(lease: LeaseView | Mapping[str, Any], pool: Mapping[str, Any] | None = None) -> str:
    """What an active lease holds, grouped: '2 × L4 on gpu-02', 'a 0.5 share of A100 on gpu-01',
    'MIG 3g.40gb of A100 on gpu-01'; without a placement, what it asks for."""
    view = _view(lease)
    if not view.slices:
        return request_words(view.request, pool)
    groups: dict[tuple[str, str, bool], int] = {}
    for s in view.slices:
        key = (slice_words(s, name=""), s.node, not s.is_mig and not s.is_share)
        groups[key] = groups.get(key, 0) + 1
    parts = []
    for (what, node, whole), n in groups.items():
        text = f"{n} × {what}" if whole or n > 1 else what
        parts.append(f"{text} on {node}" if node else text)
    return ", ".join(parts)


def short_model(model: str) -> str:
    """'A100' from 'A100-SXM4-80GB': the model's first word, short enough for a status bar."""
    return (model or "GPU").replace(" ", "-").split("-")[0]


def holding_short(lease: LeaseView | Mapping[str, Any]) -> str:
    """What the lease holds in a few characters (the status bar): 'A100 ×1', 'L4 ×0.5', 'A100 3g.40gb'; '' without devices."""
    slices = _view(lease).slices
    if not slices:
        return ""
    first = slices[0]
    if first.mig_profile:
        return f"{short_model(first.model)} {first.mig_profile}"
    total = round(sum(s.share for s in slices), 2)
    return f"{short_model(first.model)} ×{total:g}"


# --------------------------------------------------------------------------- the queue
def wait_words(eta: float | None, now: float) -> str:
    """'about 14 min', 'any moment now' (under a minute), 'no estimate yet'."""
    if eta is None:
        return "no estimate yet"
    left = eta - now
    return "any moment now" if left < 60 else f"about {format_duration(left)}"


def sooner_words(queue: QueueView | Mapping[str, Any] | None, now: float, *, long: bool = True) -> str:
    """The broker's ``may_start_sooner_at`` (what the lease waits for sits idle and goes back by then):
    ', or sooner: the GPU it waits for is idle and goes back by 14:05 if it stays idle' (``long``),
    ', or sooner: by 14:05', or ''."""
    if isinstance(queue, Mapping):
        queue = QueueView.from_json(queue)
    at = queue.may_start_sooner_at if queue else None
    if at is None or at <= now:
        return ""
    if long:
        return f", or sooner: the GPU it waits for is idle and goes back by {hhmm_by(at)} if it stays idle"
    return f", or sooner: by {hhmm_by(at)}"


def queue_place(lease: LeaseView | Mapping[str, Any]) -> str:
    """'position 2 of 5' ('?' for what the broker has not said)."""
    q = _view(lease).queue or QueueView()
    return f"position {'?' if q.position is None else q.position} of {'?' if q.length is None else q.length}"


def queue_words(lease: LeaseView | Mapping[str, Any], now: float) -> str:
    """'position 2 of 5, about 14 min' (', or sooner: …' when what it waits for sits idle), '…, no estimate yet'."""
    view = _view(lease)
    q = view.queue or QueueView()
    text = f"{queue_place(view)}, {wait_words(q.eta, now)}"
    return text + sooner_words(q, now) if q.eta is not None else text


def queue_message(lease: LeaseView | Mapping[str, Any], pool: Mapping[str, Any] | None = None, now: float = 0.0, *,
                  gives_up_at: float | None = None) -> str:
    """'Waiting for 1 × A100 (80 GB): position 2 of 5, about 14 min' (the spawn's progress).

    ``gives_up_at``: when the spawn stops waiting (POSIX seconds); an ETA beyond it says that
    the spawn will give up first (so does the broker's ``eta_after_wait_limit`` flag, and its
    ``gives_up_at`` stands in for ``gives_up_at`` when not given)."""
    view = _view(lease)
    what = request_words(view.request, pool)
    q = view.queue
    if q is None:
        return f"Waiting for {what}"
    text = f"Waiting for {what}: {queue_place(view)}, {wait_words(q.eta, now)}{sooner_words(q, now)}"
    if gives_up_at is None:
        gives_up_at = q.gives_up_at
    beyond = q.eta_after_wait_limit
    if beyond is None and q.eta is not None and gives_up_at is not None:
        beyond = q.eta > gives_up_at
    if beyond:
        limit = f" (in {format_duration(max(0.0, gives_up_at - now))})" if gives_up_at is not None else ""
        text += (f". That is after this spawn stops waiting{limit}: unless GPUs free up sooner it will give up; "
                 "a smaller request (a share, another model) may start sooner")
    return text


# --------------------------------------------------------------------------- the lease
def granted_message(lease: LeaseView | Mapping[str, Any], now: float) -> str:
    """'GPU lease 0123… granted: A100-SXM4-80GB (GPU-…), for 2 h' (with a short grant's reason)."""
    view = _view(lease)
    until = ""
    if view.expires_at:
        until = f", for {format_duration(view.expires_at - now)}"
        if view.granted_at is not None and view.duration_s and view.expires_at - view.granted_at < view.duration_s - 1:
            # a short grant: a preemptible lease started on GPUs promised to someone waiting
            until += f" (you asked for {format_duration(view.duration_s)}; these GPUs are promised to a waiting request after that)"
    return f"GPU lease {view.id} granted: {placement_words(view, name='uuid', none='')}{until}"


def end_words(lease: LeaseView | Mapping[str, Any]) -> str:
    """Why a lease ended, in one sentence: the broker's ``end_message`` when it has one."""
    view = _view(lease)
    if view.end_message:
        return view.end_message
    by: Any = view.ended_by or {}
    if not isinstance(by, Mapping):  # the actor of the feed's event: 'admin:<name>', 'broker', a user
        actor = str(by)
        by = ({"kind": "admin", "user": actor.split(":", 1)[1]} if actor.startswith("admin:")
              else {"kind": "broker"} if actor == "broker" else {"kind": actor})
    reason = view.end_reason.strip()
    state = view.state
    if state is LeaseState.PREEMPTED:
        who = f" for {by['user']}'s" if by.get("user") else " for a"
        tier = f" {by['tier']!r}" if by.get("tier") else " higher-tier"
        return f"It was preempted{who}{tier} request." + (f" ({reason})" if reason else "")
    if state is LeaseState.EXPIRED:
        return "It reached the end of its time."
    words = {LeaseState.RECLAIMED: "Its GPU was reclaimed", LeaseState.REVOKED: "It was revoked", LeaseState.FAILED: "It failed",
             LeaseState.RELEASED: "It was released", LeaseState.WITHDRAWN: "It was withdrawn"}.get(state, f"It ended ({state.value})")
    if by.get("kind") == "admin" and by.get("user"):
        words += f" by {by['user']} (admin)"
    elif by.get("kind") == "broker" and state in (LeaseState.REVOKED, LeaseState.FAILED):
        words += " by the broker"
    return f"{words}: {reason}." if reason else f"{words}."


def summary(lease: LeaseView | Mapping[str, Any]) -> str:
    """The lease in one line that does not change by the second (the lab panel adds the countdown or ETA):
    'Lease 0123abcd · tier standard', 'Waiting: position 2 of 5', or an ended lease's :func:`end_words`."""
    view = _view(lease)
    if view.queued:
        return f"Waiting: {queue_place(view)}"
    if view.active:
        return f"Lease {view.short_id} · tier {view.tier or '–'}"
    return end_words(view)


def lease_line(lease: LeaseView | Mapping[str, Any] | None, now: float) -> str:
    """One line about the lease (``%gpu``): what, state, time left or queue position, or how it ended."""
    if not lease:
        return "no GPU lease (ask for one with %gpu request)"
    view = _view(lease)
    if view.queued:
        return f"lease {view.short_id} waits for {request_words(view.request)}: {queue_words(view, now)}"
    if view.active:
        left = "" if view.expires_at is None else f", {format_time_left(view.expires_at - now)} left"
        tier = f" (tier {view.tier})" if view.tier else ""
        return f"lease {view.short_id}: {placement_words(view)}{tier}{left}"
    if view.end_message:  # a sentence that names the state itself ('Released from the notebook.')
        return f"lease {view.short_id}: {view.end_message}"
    return f"lease {view.short_id} {view.state.value}" + (f": {view.end_reason}" if view.end_reason else "")

