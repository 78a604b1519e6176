"""Bookings in the broker: GPUs reserved ahead for a user, a group or a list of users.

The scheduler places and keeps them (:mod:`jupyter_gpulease.core.bookings`); here they are
admitted by the admin's rules (how far ahead, how long, GPU-hours per user and week, who may
book: the broker's ``booking_*`` settings), made durable and shown.

* A booking is placed at once or refused at once: a window in the past, end before start, over
  the rules or a slice the pool lacks is a 400 naming the field; GPUs that are booked, in a
  maintenance window or out of service for the window, or a user over the GPU-hours, a 409 with
  the reason and, where one exists, the earliest start of the same length that would work
  (``next_start``).
* Every change the scheduler makes to a booking (accepted, active, moved, marked, cleared,
  ended) is written in the group commit with the lease changes of the same pass
  (:class:`.commit.GroupCommit`, schema 0006, :mod:`jupyter_gpulease.booking_store`) and goes
  on the event feed as an event of kind ``booking`` (no lease; admins' streams carry it).
* At start (and when a standby takes over) the bookings are read back with the maintenance
  windows (:func:`restore`, from :meth:`.health.HealthKeeper.start`).
* The calendar: :func:`ics` writes bookings as an iCalendar (RFC 5545) feed.
"""

from __future__ import annotations

import datetime as dt
import fnmatch
import logging
import secrets
from collections.abc import Iterable
from typing import Any

from .. import booking_store
from ..core.bookings import ENDED, Booking
from ..core.model import BadRequest, Conflict, Forbidden, NotFound, SliceKind
from ..core.request import MAX_NAME_LEN, parse_request
from ..core.text import format_duration

log = logging.getLogger(__name__)

WEEK = 7 * 86400.0
KEEP_ENDED_S = WEEK  # ended bookings stay in memory (lists, the calendar) this long after their end; the store keeps them all
START_SLACK_S = 60.0  # a booking may start this much in the past (the time the form took to send)
MAX_TITLE = 200


class BookingRefused(Conflict):
    """A booking that cannot be honoured; ``next_start``: the earliest start of the same length that would work."""

    def __init__(self, message: str, *, field: str | None = None, next_start: float | None = None):
        super().__init__(message, field=field)
        self.next_start = next_start

    def to_dict(self) -> dict[str, Any]:
        d = super().to_dict()
        if self.next_start is not None:
            d["next_start"] = self.next_start
        return d


async def restore(manager) -> int:
    """Read the bookings back into the scheduler (the live ones and those ended within :data:`KEEP_ENDED_S`)."""
    now = manager.now()
    rows = await manager.in_writer(lambda: booking_store.load(manager.store, ended_after=now - KEEP_ENDED_S))
    manager.scheduler.set_bookings(booking_store.booking_of(r) for r in rows)
    manager.commit.booking_extra.update({r["id"]: {"created_by": r["created_by"], "created_at": r["created_at"]} for r in rows})
    return len(rows)


def booked_gpus(b: Booking) -> int:
    """Whole GPUs a booking holds (a share or MIG booking holds the GPU its slice is on)."""
    if b.slices:
        return len(b.devices)
    return b.request.gpus_asked if b.request.kind is SliceKind.GPU else 1


def summary(b: Booking) -> str:
    """'2 × A100-SXM4-80GB for alice'."""
    models = sorted({sl.model for sl in b.slices}) or list(b.request.models) or ["GPU"]
    what = f"{booked_gpus(b)} × {', '.join(models)}"
    if b.request.kind is not SliceKind.GPU:
        what = f"{b.request.describe()} ({what})"
    return f"{what} for {b.owner_words()}"


class BookingDesk:
    """Admits, lists and ends bookings for the REST API (one per broker, holds the manager)."""

    def __init__(self, manager, *, max_ahead_s: float = 14 * 86400.0, max_length_s: float = 8 * 3600.0, gpu_hours_per_week: float = 40.0,
                 groups: Iterable[str] = (), logger: logging.Logger | None = None):
        self.manager = manager
        self.max_ahead_s = float(max_ahead_s)
        self.max_length_s = float(max_length_s)
        self.gpu_hours_per_week = float(gpu_hours_per_week)
        self.groups = frozenset(groups)
        self.log = logger or log

    @property
    def scheduler(self):
        return self.manager.scheduler

    # ------------------------------------------------------------------ reads
    def json(self, b: Booking) -> dict[str, Any]:
        extra = self.manager.commit.booking_extra.get(b.id, {})
        return {**b.to_dict(), "gpus": booked_gpus(b), "summary": summary(b), "created_by": extra.get("created_by", ""),
                "created_at": extra.get("created_at")}

    def visible(self, b: Booking, user: str, groups: Iterable[str], admin: bool) -> bool:
        return admin or b.owned_by(user, tuple(groups))

    def list(self, *, owner: str | None = None, owner_groups: Iterable[str] = (), model: str | None = None,
             start: float | None = None, end: float | None = None) -> list[Booking]:
        """Bookings soonest first: of ``owner`` (by name, or by one of ``owner_groups``), on GPUs of
        ``model`` (a glob), overlapping ``[start, end)``."""
        now = self.manager.now()
        out = []
        for b in self.scheduler.bookings.values():
            if b.state == ENDED and b.end <= now - KEEP_ENDED_S:
                continue
            if owner is not None and not b.owned_by(owner, tuple(owner_groups)):
                continue
            if model and not any(fnmatch.fnmatchcase(sl.model, model) for sl in b.slices):
                continue
            if not b.overlaps(-float("inf") if start is None else start, float("inf") if end is None else end):
                continue
            out.append(b)
        return sorted(out, key=lambda b: (b.start, b.id))

    async def get(self, booking_id: str) -> Booking:
        b = self.scheduler.bookings.get(booking_id)
        if b is None:
            row = await self.manager.in_reader(booking_store.get, self.manager.store, booking_id)
            if row is None:
                raise NotFound(f"no booking {booking_id!r}", field="id")
            b = booking_store.booking_of(row)
            self.manager.commit.booking_extra.setdefault(b.id, {"created_by": row["created_by"], "created_at": row["created_at"]})
        return b

    # ------------------------------------------------------------------ admission
    def _hours_in_a_week(self, user: str, new: Booking) -> float:
        """The most GPU-hours ``user``'s bookings (``new`` among them) hold in any 7 days that include ``new``."""
        mine = [b for b in self.scheduler.bookings.values() if user in b.users and (b.live or b.used_at is not None) and b.id != new.id]
        mine.append(new)
        lo, hi = new.end - WEEK, new.start
        ts = {lo, hi} | {t for b in mine for t in (b.start, b.end - WEEK) if lo <= t <= hi}
        best = 0.0
        for t in ts:
            held = sum(max(0.0, min(b.end, t + WEEK) - max(b.start, t)) * booked_gpus(b) for b in mine)
            best = max(best, held)
        return best / 3600.0

    async def book(self, *, caller: str, caller_groups: Iterable[str], admin: bool, start: float, end: float, request: Any,
                   users: list[str] | None = None, groups: list[str] | None = None, title: str = "") -> Booking:
        """Place a booking (see the module doc); the placed booking, once it is on disk."""
        caller_groups = tuple(caller_groups)
        if not admin and (groups or (users and users != [caller])):
            raise Forbidden("only admins may book for other users or for a group", field="groups" if groups else "users")
        for fld, names in (("users", users or []), ("groups", groups or [])):
            if not all(isinstance(x, str) and 0 < len(x.strip()) <= MAX_NAME_LEN for x in names) or len(names) > 1000:
                raise BadRequest(f"'{fld}' must be a list of names (at most {MAX_NAME_LEN} characters each)", field=fld)
        owners = sorted({x.strip() for x in users or []}) if users or groups else [caller]
        owner_groups = sorted({x.strip() for x in groups or []})
        if not admin:
            if self.groups and self.groups.isdisjoint(caller_groups):
                raise Forbidden(f"only members of {', '.join(sorted(self.groups))} may book GPUs ahead", field="groups")
            if self.gpu_hours_per_week <= 0:
                raise Forbidden("booking GPUs ahead is for admins only here (booking_gpu_hours_per_week is 0)", field="start")
        if not isinstance(title, str) or len(title) > MAX_TITLE:
            raise BadRequest(f"'title' must be a string of at most {MAX_TITLE} characters", field="title")
        now = self.manager.now()
        if end <= start:
            raise BadRequest("'end' must be after 'start'", field="end")
        if end <= now:
            raise BadRequest("the window is already over: 'end' is in the past", field="end")
        if start < now - START_SLACK_S:
            raise BadRequest("'start' is in the past: a booking reserves GPUs ahead (ask for a lease to start now)", field="start")
        if start - now > self.max_ahead_s:
            raise BadRequest(f"'start' is more than {format_duration(self.max_ahead_s)} ahead (booking_max_ahead_s)", field="start")
        if end - start > self.max_length_s:
            raise BadRequest(f"a booking lasts at most {format_duration(self.max_length_s)} (booking_max_length_s); this one "
                             f"{format_duration(end - start)}", field="end")
        if not isinstance(request, dict):
            raise BadRequest("'request' must be an object, as POST api/leases takes it: {\"gpus\": 2, \"model\": \"A100*\"}", field="request")
        req = parse_request(request)
        never = self.scheduler.pool.why_never(req)
        if never is not None:
            raise BadRequest(never[1], field=f"request.{never[0]}" if never[0] else "request")
        b = Booking(secrets.token_hex(6), float(start), float(end), req, users=frozenset(owners), groups=frozenset(owner_groups), title=title.strip())
        if not admin:
            used = self._hours_in_a_week(caller, b)
            if used > self.gpu_hours_per_week + 1e-9:
                raise BookingRefused(f"over the booking allowance: {used:.4g} GPU-hours within 7 days with this booking, "
                                     f"at most {self.gpu_hours_per_week:g} (booking_gpu_hours_per_week)", field="start")
        self.manager.commit.booking_extra[b.id] = {"created_by": caller, "created_at": now}
        got = self.scheduler.place_booking(b, now)
        if not got.ok:
            self.manager.commit.booking_extra.pop(b.id, None)
            await self.manager.flush()  # what the refusal read is on disk
            raise BookingRefused(got.reason, field="start", next_start=got.next_start)
        self.log.info("Booking %s by %s: %s, %s to %s", b.id, caller, summary(got.booking), start, end)
        await self.manager.commit.stage([], tick=True)
        return self.scheduler.bookings[b.id]

    async def end(self, booking_id: str, *, actor: str) -> Booking:
        """End a booking now (its GPUs go back to everyone; a lease running in it keeps its end)."""
        b = await self.get(booking_id)
        if not b.live:
            raise Conflict(f"booking {booking_id} has already ended ({b.reason})", field="id")
        self.scheduler.end_booking(booking_id, self.manager.now(), reason=f"ended early by {actor}")
        await self.manager.commit.stage([], tick=True)
        self.log.info("Booking %s ended early by %s", booking_id, actor)
        return self.scheduler.bookings[booking_id]


# --------------------------------------------------------------------------- iCalendar (RFC 5545)
def _ics_time(t: float) -> str:
    return dt.datetime.fromtimestamp(t, dt.UTC).strftime("%Y%m%dT%H%M%SZ")


def _ics_text(s: str) -> str:
    return s.replace("\\", "\\\\").replace(";", "\\;").replace(",", "\\,").replace("\r\n", "\\n").replace("\n", "\\n")


def _fold(line: str) -> str:
    """A content line folded at 75 octets (a CRLF and a space before each continuation; never inside a character)."""
    out, cur, size = [], [], 0
    for ch in line:
        n = len(ch.encode("utf-8"))
        if size + n > (75 if not out else 74):
            out.append("".join(cur))
            cur, size = [], 0
        cur.append(ch)
        size += n
    out.append("".join(cur))
    return "\r\n ".join(out)


def ics(bookings: Iterable[Booking], *, now: float, name: str = "GPU bookings", host: str = "gpulease") -> str:
    """The bookings as an iCalendar: one VEVENT each (UID, DTSTAMP, DTSTART/DTEND in UTC, SUMMARY,
    DESCRIPTION with the GPUs and the state); CRLF line endings, lines folded at 75 octets."""
    lines = ["BEGIN:VCALENDAR", "VERSION:2.0", "PRODID:-//jupyter-gpulease//bookings//EN", "CALSCALE:GREGORIAN", "METHOD:PUBLISH",
             f"X-WR-CALNAME:{_ics_text(name)}"]
    for b in bookings:
        gpus = ", ".join(f"{sl.model} #{sl.index} on {sl.node} ({sl.gpu_uuid})" for sl in b.slices) or "not placed"
        state = b.state + (f" ({b.reason})" if b.reason else "") + (f"; {b.problem}" if b.problem else "")
        desc = f"GPUs: {gpus}\nState: {state}" + (f"\n{b.title}" if b.title else "")
        lines += ["BEGIN:VEVENT", f"UID:{b.id}@{host}", f"DTSTAMP:{_ics_time(now)}", f"DTSTART:{_ics_time(b.start)}", f"DTEND:{_ics_time(b.end)}",
                  f"SUMMARY:{_ics_text(summary(b) + (f': {b.title}' if b.title else ''))}", f"DESCRIPTION:{_ics_text(desc)}",
                  f"STATUS:{'CANCELLED' if b.state == ENDED and b.used_at is None else 'CONFIRMED'}", "END:VEVENT"]
    lines.append("END:VCALENDAR")
    return "".join(_fold(x) + "\r\n" for x in lines)


__all__ = ["KEEP_ENDED_S", "BookingDesk", "BookingRefused", "booked_gpus", "ics", "restore", "summary"]
