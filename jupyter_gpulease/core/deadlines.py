"""Deadlines: the times at which something may happen to a lease without anyone calling.

One heap of (time, order, kind, lease id). The scheduler pushes a deadline whenever it sets a
time (a grant's expiry and warning, a preemption's end, a wait limit, the confirm and
heartbeat timeouts); :meth:`Deadlines.due` pops those whose time has come, and the scheduler
handles each kind with one handler (its table in :class:`~.scheduler.Scheduler`). A deadline
whose lease ended or moved on is stale; its handler finds nothing to do.
"""

from __future__ import annotations

import enum
import heapq
from collections.abc import Callable, Iterator


class Deadline(enum.Enum):
    EXPIRE = "expire"  # the lease's time limit runs out
    WARN = "warn"  # warn_before_s ahead of the expiry
    PREEMPT = "preempt"  # the grace of a decided preemption ends
    MAX_WAIT = "maxwait"  # a queued lease's wait limit runs out
    CONFIRM = "confirm"  # a granted lease was never confirmed by its holder
    HEARTBEAT = "heartbeat"  # the holder's heartbeats stopped


class Deadlines:
    """A heap of deadlines, earliest first; ties in the order they were set."""

    def __init__(self):
        self._heap: list[tuple[float, int, Deadline, str]] = []
        self._n = 0

    def add(self, t: float, kind: Deadline, lease_id: str) -> None:
        self._n += 1
        heapq.heappush(self._heap, (t, self._n, kind, lease_id))

    def due(self, now: float) -> Iterator[tuple[Deadline, str]]:
        """Pop and yield (kind, lease id) of every deadline at or before ``now``, earliest first."""
        heap = self._heap
        while heap and heap[0][0] <= now:
            _, _, kind, lease_id = heapq.heappop(heap)
            yield kind, lease_id

    def next_time(self, alive: Callable[[str], bool]) -> float | None:
        """The earliest deadline of a lease that ``alive`` says still exists (stale ones dropped)."""
        heap = self._heap
        while heap and not alive(heap[0][3]):
            heapq.heappop(heap)
        return heap[0][0] if heap else None
