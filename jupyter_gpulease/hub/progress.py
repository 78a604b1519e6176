"""The spawn page's progress feed while a lease waits: queue position and ETA, then the engine's own.

Every progress stream open for a spawn replays all of its events; one opened before the spawn
begins waits for that spawn's events instead of ending early.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any


class _SpawnLog:
    """The progress events of one spawn; every open progress stream replays all of them."""

    def __init__(self):
        self.events: list[dict] = []
        self.done = False
        self.engine_started = False  # the lease part succeeded: the engine's own events follow


class SpawnProgress:
    """The progress events of a server's spawns, as the spawn page streams them.

    One per spawner: :meth:`begin` starts the log of a new spawn (open streams switch to it),
    :meth:`emit` adds an event, :meth:`finish` ends the lease part of the spawn (saying whether
    the engine's own events follow), :meth:`close` drops the log when the server stops.
    :meth:`stream` is one stream's events. ``announce`` is called with each message added (the
    spawner logs it).
    """

    def __init__(self, announce: Callable[[str], Any] | None = None):
        self._announce = announce
        self._log: _SpawnLog | None = None
        self._signal = asyncio.Event()  # set (and replaced) at every change: wakes the open streams

    @property
    def events(self) -> list[dict]:
        """The events of the spawn under way (or the last one), oldest first."""
        return list(self._log.events) if self._log is not None else []

    def _wake(self) -> None:
        signal, self._signal = self._signal, asyncio.Event()
        signal.set()

    def begin(self) -> None:
        """A fresh event log for the spawn that starts now; open streams switch to it."""
        self._log = _SpawnLog()
        self._wake()

    def close(self) -> None:
        """The server stopped: its spawn's events are history (a stream still open ends)."""
        self._log = None
        self._wake()

    def emit(self, message: str, progress: int | None = None, **data: Any) -> None:
        """Add one event (every open stream sees all of them); nothing once the lease part is done
        or when no spawn is under way. ``data`` goes into the event's ``gpulease`` field."""
        log = self._log
        if log is None or log.done:
            return
        event: dict[str, Any] = {"message": message}
        if progress is not None:
            event["progress"] = int(progress)
        if data:
            event["gpulease"] = data
        if log.events and log.events[-1] == event:
            return
        log.events.append(event)
        if self._announce is not None:
            self._announce(message)
        self._wake()

    def finish(self, engine_starts: bool = False) -> None:
        """The lease part of the spawn is over; ``engine_starts``: the engine's own events follow."""
        if self._log is not None and not self._log.done:
            self._log.done = True
            self._log.engine_started = engine_starts
        self._wake()

    async def stream(self, then: Callable[[], AsyncIterator[dict]] | None = None) -> AsyncIterator[dict]:
        """One progress stream: every event of the spawn under way, as they come; then, when
        its engine started, the events of ``then()`` (the engine's own progress).

        A stream opened before the spawn begins (the hub opens it as soon as the spawn is
        requested) waits for that spawn's events instead of ending early; a stream of a spawn
        that was cancelled, failed or stopped ends with it."""
        log: _SpawnLog | None = None
        i = 0
        while True:
            signal = self._signal
            current = self._log
            if current is not log:
                if log is not None:
                    return  # the spawn we followed was closed (stopped, failed, cancelled)
                log, i = current, 0
            if log is None:
                await signal.wait()  # the spawn has not begun yet
                continue
            while i < len(log.events):
                yield log.events[i]
                i += 1
            if log.done:
                break
            await signal.wait()
        if log.engine_started and then is not None:
            async for event in then():
                yield event
