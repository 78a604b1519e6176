"""Background tasks that stay referenced until they finish.

asyncio keeps only weak references to tasks, so a task started and forgotten may be
garbage-collected before it runs to its end; its failure is then reported nowhere. Every part
that starts work in the background (the hub's link to the broker, the device guard, the broker's
server stops, the server extension) keeps its tasks in one :class:`BackgroundTasks`: referenced
until done, a failure logged once with what the task was for, and all cancelled together when
the part closes.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine, Iterator
from typing import Any

log = logging.getLogger("jupyter_gpulease")


class BackgroundTasks:
    """A set of running tasks, each kept referenced until it is done.

    ``start(coro, what=...)`` schedules ``coro`` on the running loop and returns its task. A task
    that fails logs ``"<what> failed"`` with its traceback (on ``logger``); a cancelled one
    logs nothing. ``cancel()`` cancels every task still running and waits for them to finish.
    """

    def __init__(self, logger: logging.Logger | logging.LoggerAdapter | None = None) -> None:
        self.log = logger or log
        self._tasks: set[asyncio.Task] = set()

    def start(self, coro: Coroutine[Any, Any, Any], *, what: str = "") -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(lambda t: self._done(t, what))
        return task

    def _done(self, task: asyncio.Task, what: str) -> None:
        self._tasks.discard(task)
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            self.log.error("%s failed", what or task.get_coro().__qualname__, exc_info=exc)

    def __len__(self) -> int:
        return len(self._tasks)

    def __iter__(self) -> Iterator[asyncio.Task]:
        return iter(list(self._tasks))

    async def cancel(self, timeout: float | None = 5.0) -> None:
        """Cancel every running task and wait (at most ``timeout`` seconds) until they are done."""
        tasks = [t for t in self._tasks if not t.done()]
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=timeout)
