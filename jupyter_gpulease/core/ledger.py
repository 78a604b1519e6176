"""The lease book: the live leases and what they hold.

Every start and end of a lease goes through here, so that the pool's occupancy, the quotas'
accounting, the deadlines and the preemptions under way stay in step with the leases: a grant
takes its slices and sets its deadlines; an end gives the slices back, counts the use, and
calls off what was under way for it. The scheduler decides; the book keeps the books.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from . import events as ev
from .deadlines import Deadline, Deadlines
from .events import Event
from .model import GPU, Conflict, Lease, LeaseState, Placement
from .policy import Policy
from .pool import Pool
from .preemption import Preemption
from .queue import WaitQueue
from .quota import Quotas
from .text import format_duration
from .views import LastPass

INF = math.inf


class LeaseBook:
    def __init__(self, policy: Policy, pool: Pool, queue: WaitQueue, quotas: Quotas, preemption: Preemption, deadlines: Deadlines, found: LastPass):
        self.policy = policy
        self.pool = pool
        self.leases: dict[str, Lease] = {}
        self.free_at: dict[str, float] = {}  # GPU uuid -> when its last holder leaves (held GPUs only)
        self.reclaimed_from: set[tuple[str, str]] = set()  # (user, server) whose last lease was reclaimed as idle
        self.restore_failed: list[tuple[str, str]] = []  # (lease id, why) to end as failed at the next tick
        self.dirty = True  # something changed that the next pass must look at
        self._queue = queue
        self._quotas = quotas
        self._preemption = preemption
        self._deadlines = deadlines
        self._found = found

    # ----------------------------------------------------------------- when slices free up
    @staticmethod
    def lease_end(lease: Lease) -> float:
        """When a lease's slices free up: its expiry, or the end of a preemption's grace."""
        end = lease.expires_at if lease.expires_at is not None else INF
        return min(end, lease.preempt_at) if lease.preempt_at is not None else end

    def live_end(self, lease_id: str) -> float | None:
        """:meth:`lease_end` of a live lease; None: no such lease."""
        lease = self.leases.get(lease_id)
        return None if lease is None else self.lease_end(lease)

    def touch(self, placement: Placement | None) -> None:
        """Recompute when the GPUs of ``placement`` free up (after a grant, end, extension, preemption)."""
        if placement is None:
            return
        for sl in placement.slices:
            st = self.pool.gpus.get(sl.gpu_uuid)
            if st is None or not st.holders:
                self.free_at.pop(sl.gpu_uuid, None)
            else:
                self.free_at[sl.gpu_uuid] = max(self.lease_end(self.leases[h]) for h in st.holders if h in self.leases)

    def preemptible(self, lease: Lease) -> bool:
        t = self.policy.tiers.get(lease.tier)
        return bool(t and t.preemptible)

    def add_expiry_deadlines(self, lease: Lease, now: float) -> None:
        self._deadlines.add(lease.expires_at, Deadline.EXPIRE, lease.id)
        if self.policy.warn_before_s and lease.warned_at is None:
            self._deadlines.add(max(now, lease.expires_at - self.policy.warn_before_s), Deadline.WARN, lease.id)

    # ----------------------------------------------------------------- starts
    def grant(self, lease: Lease, placement: Placement, now: float, until: float | None = None, cut_why: str = "") -> list[Event]:
        """The lease starts holding ``placement`` now, until its duration ends (or ``until``, a short grant)."""
        pol = self.policy
        self.pool.take(lease.id, placement, self.preemptible(lease))
        self._queue.remove(lease)
        lease.state = LeaseState.ACTIVE
        lease.placement = placement
        lease.granted_at = now
        lease.expires_at = now + lease.duration_s if until is None else until
        self._quotas.hold(lease)
        self.reclaimed_from.discard((lease.user, lease.server))
        self.touch(placement)
        self.add_expiry_deadlines(lease, now)
        if pol.confirm_timeout_s is not None:
            self._deadlines.add(now + pol.confirm_timeout_s, Deadline.CONFIRM, lease.id)
        if pol.heartbeat_timeout_s:
            self._deadlines.add(now + pol.heartbeat_timeout_s, Deadline.HEARTBEAT, lease.id)
        reason = f"granted after waiting {format_duration(now - lease.created_at)}"
        if until is not None:
            why = cut_why or "these GPUs are promised to a waiting lease from then"
            reason += f", for {format_duration(until - now)} instead of {format_duration(lease.duration_s)}: {why}"
        return [ev.granted(lease, now, reason, short_grant=until is not None), *self.cancel_preemption(lease.id, now, "the lease it was for started elsewhere")]

    def start_preemption(self, waiter: Lease, victims: list[Lease], now: float) -> list[Event]:
        out = self._preemption.start(waiter, victims, now)
        for v in victims:
            self._deadlines.add(v.preempt_at, Deadline.PREEMPT, v.id)
            self.touch(v.placement)
        return out

    def revoke_at(self, lease: Lease, at: float) -> None:
        """End ``lease`` as revoked at ``at`` (an admin's revoke with a grace; see Scheduler.revoke)."""
        lease.preempt_at = at
        lease.preempted_for = ""
        self._deadlines.add(at, Deadline.PREEMPT, lease.id)
        self.touch(lease.placement)

    def cancel_preemption(self, waiter_id: str, now: float, why: str) -> list[Event]:
        out, kept = self._preemption.cancel(waiter_id, self.leases, now, why)
        for v in kept:
            self.touch(v.placement)
        return out

    # ----------------------------------------------------------------- ends
    def end(self, lease: Lease, state: LeaseState, now: float, reason: str, actor: str) -> list[Event]:
        """End a live lease in ``state``: its slices go back, its use is counted, what waited on it is called off."""
        prev = lease.state
        if prev.terminal:
            raise Conflict(f"lease {lease.id} already ended ({prev.value})")
        out: list[Event] = []
        if prev is LeaseState.ACTIVE:
            self.pool.give(lease.id, lease.placement)
            self._quotas.unhold(lease)
            self._quotas.record_usage(lease.user, lease.groups, lease.granted_at, now, lease.placement.gpu_milli)
            self._preemption.victim_ended(lease)
            if state is LeaseState.RECLAIMED:
                self.reclaimed_from.add((lease.user, lease.server))
        else:
            self._queue.remove(lease)
            out += self.cancel_preemption(lease.id, now, "the lease it was for left the queue")
        lease.state = state
        lease.ended_at = now
        lease.end_reason = reason
        del self.leases[lease.id]
        if prev is LeaseState.ACTIVE:
            self.touch(lease.placement)
        self._found.forget(lease.id)
        self.dirty = True
        out.insert(0, ev.ended(lease, now, prev.value, actor))
        return out

    def _end_lost(self, lease: Lease, now: float) -> list[Event]:
        # its slices are not in the new pool: end it without giving them back
        self._quotas.unhold(lease)
        self._quotas.record_usage(lease.user, lease.groups, lease.granted_at, now, lease.placement.gpu_milli)
        prev = lease.state
        lease.state, lease.ended_at, lease.end_reason = LeaseState.FAILED, now, "its GPU left the pool"
        del self.leases[lease.id]
        self.dirty = True
        return [ev.ended(lease, now, prev.value, "broker")]

    # ----------------------------------------------------------------- restarts and inventory changes
    def restore(self, leases: Iterable[Lease]) -> int:
        """Take back the live leases of a previous run (after a broker restart); the highest arrival number seen."""
        pol = self.policy
        seq = 0
        for lease in sorted(leases, key=lambda x: x.seq):
            if lease.state.terminal:
                continue
            seq = max(seq, lease.seq)
            self.leases[lease.id] = lease
            if lease.state is LeaseState.QUEUED:
                self._queue.add(lease, self.pool.gpu_milli_of(lease.request))
                if lease.max_wait_s is not None:
                    self._deadlines.add(lease.created_at + lease.max_wait_s, Deadline.MAX_WAIT, lease.id)
                continue
            if lease.placement is None or not self.pool.fits_placement(lease.placement):
                # not holding anything: queued without accounting, ended as failed on the next tick
                self.restore_failed.append((lease.id, "its GPUs are no longer in the pool (or already held) after a restart"))
                lease.state = LeaseState.QUEUED
                self._queue.add(lease, self.pool.gpu_milli_of(lease.request))
                continue
            self.pool.take(lease.id, lease.placement, self.preemptible(lease))
            self._quotas.hold(lease)
            self.touch(lease.placement)
            self._deadlines.add(lease.expires_at, Deadline.EXPIRE, lease.id)
            if pol.warn_before_s and lease.warned_at is None:
                self._deadlines.add(lease.expires_at - pol.warn_before_s, Deadline.WARN, lease.id)
            if lease.preempt_at is not None:
                self._deadlines.add(lease.preempt_at, Deadline.PREEMPT, lease.id)
                self._preemption.restored(lease)
            if lease.confirmed_at is None and pol.confirm_timeout_s is not None:
                self._deadlines.add(lease.granted_at + pol.confirm_timeout_s, Deadline.CONFIRM, lease.id)
            if pol.heartbeat_timeout_s:
                self._deadlines.add((lease.last_heartbeat or lease.confirmed_at or lease.granted_at) + pol.heartbeat_timeout_s, Deadline.HEARTBEAT, lease.id)
        self.dirty = True
        return seq

    def set_inventory(self, gpus: list[GPU], now: float) -> list[Event]:
        """Hold the leases on a new inventory; those whose GPUs left it fail, as do queued ones it can never hold."""
        self.pool = Pool(gpus, self.policy.share_placement, self.pool.sizes)
        self.free_at.clear()
        out: list[Event] = []
        for lease in list(self.leases.values()):
            if lease.state is LeaseState.ACTIVE:
                if self.pool.fits_placement(lease.placement):
                    self.pool.take(lease.id, lease.placement, self.preemptible(lease))
                    self.touch(lease.placement)
                else:
                    out += self._end_lost(lease, now)
        for lease in list(self.leases.values()):
            if lease.state is LeaseState.QUEUED:
                never = self.pool.why_never(lease.request)
                if never:
                    out += self.end(lease, LeaseState.FAILED, now, f"can no longer be granted: {never[1]}", "broker")
        self.dirty = True
        return out
