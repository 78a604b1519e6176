"""Ending leases from the hub: releases retried until the broker has them, kept in the outbox
file when it does not answer (sent later by this hub or the next), the ends of a server's leases
(its own and those it took itself), and the flush at shutdown.

:class:`LeaseEnds` does this with a broker client and a :class:`~.outbox.ReleaseOutbox`; it tells
its owner (:class:`.link.BrokerLink`) of each lease the broker ended through the callables it
was given.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

from ..client import Backoff, BrokerError
from ..core.request import SPAWNER_META
from ..tasks import BackgroundTasks
from .outbox import ReleaseOutbox

log = logging.getLogger("jupyter_gpulease.hub")

LIVE_STATES = ("queued", "active")


def _nothing(*args: Any) -> None:
    return None


class LeaseEnds:
    """The hub's lease ends to the broker, with the outbox that keeps them (see the module doc).

    ``client``: :class:`~jupyter_gpulease.client.BrokerClient`'s ``release`` and ``list_leases``
    (or a fake). ``outbox``: where ends the broker did not take at the first try are kept (None:
    in memory only). ``on_lease(lease)``: the lease JSON the broker answered a release with.
    ``on_gone(lease_id)``: the broker had nothing to end (an unknown lease, or one ended
    already): the owner reads it again. ``background(coro)``: starts a task (default: a
    :class:`BackgroundTasks` of its own).
    """

    def __init__(
        self,
        client: Any,
        outbox: ReleaseOutbox | None = None,
        *,
        on_lease: Callable[[dict], Any] = _nothing,
        on_gone: Callable[[str], Any] = _nothing,
        background: Callable[[Coroutine], asyncio.Task] | None = None,
        logger: logging.Logger | logging.LoggerAdapter | None = None,
    ):
        self.client = client
        self.outbox = outbox
        self.on_lease = on_lease
        self.on_gone = on_gone
        self.log = logger or log
        self.closed = False
        self._background = background or BackgroundTasks(self.log).start
        self._ending: dict[str, asyncio.Task] = {}
        self._ending_why: dict[str, tuple[str, str, str]] = {}  # lease id -> (reason, state, who)
        self._outbox_task: asyncio.Task | None = None
        self._outbox_kick = asyncio.Event()

    def close(self) -> None:
        """Stop sending the outbox (its entries stay in the file); ends under way finish."""
        self.closed = True
        self._outbox_kick.set()

    # ------------------------------------------------------------------ one lease
    def end_lease(self, lease_id: str, reason: str, *, state: str = "released", who: str = "") -> asyncio.Task:
        """Release (or, while queued, withdraw) ``lease_id`` until the broker has it.

        Returns a task that ends with the lease JSON, or None when the lease had already ended
        or the broker refused for good (logged). Retries with back-off while the broker cannot
        be reached, the end kept in the outbox meanwhile; one task per lease, however often it
        is asked."""
        task = self._ending.get(lease_id)
        if task is None or task.done():
            self._ending_why[lease_id] = (reason, state, who or lease_id)
            task = self._ending[lease_id] = self._background(self._end_until_done(lease_id, reason, state, who or lease_id))
            task.add_done_callback(lambda t, lid=lease_id: self._ending_done(lid, t))
        return task

    def _ending_done(self, lease_id: str, task: asyncio.Task) -> None:
        if self._ending.get(lease_id) is task:
            self._ending.pop(lease_id, None)
            self._ending_why.pop(lease_id, None)

    async def _end_until_done(self, lease_id: str, reason: str, state: str, who: str) -> dict | None:
        delays = Backoff(first=0.5, cap=15.0).delays()
        tries = 0
        while True:
            tries += 1
            try:
                lease = await self.client.release(lease_id, reason=reason, state=state)
            except BrokerError as e:
                if e.status in (404, 409):  # unknown, or ended already: nothing left to end
                    self.on_gone(lease_id)
                    self._outbox_done_lease(lease_id)
                    return None
                if e.status == 0 or e.status == 429 or e.status >= 500:
                    if tries == 1:
                        self.log.warning("Could not release lease %s of %s yet (%s); retrying until the broker answers",
                                         lease_id, who, e.message)
                        if self.outbox is not None:
                            self.outbox.add_lease(lease_id, reason=reason, state=state, who=who)
                    await asyncio.sleep(next(delays))
                    continue
                self.log.error("The broker refused to release lease %s of %s: %s", lease_id, who, e)
                self._outbox_done_lease(lease_id)
                return None
            self.on_lease(lease)
            self._outbox_done_lease(lease_id)
            done = "Withdrew queued" if lease.get("state") == "withdrawn" else "Released"
            after = f" after {tries} tries" if tries > 1 else ""
            self.log.info("%s lease %s of %s (%s)%s", done, lease_id, who, reason, after)
            return lease

    def _outbox_done_lease(self, lease_id: str) -> None:
        if self.outbox is not None:
            self.outbox.done_lease(lease_id)

    # ------------------------------------------------------------------ a server's leases
    async def end_server_leases(self, user: str, server: str, reason: str, *, keep: tuple[str, ...] = (),
                                wait: float = 3.0) -> int | None:
        """End every live lease bound to ``user``'s ``server`` (``meta.spawner`` is
        ``SPAWNER_META``: the spawner's own and those the server took itself) except ``keep``.
        Waits up to ``wait`` s for the broker's list; when it does not come, the outbox keeps the
        order and sends it once the broker answers. Returns how many ends were started (None:
        left to the outbox)."""
        before = time.time()
        try:
            leases = await asyncio.wait_for(self.client.list_leases(state="live", user=user), timeout=wait)
        except (BrokerError, TimeoutError) as e:
            self.log.debug("Could not list the leases of %s's server %r yet: %s", user, server, e)
            if self.outbox is not None:
                self.outbox.add_server(user, server, reason=reason, before=before, keep=keep)
                self.kick_outbox()
            return None
        return len(self._end_bound(leases, user, server, reason, keep=keep, before=before))

    def _end_bound(self, leases: list[dict], user: str, server: str, reason: str, *, keep, before: float) -> list[asyncio.Task]:
        tasks = []
        for lease in leases:
            if (lease.get("state") in LIVE_STATES and lease.get("user") == user and (lease.get("server") or "") == server
                    and (lease.get("meta") or {}).get("spawner") == SPAWNER_META and lease.get("id") not in keep
                    and float(lease.get("created_at") or 0) <= before):
                self.log.warning("Ending lease %s of %s's server %r: %s", lease["id"], user, server, reason)
                tasks.append(self.end_lease(lease["id"], reason, who=f"{user}/{server}" if server else user))
        return tasks

    # ------------------------------------------------------------------ the outbox
    def kick_outbox(self) -> None:
        """Send what the outbox holds, in the background, until the broker has all of it."""
        if self.outbox is None or not self.outbox or self.closed:
            return
        self._outbox_kick.set()
        if self._outbox_task is None or self._outbox_task.done():
            self._outbox_task = self._background(self._run_outbox())

    async def _run_outbox(self) -> None:
        outbox = self.outbox
        delays = Backoff(first=1.0, cap=30.0).delays()
        announced = False
        while outbox and not self.closed:
            self._outbox_kick.clear()
            if not announced:
                self.log.info("GPU lease ends left to send to the broker: %d (sent as soon as it answers)", len(outbox))
                announced = True
            for lease_id, entry in list(outbox.leases.items()):
                if lease_id not in self._ending:
                    self.end_lease(lease_id, entry.get("reason") or "server stopped", state=entry.get("state") or "released",
                                   who=entry.get("who") or lease_id)
            failed = False
            for key, entry in list(outbox.servers.items()):
                try:
                    leases = await self.client.list_leases(state="live", user=entry["user"])
                except BrokerError as e:
                    self.log.debug("Outbox: cannot list the leases of %s yet: %s", entry.get("user"), e)
                    failed = True
                    break
                self._end_bound(leases, entry["user"], entry.get("server") or "", entry.get("reason") or "its server stopped",
                                keep=tuple(entry.get("keep") or ()), before=float(entry["before"]))
                outbox.done_server(key)
            pending = [t for t in self._ending.values() if not t.done()]
            if pending:
                await asyncio.wait(pending, timeout=5)
            if not outbox:
                break
            delay = next(delays) if failed or pending else 1.0
            try:
                async with asyncio.timeout(delay):
                    await self._outbox_kick.wait()
            except TimeoutError:
                pass
        if announced and not outbox:
            self.log.info("Every GPU lease end the hub kept has reached the broker")

    def persist_pending(self) -> int:
        """Write every end still under way into the outbox (the hub is exiting); returns how many."""
        if self.outbox is None:
            return 0
        n = 0
        for lease_id, task in list(self._ending.items()):
            if not task.done():
                reason, state, who = self._ending_why.get(lease_id, ("server stopped", "released", lease_id))
                self.outbox.add_lease(lease_id, reason=reason, state=state, who=who)
                n += 1
        return n

    @property
    def ending(self) -> list[str]:
        """Ids of leases whose release has not reached the broker yet."""
        return [lid for lid, t in self._ending.items() if not t.done()]

    async def flush(self, timeout: float) -> list[str]:
        """Wait up to ``timeout`` s for every pending release; returns the ids still pending."""
        pending = [t for t in self._ending.values() if not t.done()]
        if pending:
            await asyncio.wait(pending, timeout=timeout)
        return self.ending
