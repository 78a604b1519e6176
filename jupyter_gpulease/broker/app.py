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
import time
from importlib import resources
from urllib.parse import urlsplit

from tornado.httpserver import HTTPServer
from tornado.ioloop import PeriodicCallback
from tornado.web import Application as WebApplication
from traitlets import Any, Bool, CaselessStrEnum, Dict, Float, Integer, List, TraitError, Unicode, default, validate
from traitlets.config import Application

from .. import __version__
from ..core.events import ENDED
from ..core.model import LeaseState
from ..core.policy_config import PolicyConfig
from ..tasks import BackgroundTasks
from . import checks, hubapi
from .checks import ConfigError
from .inputs import Limits
from .manager import LeaseManager, SystemClock
from .unleased import BACKENDS_WITH_PROCESSES

SERVICE_NAME = "gpulease"
EXIT_CONFIG = 2  # the config is wrong: restarting will not help
EXIT_LOST_DB = 3  # the database failed: a fresh broker (or the standby) carries on
ORPHAN_STANDBY_GRACE_S = 3.0  # a serving broker whose supervisor died: the old standby has stopped by then


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

    # the policy options are the broker's: one section in the generated config and in
    # --help-all, each with its whole help, not a "See also" of the mixin that declares it
    _POLICY_MIXINS = tuple(c for c in PolicyConfig.__mro__ if c not in Application.__mro__)

    def _classes_with_config_traits(self, classes=None):
        for cls in super()._classes_with_config_traits(classes):
            if cls not in self._POLICY_MIXINS:
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

    # ------------------------------------------------------------------ storage
    db_url = Unicode(
        "sqlite:///gpulease.sqlite",
        help="""SQLAlchemy URL of the lease database.

        A SQLite file by default (WAL journal, synchronous=FULL: every answered request is on
        disk). For larger sites, and for a standby on another machine, PostgreSQL, e.g.
        ``postgresql+psycopg://gpulease:secret@db/gpulease`` (install ``psycopg``). The schema
        is upgraded automatically at start (a SQLite file is copied to ``<file>.<rev>.bak``
        first).
        """,
    ).tag(config=True)

    sqlite_synchronous = CaselessStrEnum(
        ["OFF", "NORMAL", "FULL", "EXTRA"],
        "FULL",
        help="""SQLite's ``synchronous`` setting, when ``db_url`` is a SQLite file.

        FULL (default): a request is answered only after its change is on disk, one fsync per
        group commit. NORMAL: with WAL, a power cut may lose the last commits (a process crash
        loses nothing). Example: "NORMAL".
        """,
    ).tag(config=True)

    event_retention_days = Float(
        365.0,
        help="""Days the events (the audit log) of ended leases are kept; older ones are deleted
        once an hour. Lease rows themselves stay (usage reports read them). 0: keep every
        event. Example: 90.""",
    ).tag(config=True)

    # ------------------------------------------------------------------ the pool
    device_backend = Unicode(
        "auto",
        help="""Where the pool's GPUs come from: 'nvml' (the GPUs of this machine), 'static' (a
        declared inventory, e.g. for several nodes), 'simulated' (fake GPUs, for demos and
        tests), or 'auto' (NVML when it finds GPUs, else simulated).
        """,
    ).tag(config=True)

    devices = Dict(
        help="""Config of the device backend. For 'static' and 'simulated', ``gpus`` declares the
        inventory, one entry per group of identical GPUs on one node (``memory_mib`` required),
        e.g.::

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

    # ------------------------------------------------------------------ unleased GPU use
    unleased_check_interval = Float(
        30.0,
        help="""Seconds between checks for unleased GPU use: every compute process on every GPU
        (and MIG instance) the device backend sees ('nvml' on the broker's machine, 'simulated'),
        mapped to its owner (Unix user, cgroup, the single-user server whose environment it
        inherited) and compared with the live leases. A process on a GPU its owner does not
        lease, or of someone who is no hub user, is *unleased use*: an ``unleased-use`` event,
        metrics, a section of the admin page, and what ``unleased_use`` says. Reading other
        users' processes needs root. 0: never check. Example: 15.""",
    ).tag(config=True)
    unleased_use = CaselessStrEnum(
        ["report", "warn", "kill"],
        "warn",
        help="""What the broker does about unleased GPU use. 'report': the admin sees it (event,
        metrics, admin page). 'warn' (default): the process's owner is told too, in their
        notebook (a warning in the status bar). 'kill': told, and after ``unleased_grace_s`` the
        process is stopped (SIGTERM, SIGKILL 5 s later) — that process only; root's processes
        are never stopped. Stopping needs the broker to run as root on the GPUs' machine.
        Example: "kill".""",
    ).tag(config=True)
    unleased_grace_s = Float(
        300.0,
        help="""Seconds unleased GPU use may last before the broker stops the process, when
        ``unleased_use`` is 'kill'. Example: 120.""",
    ).tag(config=True)

    # ------------------------------------------------------------------ policy
    # tiers, quotas and every scheduling setting come from PolicyConfig, declared once in core

    # ------------------------------------------------------------------ service
    # ------------------------------------------------------------------ device figures, alerts, dcgm-exporter
    device_sample_interval = Float(
        15.0, min=0.0,
        help="""Seconds between samples of the pool's devices by the broker's own device backend
        ('nvml' on the broker's machine, 'simulated'): utilization, memory, temperature against
        the card's slowdown threshold, power and XID errors, for /metrics and the alert webhooks.
        0: none. Backends that see no devices from the broker (Kubernetes, Slurm) export none. Example: 15.""",
    ).tag(config=True)
    alert_webhooks = List(
        Dict(),
        help="""Where the broker POSTs alerts when they start and when they resolve, for admins
        without Prometheus (the same conditions as the shipped rules in config/gpulease-alerts.yml,
        but a broker that is down cannot say so). Each entry: ``{"url": ..., "format": "json" |
        "slack" | "teams"}`` (format default "json"). Example: [{"url":
        "https://hooks.slack.com/services/T000/B000/XXXX", "format": "slack"}].""",
    ).tag(config=True)

    @validate("alert_webhooks")
    def _webhooks(self, proposal):
        out = []
        for i, hook in enumerate(proposal["value"]):
            url = str(hook.get("url") or "")
            if not url.startswith(("http://", "https://")):
                raise TraitError(f"alert_webhooks[{i}] needs a 'url' that starts with http:// or https://, got {url!r}")
            unknown = sorted(set(hook) - {"url", "format"})
            if unknown:
                raise TraitError(f"alert_webhooks[{i}]: unknown key(s) {', '.join(map(repr, unknown))}; allowed: 'url', 'format'")
            fmt = str(hook.get("format") or "json").lower()
            if fmt not in ("json", "slack", "teams"):
                raise TraitError(f"alert_webhooks[{i}]: 'format' must be 'json', 'slack' or 'teams', got {hook.get('format')!r}")
            out.append({"url": url, "format": fmt})
        return out

    alert_check_interval = Float(30.0, min=1.0, help="Seconds between the broker's checks for its alert webhooks. Example: 30.").tag(config=True)
    alert_idle_lease_s = Float(7200.0, min=0.0, help="An active lease whose GPUs sat idle this long is alerted (webhooks). Example: 7200.").tag(config=True)
    alert_hot_margin_c = Float(
        5.0, min=0.0,
        help="A GPU this many degrees Celsius below its own slowdown threshold, or hotter, is alerted (webhooks; critical at the threshold). Example: 5.",
    ).tag(config=True)
    alert_xid_window_s = Float(600.0, min=0.0, help="Seconds a new critical XID error (not an application's) stays alerted (webhooks). Example: 600.").tag(config=True)
    alert_queue_wait_p95_s = Float(
        1800.0, min=0.0,
        help="The 95th percentile of waits in the queue (the last half hour's and those still waiting) above which the queue is alerted (webhooks). Example: 1800.",
    ).tag(config=True)
    alert_retry_s = Float(300.0, min=0.0, help="Seconds a failed webhook delivery is tried again (exponential back-off) before it is dropped. Example: 300.").tag(config=True)
    public_url = Unicode(
        "",
        help="""The hub's address as people reach it, e.g. https://hub.example.org: alert webhooks
        link to the broker's admin page under it ("": the link is the page's path only).""",
    ).tag(config=True)
    dcgm_hpc_job_mapping_dir = Unicode(
        "",
        help="""The folder dcgm-exporter reads with ``--hpc-job-mapping-dir``: the broker writes
        there, per GPU index, the ids of the leases holding the GPU, so DCGM's metrics carry an
        ``hpc_job`` label with the lease. ``{node}`` in the path stands for the GPU's node (one
        folder per node on shared storage). "": none. Example: /run/dcgm-job-map.""",
    ).tag(config=True)

    # ------------------------------------------------------------------ GPU health, cordons, maintenance
    health_drain_action = CaselessStrEnum(
        ["suspend", "restart"], "suspend",
        help="""What happens to a lease on a GPU that must be drained now (XID 79, 48, a lost GPU…, see
        the XID table in README): 'suspend': its server suspends its kernels during
        health_drain_grace_s, then the lease ends and the next cell resumes them on a healthy GPU
        (first in its tier); 'restart': the lease ends at once (the kernels' GPU state is lost) and
        the next request goes first in its tier. Example: 'restart'.""",
    ).tag(config=True)
    health_drain_grace_s = Float(
        60.0, min=15.0,
        help="Seconds a lease on a GPU drained now keeps it, for its server to suspend its kernels ('suspend'). Example: 60.",
    ).tag(config=True)
    health_settle_s = Float(
        300.0, min=0.0,
        help="""Seconds a GPU cordoned by its health must stay healthy after a reset before it comes back
        into the pool by itself (an admin's cordon stays until an admin uncordons it). Example: 300.""",
    ).tag(config=True)

    tick_interval = Float(5.0, help="Seconds between scheduling passes (expiries, warnings, grants). Example: 5.").tag(config=True)

    stop_servers_on_end = Bool(
        False,
        help="""Whether the broker itself asks the Hub to stop a server when the broker ends its lease
        (expired, preempted, revoked, failed; see ``stop_server_states``). Leave it off with
        GPULeaseSpawner: the spawner hears of the end through the broker's event feed and stops
        (or keeps, per its ``on_lease_end``) its own server within about a second, or at its next
        ``c.Spawner.poll_interval`` when the feed missed it. Turn it on for servers started by
        another spawner that knows nothing of leases. Needs the broker's service to hold the
        ``admin:servers`` scope (a role in jupyterhub_config.py, see the README).
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
        broker could not hear of it. The same pass warns about group names in this config that
        the hub does not know. 0: never check. Needs the broker's service to hold the scopes
        ``read:users``, ``read:servers`` and ``read:groups`` (a role in jupyterhub_config.py).
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

    show_preemptor_names = Bool(
        False,
        help="""Tell the holder of a preempted lease whose request preempted it, and a user whose
        process uses a GPU without a lease whose lease that GPU is. False (default): only the
        preempting request's tier, and "another user"; admins always see the names.""",
    ).tag(config=True)

    token_cache_max_age = Float(
        10.0,
        help="""Seconds the broker trusts a token it has checked with the hub before checking it
        again: a token revoked on the hub stops working here within this time. Longer saves
        calls to the hub; JupyterHub's own default is 300. Example: 10.""",
    ).tag(config=True)

    authenticate_metrics = Bool(
        True,
        help="""Require a hub token to read /metrics: one whose scopes include
        ``access:services!service=gpulease``, e.g. the token of a hub service for Prometheus
        (false: anyone who can reach the broker).""",
    ).tag(config=True)
    metrics_per_user = Bool(
        False,
        help="""Add per-user series to /metrics (``gpulease_user_leases``,
        ``gpulease_user_gpus_held``): one series per user who holds or waits for a lease. A
        cardinality risk on a large hub (every user becomes a time series in Prometheus), and
        the series name users to whoever may scrape; the per-group series are always there.""",
    ).tag(config=True)

    max_body_bytes = Integer(64 * 1024, help="Largest request body accepted, bytes; larger is answered 413. Example: 65536.").tag(config=True)
    max_meta_bytes = Integer(4096, help="Largest ``meta`` object of a lease request, bytes of JSON. Example: 4096.").tag(config=True)
    max_usage_bytes = Integer(4096, help="Largest ``usage`` object of a heartbeat, bytes of JSON. Example: 4096.").tag(config=True)
    max_reason_chars = Integer(1000, help="Longest ``reason`` of a release, characters. Example: 1000.").tag(config=True)
    max_json_depth = Integer(16, help="Deepest nesting of a request body's JSON, levels. Example: 16.").tag(config=True)
    max_streams_per_user = Integer(
        20,
        help="""Event streams (SSE) and waiting long polls one user may hold open at once; more are
        answered 429. Callers with the admin scope (the spawner) are bounded by ``max_streams``
        only. Example: 20.""",
    ).tag(config=True)
    max_streams = Integer(5000, help="Event streams and waiting long polls open at once, all users together. Example: 5000.").tag(config=True)
    stream_buffer_events = Integer(
        1000,
        help="""Events buffered for one event stream; a client that falls further behind is dropped
        with a reason (it reconnects with Last-Event-ID and catches up). Example: 1000.""",
    ).tag(config=True)

    supervise = Bool(
        True,
        help="""Run the broker under a small supervisor process that keeps ``standbys`` more broker
        processes waiting: when the active broker dies, a standby takes over within about a second
        (it waits on the database's lock), and the supervisor starts a new standby. False: one
        process (the hub's service poll restarts it, 10-30 s later).""",
    ).tag(config=True)
    standbys = Integer(1, help="Standby broker processes the supervisor keeps waiting (0: none; it still restarts a broker that died). Example: 1.").tag(config=True)
    worker = Bool(False, help="Internal: this process is a worker of the supervisor.").tag(config=True)

    orphan_hub_grace_s = Float(
        60.0,
        help="""A broker whose supervisor died serves on until a broker of the restarted service
        takes over. When meanwhile the hub itself does not answer for this many seconds (stopped
        or dead: nobody will restart the service), the broker stops, as it would have with its
        supervisor; the next hub starts its own. Example: 60.""",
    ).tag(config=True)

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
            self.manager.usage_recorder = UsageRecorder(s.accounting(), per_user_metrics=self.metrics_per_user)
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

    # ------------------------------------------------------------------ the hub
    def hub_home_url(self) -> str:
        """The hub's home page, for links from the broker's pages."""
        return "/" + (os.environ.get("JUPYTERHUB_BASE_URL", "/").strip("/") + "/hub/home").lstrip("/")

    @property
    def hub(self):
        """The Hub API with the broker's own token."""
        from ..client import HubClient

        if getattr(self, "_hub", None) is None:
            api_url = os.environ.get("JUPYTERHUB_API_URL") or (self.hub_auth.api_url if getattr(self, "hub_auth", None) else "")
            token = os.environ.get("JUPYTERHUB_API_TOKEN") or (self.hub_auth.api_token if getattr(self, "hub_auth", None) else "")
            self._hub = HubClient(api_url or "http://127.0.0.1:8081/hub/api", token)
        return self._hub

    async def user_groups(self, user: str) -> tuple[str, ...]:
        return await hubapi.user_groups(self.hub, user, self.log)

    async def stop_server(self, user: str, server: str, why: str) -> None:
        await hubapi.stop_server(self.hub, user, server, why, self.log)

    async def _hub_user_exists(self, name: str) -> bool | None:
        """Whether the hub has a user called ``name`` (None: the hub did not answer)."""
        from ..client import BrokerError

        try:
            return await self.hub.user(name) is not None
        except BrokerError:
            return None

    async def _check_unleased(self) -> None:
        try:
            await self.unleased.check()
        except Exception:
            self.log.exception("the check for unleased GPU use failed")

    def _on_events(self, written, events) -> None:
        if not self.stop_servers_on_end:
            return
        for e in events:
            lease = getattr(e, "lease", None)
            if e.kind == ENDED and e.from_state == "active" and e.to_state in self.stop_server_states and lease is not None:
                self._background(self.stop_server(lease.user, lease.server, e.to_state))

    def _background(self, coro) -> None:
        """Run ``coro`` as a task that is kept referenced until done (the loop holds tasks weakly)."""
        self._tasks.start(coro, what="a background task of the broker")

    RECONCILE_REASON = hubapi.RECONCILE_REASON

    async def reconcile(self) -> list[str]:
        """One check with the hub (see ``reconcile_interval``); the ids of the leases it ended."""
        if not hasattr(self, "_reconcile_state"):
            self._reconcile_state = hubapi.ReconcileState()
        return await hubapi.reconcile(self.manager, self.hub, self._reconcile_state, grace=self.reconcile_grace, interval=self.reconcile_interval, log=self.log)

    async def check_hub_groups(self) -> None:
        """Warn about group names in the config the hub does not know; again when that changes."""
        unknown = await hubapi.unknown_groups(self.policy, self.hub, self.log)
        if unknown is None:
            return
        before = getattr(self, "_unknown_groups", {})
        where = self.config_file or "(command line)"
        for g in sorted(set(unknown) - set(before)):
            self.log.warning("Config %s: the hub has no group %r (named in %s); nobody gets what it gives. Fix: create the group on the hub or correct the name",
                             where, g, ", ".join(unknown[g]))
        for g in sorted(set(before) - set(unknown)):
            self.log.info("Config %s: the hub has the group %r now", where, g)
        self._unknown_groups = unknown

    async def _reconcile(self) -> None:
        try:
            await self.reconcile()
            await self.check_hub_groups()
        except Exception:
            self.log.exception("lease check with the hub failed")

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
        self.ticker = PeriodicCallback(self.manager.tick, self.tick_interval * 1000)
        self.ticker.start()
        self.periodic = [self.ticker]
        if self.reconcile_interval > 0:
            self.periodic.append(PeriodicCallback(self._reconcile, self.reconcile_interval * 1000))
            self._background(self._reconcile())  # once at start
        if self.event_retention_days > 0:
            self.periodic.append(PeriodicCallback(self._prune, 3600 * 1000))
            self._background(self._prune())
        if self.usage_settings.sample_retention_days > 0:
            self.periodic.append(PeriodicCallback(self._prune_usage, 3600 * 1000))
            self._background(self._prune_usage())
        if self.store.dialect == "postgresql":
            self.periodic.append(PeriodicCallback(self._check_lock, 1000))
        if self.unleased is not None:
            self.periodic.append(PeriodicCallback(self._check_unleased, self.unleased_check_interval * 1000))
            self.log.info("Checking for unleased GPU use every %g s (%s; grace %g s)", self.unleased_check_interval, self.unleased.action, self.unleased_grace_s)
        if self.telemetry is not None:
            self.periodic.append(PeriodicCallback(self.telemetry.sample, self.device_sample_interval * 1000))
            self._background(self.telemetry.sample())
        if self.alerts is not None:
            self.periodic.append(PeriodicCallback(self.alerts.check, self.alert_check_interval * 1000))
        if self.dcgm is not None:
            self.dcgm.start()
        every = self.inventory_interval or float(getattr(self.backend, "inventory_refresh_s", 0) or 0)
        if every > 0:
            self.periodic.append(PeriodicCallback(self._refresh_inventory, every * 1000))
        for p in self.periodic[1:]:
            p.start()
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

    async def _prune(self) -> None:
        try:
            n = await self.manager.prune_events(self.event_retention_days * 86400)
            if n:
                self.log.info("Deleted %d event(s) of ended leases older than %g days", n, self.event_retention_days)
        except Exception:
            self.log.exception("pruning old events failed")

    async def _prune_usage(self) -> None:
        try:
            n = await self.manager.prune_usage_samples(self.usage_settings.sample_retention_days * 86400)
            if n:
                self.log.info("Deleted %d raw usage sample(s) older than %g days (the hourly roll-ups stay)", n, self.usage_settings.sample_retention_days)
        except Exception:
            self.log.exception("pruning old usage samples failed")

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

    async def _check_lock(self) -> None:
        try:
            await asyncio.get_running_loop().run_in_executor(self.manager._writer, self.store.check_leadership)
        except Exception as e:  # the connection holding the lock is gone
            self.manager._fail(e, asyncio.get_running_loop().create_future())

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

    # ------------------------------------------------------------------ the supervisor
    def _watch_supervisor(self) -> None:
        """A worker: learn at once when the supervisor dies (the end of file of its pipe)."""
        from .supervisor import SUPERVISOR_FD

        raw = os.environ.pop(SUPERVISOR_FD, None)
        if not raw or not self.worker:
            return
        fd = int(raw)
        loop = asyncio.get_running_loop()

        def readable():
            try:
                data = os.read(fd, 64)
            except BlockingIOError:
                return
            except OSError:
                data = b""
            if data:
                return  # the supervisor writes nothing; ignore it if it ever does
            loop.remove_reader(fd)
            os.close(fd)
            self._on_supervisor_gone()

        os.set_blocking(fd, False)
        loop.add_reader(fd, readable)

    def _on_supervisor_gone(self) -> None:
        if not self.store.leader:
            self.log.info("The supervisor is gone: this standby (pid %d) stops", os.getpid())
            self._stop_waiting.set()
            self._stopping.set()
            return
        self.log.warning("The supervisor is gone: this broker (pid %d) serves on until a broker of the restarted service waits "
                         "for the database's lock, then hands over", os.getpid())
        self._orphaned_at = self._hub_seen_at = time.monotonic()
        self._hub_probed_at = 0.0
        self._waiter_gone = False
        self._successor_check = PeriodicCallback(self._check_successor, 250)
        self._successor_check.start()

    async def _check_successor(self) -> None:
        """An orphan's hand-over: once a broker of the new supervisor waits for the lock, stop."""
        if self._stopping.is_set() or self._checking_successor:
            return
        self._checking_successor = True
        try:
            if not await self._hub_still_there():
                self.log.warning("The hub has not answered for %g s and nobody took over: this broker (pid %d) stops; "
                                 "the next hub starts its own", self.orphan_hub_grace_s, os.getpid())
                self._successor_check.stop()
                self._stopping.set()
                return
            waiting = await asyncio.get_running_loop().run_in_executor(self.manager._writer, self.store.successor_waiting)
        except Exception as e:
            self.log.warning("Cannot tell whether another broker waits for the lock: %s", e)
            return
        finally:
            self._checking_successor = False
        if not waiting:
            self._waiter_gone = True  # the supervisor's own standby has stopped
            return
        # a waiter seen before the old standby was seen gone may be that standby, stopping
        if self._waiter_gone or time.monotonic() - self._orphaned_at > ORPHAN_STANDBY_GRACE_S:
            self.log.info("A broker waits for the lock of %s: handing over to it", self.store.describe())
            self._successor_check.stop()
            self._stopping.set()

    async def _hub_still_there(self) -> bool:
        """An orphan's look at its hub (a TCP connect to the Hub API, every 2 s): False once it has
        not answered for ``orphan_hub_grace_s``. True without a hub to look at (run by hand)."""
        api = os.environ.get("JUPYTERHUB_API_URL", "")
        now = time.monotonic()
        if not api or now - self._hub_probed_at < 2.0:
            return True
        self._hub_probed_at = now
        parts = urlsplit(api)
        try:
            _, writer = await asyncio.wait_for(
                asyncio.open_connection(parts.hostname or "127.0.0.1", parts.port or (443 if parts.scheme == "https" else 80)), 1.0)
            writer.close()
            self._hub_seen_at = now
        except (OSError, TimeoutError):
            pass
        return now - self._hub_seen_at <= self.orphan_hub_grace_s

    def _fatal(self, exc: BaseException) -> None:
        """The database failed under the broker: end this process at once (see the manager)."""
        logging.shutdown()
        os._exit(EXIT_LOST_DB)

    _successor_check: PeriodicCallback | None = None
    _checking_successor = False

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
