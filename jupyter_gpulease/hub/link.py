"""One link from a hub process to the lease broker, shared by every spawner in it.

Thirty spawns waiting in the queue must not cost thirty long-polls, nor may the calls that
matter most (a release when a server stops, a confirm, a check) wait behind them. So a hub
process holds one :class:`BrokerLink` per broker it talks to:

* **its own HTTP client**, sized for the hub (``max_connections``), not tornado's process-wide
  one of 10 connections;
* **one subscription to the broker's event feed** for all spawners: each spawner follows its
  lease through a :class:`LeaseWatch`, woken by the feed when the lease is granted, warned,
  extended or ended. After a lost connection (a restarted hub or broker) the link reconnects
  with back-off and re-reads every followed lease, so an end that happened meanwhile is
  noticed as soon as the broker answers, not at the next periodic poll;
* **one queue refresh** (``GET api/queue``) for every waiting spawn, after each change and
  every ``queue_refresh_interval`` seconds, instead of one call per spawn;
* **releases that keep trying**: :meth:`BrokerLink.end_lease` retries with back-off until
  the broker has the release (or says the lease already ended), in the background, so a
  stopped server's lease never stays active because the broker was briefly busy or away;
* **ends that outlive the hub**: an end the broker did not take at the first try is written to
  the hub's :class:`~.outbox.ReleaseOutbox` (a small file) and sent from there until the broker
  has it, also by the next hub process when this one exits or dies first;
* **a start-up check** of the broker URL and the token, logged as one line for the admin.

The link holds its parts as objects of their own, built in its ``__init__``: the event feed
(:class:`~.linkfeed.LeaseFeed`), the lease ends with their outbox (:class:`~.linkends.LeaseEnds`)
and the check (the functions of :mod:`.linkcheck`). It keeps the watches, the lease refreshes
and the queue refresh itself, and tells the parts what to do with a lease through callables.
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from collections.abc import Callable
from typing import Any, ClassVar

from tornado.httpclient import AsyncHTTPClient

from ..client import Backoff, BrokerClient, BrokerError
from ..tasks import BackgroundTasks
from . import linkcheck
from .linkends import LIVE_STATES, LeaseEnds
from .linkfeed import REFRESH_KINDS, LeaseFeed
from .outbox import ReleaseOutbox

log = logging.getLogger("jupyter_gpulease.hub")

FEED_ONLY = ("ended_actor",)  # lease fields the hub learns from the event feed only


def ended_by_holder(lease: dict) -> bool:
    """Whether the server's own side gave the lease back, so that the server may keep running:
    the release asked to keep the server (``keep_server``), the server extension reclaimed an
    idle GPU (state ``reclaimed``), or the lease's own user released it (from inside the
    server, the CLI or the my-leases page) rather than the spawner, an admin or the broker."""
    if lease.get("keep_server") is True:
        return True
    state = lease.get("state")
    if state not in ("released", "reclaimed"):
        return False
    by = lease.get("ended_by")
    if isinstance(by, dict) and by.get("kind"):
        return by["kind"] in ("holder", "user", "idle")
    actor = lease.get("ended_actor") or ""
    if state == "reclaimed":
        return not actor.startswith(("service:", "admin:")) and actor != "broker"
    return bool(actor) and actor == lease.get("user")


def moved_off_its_gpu(lease: dict) -> bool:
    """Whether the lease ended because it moves off a sick GPU (the broker's health, or an admin's
    drain): its server's kernels were suspended and take a healthy GPU at their next cell, so a
    server that can change GPUs keeps running, whatever ``on_lease_end`` says for other ends."""
    return lease.get("state") == "revoked" and isinstance((lease.get("meta") or {}).get("health"), dict)


class LeaseWatch:
    """What one spawner knows of its lease: the latest lease JSON and the last warning.

    ``await watch.changed(timeout)`` returns when the link learnt something new about it;
    ``on_change`` callbacks (plain functions) run at each change.
    """

    def __init__(self, link: BrokerLink, lease_id: str, lease: dict | None = None):
        self.link = link
        self.lease_id = lease_id
        self.lease: dict = dict(lease) if lease else {"id": lease_id}
        self.warning: dict | None = None
        self.on_change: list[Callable[[LeaseWatch], Any]] = []
        self.on_event: list[Callable[[dict], Any]] = []  # each broker event of the lease, as the feed delivers it
        self._event = asyncio.Event()
        self.closed = False

    @property
    def state(self) -> str | None:
        return self.lease.get("state")

    @property
    def live(self) -> bool:
        return self.state in LIVE_STATES

    def update(self, lease: dict | None = None, **fields: Any) -> None:
        """Take a newer lease JSON (or some fields of it) and wake whoever waits.

        An ended lease stays ended: a late answer that still says 'active' is ignored."""
        new = dict(self.lease)
        if lease is not None:
            if self.state is not None and not self.live and lease.get("state") in LIVE_STATES:
                return
            # what only the feed told (who ended it) survives a re-read of the lease
            new = {**{k: v for k, v in self.lease.items() if k in FEED_ONLY}, **lease}
        new.update(fields)
        if new == self.lease:
            return
        self.lease = new
        self._fire()

    def warn(self, event: dict) -> None:
        self.warning = event
        self._fire()

    def deliver(self, event: dict) -> None:
        """One event of the lease from the broker's feed, for ``on_event`` callbacks."""
        for callback in list(self.on_event):
            try:
                callback(event)
            except Exception:
                log.exception("lease event callback for %s failed", self.lease_id)

    def _fire(self) -> None:
        event, self._event = self._event, asyncio.Event()
        event.set()
        for callback in list(self.on_change):
            try:
                callback(self)
            except Exception:
                log.exception("lease watch callback for %s failed", self.lease_id)

    async def changed(self, timeout: float | None = None) -> bool:
        """Wait until something changes (True) or ``timeout`` seconds pass (False)."""
        event = self._event
        # asyncio.timeout, not wait_for: Python 3.11's wait_for can swallow a cancellation
        # that races with the event, which would leave the waiting spawn running
        try:
            async with asyncio.timeout(timeout):
                await event.wait()
        except TimeoutError:
            return False
        return True

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.on_change.clear()
            self.on_event.clear()
            self.link._forget(self)


class BrokerLink:
    """The hub process's connection to one broker (see the module doc).

    Get it with :meth:`for_settings`; one per (event loop, URL, token). ``client`` may be given
    (tests pass an in-memory broker with :class:`BrokerClient`'s methods).
    """

    _links: ClassVar[weakref.WeakKeyDictionary] = weakref.WeakKeyDictionary()  # event loop -> {(url, token): link}

    def __init__(
        self,
        url: str,
        token: str,
        *,
        timeout: float = 30,
        max_connections: int = 64,
        queue_refresh_interval: float = 5,
        feed_timeout: float = 30,
        client: Any = None,
        logger: logging.Logger | None = None,
        outbox_path: str = "",
    ):
        self.url = url
        self.log = logger or log
        if client is None:
            http = AsyncHTTPClient(force_instance=True, max_clients=max_connections)
            client = BrokerClient(url, token, timeout=timeout, http_client=http)
        self.client = client
        self.timeout = timeout
        self.queue_refresh_interval = queue_refresh_interval
        self.watches: dict[str, set[LeaseWatch]] = {}
        self.spawners: weakref.WeakSet = weakref.WeakSet()
        self.problem = ""  # why the broker cannot be used, for the admin ("" when fine)
        self.problem_kind = ""  # "unreachable", "url", "token", "scope"
        self.checked = False
        self.shutting_down = False  # the hub stops its servers: polls do not ask the broker
        self._queue_task: asyncio.Task | None = None
        self._queue_kick = asyncio.Event()
        self._refresh: set[str] = set()
        self._refresh_task: asyncio.Task | None = None
        self._tasks = BackgroundTasks(log)
        self._closed = False
        # the feed runs while a watch, a live spawner or an event listener (the device guard)
        # needs it: a lease a server took itself must be heard of with no spawner following it
        self.feed = LeaseFeed(
            client,
            on_event=self._on_feed_event,
            resync=self._resync,
            needed=lambda: bool(self.watches or self.spawners),
            on_connected=lambda: self._clear_problem("unreachable"),
            on_unreachable=lambda message: self._note_problem(
                "unreachable", f"the lease broker at {self.url} is not answering: {message}"),
            background=self.background,
            logger=self.log,
            feed_timeout=feed_timeout,
        )
        self.ends = LeaseEnds(
            client,
            ReleaseOutbox(outbox_path) if outbox_path else None,
            on_lease=self._update,
            on_gone=self.refresh,
            background=self.background,
            logger=self.log,
        )

    @classmethod
    def for_settings(cls, url: str, token: str, **kw: Any) -> BrokerLink:
        """The link of this event loop for ``url`` and ``token``; made on first use."""
        loop = asyncio.get_running_loop()
        links = cls._links.setdefault(loop, {})
        key = (url, token)
        link = links.get(key)
        if link is None or link._closed:
            link = links[key] = cls(url, token, **kw)
        return link

    @classmethod
    def open_links(cls) -> list[BrokerLink]:
        """The links of the running event loop that are not closed (none outside a loop)."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return []
        return [link for link in cls._links.get(loop, {}).values() if not link.closed]

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def connected(self) -> bool:
        """The feed is caught up: watches hear of every change at once."""
        return self.feed.connected

    @property
    def feed_timeout(self) -> float:
        return self.feed.feed_timeout

    @property
    def outbox(self) -> ReleaseOutbox | None:
        """Where lease ends the broker did not take yet are kept (None: in memory only)."""
        return self.ends.outbox

    def __repr__(self) -> str:
        return f"BrokerLink({self.url!r})"

    def background(self, coro) -> asyncio.Task:
        """Run ``coro`` on the hub's loop, referenced until done (its failure is logged)."""
        return self._tasks.start(coro, what=f"GPU lease link to {self.url}")

    # ------------------------------------------------------------------ following leases
    def watch(self, lease_id: str, lease: dict | None = None) -> LeaseWatch:
        """Follow ``lease_id`` (``lease``: its JSON as last read, if at hand)."""
        w = LeaseWatch(self, lease_id, lease)
        self.watches.setdefault(lease_id, set()).add(w)
        self.feed.start()
        if w.state == "queued":
            self._ensure_queue_refresh()
        if lease is None:
            self.refresh(lease_id)
        return w

    def add_event_listener(self, listener: Callable[[dict], None]) -> Callable[[], None]:
        """Call ``listener(event)`` with every event of the feed, of any lease of any user (the
        event names the lease, not its user: read the lease to know whose it is), and with
        ``{"kind": "resync"}`` each time the feed (re)connects, when events may have been
        missed. The feed runs while a listener is registered. Returns a function that removes
        it. Listeners run on the event loop and must not block."""
        return self.feed.add_listener(listener)

    def _forget(self, w: LeaseWatch) -> None:
        ws = self.watches.get(w.lease_id)
        if ws is not None:
            ws.discard(w)
            if not ws:
                del self.watches[w.lease_id]

    def _watches_of(self, lease_id: str) -> list[LeaseWatch]:
        return list(self.watches.get(lease_id, ()))

    def _update(self, lease: dict) -> None:
        for w in self._watches_of(lease["id"]):
            w.update(lease)
        if lease.get("state") == "queued":
            self._ensure_queue_refresh()

    def refresh(self, lease_id: str) -> None:
        """Read ``lease_id`` again soon (coalesced with other refreshes)."""
        self._refresh.add(lease_id)
        if self._refresh_task is None or self._refresh_task.done():
            self._refresh_task = self.background(self._run_refresh())

    async def _run_refresh(self) -> None:
        while self._refresh:
            ids, self._refresh = list(self._refresh), set()
            ids = [i for i in ids if i in self.watches]
            results = await asyncio.gather(*(self.client.get_lease(i) for i in ids), return_exceptions=True)
            for lid, got in zip(ids, results, strict=True):
                if isinstance(got, BrokerError) and got.status == 404:
                    for w in self._watches_of(lid):
                        w.update(state="unknown", end_reason="the broker does not know this lease")
                elif isinstance(got, dict):
                    lease = got
                    if lease.get("state") not in LIVE_STATES and not lease.get("ended_by") and not self._ended_actor_known(lid):
                        lease = await self._with_ended_actor(lease)
                    self._update(lease)
                elif isinstance(got, BaseException):
                    self.log.debug("Could not read lease %s: %s", lid, got)

    def _ended_actor_known(self, lease_id: str) -> bool:
        return any("ended_actor" in w.lease for w in self._watches_of(lease_id))

    async def _with_ended_actor(self, lease: dict) -> dict:
        """An ended lease read without the feed's word on who ended it (a resync): ask its events."""
        try:
            feed = await self.client.events(since=0, lease_id=lease["id"], timeout=0)
        except BrokerError:
            return lease
        ended = [e for e in feed.get("events") or [] if e.get("kind") == "ended"]
        return {**lease, "ended_actor": ended[-1].get("actor", "")} if ended else lease

    async def get_lease(self, lease_id: str) -> dict | None:
        """The lease as the broker has it now (and every watch of it updated), or None when the
        broker cannot be reached; a lease the broker does not know comes back as state 'unknown'."""
        try:
            lease = await self.client.get_lease(lease_id)
        except BrokerError as e:
            if e.status == 404:
                lease = {"id": lease_id, "state": "unknown", "end_reason": "the broker does not know this lease"}
                for w in self._watches_of(lease_id):
                    w.update(**{k: v for k, v in lease.items() if k != "id"})
                return lease
            return None
        if lease.get("state") not in LIVE_STATES and not lease.get("ended_by") and not self._ended_actor_known(lease_id):
            lease = await self._with_ended_actor(lease)
        self._update(lease)
        return lease

    # ------------------------------------------------------------------ what the feed brings
    async def _resync(self) -> None:
        """Read every followed lease again (the feed (re)connects): what changed while it was
        away counts now."""
        ids = list(self.watches)
        if not ids:
            return
        live = {lease["id"]: lease for lease in await self.client.list_leases(state="live")}
        for lid in ids:
            if lid in live:
                self._update(live[lid])
            else:
                self.refresh(lid)  # ended meanwhile: read its end

    def _on_feed_event(self, ev: dict) -> None:
        """One event of the feed: the watches of its lease hear of it."""
        kind = ev.get("kind")
        if kind in ("requested", "granted", "ended") and self._queue_task is not None and not self._queue_task.done():
            self._queue_kick.set()
        lid = ev.get("lease_id")
        if lid not in self.watches:
            return
        for w in self._watches_of(lid):
            w.deliver(ev)
        if kind in ("warned", "preempt-warned"):
            for w in self._watches_of(lid):
                w.warn(ev)
        if kind == "ended":
            # known at once from the event; the lease JSON (end reason, who) follows
            for w in self._watches_of(lid):
                w.update(state=ev.get("to_state") or "ended", end_reason=ev.get("reason", ""),
                         ended_actor=ev.get("actor", ""), ended_at=ev.get("time"))
        if kind in REFRESH_KINDS:
            self.refresh(lid)

    # ------------------------------------------------------------------ the queue
    def _queued_ids(self) -> list[str]:
        return [lid for lid, ws in self.watches.items() if any(w.state == "queued" for w in ws)]

    def _ensure_queue_refresh(self) -> None:
        if self._closed:
            return
        if self._queue_task is None or self._queue_task.done():
            self._queue_task = self.background(self._run_queue_refresh())

    async def _run_queue_refresh(self) -> None:
        backoff = Backoff(first=self.queue_refresh_interval, cap=max(30.0, self.queue_refresh_interval))
        delays = backoff.delays()
        while not self._closed and self._queued_ids():
            self._queue_kick.clear()
            try:
                queue = await self.client.queue()
                delays = backoff.delays()
                delay = self.queue_refresh_interval
            except BrokerError as e:
                self.log.debug("Queue refresh failed: %s", e)
                queue = None
                delay = next(delays)
            if queue is not None:
                by_id = {entry.get("id"): entry for entry in queue}
                for lid in self._queued_ids():
                    entry = by_id.get(lid)
                    if entry is None:
                        self.refresh(lid)  # no longer queued: granted or ended
                        continue
                    for w in self._watches_of(lid):
                        if w.state == "queued" and entry.get("queue") is not None:
                            w.update(queue=entry["queue"])
            try:
                async with asyncio.timeout(delay):
                    await self._queue_kick.wait()
                await asyncio.sleep(0.05)  # let a burst of events settle: one refresh for all
            except TimeoutError:
                pass

    # ------------------------------------------------------------------ ending leases
    def end_lease(self, lease_id: str, reason: str, *, state: str = "released", who: str = "") -> asyncio.Task:
        """Release (or, while queued, withdraw) ``lease_id`` until the broker has it; see
        :meth:`.LeaseEnds.end_lease` (the task ends with the lease JSON, or None)."""
        return self.ends.end_lease(lease_id, reason, state=state, who=who)

    async def end_server_leases(self, user: str, server: str, reason: str, *, keep: tuple[str, ...] = (),
                                wait: float = 3.0) -> int | None:
        """End every live lease bound to ``user``'s ``server`` except ``keep``; see
        :meth:`.LeaseEnds.end_server_leases` (None: left to the outbox)."""
        return await self.ends.end_server_leases(user, server, reason, keep=keep, wait=wait)

    def kick_outbox(self) -> None:
        """Send what the outbox holds, in the background, until the broker has all of it."""
        self.ends.kick_outbox()

    def persist_pending(self) -> int:
        """Write every end still under way into the outbox (the hub is exiting); returns how many."""
        return self.ends.persist_pending()

    @property
    def ending(self) -> list[str]:
        """Ids of leases whose release has not reached the broker yet."""
        return self.ends.ending

    async def flush(self, timeout: float) -> list[str]:
        """Wait up to ``timeout`` s for every pending release; returns the ids still pending."""
        return await self.ends.flush(timeout)

    # ------------------------------------------------------------------ the check
    def _note_problem(self, kind: str, text: str) -> None:
        self.problem_kind, self.problem = kind, text

    def _clear_problem(self, kind: str) -> None:
        if self.problem_kind == kind:
            self.problem_kind, self.problem = "", ""

    async def check(self, *, patience: float = 120, clock: Callable[[], float] = time.monotonic) -> str:
        """Check the URL and the token once the broker answers; log ONE line for the admin and
        return it (see :func:`.linkcheck.check_broker`); the link keeps the outcome as its
        ``problem`` and ``problem_kind``."""
        line, kind = await linkcheck.check_broker(
            self.client, self.url, timeout=self.timeout, patience=patience, clock=clock, logger=self.log,
            on_unreachable=lambda line: self._note_problem(linkcheck.UNREACHABLE, line))
        self.checked = True
        if kind:
            self._note_problem(kind, line)
        else:
            self._clear_problem(self.problem_kind)
        return line

    def user_message(self) -> str:
        """What a user is told when a spawn cannot reach the broker because of a known problem."""
        return linkcheck.user_message(self.problem_kind)

    # ------------------------------------------------------------------ closing
    async def drain(self, on: bool, reason: str = "") -> bool:
        """Ask the broker to stop (``on``) or resume granting; False when it cannot (an older
        broker without drain mode, or none reachable)."""
        try:
            await self.client.drain(on)
            if reason:
                self.log.info("Broker %s granting: %s", "stopped" if on else "resumed", reason)
        except BrokerError as e:
            self.log.debug("Broker drain %s: %s", on, e)
            return False
        return True

    async def close(self) -> None:
        """Stop the feed, the queue refresh and the outbox loop (pending releases are left to finish)."""
        self._closed = True
        self.feed.close()
        self.ends.close()
        for task in (self._queue_task, self._refresh_task):
            if task is not None and not task.done():
                task.cancel()
