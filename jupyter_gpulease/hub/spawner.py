"""GPULeaseSpawner: lease GPUs from the broker before the server starts, and give them back.

:class:`GPULeaseSpawner` is a mixin over any JupyterHub spawner. Put it first in the bases::

    class GPULeaseLocalProcessSpawner(GPULeaseSpawner, LocalProcessSpawner): ...

Its ``start()`` asks the broker for a lease (acting for the user with a hub-side token that
has the ``custom:gpulease:admin`` scope), waits in the queue while ``progress()`` streams the
position and ETA to the spawn page, applies the granted placement and only then calls the
engine's ``start()``. ``stop()``, a ``poll()`` that finds the server gone, a cancelled or
failed spawn all end the lease. The lease id lives in the spawner state, so a restarted hub
finds it again.

The engine-specific part is :meth:`GPULeaseSpawner.apply_placement`: the default sets the
environment (``CUDA_VISIBLE_DEVICES`` by UUID and ``GPULEASE_*``, see :mod:`.placement`),
which is all a local process needs. Container engines override it to add their resource
requests and node selectors.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

from jupyterhub.spawner import LocalProcessSpawner, SimpleLocalProcessSpawner, Spawner
from tornado import web
from traitlets import Any as AnyTrait
from traitlets import Bool, Dict, Float, List, TraitError, Unicode, default, validate

from ..client import BrokerClient, BrokerError
from ..core.text import format_duration
from . import form as spawn_form
from . import pages
from .options import LeaseChoice, OptionsError, parse_presets, parse_user_options
from .placement import cpu_only_environment, describe_request, granted_message, lease_environment, queue_message

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


class GPULeaseSpawner(Spawner):
    """Mixin: lease GPUs from the jupyter-gpulease broker around the engine's start and stop."""

    # ------------------------------------------------------------------ config
    broker_url = Unicode(
        help="""The lease broker's base URL, service prefix included, as the hub reaches it.

        Example: ``http://127.0.0.1:10101/services/gpulease/`` (the service's own URL) or
        ``http://127.0.0.1:8000/services/gpulease/`` (through the proxy).
        Default: the environment variable ``GPULEASE_BROKER_URL``.
        """,
    ).tag(config=True)

    @default("broker_url")
    def _default_broker_url(self):
        return os.environ.get("GPULEASE_BROKER_URL", "")

    server_broker_url = Unicode(
        help="""The broker's URL as single-user servers reach it (``GPULEASE_BROKER_URL`` in their
        environment). Default: ``broker_url``. Set it when servers run where the hub's address
        for the broker does not work (containers, other hosts). Example:
        ``http://hub.example.org/services/gpulease/`` (through the proxy).
        """,
    ).tag(config=True)

    broker_api_token = Unicode(
        help="""Token the spawner uses to call the broker. It must carry the scope
        ``custom:gpulease:admin`` (the spawner asks for leases on behalf of users); see
        config/jupyterhub_config.py for the service and role that grant it.
        Default: the environment variable ``GPULEASE_HUB_TOKEN``.
        """,
    ).tag(config=True)

    @default("broker_api_token")
    def _default_broker_api_token(self):
        return os.environ.get("GPULEASE_HUB_TOKEN", "")

    broker_timeout = Float(30, help="Seconds one call to the broker may take before it counts as failed.").tag(config=True)

    lease_presets = List(
        help="""Named GPU options shown on the spawn form instead of (or besides) free choice,
        like KubeSpawner's ``profile_list``. Each entry::

            {"slug": "a100",                       # what user_options {"preset": "a100"} names
             "display_name": "One A100 (80 GB)",
             "description": "training runs",
             "request": {"gpus": 1, "model": "A100*"},   # or {"share": 0.5}, {"mig_profile": "3g.40gb"}
             "tier": "experiment",                 # optional; default: the broker's default tier
             "duration_s": 7200,                   # optional; default: the tier's default
             "max_wait_s": 1800,                   # optional
             "default": True}                      # the one chosen when user_options is empty

        ``{"slug": "cpu", "display_name": "CPU only", "cpu_only": True}`` offers a server
        without a GPU.
        """,
    ).tag(config=True)

    @validate("lease_presets")
    def _check_presets(self, proposal):
        try:
            parse_presets(proposal.value)
        except ValueError as e:
            raise TraitError(str(e)) from None
        return proposal.value

    allow_custom_request = Bool(
        True,
        help="""Let users choose model, count / share / MIG profile, tier and duration freely
        (form and REST API). False: only the ``lease_presets``.""",
    ).tag(config=True)

    allow_cpu_only = Bool(True, help="Offer a server without a GPU (no lease).").tag(config=True)

    default_user_options = Dict(
        help="""What a spawn without options asks for, when no preset is marked default.
        Example: ``{"gpus": 1}``. Empty: a CPU-only server if ``allow_cpu_only``, else one whole GPU.""",
    ).tag(config=True)

    lease_wait_timeout = Float(
        4 * 3600,
        help="""Longest time, in seconds, a spawn waits in the lease queue before it gives up
        (the broker also withdraws the lease then). The hub's ``start_timeout`` is stretched by
        this much for the spawn, so a long wait is not cut off by the hub's default of 60 s;
        ``start_timeout`` keeps its meaning for the engine's own start after the grant.
        A user may ask for a shorter wait (``max_wait_s``). Example: 1800 (half an hour).""",
    ).tag(config=True)

    queue_refresh_interval = Float(
        5,
        help="""Seconds between refreshes of the queue position and ETA while a spawn waits
        (a grant is noticed at once through the broker's event feed).""",
    ).tag(config=True)

    on_lease_end = Unicode(
        "stop",
        help="""What happens to a running server when its lease ends (expired, preempted,
        reclaimed, revoked): ``"stop"`` stops the server (after the broker's warning);
        ``"keep"`` leaves it running without the GPU — the server extension then ends GPU
        access for its kernels and the user can ask for a new lease from the notebook.""",
    ).tag(config=True)

    @validate("on_lease_end")
    def _check_on_lease_end(self, proposal):
        if proposal.value not in ("stop", "keep"):
            raise TraitError(f"on_lease_end must be 'stop' or 'keep', got {proposal.value!r}")
        return proposal.value

    lease_meta = Dict(help="Extra labels stored with every lease this spawner requests. Example: ``{'hub': 'teaching'}``.").tag(config=True)

    # ------------------------------------------------------------------ state
    lease_id = Unicode("", help="Id of the lease this server holds (spawner state; not config).")
    lease = AnyTrait(None, allow_none=True, help="The lease JSON last seen (not persisted).")

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._lease_pending = False
        self._stopping = False
        self._engine_start_timeout: int | None = None
        self._lease_env: dict[str, str] = {}
        self._watcher: asyncio.Task | None = None
        self._progress_events: list[dict] = []
        self._progress_done = False
        self._progress_signal = asyncio.Event()
        self._client: BrokerClient | None = None
        self._checked_pool: dict | None = None
        self._confirm_task: asyncio.Future | None = None
        self._orphan_task: asyncio.Future | None = None
        self.last_warning: dict | None = None

    # ------------------------------------------------------------------ the broker
    @property
    def broker(self) -> BrokerClient:
        if self._client is None:
            if not self.broker_url:
                raise spawn_error("GPU leases are not configured on this hub: the administrator must set "
                                  "c.GPULeaseSpawner.broker_url", reason="gpulease_config", status_code=500)
            self._client = BrokerClient(self.broker_url, self.broker_api_token, timeout=self.broker_timeout)
        return self._client

    @property
    def presets(self):
        return parse_presets(self.lease_presets)

    def _user_groups(self) -> list[str]:
        try:
            return sorted(g.name for g in (getattr(self.user, "groups", None) or []))
        except Exception:  # a user object without groups (tests, odd authenticators)
            return []

    async def fetch_pool(self) -> dict:
        """The broker's pool as this user sees it (tiers they may use, their quota)."""
        return await self.broker.pool(user=self.user.name, groups=self._user_groups())

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
        try:
            previous = dict(self.orm_spawner.user_options or {})
        except Exception:  # no orm spawner (tests)
            previous = dict(self.user_options or {})
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
                lease = self.lease = await asyncio.wait_for(self.broker.get_lease(self.lease_id), 3)
            except (TimeoutError, BrokerError) as e:
                self.log.debug("Lease %s of %s for the home page: %s", self.lease_id, self._log_name, e)
        last_end = getattr(self, "last_lease_end", None)
        if not last_end and not self.lease_id and (self.lease or {}).get("state") not in (None, "active", "queued"):
            last_end = self.lease  # the ended lease poll() found
        return pages.lease_status(lease=lease, last_end=last_end, server_active=self.active, server_ready=self.ready,
                                  cpu_only=not self.lease_id, broker_url=self.broker_url, warning=self.last_warning)

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

    # ------------------------------------------------------------------ progress
    def _reset_progress(self) -> None:
        self._progress_events = []
        self._progress_done = False
        self._progress_signal = asyncio.Event()

    def emit_progress(self, message: str, progress: int | None = None, **data: Any) -> None:
        """Add one event to the spawn page's progress feed (every open page sees all of them)."""
        event: dict[str, Any] = {"message": message}
        if progress is not None:
            event["progress"] = int(progress)
        if data:
            event["gpulease"] = data
        if self._progress_events and self._progress_events[-1] == event:
            return
        self._progress_events.append(event)
        self.log.info("%s: %s", self._log_name, message)
        self._wake_progress()

    def _wake_progress(self) -> None:
        signal, self._progress_signal = self._progress_signal, asyncio.Event()
        signal.set()

    def _finish_lease_progress(self) -> None:
        self._progress_done = True
        self._wake_progress()

    async def progress(self):
        """Queue position and ETA while the lease waits, then the engine's own progress events."""
        i = 0
        while True:
            signal = self._progress_signal
            while i < len(self._progress_events):
                yield self._progress_events[i]
                i += 1
            if self._progress_done:
                break
            await signal.wait()
        async for event in super().progress():
            yield event

    # ------------------------------------------------------------------ start
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
        self._reset_progress()
        self._lease_env = {}
        self.lease_id = ""
        self.lease = None
        self._lease_pending = True  # until start() returns, poll() says "starting"
        try:
            return await self._start_with_lease()
        finally:
            self._restore_start_timeout()
            self._lease_pending = False
            self._finish_lease_progress()

    async def _start_with_lease(self):
        server_broker_url = self.server_broker_url or self.broker_url
        # cheap local checks first: a bad option fails at once, without the broker
        choice = self.lease_choice(self.user_options)
        if choice.cpu_only:
            self._lease_env = cpu_only_environment(broker_url=server_broker_url)
            if self.broker_url:
                # a GPU lease an earlier stop could not release would otherwise stay with this
                # server (the hub's check sees the server running): end it, without delaying the spawn
                self._orphan_task = asyncio.ensure_future(self._withdraw_orphans(self.broker))
            self.emit_progress("No GPU for this server (CPU only)", 40)
            self._finish_lease_progress()
            self._restore_start_timeout()
            return await super().start()

        client = self.broker
        pool, self._checked_pool = self._checked_pool, None  # fetched by the options check just before
        try:
            if pool is None:
                pool, _ = await asyncio.gather(self.fetch_pool(), self._withdraw_orphans(client))
            else:
                await self._withdraw_orphans(client)
        except BrokerError as e:
            raise self._broker_failure(e, "ask for a GPU lease") from None
        choice = self.lease_choice(self.user_options, pool)
        body = choice.broker_body(
            user=self.user.name,
            server=self.name or "",
            groups=self._user_groups(),
            meta={"spawner": "jupyter-gpulease", "preset": choice.preset, **self.lease_meta},
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
            # cancelled while the broker answered: the lease exists, so withdraw it
            try:
                lease = await request
            except Exception:
                raise asyncio.CancelledError() from None
            await self._end_lease(lease["id"], "spawn cancelled")
            raise
        lease_id = self.lease_id = lease["id"]
        self.lease = lease
        try:
            lease = await self._wait_for_grant(client, lease, pool, time.monotonic() + wait_limit, wait_limit)
            self.lease = lease
            self.apply_placement(lease)
            self.emit_progress(granted_message(lease), 45, lease_id=lease["id"], state="active",
                               expires_at=lease.get("expires_at"))
            self._finish_lease_progress()
            self._restore_start_timeout()
            url = await super().start()
            # confirm in the background: the hub goes on waiting for the server meanwhile, and a
            # lease that ended in between is noticed by the watcher and poll(), which stop the server
            self._confirm_task = asyncio.ensure_future(self._confirm(lease_id))
            self._start_watcher()
            return url
        except BaseException as e:  # cancelled (the user pressed cancel), failed, timed out
            reason = "spawn cancelled" if isinstance(e, asyncio.CancelledError) else f"spawn failed: {e}"
            await asyncio.shield(self._end_lease(lease_id, reason))
            raise

    async def _confirm(self, lease_id: str) -> None:
        try:
            self.lease = await self.broker.confirm(lease_id)
        except BrokerError as e:
            self.log.warning("Could not confirm lease %s of %s: %s", lease_id, self._log_name, e)
        except Exception:
            self.log.exception("Could not confirm lease %s of %s", lease_id, self._log_name)

    async def _wait_for_grant(self, client: BrokerClient, lease: dict, pool: dict | None, deadline: float, wait_limit: float) -> dict:
        lease_id = lease["id"]
        since = 0
        while True:
            state = lease.get("state")
            if state == "active":
                return lease
            if state != "queued":
                why = lease.get("end_reason") or state
                raise spawn_error(f"The GPU lease {lease_id} ended before it was granted ({why}). Start again, "
                                  "perhaps with a smaller request or a longer wait.", reason="gpulease_not_granted")
            q = lease.get("queue") or {}
            self.emit_progress(queue_message(lease, pool), _queue_progress(q), lease_id=lease_id, state="queued",
                               position=q.get("position"), length=q.get("length"), eta=q.get("eta"),
                               waiting_for=q.get("waiting_for"))
            left = deadline - time.monotonic()
            if left <= 0:
                raise spawn_error(f"No GPU became free within {format_duration(wait_limit)}, so the spawn gave up and left "
                                  "the queue. Try a smaller request (a share, another model) or try later.",
                                  reason="gpulease_wait_timeout")
            try:
                feed = await client.events(since=since, lease_id=lease_id, timeout=min(self.queue_refresh_interval, left))
                since = int(feed.get("last_id") or since)
            except BrokerError as e:
                if e.status not in (0, 404) and e.status < 500:
                    raise self._broker_failure(e, "wait for the GPU lease") from None
                self.log.warning("Lease events for %s unavailable (%s); polling", self._log_name, e)
                await asyncio.sleep(min(self.queue_refresh_interval, max(left, 0)))
            try:
                lease = await client.get_lease(lease_id)
            except BrokerError as e:
                if e.status == 0 or e.status >= 500:
                    self.emit_progress("The lease broker is not answering; still waiting", None)
                    continue
                raise self._broker_failure(e, "wait for the GPU lease") from None

    def _broker_failure(self, e: BrokerError, doing: str) -> web.HTTPError:
        if e.status == 0 or e.status >= 500:
            return spawn_error(f"Could not {doing}: the GPU lease broker is not answering ({e.message}). "
                               "Try again in a minute, or choose a CPU-only server.", reason="gpulease_unavailable", status_code=503)
        if e.status in (401,):
            return spawn_error("The hub could not authenticate to the GPU lease broker; tell the administrator "
                               "(GPULeaseSpawner.broker_api_token needs the custom:gpulease:admin scope).",
                               reason="gpulease_config", status_code=500)
        return spawn_error(f"The GPU lease was refused: {e.message}", reason="gpulease_refused",
                           status_code=403 if e.status == 403 else 400)

    async def _withdraw_orphans(self, client: BrokerClient) -> None:
        """End leases of this server that no running spawner holds (left by a hub that died mid-spawn)."""
        try:
            leases = await client.list_leases(state=None, user=self.user.name)
        except BrokerError as e:
            self.log.debug("Could not list leases of %s: %s", self.user.name, e)
            return
        for lease in leases:
            if (lease.get("state") in ACTIVE_STATES and lease.get("server", "") == (self.name or "")
                    and (lease.get("meta") or {}).get("spawner") == "jupyter-gpulease" and lease.get("id") != self.lease_id):
                self.log.warning("Ending lease %s of %s: no running server holds it", lease["id"], self._log_name)
                await self._end_lease(lease["id"], "left behind by an earlier spawn")

    # ------------------------------------------------------------------ placement (engine part)
    def apply_placement(self, lease: dict) -> None:
        """Make the engine give the server the leased devices. Local processes: the environment.

        Container engines override this (and call super()) to add resource requests, node
        selectors or device mounts for ``lease["placement"]``.
        """
        self._lease_env = lease_environment(lease, broker_url=self.server_broker_url or self.broker_url)

    def get_env(self):
        env = super().get_env()
        env.update(self._lease_env)
        return env

    # ------------------------------------------------------------------ stop, poll, state
    async def stop(self, now=False):
        self._stop_watcher()
        lease_id = self.lease_id
        self._stopping = True
        try:
            # ask the engine itself: a spawn cancelled in the queue never started anything
            # (and LocalProcessSpawner would signal pid 0, the hub's own process group)
            if await super().poll() is None:
                await super().stop(now=now)
        finally:
            self._stopping = False
            if lease_id:
                await self._end_lease(lease_id, "server stopped")

    async def poll(self):
        if self._stopping:
            return await super().poll()
        if self._lease_pending:
            return None  # waiting in the queue counts as starting
        lease_id = self.lease_id
        status = await super().poll()
        if status is not None:
            self._stop_watcher()  # or it would outlive the lease, and keep a new spawn's lease unwatched
            if lease_id and not self._stopping:
                await self._end_lease(lease_id, "server is gone")
            return status
        if not lease_id:
            return None
        lease = await self._fetch_lease(lease_id)
        if lease is None:
            return None  # broker unreachable: assume nothing changed
        if lease.get("state") in ACTIVE_STATES:
            if self._watcher is None:  # a restarted hub: follow the lease again
                self._start_watcher()
            if (lease.get("state") == "active" and "confirmed_at" in lease and lease["confirmed_at"] is None
                    and (self._confirm_task is None or self._confirm_task.done())):
                # the confirm after start did not reach the broker: the server is up, say so now,
                # or the broker revokes the lease after its confirm_timeout_s and the server stops
                self._confirm_task = asyncio.ensure_future(self._confirm(lease_id))
            return None
        self.log.warning("Lease %s of %s ended (%s: %s)", lease_id, self._log_name, lease.get("state"), lease.get("end_reason"))
        self._stop_watcher()
        if self.on_lease_end != "stop":
            self.lease_id = ""
            return None
        self._stopping = True
        try:
            await super().stop()
        finally:
            self._stopping = False
        self.lease_id = ""
        status = await super().poll()
        return 0 if status is None else status

    async def _fetch_lease(self, lease_id: str) -> dict | None:
        try:
            lease = await self.broker.get_lease(lease_id)
        except BrokerError as e:
            if e.status == 404:
                return {"id": lease_id, "state": "ended", "end_reason": "unknown to the broker"}
            self.log.warning("Could not check lease %s of %s: %s", lease_id, self._log_name, e)
            return None
        self.lease = lease
        return lease

    async def _end_lease(self, lease_id: str, reason: str) -> None:
        """Release an active lease or withdraw a queued one; a lease that already ended is fine."""
        if not lease_id:
            return
        try:
            await self._release_as_holder(lease_id, reason)
            self.log.info("Released lease %s of %s (%s)", lease_id, self._log_name, reason)
        except BrokerError as e:
            if e.status not in (404, 409):
                self.log.error("Could not release lease %s of %s: %s; the broker ends it when it is never confirmed "
                               "or its heartbeats stop", lease_id, self._log_name, e)
                return
        except Exception:
            self.log.exception("Could not release lease %s of %s", lease_id, self._log_name)
            return
        if self.lease_id == lease_id:
            self.lease_id = ""

    async def _release_as_holder(self, lease_id: str, reason: str) -> dict:
        # The spawner acts for the user: the lease ends as 'released' (or 'withdrawn' while
        # queued), not 'revoked' as when an admin ends someone else's lease.
        return await self.broker.release(lease_id, reason=reason, state="released")

    def get_state(self):
        state = super().get_state()
        if self.lease_id:
            state[STATE_KEY] = {"version": STATE_VERSION, "lease_id": self.lease_id}
        return state

    def load_state(self, state):
        super().load_state(state)
        mine = (state or {}).get(STATE_KEY) or {}
        if mine.get("lease_id"):
            self.lease_id = str(mine["lease_id"])

    def clear_state(self):
        super().clear_state()
        if self._lease_pending:
            return  # never drop a lease that is still being waited for
        self.lease_id = ""
        self._lease_env = {}

    # ------------------------------------------------------------------ the running lease
    async def on_lease_event(self, event: dict) -> None:
        """Called with every broker event of the running server's lease (``extended``, ``warned``,
        ``ended``…). Engines override it, e.g. to move a batch job's time limit; the default does nothing."""

    def _start_watcher(self) -> None:
        if self.lease_id and (self._watcher is None or self._watcher.done()):
            self._watcher = asyncio.ensure_future(self._watch_lease(self.lease_id))

    def _stop_watcher(self) -> None:
        w, self._watcher = self._watcher, None
        if w is not None and not w.done() and w is not asyncio.current_task():
            w.cancel()

    async def _watch_lease(self, lease_id: str) -> None:
        """Follow the lease's events: log warnings, and stop the server promptly when it ends."""
        since = 0
        while self.lease_id == lease_id:
            try:
                feed = await self.broker.events(since=since, lease_id=lease_id, timeout=30)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                self.log.debug("Lease events for %s: %s", self._log_name, e)
                await asyncio.sleep(self.queue_refresh_interval)
                continue
            since = int(feed.get("last_id") or since)
            for ev in feed.get("events") or []:
                kind = ev.get("kind")
                try:
                    await self.on_lease_event(ev)
                except Exception:
                    self.log.exception("Handling event %s of lease %s of %s failed", kind, lease_id, self._log_name)
                if kind in ("warned", "preempt-warned"):
                    self.last_warning = ev
                    self.log.warning("Lease %s of %s: %s %s", lease_id, self._log_name, kind, ev.get("reason", ""))
                elif kind == "ended":
                    self.log.warning("Lease %s of %s ended: %s %s", lease_id, self._log_name, ev.get("to_state"), ev.get("reason", ""))
                    if self.on_lease_end == "stop" and not getattr(self, "_stop_pending", False):
                        self._watcher = None
                        # the hub's own path: poll() notices, stops the server, callbacks clean up
                        await self.poll_and_notify()
                    elif self.on_lease_end != "stop":
                        self.lease_id = ""
                    return


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


class GPULeaseSimpleLocalProcessSpawner(GPULeaseSpawner, SimpleLocalProcessSpawner):
    """Local processes without system users, for demos and tests (entry point ``gpulease-simple``).

    Like JupyterHub's SimpleLocalProcessSpawner: no isolation between users; never in production.
    """
