"""The lease broker: a JupyterHub service (traitlets Application + tornado).

Run by JupyterHub as a managed service (``c.JupyterHub.services``), or by hand with the
``JUPYTERHUB_*`` environment variables of an external service::

    jupyter gpulease broker --config gpulease_config.py
    python -m jupyter_gpulease.broker --generate-config   # writes gpulease_config.py
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys
from importlib import resources
from urllib.parse import quote, urlsplit

from tornado.httpclient import AsyncHTTPClient, HTTPClientError, HTTPRequest
from tornado.httpserver import HTTPServer
from tornado.ioloop import PeriodicCallback
from tornado.web import Application as WebApplication
from traitlets import Any, Bool, CaselessStrEnum, Dict, Float, List, Unicode, default, validate
from traitlets.config import Application, catch_config_error

from .. import __version__
from ..core.events import ENDED
from ..core.model import LeaseState
from ..core.policy_config import PolicyConfig
from .manager import LeaseManager, SystemClock

SERVICE_NAME = "gpulease"


def load_openapi() -> dict:
    """The API description kept next to this module (``openapi.json``)."""
    return json.loads(resources.files(__package__).joinpath("openapi.json").read_text())


class GPULeaseBroker(PolicyConfig, Application):
    """Hands out GPU leases from a shared pool to JupyterHub users."""

    name = "jupyter-gpulease-broker"
    description = "The GPU lease broker: a JupyterHub service that queues, grants, extends and ends GPU leases."
    version = __version__

    aliases = {
        "config": "GPULeaseBroker.config_file",
        "db-url": "GPULeaseBroker.db_url",
        "bind-url": "GPULeaseBroker.bind_url",
        "device-backend": "GPULeaseBroker.device_backend",
        "log-level": "Application.log_level",
    }
    flags = {
        "generate-config": ({"GPULeaseBroker": {"generate_config": True}}, "write a commented gpulease_config.py with every option and exit"),
        "debug": ({"Application": {"log_level": logging.DEBUG}}, "log at DEBUG level"),
    }

    @default("log_level")
    def _default_log_level(self):
        return logging.INFO

    @default("log_format")
    def _default_log_format(self):
        return "[%(levelname)1.1s %(asctime)s.%(msecs).03d gpulease %(module)s:%(lineno)d] %(message)s"

    @default("log_datefmt")
    def _default_log_datefmt(self):
        return "%Y-%m-%d %H:%M:%S"

    config_file = Unicode("gpulease_config.py", help="Config file to load (Python, traitlets). Example: --config=/etc/jupyterhub/gpulease_config.py").tag(config=True)
    generate_config = Bool(False, help="Write a commented default config file to `config_file` and exit.").tag(config=True)

    # ------------------------------------------------------------------ storage
    db_url = Unicode(
        "sqlite:///gpulease.sqlite",
        help="""SQLAlchemy URL of the lease database.

        A SQLite file by default (WAL journal, synchronous=FULL: every answered request is on
        disk). For larger sites point it at PostgreSQL, e.g.
        ``postgresql+psycopg://gpulease:secret@db/gpulease``.
        """,
    ).tag(config=True)

    sqlite_synchronous = CaselessStrEnum(
        ["OFF", "NORMAL", "FULL", "EXTRA"],
        "FULL",
        help="""SQLite's ``synchronous`` setting, when ``db_url`` is a SQLite file.

        FULL (default): a request is answered only after its change is on disk, at one fsync
        per commit (about 10 ms on a plain disk). NORMAL: with WAL, a power cut may lose the
        last commits (a process crash loses nothing); about twice as fast. Example: "NORMAL".
        """,
    ).tag(config=True)

    # ------------------------------------------------------------------ the pool
    device_backend = Unicode(
        "auto",
        help="""Where the pool's GPUs come from: 'nvml' (the GPUs of this machine), 'static' (a
        declared inventory, e.g. for several nodes), 'simulated' (fake GPUs, for demos and
        tests), 'auto' (NVML when it finds GPUs, else simulated), 'kubernetes' (the cluster's
        GPU nodes, from their labels and capacity) or 'slurm' (the GRES of ``scontrol show node``).
        """,
    ).tag(config=True)

    devices = Dict(
        help="""Config of the device backend. For 'static' and 'simulated', ``gpus`` declares the
        inventory, one entry per group of identical GPUs on one node, e.g.::

            c.GPULeaseBroker.devices = {"gpus": [
                {"node": "gpu-1", "model": "A100-SXM4-80GB", "count": 4, "memory_mib": 81920},
                {"node": "gpu-2", "model": "A100-SXM4-80GB", "memory_mib": 81920, "mig": {"1g.10gb": 7}},
                {"node": "gpu-2", "model": "L4", "count": 2, "memory_mib": 23034},
            ]}
        """,
    ).tag(config=True)

    inventory_interval = Float(
        0.0,
        help="""Seconds between re-reads of the pool from the device backend. A change (a node
        added, drained or lost, a GPU reported unhealthy) is applied at once: leases on GPUs that
        left the pool end, GPUs that came are granted. A failed read keeps the pool as it was.
        0: the backend's own period (15 s for 'kubernetes' and 'slurm'; 'static', 'simulated'
        and 'nvml' are read once at start). Example: 30.
        """,
    ).tag(config=True)

    # ------------------------------------------------------------------ policy
    # tiers, quotas and every scheduling setting come from PolicyConfig, declared once in core

    # ------------------------------------------------------------------ service
    tick_interval = Float(5.0, help="Seconds between scheduling passes (expiries, warnings, grants). Example: 5.").tag(config=True)

    stop_servers_on_end = Bool(
        False,
        help="""When the broker ends a lease (expired, preempted, revoked, failed), ask the Hub
        to stop the holder's server. Needs the broker's service to hold the ``admin:servers``
        scope (a role in jupyterhub_config.py, see the README). Off for the local engine,
        where a server may outlive its lease.
        """,
    ).tag(config=True)
    stop_server_states = List(
        Unicode(),
        ["expired", "preempted", "revoked", "failed"],
        help="Final states whose leases stop their servers when ``stop_servers_on_end`` is on. Example: ``['expired', 'revoked']``.",
    ).tag(config=True)

    reconcile_interval = Float(
        300.0,
        help="""Seconds between checks with the Hub that every lease a JupyterHub spawner holds
        still has its server (running or starting); also checked once at start. A lease whose
        server has been gone for ``reconcile_grace`` seconds is revoked (withdrawn if still
        queued): this ends the leases of servers the hub stopped, or spawns it forgot, while the
        broker could not hear of it (the hub stops its
        services before its servers on shutdown). 0: never check. Needs the broker's service to
        hold the scopes ``read:users`` and ``read:servers`` (a role in jupyterhub_config.py).
        Example: 300.""",
    ).tag(config=True)
    reconcile_grace = Float(
        120.0,
        help="""How long, in seconds, a lease's server may be missing from the hub before the
        check revokes the lease; a lease granted less than this long ago is never revoked by
        the check. Example: 120.""",
    ).tag(config=True)

    admin_scope = Unicode(
        "custom:gpulease:admin",
        help="""The scope that lets a caller see and change every lease and act for users (the
        spawner needs it). Hub admins have it implicitly. Declare it in
        ``c.JupyterHub.custom_scopes`` and grant it by a role.
        """,
    ).tag(config=True)

    authenticate_metrics = Bool(True, help="Require a hub token to read /metrics (false: anyone who can reach the broker).").tag(config=True)

    bind_url = Unicode(help="Where to listen, e.g. http://127.0.0.1:10101. Default: $JUPYTERHUB_SERVICE_URL.").tag(config=True)

    @default("bind_url")
    def _default_bind_url(self):
        return os.environ.get("JUPYTERHUB_SERVICE_URL") or "http://127.0.0.1:10101"

    base_url = Unicode(help="URL prefix of every route, e.g. /services/gpulease/. Default: $JUPYTERHUB_SERVICE_PREFIX.").tag(config=True)

    @default("base_url")
    def _default_base_url(self):
        return os.environ.get("JUPYTERHUB_SERVICE_PREFIX") or f"/services/{SERVICE_NAME}/"

    @validate("base_url")
    def _slashes(self, proposal):
        v = proposal["value"] or "/"
        return "/" + v.strip("/") + "/" if v.strip("/") else "/"

    clock = Any(help="Object with .now() -> POSIX seconds. Tests inject one they can move.")

    @default("clock")
    def _default_clock(self):
        return SystemClock()

    # ------------------------------------------------------------------ building
    @catch_config_error
    def initialize(self, argv=None):
        self._tasks: set[asyncio.Task] = set()  # background tasks, referenced until done
        super().initialize(argv)
        if self.generate_config:
            return
        if self.config_file and os.path.exists(self.config_file):
            self.load_config_file(self.config_file)
            # command-line options win over the file
            self.update_config(self.cli_config)
        elif self.config_file and "config_file" in self.cli_config.get("GPULeaseBroker", {}):
            raise FileNotFoundError(f"config file not found: {self.config_file}")
        self.policy = self.build_policy()
        self.init_manager()

    def init_manager(self) -> None:
        from ..core.scheduler import Scheduler
        from ..devices import get_backend
        from ..store import LeaseStore
        from .metrics import BrokerMetrics

        self.backend = get_backend(self.device_backend, self.devices)
        inventory = self.backend.inventory()
        self._inventory = list(inventory)
        self.log.info("Pool: %d GPU(s) from the %r device backend", len(inventory), self.device_backend)
        self.scheduler = Scheduler(inventory, self.policy)
        self.store = LeaseStore(self.db_url, sqlite_synchronous=self.sqlite_synchronous)
        self.manager = LeaseManager(self.scheduler, self.store, clock=self.clock, logger=self.log)
        self.metrics = BrokerMetrics(self.manager)
        self.manager.listeners.append(self.metrics.observe)
        self.manager.listeners.append(self._on_events)

    def make_web_app(self) -> WebApplication:
        from jupyterhub.services.auth import HubAuth, HubOAuth

        from .handlers import make_handlers

        hub_auth = HubAuth(parent=self, base_url=self.base_url)
        hub_oauth = HubOAuth(parent=self, base_url=self.base_url)
        self.hub_auth = hub_auth
        settings = {
            "hub_auth": hub_auth,
            "hub_oauth": hub_oauth,
            "cookie_secret": os.urandom(32),
            "login_url": hub_oauth.login_url,
            "gpulease_manager": self.manager,
            "gpulease_broker": self,
            "gpulease_admin_scope": self.admin_scope,
            "gpulease_metrics": self.metrics,
            "gpulease_openapi": load_openapi(),
            "gpulease_authenticate_metrics": self.authenticate_metrics,
            "log_function": self._log_request,
        }
        return WebApplication(make_handlers(self.base_url), **settings)

    def _log_request(self, handler) -> None:
        status = handler.get_status()
        level = self.log.debug if status < 400 else self.log.info if status < 500 else self.log.error
        level("%d %s %s %.1fms", status, handler.request.method, handler.request.uri.split("?")[0], 1000 * handler.request.request_time())

    # ------------------------------------------------------------------ stopping servers
    def _on_events(self, written, events) -> None:
        if not self.stop_servers_on_end:
            return
        for e in events:
            if e.kind == ENDED and e.from_state == "active" and e.to_state in self.stop_server_states and getattr(e, "lease", None):
                self._background(self.stop_server(e.lease.user, e.lease.server, e.to_state))

    def _background(self, coro) -> None:
        """Run ``coro`` as a task that is kept referenced until done (the loop holds tasks weakly)."""
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def stop_server(self, user: str, server: str, why: str) -> None:
        """Ask the Hub API to stop ``user``'s ``server`` (its lease ended: ``why``)."""
        path = f"users/{quote(user, safe='')}/servers/{quote(server, safe='')}" if server else f"users/{quote(user, safe='')}/server"
        url = self.hub_auth.api_url.rstrip("/") + "/" + path
        req = HTTPRequest(url, method="DELETE", headers={"Authorization": f"token {self.hub_auth.api_token}"}, request_timeout=60)
        try:
            await AsyncHTTPClient().fetch(req)
            self.log.info("Asked the hub to stop %s's server %r: its lease was %s", user, server, why)
        except HTTPClientError as e:
            if e.code in (400, 404):  # not running any more
                self.log.info("Server %r of %s was not running (%s)", server, user, e.code)
            else:
                self.log.error("Could not stop %s's server %r after its lease was %s: %s", user, server, why, e)
        except OSError as e:
            self.log.error("Could not reach the hub to stop %s's server %r: %s", user, server, e)

    # ------------------------------------------------------------------ the Hub API
    async def hub_api(self, method: str, path: str) -> tuple[int, dict | None]:
        """Call the Hub API with the broker's own token: (status, JSON), or (0, None) when the hub
        does not answer."""
        url = self.hub_auth.api_url.rstrip("/") + "/" + path.lstrip("/")
        req = HTTPRequest(url, method=method, headers={"Authorization": f"token {self.hub_auth.api_token}"}, request_timeout=30, connect_timeout=10)
        try:
            resp = await AsyncHTTPClient().fetch(req)
        except HTTPClientError as e:
            if e.code == 599:
                return 0, None
            return e.code, None
        except OSError:
            return 0, None
        try:
            return resp.code, json.loads(resp.body) if resp.body else None
        except ValueError:
            return resp.code, None

    async def user_groups(self, user: str) -> tuple[str, ...]:
        """``user``'s groups from the hub (needs ``read:users:groups``); none if the hub will not say."""
        status, model = await self.hub_api("GET", f"users/{quote(user, safe='')}")
        if status == 200 and isinstance(model, dict) and isinstance(model.get("groups"), list):
            return tuple(str(g) for g in model["groups"])
        if status != 404:
            self.log.warning("Could not read the groups of %s from the hub (%s); counting none", user, status or "no answer")
        return ()

    # ------------------------------------------------------------------ reconciliation with the hub
    RECONCILE_REASON = "its server is not running (found by the broker's check with the hub)"

    async def reconcile(self) -> list[str]:
        """End leases of a JupyterHub spawner whose server has been gone from the hub for
        ``reconcile_grace`` seconds: active ones are revoked, queued ones withdrawn (a hub that
        died mid-spawn leaves one behind; granted, it would hold GPUs nobody uses). Returns the
        ids ended. A hub that does not answer, or answers without server models, changes
        nothing (logged once until it answers again)."""
        from ..core.model import LeaseError

        if not hasattr(self, "_gone_since"):
            self._gone_since: dict[str, float] = {}
            self._hub_trouble = ""
        held = [lease for lease in self.manager.live() if (lease.meta or {}).get("spawner") == "jupyter-gpulease"]
        ids = {lease.id for lease in held}
        for lid in list(self._gone_since):
            if lid not in ids:
                del self._gone_since[lid]
        servers_of: dict[str, dict | None] = {}
        revoked = []
        for lease in held:
            if lease.user not in servers_of:
                status, model = await self.hub_api("GET", f"users/{quote(lease.user, safe='')}")
                if status == 404:
                    servers_of[lease.user] = {}  # the user is gone, and their servers with them
                elif status == 200 and isinstance(model, dict) and isinstance(model.get("servers"), dict):
                    servers_of[lease.user] = model["servers"]
                else:
                    trouble = ("did not answer" if status == 0 else
                               f"answered {status}" + (" without server models" if status == 200 else "") +
                               " (the broker's service needs the scopes read:users and read:servers)")
                    if trouble != self._hub_trouble:
                        self.log.warning("Lease check with the hub skipped: the hub %s; checking again in %g s", trouble, self.reconcile_interval)
                        self._hub_trouble = trouble
                    return revoked
            if self._hub_trouble:
                self.log.info("Lease check with the hub: the hub answers again")
                self._hub_trouble = ""
            now = self.manager.now()
            if (lease.server or "") in servers_of[lease.user]:
                self._gone_since.pop(lease.id, None)
                continue
            gone = self._gone_since.setdefault(lease.id, now)
            granted = lease.granted_at if lease.granted_at is not None else lease.created_at
            if now - gone < self.reconcile_grace or now - granted < self.reconcile_grace:
                continue
            try:
                await self.manager.release(lease.id, state=LeaseState.REVOKED, reason=self.RECONCILE_REASON, actor="broker:reconcile")
            except LeaseError:  # it ended meanwhile
                continue
            finally:
                self._gone_since.pop(lease.id, None)
            self.log.warning("Ended lease %s of %s (server %r): %s", lease.id, lease.user, lease.server, self.RECONCILE_REASON)
            revoked.append(lease.id)
        return revoked

    async def _reconcile(self) -> None:
        try:
            await self.reconcile()
        except Exception:
            self.log.exception("lease check with the hub failed")

    # ------------------------------------------------------------------ running
    async def start_async(self) -> None:
        """Restore, listen, tick. Returns once serving."""
        await self.manager.start()
        self.web_app = self.make_web_app()
        url = urlsplit(self.bind_url)
        self.http_server = HTTPServer(self.web_app, xheaders=True)
        self.http_server.listen(url.port or 80, url.hostname or "127.0.0.1")
        self.ticker = PeriodicCallback(self._tick, self.tick_interval * 1000)
        self.ticker.start()
        self.reconciler = None
        if self.reconcile_interval > 0:
            self.reconciler = PeriodicCallback(self._reconcile, self.reconcile_interval * 1000)
            self.reconciler.start()
            self._background(self._reconcile())  # once at start
        self.inventory_refresher = None
        interval = self.inventory_interval or float(getattr(self.backend, "inventory_refresh_s", 0) or 0)
        if interval > 0:
            self._refreshing = False
            self.inventory_refresher = PeriodicCallback(self._refresh_inventory, interval * 1000)
            self.inventory_refresher.start()
        self.log.info("GPU lease broker %s listening on %s%s", __version__, self.bind_url.rstrip("/"), self.base_url)

    async def _tick(self) -> None:
        try:
            await self.manager.tick()
        except Exception:
            self.log.exception("scheduling pass failed")

    async def _refresh_inventory(self) -> None:
        """Read the pool again (off the loop: backends may block) and apply it if it changed."""
        if self._refreshing:
            return
        self._refreshing = True
        try:
            try:
                gpus = await asyncio.get_running_loop().run_in_executor(None, self.backend.inventory)
            except Exception as e:
                self.log.warning("Pool not re-read from the %r device backend (kept as it was): %s", self.device_backend, e)
                return
            if gpus == self._inventory:
                return
            before = {g.uuid for g in self._inventory}
            events = await self.manager.set_inventory(gpus)
            self._inventory = list(gpus)
            ended = sum(1 for e in events if e.kind == ENDED)
            self.log.info("Pool changed: %d GPU(s) (%d new, %d gone, %d unhealthy); %d lease(s) ended", len(gpus),
                          len({g.uuid for g in gpus} - before), len(before - {g.uuid for g in gpus}),
                          sum(1 for g in gpus if not g.healthy), ended)
        except Exception:
            self.log.exception("applying the re-read pool failed")
        finally:
            self._refreshing = False

    async def stop_async(self) -> None:
        if getattr(self, "inventory_refresher", None):
            self.inventory_refresher.stop()
        if getattr(self, "ticker", None):
            self.ticker.stop()
        if getattr(self, "reconciler", None):
            self.reconciler.stop()
        if getattr(self, "http_server", None):
            self.http_server.stop()
        await self.manager.close()
        if getattr(self, "backend", None):
            self.backend.close()
        self.log.info("GPU lease broker stopped")

    async def _run(self) -> None:
        self._stopping = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._on_signal, sig)
        await self.start_async()
        await self._stopping.wait()
        await self.stop_async()

    def _on_signal(self, sig) -> None:
        self.log.info("Received %s, stopping", signal.Signals(sig).name)
        self._stopping.set()

    def start(self) -> None:
        if self.generate_config:
            self.write_default_config()
            return
        asyncio.run(self._run())

    def write_default_config(self) -> None:
        path = self.config_file or "gpulease_config.py"
        if os.path.exists(path):
            print(f"{path} exists; not overwriting it", file=sys.stderr)
            self.exit(1)
        with open(path, "w") as f:
            f.write(self.generate_config_file())
        print(f"Wrote {path}")


def main(argv: list[str] | None = None) -> int:
    app = GPULeaseBroker()
    app.initialize(argv)
    app.start()
    return 0


if __name__ == "__main__":
    sys.exit(main())
