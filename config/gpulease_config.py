# Configuration of the GPU lease broker (jupyter-gpulease).
#
# JupyterHub starts the broker as a managed service (see jupyterhub_config.py and the
# README's "Running the broker"), passing this file with --config. Every option is listed,
# with its default, by:  python -m jupyter_gpulease.broker --generate-config
#
# Units: times and durations in seconds (POSIX seconds for points in time), memory in MiB,
# GPU counts in GPUs (a share of one GPU counts by its fraction).

c = get_config()  # noqa: F821

# --------------------------------------------------------------------------- storage
# SQLAlchemy URL of the lease database: a SQLite file (WAL, synchronous=FULL) by default;
# PostgreSQL for larger sites, e.g. "postgresql+psycopg://gpulease:secret@db/gpulease".
c.GPULeaseBroker.db_url = "sqlite:////srv/jupyterhub/gpulease.sqlite"

# --------------------------------------------------------------------------- the pool
# 'nvml' (this machine's GPUs), 'static' (a declared inventory, e.g. several nodes whose
# GPUs the broker cannot see), 'simulated' (fake GPUs for demos), 'auto' (nvml if it finds
# GPUs, else simulated).
c.GPULeaseBroker.device_backend = "static"

# For 'static' and 'simulated': one entry per group of identical GPUs on one node.
# 'mig' puts every GPU of the entry in MIG mode with those instances.
c.GPULeaseBroker.devices = {
    "gpus": [
        {"node": "gpu-1", "model": "A100-SXM4-80GB", "count": 4, "memory_mib": 81920},
        {"node": "gpu-2", "model": "A100-SXM4-80GB", "memory_mib": 81920, "mig": {"1g.10gb": 7}},
        {"node": "gpu-2", "model": "L4", "count": 2, "memory_mib": 23034},
    ]
}

# --------------------------------------------------------------------------- tiers
# Priority classes. Higher priority is served first; a preemptible tier may be preempted
# by higher tiers after grace_s seconds of warning. users/groups limit who may use a tier
# (both empty: everyone).
c.GPULeaseBroker.tiers = {
    "production": {
        "priority": 30,
        "max_duration_s": 24 * 3600,  # longest grant, and longest step of an extension
        "default_duration_s": 8 * 3600,
        "max_lifetime_s": 72 * 3600,  # cap including extensions
        "groups": ["staff"],
        "description": "deadline work; preempts learning",
    },
    "experiment": {"priority": 20, "max_duration_s": 8 * 3600, "default_duration_s": 2 * 3600, "description": "day-to-day research"},
    "learning": {
        "priority": 10,
        "max_duration_s": 4 * 3600,
        "default_duration_s": 3600,
        "preemptible": True,
        "grace_s": 600,
        "description": "courses and tinkering; may be preempted",
    },
}
c.GPULeaseBroker.default_tier = "experiment"

# --------------------------------------------------------------------------- quotas
# max_gpus: GPUs held at once; gpu_hours: GPU-hours per rolling period_s. Missing: no limit.
c.GPULeaseBroker.default_user_quota = {"max_gpus": 2, "gpu_hours": 100, "period_s": 7 * 24 * 3600}
c.GPULeaseBroker.user_quotas = {"alice": {"max_gpus": 4, "gpu_hours": 300}}
c.GPULeaseBroker.group_quotas = {"students": {"max_gpus": 2}}  # all members together

# --------------------------------------------------------------------------- scheduling
c.GPULeaseBroker.fair_share = True  # within a tier, less recent use goes first
c.GPULeaseBroker.fair_share_half_life_s = 7 * 24 * 3600  # seconds
c.GPULeaseBroker.backfill = True  # small requests may start ahead of a blocked big one if they do not delay it
c.GPULeaseBroker.preemption = True
c.GPULeaseBroker.reservation_depth = 100  # queued leases that get a reservation and an ETA each pass
c.GPULeaseBroker.max_queued_per_user = 100  # requests one user may have waiting; one more is answered 429; 0: no limit
c.GPULeaseBroker.extend_when_contended = False  # refuse extensions while a lease of the same or a higher tier (or an aged one) waits for these GPUs
c.GPULeaseBroker.aging_s = 1800  # s: a lease waiting this long goes before newer higher-tier ones; 0: never
c.GPULeaseBroker.multi_gpu_aging = 1.0  # a request for several whole GPUs ages after aging x this (0.5: sooner)
c.GPULeaseBroker.short_grants = True  # preemptible leases may start on promised GPUs until the promise begins
c.GPULeaseBroker.placement_by_preemptibility = True  # keep preemptible work together so whole nodes can be freed
c.GPULeaseBroker.share_placement = "best_fit"  # or "fragmentation": leave room for the share sizes people ask for
c.GPULeaseBroker.warn_before_s = 600  # seconds before expiry the holder is warned
c.GPULeaseBroker.min_duration_s = 600  # shortest lease anyone may ask for (seconds)
c.GPULeaseBroker.resume_priority = False  # True: a kernel coming back after an idle reclaim goes ahead of new requests of its tier
c.GPULeaseBroker.tick_interval = 5  # seconds between scheduling passes

# Every lease ends, even if its holder dies: one never confirmed (its server never came
# up) is revoked after confirm_timeout_s; one whose heartbeats stop after heartbeat_timeout_s.
c.GPULeaseBroker.confirm_timeout_s = 900  # 0: never
c.GPULeaseBroker.heartbeat_timeout_s = 300  # 0: never; the server extension sends one every 30 s (GPULeaseExtension.heartbeat_interval)

# --------------------------------------------------------------------------- the hub
# Stop the holder's server when the broker ends its lease (expired, preempted, revoked,
# failed). Needs the 'admin:servers' scope for the gpulease service (a role in
# jupyterhub_config.py). Leave off for the local engine, where a server may outlive its lease.
c.GPULeaseBroker.stop_servers_on_end = False
c.GPULeaseBroker.stop_server_states = ["expired", "preempted", "revoked", "failed"]

# Check with the hub, at start and every reconcile_interval seconds, that each lease held by
# the lease spawner still has its server (running or starting). A lease whose server has
# been gone for reconcile_grace seconds is revoked (withdrawn while still queued, e.g. a
# spawn the hub forgot when it died): the hub stops its services before its
# servers on shutdown, so the spawner's own release cannot reach the broker then. Needs the
# 'read:users' and 'read:servers' scopes for the gpulease service (a role in
# jupyterhub_config.py). A hub that does not answer changes nothing.
c.GPULeaseBroker.reconcile_interval = 300  # 0: never check
c.GPULeaseBroker.reconcile_grace = 120

# The scope that lets a caller see all leases and act for users (the spawner needs it).
c.GPULeaseBroker.admin_scope = "custom:gpulease:admin"

# Require a hub token for /metrics (Prometheus: the token of a hub service whose role has
# access:services!service=gpulease; scrape config in config/prometheus.yml).
c.GPULeaseBroker.authenticate_metrics = True
# Per-user series in /metrics: one time series per user with a lease (a cardinality risk on a
# large hub); the per-group series are always there.
c.GPULeaseBroker.metrics_per_user = False

# bind_url and base_url come from JUPYTERHUB_SERVICE_URL and JUPYTERHUB_SERVICE_PREFIX when
# the hub runs the broker; set them only for a broker you run yourself:
# c.GPULeaseBroker.bind_url = "http://127.0.0.1:10101"
# c.GPULeaseBroker.base_url = "/services/gpulease/"
