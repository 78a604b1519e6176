"""What an admin configures for the broker (``c.GPULeaseBroker.*``), besides the policy.

Declared on a class of their own so :class:`.app.GPULeaseBroker` reads as what it does; an
admin still sets them as ``c.GPULeaseBroker.<name>`` (traitlets applies every config section of
an application's classes), and the generated config and ``--help-all`` list them under
``GPULeaseBroker``. The policy's settings (tiers, quotas, scheduling) are
:class:`..core.policy_config.PolicyConfig`'s.
"""

from __future__ import annotations

import os

from traitlets import Any, Bool, CaselessStrEnum, Dict, Float, Integer, List, TraitError, Unicode, default, validate
from traitlets.config import LoggingConfigurable

from .manager import SystemClock

SERVICE_NAME = "gpulease"


class BrokerSettings(LoggingConfigurable):
    """The broker's storage, pool, service, limits, alerts and health settings."""

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

    # ------------------------------------------------------------------ bookings (GPUs reserved ahead, see broker/bookings.py)
    booking_max_ahead_s = Float(
        14 * 86400.0, min=0.0,
        help="Seconds ahead a booking may start at the latest (from the time it is made). Example: 1209600 (14 days).",
    ).tag(config=True)
    booking_max_length_s = Float(
        8 * 3600.0, min=60.0,
        help="The longest booking, in seconds. Example: 28800 (8 hours).",
    ).tag(config=True)
    booking_gpu_hours_per_week = Float(
        40.0, min=0.0,
        help="""GPU-hours a user may hold in bookings within any 7 days (a booking holds whole GPUs: a
        share or MIG booking counts its GPU); 0: users may not book (admins still may, for anyone).
        Admins' own bookings are not counted against it. Example: 40.""",
    ).tag(config=True)
    booking_groups = List(
        Unicode(), [],
        help="""The groups whose members may book GPUs ahead for themselves; empty: every user may.
        Admins may always book, for anyone. Example: ['staff', 'ml-course'].""",
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
        ``access:services!service=gpulease`` and the metrics scope (``metrics_scope``) or the
        admin scope, e.g. the token of a hub service for Prometheus (false: anyone who can
        reach the broker).""",
    ).tag(config=True)

    metrics_scope = Unicode(
        "custom:gpulease:metrics",
        help="""The scope that lets a caller read /metrics (every lease id, each group's use,
        unleased use): a user's token, which reaches the broker for its own leases, does not
        read them. Declare it in ``c.JupyterHub.custom_scopes`` and grant it by a role, e.g. to
        the hub service whose token Prometheus sends. The admin scope reads them too.""",
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
