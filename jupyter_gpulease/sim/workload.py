"""Turn trace records into a workload (jobs, sessions) and a GPU pool.

Every choice the traces do not record is an *assumption*, collected in
:class:`WorkloadAssumptions` so that reports print them next to the figures.
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from ..core.model import GPU
from .traces import AlibabaPod, Node, NotebookEvent

DAY = 86400.0

# GPU memory per model. The Alibaba inventory gives host memory only; G2 and G3 are codes
# Alibaba does not disclose. ASSUMPTION: these sizes (they only scale memory caps of shares,
# which the trace does not constrain: gpu_spec is empty on every row).
GPU_MEMORY_MIB = {
    "V100M16": 16384,
    "V100M32": 32768,
    "T4": 16384,
    "P100": 16384,
    "A10": 24576,
    "G2": 32768,
    "G3": 32768,
}
DEFAULT_GPU_MEMORY_MIB = 32768


@dataclass
class Job:
    """One unit of work that needs a lease.

    ``kind == "batch"`` (Alibaba pods): asks for ``gpu_milli`` at ``arrival`` and holds it for
    ``work_s`` once granted.

    ``kind == "session"`` (notebook sessions): asks for ``gpu_milli`` when its first burst
    arrives; ``bursts`` are (offset from arrival, length) in seconds of GPU work. The session
    holds its GPU from the first burst until ``linger_s`` after its last (unless reclaimed).
    """

    id: str
    arrival: float
    gpu_milli: int  # < 1000: a share of one GPU; otherwise whole GPUs × 1000
    qos: str = ""
    work_s: float = 0.0
    kind: str = "batch"
    bursts: list[tuple[float, float]] = field(default_factory=list)
    source_line: int = 0

    @property
    def gpus(self) -> float:
        return self.gpu_milli / 1000.0

    @property
    def multi_gpu(self) -> bool:
        return self.gpu_milli > 1000

    @property
    def busy_s(self) -> float:
        """GPU-busy seconds of the job (batch: all of its held time, by assumption)."""
        if self.kind == "batch":
            return self.work_s
        return sum(d for _, d in _merge(self.bursts))


def _merge(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """(start, length) intervals merged where they overlap; returns (start, length)."""
    out: list[list[float]] = []
    for s, d in sorted(intervals):
        e = s + d
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e - s) for s, e in out]


@dataclass
class WorkloadAssumptions:
    """What the replay assumes beyond the trace. Printed with every result."""

    trace: str
    compress: float = 1.0
    notes: list[str] = field(default_factory=list)
    knobs: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Workload:
    jobs: list[Job]
    assumptions: WorkloadAssumptions
    excluded: dict[str, int] = field(default_factory=dict)

    @property
    def span(self) -> tuple[float, float]:
        """First and last arrival (simulated seconds)."""
        if not self.jobs:
            return (0.0, 0.0)
        return (self.jobs[0].arrival, self.jobs[-1].arrival)


# --------------------------------------------------------------------------- Alibaba
def alibaba_workload(
    pods: list[AlibabaPod],
    *,
    compress: float = 1.0,
    window_days: tuple[float | None, float | None] = (None, None),
    limit: int | None = None,
) -> Workload:
    """Jobs from Alibaba pods.

    - CPU-only pods (num_gpu 0) are left out: they need no GPU lease.
    - ASSUMPTION: ``Pending`` pods (never scheduled, so no held time) are left out.
    - ASSUMPTION: a pod's held time (deletion - scheduled) is the work it needs, unchanged by
      where or when it runs; it is busy all that time (the trace has no utilisation).
    - Arrivals are compressed ``compress``× towards the first arrival of the window; held times
      are not.
    """
    if compress <= 0:
        raise ValueError("compress must be positive")
    lo, hi = window_days
    excluded = {"cpu_only": 0, "pending_never_scheduled": 0, "outside_window": 0}
    picked: list[AlibabaPod] = []
    for p in pods:
        if p.num_gpu == 0:
            excluded["cpu_only"] += 1
            continue
        if p.scheduled is None:
            excluded["pending_never_scheduled"] += 1
            continue
        day = p.creation / DAY
        if (lo is not None and day < lo) or (hi is not None and day >= hi):
            excluded["outside_window"] += 1
            continue
        picked.append(p)
    picked.sort(key=lambda p: (p.creation, p.line))
    if limit is not None:
        picked = picked[:limit]
    t0 = picked[0].creation if picked else 0.0
    jobs = [
        Job(
            id=p.name,
            arrival=(p.creation - t0) / compress,
            gpu_milli=p.gpu_request_milli,
            qos=p.qos,
            work_s=max(1.0, p.deletion - (p.scheduled or p.creation)),
            kind="batch",
            source_line=p.line,
        )
        for p in picked
    ]
    a = WorkloadAssumptions(
        trace="alibaba",
        compress=compress,
        notes=[
            "ASSUMPTION: held time (deletion_time - scheduled_time) is the work a pod needs; it is GPU-busy all of it (no utilisation in the trace).",
            "ASSUMPTION: Pending pods (never scheduled, no held time) and CPU-only pods are left out.",
            f"Arrivals compressed {compress:g}x towards the first arrival; held times unchanged.",
            "Tenants: none in the trace; QoS class is the only priority signal.",
        ],
        knobs={"window_days": list(window_days), "limit": limit},
    )
    return Workload(jobs, a, excluded)


# --------------------------------------------------------------------------- notebook sessions
def notebook_sessions(
    events: list[NotebookEvent],
    *,
    session_gap_s: float = 3600.0,
    compress: float = 1.0,
    window_days: tuple[float | None, float | None] = (None, None),
    limit: int | None = None,
) -> Workload:
    """Sessions from notebook GPU bursts.

    ASSUMPTION (the trace marks no session boundaries): events with consecutive ``job_id`` in
    file order belong to one session while each starts no earlier than the previous one and no
    more than ``session_gap_s`` after the session's last burst ended. Default: one hour, the
    same hour a session is assumed to linger after its last cell, so a burst that comes back
    within the linger continues the session.

    ASSUMPTION: a session holds as many GPUs as its largest burst asks for.
    Session start times are compressed ``compress``×; times inside a session are not.
    """
    if compress <= 0:
        raise ValueError("compress must be positive")
    groups: list[list[NotebookEvent]] = []
    cur: list[NotebookEvent] = []
    cur_end = 0.0
    for ev in events:
        s, e = ev.submit_min * 60.0, (ev.submit_min + ev.duration_min) * 60.0
        if cur:
            prev = cur[-1]
            if ev.job_id != prev.job_id + 1 or ev.submit_min < prev.submit_min or s - cur_end > session_gap_s:
                groups.append(cur)
                cur = []
        if not cur:
            cur_end = e
        cur.append(ev)
        cur_end = max(cur_end, e)
    if cur:
        groups.append(cur)
    lo, hi = window_days
    excluded = {"outside_window": 0}
    kept = []
    for g in groups:
        day = g[0].submit_min * 60.0 / DAY
        if (lo is not None and day < lo) or (hi is not None and day >= hi):
            excluded["outside_window"] += 1
            continue
        kept.append(g)
    kept.sort(key=lambda g: (g[0].submit_min, g[0].job_id))
    if limit is not None:
        kept = kept[:limit]
    t0 = kept[0][0].submit_min * 60.0 if kept else 0.0
    jobs = []
    for g in kept:
        start = g[0].submit_min * 60.0
        bursts = [(ev.submit_min * 60.0 - start, ev.duration_min * 60.0) for ev in g]
        jobs.append(
            Job(
                id=f"session-{g[0].job_id}",
                arrival=(start - t0) / compress,
                gpu_milli=1000 * max(ev.num_gpu for ev in g),
                qos="notebook",
                kind="session",
                bursts=bursts,
                source_line=g[0].line,
            )
        )
    a = WorkloadAssumptions(
        trace="notebook",
        compress=compress,
        notes=[
            f"ASSUMPTION: sessions = runs of consecutive job_ids, each event starting no earlier than the previous and at most {session_gap_s / 60:g} min after the session's last burst ended.",
            "ASSUMPTION: a session holds as many GPUs as its largest burst.",
            "ASSUMPTION: the GPU is busy exactly during bursts (overlapping bursts merged); idle between them.",
            "ASSUMPTION: a user who waits for a GPU shifts the rest of the session by that wait (think times between cells are kept).",
            f"Session start times compressed {compress:g}x; times inside a session unchanged.",
        ],
        knobs={"session_gap_s": session_gap_s, "window_days": list(window_days), "limit": limit},
    )
    return Workload(jobs, a, excluded)


# --------------------------------------------------------------------------- pools
def pool_from_inventory(
    nodes: list[Node],
    *,
    n_nodes: int = 8,
    gpus_per_node: int | None = 8,
    models: Iterable[str] | None = None,
    seed: int = 0,
) -> list[GPU]:
    """Draw ``n_nodes`` GPU nodes from the trace's inventory, deterministically for a seed.

    Only nodes with ``gpus_per_node`` GPUs (any count if None) and, if given, of ``models`` are
    candidates; the draw is uniform over nodes, so models appear in their inventory proportions.
    """
    want = set(models) if models else None
    cand = [n for n in nodes if n.gpus > 0 and (gpus_per_node is None or n.gpus == gpus_per_node) and (want is None or n.model in want)]
    if len(cand) < n_nodes:
        raise ValueError(f"the inventory has only {len(cand)} node(s) with {gpus_per_node or 'any number of'} GPUs{' of ' + ', '.join(sorted(want)) if want else ''}; asked for {n_nodes}")
    chosen = random.Random(seed).sample(cand, n_nodes)
    chosen.sort(key=lambda n: n.sn)
    return [
        GPU(uuid=f"GPU-{n.sn}-{i}", node=n.sn, index=i, model=n.model, memory_mib=GPU_MEMORY_MIB.get(n.model, DEFAULT_GPU_MEMORY_MIB))
        for n in chosen
        for i in range(n.gpus)
    ]


def uniform_pool(n_nodes: int, gpus_per_node: int, model: str = "GPU", memory_mib: int = DEFAULT_GPU_MEMORY_MIB) -> list[GPU]:
    """A pool of identical nodes (for traces without an inventory)."""
    return [
        GPU(uuid=f"GPU-node{n:02d}-{i}", node=f"node{n:02d}", index=i, model=model, memory_mib=memory_mib)
        for n in range(n_nodes)
        for i in range(gpus_per_node)
    ]


def describe_pool(gpus: list[GPU]) -> dict[str, Any]:
    by_model: dict[str, int] = {}
    nodes: dict[str, int] = {}
    for g in gpus:
        by_model[g.model] = by_model.get(g.model, 0) + 1
        nodes[g.node] = nodes.get(g.node, 0) + 1
    return {"gpus": len(gpus), "nodes": len(nodes), "models": dict(sorted(by_model.items())), "node_ids": sorted(nodes)}
