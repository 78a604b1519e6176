"""The server's lease: what it holds, what it waits for, and its heartbeats to the broker.

:class:`LeaseKeeper` is the extension's only caller of the broker (through
:class:`jupyter_gpulease.client.BrokerClient`, with the server's own token). It

* loads the lease the spawner started the server with (``GPULEASE_LEASE_ID``), retrying while
  the broker is away;
* asks for new leases (the user's request, a resuming kernel's) and follows a queued one until
  it is granted, confirming it (the server is up) and reporting its queue position meanwhile;
* extends and releases;
* sends heartbeats with usage every ``heartbeat_interval``, backing off while the broker is
  unreachable, and reports each reply: the lease's state and the broker's warnings.

Changes reach the extension through one callback, ``on_change(kind, lease)`` with ``kind`` one
of ``queued``, ``granted`` (a lease is active that was not before), ``updated`` (the same
active lease, e.g. extended) and ``ended``; and the broker's warnings through
``on_warnings(warnings, lease)``.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from ..client import BrokerClient, BrokerError, new_request_key
from ..core.request import SPAWNER_META
from ..tasks import BackgroundTasks

log = logging.getLogger(__name__)

LIVE = ("queued", "active")
Callback = Callable[[str, dict[str, Any] | None], Awaitable[None]]


def lease_gpus(lease: dict[str, Any] | None) -> list[str]:
    """Physical GPU UUIDs of the lease (for a MIG slice: its GPU)."""
    slices = ((lease or {}).get("placement") or {}).get("slices") or []
    return [s["gpu_uuid"] for s in slices]


def same_shape_request(lease: dict[str, Any]) -> dict[str, Any]:
    """A request body for a lease of the same shape, tier and length as ``lease``."""
    body = dict(lease.get("request") or {})
    body["tier"] = lease.get("tier")
    if lease.get("duration_s"):
        body["duration_s"] = lease["duration_s"]
    return {k: v for k, v in body.items() if v is not None}


class LeaseKeeper:
    """Holds this server's lease and talks to the broker about it."""

    def __init__(
        self,
        client: BrokerClient | None,
        *,
        lease_id: str = "",
        server_name: str = "",
        heartbeat_interval: float = 30.0,
        usage: Callable[[], dict[str, Any]] = dict,
        on_change: Callback | None = None,
        on_warnings: Callable[[list[dict[str, Any]], dict[str, Any]], Awaitable[None]] | None = None,
        clock: Callable[[], float] = time.time,
        retry_max_s: float = 30.0,
    ):
        self.client = client
        self.lease_id = lease_id
        self.server_name = server_name
        self.heartbeat_interval = heartbeat_interval
        self.usage = usage
        self.on_change = on_change
        self.on_warnings = on_warnings
        self.clock = clock
        self.retry_max_s = retry_max_s
        self.lease: dict[str, Any] | None = None  # live: active or queued
        self.ended: dict[str, Any] | None = None  # the last lease that ended
        self.origin = "spawner" if lease_id else ""  # who asked for the live lease: "spawner" or "server"
        self.warnings: list[dict[str, Any]] = []
        self.heartbeat: dict[str, Any] = {"interval_s": heartbeat_interval, "last_ok": None, "last_error": "", "failures": 0, "sent": 0}
        self.loaded = not lease_id  # False until the starting lease was read from the broker
        self._granted = asyncio.Event()
        self._tasks = BackgroundTasks(log)
        self._waiter: asyncio.Task | None = None
        self._stopping = False
        self._lock = asyncio.Lock()

    # ------------------------------------------------------------------ state
    @property
    def active(self) -> dict[str, Any] | None:
        return self.lease if self.lease and self.lease.get("state") == "active" else None

    @property
    def queued(self) -> dict[str, Any] | None:
        return self.lease if self.lease and self.lease.get("state") == "queued" else None

    def _spawn(self, coro) -> asyncio.Task:
        return self._tasks.start(coro)

    async def _emit(self, kind: str, lease: dict[str, Any] | None) -> None:
        if self.on_change is not None:
            try:
                await self.on_change(kind, lease)
            except Exception:  # a listener bug must not break the lease loop
                log.exception("GPU lease: handling %r failed", kind)

    async def _set(self, lease: dict[str, Any]) -> None:
        """Take a lease JSON from the broker as the current state of our lease."""
        old = self.lease
        state = lease.get("state")
        if state in LIVE:
            self.lease = lease
            self.lease_id = lease["id"]
            if state == "active":
                self._granted.set()
                fresh = not old or old.get("id") != lease["id"] or old.get("state") != "active"
                await self._emit("granted" if fresh else "updated", lease)
            else:
                self._granted.clear()
                await self._emit("queued", lease)
        else:
            if old is not None and old.get("id") != lease.get("id"):
                return  # an older lease ended: ours is another one
            self.lease = None
            self.ended = lease
            self._granted.clear()
            self.warnings = []
            await self._emit("ended", lease)

    # ------------------------------------------------------------------ start and stop
    async def start(self) -> None:
        if self.client is None:
            return
        if self.lease_id:
            self._spawn(self._load(self.lease_id))
        self._spawn(self._heartbeat_loop())

    async def _load(self, lease_id: str) -> None:
        delay = 1.0
        while not self._stopping:
            try:
                lease = await self.client.get_lease(lease_id)
            except BrokerError as e:
                if e.status in (403, 404):
                    log.warning("GPU lease %s cannot be read from the broker (%s); running without it", lease_id, e.message)
                    self.loaded = True
                    self.lease_id = ""
                    await self._emit("ended", {"id": lease_id, "state": "unknown", "end_reason": e.message})
                    return
                self.heartbeat["last_error"] = e.message
                await asyncio.sleep(delay)
                delay = min(self.retry_max_s, delay * 2)
                continue
            self.loaded = True
            await self._set(lease)
            if lease.get("state") == "queued":
                self._follow(lease["id"])
            return

    async def stop(self, *, release: bool = True) -> None:
        """Stop heartbeats; release the lease the server itself asked for (``release``)."""
        self._stopping = True
        await self._tasks.cancel()
        if release and self.client is not None and self.lease is not None and self.origin == "server":
            try:
                await self.client.release(self.lease["id"], reason="the server stopped")
            except BrokerError as e:
                log.warning("Could not release GPU lease %s on shutdown: %s", self.lease["id"], e.message)

    # ------------------------------------------------------------------ asking
    async def request(self, body: dict[str, Any]) -> dict[str, Any]:
        """Ask the broker for a lease for this server; follow it until granted. Raises BrokerError."""
        if self.client is None:
            raise BrokerError(409, "this server has no lease broker to ask (GPULEASE_BROKER_URL is not set)", "broker")
        async with self._lock:
            if self.lease is not None:
                raise BrokerError(409, f"this server already holds lease {self.lease['id']} ({self.lease['state']}): release it first", "lease")
            # marked as a lease spawner's: the hub ends it with the server, and the broker's check
            # with the hub ends it if the server is gone (a lease the server took for itself)
            meta = {**(body.get("meta") or {}), "spawner": SPAWNER_META, "taken_by": "server"}
            body = {**body, "server": self.server_name, "meta": meta}
            try:
                lease = await self.client.request_lease(body, key=new_request_key("server"))
            except BrokerError as e:
                if e.status == 400 and e.field in ("prefer_gpus", "require_gpus"):
                    # a broker without GPU preferences: ask for the shape alone (another create: its own key)
                    log.info("The broker does not take %s; asking without a GPU preference", e.field)
                    body = {k: v for k, v in body.items() if k not in ("prefer_gpus", "require_gpus")}
                    lease = await self.client.request_lease(body, key=new_request_key("server"))
                else:
                    raise
            self.origin = "server"
            await self._set(lease)
            if lease.get("state") == "active":
                self._spawn(self._confirm(lease["id"]))
            elif lease.get("state") == "queued":
                self._follow(lease["id"])
            return lease

    def _follow(self, lease_id: str) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.cancel()
        self._waiter = self._spawn(self._wait_for_grant(lease_id))

    async def _wait_for_grant(self, lease_id: str) -> None:
        since, delay = 0, 1.0
        while not self._stopping:
            try:
                got = await self.client.events(since=since, lease_id=lease_id, timeout=10)
                events = got.get("events") or []
                if events:
                    since = max(int(e.get("id", 0)) for e in events)
                lease = await self.client.get_lease(lease_id)
                delay = 1.0
            except BrokerError as e:
                if e.status in (403, 404):
                    await self._set({"id": lease_id, "state": "unknown", "end_reason": e.message})
                    return
                await asyncio.sleep(delay)
                delay = min(self.retry_max_s, delay * 2)
                continue
            if self.lease is None or self.lease.get("id") != lease_id:
                return  # released or replaced meanwhile
            await self._set(lease)
            if lease.get("state") == "active":
                await self._confirm(lease_id)
                return
            if lease.get("state") not in LIVE:
                return

    async def _confirm(self, lease_id: str) -> None:
        try:
            await self.client.confirm(lease_id)
        except BrokerError as e:
            log.warning("Could not confirm GPU lease %s: %s", lease_id, e.message)

    async def wait_active(self, timeout: float | None = None) -> dict[str, Any] | None:
        """The active lease once there is one (None after ``timeout`` s or when the wait ended)."""
        if self.active:
            return self.active
        try:
            await asyncio.wait_for(self._granted.wait(), timeout)
        except TimeoutError:
            return None
        return self.active

    async def extend(self, *, by_s: float | None = None, until: float | None = None) -> dict[str, Any]:
        lease = self._need_active()
        got = await self.client.extend(lease["id"], by_s=by_s, until=until)
        await self._set(got)
        return got

    async def release(self, *, state: str = "released", reason: str = "", keep_server: bool = True) -> dict[str, Any]:
        """End the live lease (a queued one is withdrawn). Raises BrokerError."""
        if self.client is None or self.lease is None:
            raise BrokerError(409, "this server holds no GPU lease", "lease")
        lease_id = self.lease["id"]
        kwargs: dict[str, Any] = {"reason": reason, "state": state if self.lease.get("state") == "active" else None}
        if "keep_server" in inspect.signature(self.client.release).parameters:
            kwargs["keep_server"] = keep_server
        try:
            got = await self.client.release(lease_id, **kwargs)
        except BrokerError as e:
            if e.status != 409:
                raise
            got = await self.client.get_lease(lease_id)  # it had ended already: take the broker's word for how
        if self._waiter is not None and not self._waiter.done():
            self._waiter.cancel()
        await self._set(got)
        return got

    def _need_active(self) -> dict[str, Any]:
        if self.client is None:
            raise BrokerError(409, "this server has no lease broker to ask (GPULEASE_BROKER_URL is not set)", "broker")
        if not self.active:
            raise BrokerError(409, "this server holds no active GPU lease", "lease")
        return self.active

    # ------------------------------------------------------------------ heartbeats
    async def _heartbeat_loop(self) -> None:
        delay = 0.0
        while not self._stopping:
            await asyncio.sleep(delay or self.heartbeat_interval)
            if not self.active:
                delay = 0.0
                continue
            ok = await self.send_heartbeat()
            if ok:
                delay = 0.0
            else:  # back off while the broker is away, but never wait longer than one interval
                delay = min(self.heartbeat_interval, max(1.0, (delay or 0.5) * 2))

    async def send_heartbeat(self) -> bool:
        """One heartbeat with the current usage; True when the broker answered it."""
        lease = self.active
        if lease is None or self.client is None:
            return False
        try:
            # retried for one interval at most: the loop tries again, and counts each miss
            reply = await self.client.heartbeat(lease["id"], self.usage(), retry_for=self.heartbeat_interval)
        except BrokerError as e:
            self.heartbeat["failures"] += 1
            self.heartbeat["last_error"] = e.message
            if e.status in (404, 409):  # it ended (or is gone): find out how
                try:
                    await self._set(await self.client.get_lease(lease["id"]))
                except BrokerError as e2:
                    if e2.status == 404:
                        await self._set({**lease, "state": "unknown", "end_reason": e2.message})
                return True
            if self.heartbeat["failures"] in (1, 10) or self.heartbeat["failures"] % 100 == 0:
                log.warning("GPU lease heartbeat failed (%d in a row): %s", self.heartbeat["failures"], e.message)
            return False
        if self.heartbeat["failures"]:
            log.info("GPU lease heartbeats reach the broker again after %d failure(s)", self.heartbeat["failures"])
        self.heartbeat.update(last_ok=self.clock(), last_error="", failures=0, sent=self.heartbeat["sent"] + 1)
        warnings = list(reply.pop("warnings", None) or [])
        if self.lease is not None and self.lease.get("id") == reply.get("id"):
            await self._set(reply)
        self.warnings = warnings
        if self.on_warnings is not None and reply.get("state") == "active":
            await self.on_warnings(warnings, reply)
        return True
