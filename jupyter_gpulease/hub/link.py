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
from ..core.request import SPAWNER_META
from ..tasks import BackgroundTasks
from .outbox import ReleaseOutbox

log = logging.getLogger("jupyter_gpulease.hub")

LIVE_STATES = ("queued", "active")
FEED_ONLY = ("ended_actor",)  # lease fields the hub learns from the event feed only
# event kinds after which the lease JSON is read again (its placement, expiry, end reason)
REFRESH_KINDS = ("granted", "extended", "ended", "confirmed", "preempt-warned", "preempt-cancelled", "warned")


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
        self.feed_timeout = feed_timeout
        self.watches: dict[str, set[LeaseWatch]] = {}
        self.spawners: weakref.WeakSet = weakref.WeakSet()
        self.event_listeners: list[Callable[[dict], None]] = []  # see add_event_listener
        self.connected = False  # the feed is caught up: watches hear of every change at once
        self.problem = ""  # why the broker cannot be used, for the admin ("" when fine)
        self.problem_kind = ""  # "unreachable", "url", "token", "scope"
        self.checked = False
        self._cursor: int | None = None
        self._feed_task: asyncio.Task | None = None
        self._queue_task: asyncio.Task | None = None
        self._queue_kick = asyncio.Event()
        self._refresh: set[str] = set()
        self._refresh_task: asyncio.Task | None = None
        self._ending: dict[str, asyncio.Task] = {}
        self._ending_why: dict[str, tuple[str, str, str]] = {}  # lease id -> (reason, state, who)
        self._tasks = BackgroundTasks(log)
        self._closed = False
        self.shutting_down = False  # the hub stops its servers: polls do not ask the broker
        self.outbox = ReleaseOutbox(outbox_path) if outbox_path else None
        self._outbox_task: asyncio.Task | None = None
        self._outbox_kick = asyncio.Event()

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
        self._ensure_feed()
        if w.state == "queued":
            self._ensure_queue_refresh()
        if lease is None:
            self.refresh(lease_id)
        return w

    def add_event_listener(self, listener: Callable[[dict], None]) -> Callable[[], None]:
        """Call ``listener(event)`` with every event of the feed, of any lease of any user (the
        event names the lease, not its user: read the lease to know whose it is), and with
        ``{"kind": "resync"}`` each time the feed (re)connects, when events may have been
        missed. Returns a function that removes it. Listeners run on the event loop and must
        not block."""
        self.event_listeners.append(listener)
        self._ensure_feed()

        def remove() -> None:
            if listener in self.event_listeners:
                self.event_listeners.remove(listener)

        return remove

    def _tell_listeners(self, ev: dict) -> None:
        for listener in list(self.event_listeners):
            try:
                listener(ev)
            except Exception:
                self.log.exception("A lease event listener failed on %s", ev.get("kind"))

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

    # ------------------------------------------------------------------ the event feed
    def _ensure_feed(self) -> None:
        if self._closed:
            return
        if self._feed_task is None or self._feed_task.done():
            self._feed_task = self.background(self._run_feed())

    async def _latest_event_id(self) -> int:
        """Where the feed starts: the newest event id, without replaying history."""
        try:
            feed = await self.client.events(since="latest", timeout=0)
            return int(feed.get("last_id") or 0)
        except BrokerError as e:
            if e.status != 400:
                raise
        # a broker without since=latest: page through (each page answers at once)
        since = 0
        while True:
            feed = await self.client.events(since=since, timeout=0)
            last = int(feed.get("last_id") or since)
            if not feed.get("events") or last == since:
                return since
            since = last

    async def _resync(self) -> None:
        """Read every followed lease again: what changed while the feed was away counts now."""
        ids = list(self.watches)
        if not ids:
            return
        live = {lease["id"]: lease for lease in await self.client.list_leases(state="live")}
        for lid in ids:
            if lid in live:
                self._update(live[lid])
            else:
                self.refresh(lid)  # ended meanwhile: read its end

    async def _run_feed(self) -> None:
        backoff = Backoff(first=0.5, cap=15.0)
        delays = backoff.delays()
        lost = False  # the feed was up and went away: say so once, and once when it is back
        while not self._closed and (self.watches or self.spawners):
            try:
                if self._cursor is None:
                    self._cursor = await self._latest_event_id()
                if not self.connected:
                    await self._resync()
                    self._tell_listeners({"kind": "resync", "lease_id": ""})  # events may have been missed
                # a short first wait after a reconnect: 'connected' means the feed answers
                feed = await self.client.events(since=self._cursor, timeout=self.feed_timeout if self.connected else 0)
                delays = backoff.delays()
            except asyncio.CancelledError:
                raise
            except BrokerError as e:
                lost = self._feed_failed(e) or lost
                await asyncio.sleep(next(delays))
                continue
            except Exception:  # a bug must not end the feed for every spawner
                self.log.exception("The lease event feed failed; reconnecting")
                self.connected = False
                await asyncio.sleep(next(delays))
                continue
            if not self.connected:
                self.connected = True
                self._clear_problem("unreachable")
                if lost:
                    self.log.info("The lease broker's event feed is back")
                    lost = False
            self._cursor = int(feed.get("last_id") or self._cursor)
            self._dispatch(feed.get("events") or [])
        self.connected = False

    def _feed_failed(self, e: BrokerError) -> bool:
        """Note a failed feed call; True when this lost a working feed."""
        was = self.connected
        self.connected = False
        if e.status == 0 or e.status >= 500:
            if was and not self._closed:
                self.log.warning("Lost the lease broker's event feed (%s); reconnecting with back-off", e.message)
            self._note_problem("unreachable", f"the lease broker at {self.url} is not answering: {e.message}")
        else:
            self.log.error("The lease broker refused the hub's event feed: %s", e)
        return was

    def _dispatch(self, events: list[dict]) -> None:
        queue_changed = False
        for ev in events:
            kind = ev.get("kind")
            if kind in ("requested", "granted", "ended"):
                queue_changed = True
            self._tell_listeners(ev)
            lid = ev.get("lease_id")
            if lid not in self.watches:
                continue
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
        if queue_changed and self._queue_task is not None and not self._queue_task.done():
            self._queue_kick.set()

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
        """Release (or, while queued, withdraw) ``lease_id`` until the broker has it.

        Returns a task that ends with the lease JSON, or None when the lease had already ended
        or the broker refused for good (logged). Retries with back-off while the broker cannot
        be reached, the end kept in the outbox meanwhile; one task per lease, however often it
        is asked."""
        task = self._ending.get(lease_id)
        if task is None or task.done():
            self._ending_why[lease_id] = (reason, state, who or lease_id)
            task = self._ending[lease_id] = self.background(self._end_until_done(lease_id, reason, state, who or lease_id))
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
                    self.refresh(lease_id)
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
            self._update(lease)
            self._outbox_done_lease(lease_id)
            done = "Withdrew queued" if lease.get("state") == "withdrawn" else "Released"
            after = f" after {tries} tries" if tries > 1 else ""
            self.log.info("%s lease %s of %s (%s)%s", done, lease_id, who, reason, after)
            return lease

    def _outbox_done_lease(self, lease_id: str) -> None:
        if self.outbox is not None:
            self.outbox.done_lease(lease_id)

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
        if self.outbox is None or not self.outbox or self._closed:
            return
        self._outbox_kick.set()
        if self._outbox_task is None or self._outbox_task.done():
            self._outbox_task = self.background(self._run_outbox())

    async def _run_outbox(self) -> None:
        outbox = self.outbox
        delays = Backoff(first=1.0, cap=30.0).delays()
        announced = False
        while outbox and not self._closed:
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

    # ------------------------------------------------------------------ the start-up check
    def _note_problem(self, kind: str, text: str) -> None:
        self.problem_kind, self.problem = kind, text

    def _clear_problem(self, kind: str) -> None:
        if self.problem_kind == kind:
            self.problem_kind, self.problem = "", ""

    async def check(self, *, patience: float = 120, clock: Callable[[], float] = time.monotonic) -> str:
        """Check the URL and the token once the broker answers; log ONE line for the admin and
        return it. Waits (with back-off, quietly) up to ``patience`` seconds for a broker that is
        not up yet (the hub starts its services after its spawners), then says so and goes on
        waiting in the background."""
        delays = Backoff(first=0.5, cap=10.0).delays()
        start = clock()
        warned = False
        while True:
            try:
                async with asyncio.timeout(min(10.0, self.timeout)):
                    line, kind = await self._check_once()
            except TimeoutError:
                line, kind = f"GPU lease broker at {self.url}: not answering yet (no answer within {min(10.0, self.timeout):g} s)", "unreachable"
            if kind != "unreachable":
                break
            self._note_problem(kind, line)
            if not warned and clock() - start >= patience:
                self.log.warning("%s; the hub keeps trying (check c.GPULeaseSpawner.broker_url)", line)
                warned = True
            await asyncio.sleep(next(delays))
        self.checked = True
        if kind:
            self._note_problem(kind, line)
            self.log.error("%s", line)
        else:
            self._clear_problem(self.problem_kind)
            self.log.info("%s", line)
        return line

    async def _check_once(self) -> tuple[str, str]:
        where = f"GPU lease broker at {self.url}"
        try:
            pool = await self.client.pool() or {}
        except BrokerError as e:
            if e.status == 0 or e.status in (502, 503, 504):
                return f"{where}: not answering yet ({e.message})", "unreachable"
            if e.status == 401 or e.error == "login":
                return (f"{where}: the spawner's token is not valid (the hub does not know it): set "
                        "c.GPULeaseSpawner.broker_api_token to the api_token of a service in c.JupyterHub.services"), "token"
            if e.status == 403:
                return (f"{where}: the spawner's token may not use the broker ({e.message}): give its service a role "
                        "with the scopes custom:gpulease:admin and access:services!service=gpulease"), "scope"
            if e.status in (301, 302, 303, 307):
                return (f"{where}: the spawner's token was refused (the broker asked to log in): set "
                        "c.GPULeaseSpawner.broker_api_token to the api_token of a service in c.JupyterHub.services"), "token"
            return (f"{where}: this URL does not lead to the lease broker's API ({e.status} {e.message} for api/pool); "
                    "check c.GPULeaseSpawner.broker_url, prefix included (e.g. http://127.0.0.1:10101/services/gpulease/)"), "url"
        except ValueError:  # an answer that is not JSON: some other web server
            return (f"{where}: this URL answers, but not as the lease broker (not JSON for api/pool); "
                    "check c.GPULeaseSpawner.broker_url, prefix included"), "url"
        if pool.get("draining"):
            # only a hub's shutdown drains the broker, for the shutdown's length; a broker left
            # draining (a hub killed mid-shutdown, a broker that outlived its hub) grants again
            try:
                await self.client.drain(False)
                self.log.warning("GPU lease broker at %s was not granting leases (drain mode left from a hub shutdown); it grants again", self.url)
            except BrokerError as e:
                self.log.warning("GPU lease broker at %s is in drain mode and could not be resumed: %s", self.url, e.message)
        # the admin scope: only an admin may see another user's pool
        try:
            await self.client.pool(user="gpulease-check", groups=["gpulease-check"])
        except BrokerError as e:
            if e.status == 403:
                return (f"{where}: the spawner's token lacks the scope custom:gpulease:admin, so it cannot ask for "
                        "leases on behalf of users: add it to the role of the spawner's service"), "scope"
            if e.status == 0 or e.status >= 500:
                return f"{where}: not answering yet ({e.message})", "unreachable"
        except ValueError:
            pass
        return f"{where}: connected; the spawner's token may ask for leases on behalf of users", ""

    def user_message(self) -> str:
        """What a user is told when a spawn cannot reach the broker because of a known problem."""
        if self.problem_kind in ("token", "scope", "url"):
            return ("GPU leases do not work on this hub right now because of a configuration problem; the administrator "
                    "finds the details in the hub's log. Choose a CPU-only server meanwhile.")
        return ""

    # ------------------------------------------------------------------ closing
    async def close(self) -> None:
        """Stop the feed and the queue refresh (pending releases are left to finish)."""
        self._closed = True
        for task in (self._feed_task, self._queue_task, self._refresh_task):
            if task is not None and not task.done():
                task.cancel()
