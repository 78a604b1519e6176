"""The spawn page's progress feed while a lease waits: queue position and ETA, then the engine's own.

Every progress stream open for a spawn replays all of its events; one opened before ``start()``
runs waits for that spawn's events instead of ending early.
"""

from __future__ import annotations

import asyncio
from typing import Any

from traitlets.config import LoggingConfigurable


class _ProgressLog:
    """The progress events of one spawn; every open progress stream replays all of them."""

    def __init__(self):
        self.events: list[dict] = []
        self.done = False
        self.engine_started = False  # the lease part succeeded: the engine's own events follow


class LeaseProgress(LoggingConfigurable):
    """The lease spawner's progress events (a part of :class:`.spawner.GPULeaseSpawner`)."""

    _progress: _ProgressLog | None = None

    def _new_progress(self) -> None:
        """A fresh event log for the spawn that starts now; open streams switch to it."""
        self._progress = _ProgressLog()
        self._wake_progress()

    def _close_progress(self) -> None:
        """The server stopped: its spawn's events are history (a stream still open ends)."""
        self._progress = None
        self._wake_progress()

    def emit_progress(self, message: str, progress: int | None = None, **data: Any) -> None:
        """Add one event to the spawn page's progress feed (every open page sees all of them)."""
        log = self._progress
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
        self.log.info("%s: %s", self._log_name, message)
        self._wake_progress()

    def _wake_progress(self) -> None:
        signal, self._progress_signal = self._progress_signal, asyncio.Event()
        signal.set()

    def _finish_lease_progress(self, engine_starts: bool = False) -> None:
        if self._progress is not None and not self._progress.done:
            self._progress.done = True
            self._progress.engine_started = engine_starts
        self._wake_progress()

    async def progress(self):
        """Queue position and ETA while the lease waits, then the engine's own progress events.

        A stream opened before ``start()`` runs (the hub opens it as soon as the spawn is
        requested) waits for this spawn's events instead of ending early; a stream of a spawn
        that was cancelled or failed ends with it."""
        log: _ProgressLog | None = None
        i = 0
        while True:
            signal = self._progress_signal
            current = self._progress
            if current is not log:
                if log is not None:
                    return  # the spawn we followed was closed (stopped, failed, cancelled)
                log, i = current, 0
            if log is None:
                await signal.wait()  # start() has not begun yet
                continue
            while i < len(log.events):
                yield log.events[i]
                i += 1
            if log.done:
                break
            await signal.wait()
        if log.engine_started:
            async for event in super().progress():
                yield event
