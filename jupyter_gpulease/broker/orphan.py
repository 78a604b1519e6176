"""A worker broker whose supervisor died: it serves on, then hands over.

A worker learns at once that its supervisor is gone (the end of file of a pipe). A standby then
stops; the serving broker serves until a broker of the restarted service waits for the
database's lock, or until the hub itself stops answering (nobody will restart the service).
Held by :class:`.app.GPULeaseBroker`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable
from urllib.parse import urlsplit

from tornado.ioloop import PeriodicCallback

from ..store import LeaseStore

ORPHAN_STANDBY_GRACE_S = 3.0  # a serving broker whose supervisor died: the old standby has stopped by then
HUB_PROBE_EVERY_S = 2.0

log = logging.getLogger(__name__)


class OrphanHandover:
    """Watching the supervisor, and the hand-over of a broker it left behind.

    ``store``: whether this broker leads, and whether a successor waits for the lock (asked in
    ``in_writer``, the manager's writer thread); ``stop``: ends this broker (a standby, or the
    serving broker at the hand-over); ``worker``: this process is a supervisor's worker (else
    there is nothing to watch); ``hub_grace_s``: how long the hub may not answer before an
    orphan stops; ``hub_api_url``: where the hub is ("" : run by hand, no hub to look at);
    ``clock``: monotonic seconds."""

    def __init__(self, store: LeaseStore, *, in_writer: Callable[..., Awaitable], stop: Callable[[], None], worker: bool = False,
                 hub_grace_s: float = 60.0, hub_api_url: str | None = None, logger: logging.Logger | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.store = store
        self.in_writer = in_writer
        self.stop_broker = stop
        self.worker = worker
        self.hub_grace_s = hub_grace_s
        self.hub_api_url = os.environ.get("JUPYTERHUB_API_URL", "") if hub_api_url is None else hub_api_url
        self.log = logger or log
        self.clock = clock
        self.orphaned_at: float | None = None  # when the supervisor was seen gone (a serving broker)
        self.hub_seen_at = 0.0
        self.hub_probed_at = 0.0
        self.waiter_gone = False  # a look found nobody waiting: the supervisor's own standby has stopped
        self.successor_check: PeriodicCallback | None = None
        self._checking = False
        self._stopped = False

    def watch(self) -> None:
        """A worker: learn at once when the supervisor dies (the end of file of its pipe)."""
        from .supervisor import SUPERVISOR_FD

        raw = os.environ.pop(SUPERVISOR_FD, None)
        if not raw or not self.worker:
            return
        fd = int(raw)
        loop = asyncio.get_running_loop()

        def readable():
            try:
                data = os.read(fd, 64)
            except BlockingIOError:
                return
            except OSError:
                data = b""
            if data:
                return  # the supervisor writes nothing; ignore it if it ever does
            loop.remove_reader(fd)
            os.close(fd)
            self.supervisor_gone()

        os.set_blocking(fd, False)
        loop.add_reader(fd, readable)

    def supervisor_gone(self) -> None:
        """A standby stops; the serving broker starts looking for its successor."""
        if not self.store.leader:
            self.log.info("The supervisor is gone: this standby (pid %d) stops", os.getpid())
            self._stop()
            return
        self.log.warning("The supervisor is gone: this broker (pid %d) serves on until a broker of the restarted service waits "
                         "for the database's lock, then hands over", os.getpid())
        self.orphaned_at = self.hub_seen_at = self.clock()
        self.hub_probed_at = 0.0
        self.waiter_gone = False
        self.successor_check = PeriodicCallback(self.check_successor, 250)
        self.successor_check.start()

    def stop(self) -> None:
        """Stop looking (the broker stops)."""
        if self.successor_check is not None:
            self.successor_check.stop()

    def _stop(self) -> None:
        self._stopped = True
        self.stop()
        self.stop_broker()

    async def check_successor(self) -> None:
        """An orphan's hand-over: once a broker of the new supervisor waits for the lock, stop."""
        if self._stopped or self._checking:
            return
        self._checking = True
        try:
            if not await self.hub_still_there():
                self.log.warning("The hub has not answered for %g s and nobody took over: this broker (pid %d) stops; "
                                 "the next hub starts its own", self.hub_grace_s, os.getpid())
                self._stop()
                return
            waiting = await self.in_writer(self.store.successor_waiting)
        except Exception as e:
            self.log.warning("Cannot tell whether another broker waits for the lock: %s", e)
            return
        finally:
            self._checking = False
        if not waiting:
            self.waiter_gone = True  # the supervisor's own standby has stopped
            return
        # a waiter seen before the old standby was seen gone may be that standby, stopping
        if self.waiter_gone or self.clock() - self.orphaned_at > ORPHAN_STANDBY_GRACE_S:
            self.log.info("A broker waits for the lock of %s: handing over to it", self.store.describe())
            self._stop()

    async def hub_still_there(self) -> bool:
        """An orphan's look at its hub (a TCP connect to the Hub API, every 2 s): False once it has
        not answered for ``hub_grace_s``. True without a hub to look at (run by hand)."""
        now = self.clock()
        if not self.hub_api_url or now - self.hub_probed_at < HUB_PROBE_EVERY_S:
            return True
        self.hub_probed_at = now
        parts = urlsplit(self.hub_api_url)
        try:
            _, writer = await asyncio.wait_for(
                asyncio.open_connection(parts.hostname or "127.0.0.1", parts.port or (443 if parts.scheme == "https" else 80)), 1.0)
            writer.close()
            self.hub_seen_at = now
        except (OSError, TimeoutError):
            pass
        return now - self.hub_seen_at <= self.hub_grace_s
