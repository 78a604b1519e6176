"""One scheduling pass, phase by phase, as the Kubernetes scheduling framework names them.

:meth:`SchedulingPass.run` walks the waiting leases in queue order and, for each:

1. *queue sort* — the order itself (:mod:`.queue`: tiers, fair share, aging);
2. *pre-filter* — the quota gate: a lease whose concurrent quota is in use waits (:mod:`.quota`);
3. *filter and score* — where its slice fits now, per slice kind (:mod:`.slices`), without
   overlapping a promise to a lease ahead (backfill), or as a short grant cut to where a promise
   begins; if it fits, it is granted;
4. *post-filter* — preemption: lower-tier leases whose end makes room (:mod:`.preemption`);
5. *reserve* — the earliest slot its slices free up: its ETA (:mod:`.reservations`).

What a decision does is the caller's: the scheduler grants and starts preemptions; an
estimate (:mod:`.estimate`) only notes them. The pass itself changes nothing but its plan
and the findings it records in a :class:`~.views.LastPass`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from .events import Event
from .model import Lease, Placement
from .policy import Policy
from .pool import Pool
from .preemption import Preemption, VictimSearch
from .queue import WaitQueue
from .quota import Quotas
from .reservations import Reservations
from .text import format_duration
from .views import LastPass

INF = math.inf
SHORT_GRANT_MIN_S = 10 * 60  # shortest grant worth giving a preemptible lease on promised slices

# what a pass asks its caller to do: grant (lease, placement, cut-off end or None), preempt (waiter, victims)
Grant = Callable[[Lease, Placement, "float | None"], list[Event]]
Preempt = Callable[[Lease, list[Lease]], list[Event]]


@dataclass
class PassState:
    """What one pass remembers while it walks the queue."""

    depth: int  # reservations left to give
    room: bool  # anything free at all
    open_shapes: int  # request shapes that might still start now
    blocked_head: bool = False  # strict FCFS (no backfill): nothing passes a lease that could not start
    searches: int = 0  # victim searches so far
    failed: dict[tuple, float] = field(default_factory=dict)  # shape -> shortest duration that did not fit now
    failed_short: set[tuple] = field(default_factory=set)  # shapes that did not fit even as a short grant
    failed_window: set[tuple] = field(default_factory=set)  # shapes that did not fit even shortened before a maintenance window
    no_victims: set[tuple] = field(default_factory=set)  # (shape, tier) with no victims this pass

    def exhausted(self) -> bool:
        """Nothing further back can start now, and the reservations are used up."""
        return self.depth <= 0 and (not self.room or self.open_shapes <= 0 or self.blocked_head)


class SchedulingPass:
    def __init__(
        self,
        now: float,
        *,
        policy: Policy,
        pool: Pool,
        queue: WaitQueue,
        quotas: Quotas,
        preemption: Preemption,
        leases: Mapping[str, Lease],
        plan: Reservations,
        found: LastPass,
        grant: Grant,
        preempt: Preempt,
    ):
        self.now = now
        self.policy = policy
        self.pool = pool
        self.queue = queue
        self.quotas = quotas
        self.preemption = preemption
        self.leases = leases
        self.plan = plan
        self.found = found
        self._grant = grant
        self._preempt = preempt
        self.check_quota = bool(policy.user_quotas or policy.group_quotas or policy.default_user_quota.max_gpus is not None)
        self.victim_tiers = preemption.tiers_with_victims(quotas.active_by_tier) if policy.preemption else {}
        self.preempting: set[str] = set()  # waiting leases this pass started preemptions for
        self.state = PassState(depth=policy.reservation_depth, room=pool.has_room(), open_shapes=len(queue.shape_count))

    def run(self, order: Iterable[Lease], stop: Callable[[Lease], bool] | None = None) -> list[Event]:
        """Decide for each lease of ``order`` (1. queue order) in turn; ``stop(lease)``: end the walk after that lease."""
        out: list[Event] = []
        for lease in order:
            if self.state.exhausted():
                break
            out += self.decide(lease)
            if stop is not None and stop(lease):
                break
        return out

    def decide(self, lease: Lease) -> list[Event]:
        """The phases for one waiting lease; the events of a grant or of preemptions started."""
        st = self.state
        if self.check_quota and self.held_by_quota(lease):  # 2. quota gate
            return []
        placement, until = self.fit_now(lease)  # 3. filter and score
        if placement is not None:
            out = self._grant(lease, placement, until)
            for sl in placement.slices:
                self.plan.fit.pop(sl.gpu_uuid, None)  # its free share changed
            st.room = self.pool.has_room()
            return out
        if not self.policy.backfill:
            st.blocked_head = True
        if st.depth <= 0:
            return []
        st.depth -= 1
        out = self.preempt_for(lease)  # 4. post-filter: preemption
        self.reserve(lease)  # 5. reserve: the ETA
        return out

    # ----------------------------------------------------------------- 2. quota gate
    def held_by_quota(self, lease: Lease) -> bool:
        why = self.quotas.holds_back(lease, self.pool.gpu_milli_of(lease.request))
        if why:
            self.found.waiting_for[lease.id] = why
            self.found.quota_held.add(lease.id)
        return bool(why)

    # ----------------------------------------------------------------- 3. filter and score
    def fit_now(self, lease: Lease) -> tuple[Placement | None, float | None]:
        """Where the lease can start now without delaying a promised start: (placement, cut-off end or None)."""
        st, now = self.state, self.now
        if not st.room or st.blocked_head:
            return None, None
        key = self.queue.shape_of[lease.id]
        f = st.failed.get(key)
        if f is None or lease.duration_s < f:
            blocker = self.plan.blocker(now + lease.duration_s)
            placement = self.place(lease, blocker)
            if placement is not None:
                return placement, None
            # no room even ignoring promises: no duration of this shape can start now
            hopeless = blocker is None or (f is None and self.place(lease, self.plan.in_window_now(), ranked=False) is None)
            st.failed[key] = 0.0 if hopeless else (lease.duration_s if f is None else min(f, lease.duration_s))
            min_d = self.queue.shape_min_duration.get(key, INF)
            if (f is None or f > min_d) and st.failed[key] <= min_d:
                st.open_shapes -= 1
        pol = self.policy
        if self.plan.any and pol.short_grants and pol.backfill and self.preemptible(lease) and key not in st.failed_short:
            # a lease that may be preempted anyway may start on slices promised to others,
            # until the first promise there begins (its time limit is cut to that)
            p2 = self.place(lease, self.plan.blocker(now + SHORT_GRANT_MIN_S))
            if p2 is None:
                st.failed_short.add(key)
            else:
                end = max(now + SHORT_GRANT_MIN_S, min(self.plan.promised_from(sl) for sl in p2.slices))
                if end < now + lease.duration_s:
                    return p2, end
        if self.plan.win_from and pol.maintenance_shorten_min_s and key not in st.failed_window:
            # it would run into a maintenance window: shortened to end when the window begins
            min_s = pol.maintenance_shorten_min_s
            p3 = self.place(lease, self.plan.blocker(now + min_s))
            if p3 is None:
                st.failed_window.add(key)
            else:
                end = min(self.plan.promised_from(sl) for sl in p3.slices)
                if end == min(self.plan.window_from(sl) for sl in p3.slices) and now + min_s <= end < now + lease.duration_s:
                    return p3, end
        return None, None

    def place(self, lease: Lease, blocker, *, ranked: bool = True) -> Placement | None:
        """The pool's placement for the lease: on its preferred devices if they have room, only on its required ones."""
        pref = self.preemptible(lease) if ranked and self.policy.placement_by_preemptibility else None
        only = frozenset(lease.require_gpus) if lease.require_gpus else None
        if lease.prefer_gpus:
            preferred = frozenset(lease.prefer_gpus) if only is None else only & frozenset(lease.prefer_gpus)
            placement = self.pool.place(lease.request, blocker, pref, only=preferred)
            if placement is not None:
                return placement
        return self.pool.place(lease.request, blocker, pref, only=only)

    def preemptible(self, lease: Lease) -> bool:
        t = self.policy.tiers.get(lease.tier)
        return bool(t and t.preemptible)

    # ----------------------------------------------------------------- 4. post-filter: preemption
    def preempt_for(self, lease: Lease) -> list[Event]:
        st = self.state
        victim_tiers = self.victim_tiers.get(lease.tier)
        if not victim_tiers or st.searches >= self.policy.preemption_searches_per_pass or lease.id in self.preemption.victims_of:
            return []
        st.searches += 1
        key = (self.queue.shape_of[lease.id], lease.tier)
        if key in st.no_victims:
            return []
        search = VictimSearch(lease, self.pool, self.leases, victim_tiers, self.quotas.active_by_tier, self.plan, self.now)
        victims = [self.leases[v] for v in self.preemption.find_victims(search)]
        if not victims:
            st.no_victims.add(key)
            return []
        out = self._preempt(lease, victims)
        self.preempting.add(lease.id)
        self.plan.refresh({sl.gpu_uuid for v in victims for sl in v.placement.slices})
        return out

    # ----------------------------------------------------------------- 5. reserve
    def reserve(self, lease: Lease) -> None:
        what = lease.request.describe()
        got = self.plan.reserve(lease, frozenset(lease.require_gpus) if lease.require_gpus else None)
        if got is None:
            out = self.pool.out_of_service_for(lease.request, frozenset(lease.require_gpus) if lease.require_gpus else None)
            if out:
                self.found.waiting_for[lease.id] = (f"waiting for {what}: the {out} GPU{'s' if out > 1 else ''} that could hold it "
                                                    f"{'are' if out > 1 else 'is'} out of service (cordoned, draining or unhealthy); "
                                                    "it starts when one is back")
            else:
                self.found.waiting_for[lease.id] = f"waiting for {what}: no slice is expected to free up"
            return
        t, uuids = got
        self.found.eta[lease.id] = t
        for u in uuids:
            self.found.promised_to.setdefault(u, lease.id)
        w = self.plan.window_waits.get(lease.id)
        if lease.id in self.preempting or lease.id in self.preemption.victims_of:
            self.found.waiting_for[lease.id] = f"waiting for {what}: lower-tier leases are being preempted for it"
        elif w is not None and w.end <= t:
            because = f": {w.reason}" if w.reason else ""
            self.found.waiting_for[lease.id] = (f"waiting for {what}: it would run into a maintenance window "
                                                f"(in {format_duration(max(0.0, w.start - self.now))}, for {format_duration(w.end - w.start)}{because}); "
                                                "it starts after the window")
        else:
            self.found.waiting_for[lease.id] = f"waiting for {what}"
