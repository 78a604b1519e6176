"""The scheduler: grants, queue order, backfill, ETAs, quotas, expiry, extension, preemption.

One object holds the live (non-terminal) leases and the pool's occupancy. Every method takes
``now`` from the caller and returns the :class:`~.events.Event` list of what changed, so the
broker can persist each batch in one transaction and the simulator can replay a trace with
its own clock. Nothing here does I/O.

Queue order: tier priority (high first); within a tier, fair share — the user with the least
decayed GPU usage first, where each further queued request of the same user counts as if its
GPU-seconds were already used (weighted fair queueing, so one user's 50 requests interleave
with others' instead of going all first); then arrival.

Backfill: the first ``reservation_depth`` waiting leases get a reservation — the earliest time
their slices free up, from the expiries of active leases and the reservations of leases ahead.
A later lease starts now only where it fits without overlapping any reservation, so it cannot
delay the start of any reserved lease. Leases further back than the depth get no reservation
and no ETA (the cost of a pass stays bounded on very long queues).
"""

from __future__ import annotations

import heapq
import math
import uuid as _uuid
from collections import defaultdict, deque
from collections.abc import Iterable, Iterator
from typing import Any

from . import events as ev
from .events import Event
from .model import (
    GPU,
    MILLI,
    BadRequest,
    Conflict,
    Forbidden,
    Lease,
    LeaseState,
    NotFound,
    Placement,
    Refused,
    Request,
    SliceKind,
)
from .policy import Policy, Tier
from .pool import GPUState, Pool, share_need
from .text import format_duration as fmt_duration
from .usage import FairShare, UsageWindow

INF = math.inf


class _Reservations:
    """Pass-local plan of when GPUs free up and which are promised to whom."""

    def __init__(self, sched: Scheduler, now: float):
        self.s = sched
        self.pool = sched.pool
        self.now = now
        self.avail: dict[str, float] | None = None  # GPU uuid -> time it is wholly free and unpromised
        self.res_from: dict[str, float] = {}  # GPU uuid -> earliest start promised (whole/MIG/share)
        self.share_res: dict[str, list[tuple[float, int, int]]] = defaultdict(list)  # uuid -> (start, milli, mem)
        self.mig_res: dict[str, float] = {}  # MIG uuid -> start promised
        self.mig_avail: dict[str, float] = {}  # MIG uuid -> time it frees (+ promised end)
        self.heaps: dict[str, list[tuple[float, str]]] = {}
        self.tops: dict[str, list[str]] = {}  # model -> GPUs that free up first (until its heap changes)
        self.fit: dict[str, dict[tuple[int, int], float]] = {}  # GPU uuid -> (milli, mem) -> earliest fit (until the GPU changes)
        self.promised_end: dict[str, float] = {}  # GPU uuid -> end of the last promise on it
        self.whole: set[str] = set()  # GPUs promised whole to someone
        self.releases: dict[str, list[tuple[float, int, int]]] = {}  # GPU uuid -> (end, milli, mem) of its holders
        self.partial_early: dict[str, list[str]] = {}  # model -> partly used GPUs whose first holder leaves soonest
        self.any = False

    # --------------------------------------------------------------- time GPUs free up
    def _end(self, lease_id: str) -> float:
        lease = self.s.leases.get(lease_id)
        if lease is None:
            return self.now
        end = lease.expires_at if lease.expires_at is not None else INF
        if lease.preempt_at is not None:
            end = min(end, lease.preempt_at)
        return max(end, self.now)

    def gpu_free_at(self, st: GPUState) -> float:
        return max(self.now, self.s._gpu_free_at.get(st.gpu.uuid, self.now))

    def _gpu_free_at_slow(self, st: GPUState) -> float:
        return max((self._end(h) for h in st.holders), default=self.now)

    def _ensure(self) -> None:
        if self.avail is None:
            now, fa = self.now, self.s._gpu_free_at
            self.avail = {u: max(now, fa.get(u, now)) for u, st in self.pool.gpus.items() if not st.gpu.mig}

    def refresh(self, uuids: Iterable[str]) -> None:
        """Recompute when GPUs free up (after preemption moved some ends earlier)."""
        for u in uuids:
            st = self.pool.gpus[u]
            if st.gpu.mig:
                for sl in st.holders.values():
                    self.mig_avail.pop(sl.mig_uuid, None)  # recomputed on next use
                continue
            self.releases.pop(u, None)
            self.fit.pop(u, None)
            if self.avail is None:
                continue
            self.avail[u] = max(self.gpu_free_at(st), self.promised_end.get(u, self.now))
            h = self.heaps.get(st.gpu.model)
            if h is not None:
                heapq.heappush(h, (self.avail[u], u))
                self.tops.pop(st.gpu.model, None)

    def _heap(self, model: str) -> list[tuple[float, str]]:
        h = self.heaps.get(model)
        if h is None:
            self._ensure()
            h = [(self.avail[st.gpu.uuid], st.gpu.uuid) for st in self.pool.by_model[model] if not st.gpu.mig and st.gpu.healthy]
            heapq.heapify(h)
            self.heaps[model] = h
        return h

    def _valid_tops(self, model: str, k: int) -> list[str]:
        """Up to ``k`` GPUs of ``model`` that free up first (current heap entries only)."""
        got_k = self.tops.get(model)
        if got_k is not None and len(got_k) == k:
            return got_k
        got_k = self._valid_tops_uncached(model, k)
        self.tops[model] = got_k
        return got_k

    def _valid_tops_uncached(self, model: str, k: int) -> list[str]:
        h = self._heap(model)
        got: list[tuple[float, str]] = []
        while h and len(got) < k:
            e = heapq.heappop(h)
            if self.avail[e[1]] == e[0] and all(e[1] != g[1] for g in got):
                got.append(e)
        for e in got:
            heapq.heappush(h, e)
        return [u for _, u in got]

    def _valid_top(self, model: str, min_mem: int, skip: set[str]) -> tuple[float, str] | None:
        h = self._heap(model)
        stash = []
        found = None
        while h:
            t, u = h[0]
            if self.avail[u] != t:  # stale entry
                heapq.heappop(h)
                continue
            if u in skip or self.pool.gpus[u].gpu.memory_mib < min_mem:
                stash.append(heapq.heappop(h))
                continue
            found = (t, u)
            break
        for e in stash:
            heapq.heappush(h, e)
        return found

    # --------------------------------------------------------------- backfill guard
    def blocker(self, end: float):
        """A ``blocked`` callback for Pool.place: True where a slice held until ``end`` would overlap a promise."""
        if not self.any:
            return None
        res_from, share_res, mig_res = self.res_from, self.share_res, self.mig_res

        whole = self.whole

        def blocked(st: GPUState, milli: int, mem: int, mig_uuid: str) -> bool:
            if mig_uuid:
                return mig_res.get(mig_uuid, INF) < end
            u = st.gpu.uuid
            if res_from.get(u, INF) >= end:
                return False
            if u in whole:
                return True
            rs = share_res.get(u, ())
            r_milli = sum(m for t, m, _ in rs if t < end)
            r_mem = sum(b for t, _, b in rs if t < end)
            return st.free_milli - r_milli < milli or st.free_mem - r_mem < mem

        return blocked

    # --------------------------------------------------------------- reservations
    def reserve(self, lease: Lease) -> tuple[float, list[str]] | None:
        """Promise ``lease`` the slices that free up first; return (start, GPU/MIG uuids) or None."""
        req = lease.request
        models = self.pool.models(req.models, req.min_memory_mib)
        if not models:
            return None
        d = lease.duration_s
        if req.kind is SliceKind.GPU:
            got = self._reserve_whole(req.gpus, models, req.min_memory_mib)
            if got is None:
                return None
            t, uuids = got
            for u in uuids:
                self.res_from[u] = min(self.res_from.get(u, INF), t)
                self.avail[u] = self.promised_end[u] = t + d
                self.whole.add(u)
                self.fit.pop(u, None)
                model = self.pool.gpus[u].gpu.model
                heapq.heappush(self._heap(model), (t + d, u))
                self.tops.pop(model, None)
        elif req.kind is SliceKind.SHARE:
            got = self._reserve_share(req, models)
            if got is None:
                return None
            t, uuids, milli, mem = got
            u = uuids[0]
            self.res_from[u] = min(self.res_from.get(u, INF), t)
            self.share_res[u].append((t, milli, mem))
            self.promised_end[u] = max(self.promised_end.get(u, self.now), t + d)
            self.avail[u] = max(self.avail[u], t + d)
            self.fit.pop(u, None)
            model = self.pool.gpus[u].gpu.model
            heapq.heappush(self._heap(model), (self.avail[u], u))
            self.tops.pop(model, None)
        else:
            got = self._reserve_mig(req, models)
            if got is None:
                return None
            t, uuids = got
            self.mig_res[uuids[0]] = min(self.mig_res.get(uuids[0], INF), t)
            self.mig_avail[uuids[0]] = t + d
        self.any = True
        return got[0], got[1]

    def _reserve_whole(self, n: int, models: tuple[str, ...], min_mem: int) -> tuple[float, list[str]] | None:
        self._ensure()
        if n == 1:
            best = None
            for m in models:
                top = self._valid_top(m, min_mem, set())
                if top and (best is None or top < best):
                    best = top
            return (best[0], [best[1]]) if best else None
        best_t, best_u = INF, None
        nodes = self.pool.nodes_of(models)
        for node in nodes:
            times = sorted(
                (self.avail[st.gpu.uuid], st.gpu.uuid)
                for st in self.pool.by_node[node]
                if not st.gpu.mig and st.gpu.healthy and st.gpu.model in models and st.gpu.memory_mib >= min_mem
            )
            if len(times) >= n and times[n - 1][0] < best_t:
                best_t, best_u = times[n - 1][0], [u for _, u in times[:n]]
        return (best_t, best_u) if best_u else None

    def _share_fit_time(self, st: GPUState, milli: int, mem: int) -> float:
        """Earliest time a (milli, mem) share fits on ``st``, given its holders' ends and promises."""
        u = st.gpu.uuid
        memo = self.fit.get(u)
        if memo is None:
            memo = self.fit[u] = {}
        t = memo.get((milli, mem))
        if t is None:
            t = memo[(milli, mem)] = self._share_fit_time_uncached(st, milli, mem)
        return t

    def _share_fit_time_uncached(self, st: GPUState, milli: int, mem: int) -> float:
        u = st.gpu.uuid
        if u in self.whole:
            return self.avail[u]
        r_milli = sum(m for _, m, _ in self.share_res.get(u, ()))
        r_mem = sum(b for _, _, b in self.share_res.get(u, ()))
        free_m, free_b = st.free_milli - r_milli, st.free_mem - r_mem
        if free_m >= milli and free_b >= mem:
            return self.now
        rel = self.releases.get(u)
        if rel is None:
            rel = self.releases[u] = sorted((self._end(h), sl.share_milli, sl.memory_mib) for h, sl in st.holders.items())
        for t, m, b in rel:
            free_m += m
            free_b += b
            if free_m >= milli and free_b >= mem:
                return t
        return INF

    def _early_partial(self, model: str) -> list[str]:
        got = self.partial_early.get(model)
        if got is None:
            part = self.pool.partial_by_model.get(model, ())
            got = [st.gpu.uuid for st in heapq.nsmallest(8, part, key=lambda st: min((self._end(h) for h in st.holders), default=self.now))]
            self.partial_early[model] = got
        return got

    def _reserve_share(self, req: Request, models) -> tuple[float, list[str], int, int] | None:
        best = None
        for m in models:
            # look at the GPUs that free up first wholly, and at the partly used GPUs whose
            # first holder leaves soonest (a share may fit there sooner)
            cands = set(self._valid_tops(m, 8))
            cands.update(self._early_partial(m))
            for u in cands:
                st = self.pool.gpus[u]
                if st.gpu.mig or not st.gpu.healthy or st.gpu.memory_mib < req.min_memory_mib:
                    continue
                milli, mem = share_need(req, st.gpu)
                t = self._share_fit_time(st, milli, mem)
                if t < INF and (best is None or (t, u) < (best[0], best[1][0])):
                    best = (t, [u], milli, mem)
        return best

    def _reserve_mig(self, req: Request, models) -> tuple[float, list[str]] | None:
        best = None
        for m in models:
            for st in self.pool.by_model[m]:
                if not st.gpu.healthy or st.gpu.memory_mib < req.min_memory_mib:
                    continue
                held = {sl.mig_uuid: lid for lid, sl in st.holders.items()}
                for inst in st.gpu.mig:
                    if inst.profile != req.mig_profile:
                        continue
                    t = self.mig_avail.get(inst.uuid)
                    if t is None:
                        t = self._end(held[inst.uuid]) if inst.uuid in held else self.now
                        self.mig_avail[inst.uuid] = t
                    if best is None or t < best[0]:
                        best = (t, [inst.uuid])
        return best


class Scheduler:
    """Decides grants, queue order, ETAs, expiry, extension and preemption for one pool."""

    def __init__(self, inventory: Iterable[GPU], policy: Policy | None = None):
        self.policy = policy or Policy()
        gpus = list(inventory)
        self.inventory: dict[str, GPU] = {g.uuid: g for g in gpus}
        self.pool = Pool(gpus, self.policy.share_placement)
        self.leases: dict[str, Lease] = {}
        self._queued: dict[str, dict[str, list[Lease]]] = defaultdict(dict)  # tier -> user -> leases by seq
        self._n_queued = 0
        self._arrivals: deque[Lease] = deque()  # queued leases in submit order (ended ones dropped lazily)
        self._arrivals_multi: deque[Lease] = deque()  # the same, of requests for more than one whole GPU
        self._shape_of: dict[str, tuple] = {}  # queued lease id -> request shape
        self._weight: dict[str, float] = {}  # queued lease id -> GPU-seconds it asks for
        self._shape_n: dict[tuple, int] = {}  # queued leases per shape
        self._shape_min_d: dict[tuple, float] = {}  # lower bound of their durations
        self._seq = 0
        self._dl: list[tuple[float, int, str, str]] = []  # deadlines: (time, n, kind, lease id)
        self._dl_n = 0
        self._fair = FairShare(self.policy.fair_share_half_life_s)
        self._window = UsageWindow()
        self._held_user: dict[str, int] = defaultdict(int)
        self._held_user_t: dict[str, float] = defaultdict(float)  # Σ milli · granted_at of active leases
        self._held_group: dict[str, int] = defaultdict(int)
        self._active_by_user: dict[str, set[str]] = defaultdict(set)
        self._active_by_tier: dict[str, dict[str, None]] = defaultdict(dict)  # in grant order: newest last
        self._gpu_free_at: dict[str, float] = {}  # GPU uuid -> when its last holder leaves (held GPUs only)
        self._eta: dict[str, float] = {}
        self._waiting: dict[str, str] = {}
        self._reserved_by: dict[str, str] = {}  # GPU uuid -> queued lease promised it (last pass)
        self._preempting_for: dict[str, set[str]] = {}
        self._order: list[Lease] | None = None
        self._pos: dict[str, int] | None = None
        self._dirty = True
        self._restore_failed: list[tuple[str, str]] = []
        self.last_pass_now: float = 0.0
        self.passes = 0

    # ================================================================== requests
    def new_lease(
        self,
        *,
        user: str,
        request: Request,
        now: float,
        tier: str | None = None,
        duration_s: float | None = None,
        server: str = "",
        groups: Iterable[str] = (),
        max_wait_s: float | None = None,
        lease_id: str | None = None,
        meta: dict[str, Any] | None = None,
    ) -> Lease:
        """Validate a request and build its (queued, not yet submitted) lease.

        Raises BadRequest (malformed), Forbidden (tier not allowed) or Refused (can never be
        granted), each with a message a person can act on.
        """
        pol = self.policy
        if not isinstance(user, str) or not user:
            raise BadRequest("'user' must be a non-empty string", field="user")
        groups = tuple(groups)
        tname = tier or pol.default_tier
        if not isinstance(tname, str) or tname not in pol.tiers:
            raise BadRequest(f"unknown tier {tname!r}; tiers: {', '.join(sorted(pol.tiers))}", field="tier")
        t = pol.tiers[tname]
        if not t.allows(user, groups):
            allowed = [n for n, x in pol.tiers.items() if x.allows(user, groups)]
            raise Forbidden(f"{user} may not use tier {tname!r}; tiers open to {user}: {', '.join(allowed) or 'none'}", field="tier")
        if duration_s is None:
            duration_s = t.default_duration_s
        if isinstance(duration_s, bool) or not isinstance(duration_s, (int, float)) or not duration_s > 0 or duration_s == INF:
            raise BadRequest(f"'duration_s' must be a positive number of seconds, got {duration_s!r}", field="duration_s")
        if duration_s > t.max_duration_s:
            raise BadRequest(
                f"'duration_s' of {fmt_duration(duration_s)} is over the {fmt_duration(t.max_duration_s)} limit of tier {tname!r}; ask for at most {int(t.max_duration_s)} s",
                field="duration_s",
            )
        if max_wait_s is not None and (isinstance(max_wait_s, bool) or not isinstance(max_wait_s, (int, float)) or max_wait_s < 0):
            raise BadRequest(f"'max_wait_s' must be a number of seconds >= 0, got {max_wait_s!r}", field="max_wait_s")
        never = self.pool.why_never(request)
        if never:
            raise Refused(f"this request can never be granted: {never[1]}", field=never[0])
        milli = self.pool.gpu_milli_of(request)
        self._check_hard_quota(user, groups, milli, duration_s, now)
        return Lease(
            id=lease_id or _uuid.uuid4().hex[:16],
            user=user,
            request=request,
            tier=tname,
            duration_s=float(duration_s),
            created_at=now,
            server=server or "",
            groups=groups,
            max_wait_s=max_wait_s,
            meta=dict(meta or {}),
        )

    def _check_hard_quota(self, user: str, groups: tuple[str, ...], milli: int, duration_s: float, now: float) -> None:
        pol = self.policy
        scopes = [("you", user, pol.quota_for_user(user))] + [(f"group {g}", g, pol.group_quotas[g]) for g in groups if g in pol.group_quotas]
        for who, key, q in scopes:
            if q.max_gpus is not None and milli > q.max_gpus * MILLI:
                raise Refused(f"asks for {milli / MILLI:g} GPUs, over the limit of {q.max_gpus:g} concurrent GPUs for {who}", field="gpus")
            if q.gpu_hours is not None:
                wkey = ("g:" if who != "you" else "u:") + key
                used_h = self._window.used_s(wkey, now, q.period_s) / 3600 + self._active_gpu_hours(key, who != "you", now, q.period_s)
                want_h = milli / MILLI * duration_s / 3600
                if used_h + want_h > q.gpu_hours + 1e-9:
                    left = max(0.0, q.gpu_hours - used_h)
                    raise Refused(
                        f"over the GPU-hour quota for {who}: {used_h:.1f} of {q.gpu_hours:g} GPU-hours used in the last {fmt_duration(q.period_s)}, "
                        f"this asks for {want_h:.1f}; {left:.1f} left — ask for a shorter duration or fewer GPUs",
                        field="duration_s",
                    )

    def _active_gpu_hours(self, key: str, is_group: bool, now: float, period_s: float) -> float:
        total = 0.0
        for lease in self.leases.values():
            if lease.state is LeaseState.ACTIVE and ((key in lease.groups) if is_group else (lease.user == key)):
                total += (now - max(lease.granted_at or now, now - period_s)) * lease.gpu_milli / MILLI
        return total / 3600

    def submit(self, lease: Lease, now: float, actor: str = "") -> list[Event]:
        """Put a lease from :meth:`new_lease` in the queue."""
        if lease.id in self.leases:
            raise Conflict(f"lease {lease.id} already exists")
        self._seq += 1
        lease.seq = self._seq
        lease.state = LeaseState.QUEUED
        self.leases[lease.id] = lease
        self._enqueue(lease)
        self.pool.note_request(lease.request)
        if lease.max_wait_s is not None:
            self._deadline(lease.created_at + lease.max_wait_s, "maxwait", lease.id)
        self._dirty = True
        return [Event(lease.id, ev.REQUESTED, now, "", LeaseState.QUEUED.value, actor=actor or lease.user, data={"request": lease.request.to_dict(), "tier": lease.tier}, lease=lease)]

    def _enqueue(self, lease: Lease) -> None:
        shape = lease.request.shape()
        self._shape_of[lease.id] = shape
        self._weight[lease.id] = self.pool.gpu_milli_of(lease.request) / MILLI * lease.duration_s
        self._shape_n[shape] = self._shape_n.get(shape, 0) + 1
        self._shape_min_d[shape] = min(self._shape_min_d.get(shape, INF), lease.duration_s)
        per_user = self._queued[lease.tier]
        lst = per_user.setdefault(lease.user, [])
        if lst and lst[-1].seq > lease.seq:
            lst.append(lease)
            lst.sort(key=lambda lease: lease.seq)
        else:
            lst.append(lease)
        self._n_queued += 1
        self._arrivals.append(lease)
        if len(self._arrivals) > 2 * self._n_queued + 1024:
            self._arrivals = deque(lease for lease in self._arrivals if self._is_queued(lease))
        if self.policy.multi_gpu_aging < 1 and self._gpus_asked(lease) > 1:
            self._arrivals_multi.append(lease)
            if len(self._arrivals_multi) > 2 * self._n_queued + 1024:
                self._arrivals_multi = deque(lease for lease in self._arrivals_multi if self._is_queued(lease))
        self._order = None

    def _is_queued(self, lease: Lease) -> bool:
        return lease.state is LeaseState.QUEUED and self.leases.get(lease.id) is lease and lease.id in self._shape_of

    def _dequeue(self, lease: Lease) -> None:
        per_user = self._queued.get(lease.tier, {})
        lst = per_user.get(lease.user)
        if lst is not None:
            try:
                lst.remove(lease)
                self._n_queued -= 1
                shape = self._shape_of.pop(lease.id)
                self._weight.pop(lease.id, None)
                n = self._shape_n[shape] - 1
                if n:
                    self._shape_n[shape] = n
                else:
                    del self._shape_n[shape]
                    del self._shape_min_d[shape]
            except ValueError:
                pass
            if not lst:
                del per_user[lease.user]
        self._order = None

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
            return self._end(lease, LeaseState.WITHDRAWN, now, reason or "withdrawn by its requester", actor)
        if not state.terminal or state in (LeaseState.WITHDRAWN,):
            raise BadRequest(f"cannot end an active lease as {state.value!r}", field="state")
        return self._end(lease, state, now, reason or "released by its holder", actor)

    def extend(self, lease_id: str, now: float, *, by_s: float | None = None, until: float | None = None, actor: str = "") -> list[Event]:
        """Move ``expires_at`` later, within the tier's limits."""
        lease = self.leases.get(lease_id)
        if lease is None:
            raise NotFound(f"no live lease {lease_id!r}")
        if lease.state is not LeaseState.ACTIVE:
            raise Conflict(f"lease {lease_id} is {lease.state.value}; only an active lease can be extended")
        if (by_s is None) == (until is None):
            raise BadRequest("give exactly one of 'by_s' (seconds to add) or 'until' (new expiry, epoch seconds)", field="by_s")
        for name, v in (("by_s", by_s), ("until", until)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or v != v or v in (INF, -INF)):
                raise BadRequest(f"'{name}' must be a number, got {v!r}", field=name)
        new = until if until is not None else lease.expires_at + by_s
        if new <= lease.expires_at:
            raise BadRequest(f"the new expiry must be later than the current one ({fmt_duration(lease.expires_at - now)} from now)", field="by_s" if by_s is not None else "until")
        if lease.preempt_at is not None:
            raise Conflict(f"lease {lease_id} is being preempted (ends in {fmt_duration(lease.preempt_at - now)}); it cannot be extended")
        t = self.policy.tier(lease.tier)
        if new - now > t.max_duration_s + 1e-6:
            raise Refused(
                f"tier {t.name!r} allows at most {fmt_duration(t.max_duration_s)} ahead; you can extend until {fmt_duration(t.max_duration_s)} from now",
                field="by_s" if by_s is not None else "until",
            )
        if t.max_lifetime_s is not None and new - lease.granted_at > t.max_lifetime_s + 1e-6:
            raise Refused(
                f"tier {t.name!r} caps a lease at {fmt_duration(t.max_lifetime_s)} in all; this one may run until {fmt_duration(lease.granted_at + t.max_lifetime_s - now)} from now",
                field="by_s" if by_s is not None else "until",
            )
        if not self.policy.extend_when_contended:
            for sl in lease.placement.slices:
                waiter = self._reserved_by.get(sl.mig_uuid or sl.gpu_uuid)
                if waiter and waiter in self.leases and self._outranks(self.leases[waiter], t, now):
                    w = self.leases[waiter]
                    raise Refused(
                        f"cannot extend: {'someone' if w.user != lease.user else 'your other lease'} is waiting for this GPU "
                        f"(queued {fmt_duration(now - w.created_at)} ago, tier {w.tier}); release it when you are done",
                        field="by_s" if by_s is not None else "until",
                    )
        q = self.policy.quota_for_user(lease.user)
        if q.gpu_hours is not None:
            # past use in the window, this lease's current grant in full, and the extension
            gpus = lease.gpu_milli / MILLI
            used_h = self._window.used_s("u:" + lease.user, now, q.period_s) / 3600 + (lease.expires_at - lease.granted_at) * gpus / 3600
            if used_h + (new - lease.expires_at) * gpus / 3600 > q.gpu_hours + 1e-9:
                left = max(0.0, q.gpu_hours - used_h)
                raise Refused(
                    f"extending would go over your GPU-hour quota ({q.gpu_hours:g} GPU-hours per {fmt_duration(q.period_s)}); "
                    f"{left:.1f} GPU-hours left, enough for {fmt_duration(left * 3600 / gpus)} more",
                    field="by_s" if by_s is not None else "until",
                )
        old = lease.expires_at
        lease.expires_at = new
        lease.warned_at = None
        self._touch_gpus(lease.placement)
        self._push_expiry_deadlines(lease, now)
        self._dirty = True  # ETAs move
        return [Event(lease.id, ev.EXTENDED, now, lease.state.value, lease.state.value, actor=actor or lease.user, data={"from": old, "to": new}, lease=lease)]

    def _outranks(self, waiter: Lease, holder_tier: Tier, now: float) -> bool:
        """May ``waiter`` stand in the way of extending a lease of ``holder_tier``?

        A waiter of the same or a higher tier may; one of a lower tier only once it has aged
        (see :meth:`_aged_cutoff`), so that a stream of best-effort requests cannot cut production
        work short, yet nothing waits forever behind leases that keep extending.
        """
        wt = self.policy.tiers.get(waiter.tier)
        if wt is None or wt.priority >= holder_tier.priority:
            return True
        cutoff = self._aged_cutoff(now)
        return cutoff is not None and waiter.created_at <= cutoff

    def confirm(self, lease_id: str, now: float, actor: str = "") -> list[Event]:
        """The holder says the server using this lease is up."""
        lease = self.get(lease_id)
        if lease.state is not LeaseState.ACTIVE:
            raise Conflict(f"lease {lease_id} is {lease.state.value}; only an active lease can be confirmed")
        lease.last_heartbeat = now
        if lease.confirmed_at is not None:
            return []
        lease.confirmed_at = now
        return [Event(lease.id, ev.CONFIRMED, now, lease.state.value, lease.state.value, actor=actor or lease.user, lease=lease)]

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
            self._deadline(now + self.policy.heartbeat_timeout_s, "heartbeat", lease.id)
        if lease.confirmed_at is None:
            lease.confirmed_at = now
            return [Event(lease.id, ev.CONFIRMED, now, lease.state.value, lease.state.value, actor=lease.user, lease=lease)]
        return []

    # ================================================================== time
    def _deadline(self, t: float, kind: str, lease_id: str) -> None:
        self._dl_n += 1
        heapq.heappush(self._dl, (t, self._dl_n, kind, lease_id))

    def next_deadline(self) -> float | None:
        """When :meth:`tick` next has time-driven work (None: none pending). For simulators."""
        while self._dl and self._dl[0][3] not in self.leases:
            heapq.heappop(self._dl)
        return self._dl[0][0] if self._dl else None

    def _push_expiry_deadlines(self, lease: Lease, now: float) -> None:
        self._deadline(lease.expires_at, "expire", lease.id)
        if self.policy.warn_before_s and lease.warned_at is None:
            self._deadline(max(now, lease.expires_at - self.policy.warn_before_s), "warn", lease.id)

    def tick(self, now: float) -> list[Event]:
        """Apply what time brings (expiry, warnings, grace ends, wait limits, timeouts), then schedule."""
        out: list[Event] = []
        for lid, why in self._restore_failed:
            lease = self.leases.get(lid)
            if lease is not None:
                out += self._end(lease, LeaseState.FAILED, now, why, "broker")
        self._restore_failed = []
        pol = self.policy
        while self._dl and self._dl[0][0] <= now:
            _, _, kind, lid = heapq.heappop(self._dl)
            lease = self.leases.get(lid)
            if lease is None:
                continue
            if kind == "expire":
                if lease.state is LeaseState.ACTIVE and lease.expires_at <= now:
                    out += self._end(lease, LeaseState.EXPIRED, lease.expires_at, f"its time limit of {fmt_duration(lease.expires_at - lease.granted_at)} ran out", "broker")
            elif kind == "warn":
                if lease.state is LeaseState.ACTIVE and lease.warned_at is None and lease.expires_at - pol.warn_before_s <= now < lease.expires_at:
                    lease.warned_at = now
                    out.append(
                        Event(lease.id, ev.WARNED, now, "active", "active", f"this lease expires in {fmt_duration(lease.expires_at - now)}", "broker", {"expires_at": lease.expires_at}, lease=lease)
                    )
            elif kind == "preempt":
                if lease.state is LeaseState.ACTIVE and lease.preempt_at is not None and lease.preempt_at <= now:
                    w = self.leases.get(lease.preempted_for)
                    for_what = f"a waiting {w.tier} lease" if w else "a higher-tier lease"
                    out += self._end(lease, LeaseState.PREEMPTED, lease.preempt_at, f"preempted for {for_what}", "broker")
            elif kind == "maxwait":
                if lease.state is LeaseState.QUEUED and lease.max_wait_s is not None and lease.created_at + lease.max_wait_s <= now:
                    out += self._end(lease, LeaseState.WITHDRAWN, lease.created_at + lease.max_wait_s, f"not granted within its wait limit of {fmt_duration(lease.max_wait_s)}", "broker")
            elif kind == "confirm":
                if lease.state is LeaseState.ACTIVE and lease.confirmed_at is None and pol.confirm_timeout_s is not None:
                    out += self._end(lease, LeaseState.REVOKED, now, f"never confirmed by its holder within {fmt_duration(pol.confirm_timeout_s)} of the grant", "broker")
            elif kind == "heartbeat":
                last = lease.last_heartbeat or lease.confirmed_at or lease.granted_at
                if lease.state is LeaseState.ACTIVE and pol.heartbeat_timeout_s and last + pol.heartbeat_timeout_s <= now:
                    out += self._end(lease, LeaseState.REVOKED, now, f"its holder stopped sending heartbeats ({fmt_duration(now - last)} without one)", "broker")
        # a warning alone changes nothing a pass decides on (an extension that follows it does)
        if self._dirty or any(e.kind != ev.WARNED for e in out):
            out += self.schedule(now)
        return out

    def _lease_end(self, lease: Lease) -> float:
        end = lease.expires_at if lease.expires_at is not None else INF
        return min(end, lease.preempt_at) if lease.preempt_at is not None else end

    def _touch_gpus(self, placement: Placement | None) -> None:
        """Recompute when the GPUs of ``placement`` free up (after a grant, end, extension, preemption)."""
        if placement is None:
            return
        for sl in placement.slices:
            st = self.pool.gpus.get(sl.gpu_uuid)
            if st is None or not st.holders:
                self._gpu_free_at.pop(sl.gpu_uuid, None)
            else:
                self._gpu_free_at[sl.gpu_uuid] = max(self._lease_end(self.leases[h]) for h in st.holders if h in self.leases)

    def _hold(self, lease: Lease) -> None:
        """Book-keeping when a lease starts holding its placement (grant or restore)."""
        m = lease.placement.gpu_milli
        self._held_user[lease.user] += m
        self._held_user_t[lease.user] += m * lease.granted_at
        for g in lease.groups:
            self._held_group[g] += m
        self._active_by_user[lease.user].add(lease.id)
        self._active_by_tier[lease.tier][lease.id] = None

    def _unhold(self, lease: Lease) -> None:
        m = lease.placement.gpu_milli
        self._held_user[lease.user] -= m
        self._held_user_t[lease.user] -= m * lease.granted_at
        for g in lease.groups:
            self._held_group[g] -= m
        self._active_by_user[lease.user].discard(lease.id)
        self._active_by_tier[lease.tier].pop(lease.id, None)

    # ================================================================== the pass
    def _user_usage(self, user: str, now: float) -> float:
        """Decayed past GPU-seconds plus what the user's active leases have used so far."""
        # Σ (now - granted_i) · milli_i = now · Σ milli_i - Σ granted_i · milli_i
        return self._fair.value(user, now) + (now * self._held_user.get(user, 0) - self._held_user_t.get(user, 0.0)) / MILLI

    AGED_SCAN = 1000  # oldest aged leases moved to the front per pass (bounds a pass's cost)

    @staticmethod
    def _gpus_asked(lease: Lease) -> int:
        return lease.request.gpus if lease.request.kind is SliceKind.GPU else 1

    def _aged_cutoff(self, now: float) -> float | None:
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
            while arr and not self._is_queued(arr[0]):
                arr.popleft()
            multi_cutoff = now - aging * self.policy.multi_gpu_aging
            # the newest multi-GPU lease that has aged (the deque is in arrival order)
            for k, lease in enumerate(arr):
                if lease.created_at > multi_cutoff or k >= self.AGED_SCAN:
                    break
                if lease.created_at > cutoff and self._is_queued(lease):
                    cutoff = lease.created_at
        return cutoff

    def _iter_order(self, now: float) -> Iterator[Lease]:
        """Queued leases in scheduling order: aged leases first (oldest first), then by tier."""
        cutoff = self._aged_cutoff(now)
        if cutoff is None:
            yield from self._iter_tiers(now)
            return
        arr = self._arrivals
        while arr and not self._is_queued(arr[0]):
            arr.popleft()
        if not arr or arr[0].created_at > cutoff:
            yield from self._iter_tiers(now)
            return
        aged = []
        for lease in arr:
            if lease.created_at > cutoff or len(aged) >= self.AGED_SCAN:
                break
            if self._is_queued(lease):
                aged.append(lease)
        seen = {lease.id for lease in aged}
        yield from aged
        for lease in self._iter_tiers(now):
            if lease.id not in seen:
                yield lease

    def _iter_tiers(self, now: float) -> Iterator[Lease]:
        tiers = sorted((t for t in self.policy.tiers.values() if self._queued.get(t.name)), key=lambda t: -t.priority)
        for t in tiers:
            per_user = self._queued[t.name]
            if len(per_user) == 1:
                yield from list(next(iter(per_user.values())))
                continue
            if not self.policy.fair_share:
                yield from heapq.merge(*(list(v) for v in per_user.values()), key=lambda lease: lease.seq)
                continue
            heap = []
            weight = self._weight
            for u, lst in per_user.items():
                heap.append((self._user_usage(u, now), lst[0].seq, u, 0, list(lst)))
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

    def _quota_block(self, lease: Lease, milli: int) -> str:
        """Why a concurrent-GPU quota holds this lease back now ('' if it doesn't)."""
        pol = self.policy
        q = pol.quota_for_user(lease.user)
        if q.max_gpus is not None and self._held_user[lease.user] + milli > q.max_gpus * MILLI:
            return f"your quota of {q.max_gpus:g} concurrent GPUs is in use ({self._held_user[lease.user] / MILLI:g} held); it starts when you release some"
        for g in lease.groups:
            gq = pol.group_quotas.get(g)
            if gq is not None and gq.max_gpus is not None and self._held_group[g] + milli > gq.max_gpus * MILLI:
                return f"group {g}'s quota of {gq.max_gpus:g} concurrent GPUs is in use"
        return ""

    def _has_room(self) -> bool:
        p = self.pool
        return any(p.idle_by_model.values()) or any(v > 0 for v in p.free_milli_by_model.values()) or any(p.mig_free_by_model.values())

    def schedule(self, now: float) -> list[Event]:
        """One scheduling pass: grant what fits in queue order, reserve for the first waiters, preempt."""
        self.passes += 1
        self._dirty = False
        self.last_pass_now = now
        self._order = None
        self._eta.clear()
        self._waiting.clear()
        self._reserved_by.clear()
        if not self._n_queued:
            return []
        pol = self.policy
        out: list[Event] = []
        res = _Reservations(self, now)
        depth = pol.reservation_depth
        failed: dict[tuple, float] = {}  # shape -> shortest duration that did not fit now
        failed_short: set[tuple] = set()  # shapes that did not fit even as a short grant
        no_victims: set[tuple] = set()
        room = self._has_room()
        blocked_head = False  # strict FCFS (no backfill): nothing passes a lease that could not start
        preempt_tiers = self._tiers_with_victims() if pol.preemption else {}
        searches = 0
        open_shapes = len(self._shape_n)  # shapes that might still start now
        shape_of, min_d = self._shape_of, self._shape_min_d
        check_quota = bool(pol.user_quotas or pol.group_quotas or pol.default_user_quota.max_gpus is not None)
        for lease in self._iter_order(now):
            if depth <= 0 and (not room or open_shapes <= 0 or blocked_head):
                break  # nothing further back can start now, and reservations are used up
            req = lease.request
            if check_quota:
                qmsg = self._quota_block(lease, self.pool.gpu_milli_of(req))
                if qmsg:
                    self._waiting[lease.id] = qmsg
                    continue
            placement = None
            if room and not blocked_head:
                key = shape_of[lease.id]
                f = failed.get(key)
                if f is None or lease.duration_s < f:
                    blocker = res.blocker(now + lease.duration_s)
                    placement = self.pool.place(req, blocker, self._pre_pref(lease))
                    if placement is None:
                        # no room even ignoring promises: no duration of this shape can start now
                        hopeless = blocker is None or (f is None and self.pool.place(req) is None)
                        failed[key] = 0.0 if hopeless else (lease.duration_s if f is None else min(f, lease.duration_s))
                        if (f is None or f > min_d.get(key, INF)) and failed[key] <= min_d.get(key, INF):
                            open_shapes -= 1
            until = None
            if placement is None and room and not blocked_head and res.any and pol.short_grants and pol.backfill and self._preemptible(lease):
                # a lease that may be preempted anyway may start on slices promised to others,
                # until the first promise there begins (its time limit is cut to that)
                skey = shape_of[lease.id]
                if skey not in failed_short:
                    p2 = self.pool.place(req, res.blocker(now + self.SHORT_GRANT_MIN_S), self._pre_pref(lease))
                    if p2 is None:
                        failed_short.add(skey)
                    else:
                        first = min(
                            (res.mig_res.get(sl.mig_uuid, INF) if sl.mig_uuid else res.res_from.get(sl.gpu_uuid, INF)) for sl in p2.slices
                        )
                        end = max(now + self.SHORT_GRANT_MIN_S, first)
                        if end < now + lease.duration_s:
                            placement, until = p2, end
            if placement is not None:
                out += self._grant(lease, placement, now, until=until)
                for sl in placement.slices:
                    res.fit.pop(sl.gpu_uuid, None)  # its free share changed
                room = self._has_room()
                continue
            if not pol.backfill:
                blocked_head = True
            if depth <= 0:
                continue
            depth -= 1
            victims_tiers = preempt_tiers.get(lease.tier)
            if victims_tiers and searches < pol.preemption_searches_per_pass and lease.id not in self._preempting_for:
                searches += 1
                vkey = (req.shape(), lease.tier)
                if vkey not in no_victims:
                    victims = self._choose_victims(lease, now, victims_tiers, res)
                    if victims:
                        out += self._start_preemption(lease, victims, now)
                        res.refresh({sl.gpu_uuid for v in victims for sl in v.placement.slices})
                    else:
                        no_victims.add(vkey)
            got = res.reserve(lease)
            if got is None:
                self._waiting[lease.id] = f"waiting for {req.describe()}: no slice is expected to free up"
                continue
            t, uuids = got
            self._eta[lease.id] = t
            for u in uuids:
                self._reserved_by.setdefault(u, lease.id)
            if lease.id in self._preempting_for:
                self._waiting[lease.id] = f"waiting for {req.describe()}: lower-tier leases are being preempted for it"
            else:
                self._waiting[lease.id] = f"waiting for {req.describe()}"
        return out

    def _preemptible(self, lease: Lease) -> bool:
        t = self.policy.tiers.get(lease.tier)
        return bool(t and t.preemptible)

    def _pre_pref(self, lease: Lease) -> bool | None:
        """Preemptibility the placement should group this lease by (None: placement ignores it)."""
        return self._preemptible(lease) if self.policy.placement_by_preemptibility else None

    SHORT_GRANT_MIN_S = 10 * 60  # shortest grant worth giving a preemptible lease on promised slices

    def _grant(self, lease: Lease, placement: Placement, now: float, until: float | None = None) -> list[Event]:
        self.pool.take(lease.id, placement, self._preemptible(lease))
        self._dequeue(lease)
        lease.state = LeaseState.ACTIVE
        lease.placement = placement
        lease.granted_at = now
        lease.expires_at = now + lease.duration_s if until is None else until
        self._hold(lease)
        self._touch_gpus(placement)
        self._push_expiry_deadlines(lease, now)
        if self.policy.confirm_timeout_s is not None:
            self._deadline(now + self.policy.confirm_timeout_s, "confirm", lease.id)
        if self.policy.heartbeat_timeout_s:
            self._deadline(now + self.policy.heartbeat_timeout_s, "heartbeat", lease.id)
        out = [
            Event(
                lease.id,
                ev.GRANTED,
                now,
                "queued",
                "active",
                f"granted after waiting {fmt_duration(now - lease.created_at)}"
                + (
                    ""
                    if until is None
                    else f", for {fmt_duration(until - now)} instead of {fmt_duration(lease.duration_s)}: these GPUs are promised to a waiting lease from then"
                ),
                "broker",
                {"placement": placement.to_dict(), "expires_at": lease.expires_at, "waited_s": now - lease.created_at, **({"short_grant": True} if until is not None else {})},
                lease=lease,
            )
        ]
        out += self._cancel_preemption(lease, now, "the lease it was for started elsewhere")
        return out

    def _end(self, lease: Lease, state: LeaseState, now: float, reason: str, actor: str) -> list[Event]:
        prev = lease.state
        if prev.terminal:
            raise Conflict(f"lease {lease.id} already ended ({prev.value})")
        out: list[Event] = []
        if prev is LeaseState.ACTIVE:
            self.pool.give(lease.id, lease.placement)
            self._unhold(lease)
            self.record_usage(lease.user, lease.groups, lease.granted_at, now, lease.placement.gpu_milli)
            if lease.preempted_for:
                s = self._preempting_for.get(lease.preempted_for)
                if s is not None:
                    s.discard(lease.id)
        else:
            self._dequeue(lease)
            out += self._cancel_preemption(lease, now, "the lease it was for left the queue")
        lease.state = state
        lease.ended_at = now
        lease.end_reason = reason
        del self.leases[lease.id]
        if prev is LeaseState.ACTIVE:
            self._touch_gpus(lease.placement)
        self._eta.pop(lease.id, None)
        self._waiting.pop(lease.id, None)
        self._dirty = True
        out.insert(0, Event(lease.id, ev.ENDED, now, prev.value, state.value, reason, actor, lease=lease))
        return out

    # ================================================================== preemption
    def _tiers_with_victims(self) -> dict[str, set[str]]:
        """For each tier: the tiers it may preempt that hold active leases now."""
        active_tiers = {t for t, ids in self._active_by_tier.items() if ids}
        out = {}
        for t in self.policy.tiers.values():
            can = {v for v in active_tiers if self.policy.tiers[v].can_be_preempted_by(t)}
            if can:
                out[t.name] = can
        return out

    VICTIM_SCAN = 512  # newest preemptible leases looked at per search

    def _choose_victims(self, lease: Lease, now: float, victim_tiers: set[str], res: _Reservations) -> list[Lease]:
        """Leases whose preemption frees room for ``l``, losing little work; [] if none will do.

        Lost work is the victims' GPU-seconds so far, so the newest leases are the cheapest:
        the search walks preemptible leases newest first (a bounded number) and stops at the
        first place where they, together with idle GPUs, make room.
        """
        req = lease.request
        models = set(self.pool.models(req.models, req.min_memory_mib))
        leases = self.leases

        def ok(lid: str) -> bool:
            v = leases[lid]
            return v.preempt_at is None and v.tier in victim_tiers

        def lost(lids) -> float:
            return sum((now - leases[x].granted_at) * leases[x].gpu_milli for x in lids)

        newest = heapq.merge(
            *(reversed(list(self._active_by_tier.get(t, {}))) for t in victim_tiers),
            key=lambda lid: -leases[lid].granted_at,
        )
        seen: set[str] = set()
        if req.kind is SliceKind.GPU:
            per_node: dict[str, dict[str, list[str]]] = defaultdict(dict)
            idle_on: dict[str, list[str]] = {}
            for k, vid in enumerate(newest):
                if k >= self.VICTIM_SCAN:
                    break
                for sl in leases[vid].placement.slices:
                    st = self.pool.gpus[sl.gpu_uuid]
                    g = st.gpu
                    if g.uuid in seen or g.mig or not g.healthy or g.model not in models or g.memory_mib < req.min_memory_mib or g.uuid in res.res_from:
                        continue
                    seen.add(g.uuid)
                    if not all(ok(h) for h in st.holders):
                        continue
                    node = g.node
                    per_node[node][g.uuid] = list(st.holders)
                    if node not in idle_on:
                        idle_on[node] = [
                            x.gpu.uuid
                            for x in self.pool.by_node[node]
                            if x.wholly_free and x.gpu.model in models and x.gpu.memory_mib >= req.min_memory_mib and x.gpu.uuid not in res.res_from
                        ]
                    if len(idle_on[node]) + len(per_node[node]) >= req.gpus:
                        need = req.gpus - len(idle_on[node])
                        pick = sorted(per_node[node].values(), key=lost)[:need]
                        return [leases[x] for x in dict.fromkeys(h for hs in pick for h in hs)]
            return []
        if req.kind is SliceKind.SHARE:
            for k, vid in enumerate(newest):
                if k >= self.VICTIM_SCAN:
                    break
                sl = leases[vid].placement.slices[0]
                st = self.pool.gpus[sl.gpu_uuid]
                g = st.gpu
                if g.uuid in seen or g.mig or not g.healthy or g.model not in models or g.memory_mib < req.min_memory_mib or g.uuid in res.res_from:
                    continue
                seen.add(g.uuid)
                milli, mem = share_need(req, g)
                fm, fb = st.free_milli, st.free_mem
                chosen = []
                for _, h in sorted((lost([h]), h) for h in st.holders if ok(h)):
                    if fm >= milli and fb >= mem:
                        break
                    hs = st.holders[h]
                    fm += hs.share_milli
                    fb += hs.memory_mib
                    chosen.append(h)
                if chosen and fm >= milli and fb >= mem:
                    return [leases[x] for x in chosen]
            return []
        for k, vid in enumerate(newest):
            if k >= self.VICTIM_SCAN:
                break
            sl = leases[vid].placement.slices[0]
            if sl.mig_profile == req.mig_profile and sl.model in models and sl.mig_uuid not in res.mig_res:
                return [leases[vid]]
        return []

    def _start_preemption(self, waiter: Lease, victims: list[Lease], now: float) -> list[Event]:
        out = []
        self._preempting_for[waiter.id] = set()
        for v in victims:
            grace = self.policy.tier(v.tier).grace_s
            v.preempt_at = now + grace
            v.preempted_for = waiter.id
            self._preempting_for[waiter.id].add(v.id)
            self._deadline(v.preempt_at, "preempt", v.id)
            self._touch_gpus(v.placement)
            out.append(
                Event(
                    v.id,
                    ev.PREEMPT_WARNED,
                    now,
                    "active",
                    "active",
                    f"a {waiter.tier} lease needs this GPU: this lease ends in {fmt_duration(grace)}; save your work",
                    "broker",
                    {"preempt_at": v.preempt_at, "for_tier": waiter.tier},
                    lease=v,
                )
            )
        return out

    def _cancel_preemption(self, waiter: Lease, now: float, why: str) -> list[Event]:
        vids = self._preempting_for.pop(waiter.id, None)
        out = []
        for vid in vids or ():
            v = self.leases.get(vid)
            if v is not None and v.preempt_at is not None and v.preempted_for == waiter.id:
                v.preempt_at = None
                v.preempted_for = ""
                self._touch_gpus(v.placement)
                out.append(Event(v.id, ev.PREEMPT_CANCELLED, now, "active", "active", f"preemption called off: {why}", "broker", lease=v))
        return out

    # ================================================================== restore, history, inventory
    def restore(self, leases: Iterable[Lease]) -> None:
        """Take back the live leases of a previous run (after a broker restart)."""
        for lease in sorted(leases, key=lambda x: x.seq):
            if lease.state.terminal:
                continue
            self._seq = max(self._seq, lease.seq)
            self.leases[lease.id] = lease
            if lease.state is LeaseState.QUEUED:
                self._enqueue(lease)
                if lease.max_wait_s is not None:
                    self._deadline(lease.created_at + lease.max_wait_s, "maxwait", lease.id)
                continue
            if lease.placement is None or not self.pool.fits_placement(lease.placement):
                # keep it queued-free: account nothing, fail it on the next tick
                self._restore_failed.append((lease.id, "its GPUs are no longer in the pool (or already held) after a restart"))
                lease.state = LeaseState.QUEUED  # not holding anything; ended as failed on the next tick
                self._enqueue(lease)
                continue
            self.pool.take(lease.id, lease.placement, self._preemptible(lease))
            self._hold(lease)
            self._touch_gpus(lease.placement)
            self._deadline(lease.expires_at, "expire", lease.id)
            if self.policy.warn_before_s and lease.warned_at is None:
                self._deadline(lease.expires_at - self.policy.warn_before_s, "warn", lease.id)
            if lease.preempt_at is not None:
                self._deadline(lease.preempt_at, "preempt", lease.id)
                if lease.preempted_for:
                    self._preempting_for.setdefault(lease.preempted_for, set()).add(lease.id)
            if lease.confirmed_at is None and self.policy.confirm_timeout_s is not None:
                self._deadline(lease.granted_at + self.policy.confirm_timeout_s, "confirm", lease.id)
            if self.policy.heartbeat_timeout_s:
                self._deadline((lease.last_heartbeat or lease.confirmed_at or lease.granted_at) + self.policy.heartbeat_timeout_s, "heartbeat", lease.id)
        self._dirty = True

    def record_usage(self, user: str, groups: Iterable[str], start: float, end: float, gpu_milli: int) -> None:
        """Count GPU use that ended (here, or in history loaded at start) for fair share and quotas."""
        if end <= start or gpu_milli <= 0:
            return
        self._fair.add(user, (end - start) * gpu_milli / MILLI, end)
        self._window.add("u:" + user, start, end, gpu_milli)
        for g in groups:
            self._window.add("g:" + g, start, end, gpu_milli)

    def set_inventory(self, gpus: Iterable[GPU], now: float) -> list[Event]:
        """Replace the inventory; leases on GPUs that left the pool fail."""
        gpus = list(gpus)
        self.inventory = {g.uuid: g for g in gpus}
        self.pool = Pool(gpus, self.policy.share_placement, self.pool.sizes)
        self._gpu_free_at.clear()
        out: list[Event] = []
        for lease in list(self.leases.values()):
            if lease.state is LeaseState.ACTIVE:
                if self.pool.fits_placement(lease.placement):
                    self.pool.take(lease.id, lease.placement, self._preemptible(lease))
                    self._touch_gpus(lease.placement)
                else:
                    out += self._end_lost(lease, now)
        for lease in list(self.leases.values()):
            if lease.state is LeaseState.QUEUED:
                never = self.pool.why_never(lease.request)
                if never:
                    out += self._end(lease, LeaseState.FAILED, now, f"can no longer be granted: {never[1]}", "broker")
        self._dirty = True
        return out

    def _end_lost(self, lease: Lease, now: float) -> list[Event]:
        # its slices are not in the new pool: end it without giving them back
        self._unhold(lease)
        self.record_usage(lease.user, lease.groups, lease.granted_at, now, lease.placement.gpu_milli)
        prev = lease.state
        lease.state, lease.ended_at, lease.end_reason = LeaseState.FAILED, now, "its GPU left the pool"
        del self.leases[lease.id]
        self._dirty = True
        return [Event(lease.id, ev.ENDED, now, prev.value, lease.state.value, lease.end_reason, "broker", lease=lease)]

    # ================================================================== views
    def _order_until(self, lease_id: str | None) -> None:
        """Extend the cached queue order until ``lease_id`` is in it (None: to the end).

        The order is materialised lazily: the position of a lease near the head costs only the
        leases ahead of it, which matters on very long queues (100,000 leases take ~0.2 s).
        """
        if self._order is None:
            self._order, self._pos = [], {}
            self._order_iter = self._iter_order(self.last_pass_now)
        if lease_id is not None and lease_id in self._pos:
            return
        order, pos = self._order, self._pos
        for lease in self._order_iter:
            pos[lease.id] = len(order)
            order.append(lease)
            if lease.id == lease_id:
                return

    def queue(self) -> list[Lease]:
        """Queued leases in scheduling order, as of the last pass."""
        self._order_until(None)
        return self._order

    def queue_length(self) -> int:
        return self._n_queued

    def queue_position(self, lease_id: str) -> tuple[int, int]:
        lease = self.leases.get(lease_id)
        if lease is None or lease.state is not LeaseState.QUEUED:
            raise NotFound(f"lease {lease_id!r} is not in the queue")
        self._order_until(lease_id)
        return self._pos[lease_id] + 1, self._n_queued

    def eta(self, lease_id: str) -> float | None:
        return self._eta.get(lease_id)

    def waiting_for(self, lease_id: str) -> str:
        w = self._waiting.get(lease_id)
        if w:
            return w
        lease = self.leases.get(lease_id)
        return f"waiting for {lease.request.describe()}" if lease else ""

    def queue_info(self, lease_id: str) -> dict[str, Any] | None:
        """What a queued lease's holder wants to know: position, length, ETA, what it waits for."""
        lease = self.leases.get(lease_id)
        if lease is None or lease.state is not LeaseState.QUEUED:
            return None
        pos, n = self.queue_position(lease_id)
        return {"position": pos, "length": n, "eta": self.eta(lease_id), "waiting_for": self.waiting_for(lease_id)}

    def capacity(self) -> dict[str, dict]:
        return self.pool.capacity()

    def active(self) -> list[Lease]:
        return [lease for lease in self.leases.values() if lease.state is LeaseState.ACTIVE]

    def user_usage(self, user: str, groups: Iterable[str], now: float) -> dict[str, Any]:
        """GPUs held, GPU-hours used in the quota period, and what the quota leaves."""
        q = self.policy.quota_for_user(user)
        used_h = self._window.used_s("u:" + user, now, q.period_s) / 3600 + self._active_gpu_hours(user, False, now, q.period_s)
        held = self._held_user.get(user, 0) / MILLI
        return {
            "gpus_held": held,
            "gpu_hours_used": round(used_h, 3),
            "period_s": q.period_s,
            "max_gpus": q.max_gpus,
            "gpu_hours": q.gpu_hours,
            "gpus_left": None if q.max_gpus is None else max(0.0, q.max_gpus - held),
            "gpu_hours_left": None if q.gpu_hours is None else round(max(0.0, q.gpu_hours - used_h), 3),
            "fair_share_usage_gpu_hours": round(self._user_usage(user, now) / 3600, 3),
            "groups": list(groups),
        }


__all__ = ["Scheduler", "Tier"]
