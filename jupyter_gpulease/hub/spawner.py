"""GPULeaseSpawner: lease GPUs from the broker before the server starts, and give them back.

:class:`GPULeaseSpawner` is a mixin over any JupyterHub spawner. Put it first in the bases::

    class GPULeaseLocalProcessSpawner(GPULeaseSpawner, LocalProcessSpawner): ...

Its ``start()`` asks the broker for a lease (acting for the user with a hub-side token that
has the ``custom:gpulease:admin`` scope), waits in the queue while ``progress()`` streams the
position and ETA to the spawn page, applies the granted placement and only then calls the
engine's ``start()``. Once the hub sees the server answer, the spawner *confirms* the lease
(the broker revokes a lease whose server never comes up). ``stop()``, a ``poll()`` that finds
the server gone, a cancelled or failed spawn all end the lease. The lease id lives in the
spawner state, so a restarted hub finds it again.

Every spawner of a hub process talks to the broker through one shared
:class:`~.link.BrokerLink`: one HTTP client sized for the hub, one subscription to the
broker's event feed (a lease end stops its server within about a second), one queue refresh
for all waiting spawns, and releases that retry until the broker has them. In a running hub
the spawner also takes part in the hub's start and shutdown (see :mod:`.lifecycle`).

The engine-specific part is :meth:`GPULeaseSpawner.apply_placement`: the default sets the
environment (``CUDA_VISIBLE_DEVICES`` by UUID and ``GPULEASE_*``, see :mod:`.placement`),
which is all a local process needs. Container engines override it to add their resource
requests and node selectors.
"""

from __future__ import annotations

import asyncio
import os
import time

from jupyterhub.spawner import LocalProcessSpawner, SimpleLocalProcessSpawner, Spawner
from tornado import web
from traitlets import default

from ..client import BrokerError
from ..core.request import SPAWNER_META
from ..core.text import format_duration
from . import form as spawn_form
from . import pages
from .link import BrokerLink, LeaseWatch
from .options import LeaseChoice, OptionsError, parse_presets, parse_user_options
from .placement import cpu_only_environment, describe_request, granted_message, lease_environment, queue_message
from .progress import LeaseProgress, _ProgressLog
from .spawner_devices import SpawnerDevices
from .spawner_end import LeaseEnding
from .spawner_settings import GPULeaseSettings, spawn_error


class GPULeaseSpawner(LeaseEnding, LeaseProgress, SpawnerDevices, GPULeaseSettings, Spawner):
    """Mixin: lease GPUs from the jupyter-gpulease broker around the engine's start and stop.

    Its parts: the settings (:mod:`.spawner_settings`), the progress feed (:mod:`.progress`),
    stop, poll and state (:mod:`.spawner_end`), device access (:mod:`.spawner_devices`); this
    class asks for the lease, waits for it, and starts the engine with its placement."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        from . import lifecycle

        lifecycle.attach_to_running_hub()  # once per hub process; a no-op outside a hub
        self._lease_pending = False
        self._stopping = False
        self._spawn_cancelled = False
        self._withdraw_reason = ""
        self._engine_start_timeout: int | None = None
        self._lease_env: dict[str, str] = {}
        self._watch: LeaseWatch | None = None
        self._progress: _ProgressLog | None = None
        self._progress_signal = asyncio.Event()
        self._link: BrokerLink | None = None
        self._checked_pool: dict | None = None
        self._spawn_pool: dict | None = None
        self._confirm_task: asyncio.Future | None = None
        self._orphan_task: asyncio.Future | None = None
        self._end_task: asyncio.Future | None = None
        self._handled_end = ""
        self.last_warning: dict | None = None

    # ------------------------------------------------------------------ the broker
    @property
    def link(self) -> BrokerLink:
        """The hub process's shared link to the broker."""
        if self._link is None:
            if not self.broker_url:
                raise spawn_error("GPU leases are not configured on this hub: the administrator must set "
                                  "c.GPULeaseSpawner.broker_url", reason="gpulease_config", status_code=500)
            self._link = BrokerLink.for_settings(
                self.broker_url,
                self.broker_api_token,
                timeout=self.broker_timeout,
                max_connections=self.broker_max_connections,
                queue_refresh_interval=self.queue_refresh_interval,
                logger=self.log,
                outbox_path=os.path.abspath(self.pending_ends_file) if self.pending_ends_file else "",
            )
        if self.user is not None:
            self._link.spawners.add(self)
        return self._link

    @property
    def broker(self):
        """The broker's client (:class:`~jupyter_gpulease.client.BrokerClient` methods)."""
        return self.link.client

    @property
    def presets(self):
        return parse_presets(self.lease_presets)

    def _user_groups(self) -> list[str]:
        try:
            return sorted(g.name for g in (getattr(self.user, "groups", None) or []))
        except (AttributeError, TypeError):  # a user object without groups (tests, odd authenticators)
            return []

    async def fetch_pool(self) -> dict:
        """The broker's pool as this user sees it (tiers they may use, their quota)."""
        return await self.broker.pool(user=self.user.name, groups=self._user_groups())

    def _background(self, coro) -> asyncio.Future:
        return self.link.background(coro)

    # ------------------------------------------------------------------ form and options
    @default("options_form")
    def _default_options_form(self):
        return _render_options_form

    @default("options_from_form")
    def _default_options_from_form(self):
        return spawn_form.options_from_form

    @default("apply_user_options")
    def _default_apply_user_options(self):
        # JupyterHub >= 5.3 calls this before start(): bad options fail at once, with their message
        return _check_user_options

    async def render_options_form(self) -> str:
        """The spawn form, from the broker's live pool, queue and estimates (see :mod:`.form`)."""
        orm_spawner = getattr(self, "orm_spawner", None)  # none in tests
        previous = dict((orm_spawner.user_options if orm_spawner is not None else self.user_options) or {})
        return await spawn_form.render_for(
            self.broker if self.broker_url else None,
            user=self.user.name,
            groups=self._user_groups(),
            presets=self.presets,
            allow_custom=self.allow_custom_request,
            allow_cpu_only=self.allow_cpu_only,
            previous=previous,
            log=self.log,
        )

    async def lease_status(self) -> dict:
        """What the hub's home page shows about this server's lease (see :mod:`.pages`): fresh from
        the broker when it answers within a few seconds, else the lease last seen."""
        lease = self.lease if self.lease_id else None
        if self.lease_id and self.broker_url:
            try:
                async with asyncio.timeout(3):
                    lease = self.lease = await self.broker.get_lease(self.lease_id)
            except (TimeoutError, BrokerError) as e:
                self.log.debug("Lease %s of %s for the home page: %s", self.lease_id, self._log_name, e)
        last_end = self.last_lease_end or None
        if not last_end and not self.lease_id and (self.lease or {}).get("state") not in (None, "active", "queued"):
            last_end = self.lease  # the ended lease poll() found
        stopping = bool(self._stopping or getattr(self, "_stop_pending", False))
        return pages.lease_status(lease=lease, last_end=last_end, server_active=self.active, server_ready=self.ready,
                                  cpu_only=not self.lease_id, broker_url=self.broker_url, warning=self.last_warning,
                                  server_stopping=stopping)

    def lease_choice(self, user_options: dict | None, pool: dict | None = None) -> LeaseChoice:
        """``user_options`` checked into what to ask the broker for; spawn failure with a message if bad."""
        try:
            return parse_user_options(
                user_options,
                presets=self.presets,
                allow_custom=self.allow_custom_request,
                allow_cpu_only=self.allow_cpu_only,
                default_options=self.default_user_options,
                pool=pool,
            )
        except OptionsError as e:
            raise spawn_error(f"Invalid GPU options: {e.message}", reason="gpulease_options") from None

    # ------------------------------------------------------------------ start
    @property
    def ready(self):
        # A spawn cancelled in the queue leaves the hub's server record behind for a moment
        # (until the hub's stop runs): never report it as a ready server.
        if self._spawn_cancelled:
            return False
        return super().ready

    def run_pre_spawn_hook(self):
        # The hub wraps start() in asyncio.wait_for(start_timeout); start() includes the queue
        # wait, so stretch the limit by the wait allowed. The engine gets its own value back
        # before its start() (KubeSpawner reads start_timeout while it waits for its pod).
        if self._engine_start_timeout is None:
            self._engine_start_timeout = self.start_timeout
        self.start_timeout = int(self._engine_start_timeout + self.lease_wait_timeout + 2 * self.broker_timeout)
        return super().run_pre_spawn_hook()

    def _restore_start_timeout(self) -> None:
        if self._engine_start_timeout is not None:
            self.start_timeout = self._engine_start_timeout
            self._engine_start_timeout = None

    async def start(self):
        self._new_progress()
        self._lease_env = {}
        self.lease_id = ""
        self.lease = None
        self._spawn_cancelled = False
        self._withdraw_reason = ""
        self._handled_end = ""
        self._lease_pending = True  # until start() returns, poll() says "starting"
        try:
            return await self._start_with_lease()
        except asyncio.CancelledError:
            self._spawn_cancelled = True
            self.emit_progress("Spawn cancelled; the GPU request is given back", 100)
            raise
        finally:
            self._restore_start_timeout()
            self._lease_pending = False
            self._finish_lease_progress()

    async def _start_with_lease(self):
        server_broker_url = self.server_broker_url or self.broker_url
        # cheap local checks first: a bad option fails at once, without the broker
        choice = self.lease_choice(self.user_options)
        self._device_guard()  # enforcement required but impossible: fail before asking for anything
        if choice.cpu_only:
            self._lease_env = cpu_only_environment(broker_url=server_broker_url)
            if self.broker_url:
                # a GPU lease an earlier stop could not release would otherwise stay with this
                # server (the hub's check sees the server running): end it, without delaying the spawn
                self._orphan_task = self._background(self._withdraw_orphans())
            self.emit_progress("No GPU for this server (CPU only)", 40)
            self._finish_lease_progress(engine_starts=True)
            self._restore_start_timeout()
            return await self._start_engine()

        client = self.broker
        pool, self._checked_pool = self._checked_pool, None  # fetched by the options check just before
        try:
            if pool is None:
                pool, _ = await asyncio.gather(self.fetch_pool(), self._withdraw_orphans())
            else:
                await self._withdraw_orphans()
        except BrokerError as e:
            raise self._broker_failure(e, "ask for a GPU lease") from None
        choice = self.lease_choice(self.user_options, pool)
        body = choice.broker_body(
            user=self.user.name,
            server=self.name or "",
            groups=self._user_groups(),
            # on_end: what this hub does to the server when the lease ends (the admin page says it)
            meta={"spawner": SPAWNER_META, "preset": choice.preset, "on_end": self.on_lease_end, **self.lease_meta},
            max_wait_s=self.lease_wait_timeout,
        )
        wait_limit = body.get("max_wait_s", self.lease_wait_timeout)
        what = choice.label if choice.preset else describe_request(choice.request, pool)
        self.emit_progress(f"Asking for {what}", 5)
        request = asyncio.ensure_future(client.request_lease(body))
        try:
            lease = await asyncio.shield(request)
        except BrokerError as e:
            raise self._broker_failure(e, "ask for a GPU lease") from None
        except asyncio.CancelledError:
            # cancelled while the broker answered: the lease exists (or soon will), so withdraw
            # it once it does, in the background: the hub waits only a second for a cancel
            self._background(self._withdraw_when_created(request))
            raise
        lease_id = self.lease_id = lease["id"]
        self.lease = lease
        try:
            lease = await self._wait_for_grant(lease, pool, time.monotonic() + wait_limit, wait_limit)
            self.lease = lease
            self._spawn_pool = pool
            self.apply_placement(lease)
            self.emit_progress(granted_message(lease), 45, lease_id=lease["id"], state="active",
                               expires_at=lease.get("expires_at"))
            self._finish_lease_progress(engine_starts=True)
            self._restore_start_timeout()
            url = await self._start_engine()
        except BaseException as e:  # cancelled (the user pressed cancel), failed, timed out, withdrawn
            ended = self._watch.lease if self._watch is not None and not self._watch.live else None
            self._unfollow()
            if isinstance(e, asyncio.CancelledError):
                why = "spawn cancelled"
                self._end_lease(lease_id, why)
            else:
                why = self._withdraw_reason or f"spawn failed: {getattr(e, 'jupyterhub_message', None) or e}"
                await self._end_lease_briefly(lease_id, why)
            self._remember_end(ended or {"id": lease_id, "state": "withdrawn", "end_reason": why,
                                         "end_message": self._withdraw_reason})
            raise
        # confirm once the hub sees the server answer: the broker revokes a lease whose server
        # never comes up, and the hub goes on waiting for the server meanwhile
        self._confirm_task = self._background(self._confirm_when_up(lease_id))
        self._follow(lease_id, lease)
        return url

    async def _withdraw_when_created(self, request: asyncio.Future) -> None:
        try:
            lease = await request
        except (BrokerError, asyncio.CancelledError):
            return  # refused or unreachable: nothing was queued
        self._end_lease(lease["id"], "spawn cancelled")

    async def _confirm_when_up(self, lease_id: str) -> None:
        """Confirm the lease once the server is up (the hub marks it ready), with retries."""
        limit = time.monotonic() + max(60.0, float(self.start_timeout) + float(getattr(self, "http_timeout", 30)) + 60)
        while not self.ready:
            if self.lease_id != lease_id or time.monotonic() > limit:
                return  # stopped or failed before it came up
            await asyncio.sleep(0.2)
        await self._confirm(lease_id)

    async def _confirm(self, lease_id: str, tries: int = 5) -> None:
        from ..client import Backoff

        delays = Backoff(first=1.0, cap=10.0).delays()
        for attempt in range(tries):
            if self.lease_id != lease_id:
                return
            try:
                self.lease = await self.broker.confirm(lease_id)
                if self._watch is not None and self._watch.lease_id == lease_id:
                    self._watch.update(self.lease)
                return
            except BrokerError as e:
                if e.status not in (0, 429) and e.status < 500:
                    self.log.warning("Could not confirm lease %s of %s: %s", lease_id, self._log_name, e)
                    return
                if attempt == tries - 1:
                    self.log.warning("Could not confirm lease %s of %s yet: %s; the next poll tries again", lease_id, self._log_name, e)
                    return
            except Exception:
                self.log.exception("Could not confirm lease %s of %s", lease_id, self._log_name)
                return
            await asyncio.sleep(next(delays))

    async def _wait_for_grant(self, lease: dict, pool: dict | None, deadline: float, wait_limit: float) -> dict:
        lease_id = lease["id"]
        watch = self._follow(lease_id, lease)
        gives_up_at = time.time() + (deadline - time.monotonic())
        while True:
            if self._withdraw_reason:
                raise spawn_error(self._withdraw_reason, reason="gpulease_withdrawn", status_code=503)
            lease = watch.lease
            state = watch.state
            if state == "active" and lease.get("placement"):
                return lease
            if state not in ("queued", "active"):
                why = lease.get("end_reason") or state
                raise spawn_error(f"The GPU lease {lease_id} ended before it was granted ({why}). Start again, "
                                  "perhaps with a smaller request or a longer wait.", reason="gpulease_not_granted")
            if state == "queued":
                q = lease.get("queue") or {}
                self.emit_progress(queue_message(lease, pool, gives_up_at=gives_up_at), _queue_progress(q), lease_id=lease_id,
                                   state="queued", position=q.get("position"), length=q.get("length"), eta=q.get("eta"),
                                   may_start_sooner_at=q.get("may_start_sooner_at"), waiting_for=q.get("waiting_for"))
            left = deadline - time.monotonic()
            if left <= 0:
                raise spawn_error(f"No GPU became free within {format_duration(wait_limit)}, so the spawn gave up and left "
                                  "the queue. Try a smaller request (a share, another model) or try later.",
                                  reason="gpulease_wait_timeout")
            changed = await watch.changed(timeout=min(self.queue_refresh_interval, left))
            if not changed and not self.link.connected:
                # the broker's feed is away: ask for the lease itself
                got = await self.link.get_lease(lease_id)
                if got is None:
                    self.emit_progress("The GPU lease broker is not answering; still waiting in the queue", None)

    def _broker_failure(self, e: BrokerError, doing: str) -> web.HTTPError:
        config_problem = self._link.user_message() if self._link is not None else ""
        if e.status == 0 or e.status >= 500:
            if config_problem:
                return spawn_error(config_problem, reason="gpulease_config", status_code=503)
            return spawn_error(f"Could not {doing}: the GPU lease broker is not answering ({e.message}). "
                               "Try again in a few minutes, or choose a CPU-only server; if it lasts, tell the "
                               "administrator.", reason="gpulease_unavailable", status_code=503)
        if e.status in (301, 302, 303, 307, 401) or (e.status == 403 and "may not use this service" in e.message):
            return spawn_error(config_problem or "GPU leases do not work on this hub right now because of a configuration "
                               "problem (the hub's token for the lease broker was refused); the administrator finds "
                               "the details in the hub's log. Choose a CPU-only server meanwhile.",
                               reason="gpulease_config", status_code=500)
        return spawn_error(f"The GPU lease was refused: {e.message}", reason="gpulease_refused",
                           status_code=403 if e.status == 403 else 400)

    async def _withdraw_orphans(self, reason: str = "left behind by an earlier spawn", *, keep: str = "") -> None:
        """End the live leases bound to this server (``meta.spawner`` is jupyter-gpulease: the
        spawner's own and those the server took itself, e.g. ``%gpu request`` or a resumed
        kernel) except ``keep``: at a start, what a hub that died mid-spawn left; at a stop,
        what the server itself held. When the broker cannot list them now, the hub's outbox
        keeps the order until it can (see :mod:`.outbox`)."""
        await self.link.end_server_leases(self.user.name, self.name or "", reason,
                                          keep=tuple(k for k in (self.lease_id, keep) if k),
                                          wait=min(3.0, self.broker_timeout))

    def withdraw_for_shutdown(self, message: str) -> bool:
        """The hub is shutting down: a spawn waiting in the queue gives up at once, telling the
        user ``message``, and its lease is withdrawn. True when this spawn was waiting."""
        w = self._watch
        if not self._lease_pending or w is None or w.state != "queued":
            return False
        self._withdraw_reason = message
        w._fire()
        return True

    # ------------------------------------------------------------------ placement (engine part)
    def apply_placement(self, lease: dict) -> None:
        """Make the engine give the server the leased devices. Local processes: the environment.

        Container engines override this (and call super()) to add resource requests, node
        selectors or device mounts for ``lease["placement"]``.
        """
        pool = self._spawn_pool or {}  # the broker's pool as read for this spawn: each GPU's memory
        memory = {d.get("uuid"): int(d.get("memory_mib") or 0) for d in pool.get("devices") or [] if d.get("uuid")}
        self._lease_env = lease_environment(lease, broker_url=self.server_broker_url or self.broker_url,
                                            gpu_memory_mib=memory, cuda_mps=self.cuda_mps)

    def get_env(self):
        env = super().get_env()
        env.update(self._lease_env)
        return env



def _queue_progress(q: dict) -> int:
    """Progress of a queued lease: 10 at the back of a long queue, up to 40 at its head."""
    pos, length = q.get("position") or 1, q.get("length") or 1
    return int(10 + 30 * (1 - (pos - 1) / max(length, 1)))


async def _check_user_options(spawner: GPULeaseSpawner, user_options: dict) -> None:
    """Check the options against the live pool before start(), so the REST API answers at once."""
    choice = spawner.lease_choice(user_options)
    if choice.cpu_only:
        return
    try:
        pool = await spawner.fetch_pool()
    except (BrokerError, web.HTTPError):
        return  # start() reports the broker's trouble
    spawner.lease_choice(user_options, pool)
    spawner._checked_pool = pool  # start() runs right after: no second fetch


async def _render_options_form(spawner: GPULeaseSpawner) -> str:
    return await spawner.render_options_form()


class GPULeaseLocalProcessSpawner(GPULeaseSpawner, LocalProcessSpawner):
    """Local processes as system users, with GPU leases (entry point ``gpulease-local``)."""

    enforces_devices = True


class GPULeaseSimpleLocalProcessSpawner(GPULeaseSpawner, SimpleLocalProcessSpawner):
    """Local processes without system users, for demos and tests (entry point ``gpulease-simple``).

    Like JupyterHub's SimpleLocalProcessSpawner: no isolation between users; never in production.
    """

    enforces_devices = True


def _attach_when_loaded_by_hub() -> None:
    """Loaded into a JupyterHub process: take part in the hub's start and shutdown
    (:func:`.lifecycle.attach_to_running_hub`). JupyterHub has no start hook for a spawner: it
    imports every spawner entry point while it constructs its app (for ``--help-all``), before
    its instance and its event loop exist, and at start makes spawners only for servers that
    run. So the hub's ``init_spawners`` step (run once, at start, on its loop) gets a first action
    that attaches when the hub's spawner class is a lease spawner; the class carries a marker so
    this happens once. Anywhere else nothing happens (the first lease spawner a hub makes
    attaches too, as a second way in)."""
    import sys

    app_module = sys.modules.get("jupyterhub.app")
    if app_module is None:
        return
    hub_class = app_module.JupyterHub
    if getattr(hub_class, "gpulease_start_hook", False):
        return
    init_spawners = hub_class.init_spawners

    async def init_spawners_with_leases(self, *args, **kwargs):
        from . import lifecycle

        lifecycle.attach_to_running_hub()
        return await init_spawners(self, *args, **kwargs)

    hub_class.init_spawners = init_spawners_with_leases
    hub_class.gpulease_start_hook = True


_attach_when_loaded_by_hub()
