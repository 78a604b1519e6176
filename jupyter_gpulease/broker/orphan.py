"""A worker broker whose supervisor died: it serves on, then hands over.

A worker learns at once that its supervisor is gone (the end of file of a pipe). A standby then
stops; the serving broker serves until a broker of the restarted service waits for the
database's lock, or until the hub itself stops answering (nobody will restart the service). A
part of :class:`.app.GPULeaseBroker`.
"""

from __future__ import annotations

import asyncio
import os
import time
from urllib.parse import urlsplit

from tornado.ioloop import PeriodicCallback

ORPHAN_STANDBY_GRACE_S = 3.0  # a serving broker whose supervisor died: the old standby has stopped by then


class OrphanHandover:
    """Watching the supervisor, and the hand-over of a broker it left behind."""

    def _watch_supervisor(self) -> None:
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
            self._on_supervisor_gone()

        os.set_blocking(fd, False)
        loop.add_reader(fd, readable)

    def _on_supervisor_gone(self) -> None:
        if not self.store.leader:
            self.log.info("The supervisor is gone: this standby (pid %d) stops", os.getpid())
            self._stop_waiting.set()
            self._stopping.set()
            return
        self.log.warning("The supervisor is gone: this broker (pid %d) serves on until a broker of the restarted service waits "
                         "for the database's lock, then hands over", os.getpid())
        self._orphaned_at = self._hub_seen_at = time.monotonic()
        self._hub_probed_at = 0.0
        self._waiter_gone = False
        self._successor_check = PeriodicCallback(self._check_successor, 250)
        self._successor_check.start()

    async def _check_successor(self) -> None:
        """An orphan's hand-over: once a broker of the new supervisor waits for the lock, stop."""
        if self._stopping.is_set() or self._checking_successor:
            return
        self._checking_successor = True
        try:
            if not await self._hub_still_there():
                self.log.warning("The hub has not answered for %g s and nobody took over: this broker (pid %d) stops; "
                                 "the next hub starts its own", self.orphan_hub_grace_s, os.getpid())
                self._successor_check.stop()
                self._stopping.set()
                return
            waiting = await asyncio.get_running_loop().run_in_executor(self.manager._writer, self.store.successor_waiting)
        except Exception as e:
            self.log.warning("Cannot tell whether another broker waits for the lock: %s", e)
            return
        finally:
            self._checking_successor = False
        if not waiting:
            self._waiter_gone = True  # the supervisor's own standby has stopped
            return
        # a waiter seen before the old standby was seen gone may be that standby, stopping
        if self._waiter_gone or time.monotonic() - self._orphaned_at > ORPHAN_STANDBY_GRACE_S:
            self.log.info("A broker waits for the lock of %s: handing over to it", self.store.describe())
            self._successor_check.stop()
            self._stopping.set()

    async def _hub_still_there(self) -> bool:
        """An orphan's look at its hub (a TCP connect to the Hub API, every 2 s): False once it has
        not answered for ``orphan_hub_grace_s``. True without a hub to look at (run by hand)."""
        api = os.environ.get("JUPYTERHUB_API_URL", "")
        now = time.monotonic()
        if not api or now - self._hub_probed_at < 2.0:
            return True
        self._hub_probed_at = now
        parts = urlsplit(api)
        try:
            _, writer = await asyncio.wait_for(
                asyncio.open_connection(parts.hostname or "127.0.0.1", parts.port or (443 if parts.scheme == "https" else 80)), 1.0)
            writer.close()
            self._hub_seen_at = now
        except (OSError, TimeoutError):
            pass
        return now - self._hub_seen_at <= self.orphan_hub_grace_s

    _successor_check: PeriodicCallback | None = None

    _checking_successor = False
