"""Discrete-event replay of a workload through the core scheduler, with a simulated clock.

The replay owns only what a user, a pod controller or a server extension would do: submit a
request when work arrives, release when it is done, ask for an extension when warned,
take an idle session's GPU back, and come back with a new request at the next burst.
Every decision about who gets which GPU when -- grants, order, backfill, preemption,
expiry -- is :class:`jupyter_gpulease.core.scheduler.Scheduler`'s, the same class the broker
runs. The scheduler is looked up on its module at run time, so a test can wrap it.
"""

from __future__ import annotations

import heapq
import itertools
import math
import sys
import time as _time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..core import events as ev
from ..core import scheduler as core_scheduler
from ..core.bookings import Booking
from ..core.idle import REGRET_WINDOW_S, GapHistogram
from ..core.model import GPU, MILLI, Conflict, LeaseError, LeaseState, Refused, SliceKind
from ..core.request import Ask, Request
from .bookings import BookingSpec, summarize_bookings
from .metrics import StepSeries
from .policies import SimPolicy
from .workload import Job, Workload

# kinds of replay events, in processing order for equal times (a booking is made before anything else then)
_BOOK = -1
_END, _IDLE, _LEAVE, _BURST, _ARRIVE, _DEADLINE, _RESUME = range(7)


@dataclass
class JobRecord:
    """What happened to one job (batch) or session."""

    job: Job
    lease_id: str | None = None  # current lease
    requested_at: float | None = None  # current request's time
    first_wait: float | None = None
    waits: list[float] = field(default_factory=list)  # every wait for a grant (first + returns)
    return_waits: list[float] = field(default_factory=list)  # waits after losing the GPU (reclaim, expiry, preemption)
    active: bool = False
    granted_at: float | None = None
    held_s: float = 0.0  # GPU-seconds held (allocated milli / 1000 × time)
    busy_s: float = 0.0  # GPU-seconds busy
    work_done_s: float = 0.0  # batch: seconds of work done
    work_end: float | None = None  # batch: when the current grant's work finishes
    finished: bool = False
    refused: str = ""
    expired: int = 0
    preempted: int = 0
    extensions: int = 0
    extensions_refused: int = 0
    reclaims: int = 0
    regretted: int = 0
    # session state
    shift: float = 0.0
    next_burst: int = 0
    pending_burst: int | None = None
    busy_until: float = 0.0
    busy_since: float | None = None
    idle_version: int = 0
    lost_at: float | None = None  # when the GPU was last taken back (reclaim)
    lost_was_reclaim: bool = False  # it waits for a GPU because an idle reclaim took it
    kernel_after_reclaim: str = ""  # "" (not reclaimed, or state not modelled), "suspended" or "lost"
    last_gpus: tuple[str, ...] = ()  # the GPUs of its last grant (a resume prefers them)
    resume_delays: list[float] = field(default_factory=list)  # a cell back after a reclaim: wait for a GPU + restore or reload
    state_lost: int = 0  # reclaims that lost the kernel's state (restart, or a suspend that cannot apply)
    gaps: list[float] = field(default_factory=list)
    alloc_milli: int = 0
    busy_milli: int = 0
    booking: str = ""  # the booking its current lease runs in ("" none)


@dataclass
class ReplayResult:
    policy: SimPolicy
    records: list[JobRecord]
    allocated: StepSeries
    busy: StepSeries
    queue: StepSeries
    span: tuple[float, float]  # first and last arrival
    end_time: float
    events: int  # replay events processed (arrivals, ends, deadlines, bursts, …)
    scheduler_events: int  # Event objects the scheduler emitted
    ticks: int
    wall_s: float
    pool_gpus: int
    counters: dict[str, int]
    bookings: dict[str, Any] | None = None  # the bookings' figures (None: none were given to this policy)

    @property
    def events_per_s(self) -> float:
        return self.events / self.wall_s if self.wall_s > 0 else float("inf")


class Progress:
    """A plain progress line on stderr, updated at most every 1% (no dependency)."""

    def __init__(self, total: int, label: str, stream=None, enabled: bool | None = None):
        self.total = max(total, 1)
        self.label = label
        self.stream = stream or sys.stderr
        self.enabled = self.stream.isatty() if enabled is None else enabled
        self._last = -1
        self._t0 = _time.perf_counter()

    def update(self, done: int) -> None:
        if not self.enabled:
            return
        pct = int(100 * done / self.total)
        if pct == self._last:
            return
        self._last = pct
        bar = "#" * (pct // 4) + "-" * (25 - pct // 4)
        self.stream.write(f"\r{self.label:<18} [{bar}] {pct:3d}% {done}/{self.total} {_time.perf_counter() - self._t0:5.1f}s")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self.update(self.total)
            self.stream.write("\n")
            self.stream.flush()


class Replay:
    """One policy over one workload and pool."""

    def __init__(
        self,
        workload: Workload,
        pool: list[GPU],
        sim_policy: SimPolicy,
        *,
        linger_s: float = 3600.0,
        horizon_s: float | None = None,
        progress: bool | None = False,
        on_event: Callable[[ev.Event], None] | None = None,
        requeue_expired: bool = True,
        on_busy: Callable[[JobRecord, float, float], None] | None = None,
        bookings: list[BookingSpec] | None = None,
    ):
        self.workload = workload
        self.pool = pool
        self.sp = sim_policy
        self.linger_s = linger_s
        self.horizon_s = horizon_s
        self.progress = Progress(len(workload.jobs), sim_policy.name, enabled=progress)
        self.on_event = on_event
        self.on_busy = on_busy  # a busy interval closed: (record, start, end) — usage records (sim/usagedb.py)
        # ASSUMPTION (default): a pod cut by its time limit is resubmitted by its user for the
        # rest of its work (as a preempted one is); False: the rest of its work is lost
        self.requeue_expired = requeue_expired
        # the broker's scheduler, looked up now (tests may wrap it)
        self.sched = core_scheduler.Scheduler(pool, sim_policy.policy)
        self.heap: list[tuple[float, int, int, Any]] = []
        self._seq = itertools.count()
        self.records = [JobRecord(j) for j in workload.jobs]
        self.by_lease: dict[str, JobRecord] = {}
        t0 = workload.jobs[0].arrival if workload.jobs else 0.0
        self.allocated = StepSeries(t0)
        self.busy = StepSeries(t0)
        self.queue = StepSeries(t0)
        self.counters = {k: 0 for k in ("granted", "released", "expired", "preempted", "reclaimed", "withdrawn", "revoked", "refused", "extended", "extension_refused", "failed", "requeued")}
        self.n_events = 0
        self.n_sched_events = 0
        self.n_ticks = 0
        self.arrived = 0
        self._lease_ids = itertools.count(1)
        self._deadlines: set[float] = set()
        self._gaps = GapHistogram()  # every session's idle gaps (inf: a session ended): the learnt timeout's prior
        warn = sim_policy.policy.warn_before_s
        self.warn_before_s = warn
        # bookings (only a policy that takes them): id -> what happened to it
        self.bookings: dict[str, dict[str, Any]] | None = None
        self._booking_specs: list[tuple[str, BookingSpec]] = []
        if bookings is not None and sim_policy.takes_bookings:
            self.bookings = {}
            self._booking_specs = [(f"bk{i}", b) for i, b in enumerate(bookings, 1)]
        self._booking_use: dict[str, list[tuple[float, float, int]]] = {}  # id -> the owner's (from, to, milli) in it
        self._jobs_by_id: dict[str, Job] = {}
        for r in self.records if self._booking_specs else ():
            self._jobs_by_id.setdefault(r.job.id, r.job)

    # ----------------------------------------------------------------- plumbing
    def _push(self, t: float, kind: int, payload: Any) -> None:
        heapq.heappush(self.heap, (t, kind, next(self._seq), payload))

    def _request_for(self, job: Job) -> Request:
        milli = job.gpu_milli
        if milli < MILLI:
            if self.sp.whole_gpus:
                return Request(kind=SliceKind.GPU, gpus=1)
            return Request(kind=SliceKind.SHARE, share_milli=milli)
        return Request(kind=SliceKind.GPU, gpus=milli // MILLI)

    def _set_busy(self, rec: JobRecord, now: float, busy: bool) -> None:
        milli = rec.job.gpu_milli if busy else 0
        if milli == rec.busy_milli:
            return
        if rec.busy_since is not None:
            rec.busy_s += (now - rec.busy_since) * rec.busy_milli / MILLI
            if self.on_busy is not None:
                self.on_busy(rec, rec.busy_since, now)
        rec.busy_since = now if milli else None
        self.busy.add(now, (milli - rec.busy_milli) / MILLI)
        rec.busy_milli = milli

    # ----------------------------------------------------------------- requests
    def _request(self, rec: JobRecord, now: float) -> None:
        job = rec.job
        tier = self.sp.tier_for(job.qos)
        try:
            prefer = rec.last_gpus if rec.kernel_after_reclaim == "suspended" else ()  # a resume goes back to its GPU first
            ask = Ask(user=job.id, request=self._request_for(job), tier=tier, meta={"job": job.id}, prefer_gpus=prefer)
            lease = self.sched.new_lease(ask, now, lease_id=f"L{next(self._lease_ids)}")
        except Refused as e:
            rec.refused = e.message
            rec.finished = True
            self.counters["refused"] += 1
            return
        rec.lease_id = lease.id
        rec.requested_at = now
        self.by_lease[lease.id] = rec
        self._handle(self.sched.submit(lease, now, actor=job.id), now)
        self.queue.add(now, 1)

    def _schedule_deadline(self, now: float) -> None:
        """Wake up at the scheduler's next deadline (expiry, warning, end of a preemption grace)."""
        nd = self.sched.next_deadline()
        if nd is not None and nd > now and nd not in self._deadlines:
            self._deadlines.add(nd)
            self._push(nd, _DEADLINE, nd)

    # ----------------------------------------------------------------- scheduler events
    def _handle(self, events: list[ev.Event], now: float) -> None:
        self.n_sched_events += len(events)
        for e in events:
            if self.on_event is not None:
                self.on_event(e)
            rec = self.by_lease.get(e.lease_id)
            if rec is None or rec.lease_id != e.lease_id:
                continue
            if e.kind == ev.GRANTED:
                self._granted(rec, e.lease, now)
            elif e.kind == ev.WARNED:
                self._warned(rec, e.lease, now)
            elif e.kind == ev.ENDED:
                self._ended(rec, e, now)

    def _granted(self, rec: JobRecord, lease, now: float) -> None:
        self.counters["granted"] += 1
        self.queue.add(now, -1)
        wait = now - (rec.requested_at if rec.requested_at is not None else now)
        returning = rec.first_wait is not None
        if not returning:
            rec.first_wait = wait
        else:
            rec.return_waits.append(wait)
        rec.waits.append(wait)
        rec.active = True
        rec.granted_at = now
        rec.alloc_milli = lease.gpu_milli
        rec.booking = str(lease.meta.get("booking", "")) if self.bookings is not None else ""
        if rec.booking and rec.booking in self.bookings:
            b = self.bookings[rec.booking]
            if b["granted_at"] is None:
                b["granted_at"] = now
                b["start_delay_s"] = now - max(b["start_s"], rec.requested_at if rec.requested_at is not None else now)
        self.allocated.add(now, rec.alloc_milli / MILLI)
        job = rec.job
        if job.kind == "batch":
            remaining = job.work_s - rec.work_done_s
            rec.work_end = now + remaining
            self._set_busy(rec, now, True)
            self._push(rec.work_end, _END, (rec, lease.id))
        else:
            rec.last_gpus = tuple(dict.fromkeys(sl.gpu_uuid for sl in lease.placement.slices))
            i = rec.pending_burst if rec.pending_burst is not None else rec.next_burst
            # back after an idle reclaim: the kernel is restored (suspended) or set up again (lost)
            extra = {"suspended": self.sp.restore_s, "lost": self.sp.reload_s}.get(rec.kernel_after_reclaim, 0.0)
            if rec.lost_was_reclaim:
                rec.resume_delays.append(wait + extra)
                rec.lost_was_reclaim = False
            rec.kernel_after_reclaim = ""
            rec.shift += wait + extra
            if extra:
                self._push(now + extra, _RESUME, (rec, lease.id, i))  # the cell runs once the kernel is back
            else:
                rec.pending_burst = None
                self._run_burst(rec, i, now)

    def _needs_until(self, rec: JobRecord, now: float) -> float | None:
        """Until when the holder still wants its lease (None: it does not care)."""
        job = rec.job
        if job.kind == "batch":
            return rec.work_end
        # a session wants its GPU while it runs a burst or has more to come
        if rec.busy_until > now or rec.next_burst < len(job.bursts):
            return max(rec.busy_until, now) + self.linger_s
        return None

    def _warned(self, rec: JobRecord, lease, now: float) -> None:
        want = self._needs_until(rec, now)
        if want is None or lease.expires_at is None or want <= lease.expires_at:
            return
        tier = self.sched.policy.tier(lease.tier)
        # ask for what is needed; a tier limits one step to max_duration_s from now
        until = min(want + 60.0, now + tier.max_duration_s)
        try:
            self._handle(self.sched.extend(lease.id, now, until=until, actor=rec.job.id), now)
            rec.extensions += 1
            self.counters["extended"] += 1
        except (Refused, Conflict, LeaseError):
            rec.extensions_refused += 1
            self.counters["extension_refused"] += 1

    def _ended(self, rec: JobRecord, e: ev.Event, now: float) -> None:
        state = e.to_state
        key = state if state in self.counters else "failed"
        self.counters[key] += 1
        was_active = rec.active
        if not was_active:
            self.queue.add(now, -1)  # withdrawn while queued
        rec.lease_id = None
        self._drop(rec, now)
        job = rec.job
        if state == LeaseState.RELEASED.value or state == LeaseState.RECLAIMED.value:
            return  # we asked for it; callers update the rest
        if job.kind == "batch":
            if state == LeaseState.PREEMPTED.value:
                # ASSUMPTION: a preempted pod is recreated by its controller and resumes its
                # remaining work (checkpointing); it queues again.
                rec.preempted += 1
                self._request(rec, now)
            elif state == LeaseState.EXPIRED.value:
                rec.expired += 1  # refused an extension
                if self.requeue_expired and rec.work_done_s < job.work_s:
                    self.counters["requeued"] += 1
                    self._request(rec, now)  # its user asks again for the rest of the work
                else:
                    rec.finished = True  # the rest of its work is lost
            else:
                rec.finished = True
        else:
            if state == LeaseState.PREEMPTED.value:
                rec.preempted += 1
            elif state == LeaseState.EXPIRED.value:
                rec.expired += 1
            rec.lost_at = None  # not a reclaim
            rec.busy_until = min(rec.busy_until, now)  # the running burst is cut short
            rec.idle_version += 1
            if rec.next_burst >= len(job.bursts):
                rec.finished = True

    def _drop(self, rec: JobRecord, now: float) -> None:
        """Book-keeping when a job loses (or gives up) its lease."""
        if rec.active:
            if rec.booking:
                self._booking_use.setdefault(rec.booking, []).append((rec.granted_at if rec.granted_at is not None else now, now, rec.alloc_milli))
                rec.booking = ""
            rec.held_s += (now - (now if rec.granted_at is None else rec.granted_at)) * rec.alloc_milli / MILLI
            self.allocated.add(now, -rec.alloc_milli / MILLI)
            if rec.job.kind == "batch" and rec.work_end is not None:
                rec.work_done_s += max(0.0, min(now, rec.work_end) - (now if rec.granted_at is None else rec.granted_at))
            self._set_busy(rec, now, False)
        rec.active = False
        rec.alloc_milli = 0

    def _release(self, rec: JobRecord, now: float, state: LeaseState, reason: str) -> None:
        lease_id = rec.lease_id
        if lease_id is None:
            return
        self._handle(self.sched.release(lease_id, now, state=state, reason=reason, actor=rec.job.id), now)

    # ----------------------------------------------------------------- sessions
    def _burst_time(self, rec: JobRecord, i: int) -> float:
        return rec.job.arrival + rec.job.bursts[i][0] + rec.shift

    def _run_burst(self, rec: JobRecord, i: int, now: float) -> None:
        _, length = rec.job.bursts[i]
        if not rec.busy_milli:
            self._set_busy(rec, now, True)
        rec.busy_until = max(rec.busy_until, now + length)
        rec.next_burst = i + 1
        rec.idle_version += 1
        if rec.next_burst < len(rec.job.bursts):
            self._push(max(now, self._burst_time(rec, rec.next_burst)), _BURST, (rec, rec.next_burst))
        self._push(rec.busy_until, _IDLE, (rec, rec.idle_version, "busy-end"))

    def _burst(self, rec: JobRecord, i: int, now: float) -> None:
        if i != rec.next_burst or rec.pending_burst is not None:
            return
        if rec.busy_until < now:
            rec.gaps.append(now - rec.busy_until)
            self._learn_gap(now - rec.busy_until)
        if rec.active:
            self._run_burst(rec, i, now)
            return
        # no GPU: come back with a new request (a returning user)
        if rec.lost_at is not None and now - rec.lost_at <= REGRET_WINDOW_S:
            rec.regretted += 1
        rec.lost_at = None
        rec.pending_burst = i
        rec.next_burst = i
        self._request(rec, now)

    def _resumed(self, rec: JobRecord, lease_id: str, i: int, now: float) -> None:
        """The kernel is back on its GPU (restored or set up again): the waiting cell runs."""
        if rec.pending_burst != i:
            return
        if rec.active and rec.lease_id == lease_id:
            rec.pending_burst = None
            self._run_burst(rec, i, now)
        elif not rec.active and not rec.finished:
            self._request(rec, now)  # the lease ended while the kernel came back: ask again

    def _learn_gap(self, gap: float) -> None:
        self._gaps.add(gap)

    def _idle_timeout(self, rec: JobRecord) -> float | None:
        """The session's idle timeout, from the core's idle rule for what its reclaim really does
        (its own gaps; everyone's as a prior where the policy says so)."""
        n_gpus = max(1, rec.job.gpu_milli // MILLI)
        return self.sp.idle_rule(n_gpus).timeout(rec.gaps, self._gaps if self.sp.idle_prior else None)

    def _idle(self, rec: JobRecord, version: int, what: str, now: float) -> None:
        if what == "ended":
            self._learn_gap(math.inf)
            return
        if version != rec.idle_version or not rec.active:
            return
        if what == "busy-end":
            self._set_busy(rec, now, False)
            more = rec.next_burst < len(rec.job.bursts)
            timeout = self._idle_timeout(rec)
            if more:
                # it would have come back at its next burst anyway
                if timeout is not None and timeout < self.linger_s:
                    self._push(now + timeout, _IDLE, (rec, version, "reclaim"))
            else:
                if timeout is not None and timeout < self.linger_s:
                    self._push(now + timeout, _IDLE, (rec, version, "reclaim"))
                else:
                    self._push(now + self.linger_s, _IDLE, (rec, version, "leave"))
        elif what == "reclaim":
            rec.reclaims += 1
            more = rec.next_burst < len(rec.job.bursts)
            rec.lost_at = now if more else None
            rec.lost_was_reclaim = more
            action = self.sp.reclaim_action
            if action != "release" and more:
                # a kernel on several GPUs can be suspended only when it drives them from its own
                # process without NCCL (cuda-checkpoint's limits); otherwise it is restarted
                if action == "suspend" and (len(rec.last_gpus) <= 1 or self.sp.suspend_multi_gpu):
                    rec.kernel_after_reclaim = "suspended"
                else:
                    rec.kernel_after_reclaim = "lost"
                    rec.state_lost += 1
            self._release(rec, now, LeaseState.RECLAIMED, "idle" if self.sp.idle_action == "reclaim" else "culled: server idle")
            if not more:
                rec.finished = True
                # the broker learns that the session is over only when it stays away
                self._push(now + self.linger_s, _IDLE, (rec, -1, "ended"))
        elif what == "leave":
            self._learn_gap(math.inf)
            self._release(rec, now, LeaseState.RELEASED, "session over")
            rec.finished = True

    # ----------------------------------------------------------------- main loop
    def run(self) -> ReplayResult:
        t_wall = _time.perf_counter()
        for rec in self.records:
            self._push(rec.job.arrival, _ARRIVE, rec)
        now = self.records[0].job.arrival if self.records else 0.0
        for bid, spec in self._booking_specs:
            self._push(min(now, spec.start) if spec.created is None else spec.created, _BOOK, (bid, spec))
        end = now
        horizon = None
        if self.horizon_s is not None and self.records:
            horizon = self.records[-1].job.arrival + self.horizon_s
        heap = self.heap
        while heap:
            t = heap[0][0]
            if horizon is not None and t > horizon:
                break
            now = t
            need_tick = False
            while heap and heap[0][0] <= now:
                _, kind, _, payload = heapq.heappop(heap)
                if kind == _DEADLINE:
                    self._deadlines.discard(payload)
                    # stale when the lease it was for ended or moved its deadline
                    nd = self.sched.next_deadline()
                    if nd is not None and nd <= now:
                        need_tick = True
                        self.n_events += 1
                    continue
                need_tick = True
                self.n_events += 1
                if kind == _BOOK:
                    self._make_booking(*payload, now)
                elif kind == _ARRIVE:
                    rec = payload
                    self.arrived += 1
                    if rec.job.kind == "batch":
                        self._request(rec, now)
                    else:
                        rec.pending_burst = 0
                        self._request(rec, now)
                    self.progress.update(self.arrived)
                elif kind == _END:
                    rec, lease_id = payload
                    if rec.lease_id == lease_id and rec.active:
                        rec.finished = True
                        self._release(rec, now, LeaseState.RELEASED, "done")
                elif kind == _BURST:
                    rec, i = payload
                    self._burst(rec, i, now)
                elif kind == _IDLE:
                    rec, version, what = payload
                    self._idle(rec, version, what, now)
                elif kind == _RESUME:
                    rec, lease_id, i = payload
                    self._resumed(rec, lease_id, i, now)
            if not need_tick:
                continue
            end = now
            self.n_ticks += 1
            self._handle(self.sched.tick(now), now)
            if self.bookings is not None:
                self._booking_changes()
            self._schedule_deadline(now)
        # close the books of whatever still holds or waits (horizon reached)
        for rec in self.records:
            if rec.active:
                if rec.booking:
                    self._booking_use.setdefault(rec.booking, []).append((rec.granted_at if rec.granted_at is not None else end, end, rec.alloc_milli))
                rec.held_s += (end - (end if rec.granted_at is None else rec.granted_at)) * rec.alloc_milli / MILLI
                if rec.busy_since is not None:
                    rec.busy_s += (end - rec.busy_since) * rec.busy_milli / MILLI
        self.progress.close()
        wall = _time.perf_counter() - t_wall
        return ReplayResult(
            policy=self.sp,
            records=self.records,
            allocated=self.allocated,
            busy=self.busy,
            queue=self.queue,
            span=self.workload.span,
            end_time=end,
            events=self.n_events,
            scheduler_events=self.n_sched_events,
            ticks=self.n_ticks,
            wall_s=wall,
            pool_gpus=len(self.pool),
            counters=self.counters,
            bookings=self._booking_figures(end),
        )

    # ----------------------------------------------------------------- bookings
    def _make_booking(self, bid: str, spec: BookingSpec, now: float) -> None:
        """Make a booking now: placed by the scheduler, or refused (the reason is kept)."""
        owner = self._jobs_by_id.get(spec.owner)
        request = spec.request if spec.request is not None else self._request_for(owner)
        item: dict[str, Any] = {
            "id": bid, "owner": spec.owner, "created_s": now, "start_s": spec.start, "end_s": spec.end,
            "request": request.describe(), "line": spec.line, "placed": False, "gpus": 0, "reason": "",
            "granted_at": None, "start_delay_s": None, "ended_at": None, "booked_gpu_hours": 0.0, "used_gpu_hours": 0.0,
            # the scheduler grants a request in a booking only where it fits the booked GPUs
            "shape_mismatch": owner is not None and self._request_for(owner).shape() != request.shape(),
            "owner_in_replay": owner is not None,
        }
        self.bookings[bid] = item
        got = self.sched.place_booking(Booking(bid, spec.start, spec.end, request, users=frozenset({spec.owner})), now)
        if got.ok:
            item.update(placed=True, gpus=len(got.booking.devices), devices=sorted(got.booking.devices))
        else:
            item["reason"] = got.reason
        self._booking_changes()

    def _booking_changes(self) -> None:
        for c in self.sched.pop_booking_changes():
            item = self.bookings.get(c.booking.id)
            if item is not None and c.what == "ended" and item["ended_at"] is None:
                item["ended_at"] = c.at
                item["reason"] = c.booking.reason

    def _booking_figures(self, end: float) -> dict[str, Any] | None:
        if self.bookings is None:
            return None
        for bid, item in self.bookings.items():
            if not item["placed"]:
                continue
            t0 = item["start_s"]
            t1 = min(item["end_s"], item["ended_at"] if item["ended_at"] is not None else item["end_s"], max(end, t0))
            item["booked_gpu_hours"] = item["gpus"] * max(0.0, t1 - t0) / 3600
            used = sum(max(0.0, min(b, t1) - max(a, t0)) * min(milli / MILLI, item["gpus"]) for a, b, milli in self._booking_use.get(bid, []))
            item["used_gpu_hours"] = used / 3600
        return summarize_bookings(list(self.bookings.values()))


def replay(workload: Workload, pool: list[GPU], sim_policy: SimPolicy, **kw) -> ReplayResult:
    """Replay ``workload`` on ``pool`` under ``sim_policy``."""
    return Replay(workload, pool, sim_policy, **kw).run()
