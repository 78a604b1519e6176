"""The lease broker: a JupyterHub service (traitlets Application + tornado).

This module wires config into the parts; each part has one job:

* :mod:`.manager` — the scheduler, the store and the clock: every decision, committed before
  it is answered (group commit), the only door handlers and metrics use;
* :mod:`.handlers` — the REST API and the event feed; :mod:`.pages` — the "my leases" and
  admin pages (Jinja2 templates);
* :mod:`.hubapi` — what the broker asks of the Hub API (groups, stopping servers, the check
  that every lease still has its server);
* :mod:`.supervisor` — keeps a hot standby ready and restarts a broker that died;
* :mod:`.checks` — config mistakes found before they cost anything.
* :mod:`.settings` — what an admin sets (``c.GPULeaseBroker.*``, besides the policy);
  :mod:`.jobs` — the periodic jobs; :mod:`.hubside` — what the broker asks of its hub;
  :mod:`.orphan` — serving on, then handing over, when the supervisor died. These are parts of
  :class:`GPULeaseBroker` (mixins); this module builds the parts, serves and stops.

Run by JupyterHub as a managed service (``c.JupyterHub.services``), or by hand with the
``JUPYTERHUB_*`` environment variables of an external service::

    jupyter gpulease broker --config gpulease_config.py
    jupyter gpulease broker --config gpulease_config.py --check-config
    python -m jupyter_gpulease.broker --generate-config   # writes gpulease_config.py
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys
import threading
from importlib import resources
from urllib.parse import urlsplit

from tornado.httpserver import HTTPServer
from tornado.web import Application as WebApplication
from traitlets import Bool, TraitError, Unicode, default
from traitlets.config import Application

from .. import __version__
from ..core.model import LeaseState
from ..core.policy_config import PolicyConfig
from ..tasks import BackgroundTasks
from . import checks
from .checks import ConfigError
from .hubside import HubSide
from .inputs import Limits
from .jobs import PeriodicJobs
from .manager import LeaseManager
from .orphan import OrphanHandover
from .settings import SERVICE_NAME, BrokerSettings
from .unleased import BACKENDS_WITH_PROCESSES

__all__ = ["EXIT_CONFIG", "EXIT_LOST_DB", "GC_GEN0_THRESHOLD", "SERVICE_NAME", "GPULeaseBroker", "load_openapi", "main", "tune_gc"]

EXIT_CONFIG = 2  # the config is wrong: restarting will not help
EXIT_LOST_DB = 3  # the database failed: a fresh broker (or the standby) carries on


def load_openapi() -> dict:
    """The API description kept next to this module (``openapi.json``)."""
    return json.loads(resources.files(__package__).joinpath("openapi.json").read_text())


class GPULeaseBroker(PeriodicJobs, HubSide, OrphanHandover, BrokerSettings, PolicyConfig, Application):
    """Hands out GPU leases from a shared pool to JupyterHub users."""

    name = "jupyter-gpulease-broker"
    description = "The GPU lease broker: a JupyterHub service that queues, grants, extends and ends GPU leases."
    version = __version__

    aliases = {
        "config": "GPULeaseBroker.config_file",
        "db-url": "GPULeaseBroker.db_url",
        "bind-url": "GPULeaseBroker.bind_url",
        "device-backend": "GPULeaseBroker.device_backend",
        "standbys": "GPULeaseBroker.standbys",
        "log-level": "Application.log_level",
    }
    flags = {
        "generate-config": ({"GPULeaseBroker": {"generate_config": True}}, "write a commented gpulease_config.py with every option and exit"),
        "check-config": (
            {"GPULeaseBroker": {"check_config": True}},
            "check the config file (options, tiers, quotas, the pool, the database, and the hub's groups when the hub can be asked) and exit: 0 when it is fine",
        ),
        "no-supervise": ({"GPULeaseBroker": {"supervise": False}}, "run one broker process, without a supervisor or standby"),
        "debug": ({"Application": {"log_level": logging.DEBUG}}, "log at DEBUG level"),
    }

    # the policy options and the settings are the broker's: one section in the generated config
    # and in --help-all, each with its whole help, not a "See also" of the mixin that declares it
    _CONFIG_MIXINS = tuple(c for c in (*BrokerSettings.__mro__, *PolicyConfig.__mro__) if c not in Application.__mro__)

    def _classes_with_config_traits(self, classes=None):
        for cls in super()._classes_with_config_traits(classes):
            if cls not in self._CONFIG_MIXINS:
                yield cls

    @default("log_level")
    def _default_log_level(self):
        return logging.INFO

    @default("raise_config_file_errors")
    def _default_raise_config_file_errors(self):
        return True  # a config file that does not load stops the broker (with one line), never half-applied

    @default("log_format")
    def _default_log_format(self):
        return "[%(levelname)1.1s %(asctime)s.%(msecs).03d gpulease %(module)s:%(lineno)d] %(message)s"

    @default("log_datefmt")
    def _default_log_datefmt(self):
        return "%Y-%m-%d %H:%M:%S"

    config_file = Unicode("gpulease_config.py", help="Config file to load (Python, traitlets). Example: --config=/etc/jupyterhub/gpulease_config.py").tag(config=True)
    generate_config = Bool(False, help="Write a commented default config file to `config_file` and exit.").tag(config=True)
    check_config = Bool(False, help="Check the config and exit (0: fine; 2: an error, printed as one line naming the option).").tag(config=True)

    # ------------------------------------------------------------------ building
    def initialize(self, argv=None, *, build_manager: bool = True):
        """Parse the command line, load the config file, build the parts (``build_manager``:
        the pool, scheduler and store too). A config mistake raises :class:`ConfigError` (one
        line naming the option, the file and the fix)."""
        self._tasks = BackgroundTasks(self.log)
        self._stop_waiting = threading.Event()
        try:
            super().initialize(argv)
        except TraitError as e:
            raise ConfigError(f"command line: {e}") from None
        if self.generate_config:
            return
        if self.config_file and os.path.exists(self.config_file):
            checks.load_config_file(self, self.config_file)
            try:
                self.update_config(self.cli_config)  # command-line options win over the file
            except TraitError as e:
                raise ConfigError(checks.trait_error("(command line)", e)) from None
        elif self.config_file and "config_file" in self.cli_config.get("GPULeaseBroker", {}):
            raise ConfigError(f"config file not found: {self.config_file} (fix: pass --config with the path of an existing file)")
        self.policy = checks.build(self, self.build_policy, what="the tiers and quotas")
        for line in checks.policy_warnings(self.policy):
            self.log.warning("Config %s: %s", self.config_file or "(command line)", line)
        if build_manager and not self.check_config:
            checks.build(self, self.init_manager, what="the pool and the database")

    def init_manager(self) -> None:
        from ..core.scheduler import Scheduler
        from ..devices import get_backend
        from ..store import LeaseStore
        from .feed import Feed
        from .metrics import BrokerMetrics

        self.backend = get_backend(self.device_backend, self.devices)
        inventory = self.backend.inventory()
        self._inventory = list(inventory)
        self._refreshing = False
        self.log.info("Pool: %d GPU(s) from the %r device backend", len(inventory), self.device_backend)
        self.scheduler = Scheduler(inventory, self.policy)
        self.store = LeaseStore(self.db_url, sqlite_synchronous=self.sqlite_synchronous, migrate=False)
        feed = Feed(buffer=self.stream_buffer_events, max_per_user=self.max_streams_per_user, max_total=self.max_streams)
        self.manager = LeaseManager(self.scheduler, self.store, clock=self.clock, logger=self.log, feed=feed, show_preemptor_names=self.show_preemptor_names)
        self.metrics = BrokerMetrics(self.manager, per_user=self.metrics_per_user)
        self.init_usage()
        self.manager.listeners.append(self._on_events)
        self.unleased = None
        if self.unleased_check_interval > 0 and self.backend.name in BACKENDS_WITH_PROCESSES:
            from .unleased import UnleasedDetector

            self.unleased = UnleasedDetector(self.manager, self.backend, action=self.unleased_use.lower(), grace_s=self.unleased_grace_s,
                                             hub_user_exists=self._hub_user_exists, logger=self.log,
                                             show_holders=self.show_preemptor_names)

        self.telemetry = self.alerts = self.dcgm = None
        if self.device_sample_interval > 0 and self.backend.name in BACKENDS_WITH_PROCESSES:
            from .telemetry import DeviceTelemetry

            self.telemetry = DeviceTelemetry(self.manager, self.backend, interval_s=self.device_sample_interval, logger=self.log)
        if self.alert_webhooks:
            from .alerts import BrokerAlerts, Thresholds

            self.alerts = BrokerAlerts(
                self.manager, self.alert_webhooks, logger=self.log, retry_s=self.alert_retry_s, link=self.public_url.rstrip("/") + self.base_url + "admin",
                limits=Thresholds(idle_lease_s=self.alert_idle_lease_s, hot_margin_c=self.alert_hot_margin_c, xid_window_s=self.alert_xid_window_s,
                                  queue_wait_p95_s=self.alert_queue_wait_p95_s))
        from .health import HealthKeeper

        self.health = HealthKeeper(self.manager, settle_s=self.health_settle_s, drain_action=self.health_drain_action.lower(),
                                   drain_grace_s=self.health_drain_grace_s, logger=self.log)
        if self.telemetry is not None:
            self.telemetry.listeners.append(self.health.on_samples)
        if self.dcgm_hpc_job_mapping_dir:
            from .dcgm import DcgmJobMap

            self.dcgm = DcgmJobMap(self.manager, self.dcgm_hpc_job_mapping_dir, logger=self.log)

    def init_usage(self) -> None:
        """Usage records (the recorder feeds on the manager's batches) and the report over the store."""
        from .usage import GPULeaseUsage, UsageAPI, UsageRecorder, offers_of

        self.usage_settings = s = GPULeaseUsage(parent=self)
        if s.record:
            self.manager.usage_recorder = UsageRecorder(s.accounting(), per_user_metrics=self.metrics_per_user, sample_s=s.sample_interval_s,
                                                       write_s=s.write_interval_s)
        self.usage = UsageAPI(self.store, s.accounting(), offers=lambda: offers_of(self.manager.inventory()), clock=self.clock.now,
                              min_leases=s.suggestion_min_leases, suggestion_days=s.suggestion_days)

    @property
    def limits(self) -> Limits:
        return Limits(body_bytes=self.max_body_bytes, meta_bytes=self.max_meta_bytes, usage_bytes=self.max_usage_bytes, reason_chars=self.max_reason_chars, json_depth=self.max_json_depth)

    def make_web_app(self) -> WebApplication:
        """The tornado Application: the REST API's routes (:meth:`api_routes`), then the pages."""
        from jupyterhub.services.auth import HubAuth, HubOAuth

        from .pages import page_handlers

        hub_auth = HubAuth(parent=self, base_url=self.base_url, cache_max_age=int(self.token_cache_max_age))
        hub_oauth = HubOAuth(parent=self, base_url=self.base_url, cache_max_age=int(self.token_cache_max_age))
        self.hub_auth = hub_auth
        settings = {
            "hub_auth": hub_auth,
            "hub_oauth": hub_oauth,
            "cookie_secret": os.urandom(32),
            "xsrf_cookies": True,
            "login_url": hub_oauth.login_url,
            "gpulease_manager": self.manager,
            "gpulease_broker": self,
            "gpulease_admin_scope": self.admin_scope,
            "gpulease_metrics": self.metrics,
            "gpulease_openapi": load_openapi(),
            "gpulease_authenticate_metrics": self.authenticate_metrics,
            "gpulease_limits": self.limits,
            "log_function": self._log_request,
            "gpulease_calls": set(),  # the API calls being answered (the stop lets them finish)
        }
        return WebApplication(self.api_routes() + page_handlers(self.base_url), **settings)

    def api_routes(self) -> list[tuple]:
        """The REST API's routes; the last one answers any other ``api/`` path 404."""
        from . import unleased, usage_handlers
        from .handlers import api_handlers
        from .health_handlers import api_handlers as health_api_handlers

        routes = api_handlers(self.base_url)
        routes[-1:-1] = unleased.api_handlers(self.base_url)  # before the catch-all 404
        routes[-1:-1] = health_api_handlers(self.base_url)
        routes[-1:-1] = usage_handlers.api_handlers(self.base_url)
        return routes

    def _log_request(self, handler) -> None:
        status = handler.get_status()
        if status < 400 and self._quiet_successes:
            return  # the logger takes every level (its handler filters): skip building the record
        if getattr(handler, "_reported", False):
            return  # the handler's own line already says what went wrong
        level = self.log.debug if status < 400 else self.log.info if status < 500 else self.log.error
        # the path only: a query string may carry a token
        level("%d %s %s %.1fms", status, handler.request.method, handler.request.path, 1000 * handler.request.request_time())


    def _background(self, coro) -> None:
        """Run ``coro`` as a task that is kept referenced until done (the loop holds tasks weakly)."""
        self._tasks.start(coro, what="a background task of the broker")

    # ------------------------------------------------------------------ running
    async def wait_for_leadership(self) -> bool:
        """Wait until this broker holds the database's lock (False: told to stop first)."""
        loop = asyncio.get_running_loop()
        store = self.store

        def waiting():
            self.log.info("Standing by (pid %d): another broker holds the lock of %s; taking over when it stops", os.getpid(), store.describe())

        got = await loop.run_in_executor(None, lambda: store.acquire_leadership(self._stop_waiting, on_wait=waiting))
        return got

    async def start_async(self) -> bool:
        """Wait for the lock, upgrade the schema, restore, listen, tick. False if stopped while
        standing by."""
        if not await self.wait_for_leadership():
            return False
        await self.manager.start()
        await self.health.start()
        self.web_app = self.make_web_app()
        url = urlsplit(self.bind_url)
        self._quiet_successes = self.log_level > logging.DEBUG
        # no xheaders: the broker never uses the client's address, and checking it costs a lookup per call
        self.http_server = HTTPServer(self.web_app, max_body_size=max(4 * self.max_body_bytes, 1 << 20))
        await self._listen(url.port or 80, url.hostname or "127.0.0.1")
        self.backend.start()  # a backend that follows its source (the Kubernetes node watch) does it on this loop
        self._start_jobs()
        self.log.info("GPU lease broker %s active (pid %d), listening on %s%s", __version__, os.getpid(), self.bind_url.rstrip("/"), self.base_url)
        return True

    async def _listen(self, port: int, host: str) -> None:
        # a broker that just died may leave its port for a moment: try for a few seconds
        for attempt in range(50):
            try:
                self.http_server.listen(port, host)
                return
            except OSError as e:
                if attempt == 49 or e.errno not in (98, 48):  # EADDRINUSE
                    raise
                await asyncio.sleep(0.1)

    async def stop_async(self) -> None:
        """Stop listening, commit what was decided, let go of the database's lock (the next
        broker may take over from here on), then end the calls and connections left."""
        self._stop_waiting.set()
        for p in getattr(self, "periodic", ()):
            p.stop()
        if self._successor_check is not None:
            self._successor_check.stop()
        server = getattr(self, "http_server", None)
        if server is not None:
            server.stop()
        if getattr(self, "alerts", None) is not None:
            await self.alerts.close()
        if getattr(self, "unleased", None) is not None:
            await self.unleased.close()
        if getattr(self, "manager", None):
            led = self.store.leader
            await self.manager.close()  # calls that come now are answered 503; the lock is let go
            if led:
                self.log.info("Let go of the lock of %s (pid %d)", self.store.describe(), os.getpid())
        if server is not None:
            # the answers of calls already committed go out; then the connections close, so that
            # clients (and the hub's proxy) reconnect to the next broker instead of asking this one
            calls = set(self.web_app.settings["gpulease_calls"])
            if calls:
                await asyncio.wait(calls, timeout=2)
            try:
                await asyncio.wait_for(server.close_all_connections(), 2)
            except TimeoutError:
                pass
        if getattr(self, "backend", None):
            self.backend.close()
        self.log.info("GPU lease broker stopped")


    def _fatal(self, exc: BaseException) -> None:
        """The database failed under the broker: end this process at once (see the manager)."""
        logging.shutdown()
        os._exit(EXIT_LOST_DB)

    async def _run(self) -> None:
        self._stopping = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._on_signal, sig)
        self._watch_supervisor()
        self.manager.on_fatal = self._fatal
        if await self.start_async():
            tune_gc()
            await self._stopping.wait()
        await self.stop_async()

    def _on_signal(self, sig) -> None:
        self.log.info("Received %s, stopping", signal.Signals(sig).name)
        self._stop_waiting.set()
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


GC_GEN0_THRESHOLD = 50_000


def tune_gc() -> None:
    """The broker's own process, once it serves: what it loaded at start (the live leases, the
    usage history, modules) leaves the collector's view (``gc.freeze``), and the youngest
    generation is collected after 50,000 new objects instead of 700. A request makes a few
    hundred short-lived objects that reference counting frees anyway; with the default, the
    collector ran every few requests and, under 200 clients, cost a quarter of the broker's
    throughput (``benchmarks/bench_broker.py``). Cycles are still collected, in larger rounds."""
    import gc

    gc.collect()
    gc.freeze()
    _, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(GC_GEN0_THRESHOLD, gen1, gen2)


def _route_library_logs(app: GPULeaseBroker) -> None:
    """Lines of tornado and of JupyterHub's auth code in the broker's format (prefixed, no tokens)."""
    for name in ("tornado", "jupyterhub"):
        lg = logging.getLogger(name)
        lg.handlers = list(app.log.handlers)
        lg.propagate = False
        lg.setLevel(app.log.level)
    logging.getLogger("tornado.access").setLevel(logging.WARNING)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    app = GPULeaseBroker()
    try:
        app.initialize(argv, build_manager=False)
        if app.generate_config:
            app.start()
            return 0
        if app.check_config:
            return checks.check_config_main(app)
        if app.supervise and not app.worker:
            from .supervisor import Supervisor

            checks.check_declared_devices(app)
            return Supervisor(argv, standbys=app.standbys, log=app.log).run()
        checks.build(app, app.init_manager, what="the pool and the database")
    except ConfigError as e:
        print(f"jupyter gpulease broker: {e}", file=sys.stderr)
        return EXIT_CONFIG
    _route_library_logs(app)
    app.start()
    return 0


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["GPULeaseBroker", "LeaseState", "main"]
