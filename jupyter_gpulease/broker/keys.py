"""Idempotency keys: a call sent again gets what the first one did.

A client whose answer was lost (its broker killed in the middle of the call, a hand-over to the
standby, a timeout) sends the same call again with the same ``Idempotency-Key`` header, and gets
the lease the first call made or changed instead of a second one. The key, scoped to the caller
(:func:`scoped_key`), is written with the first event the call caused, in the same transaction
(the events' ``request_key``): a key is durable exactly when what it did is, and a broker that
takes over finds it in the database. The broker that serves also keeps the keys it answered in
memory (:class:`RequestKeys`), so that it reads the database for a key only in its first
``window_s`` seconds: a retry comes within seconds, and keys of calls answered before the
broker started are older than its uptime after that.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Awaitable, Callable

KEY_CHARS = 64  # the longest key a client may send
STORED_CHARS = 80  # what the database's column holds


def scoped_key(caller: str, key: str) -> str:
    """``key`` as stored for ``caller`` (the same key of two callers are two keys): their names
    joined, or a digest of them where a long user name would not fit the column."""
    scoped = f"{caller}:{key}"
    if len(scoped) <= STORED_CHARS:
        return scoped
    return "sha256:" + hashlib.sha256(scoped.encode()).hexdigest()


class RequestKeys:
    """The idempotency keys a broker answered: ``find(key)`` reads the database (awaitable: a
    lease id or None) for keys it has not seen itself in its first ``window_s`` seconds (from
    :meth:`start`); ``now``: the broker's clock. At most ``max_keys`` are kept in memory."""

    def __init__(self, find: Callable[[str], Awaitable[str | None]], *, now: Callable[[], float], window_s: float = 900.0,
                 max_keys: int = 200_000):
        self._find = find
        self.now = now
        self.window_s = window_s
        self.max_keys = max_keys
        self.started_at = 0.0
        self._keys: OrderedDict[str, str] = OrderedDict()  # key -> lease id

    def start(self, now: float) -> None:
        """The broker starts serving at ``now``: keys before it are in the database."""
        self.started_at = now

    def remember(self, key: str | None, lease_id: str) -> None:
        """A call with ``key`` is about to change ``lease_id`` (before its commit: a retry that
        comes meanwhile waits for that commit instead of deciding again)."""
        if not key:
            return
        self._keys[key] = lease_id
        if len(self._keys) > self.max_keys:
            self._keys.popitem(last=False)

    async def find(self, key: str | None) -> str | None:
        """The lease an earlier call with ``key`` made or changed; None if none did."""
        if not key:
            return None
        lid = self._keys.get(key)
        if lid is None and self.now() - self.started_at < self.window_s:
            lid = await self._find(key)  # answered before this broker started?
            # a call with the same key may have decided while the database was read
            lid = self._keys.get(key) or lid
        return lid
