"""A ``cull_arbiter_hook`` for jupyterhub-idle-culler 2: GPU work keeps a server, an idle lease lets it go sooner.

The idle culler decides from the hub's ``last_activity`` alone. The server extension already
reports GPU work as activity, but activity reaches the hub only every few minutes; and a
server that holds a GPU lease nobody uses costs more than one that holds none. This hook asks
the lease broker (one listing per culling pass) and decides per server:

* its lease's last heartbeat says a kernel computes on the GPU, or did within
  ``busy_window_s``: keep it, however long the hub has seen no activity;
* it holds an active lease whose GPU is idle: cull it once inactive for ``gpu_idle_limit``
  seconds (shorter than the culler's ``--timeout``);
* no lease, or a lease whose server has sent no usage yet: the culler's own rule (inactive
  for its ``--timeout``).

Before the culler stops a server that holds a lease, the hook releases the lease itself, with
a reason that says it was culled and why (the spawner's own release when the server stops then
finds it ended). Its decisions that differ from the culler's rule go to the culler's log at
its default level, once per server until they change.

It finds the broker through the Hub API (``GET /hub/api/services/gpulease``: the service's
``url`` and ``prefix``), so the culler needs no setting of its own; ``GPULEASE_BROKER_URL``
overrides. The culler's role needs, besides the culler's own scopes, ``read:services!service=gpulease``,
``access:services!service=gpulease`` and ``custom:gpulease:admin``; a missing one, or a broker
it cannot reach, is logged once with what to fix, and the culler decides by activity alone
meanwhile. In the idle culler's config file (README, "The idle culler")::

    from jupyter_gpulease.culler import GPUCullArbiter
    c.IdleCuller.cull_arbiter_hook = GPUCullArbiter(gpu_idle_limit=1800)

It runs in the culler's process, not in a Jupyter server: it imports nothing of jupyterhub, of
the culler or of the server extension, and talks to the broker through the project's one
client. How long a lease's GPU has been idle is the broker metrics' own measure
(:func:`~jupyter_gpulease.core.lease.lease_idle_s`: from the server's heartbeats, clock skew
between the server and the broker taken out); durations read as everywhere else
(:func:`~jupyter_gpulease.core.text.format_duration`).
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import os
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import quote

from .client import NO_RETRY, SERVICE_NAME, BrokerClient, BrokerError, fetch_json, join_url
from .core.lease import lease_idle_s
from .core.text import format_duration

log = logging.getLogger(__name__)

# the culler's own scopes (jupyterhub-idle-culler's README), then the hook's
CULLER_SCOPES = ("list:users", "read:users:activity", "read:servers", "delete:servers")
HOOK_SCOPES = (f"read:services!service={SERVICE_NAME}", f"access:services!service={SERVICE_NAME}", "custom:gpulease:admin")
CULLER_ROLE_SCOPES = CULLER_SCOPES + HOOK_SCOPES


def _held(scope: str, scopes: set[str]) -> bool:
    """Whether ``scopes`` (a token's expanded scopes) grant ``scope`` (maybe filtered to our service)."""
    return scope in scopes or scope.split("!", 1)[0] in scopes


class GPUCullArbiter:
    """Callable as ``cull_arbiter(inactive=, inactive_limit=, server=)`` (jupyterhub-idle-culler 2)."""

    def __init__(
        self,
        *,
        gpu_idle_limit: float | None = None,
        busy_window_s: float = 600.0,
        broker_url: str | None = None,
        token: str | None = None,
        hub_api_url: str | None = None,
        cache_s: float = 30.0,
        release_on_cull: bool = True,
        client: BrokerClient | None = None,
        logger: logging.Logger | None = None,
        clock: Callable[[], float] = time.time,
    ):
        """``gpu_idle_limit``: seconds of inactivity after which a server holding an idle GPU lease
        is culled (None: the culler's own limit). ``busy_window_s``: how recent GPU work must be
        to keep a server. ``release_on_cull``: release a culled server's lease with a reason that
        says so before the culler stops the server. The broker's URL: ``broker_url``, else
        ``GPULEASE_BROKER_URL``, else asked of the hub (``hub_api_url``, default the culler's
        ``JUPYTERHUB_API_URL``). The token: ``GPULEASE_TOKEN`` or the culler's ``JUPYTERHUB_API_TOKEN``.
        ``logger``: default the culler's own log (its level and format)."""
        self.gpu_idle_limit = gpu_idle_limit
        self.busy_window_s = busy_window_s
        self.cache_s = cache_s
        self.release_on_cull = release_on_cull
        self.clock = clock
        self._client = client
        self._url = broker_url
        self._token = token
        self._hub_api_url = hub_api_url
        self._logger = logger
        self._leases: dict[tuple[str, str], dict[str, Any]] | None = {}  # None: the broker could not say
        self._fetched_at = -1e18
        self._lock: asyncio.Lock | None = None
        self._problem: str | None = None  # what the log last said was wrong ("" once it works)
        self._said: dict[str, str] = {}  # server -> the decision last logged for it

    # ------------------------------------------------------------------ where things are
    @property
    def log(self) -> logging.Logger | logging.LoggerAdapter:
        """The culler's own logger when the hook runs inside jupyterhub-idle-culler, else this module's."""
        if self._logger is None:
            app = self._culler_app()
            self._logger = getattr(app, "log", None) or log
        return self._logger

    @staticmethod
    def _culler_app() -> Any:
        try:
            from traitlets.config import Application
        except ImportError:  # pragma: no cover - traitlets comes with jupyter_server
            return None
        if not Application.initialized():
            return None
        app = Application.instance()
        return app if hasattr(app, "cull_arbiter_hook") else None

    @property
    def token(self) -> str:
        return self._token or os.environ.get("GPULEASE_TOKEN") or os.environ.get("JUPYTERHUB_API_TOKEN", "")

    @property
    def hub_api_url(self) -> str:
        app = self._culler_app()
        return self._hub_api_url or getattr(app, "url", None) or os.environ.get("JUPYTERHUB_API_URL", "")

    def _say_problem(self, problem: str) -> None:
        """Log what is wrong and what to fix, once (again only when it changes)."""
        if problem != self._problem:
            self._problem = problem
            self.log.error("GPU cull arbiter: %s; until then the culler decides by activity alone", problem)

    def _say_ok(self, url: str) -> None:
        if self._problem != "":
            self._problem = ""
            self.log.info("GPU cull arbiter: deciding with the GPU leases of the broker at %s", url)

    async def _hub(self, path: str) -> tuple[int, Any]:
        """GET ``path`` of the Hub API with the culler's token: (status, JSON); status 0 when unreachable."""
        try:
            status, data, _ = await fetch_json("GET", join_url(self.hub_api_url, path), token=self.token, timeout=20,
                                               backoff=NO_RETRY, what="the hub")
        except BrokerError as e:
            return e.status, e.message
        return status, data

    async def _connect(self) -> BrokerClient | None:
        """The broker's client, once the hub said where the broker is and that the token may use it; None (logged) when not."""
        if self._client is not None:
            return self._client
        api = self.hub_api_url
        url = self._url or os.environ.get("GPULEASE_BROKER_URL", "")
        if not self.token:
            self._say_problem("no token: run the culler as a JupyterHub service (it gets JUPYTERHUB_API_TOKEN) or set GPULEASE_TOKEN")
            return None
        if not url:
            if not api:
                self._say_problem("JUPYTERHUB_API_URL is not set, so the broker cannot be found: run the culler as a JupyterHub "
                                  "service, or set GPULEASE_BROKER_URL to the broker's URL (…/services/gpulease/)")
                return None
            status, model = await self._hub(f"services/{quote(SERVICE_NAME)}")
            if status in (401, 403) or (status == 200 and isinstance(model, dict) and "url" not in model):
                self._say_problem(f"the hub does not show the service {SERVICE_NAME!r} to the culler ({status}): add the scope "
                                  f"read:services!service={SERVICE_NAME} to the culler's role (README, \"The idle culler\"), "
                                  "or set GPULEASE_BROKER_URL")
                return None
            if status == 404:
                self._say_problem(f"the hub at {api} has no service named {SERVICE_NAME!r}: run the lease broker as that service, "
                                  "or set GPULEASE_BROKER_URL")
                return None
            if status != 200 or not isinstance(model, dict):
                self._say_problem(f"cannot ask the hub at {api} where the broker is ({status}: {model})")
                return None
            if not model.get("url"):
                self._say_problem(f"the hub's service {SERVICE_NAME!r} has no url: set GPULEASE_BROKER_URL to the broker's URL")
                return None
            url = join_url(model["url"], model.get("prefix") or f"/services/{SERVICE_NAME}/")
        if api:
            # what the token may do: without the admin scope the broker lists no one's leases
            status, me = await self._hub("user")
            if status == 200 and isinstance(me, dict) and isinstance(me.get("scopes"), list):
                scopes = set(me["scopes"])
                missing = [s for s in HOOK_SCOPES if not _held(s, scopes)]
                if self._url or os.environ.get("GPULEASE_BROKER_URL"):
                    missing = [s for s in missing if not s.startswith("read:services")]
                if missing:
                    self._say_problem(f"the token of {me.get('kind', 'service')} {me.get('name')!r} lacks {', '.join(missing)}: "
                                      "add them to the culler's role (README, \"The idle culler\")")
                    return None
                lacking = [s for s in CULLER_SCOPES if not _held(s, scopes)]
                if lacking:  # the culler's own; it says so itself when it fails, but not which
                    self.log.warning("GPU cull arbiter: the culler's token lacks %s, which the culler itself needs", ", ".join(lacking))
        # a broker that is away costs the pass a few seconds, not the client's usual half minute
        self._client = BrokerClient(url, self.token, timeout=20, retry_for=5)
        return self._client

    @property
    def client(self) -> BrokerClient:
        """The broker's client (after the first pass found the broker)."""
        if self._client is None:
            raise RuntimeError("the broker is not known yet (see the culler's log)")
        return self._client

    # ------------------------------------------------------------------ one pass
    async def _live_leases(self) -> dict[tuple[str, str], dict[str, Any]] | None:
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:  # one listing per culling pass, however many servers ask at once
            if self.clock() - self._fetched_at < self._cache_for():
                return self._leases
            self._leases = await self._list()
            self._fetched_at = self.clock()  # a failure too: the pass's other servers do not try again
            if self._leases is not None:  # forget what was said of servers whose leases ended
                self._said = {who: d for who, d in self._said.items() if tuple(who.partition("/")[::2]) in self._leases}
            return self._leases

    async def _list(self) -> dict[tuple[str, str], dict[str, Any]] | None:
        client = await self._connect()
        if client is None:
            return None
        try:
            leases = await client.list_leases(state="active")
        except BrokerError as e:
            fix = ""
            if e.status == 403:
                fix = " (add custom:gpulease:admin and access:services!service=gpulease to the culler's role)"
            elif e.status in (0, 400):
                fix = " (is the broker running? GPULEASE_BROKER_URL, when set, must be its URL, ending in /services/gpulease/)"
            self._say_problem(f"cannot list leases at {client.url}: {e.message}{fix}")
            return None
        self._say_ok(client.url)
        return {(x["user"], x.get("server") or ""): x for x in leases}

    def _cache_for(self) -> float:
        """How long one listing serves: ``cache_s``, at most half the culler's --cull-every (one listing per pass)."""
        every = getattr(self._culler_app(), "cull_every", 0) or 0
        return min(self.cache_s, every / 2) if every > 0 else self.cache_s

    def _will_act(self, name: str) -> bool:
        """Whether the culler acts on a server of this kind (its --cull-default-servers / --cull-named-servers)."""
        app = self._culler_app()
        return bool(getattr(app, "cull_named_servers" if name else "cull_default_servers", True))

    def _say(self, who: str, decision: str, message: str, *args: Any) -> None:
        """Log a decision that differs from the culler's rule, once until it changes."""
        if self._said.get(who) != decision:
            self._said[who] = decision
            self.log.info("GPU cull arbiter: " + message, *args)

    async def __call__(self, *, inactive: datetime.timedelta | None, inactive_limit: float, server: dict[str, Any], **kwargs: Any) -> bool:
        default = inactive is not None and inactive.total_seconds() >= inactive_limit
        who = server.get("full_name") or ""
        user, _, name = who.partition("/")
        leases = await self._live_leases()
        if not user or leases is None:
            return default
        lease = leases.get((user, name))
        if lease is None:
            self._said.pop(who, None)
            return default
        usage = lease.get("usage") or {}
        last = usage.get("last_gpu_activity")
        worked = isinstance(last, (int, float)) and not isinstance(last, bool)  # some GPU work since the grant
        gpu_idle_s = lease_idle_s(lease, self.clock())  # None before the first heartbeat
        idle_s = inactive.total_seconds() if inactive is not None else 0.0
        if usage.get("gpu_busy") or (worked and gpu_idle_s is not None and gpu_idle_s < self.busy_window_s):
            if default:
                work = "working now" if usage.get("gpu_busy") else f"worked {format_duration(gpu_idle_s)} ago"
                self._say(who, "keep", "keeping %s: its GPU is %s (lease %s), though the hub has seen no activity for %s (the culler's limit: %s)",
                          who, work, lease.get("id"), format_duration(idle_s), format_duration(inactive_limit))
            else:
                self._said.pop(who, None)
            return False
        self._said.pop(who, None)
        if usage:
            limit = inactive_limit if self.gpu_idle_limit is None else min(self.gpu_idle_limit, inactive_limit)
            cull = inactive is not None and idle_s >= limit
            gpu = (f"its GPU idle (last GPU work {format_duration(gpu_idle_s)} ago)" if worked and gpu_idle_s is not None
                   else "its GPU idle (no GPU work since the lease began)")
        else:  # no heartbeat yet: nothing says that its GPU is idle
            cull, gpu = default, ""
        if not cull or not self._will_act(name):
            return cull
        reason = f"culled by the idle culler: no activity for {format_duration(idle_s)}" + (f" and {gpu}" if gpu else "")
        released = await self._release(who, (user, name), lease, reason) if self.release_on_cull else False
        done = f"; released its lease {lease.get('id')}" if released else ""
        if not default:
            self.log.info("GPU cull arbiter: culling %s early: no activity for %s (the culler's limit: %s) and %s%s",
                          who, format_duration(idle_s), format_duration(inactive_limit), gpu, done)
        elif released:
            self.log.info("GPU cull arbiter: released lease %s of %s (%s)", lease.get("id"), who, reason)
        return True

    async def _release(self, who: str, key: tuple[str, str], lease: dict[str, Any], reason: str) -> bool:
        """End the lease with ``reason`` before the culler stops the server (which then stops as
        the culler asks, not because its lease ended: keep_server). False when it had ended already or could not be ended."""
        lease_id = lease.get("id")
        if not lease_id:
            return False
        try:
            await self.client.release(lease_id, reason=reason, state="released", keep_server=True)
        except BrokerError as e:
            if e.status not in (404, 409):  # unknown or ended already: nothing to end
                self.log.warning("GPU cull arbiter: could not release lease %s of %s (%s); the spawner releases it when the server stops",
                                 lease_id, who, e.message)
            return False
        if self._leases is not None:
            self._leases.pop(key, None)
        return True
