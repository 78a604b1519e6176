"""CPU time of a process, or of each of its threads, from ``/proc`` (Linux), for the benchmarks."""

from __future__ import annotations

import os

CLK_TCK = os.sysconf("SC_CLK_TCK")


def _stat_cpu(path: str) -> float | None:
    """User + system CPU seconds from a ``stat`` file; None where it is gone."""
    try:
        with open(path) as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def cpu_seconds(pid: int | None) -> float:
    """User + system CPU seconds of process ``pid`` so far (0 for none)."""
    return (_stat_cpu(f"/proc/{pid}/stat") or 0.0) if pid else 0.0


def thread_cpu(pid: int) -> dict[int, float]:
    """CPU seconds of each thread of ``pid`` so far, by thread id; {} where there is no such process."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return {}
    out = {int(tid): _stat_cpu(f"/proc/{pid}/task/{tid}/stat") for tid in tids}
    return {tid: s for tid, s in out.items() if s is not None}  # (a thread may end meanwhile)
