"""MIG instances: one instance of a named profile (``3g.40gb``) on a GPU in MIG mode."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..model import MILLI, BadRequest, Placement, Slice, SliceKind
from .base import SliceType, where

if TYPE_CHECKING:
    from ..pool import GPUState, Pool
    from ..preemption import VictimSearch
    from ..request import Request
    from ..reservations import Reservations


def instance_milli(memory_mib: int, gpu_memory_mib: int) -> int:
    """A MIG instance counts as its share of its GPU's memory (quotas, fair share)."""
    return max(1, round(memory_mib * MILLI / gpu_memory_mib))


class MigSlices(SliceType):
    kind = SliceKind.MIG

    def parse(self, d: dict[str, Any], common: dict[str, Any]) -> Request:
        from ..request import Request

        mig = d.get("mig_profile")
        if not isinstance(mig, str) or not mig.strip():
            raise BadRequest("'mig_profile' must name a MIG profile such as '1g.10gb'", field="mig_profile")
        return Request(kind=self.kind, mig_profile=mig.strip(), **common)

    def from_dict(self, d: dict[str, Any], common: dict[str, Any]) -> Request:
        from ..request import Request

        return Request(kind=self.kind, mig_profile=d.get("mig_profile", ""), **common)

    def to_dict(self, req: Request) -> dict[str, Any]:
        return {"mig_profile": req.mig_profile}

    def describe(self, req: Request) -> str:
        return f"MIG {req.mig_profile}{where(req)}"

    def asked_milli(self, req: Request) -> int:
        return 0  # set per placement from the instance's fraction of its GPU

    # ----------------------------------------------------------------- the pool
    def why_never(self, pool: Pool, req: Request, cands: list[GPUState]) -> tuple[str, str] | None:
        if not any(m.profile == req.mig_profile for s in cands for m in s.gpu.mig):
            profiles = sorted({m.profile for s in cands for m in s.gpu.mig})
            have = ", ".join(profiles) if profiles else "none"
            return "mig_profile", f"no GPU offers MIG profile {req.mig_profile!r}; profiles in the pool: {have}"
        return None

    def gpu_milli(self, pool: Pool, req: Request, models: tuple[str, ...]) -> int:
        for m in models:
            for s in pool.by_model[m]:
                for inst in s.gpu.mig:
                    if inst.profile == req.mig_profile:
                        return instance_milli(inst.memory_mib, s.gpu.memory_mib)
        return 0

    def place(self, pool: Pool, req: Request, models: tuple[str, ...], blocked, preemptible: bool | None) -> Placement | None:
        """The first free instance of the profile, in inventory order."""
        for m in models:
            if pool.mig_free_by_model.get(m, 0) <= 0:
                continue
            for s in pool.by_model[m]:
                if not s.gpu.healthy or s.gpu.memory_mib < req.min_memory_mib:
                    continue
                for inst in s.mig_free.values():
                    if inst.profile == req.mig_profile and not (blocked and blocked(s, 0, inst.memory_mib, inst.uuid)):
                        g = s.gpu
                        return Placement((Slice(g.uuid, g.node, g.index, g.model, inst.memory_mib, instance_milli(inst.memory_mib, g.memory_mib), inst.uuid, inst.profile),))
        return None

    # ----------------------------------------------------------------- reservations and preemption
    def reserve(self, plan: Reservations, req: Request, duration_s: float, models: tuple[str, ...], only=None) -> tuple[float, list[str]] | None:
        """The instance of the profile that frees up first."""
        best = None
        for m in models:
            for st in plan.pool.by_model[m]:
                if not st.gpu.healthy or st.gpu.memory_mib < req.min_memory_mib:
                    continue
                held = {sl.mig_uuid: lid for lid, sl in st.holders.items()}
                for inst in st.gpu.mig:
                    if inst.profile != req.mig_profile or (only is not None and inst.uuid not in only and st.gpu.uuid not in only):
                        continue
                    t = plan.mig_free_at(inst.uuid, held.get(inst.uuid))
                    if best is None or t < best[0]:
                        best = (t, [inst.uuid])
        if best is not None:
            plan.promise_mig(best[1][0], best[0], duration_s)
        return best

    def victims(self, search: VictimSearch) -> list[str]:
        """The newest preemptible holder of an instance of the profile that nobody is promised
        and that is not already being preempted for another waiting lease."""
        req, models = search.request, search.models
        for vid in search.candidates():
            sl = search.placement_of(vid).slices[0]
            if (
                sl.mig_profile == req.mig_profile
                and sl.model in models
                and search.may_preempt(vid)
                and not search.promised_mig(sl.mig_uuid)
                and search.allowed(sl.mig_uuid, sl.gpu_uuid)
            ):
                return [vid]
        return []


MIG = MigSlices()
