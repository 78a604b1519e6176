"""What a request would get if it were made now, without making it.

The spawn form shows each option's prospects before anyone submits; a request that cannot start
within its wait limit should be told so at once. The answer comes from the scheduling pass
itself (:class:`~.passes.SchedulingPass`), run *dry*: the hypothetical lease is put in the queue
order where it would go, the pass walks the queue as a real pass would, and for that lease it
notes whether it fits now (maybe as a short grant), would preempt lower tiers, or gets a
reservation (its ETA). Nothing is granted, preempted or recorded; the slices the leases ahead
would take in this pass are taken for the walk and given back.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from .events import Event
from .model import Lease, LeaseError, Placement
from .pool import Pool


@dataclass(frozen=True)
class Estimate:
    """The prospects of a request not yet made.

    ``start``: ``"now"`` (it would be granted at once), ``"queued"`` (it would wait: its
    ``position`` of ``length`` in the queue, ``eta`` when known) or ``"never"`` (``refused``
    says why). ``duration_s`` is the grant's length (shorter than asked for a short grant).
    ``within_wait_limit``: whether it would start within ``max_wait_s`` (None: no limit, or no
    ETA to judge by).
    """

    start: str
    tier: str | None = None
    duration_s: float | None = None
    short_grant: bool = False
    placement: Placement | None = None
    short_why: str = ""  # why a short grant ends early
    position: int | None = None
    length: int | None = None
    eta: float | None = None
    waiting_for: str = ""
    within_wait_limit: bool | None = None
    refused: LeaseError | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "start": self.start,
            "tier": self.tier,
            "duration_s": self.duration_s,
            "short_grant": self.short_grant,
            "short_why": self.short_why,
            "placement": self.placement.to_dict() if self.placement else None,
            "position": self.position,
            "length": self.length,
            "eta": self.eta,
            "waiting_for": self.waiting_for,
            "within_wait_limit": self.within_wait_limit,
            "refused": {"field": self.refused.field, "message": self.refused.message} if self.refused else None,
        }


class DryRun:
    """The effects of a dry pass: note what happens to ``target``; let the leases ahead take
    their slices for the rest of the walk; move the victims' ends for the target's reservation."""

    def __init__(self, target: Lease, pool: Pool, preemptible: Callable[[Lease], bool], grace_of: Callable[[Lease], float], now: float,
                 lease_end: Callable[[str], float | None], free_at: Mapping[str, float]):
        self.target = target
        self.pool = pool
        self.preemptible = preemptible
        self.grace_of = grace_of
        self.now = now
        self._lease_end = lease_end
        self.free_at = dict(free_at)  # a copy: moved for the victims of the target
        self.ends: dict[str, float] = {}  # victims' ends, moved to the end of their grace
        self.fit: tuple[Placement, float | None] | None = None
        self.victims: list[Lease] = []
        self._taken: list[tuple[str, Placement]] = []
        self.decided = False

    def end_of(self, lease_id: str) -> float | None:
        moved = self.ends.get(lease_id)
        return moved if moved is not None else self._lease_end(lease_id)

    def grant(self, lease: Lease, placement: Placement, until: float | None) -> list[Event]:
        if lease is self.target:
            self.fit = (placement, until)
        else:
            self.pool.take(lease.id, placement, self.preemptible(lease))
            self._taken.append((lease.id, placement))
        return []

    def preempt(self, waiter: Lease, victims: list[Lease]) -> list[Event]:
        if waiter is self.target:
            self.victims = victims
            for v in victims:
                self.ends[v.id] = self.now + self.grace_of(v)
            for sl in {sl.gpu_uuid: sl for v in victims for sl in v.placement.slices}.values():
                holders = self.pool.gpus[sl.gpu_uuid].holders
                self.free_at[sl.gpu_uuid] = max((self.end_of(h) or self.now) for h in holders)
        return []

    def is_target(self, lease: Lease) -> bool:
        if lease is self.target:
            self.decided = True
        return self.decided

    def undo(self) -> None:
        for lease_id, placement in reversed(self._taken):
            self.pool.give(lease_id, placement)
        self._taken.clear()
