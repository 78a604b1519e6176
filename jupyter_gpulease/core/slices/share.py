"""Shares: a fraction of one GPU's compute and memory, several leases per GPU."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..model import GPU, MILLI, BadRequest, Placement, Slice, SliceKind
from .base import SliceType, share_need, where

if TYPE_CHECKING:
    from ..pool import GPUState, Pool
    from ..preemption import VictimSearch
    from ..request import Request
    from ..reservations import Reservations


class Shares(SliceType):
    kind = SliceKind.SHARE

    def parse(self, d: dict[str, Any], common: dict[str, Any]) -> Request:
        from ..request import Request

        share, mem = d.get("share"), d.get("memory_mib")
        if share is None and mem is None:
            raise BadRequest("a share needs 'share' (0 < share < 1) or 'memory_mib'", field="share")
        share_milli = 0
        if share is not None:
            if not 0 < share < 1:
                raise BadRequest(f"'share' must be between 0 and 1 (exclusive), got {share:g}; ask for 'gpus' for whole GPUs", field="share")
            share_milli = max(1, round(share * MILLI))
        return Request(kind=self.kind, share_milli=share_milli, memory_mib=mem or 0, **common)

    def from_dict(self, d: dict[str, Any], common: dict[str, Any]) -> Request:
        from ..request import Request

        return Request(kind=self.kind, share_milli=round(float(d.get("share") or 0) * MILLI), memory_mib=int(d.get("memory_mib") or 0), **common)

    def to_dict(self, req: Request) -> dict[str, Any]:
        return {"share": req.share_milli / MILLI, "memory_mib": req.memory_mib}

    def describe(self, req: Request) -> str:
        mem = f", {req.memory_mib} MiB" if req.memory_mib else ""
        return f"a {req.share_milli / MILLI:g} share of one GPU{mem}{where(req)}"

    def asked_milli(self, req: Request) -> int:
        return req.share_milli

    # ----------------------------------------------------------------- the pool
    def why_never(self, pool: Pool, req: Request, cands: list[GPUState]) -> tuple[str, str] | None:
        if not any(not s.gpu.mig for s in cands):
            return "share", "every matching GPU is in MIG mode; ask for a MIG profile instead of a share"
        if req.memory_mib and not any(not s.gpu.mig and s.gpu.memory_mib >= req.memory_mib for s in cands):
            biggest = max((s.gpu.memory_mib for s in cands if not s.gpu.mig), default=0)
            return "memory_mib", f"asks for {req.memory_mib} MiB on one GPU, but the largest GPU has {biggest} MiB"
        return None

    def gpu_milli(self, pool: Pool, req: Request, models: tuple[str, ...]) -> int:
        """The share asked for; a share given only as memory: that fraction of the largest GPU it fits on."""
        if req.share_milli:
            return req.share_milli
        mems = [s.gpu.memory_mib for m in models for s in pool.by_model[m] if not s.gpu.mig and s.gpu.memory_mib >= req.memory_mib]
        return share_need(req, GPU("", "", 0, "", max(mems)))[0] if mems else MILLI

    def size_sample(self, pool: Pool, req: Request) -> int | None:
        return pool.gpu_milli_of(req)

    def place(self, pool: Pool, req: Request, models: tuple[str, ...], blocked, preemptible: bool | None) -> Placement | None:
        """The fullest partly used GPU that still fits (best fit), or with ``share_placement =
        "fragmentation"`` the GPU whose fragmentation grows least; an idle GPU only when no
        partly used one fits (or one on a better-ranked node does)."""
        best = None
        best_key = None
        rank = pool.node_rank
        # fragmentation-aware: the second key is how much the GPU's fragmentation grows (0 for
        # plain best fit, so the key then orders exactly as best fit)
        frag = pool.sizes.frag_table() if pool.share_placement == "fragmentation" else None
        for m in models:
            if pool.free_milli_by_model.get(m, 0) <= 0:
                continue
            for s in pool.partial_by_model.get(m, ()):
                g = s.gpu
                if g.memory_mib < req.min_memory_mib:
                    continue
                milli, mem = share_need(req, g)
                if s.free_milli < milli or s.free_mem < mem or (blocked and blocked(s, milli, mem, "")):
                    continue
                f = s.free_milli
                key = (rank(g.node, preemptible), frag[f - milli] - frag[f] if frag else 0, 0, f - milli, g.node, g.index)
                if best_key is None or key < best_key:
                    best, best_key = (s, milli, mem), key
        idle_too = best is None or best_key[0] > 0
        if not idle_too and frag:
            # an idle GPU may grow fragmentation less than the best partly used one
            milli0 = req.share_milli
            idle_too = not milli0 or frag[MILLI - milli0] - frag[MILLI] < best_key[1]
        if idle_too:
            # an idle GPU on a better-ranked node beats a partly used one on a worse node
            for m in models:
                for s in pool.idle_set_by_model.get(m, ()):
                    g = s.gpu
                    if g.memory_mib < req.min_memory_mib:
                        continue
                    milli, mem = share_need(req, g)
                    if s.free_mem < mem or (blocked and blocked(s, milli, mem, "")):
                        continue
                    # an idle GPU on the node with the fewest idle GPUs keeps big nodes whole
                    key = (rank(g.node, preemptible), frag[MILLI - milli] - frag[MILLI] if frag else 0, 1, pool.idle_by_node[g.node], g.node, g.index)
                    if best_key is None or key < best_key:
                        best, best_key = (s, milli, mem), key
        if best is None:
            return None
        s, milli, mem = best
        g = s.gpu
        return Placement((Slice(g.uuid, g.node, g.index, g.model, mem, milli),))

    # ----------------------------------------------------------------- reservations and preemption
    def reserve(self, plan: Reservations, req: Request, duration_s: float, models: tuple[str, ...], only=None) -> tuple[float, list[str]] | None:
        """The GPU where the share fits soonest: among those that free up first wholly and the
        partly used ones whose first holder leaves soonest."""
        best = None
        for m in models:
            cands = set(plan.first_free_gpus(m, 8))
            cands.update(plan.soonest_partial(m))
            for u in cands:
                st = plan.pool.gpus[u]
                if st.gpu.mig or not st.gpu.healthy or st.gpu.memory_mib < req.min_memory_mib or (only is not None and u not in only):
                    continue
                milli, mem = share_need(req, st.gpu)
                t = plan.share_fit_time(st, milli, mem)
                if t < float("inf") and (best is None or (t, u) < (best[0], best[1][0])):
                    best = (t, [u], milli, mem)
        if best is None:
            return None
        t, uuids, milli, mem = best
        plan.promise_share(uuids[0], t, milli, mem, duration_s)
        return t, uuids

    def victims(self, search: VictimSearch) -> list[str]:
        """On the first GPU (newest holders first) where ending preemptible holders, least work lost first, makes room."""
        req, pool, models = search.request, search.pool, search.models
        seen: set[str] = set()
        for vid in search.candidates():
            sl = search.placement_of(vid).slices[0]
            st = pool.gpus[sl.gpu_uuid]
            g = st.gpu
            if g.uuid in seen or g.mig or not g.healthy or g.model not in models or g.memory_mib < req.min_memory_mib or search.promised(g.uuid):
                continue
            seen.add(g.uuid)
            if not search.allowed(g.uuid):
                continue
            milli, mem = share_need(req, g)
            fm, fb = st.free_milli, st.free_mem
            chosen = []
            for _, h in sorted((search.work_lost([h]), h) for h in st.holders if search.may_preempt(h)):
                if fm >= milli and fb >= mem:
                    break
                hs = st.holders[h]
                fm += hs.share_milli
                fb += hs.memory_mib
                chosen.append(h)
            if chosen and fm >= milli and fb >= mem:
                return chosen
        return []


SHARE = Shares()
