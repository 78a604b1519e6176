"""The scheduler: the one façade the broker and the simulator call.

It holds the live (non-terminal) leases and the pool's occupancy. Every method takes ``now``
from the caller and returns the :class:`~.events.Event` list of what changed, so that the
broker can persist each batch in one transaction and the simulator can replay a trace with
its own clock. Nothing here does I/O.

A scheduling pass (:meth:`Scheduler.schedule`, walked by :class:`~.passes.SchedulingPass`)
follows the Kubernetes scheduling framework's phases, each in its own module:

1. queue order — tiers, fair share, aging (:mod:`.queue`);
2. quota gate — a lease whose concurrent quota is in use waits (:mod:`.quota`);
3. filter and score — where the slice fits now, per slice kind (:mod:`.pool`, :mod:`.slices`),
   without overlapping a promise to a lease ahead (backfill), or as a short grant;
4. post-filter — preemption of lower tiers when nothing fits (:mod:`.preemption`);
5. reserve — the earliest slot, which is the lease's ETA (:mod:`.reservations`).

Time-driven work (expiry, warnings, grace ends, wait limits, timeouts) is typed deadlines
(:mod:`.deadlines`) handled by :meth:`Scheduler.tick` (one handler per kind); the bookkeeping of
grants and ends is :class:`~.ledger.LeaseBook`'s; queries that change nothing (position, ETA,
the estimate for a request not yet made) are in :mod:`.views` and :mod:`.estimate`.
"""

from __future__ import annotations

import math
import uuid as _uuid
from collections.abc import Iterable, Iterator
from typing import Any

from . import events as ev
from .admission import check_ask, check_extension, lease_for
from .bookings import ACCEPTED, ACTIVE, ENDED, Booking, BookingChange, BookingWindow, Placed, place, window_of
from .deadlines import Deadline, Deadlines
from .estimate import DryRun, Estimate
from .events import Event
from .health import HEALTH_META, MOVED_META
from .ledger import LeaseBook
from .maintenance import MaintenanceWindow, WindowIndex
from .model import GPU, BadRequest, Conflict, Lease, LeaseError, LeaseState, NotFound
from .passes import SchedulingPass
from .policy import Policy, Tier
from .pool import Pool
from .preemption import Preemption
from .queue import WaitQueue
from .quota import Quotas
from .request import Ask
from .reservations import Reservations
from .text import format_duration
from .views import LastPass

INF = math.inf
REVOKE_META = "revoke"  # lease.meta of an admin's revoke with a grace: its reason and actor, until it ends
BOOKING_META = "booking"  # lease.meta of a lease granted in a booking: the booking's id


class Scheduler:
    """Decides grants, queue order, ETAs, expiry, extension and preemption for one pool."""

    def __init__(self, inventory: Iterable[GPU], policy: Policy | None = None):
        self.policy = policy or Policy()
        gpus = list(inventory)
        self.inventory: dict[str, GPU] = {g.uuid: g for g in gpus}
        self._queued = WaitQueue(self.policy)
        self._quotas = Quotas(self.policy)
        self._preemption = Preemption(self.policy)
        self._deadlines = Deadlines()
        self._found = LastPass()  # the last pass's ETAs, what each lease waits for, promises
        self._book = LeaseBook(self.policy, Pool(gpus, self.policy.share_placement), self._queued, self._quotas, self._preemption, self._deadlines, self._found)
        self.leases = self._book.leases  # the live leases, by id
        self._on_deadline = {
            Deadline.EXPIRE: self._expire,
            Deadline.WARN: self._warn,
            Deadline.PREEMPT: self._preempt_ends,
            Deadline.MAX_WAIT: self._wait_limit_ends,
            Deadline.CONFIRM: self._never_confirmed,
            Deadline.HEARTBEAT: self._heartbeats_stopped,
        }
        self._seq = 0
        self.draining = False
        self.windows: tuple[MaintenanceWindow, ...] = ()  # maintenance windows (see set_maintenance)
        self.bookings: dict[str, Booking] = {}  # by id (see set_bookings)
        self._booking_changes: list[BookingChange] = []
        self._bookings_seen = -INF  # the last tick's time, for the bookings' next deadline
        self._pending: list[Event] = []  # events of booking work done in a tick before its pass (a stranger warned off a booked GPU)
        # (user, server) whose lease was drained off a sick GPU -> what happened: their next request goes first in its tier
        self.moved: dict[tuple[str, str], dict[str, Any]] = {}
        self.last_pass_now: float = 0.0
        self.passes = 0

    @property
    def pool(self) -> Pool:
        """The pool's live occupancy (replaced by :meth:`set_inventory`)."""
        return self._book.pool

    # ================================================================== requests
    def check_ask(self, ask: Ask, now: float) -> tuple[Tier, float]:
        """The tier and duration ``ask`` gets under this policy and pool; raises what is wrong (see :mod:`.admission`)."""
        return check_ask(ask, now, policy=self.policy, pool=self.pool, quotas=self._quotas, leases=self.leases, queued=self._queued.queued_of(ask.user))

    def new_lease(self, ask: Ask, now: float, *, lease_id: str | None = None) -> Lease:
        """Check ``ask`` (see :meth:`check_ask`) and build its lease, queued but not yet submitted."""
        tier, duration_s = self.check_ask(ask, now)
        return lease_for(ask, tier, duration_s, now, lease_id or _uuid.uuid4().hex[:16])

    def submit(self, lease: Lease, now: float, actor: str = "") -> list[Event]:
        """Put a lease from :meth:`new_lease` in the queue."""
        if lease.id in self.leases:
            raise Conflict(f"lease {lease.id} already exists")
        self._seq += 1
        lease.seq = self._seq
        lease.state = LeaseState.QUEUED
        lease.resuming = (lease.user, lease.server) in self._book.reclaimed_from
        moved = self.moved.pop((lease.user, lease.server), None)
        if moved is not None:
            lease.resuming = True
            lease.meta = {**lease.meta, MOVED_META: moved}
        self.leases[lease.id] = lease
        self._queued.add(lease, self.pool.gpu_milli_of(lease.request))
        self.pool.note_request(lease.request)
        if lease.max_wait_s is not None:
            self._deadlines.add(lease.created_at + lease.max_wait_s, Deadline.MAX_WAIT, lease.id)
        self._book.dirty = True
        return [ev.requested(lease, now, actor or lease.user)]

    def estimate(self, ask: Ask, now: float) -> Estimate:
        """What ``ask`` would get if it were made now: start now, wait (position, ETA), or never. Changes nothing.

        Run right after a pass (the broker ticks after every change), it is exactly what the
        next pass would decide for it; see :mod:`.estimate`.
        """
        try:
            tier, duration_s = self.check_ask(ask, now)
        except LeaseError as e:
            return Estimate("never", refused=e)
        target = lease_for(ask, tier, duration_s, now, "(estimate)")
        target.seq = self._seq + 1
        target.resuming = (target.user, target.server) in self._book.reclaimed_from
        if (target.user, target.server) in self.moved:
            target.resuming = True
            target.meta = {**target.meta, MOVED_META: self.moved[(target.user, target.server)]}
        book = self._book
        dry = DryRun(target, self.pool, book.preemptible, lambda v: self.policy.tier(v.tier).grace_s, now, book.live_end, book.free_at)
        found = LastPass()
        self._queued.add(target, self.pool.gpu_milli_of(target.request))
        try:
            order = self._queued.in_order(now, self._quotas.usage)
            position = 0
            if not self.draining:
                run = self._pass(now, found, Reservations(self.pool, now, dry.end_of, dry.free_at, self._window_index(now)), grant=dry.grant, preempt=dry.preempt)
                counted = _Counted(order)
                run.run(counted, stop=dry.is_target)
                position = counted.n
            if not dry.decided:
                position += next((k for k, lease in enumerate(order, 1) if lease is target), 0)
            length = len(self._queued)
        finally:
            self._queued.remove(target)
            dry.undo()
        waited = None if ask.max_wait_s is None else now + ask.max_wait_s
        if dry.fit is not None:
            placement, until = dry.fit
            why = (self._cut_why(placement, until, now) or "these GPUs are promised to a waiting lease from then") if until is not None else ""
            return Estimate("now", tier.name, (until or now + duration_s) - now, until is not None, placement, short_why=why,
                            within_wait_limit=None if waited is None else True)
        eta = found.eta.get(target.id)
        if target.id in found.quota_held:
            eta = self._quotas.frees_at(target, self.pool.gpu_milli_of(target.request), self.leases, book.live_end)
        why = found.waiting_for.get(target.id) or self._waiting_text(target, position)
        return Estimate(
            "queued", tier.name, duration_s, position=position, length=length, eta=eta, waiting_for=why,
            within_wait_limit=None if waited is None or eta is None else eta <= waited,
        )  # fmt: skip

    # ================================================================== lease calls
    def get(self, lease_id: str) -> Lease:
        lease = self.leases.get(lease_id)
        if lease is None:
            raise NotFound(f"no live lease {lease_id!r}")
        return lease

    def release(self, lease_id: str, now: float, *, state: LeaseState = LeaseState.RELEASED, reason: str = "", actor: str = "") -> list[Event]:
        """End a lease: a queued one is withdrawn, an active one ends in ``state``."""
        lease = self.get(lease_id)
        if lease.state is LeaseState.QUEUED:
            return self._book.end(lease, LeaseState.WITHDRAWN, now, reason or "withdrawn by its requester", actor)
        if not state.terminal or state in (LeaseState.WITHDRAWN,):
            raise BadRequest(f"cannot end an active lease as {state.value!r}", field="state")
        return self._book.end(lease, state, now, reason or "released by its holder", actor)

    def revoke(self, lease_id: str, now: float, *, grace_s: float, reason: str, actor: str = "") -> list[Event]:
        """An admin ends a lease after ``grace_s`` seconds, warning its holder now (a queued one is
        withdrawn at once). The lease ends as revoked with ``reason`` when the grace is over."""
        lease = self.get(lease_id)
        if lease.state is LeaseState.QUEUED or grace_s <= 0:
            return self.release(lease_id, now, state=LeaseState.REVOKED, reason=reason, actor=actor)
        at = now + grace_s
        if lease.preempt_at is not None and lease.preempt_at <= at:
            raise Conflict(f"lease {lease.id} already ends in {format_duration(lease.preempt_at - now)}, before this grace is over")
        if lease.expires_at is not None and lease.expires_at <= at:
            raise Conflict(f"lease {lease.id} expires in {format_duration(lease.expires_at - now)}, before this grace is over: revoke it now or let it run out")
        if lease.preempted_for:
            self._preemption.victim_ended(lease)  # a revoke replaces the preemption it was warned of
        lease.meta = {**lease.meta, REVOKE_META: {"reason": reason, "actor": actor}}
        self._book.revoke_at(lease, at)
        return [ev.revoke_warned(lease, now, f"an admin ends this lease in {format_duration(grace_s)}: {reason}; save your work", actor)]

    def drain(self, lease_id: str, now: float, *, grace_s: float, reason: str, device: str, actor: str = "broker") -> list[Event]:
        """Move an active lease off a sick GPU: it ends as revoked after ``grace_s`` (its holder's
        kernels are suspended meanwhile; 0: at once), and the next request of its server goes first
        in its tier, onto a healthy GPU. ``lease.meta['health']`` keeps what happened and why."""
        lease = self.get(lease_id)
        if lease.state is not LeaseState.ACTIVE:
            return []
        info = {"device": device, "reason": reason, "at": now, "action": "drain_now"}
        lease.meta = {**lease.meta, HEALTH_META: info}
        key = (lease.user, lease.server)
        if grace_s <= 0:
            self.moved[key] = info
            return self._book.end(lease, LeaseState.REVOKED, now, f"moved off its GPU: {reason}", actor)
        at = now + grace_s
        if (lease.preempt_at is not None and lease.preempt_at <= at) or lease.expires_at <= at:
            self.moved[key] = info  # it ends within the grace anyway
            return [ev.revoke_warned(lease, now, f"its GPU is failing ({reason}); this lease ends in {format_duration(min(lease.preempt_at or INF, lease.expires_at) - now)}", actor)]
        if lease.preempted_for:
            self._preemption.victim_ended(lease)
        lease.meta = {**lease.meta, REVOKE_META: {"reason": f"moved off its GPU: {reason}", "actor": actor, "drain": True}}
        self._book.revoke_at(lease, at)
        return [ev.revoke_warned(lease, now, f"its GPU is failing ({reason}): this lease moves to a healthy GPU in {format_duration(grace_s)}; "
                                             "its kernels are suspended first and resume there", actor)]

    def cancel_drain(self, lease_id: str, now: float, *, why: str, actor: str = "broker") -> list[Event]:
        """Call off a drain whose grace is not over (its GPU went back into the pool): the lease
        keeps its GPU and runs to its own end; its holder is told (``preempt-cancelled``). A lease
        with no drain pending is left as it is (no event)."""
        lease = self.leases.get(lease_id)
        if lease is None or lease.state is not LeaseState.ACTIVE or HEALTH_META not in lease.meta:
            return []
        revoke = lease.meta.get(REVOKE_META)
        draining = isinstance(revoke, dict) and revoke.get("drain") and lease.preempt_at is not None
        meta = {k: v for k, v in lease.meta.items() if k != HEALTH_META and not (draining and k == REVOKE_META)}
        lease.meta = meta
        self.moved.pop((lease.user, lease.server), None)
        if draining:
            lease.preempt_at = None  # its deadline, when it comes, finds nothing to end
        self._book.touch(lease.placement)
        return [ev.preempt_cancelled(lease, now, f"the move off its GPU is called off: {why}", actor=actor)]

    def extend(self, lease_id: str, now: float, *, by_s: float | None = None, until: float | None = None, actor: str = "") -> list[Event]:
        """Move ``expires_at`` later, within the tier's limits."""
        lease = self.leases.get(lease_id)
        if lease is None:
            raise NotFound(f"no live lease {lease_id!r}")
        if lease.state is not LeaseState.ACTIVE:
            raise Conflict(f"lease {lease_id} is {lease.state.value}; only an active lease can be extended")
        if (by_s is None) == (until is None):
            raise BadRequest("give exactly one of 'by_s' (how much longer, e.g. 3600 or '1h') or 'until' (the new end, epoch seconds)", field="by_s")
        for name, v in (("by_s", by_s), ("until", until)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or v != v or v in (INF, -INF)):
                raise BadRequest(f"'{name}' must be a number, got {v!r}", field=name)
        fld = "by_s" if by_s is not None else "until"
        new = until if until is not None else lease.expires_at + by_s
        waiters = [w for sl in lease.placement.slices if (w := self.leases.get(self._found.promised_to.get(sl.mig_uuid or sl.gpu_uuid, ""))) is not None]
        check_extension(lease, new, now, fld, policy=self.policy, quotas=self._quotas, waiters=waiters, aged_cutoff=lambda: self._queued.aged_cutoff(now))
        idx = self._window_index(now)
        for sl in lease.placement.slices if idx else ():
            w = self._clash_for(lease, idx, sl.gpu_uuid, lease.expires_at, new)
            if w is not None:
                because = f" ({w.reason})" if w.reason else ""
                what = "booking" if isinstance(w, BookingWindow) else "maintenance window"
                raise Conflict(f"a {what} of its GPU begins in {format_duration(max(0.0, w.start - now))}{because}: "
                               "the lease cannot be extended past it", field=fld)
        b = self.bookings.get(str(lease.meta.get(BOOKING_META, "")))
        if b is not None and new > b.end:
            raise Conflict(f"this lease runs in booking {b.id}, which ends in {format_duration(max(0.0, b.end - now))}: "
                           "it cannot be extended past the booking's end", field=fld)
        old = lease.expires_at
        lease.expires_at = new
        lease.warned_at = None
        self._book.touch(lease.placement)
        self._book.add_expiry_deadlines(lease, now)
        self._book.dirty = True  # ETAs move
        return [ev.extended(lease, now, old, actor or lease.user)]

    def confirm(self, lease_id: str, now: float, actor: str = "") -> list[Event]:
        """The holder says the server using this lease is up."""
        lease = self.get(lease_id)
        if lease.state is not LeaseState.ACTIVE:
            raise Conflict(f"lease {lease_id} is {lease.state.value}; only an active lease can be confirmed")
        lease.last_heartbeat = now
        if lease.confirmed_at is not None:
            return []
        lease.confirmed_at = now
        return [ev.confirmed(lease, now, actor or lease.user)]

    def heartbeat(self, lease_id: str, now: float, usage: dict | None = None) -> list[Event]:
        """The holder is alive; ``usage`` is its latest sample. Confirms an unconfirmed lease."""
        lease = self.get(lease_id)
        if usage is not None:
            if not isinstance(usage, dict):
                raise BadRequest("'usage' must be an object", field="usage")
            lease.usage = dict(usage)
        if lease.state is LeaseState.QUEUED:
            return []
        lease.last_heartbeat = now
        if self.policy.heartbeat_timeout_s:
            self._deadlines.add(now + self.policy.heartbeat_timeout_s, Deadline.HEARTBEAT, lease.id)
        if lease.confirmed_at is None:
            lease.confirmed_at = now
            return [ev.confirmed(lease, now, lease.user)]
        return []

    def set_maintenance(self, windows: Iterable[MaintenanceWindow]) -> None:
        """The maintenance windows (replacing the previous ones): no lease is granted that would run
        into a window of its GPUs (see :mod:`.maintenance`); ETAs fall after the windows in the way."""
        self.windows = tuple(windows)
        self._windex = None
        self._book.dirty = True

    _windex: WindowIndex | None = None

    def _window_index(self, now: float) -> WindowIndex | None:
        """The windows per GPU, maintenance and live bookings (None: none); built once per change
        of the windows, the bookings or the pool."""
        if not self.windows and not self.bookings:
            return None
        if self._windex is None:
            booked = [window_of(b) for b in self.bookings.values() if b.live and b.slices]
            self._windex = WindowIndex((*self.windows, *booked), self.inventory)
        return self._windex or None

    def windows_on(self, gpu_uuid: str, now: float) -> list[MaintenanceWindow]:
        """The maintenance windows still to come (or under way) on a GPU, soonest first."""
        idx = self._window_index(now)
        return [w for w in idx.by_gpu.get(gpu_uuid, ()) if w.end > now and not isinstance(w, BookingWindow)] if idx else []

    def _clash_for(self, lease: Lease, idx: WindowIndex, gpu_uuid: str, start: float, end: float) -> MaintenanceWindow | None:
        """The first window of a GPU that overlaps [start, end) and keeps ``lease`` out (its owner's bookings do not)."""
        for w in idx.by_gpu.get(gpu_uuid, ()):
            if w.start < end and start < w.end and not (isinstance(w, BookingWindow) and w.booking.owned_by(lease.user, lease.groups)):
                return w
        return None

    # ================================================================== bookings
    def set_bookings(self, bookings: Iterable[Booking]) -> None:
        """The bookings (replacing the previous ones; placed ones, see :func:`.bookings.place`). For
        everyone but its owner a live booking is a maintenance window on its GPUs; from its start its
        owner's requests that fit it take its GPUs first, each until the booking's end at the latest."""
        self.bookings = {b.id: b for b in bookings}
        self._windex = None
        self._book.dirty = True

    def place_booking(self, booking: Booking, now: float) -> Placed:
        """Place ``booking`` (see :func:`.bookings.place`) among the live bookings and the maintenance
        windows, and keep it when it is placed. Changes nothing when refused."""
        if booking.end <= now:
            return Placed(None, "a booking must end in the future")
        got = place(booking, self.inventory.values(), self.bookings.values(), self.windows)
        if got.ok:
            self.bookings[booking.id] = got.booking
            self._windex = None
            self._book.dirty = True
            self._note(got.booking, now, ACCEPTED, f"booking accepted on {', '.join(sorted(got.booking.devices))}")
        return got

    def end_booking(self, booking_id: str, now: float, reason: str = "ended early") -> BookingChange:
        """End a booking now: its GPUs go back to everyone (a lease already running in it keeps its end)."""
        b = self.bookings.get(booking_id)
        if b is None:
            raise NotFound(f"no booking {booking_id!r}")
        if not b.live:
            raise Conflict(f"booking {booking_id} has already ended ({b.reason})")
        return self._end_booking(b, now, reason)

    def pop_booking_changes(self) -> list[BookingChange]:
        """What changed about bookings since the last call (for telling their owners)."""
        out, self._booking_changes = self._booking_changes, []
        return out

    def _note(self, b: Booking, now: float, what: str, words: str) -> BookingChange:
        change = BookingChange(b, now, what, words)
        self._booking_changes.append(change)
        return change

    def _set_booking(self, b: Booking) -> None:
        self.bookings[b.id] = b
        self._windex = None
        self._book.dirty = True

    def _end_booking(self, b: Booking, now: float, reason: str) -> BookingChange:
        b = b.with_(state=ENDED, reason=reason)
        self._set_booking(b)
        return self._note(b, now, ENDED, f"booking ended: {reason}")

    def _bookings_in_time(self, now: float) -> None:
        """Bookings at ``now``: over, not used within their grace, or with a stranger still on their GPUs."""
        for b in list(self.bookings.values()):
            if not b.live:
                continue
            if b.end <= now:
                self._end_booking(b, now, "its time is over")
            elif b.state == ACCEPTED and b.start + b.grace_s <= now:
                self._end_booking(b, now, f"not used within {format_duration(b.grace_s)}")
            else:
                self._strangers_off(b, now)

    def _strangers_off(self, b: Booking, now: float) -> None:
        """A lease of someone else that holds a booked GPU into the booking (granted before the booking
        was placed) ends with its tier's grace, timed to end at the booking's start where there is time."""
        for u in b.devices:
            st = self.pool.gpus.get(u)
            for holder in list(st.holders) if st is not None else ():
                lease = self.leases.get(holder)
                if lease is None or lease.state is not LeaseState.ACTIVE or b.owned_by(lease.user, lease.groups):
                    continue
                if self._book.lease_end(lease) <= b.start:
                    continue
                grace = self.policy.tier(lease.tier).grace_s
                if now < b.start - grace:
                    continue
                at = max(b.start, now + grace)
                if lease.preempt_at is not None and lease.preempt_at <= at:
                    continue
                if lease.preempted_for:
                    self._preemption.victim_ended(lease)
                why = f"its GPU is booked from {b.start:.0f} ({window_of(b).reason})"
                lease.meta = {**lease.meta, REVOKE_META: {"reason": why, "actor": "broker"}}
                self._book.revoke_at(lease, at)
                self._pending.append(ev.revoke_warned(lease, now, f"{why}: this lease ends in {format_duration(at - now)}; save your work", "broker"))

    def _bookings_health(self, now: float) -> None:
        """A live booking on a GPU out of service moves to healthy GPUs of its kind where there are, else is marked."""
        for b in list(self.bookings.values()):
            if not b.live or not b.slices or b.end <= now:
                continue
            sick = sorted(u for u in b.devices if u not in self.inventory or not self.inventory[u].healthy)
            if not sick:
                if b.problem:
                    fine = b.with_(problem="")
                    self._set_booking(fine)
                    self._note(fine, now, "cleared", "its GPUs are back in service")
                continue
            others = [o for o in self.bookings.values() if o.id != b.id]
            got = place(b.with_(slices=()), self.inventory.values(), others, self.windows)
            if got.ok:
                moved = got.booking.with_(state=b.state, used_at=b.used_at)
                self._set_booking(moved)
                self._note(moved, now, "moved", f"moved off {', '.join(sick)} (out of service) to {', '.join(sorted(moved.devices))}")
            elif b.problem == "" or sick[0] not in b.problem:
                marked = b.with_(problem=f"its GPU {', '.join(sick)} is out of service and no healthy {b.request.describe()} is free for it")
                self._set_booking(marked)
                self._note(marked, now, "marked", marked.problem)

    def _booked_grants(self, now: float) -> list[Event]:
        """From a booking's start, its owner's waiting requests that fit its GPUs start there (queue order),
        each until the booking's end at the latest; no quota gate (the booking is the guarantee)."""
        live = [b for b in self.bookings.values() if b.live and b.slices and b.start <= now < b.end]
        if not live:
            return []
        out: list[Event] = []
        idx = self._window_index(now)
        for lease in list(self._queued.in_order(now, self._quotas.usage)):
            for b in live:
                if not b.owned_by(lease.user, lease.groups):
                    continue
                only = b.devices if not lease.require_gpus else b.devices & frozenset(lease.require_gpus)
                until = b.end if now + lease.duration_s > b.end else None
                end = until or now + lease.duration_s

                def blocked(st, milli, mem, mig_uuid, lease=lease, end=end):
                    return idx is not None and self._clash_for(lease, idx, st.gpu.uuid, now, end) is not None

                placement = self.pool.place(lease.request, blocked, only=only) if only else None
                if placement is None:
                    continue
                lease.meta = {**lease.meta, BOOKING_META: b.id}
                out += self._book.grant(lease, placement, now, until, cut_why=f"its booking {b.id} ends then")
                if b.state == ACCEPTED:
                    used = b.with_(state=ACTIVE, used_at=now)
                    self.bookings[b.id] = used  # same GPUs and time: the window index stays
                    live = [used if o.id == b.id else o for o in live]
                    self._note(used, now, ACTIVE, f"in use from {now:.0f} by {lease.user}")
                break
        return out

    def _booking_words(self, found: LastPass, plan: Reservations, now: float) -> None:
        """A waiting lease whose ETA waits for a booking says so (the pass words it as a maintenance window)."""
        for lid, w in plan.window_waits.items():
            text = found.waiting_for.get(lid, "")
            if isinstance(w, BookingWindow) and "maintenance window" in text and lid in self.leases:
                found.waiting_for[lid] = (f"waiting for {self.leases[lid].request.describe()}: its GPUs are booked "
                                          f"(in {format_duration(max(0.0, w.start - now))}, for {format_duration(w.end - w.start)}: {w.reason}); "
                                          "it starts after the booking")

    def _cut_why(self, placement, until: float | None, now: float) -> str:
        """Why a grant ends at ``until`` when a maintenance window begins then ("" otherwise)."""
        idx = self._window_index(now) if until is not None else None
        for sl in placement.slices if idx else ():
            for w in idx.by_gpu.get(sl.gpu_uuid, ()):
                if w.start == until and isinstance(w, BookingWindow):
                    return "a booking of its GPU begins then"
                if w.start == until:
                    because = f" ({w.reason})" if w.reason else ""
                    return f"a maintenance window of its GPU begins then{because}"
        return ""

    def set_draining(self, draining: bool) -> None:
        """Stop (or resume) granting: while draining, passes grant and preempt nothing; time still ends leases."""
        self.draining = bool(draining)
        self._book.dirty = True

    # ================================================================== time
    def next_deadline(self) -> float | None:
        """When :meth:`tick` next has time-driven work (None: none pending). For simulators."""
        t = self._deadlines.next_time(self.leases.__contains__)
        ends = [w.end for w in self.windows if w.end > self.last_pass_now]
        if ends and len(self._queued):
            t = min(ends) if t is None else min(t, *ends)
        grace = max((tier.grace_s for tier in self.policy.tiers.values()), default=0.0)
        times = [x for b in self.bookings.values() if b.live
                 for x in (b.start - grace, b.start, b.start + b.grace_s if b.state == ACCEPTED else INF, b.end) if x > self._bookings_seen]
        if times:
            t = min(times) if t is None else min(t, *times)
        return t

    def tick(self, now: float) -> list[Event]:
        """Apply what time brings (expiry, warnings, grace ends, wait limits, timeouts), then schedule."""
        out: list[Event] = []
        failed, self._book.restore_failed = self._book.restore_failed, []
        for lid, why in failed:
            lease = self.leases.get(lid)
            if lease is not None:
                out += self._book.end(lease, LeaseState.FAILED, now, why, "broker")
        for kind, lid in self._deadlines.due(now):
            lease = self.leases.get(lid)
            if lease is not None:
                out += self._on_deadline[kind](lease, now)
        if self.windows and any(self.last_pass_now < w.end <= now for w in self.windows):
            self._book.dirty = True  # a maintenance window ended: what waited for it may start
        if self.bookings:
            if any(b.live and (self.last_pass_now < b.start <= now or self.last_pass_now < b.end <= now) for b in self.bookings.values()):
                self._book.dirty = True  # a booking began (its owner may start) or ended (what waited may start)
            self._bookings_in_time(now)
            self._bookings_seen = max(self._bookings_seen, now)
            out += self._pending
            self._pending = []
        # a warning alone changes nothing a pass decides on (an extension that follows it does)
        if self._book.dirty or any(e.kind != ev.WARNED for e in out):
            out += self.schedule(now)
        return out

    def _expire(self, lease: Lease, now: float) -> list[Event]:
        if lease.state is LeaseState.ACTIVE and lease.expires_at <= now:
            return self._book.end(lease, LeaseState.EXPIRED, lease.expires_at, f"its time limit of {format_duration(lease.expires_at - lease.granted_at)} ran out", "broker")
        return []

    def _warn(self, lease: Lease, now: float) -> list[Event]:
        if lease.state is LeaseState.ACTIVE and lease.warned_at is None and lease.expires_at - self.policy.warn_before_s <= now < lease.expires_at:
            lease.warned_at = now
            return [ev.warned(lease, now, f"this lease expires in {format_duration(lease.expires_at - now)}")]
        return []

    def _preempt_ends(self, lease: Lease, now: float) -> list[Event]:
        if lease.state is LeaseState.ACTIVE and lease.preempt_at is not None and lease.preempt_at <= now:
            revoke = lease.meta.get(REVOKE_META) if not lease.preempted_for else None
            if isinstance(revoke, dict):  # an admin's revoke (or a drain) whose grace is over
                if revoke.get("drain") and isinstance(lease.meta.get(HEALTH_META), dict):
                    self.moved[(lease.user, lease.server)] = lease.meta[HEALTH_META]
                return self._book.end(lease, LeaseState.REVOKED, lease.preempt_at, str(revoke.get("reason") or "revoked by an admin"),
                                      str(revoke.get("actor") or "admin"))
            w = self.leases.get(lease.preempted_for)
            for_what = f"a waiting {w.tier} lease" if w else "a higher-tier lease"
            return self._book.end(lease, LeaseState.PREEMPTED, lease.preempt_at, f"preempted for {for_what}", "broker")
        return []

    def _wait_limit_ends(self, lease: Lease, now: float) -> list[Event]:
        if lease.state is LeaseState.QUEUED and lease.max_wait_s is not None and lease.created_at + lease.max_wait_s <= now:
            limit = lease.created_at + lease.max_wait_s
            return self._book.end(lease, LeaseState.WITHDRAWN, limit, f"not granted within its wait limit of {format_duration(lease.max_wait_s)}", "broker")
        return []

    def _never_confirmed(self, lease: Lease, now: float) -> list[Event]:
        timeout = self.policy.confirm_timeout_s
        if lease.state is LeaseState.ACTIVE and lease.confirmed_at is None and timeout is not None:
            return self._book.end(lease, LeaseState.REVOKED, now, f"never confirmed by its holder within {format_duration(timeout)} of the grant", "broker")
        return []

    def _heartbeats_stopped(self, lease: Lease, now: float) -> list[Event]:
        timeout = self.policy.heartbeat_timeout_s
        last = lease.last_heartbeat or lease.confirmed_at or lease.granted_at
        if lease.state is LeaseState.ACTIVE and timeout and last + timeout <= now:
            return self._book.end(lease, LeaseState.REVOKED, now, f"its holder stopped sending heartbeats ({format_duration(now - last)} without one)", "broker")
        return []

    # ================================================================== the pass
    def schedule(self, now: float) -> list[Event]:
        """One scheduling pass: walk the queue in order; grant what fits, reserve for the first waiters, preempt.

        The phases are :class:`~.passes.SchedulingPass`'s; this applies its decisions.
        """
        self.passes += 1
        self._book.dirty = False
        self.last_pass_now = now
        self._found.clear()
        if not len(self._queued) or self.draining:
            return []
        book = self._book
        out = self._booked_grants(now) if self.bookings else []
        plan = Reservations(self.pool, now, book.live_end, book.free_at, self._window_index(now))
        run = self._pass(
            now, self._found, plan,
            grant=lambda lease, placement, until: book.grant(lease, placement, now, until, cut_why=self._cut_why(placement, until, now)),
            preempt=lambda waiter, victims: book.start_preemption(waiter, victims, now),
        )  # fmt: skip
        out += run.run(self._queued.in_order(now, self._quotas.usage))
        if self.bookings:
            self._booking_words(self._found, plan, now)
        return out

    def _pass(self, now: float, found: LastPass, plan: Reservations, *, grant, preempt) -> SchedulingPass:
        return SchedulingPass(
            now, policy=self.policy, pool=self.pool, queue=self._queued, quotas=self._quotas, preemption=self._preemption,
            leases=self.leases, plan=plan, found=found, grant=grant, preempt=preempt,
        )  # fmt: skip

    # ================================================================== restore, history, inventory    # ================================================================== restore, history, inventory
    def restore(self, leases: Iterable[Lease]) -> None:
        """Take back the live leases of a previous run (after a broker restart)."""
        self._seq = max(self._seq, self._book.restore(leases))

    def record_usage(self, user: str, groups: Iterable[str], start: float, end: float, gpu_milli: int) -> None:
        """Count GPU use that ended (here, or in history loaded at start) for fair share and quotas."""
        self._quotas.record_usage(user, groups, start, end, gpu_milli)

    def set_inventory(self, gpus: Iterable[GPU], now: float) -> list[Event]:
        """Replace the inventory; leases on GPUs that left the pool fail."""
        gpus = list(gpus)
        self.inventory = {g.uuid: g for g in gpus}
        self._windex = None
        out = self._book.set_inventory(gpus, now)
        if self.bookings:
            self._bookings_health(now)
        return out

    # ================================================================== views
    def queue(self) -> list[Lease]:
        """Queued leases in scheduling order, as of the last pass."""
        return self._order_until(None)[0]

    def queue_length(self) -> int:
        return len(self._queued)

    def queue_position(self, lease_id: str) -> tuple[int, int]:
        lease = self.leases.get(lease_id)
        if lease is None or lease.state is not LeaseState.QUEUED:
            raise NotFound(f"lease {lease_id!r} is not in the queue")
        return self._order_until(lease_id)[1][lease_id] + 1, len(self._queued)

    def _order_until(self, lease_id: str | None):
        return self._found.order_until(lease_id, self._queued.version, lambda: self._queued.in_order(self.last_pass_now, self._quotas.usage))

    def eta(self, lease_id: str) -> float | None:
        """When the lease's reservation starts (or, held back by a quota, when the quota frees up); None: not known."""
        if lease_id in self._found.quota_held and lease_id in self.leases:
            lease = self.leases[lease_id]
            return self._quotas.frees_at(lease, self.pool.gpu_milli_of(lease.request), self.leases, self._book.live_end)
        return self._found.eta.get(lease_id)

    def waiting_for(self, lease_id: str) -> str:
        w = self._found.waiting_for.get(lease_id)
        if w:
            return w
        lease = self.leases.get(lease_id)
        if lease is None:
            return ""
        return self._waiting_text(lease, self.queue_position(lease_id)[0] if lease.state is LeaseState.QUEUED else None)

    def _waiting_text(self, lease: Lease, position: int | None) -> str:
        what = f"waiting for {lease.request.describe()}"
        if self.draining:
            return f"{what}: no leases are being granted right now (the broker is draining)"
        if position is not None and position > self.policy.reservation_depth:
            return f"{what}: behind {self.policy.reservation_depth} waiting leases with a reservation, no estimate yet"
        return what

    def queue_info(self, lease_id: str) -> dict[str, Any] | None:
        """What a queued lease's holder wants to know: position, length, ETA, what it waits for,
        and whether that ETA falls after the lease's wait limit (it would give up first)."""
        lease = self.leases.get(lease_id)
        if lease is None or lease.state is not LeaseState.QUEUED:
            return None
        pos, n = self.queue_position(lease_id)
        eta = self.eta(lease_id)
        gives_up_at = None if lease.max_wait_s is None else lease.created_at + lease.max_wait_s
        return {
            "position": pos,
            "length": n,
            "eta": eta,
            "waiting_for": self.waiting_for(lease_id),
            "gives_up_at": gives_up_at,
            "eta_after_wait_limit": eta is not None and gives_up_at is not None and eta > gives_up_at,
        }

    def promised_holders(self, lease_id: str) -> list[Lease] | None:
        """The active leases that hold the devices the last pass promised to waiting ``lease_id``
        (a GPU promised: every lease with a slice of it; a MIG instance: its holder); None when
        nothing is promised to it. Found through the pool's holders, so a queued lease's read
        costs what it waits for, not a walk over every live lease."""
        promised = [u for u, lid in self._found.promised_to.items() if lid == lease_id]
        if not promised:
            return None
        pool, out, seen = self.pool, [], set()
        for u in promised:
            st = pool.gpus.get(u)
            mig = st is None
            if mig:
                st = pool.mig_owner.get(u)
            for holder in list(st.holders) if st is not None else ():
                lease = self.leases.get(holder)
                if holder in seen or lease is None or lease.state is not LeaseState.ACTIVE or lease.placement is None:
                    continue
                if mig and not any(sl.mig_uuid == u for sl in lease.placement.slices):
                    continue
                seen.add(holder)
                out.append(lease)
        return out

    def preempting_for(self, lease_id: str) -> list[str] | None:
        """The leases still in their grace, preempted to make room for ``lease_id`` ([] once they
        have all ended while it still waits; None: no preemption was started for it)."""
        victims = self._preemption.victims_of.get(lease_id)
        return None if victims is None else sorted(victims)

    def capacity(self) -> dict[str, dict]:
        return self.pool.capacity()

    def active(self) -> list[Lease]:
        return [lease for lease in self.leases.values() if lease.state is LeaseState.ACTIVE]

    def user_usage(self, user: str, groups: Iterable[str], now: float) -> dict[str, Any]:
        """GPUs held, GPU-hours used in the quota period, and what the quota leaves."""
        return self._quotas.user_usage(user, groups, now, self.leases)


class _Counted:
    """An iterator that counts what it gave."""

    def __init__(self, it: Iterator[Lease]):
        self._it = it
        self.n = 0

    def __iter__(self):
        return self

    def __next__(self) -> Lease:
        lease = next(self._it)
        self.n += 1
        return lease


__all__ = ["Scheduler"]
