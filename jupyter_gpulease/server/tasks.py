"""A set of background tasks that are kept alive until they finish and cancelled together."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any


class TaskSet:
    """Holds strong references to fire-and-forget tasks (the loop keeps only weak ones)."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task] = set()

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task:
        t = asyncio.ensure_future(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)
        return t

    def cancel_all(self) -> None:
        for t in list(self._tasks):
            t.cancel()

    def __len__(self) -> int:
        return len(self._tasks)
