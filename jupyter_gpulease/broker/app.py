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
  :mod:`.orphan` — serving on, then handing over, when the supervisor died.

:meth:`GPULeaseBroker.build_parts` builds every part of the broker and hands each what it
needs (what the broker is made of reads there); this module also serves and stops.

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
from traitlets import Bool, Set, TraitError, Unicode, default, validate
from traitlets.config import Application

from .. import __version__
from ..core.model import LeaseState
from ..core.policy_config import PolicyConfig, policy_from_config
from ..core.renames import migrated
from ..tasks import BackgroundTasks
from . import checks
from .checks import ConfigError
from .hubside import HubSide, hub_home_url
from .inputs import Limits
from .jobs import PeriodicJobs
from .manager import LeaseManager
from .orphan import OrphanHandover
from .settings import SERVICE_NAME, BrokerSettings
from .supervisor import inherited_sockets
from .tokens import TokenChecks
from .unleased import BACKENDS_WITH_PROCESSES

__all__ = ["EXIT_CONFIG", "EXIT_LOST_DB", "GC_THRESHOLDS", "SERVICE_NAME", "GPULeaseBroker", "load_openapi", "main", "tune_gc", "tune_switching"]

EXIT_CONFIG = 2  # the config is wrong: restarting will not help
EXIT_LOST_DB = 3  # the database failed: a fresh broker (or the standby) carries on


def load_openapi() -> dict:
    """The API description kept next to this module (``openapi.json``)."""
    return json.loads(resources.files(__package__).joinpath("openapi.json").read_text())


class GPULeaseBroker(BrokerSettings, PolicyConfig, Application):
    """Hands out GPU leases from a shared pool to JupyterHub users.

    Its settings are declared on :class:`BrokerSettings` and :class:`PolicyConfig` (traits
    only); its parts, built by :meth:`build_parts`, are held here (None until built, or where
    the config turns them off)."""

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
    # (traitlets has no public hook for which classes those list: Application.classes only adds)
    _CONFIG_MIXINS = tuple(c for c in (*BrokerSettings.__mro__, *PolicyConfig.__mro__) if c not in Application.__mro__)

    def _classes_with_config_traits(self, classes=None):
        for cls in super()._classes_with_config_traits(classes):
            if cls not in self._CONFIG_MIXINS:
                yield cls

    # old option names (core/renames.py) move to their new names before any option is set from a
    # config: traitlets' two public hooks, the config given at construction and every loaded one
    _renames_said = Set()  # each old-name warning once

    @validate("config")
    def _config_with_new_names(self, proposal):
        return migrated(self, proposal.value, self._renames_said)

    def update_config(self, config):
        super().update_config(migrated(self, config, self._renames_said))

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
        self.policy = checks.build(self, lambda: policy_from_config(self), what="the tiers and quotas")
        for line in checks.policy_warnings(self.policy):
            self.log.warning("Config %s: %s", self.config_file or "(command line)", line)
        if build_manager and not self.check_config:
            checks.build(self, self.build_parts, what="the pool and the database")

    # the parts (see build_parts)
    backend = scheduler = store = past = read_ahead = manager = usage_settings = usage = hub_side = None
    health = bookings = telemetry = unleased = metrics = alerts = dcgm = jobs = orphan = None
    hub_auth = hub_oauth = web_app = http_server = None
    _hub = None

    def build_parts(self) -> None:
        """Build every part of the broker and hand each what it needs, in this order: each part
        is built after the parts it is given. The parts that hold the manager are handed to it
        last (``LeaseManager.wire``)."""
        from ..core.scheduler import Scheduler
        from ..devices import get_backend
        from ..store import LeaseStore
        from .bookings import BookingDesk
        from .feed import Feed
        from .health import HealthKeeper
        from .manager import usage_lookback
        from .metrics import BrokerMetrics, count_events
        from .past import PastLeases, ReadAhead
        from .usage import GPULeaseUsage, UsageAPI, UsageRecorder, offers_of

        log = self.log
        self.backend = backend = get_backend(self.device_backend, self.devices)
        inventory = backend.inventory()
        log.info("Pool: %d GPU(s) from the %r device backend", len(inventory), self.device_backend)
        self.scheduler = Scheduler(inventory, self.policy)
        self.store = store = LeaseStore(self.db_url, sqlite_synchronous=self.sqlite_synchronous, migrate=False)
        # the leases that ended lately: the usage window, and the hour the health keeper reads
        self.past = PastLeases(store, keep_s=max(usage_lookback(self.policy), HealthKeeper.MOVED_MEMORY_S), now=self.clock.now)
        self.usage_settings = us = GPULeaseUsage(parent=self)
        recorder = UsageRecorder(us.accounting(), per_user_metrics=self.metrics_per_user, sample_s=us.sample_interval_s,
                                 write_s=us.write_interval_s) if us.record else None
        feed = Feed(buffer=self.stream_buffer_events, max_per_user=self.max_streams_per_user, max_total=self.max_streams)
        self.manager = manager = LeaseManager(self.scheduler, store, clock=self.clock, logger=log, feed=feed, show_preemptor_names=self.show_preemptor_names,
                                              count_totals=count_events, usage_recorder=recorder, on_fatal=self._lost_database, past=self.past)
        self.read_ahead = ReadAhead(store, self.past, then=manager.record_past, logger=log)
        self.usage = UsageAPI(store, us.accounting(), offers=lambda: offers_of(manager.inventory()), clock=self.clock.now,
                              min_leases=us.suggestion_min_leases, suggestion_days=us.suggestion_days)
        self.hub_side = HubSide(manager, self.policy, hub=lambda: self.hub, tasks=self._tasks, logger=log, stop_servers_on_end=self.stop_servers_on_end,
                                stop_server_states=self.stop_server_states, reconcile_grace=self.reconcile_grace,
                                reconcile_interval=self.reconcile_interval, config_file=self.config_file)
        self.health = HealthKeeper(manager, settle_s=self.health_settle_s, drain_action=self.health_drain_action.lower(),
                                   drain_grace_s=self.health_drain_grace_s, logger=log, past=self.past)
        self.bookings = BookingDesk(manager, max_ahead_s=self.booking_max_ahead_s, max_length_s=self.booking_max_length_s,
                                    gpu_hours_per_week=self.booking_gpu_hours_per_week, groups=self.booking_groups, logger=log)
        self._build_device_parts(manager)
        self.metrics = BrokerMetrics(manager, per_user=self.metrics_per_user, telemetry=self.telemetry, health=self.health, unleased=self.unleased)
        if self.alert_webhooks:
            from .alerts import BrokerAlerts, Thresholds

            self.alerts = BrokerAlerts(
                manager, self.alert_webhooks, logger=log, retry_s=self.alert_retry_s, link=self.public_url.rstrip("/") + self.base_url + "admin",
                limits=Thresholds(idle_lease_s=self.alert_idle_lease_s, hot_margin_c=self.alert_hot_margin_c, xid_window_s=self.alert_xid_window_s,
                                  queue_wait_p95_s=self.alert_queue_wait_p95_s),
                telemetry=self.telemetry, health=self.health, unleased=self.unleased)
        if self.dcgm_hpc_job_mapping_dir:
            from .dcgm import DcgmJobMap

            self.dcgm = DcgmJobMap(manager, self.dcgm_hpc_job_mapping_dir, logger=log)
        manager.wire(listeners=[p.on_events for p in (self.hub_side, self.alerts, self.dcgm) if p is not None], health=self.health,
                     warnings=[self.health.warnings] if self.unleased is None else [self.unleased.lease_warnings, self.health.warnings])
        self.jobs = PeriodicJobs(
            manager, backend=backend, tasks=self._tasks, logger=log, tick_s=self.tick_interval, inventory=inventory, backend_name=self.device_backend,
            inventory_s=self.inventory_interval or float(getattr(backend, "inventory_refresh_s", 0) or 0),
            hub_check=self.hub_side.check, reconcile_s=self.reconcile_interval, event_retention_days=self.event_retention_days,
            usage_retention_days=us.sample_retention_days, lock_check=store.dialect == "postgresql",
            unleased=self.unleased, unleased_check_s=self.unleased_check_interval, telemetry=self.telemetry, sample_s=self.device_sample_interval,
            alerts=self.alerts, alert_check_s=self.alert_check_interval, dcgm=self.dcgm)
        self.orphan = OrphanHandover(store, in_writer=manager.in_writer, stop=self._request_stop, worker=self.worker,
                                     hub_grace_s=self.orphan_hub_grace_s, logger=log)

    def _build_device_parts(self, manager) -> None:
        """The parts that look at the devices from the broker's machine (where its backend sees
        them): the device samples (the health keeper listens to them) and the unleased-use check."""
        from .telemetry import DeviceTelemetry, SharedSample
        from .unleased import UnleasedDetector

        here = self.backend.name in BACKENDS_WITH_PROCESSES
        # both read every device of the pool, and their jobs fall due together: one sample serves both
        shared = SharedSample(self.backend)
        if self.device_sample_interval > 0 and here:
            self.telemetry = DeviceTelemetry(manager, shared, interval_s=self.device_sample_interval, logger=self.log,
                                             listeners=[self.health.on_samples])
        if self.unleased_check_interval > 0 and here:
            self.unleased = UnleasedDetector(manager, shared, action=self.unleased_use.lower(), grace_s=self.unleased_grace_s,
                                             hub_user_exists=self.hub_side.user_exists, logger=self.log, show_holders=self.show_preemptor_names)

    @property
    def hub(self):
        """The Hub API with the broker's own token (where the hub is: the environment, else the
        web app's HubAuth)."""
        from ..client import HubClient

        if self._hub is None:
            auth = self.hub_auth
            api_url = os.environ.get("JUPYTERHUB_API_URL") or (auth.api_url if auth is not None else "")
            token = os.environ.get("JUPYTERHUB_API_TOKEN") or (auth.api_token if auth is not None else "")
            self._hub = HubClient(api_url or "http://127.0.0.1:8081/hub/api", token)
        return self._hub

    def hub_home_url(self) -> str:
        """The hub's home page, for links from the broker's pages."""
        return hub_home_url()

    @property
    def limits(self) -> Limits:
        return Limits(body_bytes=self.max_body_bytes, meta_bytes=self.max_meta_bytes, usage_bytes=self.max_usage_bytes, reason_chars=self.max_reason_chars, json_depth=self.max_json_depth)

    def make_web_app(self) -> WebApplication:
        """The tornado Application: the REST API's routes (:meth:`api_routes`), then the pages."""
        from jupyterhub.services.auth import HubAuth, HubOAuth

        from .pages import page_handlers

        hub_auth = HubAuth(parent=self, base_url=self.base_url, cache_max_age=int(self.token_cache_max_age))
        hub_oauth = HubOAuth(parent=self, base_url=self.base_url, cache_max_age=int(self.token_cache_max_age))
        self.hub_auth, self.hub_oauth = hub_auth, hub_oauth
        settings = {
            "hub_auth": hub_auth,
            "hub_oauth": hub_oauth,
            "cookie_secret": os.urandom(32),
            "xsrf_cookies": True,
            "login_url": hub_oauth.login_url,
            "gpulease_manager": self.manager,
            "gpulease_broker": self,
            "gpulease_hub_side": self.hub_side,
            "gpulease_health": self.health,
            "gpulease_bookings": self.bookings,
            "gpulease_unleased": self.unleased,
            "gpulease_admin_scope": self.admin_scope,
            "gpulease_metrics": self.metrics,
            "gpulease_openapi": load_openapi(),
            "gpulease_authenticate_metrics": self.authenticate_metrics,
            "gpulease_metrics_scope": self.metrics_scope,
            "gpulease_limits": self.limits,
            "log_function": self._log_request,
            "gpulease_calls": set(),  # the API calls being answered (the stop lets them finish)
            "gpulease_token_checks": TokenChecks(),
        }
        return WebApplication(self.api_routes() + page_handlers(self.base_url), **settings)

    def api_routes(self) -> list[tuple]:
        """The REST API's routes; the last one answers any other ``api/`` path 404."""
        from . import booking_handlers, unleased, usage_handlers
        from .handlers import api_handlers
        from .health_handlers import api_handlers as health_api_handlers

        routes = api_handlers(self.base_url)
        routes[-1:-1] = unleased.api_handlers(self.base_url)  # before the catch-all 404
        routes[-1:-1] = health_api_handlers(self.base_url)
        routes[-1:-1] = booking_handlers.api_handlers(self.base_url)
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


    # ------------------------------------------------------------------ running
    async def wait_for_leadership(self) -> bool:
        """Wait until this broker holds the database's lock (False: told to stop first)."""
        loop = asyncio.get_running_loop()
        store = self.store

        def waiting():
            self.log.info("Standing by (pid %d): another broker holds the lock of %s; taking over when it stops", os.getpid(), store.describe())

        # a file lock is one system call to try; a PostgreSQL lock a query. Between tries, a
        # standby reads ahead what taking over would read (past.py)
        poll_s = 0.05 if store.dialect == "sqlite" else 0.1
        return await loop.run_in_executor(None, lambda: store.acquire_leadership(self._stop_waiting, poll_s=poll_s, on_wait=waiting, idle=self.read_ahead))

    async def start_async(self) -> bool:
        """Wait for the lock, upgrade the schema, restore, listen, tick. False if stopped while
        standing by. What needs no lock is made before it (a standby has it ready)."""
        self.web_app = self.make_web_app()
        if not await self.wait_for_leadership():
            return False
        await self.manager.start()
        await self.health.start()
        self.past.clear()  # read by both at start; the scheduler keeps the usage from here on
        url = urlsplit(self.bind_url)
        self._quiet_successes = self.log_level > logging.DEBUG
        # no xheaders: the broker never uses the client's address, and checking it costs a lookup per call
        self.http_server = HTTPServer(self.web_app, max_body_size=max(4 * self.max_body_bytes, 1 << 20))
        held = inherited_sockets()  # the supervisor's: connections waited there for this broker
        if held:
            self.http_server.add_sockets(held)
        else:
            await self._listen(url.port or 80, url.hostname or "127.0.0.1")
        self.backend.start()  # a backend that follows its source (the Kubernetes node watch) does it on this loop
        self.jobs.start()
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
        if self.jobs is not None:
            self.jobs.stop()
        if self.orphan is not None:
            self.orphan.stop()
        server = self.http_server
        if server is not None:
            server.stop()
        if self.alerts is not None:
            await self.alerts.close()
        if self.unleased is not None:
            await self.unleased.close()
        if self.manager is not None:
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
        if self.backend is not None:
            self.backend.close()
        self.log.info("GPU lease broker stopped")

    lost_database: BaseException | None = None  # why the database failed under this broker
    _exit_on_lost_database = False  # a broker process (_run) ends at once; one embedded in tests answers 503 until stopped

    def _lost_database(self, exc: BaseException) -> None:
        """The database failed under the broker (the manager's ``on_fatal``): a broker process
        ends at once (see the manager), so that its standby or the restarted broker carries on."""
        self.lost_database = exc
        if self._exit_on_lost_database:
            logging.shutdown()
            os._exit(EXIT_LOST_DB)

    async def _run(self) -> None:
        self._stopping = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._on_signal, sig)
        self.orphan.watch()
        self._exit_on_lost_database = True
        if await self.start_async():
            tune_gc()
            tune_switching()
            await self._stopping.wait()
        await self.stop_async()

    def _on_signal(self, sig) -> None:
        self.log.info("Received %s, stopping", signal.Signals(sig).name)
        self._request_stop()

    def _request_stop(self) -> None:
        """Stop standing by, or stop serving (a signal, or the orphan's hand-over)."""
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


GC_THRESHOLDS = (10_000, 2, 164)  # the collector's, once the broker serves (see tune_gc)


def tune_gc() -> None:
    """The broker's own process, once it serves: what it loaded at start (the live leases, the
    usage history, modules) leaves the collector's view (``gc.freeze``), and each collection is
    kept short, since it stops every thread, the event loop's too, while it runs:

    * the youngest generation is collected after 10,000 new objects instead of 700. A request
      makes a few hundred short-lived objects that reference counting frees anyway; with the
      default, the collector ran every few requests and, under 200 clients, cost a quarter of the
      broker's throughput (``benchmarks/bench_broker.py --stress``);
    * the middle one at every fourth collection instead of every twelfth. A pause lasts as long
      as the young objects still alive take to walk, and a busy broker keeps most of what it makes
      (a lease's committed state and usage record at each heartbeat): under the heartbeats of
      10,000 servers, young collections after 50,000 new objects walked ~100,000 (60-80 ms of
      CPU) and every twelfth ~350,000 (~280 ms), the slowest answers of the window; after 10,000
      and every fourth, none walks more than ~60,000 (~60 ms at most; ``--stalls``). The price:
      under 200 clients the collector takes ~30 µs of CPU per call instead of ~12;
    * the oldest generation (a full collection: ~0.5 s with 10,000 leases) as rarely as before:
      after 165 middle ones instead of 11 (10,000 × 4 × 165 and 50,000 × 12 × 11 are both ~6.6
      million new objects), and, as Python does, only once a quarter more objects than the last
      one kept have reached it since.

    Cycles are still collected: one that outlives the young collections waits for a full one."""
    import gc

    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


SWITCH_INTERVAL_S = 0.001


def tune_switching() -> None:
    """The broker's own process, once it serves: a thread that holds the GIL (the store's writer,
    the device samples of a large pool) hands it back to the event loop within 1 ms instead of
    Python's 5 ms. The loop lets go of the GIL at every socket read and write and every wait for
    events, and may then wait up to the switch interval to get it back while a worker computes:
    a heartbeat does that several times, which made tens of milliseconds under a pool's device
    sample (``benchmarks/bench_broker.py --stalls``)."""
    sys.setswitchinterval(SWITCH_INTERVAL_S)


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
            url = urlsplit(app.bind_url)
            return Supervisor(argv, standbys=app.standbys, log=app.log, listen=(url.hostname or "127.0.0.1", url.port or 80)).run()
        checks.build(app, app.build_parts, what="the pool and the database")
    except ConfigError as e:
        print(f"jupyter gpulease broker: {e}", file=sys.stderr)
        return EXIT_CONFIG
    _route_library_logs(app)
    app.start()
    return 0


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["GPULeaseBroker", "LeaseState", "main"]
