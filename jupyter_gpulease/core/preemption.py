"""Preemption: ending lower-tier leases, after a grace, to make room (the framework's *post-filter*).

A waiting lease that finds no room may look for victims among the active leases of tiers it
may preempt (:meth:`Tier.can_be_preempted_by`). Lost work is the victims' GPU-seconds so far,
so the newest leases are the cheapest: the search walks preemptible leases newest first (a
bounded number) and stops at the first place where they, with what is free, make room; where
to look depends on the slice kind (:meth:`SliceType.victims`). Victims are warned and end when
their tier's grace runs out, unless the waiting lease starts elsewhere first.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator, Mapping

from . import events as ev
from .events import Event
from .model import Lease, Placement
from .policy import Policy
from .pool import Pool
from .reservations import Reservations
from .slices import slice_type
from .text import format_duration

VICTIM_SCAN = 512  # newest preemptible leases looked at per search


class VictimSearch:
    """What a slice kind's victim search may look at, for one waiting lease."""

    def __init__(self, waiter: Lease, pool: Pool, leases: Mapping[str, Lease], victim_tiers: set[str], active_by_tier: Mapping[str, Mapping[str, None]],
                 plan: Reservations, now: float):
        req = waiter.request
        self.request = req
        self.pool = pool
        self.models = set(pool.models(req.models, req.min_memory_mib))
        self.now = now
        self._leases = leases
        self._tiers = victim_tiers
        self._active_by_tier = active_by_tier
        self._plan = plan
        self._only = frozenset(waiter.require_gpus) if waiter.require_gpus else None

    def candidates(self) -> Iterator[str]:
        """Active leases of the victim tiers, newest first, at most :data:`VICTIM_SCAN` of them."""
        leases = self._leases
        newest = heapq.merge(*(reversed(list(self._active_by_tier.get(t, {}))) for t in self._tiers), key=lambda lid: -leases[lid].granted_at)
        for k, vid in enumerate(newest):
            if k >= VICTIM_SCAN:
                return
            yield vid

    def placement_of(self, lease_id: str) -> Placement:
        return self._leases[lease_id].placement

    def may_preempt(self, lease_id: str) -> bool:
        v = self._leases[lease_id]
        return v.preempt_at is None and v.tier in self._tiers

    def work_lost(self, lease_ids) -> float:
        leases, now = self._leases, self.now
        return sum((now - leases[x].granted_at) * leases[x].gpu_milli for x in lease_ids)

    def promised(self, gpu_uuid: str) -> bool:
        return self._plan.promised(gpu_uuid)

    def promised_mig(self, mig_uuid: str) -> bool:
        return self._plan.promised_mig(mig_uuid)

    def allowed(self, *uuids: str) -> bool:
        """Whether a device (any of the given UUIDs: a MIG instance and its GPU) may hold the waiter."""
        return self._only is None or any(u in self._only for u in uuids)


class Preemption:
    """The preemptions under way: which victims end for which waiting lease."""

    def __init__(self, policy: Policy):
        self.policy = policy
        self.victims_of: dict[str, set[str]] = {}  # waiting lease id -> victims being preempted for it

    def tiers_with_victims(self, active_by_tier: Mapping[str, Mapping[str, None]]) -> dict[str, set[str]]:
        """For each tier: the tiers it may preempt that hold active leases now."""
        active_tiers = {t for t, ids in active_by_tier.items() if ids}
        out = {}
        for t in self.policy.tiers.values():
            can = {v for v in active_tiers if self.policy.tiers[v].can_be_preempted_by(t)}
            if can:
                out[t.name] = can
        return out

    def find_victims(self, search: VictimSearch) -> list[str]:
        return slice_type(search.request).victims(search)

    def start(self, waiter: Lease, victims: list[Lease], now: float) -> list[Event]:
        """Warn ``victims``: each ends after its tier's grace unless the waiter starts elsewhere first."""
        out = []
        self.victims_of[waiter.id] = set()
        for v in victims:
            grace = self.policy.tier(v.tier).grace_s
            v.preempt_at = now + grace
            v.preempted_for = waiter.id
            self.victims_of[waiter.id].add(v.id)
            out.append(ev.preempt_warned(v, now, f"a {waiter.tier} lease needs this GPU: this lease ends in {format_duration(grace)}; save your work", for_tier=waiter.tier))
        return out

    def cancel(self, waiter_id: str, leases: Mapping[str, Lease], now: float, why: str) -> tuple[list[Event], list[Lease]]:
        """Call off the preemptions for ``waiter_id``; the events and the leases that keep running."""
        vids = self.victims_of.pop(waiter_id, None)
        out, kept = [], []
        for vid in sorted(vids or ()):  # sorted: the same events in the same order in every process
            v = leases.get(vid)
            if v is not None and v.preempt_at is not None and v.preempted_for == waiter_id:
                v.preempt_at = None
                v.preempted_for = ""
                kept.append(v)
                out.append(ev.preempt_cancelled(v, now, f"preemption called off: {why}"))
        return out, kept

    def victim_ended(self, lease: Lease) -> None:
        if lease.preempted_for:
            s = self.victims_of.get(lease.preempted_for)
            if s is not None:
                s.discard(lease.id)

    def restored(self, lease: Lease) -> None:
        """A restored lease that was being preempted: remember for whom."""
        if lease.preempt_at is not None and lease.preempted_for:
            self.victims_of.setdefault(lease.preempted_for, set()).add(lease.id)
