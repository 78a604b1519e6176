"""GPULeaseSpawner: lease GPUs from the broker before the server starts, and give them back.

:class:`GPULeaseSpawner` goes over any JupyterHub spawner (the engine). Put it first in the bases::

    class GPULeaseLocalProcessSpawner(GPULeaseSpawner, LocalProcessSpawner): ...

Its ``start()`` asks the broker for a lease (acting for the user with a hub-side token that
has the ``custom:gpulease:admin`` scope), waits in the queue while ``progress()`` streams the
position and ETA to the spawn page, applies the granted placement and only then calls the
engine's ``start()``. Once the hub sees the server answer, the spawner *confirms* the lease
(the broker revokes a lease whose server never comes up). ``stop()``, a ``poll()`` that finds
the server gone, a cancelled or failed spawn all end the lease; a lease that ends while the
server runs stops the server through the hub's own path (``poll()``), or leaves it running
without the lease where the settings say so. The lease id lives in the spawner state, so a
restarted hub finds it again.

Every spawner of a hub process talks to the broker through one shared
:class:`~.link.BrokerLink`: one HTTP client sized for the hub, one subscription to the
broker's event feed (a lease end stops its server within about a second), one queue refresh
for all waiting spawns, and releases that retry until the broker has them. In a running hub
the spawner also takes part in the hub's start and shutdown (see :mod:`.lifecycle`).

The spawner is one class; what it delegates are small objects it holds: the spawn page's
progress (:class:`~.progress.SpawnProgress`) and, for engines that lock each server to its
leases' devices, the server's door to the hub's device guard
(:class:`~.cgroups.ServerDevices`). Its settings are declared in
:class:`~.spawner_settings.GPULeaseSettings`.

The engine-specific part is :meth:`GPULeaseSpawner.apply_placement`: the default sets the
environment (``CUDA_VISIBLE_DEVICES`` by UUID and ``GPULEASE_*``, see :mod:`.placement`),
which is all a local process needs. Container engines override it to add their resource
requests and node selectors, and :meth:`GPULeaseSpawner.before_engine_start` to make what
the server's start needs.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

from jupyterhub.spawner import LocalProcessSpawner, SimpleLocalProcessSpawner, Spawner
from tornado import web
from traitlets import Any as AnyTrait
from traitlets import Dict, Unicode, default

from ..client import Backoff, BrokerError, new_request_key
from ..core.request import SPAWNER_META
from ..core.text import format_duration
from . import form as spawn_form
from . import pages
from .cgroups import DeviceAccessError, DeviceGuard, DeviceStart, Mechanism, ServerDevices
from .link import BrokerLink, LeaseWatch, ended_by_holder, moved_off_its_gpu
from .options import LeaseChoice, OptionsError, parse_presets, parse_user_options
from .placement import cpu_only_environment, describe_request, granted_message, lease_environment, queue_message
from .progress import SpawnProgress
from .spawner_settings import GPULeaseSettings

try:  # JupyterHub >= 6
    from jupyterhub.spawner import SpawnException
except ImportError:  # pragma: no cover - JupyterHub 5
    SpawnException = None

STATE_KEY = "gpulease"
STATE_VERSION = 1
ACTIVE_STATES = ("queued", "active")


def spawn_error(message: str, *, reason: str, status_code: int = 400) -> web.HTTPError:
    """A spawn failure whose message the user reads on the spawn page and in the REST API."""
    if SpawnException is not None:
        e = SpawnException(message, reason=reason, status_code=status_code)
        # the spawn page shows str(e) ("400 SpawnException(reason=…): …") unless this is set
        e.jupyterhub_message = message
        return e
    e = web.HTTPError(status_code, "%s", message)  # pragma: no cover - JupyterHub 5
    e.jupyterhub_message = message
    return e


class GPULeaseSpawner(GPULeaseSettings, Spawner):
    """Lease GPUs from the jupyter-gpulease broker around the engine's start and stop.

    It asks for the lease, waits for it, starts the engine with its placement, follows the lease
    while the server runs, and ends it with the server. It holds the spawn page's progress
    (:class:`~.progress.SpawnProgress`) and, where the engine locks devices, the server's
    :class:`~.cgroups.ServerDevices`."""

    enforces_devices = False  # engines that lock each server to its leases' devices set it
    # a running server may take other GPUs (a lease it takes itself after a move off a sick GPU);
    # engines whose servers keep the devices they started with (a pod, a Slurm job) clear it
    server_changes_gpus = True

    # ------------------------------------------------------------------ state (not config)
    lease_id = Unicode("", help="Id of the lease this server holds (spawner state; not config).")
    lease = AnyTrait(None, allow_none=True, help="The lease JSON last seen (not persisted).")
    last_lease_end = Dict(
        help="""How this server's last lease ended (spawner state, kept across restarts, for
        the hub's pages): ``{"lease_id", "state", "end_reason", "ended_at", "ended_by"}``.
        Empty until a lease ended.""",
    )

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        from . import lifecycle

        lifecycle.attach_to_running_hub()  # once per hub process; a no-op outside a hub
        self._lease_pending = False
        self._stopping = False
        self._spawn_cancelled = False
        self._withdraw_reason = ""
        self._withdrawn = asyncio.Event()  # set when the hub's shutdown withdraws the waiting spawn
        self._engine_start_timeout: int | None = None
        self._lease_env: dict[str, str] = {}
        self._watch: LeaseWatch | None = None
        self._watched = ""  # the lease id _watch follows
        self._progress = SpawnProgress(announce=lambda message: self.log.info("%s: %s", self._log_name, message))
        self._devices: ServerDevices | None = None
        self._link: BrokerLink | None = None
        self._checked_pool: dict | None = None
        self._spawn_pool: dict | None = None
        self._confirm_task: asyncio.Future | None = None
        self._orphan_task: asyncio.Future | None = None
        self._end_task: asyncio.Future | None = None
        self._handled_end = ""
        self.last_warning: dict | None = None
        self.device_start = DeviceStart()  # what the engine's start needs for the device lock (set before each start)

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
        orm_spawner = self.orm_spawner  # none in tests
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
        elif self.active and self.broker_url:  # a lease the server took itself (%gpu request in it): only the broker knows it
            try:
                async with asyncio.timeout(3):
                    lease = pages.server_lease(await self.broker.list_leases(user=self.user.name), self.name)
            except (TimeoutError, BrokerError) as e:
                self.log.debug("Leases of %s for the home page: %s", self._log_name, e)
        last_end = self.last_lease_end or None
        if not last_end and not self.lease_id and (self.lease or {}).get("state") not in (None, "active", "queued"):
            last_end = self.lease  # the ended lease poll() found
        stopping = bool(self._stopping or self._stop_pending)
        return pages.lease_status(lease=lease, last_end=last_end, server_active=self.active, server_ready=self.ready,
                                  cpu_only=not (self.lease_id or lease), broker_url=self.broker_url, warning=self.last_warning,
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
        self._progress.begin()
        self._lease_env = {}
        self.lease_id = ""
        self.lease = None
        self._spawn_cancelled = False
        self._withdraw_reason = ""
        self._withdrawn = asyncio.Event()
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
            self._progress.finish()

    async def _start_with_lease(self):
        server_broker_url = self.server_broker_url or self.broker_url
        # cheap local checks first: a bad option fails at once, without the broker
        choice = self.lease_choice(self.user_options)
        self._check_devices()  # enforcement required but impossible: fail before asking for anything
        await self.before_lease_request()
        if choice.cpu_only:
            self._lease_env = cpu_only_environment(broker_url=server_broker_url)
            if self.broker_url:
                # a GPU lease an earlier stop could not release would otherwise stay with this
                # server (the hub's check sees the server running): end it, without delaying the spawn
                self._orphan_task = self._background(self._withdraw_orphans())
            self.emit_progress("No GPU for this server (CPU only)", 40)
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
        # one key for this spawn's create: however often it is sent, it makes one lease
        request = asyncio.ensure_future(client.request_lease(body, key=new_request_key("spawn")))
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
        limit = time.monotonic() + max(60.0, float(self.start_timeout) + float(self.http_timeout) + 60)
        while not self.ready:
            if self.lease_id != lease_id or time.monotonic() > limit:
                return  # stopped or failed before it came up
            await asyncio.sleep(0.2)
        await self._confirm(lease_id)

    async def _confirm(self, lease_id: str, tries: int = 5) -> None:
        delays = Backoff(first=1.0, cap=10.0).delays()
        for attempt in range(tries):
            if self.lease_id != lease_id:
                return
            try:
                self.lease = await self.broker.confirm(lease_id)
                if self._watch is not None and self._watched == lease_id:
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
            changed = await self._changed_or_withdrawn(watch, min(self.queue_refresh_interval, left))
            if not changed and not self.link.connected:
                # the broker's feed is away: ask for the lease itself
                got = await self.link.get_lease(lease_id)
                if got is None:
                    self.emit_progress("The GPU lease broker is not answering; still waiting in the queue", None)

    async def _changed_or_withdrawn(self, watch: LeaseWatch, timeout: float) -> bool:
        """Wait until the lease changes (True), the hub's shutdown withdraws this spawn, or
        ``timeout`` seconds pass (False for both)."""
        if self._withdrawn.is_set():
            return False
        changed = asyncio.ensure_future(watch.changed(timeout))
        withdrawn = asyncio.ensure_future(self._withdrawn.wait())
        try:
            await asyncio.wait((changed, withdrawn), return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (changed, withdrawn):
                task.cancel()
        return changed.done() and not changed.cancelled() and changed.result()

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
        self._withdrawn.set()
        return True

    # ------------------------------------------------------------------ the engine
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

    async def before_lease_request(self) -> None:
        """Called at the start of a spawn, once the options are checked, before the lease is asked
        for (for a CPU-only server: before the engine starts): an engine prepares here what must
        not count against the lease's time limit (Docker: the environment's image, pulled with its
        progress on the spawn page). A failure fails the spawn, and nothing was leased."""

    async def before_engine_start(self) -> None:
        """Called right before the engine's ``start()``, once the placement is applied (or, for a
        CPU-only server, none): an engine makes here what its server's start needs (Kubernetes:
        the pod's ResourceClaim). A failure fails the spawn."""

    async def _start_engine(self):
        """The engine's start, with the server's device lock where this engine keeps one: made
        with the rules of the lease (none: every GPU denied) before, told the server's process
        right after."""
        devices = self._server_devices()
        self.device_start = DeviceStart()
        if devices is not None:
            lease = self.lease if self.lease_id and isinstance(self.lease, dict) else None
            try:
                self.device_start = await devices.starting(lease)
            except DeviceAccessError as e:
                raise spawn_error(str(e), reason="gpulease_devices", status_code=500) from None
        await self.before_engine_start()
        url = await self._run_engine_start(self.device_start)
        if devices is not None:
            try:
                await devices.running(self._engine_pid())
            except DeviceAccessError as e:
                await super().stop(now=True)
                raise spawn_error(str(e), reason="gpulease_devices", status_code=500) from None
        return url

    async def _run_engine_start(self, needs: DeviceStart):
        prefixed = bool(needs.command_prefix)
        saved = self.cmd
        if prefixed:
            # The server's command runs under a systemd scope. LocalProcessSpawner has no hook for
            # a command in front of the server's: its start() builds the command from self.cmd and
            # get_args() and hands it to Popen in one step, without yielding to the loop; so the
            # prefix is in self.cmd for that call only (tests/test_spawner_parts.py runs it).
            self.cmd = [*needs.command_prefix, *saved]
        try:
            started = super().start()
            # the engine's own progress follows from here: after its start() was called, so an
            # engine that notes its start there (KubeSpawner) is followed for this spawn
            self._progress.finish(engine_starts=True)
            return await started
        finally:
            if prefixed:
                self.cmd = saved

    def _engine_pid(self) -> int:
        """The server's process id where the engine runs it as a local process; else 0."""
        return self.pid if isinstance(self, LocalProcessSpawner) else 0

    # ------------------------------------------------------------------ device access
    @classmethod
    def log_device_access_at_hub_start(cls, hub) -> None:
        """Log the one line about device enforcement when the hub starts (the local engines'
        mechanism; an engine with a mechanism of its own overrides this)."""
        from .cgroups import log_at_hub_start

        log_at_hub_start(hub)

    @classmethod
    def engine_at_hub_start(cls, hub) -> None:
        """The hub starts (its loop runs): an engine starts here what runs beside the hub for all
        its servers (Docker: keeping the environments' images warm). Nothing by default."""

    @classmethod
    def device_access_at_hub_stop(cls, hub) -> None:
        """The hub stops (after its servers were stopped, or left running): the local engines
        remove the empty device cgroups and their parent, and let go of the parent's lock."""
        from .cgroups import at_hub_stop

        at_hub_stop(hub)

    def find_device_mechanism(self) -> Mechanism:
        """How this host locks this engine's servers to their leases' devices (asked once per hub
        process, when its device guard is made). Local processes: a device cgroup (see
        :mod:`.cgroups`); an engine with a mechanism of its own overrides this."""
        from .cgroups import detect

        return detect(self.device_cgroup_parent)

    def device_unit(self) -> Any:
        """Where the server runs, in the words of the device mechanism, for one that does not name
        the server itself (SystemdSpawner: its unit); None: the server's cgroup by its name."""
        return None

    def _server_devices(self) -> ServerDevices | None:
        """This server's door to the hub's device guard (None: this engine locks no devices, or
        enforcement is off, or no broker)."""
        if not self.enforces_devices or self.enforce_devices == "off" or not self.broker_url or self.user is None:
            return None
        if self._devices is None:
            guard = DeviceGuard.for_link(self.link, mode=self.enforce_devices, mechanism=self.find_device_mechanism,
                                         logger=self.log)
            self._devices = ServerDevices(guard, self.user.name, self.name or "", unit=self.device_unit(),
                                          who=self._log_name, logger=self.log)
        return self._devices

    def _check_devices(self) -> None:
        """Fail the spawn where enforcement is required and this host cannot give it."""
        devices = self._server_devices()
        if devices is not None and devices.refusal:
            raise spawn_error(devices.refusal, reason="gpulease_devices", status_code=500)

    # ------------------------------------------------------------------ progress
    def emit_progress(self, message: str, progress: int | None = None, **data: Any) -> None:
        """Add one event to the spawn page's progress feed (every open page sees all of them)."""
        self._progress.emit(message, progress, **data)

    async def progress(self):
        """Queue position and ETA while the lease waits, then the engine's own progress events.

        A stream opened before ``start()`` runs (the hub opens it as soon as the spawn is
        requested) waits for this spawn's events instead of ending early; a stream of a spawn
        that was cancelled or failed ends with it."""
        async for event in self._progress.stream(then=super().progress):
            yield event

    # ------------------------------------------------------------------ stop, poll, state
    async def stop(self, now=False):
        lease_id = self.lease_id
        self._unfollow()
        self._stopping = True
        early = None
        if lease_id:
            self._remember_end({"id": lease_id, "state": "released", "end_reason": "server stopped"})
            if self.release_when_stopping:
                # the hub took the server off the proxy before this: nobody reaches it any more
                early = self._end_lease(lease_id, "server stopped")
        try:
            # ask the engine itself: a spawn cancelled in the queue never started anything
            # (and LocalProcessSpawner would signal pid 0, the hub's own process group)
            if await super().poll() is None:
                await super().stop(now=now)
        finally:
            self._stopping = False
            self._progress.close()
            if self._devices is not None:
                self._devices.stopped()
            ends = [early] if early is not None else []
            if early is None and lease_id:
                ends.append(self._end_lease(lease_id, "server stopped"))
            if self.broker_url and not self._lease_pending:
                # leases the server took itself (%gpu request, a kernel resumed after a reclaim) end
                # with it; a broker that cannot list them now gets the order from the outbox later
                ends.append(asyncio.ensure_future(self._withdraw_orphans("its server stopped", keep=lease_id)))
            ends = [t for t in ends if t is not None]
            if ends:
                # a moment for the broker's answer, never longer: the ends go on in the background
                await asyncio.wait(ends, timeout=min(5.0, self.broker_timeout))
            first = ends[0] if ends else None
            if lease_id and first is not None and first.done() and not first.cancelled() and first.exception() is None and first.result() is None:
                # the lease had already ended (the idle culler released it saying why, an admin
                # revoked it): the home page says how, not "server stopped"
                ended = await self._read_lease_briefly(lease_id)
                if ended and ended.get("state") not in ACTIVE_STATES and ended.get("state") != "unknown":
                    self._remember_end(ended)

    async def poll(self):
        if self._stopping:
            return await super().poll()
        if self._lease_pending:
            return None  # waiting in the queue counts as starting
        lease_id = self.lease_id
        status = await super().poll()
        if status is not None:
            self._unfollow()  # or it would outlive the lease, and keep a new spawn's lease unwatched
            if lease_id and not self._stopping:
                self._remember_end({"id": lease_id, "state": "released", "end_reason": "its server was gone"})
                self._end_lease(lease_id, "server is gone")
            return status
        self._adopt_devices()
        if not lease_id:
            return None
        if self.link.shutting_down:
            return None  # the hub is stopping its servers: the process answers, the broker is not asked
        fresh = self._watch is None or self._watched != lease_id
        watch = self._follow(lease_id)  # a restarted hub: follow the lease again (the link retries until the broker answers)
        if (fresh or not self.link.connected) and await self._read_lease_briefly(lease_id) is None:
            return None  # broker unreachable: assume nothing changed; the link tells us once it answers
        lease = watch.lease
        if watch.live:
            self.lease = lease
            if (lease.get("state") == "active" and "confirmed_at" in lease and lease["confirmed_at"] is None
                    and self.ready and (self._confirm_task is None or self._confirm_task.done())):
                # the confirm after start did not reach the broker: the server is up, say so now,
                # or the broker revokes the lease after its confirm_timeout and the server stops
                self._confirm_task = self._background(self._confirm(lease_id))
            return None
        return await self._lease_ended(lease)

    def _adopt_devices(self) -> None:
        """A running server this hub process did not start (the hub restarted): its device lock again."""
        if self._lease_pending or self._stopping:
            return
        devices = self._server_devices()
        if devices is not None:
            devices.adopt(self._engine_pid(), self.lease_id)

    async def _read_lease_briefly(self, lease_id: str) -> dict | None:
        """The lease from the broker, or None when it does not answer within a few seconds: a
        poll (the hub's start, a stop, the periodic check) never waits out the broker's retries."""
        try:
            return await asyncio.wait_for(self.link.get_lease(lease_id), timeout=min(5.0, self.broker_timeout))
        except TimeoutError:
            return None

    async def _lease_ended(self, lease: dict):
        """The lease of the running server ended: stop the server, or keep it running without it."""
        lease_id = lease.get("id") or self.lease_id
        if lease_id and (not lease.get("end_message") or "meta" not in lease):
            # the feed's event says that it ended; the lease JSON says how, in words, and who
            # ended it (what the user reads on the home page): a short wait for it
            try:
                full = await asyncio.wait_for(self.link.get_lease(lease_id), timeout=min(3.0, self.broker_timeout))
            except (BrokerError, TimeoutError):
                full = None
            if full and full.get("state") == lease.get("state"):
                lease = {**lease, **full}
        self._unfollow()
        self._remember_end(lease)
        by_user = ended_by_holder(lease)
        moved = moved_off_its_gpu(lease) and self.server_changes_gpus
        keep = moved or (self.on_release_by_user == "keep" if by_user else self.on_lease_end != "stop")
        if self._handled_end != lease_id:
            self._handled_end = lease_id
            how = ("; moved off its GPU: the server keeps running, its kernels take a healthy GPU at their next cell" if moved
                   else "; the server keeps running without it" if keep else "; stopping the server")
            self.log.warning("Lease %s of %s ended (%s: %s)%s", lease_id, self._log_name, lease.get("state"), lease.get("end_reason") or "", how)
        self.lease_id = ""
        if keep:
            self._lease_env = {}
            return None
        self._stopping = True
        try:
            await super().stop()
        finally:
            self._stopping = False
        status = await super().poll()
        return 0 if status is None else status

    def _remember_end(self, lease: dict) -> None:
        known = self.lease if isinstance(self.lease, dict) and self.lease.get("id") == lease.get("id") else {}
        self.last_lease_end = {
            "lease_id": lease.get("id") or self.lease_id,
            "state": lease.get("state") or "",
            "end_reason": lease.get("end_reason") or "",
            "end_message": lease.get("end_message") or "",
            "ended_at": lease.get("ended_at") or time.time(),
            "ended_by": lease.get("ended_by") or lease.get("ended_actor") or "",
            "tier": lease.get("tier") or known.get("tier") or "",
            "request": lease.get("request") or known.get("request") or {},
            "placement": lease.get("placement") or known.get("placement") or {},
        }

    def _end_lease(self, lease_id: str, reason: str) -> asyncio.Future | None:
        """Release an active lease or withdraw a queued one, in the background until the broker
        has it (a lease that already ended is fine)."""
        if not lease_id:
            return None
        if self.lease_id == lease_id:
            self.lease_id = ""
        return self.link.end_lease(lease_id, reason, state="released", who=self._log_name)

    async def _end_lease_briefly(self, lease_id: str, reason: str) -> None:
        """:meth:`_end_lease`, waiting a moment for the broker's answer (it goes on in the
        background when the broker is slow or away)."""
        task = self._end_lease(lease_id, reason)
        if task is not None:
            await asyncio.wait([task], timeout=min(5.0, self.broker_timeout))

    def get_state(self):
        state = super().get_state()
        mine: dict[str, Any] = {}
        if self.lease_id:
            mine["lease_id"] = self.lease_id
        if self.last_lease_end:
            mine["last_end"] = dict(self.last_lease_end)
        if mine:
            state[STATE_KEY] = {"version": STATE_VERSION, **mine}
        return state

    def load_state(self, state):
        super().load_state(state)
        mine = (state or {}).get(STATE_KEY) or {}
        if mine.get("lease_id"):
            self.lease_id = str(mine["lease_id"])
        if isinstance(mine.get("last_end"), dict):
            self.last_lease_end = dict(mine["last_end"])

    def clear_state(self):
        super().clear_state()
        if self._lease_pending:
            return  # never drop a lease that is still being waited for
        self.lease_id = ""
        self._lease_env = {}
        self._progress.close()

    # ------------------------------------------------------------------ following the lease while the server runs
    def _follow(self, lease_id: str, lease: dict | None = None) -> LeaseWatch:
        """Follow ``lease_id`` through the hub's shared event feed."""
        w = self._watch
        if w is not None and self._watched == lease_id:
            if lease is not None:
                w.update(lease)
            return w
        self._unfollow()
        w = self._watch = self.link.watch(lease_id, lease)
        self._watched = lease_id
        w.on_change.append(lambda w, lid=lease_id: self._on_lease_change(w, lid))
        w.on_event.append(self._on_lease_event)
        return w

    def _unfollow(self) -> None:
        w, self._watch, self._watched = self._watch, None, ""
        if w is not None:
            w.close()

    def _on_lease_event(self, event: dict) -> None:
        if type(self).on_lease_event is not GPULeaseSpawner.on_lease_event:
            self._background(self._call_on_lease_event(event))

    async def _call_on_lease_event(self, event: dict) -> None:
        try:
            await self.on_lease_event(event)
        except Exception:
            self.log.exception("on_lease_event of %s failed for %s", self._log_name, event.get("kind"))

    async def on_lease_event(self, event: dict) -> None:
        """Called with every broker event of this server's lease (requested, granted, warned,
        preempt-warned, extended, confirmed, ended, ...), as the hub's event feed delivers it.
        Engines override it (the Slurm engine moves the job's time limit on ``extended``)."""

    def _on_lease_change(self, w: LeaseWatch, lease_id: str) -> None:
        if w.warning is not None and w.warning is not self.last_warning:
            self.last_warning = w.warning
            self.log.warning("Lease %s of %s: %s %s", lease_id, self._log_name, w.warning.get("kind"), w.warning.get("reason", ""))
        if (w.live or w.state is None or self._lease_pending or self._stopping or self.lease_id != lease_id
                or self._handled_end == lease_id or (self._end_task is not None and not self._end_task.done())):
            return
        # ended while the server runs: the hub's own path (poll() decides, callbacks clean up)
        self._end_task = self._background(self.poll_and_notify())


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
