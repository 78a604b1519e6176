"""The one interface every slice kind implements, and what the kinds share.

A request asks for one kind of slice: whole GPUs, a share of one GPU, or a MIG instance. All
that differs between the kinds lives in one class per kind (:mod:`.whole`, :mod:`.share`,
:mod:`.mig`), so that the pool, the reservations and the preemption search each call one
method instead of branching on the kind:

- the request's own shape: ``parse``/``from_dict``/``to_dict``/``describe``, how many GPUs it
  counts as;
- ``why_never``: why the inventory can never hold it (field at fault, reason);
- ``gpu_milli``: the milli-GPUs it will hold on this pool (quotas, fair share);
- ``place``: where it fits now (the *filter* and *score* of the scheduling framework);
- ``reserve``: the earliest slot it is promised, given when held slices free up (*reserve*);
- ``victims``: the cheapest preemptible leases whose end makes room for it (*post-filter*).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from ..model import GPU, MILLI, SliceKind

if TYPE_CHECKING:
    from ..model import Placement
    from ..pool import GPUState, Pool
    from ..preemption import VictimSearch
    from ..request import Request
    from ..reservations import Reservations

Blocked = "Callable[[GPUState, int, int, str], bool] | None"


def share_need(req: Request, gpu: GPU) -> tuple[int, int]:
    """(compute milli, memory MiB) a share request takes on ``gpu``.

    A share given only as a fraction takes that fraction of the GPU's memory too; a share
    given only as memory takes the same fraction of compute; both given: both as asked.
    """
    milli = req.share_milli
    mem = req.memory_mib
    if not mem:
        mem = (gpu.memory_mib * milli) // MILLI
    if not milli:
        milli = max(1, min(MILLI, math.ceil(mem * MILLI / gpu.memory_mib)))
    return milli, mem


def where(req: Request) -> str:
    """' (A100*|L4)' when the request names models, else ''."""
    return f" ({'|'.join(req.models)})" if req.models else ""


class SliceType:
    """One kind of slice. Subclasses are stateless singletons."""

    kind: SliceKind

    # ----------------------------------------------------------- the request's shape
    def parse(self, d: dict[str, Any], common: dict[str, Any]) -> Request:
        """A request of this kind from untrusted fields (``common``: models, min_memory_mib)."""
        raise NotImplementedError

    def from_dict(self, d: dict[str, Any], common: dict[str, Any]) -> Request:
        """The request written by :meth:`to_dict` (trusted)."""
        raise NotImplementedError

    def to_dict(self, req: Request) -> dict[str, Any]:
        """This kind's fields of the request's JSON."""
        raise NotImplementedError

    def describe(self, req: Request) -> str:
        raise NotImplementedError

    def asked_milli(self, req: Request) -> int:
        """Milli-GPUs the request counts as before it is placed (MIG: 0, known per placement)."""
        raise NotImplementedError

    def gpus_asked(self, req: Request) -> int:
        """Whole GPUs that must be free together (1 for everything but multi-GPU requests)."""
        return 1

    # ----------------------------------------------------------- the pool
    def why_never(self, pool: Pool, req: Request, cands: list[GPUState]) -> tuple[str, str] | None:
        raise NotImplementedError

    def gpu_milli(self, pool: Pool, req: Request, models: tuple[str, ...]) -> int:
        raise NotImplementedError

    def size_sample(self, pool: Pool, req: Request) -> int | None:
        """The compute per GPU this request adds to the size distribution (None: not counted)."""
        return None

    def place(self, pool: Pool, req: Request, models: tuple[str, ...], blocked, preemptible: bool | None) -> Placement | None:
        raise NotImplementedError

    # ----------------------------------------------------------- reservations and preemption
    def reserve(self, plan: Reservations, req: Request, duration_s: float, models: tuple[str, ...]) -> tuple[float, list[str]] | None:
        raise NotImplementedError

    def victims(self, search: VictimSearch) -> list[str]:
        raise NotImplementedError
