"""The pool: what each GPU has free right now, and where a request fits.

``Pool`` holds the live occupancy of every GPU (which leases hold which slices) with small
indexes (idle GPUs per node and per model) so that a placement attempt on a full pool of
thousands of GPUs is rejected in O(models), not O(GPUs). Pure Python, no I/O, no clock.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from typing import TYPE_CHECKING

from .model import GPU, MILLI, MigInstance, Placement, Slice, model_matches
from .slices import slice_type

if TYPE_CHECKING:
    from .request import Request


class GPUState:
    """Occupancy of one GPU."""

    __slots__ = ("free_mem", "free_milli", "gpu", "holders", "mig_free")

    def __init__(self, gpu: GPU):
        self.gpu = gpu
        self.free_milli = MILLI
        self.free_mem = gpu.memory_mib
        self.holders: dict[str, Slice] = {}  # lease id -> slice it holds here
        self.mig_free: dict[str, MigInstance] = {m.uuid: m for m in gpu.mig}

    @property
    def idle(self) -> bool:
        """Nobody holds anything here (for a MIG GPU: every instance free)."""
        return not self.holders

    @property
    def wholly_free(self) -> bool:
        """Can be leased as a whole GPU."""
        return not self.holders and not self.gpu.mig and self.gpu.healthy


class ShareSizes:
    """Online distribution of the compute (milli-GPUs per GPU) that requests ask for.

    Fed with every request submitted (a share: its milli; a whole-GPU request: one GPU's 1000),
    on top of a small uniform prior, so that the first placements are not driven by a handful
    of samples. :meth:`frag_table` gives, per free milli ``f`` of a GPU, its fragmentation
    ``f * P(size > f)``: the free capacity that a random future request could not use there
    (FGD, "Beware of Fragmentation", USENIX ATC'23). The table is rebuilt lazily, at most
    once per scheduling pass that follows new requests.
    """

    __slots__ = ("_frag", "counts", "total")

    def __init__(self, prior: float = 1.0):
        self.counts = [0.0] + [prior / MILLI] * MILLI  # size (milli) -> weight
        self.total = float(prior)
        self._frag: list[float] | None = None

    def add(self, milli: int, weight: float = 1.0) -> None:
        if 0 < milli <= MILLI:
            self.counts[milli] += weight
            self.total += weight
            self._frag = None

    def frag_table(self) -> list[float]:
        """``t[f] = f * P(size > f)`` for f in 0..1000."""
        t = self._frag
        if t is None:
            t = [0.0] * (MILLI + 1)
            tail, counts, total = 0.0, self.counts, self.total
            for f in range(MILLI, -1, -1):
                t[f] = f * tail / total
                tail += counts[f]
            self._frag = t
        return t


SHARE_PLACEMENTS = ("best_fit", "fragmentation")


class Pool:
    """Live occupancy of the whole inventory, with placement.

    ``share_placement`` picks the GPU of a share among those that fit (after the
    preemption-aware node rank): ``"best_fit"`` the fullest partly used GPU, ``"fragmentation"``
    the GPU whose total fragmentation (see :class:`ShareSizes`) grows least, best fit on ties.
    """

    def __init__(self, gpus: Iterable[GPU], share_placement: str = "best_fit", sizes: ShareSizes | None = None):
        if share_placement not in SHARE_PLACEMENTS:
            raise ValueError(f"share_placement must be one of {', '.join(SHARE_PLACEMENTS)}, got {share_placement!r}")
        self.share_placement = share_placement
        self.sizes = sizes if sizes is not None else ShareSizes()  # requested sizes seen so far
        self.gpus: dict[str, GPUState] = {}
        self.by_node: dict[str, list[GPUState]] = defaultdict(list)
        self.by_model: dict[str, list[GPUState]] = defaultdict(list)
        self.mig_owner: dict[str, GPUState] = {}  # MIG uuid -> its GPU
        # model -> its nodes in inventory order (a dict used as an ordered set: placement and
        # reservations walk nodes in this order, so ties break the same way in every process;
        # a set's order of strings changes with PYTHONHASHSEED)
        self.nodes_by_model: dict[str, dict[str, None]] = defaultdict(dict)
        for g in gpus:
            if g.uuid in self.gpus:
                raise ValueError(f"duplicate GPU uuid {g.uuid!r} in the inventory")
            st = GPUState(g)
            self.gpus[g.uuid] = st
            self.by_node[g.node].append(st)
            self.by_model[g.model].append(st)
            self.nodes_by_model[g.model][g.node] = None
            for m in g.mig:
                self.mig_owner[m.uuid] = st
        for lst in self.by_node.values():
            lst.sort(key=lambda s: s.gpu.index)
        # idle whole-GPU counts, kept up to date by take()/give()
        self.idle_by_node: dict[str, int] = {n: sum(1 for s in lst if s.wholly_free) for n, lst in self.by_node.items()}
        self.idle_by_model: dict[str, int] = {m: sum(1 for s in lst if s.wholly_free) for m, lst in self.by_model.items()}
        self.free_milli_by_model: dict[str, int] = {m: sum(s.free_milli for s in lst if not s.gpu.mig and s.gpu.healthy) for m, lst in self.by_model.items()}
        self.mig_free_by_model: dict[str, int] = {m: sum(len(s.mig_free) for s in lst if s.gpu.healthy) for m, lst in self.by_model.items()}
        # GPUs open to shares, per model: partly used (packed first) and wholly free
        self.partial_by_model: dict[str, set[GPUState]] = defaultdict(set)
        self.idle_set_by_model: dict[str, set[GPUState]] = defaultdict(set)
        for st in self.gpus.values():
            self._index(st)
        self._match_cache: dict[tuple[tuple[str, ...], int], tuple[str, ...]] = {}
        self._never_cache: dict[tuple, tuple[str, str] | None] = {}  # request shape -> why_never
        self._milli_cache: dict[tuple, int] = {}  # request shape -> gpu_milli_of
        # preemptibility of what each node holds (slices), for preemption-aware placement:
        # keeping non-preemptible leases together leaves whole nodes that preemption can free
        self.preemptible_of: dict[str, bool] = {}  # lease id -> preemptible (as given to take())
        self.nonpre_by_node: dict[str, int] = defaultdict(int)  # non-preemptible slices held per node
        self.pre_by_node: dict[str, int] = defaultdict(int)  # preemptible slices held per node

    def _index(self, st: GPUState) -> None:
        g = st.gpu
        if g.mig or not g.healthy:
            return
        part, idle = self.partial_by_model[g.model], self.idle_set_by_model[g.model]
        if not st.holders:
            idle.add(st)
            part.discard(st)
        else:
            idle.discard(st)
            if st.free_milli > 0:
                part.add(st)
            else:
                part.discard(st)

    # ----------------------------------------------------------------- queries
    def models(self, patterns: tuple[str, ...], min_memory_mib: int = 0) -> tuple[str, ...]:
        """Models of the pool matching the patterns and the minimum memory (cached)."""
        key = (patterns, min_memory_mib)
        hit = self._match_cache.get(key)
        if hit is None:
            hit = tuple(
                m for m, lst in self.by_model.items() if model_matches(m, patterns) and any(s.gpu.memory_mib >= min_memory_mib for s in lst)
            )
            self._match_cache[key] = hit
        return hit

    def has_room(self) -> bool:
        """Anything free at all: an idle GPU, free compute on a shared one, a free MIG instance."""
        return any(self.idle_by_model.values()) or any(v > 0 for v in self.free_milli_by_model.values()) or any(self.mig_free_by_model.values())

    # ----------------------------------------------------------------- feasibility
    def why_never(self, req: Request) -> tuple[str, str] | None:
        """Why ``req`` can never be placed here, even on an empty pool, as (field at fault, reason); None if it can.

        Depends only on the inventory, so it is cached per request shape.
        """
        key = req.shape()
        if key not in self._never_cache:
            self._never_cache[key] = self._why_never(req)
        return self._never_cache[key]

    def _why_never(self, req: Request, only: frozenset[str] | None = None) -> tuple[str, str] | None:
        models = self.models(req.models)
        all_models = ", ".join(sorted(self.by_model)) or "none"
        if req.models and not models:
            return "model", f"no GPU model in the pool matches {'|'.join(req.models)!r}; the pool has: {all_models}"
        models = self.models(req.models, req.min_memory_mib)
        if not models:
            where = f" among {'|'.join(req.models)}" if req.models else ""
            return "min_memory_mib", f"no GPU has at least {req.min_memory_mib} MiB of memory{where}"
        # unhealthy GPUs count: they may come back (a drained or cordoned node, a GPU being reset),
        # so a request that only they could hold waits instead of failing
        cands = [s for m in models for s in self.by_model[m] if s.gpu.memory_mib >= req.min_memory_mib]
        if only is not None:
            cands = [s for s in cands if s.gpu.uuid in only or any(m.uuid in only for m in s.gpu.mig)]
            if not cands:
                return "require_gpus", "none of the GPUs in 'require_gpus' is in the pool and matches the request"
        return slice_type(req).why_never(self, req, cands)

    def out_of_service_for(self, req: Request, only: frozenset[str] | None = None) -> int:
        """How many GPUs could hold ``req`` but are out of service (cordoned, draining or
        unhealthy) when none in service could: 0 when some GPU in service could."""
        models = self.models(req.models, req.min_memory_mib)
        cands = [s for m in models for s in self.by_model[m] if s.gpu.memory_mib >= req.min_memory_mib]
        if only is not None:
            cands = [s for s in cands if s.gpu.uuid in only or any(m.uuid in only for m in s.gpu.mig)]
        if any(s.gpu.healthy for s in cands):
            return 0
        return len(cands)

    def why_never_on(self, req: Request, only: frozenset[str]) -> tuple[str, str] | None:
        """Why ``req`` can never be placed on the devices ``only`` (GPU or MIG UUIDs); None if it can."""
        return self._why_never(req, only)

    def note_request(self, req: Request) -> None:
        """Count a submitted request in the size distribution (fragmentation-aware placement)."""
        milli = slice_type(req).size_sample(self, req)
        if milli is not None:
            self.sizes.add(milli)

    def gpu_milli_of(self, req: Request) -> int:
        key = req.shape()
        m = self._milli_cache.get(key)
        if m is None:
            m = self._milli_cache[key] = self._gpu_milli_of(req)
        return m

    def _gpu_milli_of(self, req: Request) -> int:
        """Milli-GPUs a request will count as (MIG: its instance's share of memory; shares by memory: largest GPU)."""
        return slice_type(req).gpu_milli(self, req, self.models(req.models, req.min_memory_mib))

    # ----------------------------------------------------------------- placement now
    def node_rank(self, node: str, preemptible: bool | None) -> int:
        """How well a node suits a lease of this preemptibility (lower is better; 0 when ignored).

        Non-preemptible leases go first to nodes that already hold non-preemptible work, then to
        empty nodes, last to nodes holding only preemptible work; a preemptible lease first to
        nodes that hold only preemptible work, then into the gaps of nodes with non-preemptible
        work, last to empty nodes. Within a rank, the usual best fit. So a node mostly either
        holds non-preemptible work or can be emptied by preemption for a multi-GPU request.
        """
        if preemptible is None:
            return 0
        nonpre = self.nonpre_by_node.get(node, 0)
        if not preemptible:
            return 0 if nonpre else (2 if self.pre_by_node.get(node, 0) else 1)
        if nonpre:
            return 1
        return 0 if self.pre_by_node.get(node, 0) else 2

    def nodes_of(self, models) -> dict[str, None]:
        """Nodes holding any of ``models``, in inventory order (deterministic)."""
        if len(models) == 1:
            return self.nodes_by_model[models[0]]
        return dict.fromkeys(n for m in models for n in self.nodes_by_model[m])

    def place(self, req: Request, blocked=None, preemptible: bool | None = None, only: frozenset[str] | None = None) -> Placement | None:
        """Find room for ``req`` now, or None.

        ``blocked(state, milli, mem, mig_uuid) -> bool`` lets the scheduler keep reserved capacity out
        (backfill). ``preemptible`` (None: ignored) ranks nodes first by :meth:`node_rank`.
        ``only``: GPU or MIG UUIDs the placement may use (None: any). Each slice kind places in
        its own way (see :mod:`.slices`).
        """
        models = self.models(req.models, req.min_memory_mib)
        if not models:
            return None
        if only is not None:
            blocked = _only(only, blocked)
        return slice_type(req).place(self, req, models, blocked, preemptible)

    # ----------------------------------------------------------------- occupancy
    def take(self, lease_id: str, placement: Placement, preemptible: bool = False) -> None:
        """Mark a placement as held by ``lease_id`` (grant or restore)."""
        self.preemptible_of[lease_id] = preemptible
        per_node = self.pre_by_node if preemptible else self.nonpre_by_node
        for sl in placement.slices:
            s = self.gpus[sl.gpu_uuid]
            was_free = s.wholly_free
            if sl.mig_uuid:
                if sl.mig_uuid not in s.mig_free:
                    raise ValueError(f"MIG instance {sl.mig_uuid} is already held")
                del s.mig_free[sl.mig_uuid]
                self.mig_free_by_model[s.gpu.model] -= 1
            else:
                if s.free_milli < sl.share_milli or s.free_mem < sl.memory_mib:
                    raise ValueError(f"GPU {sl.gpu_uuid} has no room for this slice")
                s.free_milli -= sl.share_milli
                s.free_mem -= sl.memory_mib
                self.free_milli_by_model[s.gpu.model] -= sl.share_milli
            s.holders[lease_id] = sl
            per_node[s.gpu.node] += 1
            if was_free:
                self.idle_by_node[s.gpu.node] -= 1
                self.idle_by_model[s.gpu.model] -= 1
            self._index(s)

    def give(self, lease_id: str, placement: Placement) -> None:
        """Return a placement's slices to the pool."""
        pre = self.preemptible_of.pop(lease_id, False)
        per_node = self.pre_by_node if pre else self.nonpre_by_node
        for sl in placement.slices:
            s = self.gpus.get(sl.gpu_uuid)
            if s is None or s.holders.pop(lease_id, None) is None:
                continue
            per_node[s.gpu.node] -= 1
            if sl.mig_uuid:
                inst = next((m for m in s.gpu.mig if m.uuid == sl.mig_uuid), None)
                if inst is not None:
                    s.mig_free[inst.uuid] = inst
                    self.mig_free_by_model[s.gpu.model] += 1
            else:
                s.free_milli += sl.share_milli
                s.free_mem += sl.memory_mib
                self.free_milli_by_model[s.gpu.model] += sl.share_milli
            if s.wholly_free:
                self.idle_by_node[s.gpu.node] += 1
                self.idle_by_model[s.gpu.model] += 1
            self._index(s)

    def fits_placement(self, placement: Placement) -> bool:
        """Whether every slice of a (restored) placement exists and still has room."""
        for sl in placement.slices:
            s = self.gpus.get(sl.gpu_uuid)
            if s is None:
                return False
            if sl.mig_uuid:
                if sl.mig_uuid not in s.mig_free:
                    return False
            elif s.gpu.mig or s.free_milli < sl.share_milli or s.free_mem < sl.memory_mib:
                return False
        return True

    def capacity(self) -> dict[str, dict]:
        """Per model: GPUs, idle whole GPUs, free compute (GPUs) and memory, MIG instances per profile."""
        out: dict[str, dict] = {}
        for m, lst in sorted(self.by_model.items()):
            mig: dict[str, dict[str, int]] = {}
            for s in lst:
                for inst in s.gpu.mig:
                    d = mig.setdefault(inst.profile, {"total": 0, "free": 0})
                    d["total"] += 1
                    d["free"] += inst.uuid in s.mig_free
            plain = [s for s in lst if not s.gpu.mig and s.gpu.healthy]
            out[m] = {
                "gpus": len(lst),
                "memory_mib": max(s.gpu.memory_mib for s in lst),
                "nodes": sorted({s.gpu.node for s in lst}),
                "idle_gpus": self.idle_by_model.get(m, 0),
                "free_share": round(sum(s.free_milli for s in plain) / MILLI, 3),
                "largest_free_share": round(max((s.free_milli for s in plain), default=0) / MILLI, 3),
                "free_memory_mib": sum(s.free_mem for s in plain),
                "mig": mig,
                "healthy": sum(1 for s in lst if s.gpu.healthy),
            }
        return out


def _only(only: frozenset[str], blocked):
    """A ``blocked`` callback that also keeps out every device not in ``only``."""

    def outside(st: GPUState, milli: int, mem: int, mig_uuid: str) -> bool:
        if (mig_uuid not in only and st.gpu.uuid not in only) if mig_uuid else st.gpu.uuid not in only:
            return True
        return bool(blocked and blocked(st, milli, mem, mig_uuid))

    return outside


def pool_from_devices(devices: Iterable[dict]) -> Pool:
    """An empty Pool of the devices as the broker's ``GET api/pool`` lists them (``GPU.to_dict``),
    for checks made outside the broker: ``pool_from_devices(doc["devices"]).why_never(request)``
    gives the broker's own reason why a request can never be granted there."""
    return Pool(GPU.from_dict(d) for d in devices)
