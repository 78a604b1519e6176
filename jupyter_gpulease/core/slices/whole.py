"""Whole GPUs: 1..n GPUs of one node, each leased entirely."""

from __future__ import annotations

import math
from collections import defaultdict
from typing import TYPE_CHECKING, Any

from ..model import MILLI, Placement, Slice, SliceKind
from .base import SliceType, where

if TYPE_CHECKING:
    from ..pool import GPUState, Pool
    from ..preemption import VictimSearch
    from ..request import Request
    from ..reservations import Reservations


class WholeGPUs(SliceType):
    kind = SliceKind.GPU

    def parse(self, d: dict[str, Any], common: dict[str, Any]) -> Request:
        from ..request import Request, parse_number

        gpus = 1 if d.get("gpus") is None else parse_number(d["gpus"], "gpus", integer=True, minimum=1)
        return Request(kind=self.kind, gpus=gpus, **common)

    def from_dict(self, d: dict[str, Any], common: dict[str, Any]) -> Request:
        from ..request import Request

        return Request(kind=self.kind, gpus=int(d.get("gpus", 1)), **common)

    def to_dict(self, req: Request) -> dict[str, Any]:
        return {"gpus": req.gpus}

    def describe(self, req: Request) -> str:
        return f"{req.gpus} × GPU{where(req)}"

    def asked_milli(self, req: Request) -> int:
        return req.gpus * MILLI

    def gpus_asked(self, req: Request) -> int:
        return req.gpus

    # ----------------------------------------------------------------- the pool
    def why_never(self, pool: Pool, req: Request, cands: list[GPUState]) -> tuple[str, str] | None:
        per_node: dict[str, int] = defaultdict(int)
        for s in cands:
            if not s.gpu.mig:
                per_node[s.gpu.node] += 1
        most = max(per_node.values(), default=0)
        if req.gpus > most:
            what = f" of model {'|'.join(req.models)}" if req.models else ""
            return "gpus", f"asks for {req.gpus} GPUs on one node, but the most any node has{what} is {most}"
        return None

    def gpu_milli(self, pool: Pool, req: Request, models: tuple[str, ...]) -> int:
        return req.gpus * MILLI

    def size_sample(self, pool: Pool, req: Request) -> int | None:
        return MILLI

    def place(self, pool: Pool, req: Request, models: tuple[str, ...], blocked, preemptible: bool | None) -> Placement | None:
        """The node with the fewest idle GPUs that still fit (best fit), so that big nodes stay whole."""
        n = req.gpus
        if sum(pool.idle_by_model.get(m, 0) for m in models) < n:
            return None
        best: list[GPUState] | None = None
        best_idle = (1 << 30, 1 << 30)
        nodes = pool.nodes_of(models) if len(models) < len(pool.by_model) else pool.by_node.keys()
        for node in nodes:
            idle0 = pool.idle_by_node.get(node, 0)
            if idle0 < n:
                continue
            idle = (pool.node_rank(node, preemptible), idle0)
            if idle >= best_idle:
                continue
            fit = [
                s
                for s in pool.by_node[node]
                if s.wholly_free and s.gpu.model in models and s.gpu.memory_mib >= req.min_memory_mib and not (blocked and blocked(s, MILLI, s.gpu.memory_mib, ""))
            ]
            if len(fit) >= n:
                best, best_idle = fit[:n], idle
                if idle == (0, n):
                    break
        if best is None:
            return None
        return Placement(tuple(Slice(s.gpu.uuid, s.gpu.node, s.gpu.index, s.gpu.model, s.gpu.memory_mib, MILLI) for s in best))

    # ----------------------------------------------------------------- reservations and preemption
    def reserve(self, plan: Reservations, req: Request, duration_s: float, models: tuple[str, ...], only=None) -> tuple[float, list[str]] | None:
        """The ``n`` GPUs of one node that are all free soonest."""
        n, min_mem = req.gpus, req.min_memory_mib
        if n == 1:
            best = None
            for m in models:
                top = plan.first_free(m, min_mem, only)
                if top and (best is None or top < best):
                    best = top
            got = (best[0], [best[1]]) if best else None
        else:
            got = None
            best_t = math.inf
            for node in plan.pool.nodes_of(models):
                times = plan.free_times_on(node, models, min_mem, only)
                if len(times) >= n and times[n - 1][0] < best_t:
                    best_t, got = times[n - 1][0], (times[n - 1][0], [u for _, u in times[:n]])
        if got is not None:
            plan.promise_whole(got[1], got[0], duration_s)
        return got

    def victims(self, search: VictimSearch) -> list[str]:
        """The newest preemptible leases that, with idle GPUs, free ``n`` GPUs of one node."""
        req, pool, models = search.request, search.pool, search.models
        per_node: dict[str, dict[str, list[str]]] = defaultdict(dict)
        idle_on: dict[str, list[str]] = {}
        seen: set[str] = set()
        for vid in search.candidates():
            for sl in search.placement_of(vid).slices:
                st = pool.gpus[sl.gpu_uuid]
                g = st.gpu
                if g.uuid in seen or g.mig or not g.healthy or g.model not in models or g.memory_mib < req.min_memory_mib or search.promised(g.uuid):
                    continue
                seen.add(g.uuid)
                if not search.allowed(g.uuid) or not all(search.may_preempt(h) for h in st.holders):
                    continue
                node = g.node
                per_node[node][g.uuid] = list(st.holders)
                if node not in idle_on:
                    idle_on[node] = [
                        x.gpu.uuid
                        for x in pool.by_node[node]
                        if x.wholly_free and x.gpu.model in models and x.gpu.memory_mib >= req.min_memory_mib and not search.promised(x.gpu.uuid)
                        and search.allowed(x.gpu.uuid)
                    ]
                if len(idle_on[node]) + len(per_node[node]) >= req.gpus:
                    need = req.gpus - len(idle_on[node])
                    pick = sorted(per_node[node].values(), key=search.work_lost)[:need]
                    return list(dict.fromkeys(h for hs in pick for h in hs))
        return []


WHOLE = WholeGPUs()
