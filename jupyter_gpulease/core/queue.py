"""Queue order: which waiting lease the scheduler considers first (the framework's *queue sort*).

Tier priority first (high first). Within a tier, fair share: the user with the least decayed
GPU usage first, where each further queued request of the same user counts as if its
GPU-seconds were already used (weighted fair queueing, so one user's 50 requests interleave
with others' instead of going all first); then arrival. A lease that resumes a GPU its
server lost to an idle reclaim goes ahead of the new requests of its tier when the policy
says so (``resume_priority``).

Aging: a lease that has waited ``aging_s`` is considered before every tier's newer leases,
oldest first, so that its reservation holds against higher tiers too and a large request
cannot be passed forever by a stream of small higher-tier ones.
"""

from __future__ import annotations

import heapq
import math
from collections import defaultdict, deque
from collections.abc import Callable, Iterator

from .health import MOVED_META
from .model import Lease, LeaseState
from .policy import Policy

AGED_SCAN = 1000  # oldest aged leases moved to the front per pass (bounds a pass's cost)


class WaitQueue:
    """The queued leases, by tier and user, with what the scheduling pass needs to know about them."""

    def __init__(self, policy: Policy):
        self.policy = policy
        self._by_tier: dict[str, dict[str, list[Lease]]] = defaultdict(dict)  # tier -> user -> leases by seq
        self._members: dict[str, Lease] = {}  # queued lease id -> lease
        self._n = 0
        self.version = 0  # changes whenever a lease joins or leaves (cached orders go stale)
        self._arrivals: deque[Lease] = deque()  # in submit order (ended ones dropped lazily)
        self._arrivals_multi: deque[Lease] = deque()  # the same, of requests for more than one whole GPU
        self.shape_of: dict[str, tuple] = {}  # queued lease id -> request shape
        self.weight: dict[str, float] = {}  # queued lease id -> GPU-seconds it asks for
        self.shape_count: dict[tuple, int] = {}  # queued leases per shape
        self.shape_min_duration: dict[tuple, float] = {}  # lower bound of their durations
        self._resuming: dict[str, list[Lease]] = defaultdict(list)  # tier -> resuming leases by seq

    def __len__(self) -> int:
        return self._n

    def __contains__(self, lease: Lease) -> bool:
        return lease.state is LeaseState.QUEUED and self._members.get(lease.id) is lease

    def queued_of(self, user: str) -> int:
        """How many requests ``user`` has waiting (every tier)."""
        return sum(len(per_user.get(user, ())) for per_user in self._by_tier.values())

    # ----------------------------------------------------------------- membership
    def add(self, lease: Lease, gpu_milli: int) -> None:
        shape = lease.request.shape()
        if lease.require_gpus:  # fits in fewer places than its shape alone says
            shape += (lease.require_gpus,)
        self.version += 1
        self.shape_of[lease.id] = shape
        self._members[lease.id] = lease
        self.weight[lease.id] = gpu_milli / 1000 * lease.duration_s
        self.shape_count[shape] = self.shape_count.get(shape, 0) + 1
        self.shape_min_duration[shape] = min(self.shape_min_duration.get(shape, math.inf), lease.duration_s)
        per_user = self._by_tier[lease.tier]
        lst = per_user.setdefault(lease.user, [])
        lst.append(lease)
        if len(lst) > 1 and lst[-2].seq > lease.seq:
            lst.sort(key=lambda x: x.seq)
        self._n += 1
        if lease.resuming:
            self._resuming[lease.tier].append(lease)
            self._resuming[lease.tier].sort(key=lambda x: x.seq)
        self._arrivals.append(lease)
        if len(self._arrivals) > 2 * self._n + 1024:
            self._arrivals = deque(x for x in self._arrivals if x in self)
        if self.policy.multi_gpu_aging < 1 and lease.request.gpus_asked > 1:
            self._arrivals_multi.append(lease)
            if len(self._arrivals_multi) > 2 * self._n + 1024:
                self._arrivals_multi = deque(x for x in self._arrivals_multi if x in self)

    def remove(self, lease: Lease) -> None:
        self.version += 1
        per_user = self._by_tier.get(lease.tier, {})
        lst = per_user.get(lease.user)
        if lst is None:
            return
        try:
            lst.remove(lease)
        except ValueError:
            pass
        else:
            self._n -= 1
            self._members.pop(lease.id, None)
            if lease.resuming and lease in self._resuming.get(lease.tier, ()):
                self._resuming[lease.tier].remove(lease)
            shape = self.shape_of.pop(lease.id)
            self.weight.pop(lease.id, None)
            n = self.shape_count[shape] - 1
            if n:
                self.shape_count[shape] = n
            else:
                del self.shape_count[shape]
                del self.shape_min_duration[shape]
        if not lst:
            del per_user[lease.user]

    # ----------------------------------------------------------------- order
    def aged_cutoff(self, now: float) -> float | None:
        """Leases queued at or before this time count as aged (None: aging is off).

        Normally ``now - aging_s``. A request for more than one whole GPU ages after
        ``aging_s * multi_gpu_aging`` (one GPU frees up often, but several on one node are free
        together only when the scheduler keeps them free, which it does for aged and higher-tier
        leases), and every lease queued before it ages with it, so that aging never lets a newer
        lease pass an older one of its tier (their positions and ETAs hold).
        """
        aging = self.policy.aging_s
        if aging is None:
            return None
        cutoff = now - aging
        if self.policy.multi_gpu_aging < 1:
            arr = self._arrivals_multi
            while arr and arr[0] not in self:
                arr.popleft()
            multi_cutoff = now - aging * self.policy.multi_gpu_aging
            # the newest multi-GPU lease that has aged (the deque is in arrival order)
            for k, lease in enumerate(arr):
                if lease.created_at > multi_cutoff or k >= AGED_SCAN:
                    break
                if lease.created_at > cutoff and lease in self:
                    cutoff = lease.created_at
        return cutoff

    def in_order(self, now: float, usage: Callable[[str, float], float]) -> Iterator[Lease]:
        """Queued leases in scheduling order: aged leases first (oldest first), then by tier.

        ``usage(user, now)`` is a user's fair-share usage in GPU-seconds. The order is computed
        lazily: a pass that stops early pays only for the leases it looked at.
        """
        cutoff = self.aged_cutoff(now)
        if cutoff is None:
            yield from self._by_tiers(now, usage)
            return
        arr = self._arrivals
        while arr and arr[0] not in self:
            arr.popleft()
        if not arr or arr[0].created_at > cutoff:
            yield from self._by_tiers(now, usage)
            return
        aged = []
        for lease in arr:
            if lease.created_at > cutoff or len(aged) >= AGED_SCAN:
                break
            if lease in self:
                aged.append(lease)
        seen = {lease.id for lease in aged}
        yield from aged
        for lease in self._by_tiers(now, usage):
            if lease.id not in seen:
                yield lease

    def _by_tiers(self, now: float, usage: Callable[[str, float], float]) -> Iterator[Lease]:
        tiers = sorted((t for t in self.policy.tiers.values() if self._by_tier.get(t.name)), key=lambda t: -t.priority)
        for t in tiers:
            per_user = self._by_tier[t.name]
            resuming = self._resuming.get(t.name)
            if resuming and not self.policy.resume_priority:  # only those moved off a sick GPU go ahead
                resuming = [x for x in resuming if MOVED_META in x.meta]
            if resuming:
                ahead = {x.id for x in resuming}
                yield from list(resuming)
                yield from (x for x in self._within_tier(per_user, now, usage) if x.id not in ahead)
            else:
                yield from self._within_tier(per_user, now, usage)

    def _within_tier(self, per_user: dict[str, list[Lease]], now: float, usage: Callable[[str, float], float]) -> Iterator[Lease]:
        if len(per_user) == 1:
            yield from list(next(iter(per_user.values())))
            return
        if not self.policy.fair_share:
            yield from heapq.merge(*(list(v) for v in per_user.values()), key=lambda x: x.seq)
            return
        heap = []
        weight = self.weight
        for u, lst in per_user.items():
            heap.append((usage(u, now), lst[0].seq, u, 0, list(lst)))
        heapq.heapify(heap)
        while heap:
            key, _, u, i, lst = heap[0]
            lease = lst[i]
            w = weight[lease.id]  # read before yielding: a grant drops it
            yield lease
            i += 1
            if i < len(lst):
                heapq.heapreplace(heap, (key + w, lst[i].seq, u, i, lst))
            else:
                heapq.heappop(heap)
