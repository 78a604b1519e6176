"""A ``cull_arbiter_hook`` for jupyterhub-idle-culler 2: GPU work keeps a server, an idle lease lets it go sooner.

The idle culler decides from the hub's ``last_activity`` alone. The server extension already
reports GPU work as activity, but activity reaches the hub only every few minutes; and a
server that holds a GPU lease nobody uses costs more than one that holds none. This hook asks
the lease broker (one listing per culling pass) and decides per server:

* its lease's last heartbeat says a kernel computes on the GPU, or did within
  ``busy_window_s``: keep it, however long the hub has seen no activity;
* it holds an active lease whose GPU is idle: cull it once inactive for ``gpu_idle_limit``
  seconds (shorter than the culler's ``--timeout``);
* no lease: the culler's own rule (inactive for its ``--timeout``).

In the idle culler's config (it runs as a hub service; its token needs the scopes
``custom:gpulease:admin`` and ``access:services!service=gpulease`` to list every lease)::

    from jupyter_gpulease.server.culler import GPUCullArbiter
    c.IdleCuller.cull_arbiter_hook = GPUCullArbiter(gpu_idle_limit=1800)

It imports nothing of jupyterhub and talks to the broker through the project's one client.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import os
import time
from collections.abc import Callable
from typing import Any

from ..client import BrokerClient, BrokerError, default_broker_url

log = logging.getLogger(__name__)


class GPUCullArbiter:
    """Callable as ``cull_arbiter(inactive=, inactive_limit=, server=)`` (jupyterhub-idle-culler 2)."""

    def __init__(
        self,
        *,
        gpu_idle_limit: float | None = None,
        busy_window_s: float = 600.0,
        broker_url: str | None = None,
        token: str | None = None,
        cache_s: float = 30.0,
        client: BrokerClient | None = None,
        clock: Callable[[], float] = time.time,
    ):
        """``gpu_idle_limit``: seconds of inactivity after which a server holding an idle GPU lease
        is culled (None: the culler's own limit). ``busy_window_s``: how recent GPU work must be
        to keep a server. The broker's URL and the token default to the culler's environment
        (``GPULEASE_BROKER_URL``, or the hub's; ``GPULEASE_TOKEN`` or ``JUPYTERHUB_API_TOKEN``)."""
        self.gpu_idle_limit = gpu_idle_limit
        self.busy_window_s = busy_window_s
        self.cache_s = cache_s
        self.clock = clock
        self._client = client
        self._url = broker_url
        self._token = token
        self._leases: dict[tuple[str, str], dict[str, Any]] = {}
        self._fetched_at = -1e18
        self._lock: asyncio.Lock | None = None

    @property
    def client(self) -> BrokerClient:
        if self._client is None:
            token = self._token or os.environ.get("GPULEASE_TOKEN") or os.environ.get("JUPYTERHUB_API_TOKEN", "")
            self._client = BrokerClient(self._url or default_broker_url(), token)
        return self._client

    async def _live_leases(self) -> dict[tuple[str, str], dict[str, Any]] | None:
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:  # one listing per culling pass, however many servers ask at once
            if self.clock() - self._fetched_at < self.cache_s:
                return self._leases
            try:
                leases = await self.client.list_leases(state="active")
            except BrokerError as e:
                log.warning("GPU cull arbiter: cannot list leases (%s); deciding by activity alone", e.message)
                return None
            self._leases = {(x["user"], x.get("server") or ""): x for x in leases}
            self._fetched_at = self.clock()
            return self._leases

    async def __call__(self, *, inactive: datetime.timedelta | None, inactive_limit: float, server: dict[str, Any], **kwargs: Any) -> bool:
        default = inactive is not None and inactive.total_seconds() >= inactive_limit
        user, _, name = (server.get("full_name") or "").partition("/")
        leases = await self._live_leases()
        if not user or leases is None:
            return default
        lease = leases.get((user, name))
        if lease is None:
            return default
        usage = lease.get("usage") or {}
        last = usage.get("last_gpu_activity")
        now = self.clock()
        if usage.get("gpu_busy") or (isinstance(last, (int, float)) and now - last < self.busy_window_s):
            log.info("GPU cull arbiter: keeping %s: its GPU is working", server.get("full_name"))
            return False
        limit = inactive_limit if self.gpu_idle_limit is None else min(self.gpu_idle_limit, inactive_limit)
        return inactive is not None and inactive.total_seconds() >= limit
