"""Reservations: one pass's plan of when slices free up and which are promised to whom (*reserve*).

The first ``reservation_depth`` waiting leases of a pass each get the earliest slot their
slices free up, from the ends of active leases and the promises to leases ahead of them; that
slot's start is their ETA. A later lease may start now only where it fits without overlapping
any promise (backfill), so it cannot delay the start of a reserved lease. How a slot is found
depends on the slice kind (:meth:`SliceType.reserve`); this class keeps the promises and
answers the time questions the kinds ask.
"""

from __future__ import annotations

import heapq
import math
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping

from .maintenance import MaintenanceWindow, WindowIndex
from .model import Lease, Slice
from .pool import GPUState, Pool
from .slices import slice_type

INF = math.inf


class Reservations:
    """Pass-local plan. ``lease_end(lease_id)`` says when a live lease's slices free up (None: no
    such lease); ``free_at`` is when each held GPU's last holder leaves, as the scheduler tracks it."""

    def __init__(self, pool: Pool, now: float, lease_end: Callable[[str], float | None], free_at: Mapping[str, float],
                 windows: WindowIndex | None = None):
        self.pool = pool
        self.now = now
        self._lease_end = lease_end
        self._free_at = free_at
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
        # maintenance windows: no slice is promised or granted across one (see core/maintenance.py)
        self.windows = windows
        self.win_from: dict[str, float] = windows.first_starts(now) if windows else {}
        self.any = bool(self.win_from)
        self._clash: MaintenanceWindow | None = None  # a window that moved the promise being made
        self.window_waits: dict[str, MaintenanceWindow] = {}  # lease id -> the window its ETA waits for

    # --------------------------------------------------------------- reserving
    def reserve(self, lease: Lease, only: frozenset[str] | None = None) -> tuple[float, list[str]] | None:
        """Promise ``lease`` the slot that frees up first; (start, GPU/MIG uuids) or None."""
        req = lease.request
        models = self.pool.models(req.models, req.min_memory_mib)
        if not models:
            return None
        kind = slice_type(req)
        got = kind.reserve(self, req, lease.duration_s, models, only)
        for _ in range(64):  # each retry moves a device past one window: few
            if self._clash is None:
                break
            self.window_waits[lease.id] = self._clash
            self._clash = None
            got = kind.reserve(self, req, lease.duration_s, models, only)
        else:
            self._clash = None
            return None
        if got is not None:
            self.any = True
        return got

    def _window_in(self, gpu_uuid: str, t: float, duration_s: float) -> bool:
        """Whether [t, t + duration) runs into a window of the GPU; if so, the GPU is not free before the window's end."""
        if not self.win_from or gpu_uuid not in self.win_from:
            return False
        w = self.windows.clash(gpu_uuid, t, t + duration_s)
        if w is None:
            return False
        self._clash = w
        return True

    def _past_window(self, u: str) -> None:
        st = self.pool.gpus[u]
        w = self._clash
        self._ensure()
        self.avail[u] = max(self.avail[u], w.end)
        self.whole.add(u)  # a share waits for the GPU past the window too
        self.fit.pop(u, None)
        heapq.heappush(self._heap(st.gpu.model), (self.avail[u], u))
        self.tops.pop(st.gpu.model, None)

    def promise_whole(self, uuids: list[str], t: float, duration_s: float) -> None:
        clashing = [u for u in uuids if self._window_in(u, t, duration_s)]
        if clashing:
            for u in clashing:
                self._past_window(u)
            return
        for u in uuids:
            self.res_from[u] = min(self.res_from.get(u, INF), t)
            self.avail[u] = self.promised_end[u] = t + duration_s
            self.whole.add(u)
            self.fit.pop(u, None)
            model = self.pool.gpus[u].gpu.model
            heapq.heappush(self._heap(model), (t + duration_s, u))
            self.tops.pop(model, None)

    def promise_share(self, u: str, t: float, milli: int, mem: int, duration_s: float) -> None:
        if self._window_in(u, t, duration_s):
            self._past_window(u)
            return
        self.res_from[u] = min(self.res_from.get(u, INF), t)
        self.share_res[u].append((t, milli, mem))
        self.promised_end[u] = max(self.promised_end.get(u, self.now), t + duration_s)
        self.avail[u] = max(self.avail[u], t + duration_s)
        self.fit.pop(u, None)
        model = self.pool.gpus[u].gpu.model
        heapq.heappush(self._heap(model), (self.avail[u], u))
        self.tops.pop(model, None)

    def promise_mig(self, mig_uuid: str, t: float, duration_s: float) -> None:
        if self._window_in(self.pool.mig_owner[mig_uuid].gpu.uuid, t, duration_s):
            self.mig_avail[mig_uuid] = max(t, self._clash.end)
            return
        self.mig_res[mig_uuid] = min(self.mig_res.get(mig_uuid, INF), t)
        self.mig_avail[mig_uuid] = t + duration_s

    # --------------------------------------------------------------- what is promised
    def promised(self, gpu_uuid: str) -> bool:
        """Whether anything on this (non-MIG) GPU is promised to a waiting lease."""
        return gpu_uuid in self.res_from

    def promised_mig(self, mig_uuid: str) -> bool:
        return mig_uuid in self.mig_res

    def promised_from(self, sl: Slice) -> float:
        """When the first promise on a slice's device begins (inf: none)."""
        promised = self.mig_res.get(sl.mig_uuid, INF) if sl.mig_uuid else self.res_from.get(sl.gpu_uuid, INF)
        return min(promised, self.win_from.get(sl.gpu_uuid, INF))

    def window_from(self, sl: Slice) -> float:
        """When the first maintenance window on a slice's GPU begins (inf: none)."""
        return self.win_from.get(sl.gpu_uuid, INF)

    def in_window_now(self):
        """A ``blocked`` callback for Pool.place that keeps out only the GPUs in a maintenance window
        now (None: none is): where no lease of any length can start now."""
        now, win_from = self.now, self.win_from
        if not any(t <= now for t in win_from.values()):
            return None
        return lambda st, milli, mem, mig_uuid: win_from.get(st.gpu.uuid, INF) <= now

    def blocker(self, end: float):
        """A ``blocked`` callback for Pool.place: True where a slice held until ``end`` would overlap a promise."""
        if not self.any:
            return None
        res_from, share_res, mig_res = self.res_from, self.share_res, self.mig_res
        whole, win_from = self.whole, self.win_from

        def blocked(st: GPUState, milli: int, mem: int, mig_uuid: str) -> bool:
            u = st.gpu.uuid
            if win_from and win_from.get(u, INF) < end:  # it would run into a maintenance window
                return True
            if mig_uuid:
                return mig_res.get(mig_uuid, INF) < end
            if res_from.get(u, INF) >= end:
                return False
            if u in whole:
                return True
            rs = share_res.get(u, ())
            r_milli = sum(m for t, m, _ in rs if t < end)
            r_mem = sum(b for t, _, b in rs if t < end)
            return st.free_milli - r_milli < milli or st.free_mem - r_mem < mem

        return blocked

    # --------------------------------------------------------------- when GPUs free up
    def end_of(self, lease_id: str) -> float:
        """When a holder's slices free up, not before now (now for a lease that is gone)."""
        end = self._lease_end(lease_id)
        return self.now if end is None else max(end, self.now)

    def gpu_free_at(self, st: GPUState) -> float:
        return max(self.now, self._free_at.get(st.gpu.uuid, self.now))

    def _ensure(self) -> None:
        if self.avail is None:
            now, fa = self.now, self._free_at
            self.avail = {u: max(now, fa.get(u, now)) for u, st in self.pool.gpus.items() if not st.gpu.mig}
            for u in self.win_from:  # a GPU that frees up inside a window is free only after it
                if u in self.avail:
                    self.avail[u] = self._past_windows(u, self.avail[u])

    def _past_windows(self, u: str, t: float) -> float:
        """The first time from ``t`` that is not inside a maintenance window of GPU ``u``."""
        for w in self.windows.by_gpu.get(u, ()):
            if w.start <= t < w.end:
                t = w.end
        return t

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

    def first_free_gpus(self, model: str, k: int) -> list[str]:
        """Up to ``k`` GPUs of ``model`` that free up first (kept until the model's heap changes)."""
        got_k = self.tops.get(model)
        if got_k is not None and len(got_k) == k:
            return got_k
        h = self._heap(model)
        got: list[tuple[float, str]] = []
        while h and len(got) < k:
            e = heapq.heappop(h)
            if self.avail[e[1]] == e[0] and all(e[1] != g[1] for g in got):
                got.append(e)
        for e in got:
            heapq.heappush(h, e)
        got_k = self.tops[model] = [u for _, u in got]
        return got_k

    def first_free(self, model: str, min_mem: int, only: frozenset[str] | None = None) -> tuple[float, str] | None:
        """(time, uuid) of the GPU of ``model`` (with at least ``min_mem``) that is free soonest."""
        h = self._heap(model)
        stash = []
        found = None
        while h:
            t, u = h[0]
            if self.avail[u] != t:  # stale entry
                heapq.heappop(h)
                continue
            if self.pool.gpus[u].gpu.memory_mib < min_mem or (only is not None and u not in only):
                stash.append(heapq.heappop(h))
                continue
            found = (t, u)
            break
        for e in stash:
            heapq.heappush(h, e)
        return found

    def free_times_on(self, node: str, models: tuple[str, ...], min_mem: int, only: frozenset[str] | None = None) -> list[tuple[float, str]]:
        """(time wholly free, uuid) of the GPUs of ``node`` that could hold the request, soonest first."""
        self._ensure()
        return sorted(
            (self.avail[st.gpu.uuid], st.gpu.uuid)
            for st in self.pool.by_node[node]
            if not st.gpu.mig and st.gpu.healthy and st.gpu.model in models and st.gpu.memory_mib >= min_mem and (only is None or st.gpu.uuid in only)
        )

    def share_fit_time(self, st: GPUState, milli: int, mem: int) -> float:
        """Earliest time a (milli, mem) share fits on ``st``, given its holders' ends and promises (kept per pass)."""
        u = st.gpu.uuid
        memo = self.fit.get(u)
        if memo is None:
            memo = self.fit[u] = {}
        t = memo.get((milli, mem))
        if t is None:
            t = memo[(milli, mem)] = self._share_fit_time(st, milli, mem)
        return t

    def _share_fit_time(self, st: GPUState, milli: int, mem: int) -> float:
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
            rel = self.releases[u] = sorted((self.end_of(h), sl.share_milli, sl.memory_mib) for h, sl in st.holders.items())
        for t, m, b in rel:
            free_m += m
            free_b += b
            if free_m >= milli and free_b >= mem:
                return t
        return INF

    def soonest_partial(self, model: str) -> list[str]:
        """Partly used GPUs of ``model`` whose first holder leaves soonest (up to 8)."""
        got = self.partial_early.get(model)
        if got is None:
            part = self.pool.partial_by_model.get(model, ())
            got = [st.gpu.uuid for st in heapq.nsmallest(8, part, key=lambda st: min((self.end_of(h) for h in st.holders), default=self.now))]
            self.partial_early[model] = got
        return got

    def mig_free_at(self, mig_uuid: str, holder: str | None) -> float:
        """When a MIG instance frees up (its holder's end, or a promise's end)."""
        t = self.mig_avail.get(mig_uuid)
        if t is None:
            t = self.end_of(holder) if holder is not None else self.now
            if self.win_from:
                t = self._past_windows(self.pool.mig_owner[mig_uuid].gpu.uuid, t)
            self.mig_avail[mig_uuid] = t
        return t
