"""Bookings: GPUs reserved ahead of time for a person, a group or a course. Pure, no I/O.

A booking is the maintenance window's guarantee turned round, for someone: an owner (users
and/or groups), a window ``[start, end)`` and a request shaped as a lease's request. It is
placed ahead of time on concrete devices (:func:`place`) that no other booking and no
maintenance window holds in the overlapping time. A booking holds whole GPUs: a whole-GPU
booking its GPUs, a share or MIG booking the GPU its slice is on (the scheduler keeps others
off a GPU, not off part of one, as it does for maintenance windows).

For everyone but its owner the scheduler treats a booking like a maintenance window on its
GPUs (:class:`BookingWindow`); from its start, a request of its owner that fits it takes the
booked GPUs first (see :meth:`~.scheduler.Scheduler.set_bookings`).

States: ``accepted`` (placed, not used yet), ``active`` (its owner started a lease on it),
``ended`` (with a reason: its time is over, not used within its grace, ended early). A booking
whose GPU failed and that could not be moved stays in its state with ``problem`` saying why.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from .maintenance import MaintenanceWindow
from .model import GPU, Slice
from .pool import Pool
from .request import Request
from .text import format_duration

INF = math.inf
DAY = 86400.0
SEARCH_S = 14 * DAY  # how far ahead :func:`place` looks for the next window that would work
UNUSED_GRACE_S = 900.0  # a booking its owner has not used this long after its start is given back

ACCEPTED, ACTIVE, ENDED = "accepted", "active", "ended"
STATES = (ACCEPTED, ACTIVE, ENDED)


@dataclass(frozen=True)
class Booking:
    id: str
    start: float
    end: float
    request: Request
    users: frozenset[str] = frozenset()
    groups: frozenset[str] = frozenset()
    slices: tuple[Slice, ...] = ()  # what it holds once placed
    state: str = ACCEPTED
    reason: str = ""  # why it ended
    problem: str = ""  # what is wrong with it while it lasts (its GPU failed and it could not move)
    used_at: float | None = None  # when its owner's first lease on it started
    grace_s: float = UNUSED_GRACE_S  # given back when not used this long after its start
    title: str = ""  # what it is for ("course ML-101, lab 3")

    @property
    def devices(self) -> frozenset[str]:
        """The GPUs it holds (UUIDs)."""
        return frozenset(sl.gpu_uuid for sl in self.slices)

    @property
    def live(self) -> bool:
        return self.state != ENDED

    def owned_by(self, user: str, groups: Iterable[str] = ()) -> bool:
        return user in self.users or not self.groups.isdisjoint(groups)

    def overlaps(self, start: float, end: float) -> bool:
        return self.start < end and start < self.end

    def owner_words(self) -> str:
        parts = sorted(self.users) + [f"group {g}" for g in sorted(self.groups)]
        return ", ".join(parts) or "nobody"

    def with_(self, **kw: Any) -> Booking:
        return dataclasses.replace(self, **kw)

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id, "start": self.start, "end": self.end, "request": self.request.to_dict(),
            "users": sorted(self.users), "groups": sorted(self.groups), "slices": [sl.to_dict() for sl in self.slices],
            "state": self.state, "reason": self.reason, "problem": self.problem, "used_at": self.used_at,
            "grace_s": self.grace_s, "title": self.title,
        }  # fmt: skip


@dataclass(frozen=True)
class BookingWindow(MaintenanceWindow):
    """A booking as the scheduler's window index sees it: its GPUs, its time, its owner."""

    booking: Booking | None = None


def window_of(b: Booking) -> BookingWindow:
    what = f"booked for {b.owner_words()}" + (f": {b.title}" if b.title else "")
    return BookingWindow(f"booking:{b.id}", b.start, b.end, what, devices=b.devices, booking=b)


@dataclass(frozen=True)
class Placed:
    """What :func:`place` decided: the booking placed (``booking``), or why not and the next window that would work."""

    booking: Booking | None
    reason: str = ""
    next_start: float | None = None  # same length, the earliest start >= the asked start where it fits (within SEARCH_S)

    @property
    def ok(self) -> bool:
        return self.booking is not None


@dataclass(frozen=True)
class BookingChange:
    """What changed about a booking, for its owner: accepted, active, moved, marked, cleared, ended."""

    booking: Booking
    at: float
    what: str
    words: str


def _gpus_of(pool: Pool | Iterable[GPU]) -> list[GPU]:
    return [st.gpu for st in pool.gpus.values()] if isinstance(pool, Pool) else list(pool)


def _fmt(t: float) -> str:
    return f"{t:.0f}"


def place(booking: Booking, pool: Pool | Iterable[GPU], existing: Iterable[Booking], windows: Iterable[MaintenanceWindow] = (),
          *, search_s: float = SEARCH_S) -> Placed:
    """Place ``booking`` on GPUs of its kind that no other live booking (``existing``; its own id is
    skipped) and no maintenance window holds in ``[start, end)``, and that are in service now.

    Refused: a reason in words and, where one exists within ``search_s`` (14 days), the start of
    the earliest window of the same length, from the asked start on, where it would fit.
    """
    req = booking.request
    gpus = _gpus_of(pool)
    fresh = Pool(gpus, pool.share_placement if isinstance(pool, Pool) else "best_fit")
    if not booking.end > booking.start:
        return Placed(None, "a booking must end after it starts")
    never = fresh.why_never(req)
    if never is not None:
        return Placed(None, never[1])
    others = [b for b in existing if b.live and b.id != booking.id and b.slices]
    wins = [w for w in windows if w.end > w.start]
    length = booking.end - booking.start

    def blocked_at(t0: float, t1: float) -> tuple[set[str], int, int, int]:
        booked = {u for b in others if b.overlaps(t0, t1) for u in b.devices}
        inwin = {g.uuid for g in gpus for w in wins if w.start < t1 and t0 < w.end and w.covers(g)}
        sick = {g.uuid for g in gpus if not g.healthy}
        return booked | inwin | sick, len(booked), len(inwin - booked), len(sick - booked - inwin)

    def fit(t0: float) -> tuple[Slice, ...] | None:
        blocked = blocked_at(t0, t0 + length)[0]
        p = fresh.place(req, lambda st, milli, mem, mig: st.gpu.uuid in blocked)
        return None if p is None else p.slices

    got = fit(booking.start)
    if got is not None:
        return Placed(booking.with_(slices=got, state=ACCEPTED, reason="", problem=""))
    # earliest start from the asked one: a fit can only begin where something in the way ends
    limit = booking.start + search_s
    cands = sorted({t for t in [b.end for b in others] + [w.end for w in wins] if booking.start < t <= limit})
    nxt = next((t for t in cands if fit(t) is not None), None)
    _, n_booked, n_win, n_sick = blocked_at(booking.start, booking.end)
    why = [f"{n} booked by others" if (n := n_booked) else "", f"{n_win} in a maintenance window" if n_win else "",
           f"{n_sick} out of service" if n_sick else ""]
    why = ", ".join(w for w in why if w) or "too few of them together"
    reason = f"no {req.describe()} is free for the whole of {_fmt(booking.start)}–{_fmt(booking.end)} (GPUs in the way: {why})"
    if nxt is not None:
        reason += f"; the earliest {format_duration(length)} that would work starts at {_fmt(nxt)}"
    else:
        reason += f"; none within the {format_duration(search_s)} searched"
    return Placed(None, reason, nxt)


__all__ = ["ACCEPTED", "ACTIVE", "ENDED", "SEARCH_S", "UNUSED_GRACE_S", "Booking", "BookingChange", "BookingWindow", "Placed", "place", "window_of"]
