# JupyterHub with GPU leases: an annotated example.
#
# This is the file `jupyter gpulease demo` runs, and the one an admin starts from. The demo
# passes its folder, ports and secrets in GPULEASE_DEMO_* environment variables; on a real
# hub, replace those lookups with fixed values (and a real authenticator).
#
# The parts:
#   1. the lease broker, run by the hub as a managed service ("gpulease");
#   2. a token-only service ("gpulease-spawner") whose token the spawner uses to ask the
#      broker for leases on behalf of users: it needs the custom scope custom:gpulease:admin;
#   3. the spawner: c.JupyterHub.spawner_class = "gpulease-local" (system users) or
#      "gpulease-simple" (no system users; demos and tests only);
#   4. roles: users may reach the broker (their servers' extension and the %gpu magics do),
#      the spawner's service holds the admin scope, the broker may stop servers;
#   5. jupyterhub-idle-culler, when installed, with the GPU lease hook (idle_culler_config.py).

import importlib.util
import json
import os
import secrets
import sys
from pathlib import Path

from jupyter_gpulease.hub.pages import TEMPLATE_PATH

c = get_config()  # noqa: F821 - provided by JupyterHub

env = os.environ.get
here = Path(__file__).resolve().parent
state = Path(env("GPULEASE_DEMO_DIR", "demo-state")).resolve()  # everything the hub writes lives here
state.mkdir(parents=True, exist_ok=True)

port = int(env("GPULEASE_DEMO_PORT", "8000"))
hub_port = int(env("GPULEASE_DEMO_HUB_PORT", "8081"))
proxy_api_port = int(env("GPULEASE_DEMO_PROXY_API_PORT", "8001"))
broker_port = int(env("GPULEASE_DEMO_BROKER_PORT", "10101"))

# ------------------------------------------------------------------ the hub and its proxy
c.JupyterHub.bind_url = f"http://127.0.0.1:{port}"
c.JupyterHub.hub_bind_url = f"http://127.0.0.1:{hub_port}"
c.JupyterHub.db_url = f"sqlite:///{state / 'jupyterhub.sqlite'}"
c.JupyterHub.cookie_secret_file = str(state / "jupyterhub_cookie_secret")
# configurable-http-proxy with an error target of its own: a program calling the broker's API
# while it hands over to its standby gets JSON (503 Unavailable), not the hub's HTML page.
c.JupyterHub.proxy_class = "jupyter_gpulease.hub.proxy.GPULeaseProxy"
c.ConfigurableHTTPProxy.api_url = f"http://127.0.0.1:{proxy_api_port}"
c.ConfigurableHTTPProxy.pid_file = str(state / "jupyterhub-proxy.pid")
if env("GPULEASE_CHP"):  # where configurable-http-proxy is, when it is not on PATH
    c.ConfigurableHTTPProxy.command = [env("GPULEASE_CHP")]
# On shutdown the hub stops every server (the default). The lease spawner goes first: the
# broker stops granting, spawns waiting in the queue are withdrawn (their users are told),
# then servers with GPU leases stop and their leases are given back while the broker still
# runs. With c.JupyterHub.cleanup_servers = False servers keep running across a hub restart
# and keep their leases: the restarted hub follows them again from the saved spawner state.
c.JupyterHub.cleanup_servers = True

# ------------------------------------------------------------------ who may log in
# The demo: any user name, one shared password. A real hub uses its site's authenticator.
c.JupyterHub.authenticator_class = "jupyter_gpulease.hub.demo.DemoAuthenticator"
c.DemoAuthenticator.password = env("GPULEASE_DEMO_PASSWORD", "gpulease")
c.Authenticator.allow_all = True
c.Authenticator.admin_users = {"admin"}
if env("GPULEASE_DEMO_DIR"):
    # the groups gpulease_config.py gives a tier and a quota to; a real hub has its own groups
    c.JupyterHub.load_groups = {"staff": {"users": []}, "students": {"users": []}}

# ------------------------------------------------------------------ the lease broker service
broker_url = f"http://127.0.0.1:{broker_port}"
broker_config = env("GPULEASE_BROKER_CONFIG", str(here / "gpulease_config.py"))
broker_cmd = [sys.executable, "-m", "jupyter_gpulease.cli", "broker"]
if os.path.exists(broker_config):
    broker_cmd.append(f"--config={broker_config}")
broker_cmd.append(f"--db-url=sqlite:///{state / 'gpulease.sqlite'}")
if env("GPULEASE_DEVICE_BACKEND"):  # auto (NVML if it finds GPUs, else simulated), nvml, simulated, static
    broker_cmd.append(f"--device-backend={env('GPULEASE_DEVICE_BACKEND')}")

# The spawner's token. The demo keeps one in its folder; on a real hub generate one
# (openssl rand -hex 32) and give it to the hub's environment as GPULEASE_HUB_TOKEN.
spawner_token = env("GPULEASE_HUB_TOKEN") or secrets.token_hex(32)

c.JupyterHub.services = [
    {
        "name": "gpulease",
        "url": broker_url,
        "command": broker_cmd,
        "cwd": str(state),
        "oauth_no_confirm": True,  # the broker's pages log browsers in through the hub without a consent page
        # the login to the broker's pages may carry the admin scope of those who hold it
        "oauth_client_allowed_scopes": ["custom:gpulease:admin"],
        "display": True,  # listed in the hub's Services menu: each user's leases; the admin page for admins
    },
    {"name": "gpulease-spawner", "api_token": spawner_token},
]
if env("GPULEASE_DEMO_ADMIN_TOKEN"):
    # the demo command's own token: it reads which servers run (what it says when it stops)
    c.JupyterHub.services.append({"name": "gpulease-demo", "api_token": env("GPULEASE_DEMO_ADMIN_TOKEN")})

# ------------------------------------------------------------------ scopes and roles
c.JupyterHub.custom_scopes = {
    "custom:gpulease:admin": {"description": "See and change every GPU lease, and ask for leases on behalf of users."},
    # reads the broker's /metrics (every lease, each group's use): give it to Prometheus' service
    "custom:gpulease:metrics": {"description": "Read the GPU lease broker's metrics (every lease, each group's use)."},
}
c.JupyterHub.load_roles = [
    # Users reach the broker: their own leases, the pool, the queue (through their servers'
    # tokens too, see server_token_scopes below).
    {"name": "user", "scopes": ["self", "access:services!service=gpulease"]},
    # The spawner asks for leases for users; only the hub process holds this token.
    {"name": "gpulease-spawner", "scopes": ["custom:gpulease:admin", "access:services!service=gpulease"], "services": ["gpulease-spawner"]},
    # The broker reads users' groups (group tiers and quotas; read:users), the hub's group
    # names to check the ones in its config (list:groups, read:groups), checks every
    # GPULeaseBroker.reconcile_interval seconds that each leased server still exists
    # (read:users + read:servers: a lease whose server is gone is revoked, e.g. after the hub
    # stopped its servers while the broker was down), and may stop a server whose lease ended
    # (admin:servers, for GPULeaseBroker.stop_servers_on_end).
    {"name": "gpulease-broker", "scopes": ["read:users", "read:servers", "read:groups", "list:groups", "admin:servers"], "services": ["gpulease"]},
    # Hub admins manage every lease on the broker's admin page.
    {"name": "gpulease-admins", "scopes": ["custom:gpulease:admin", "access:services!service=gpulease"], "users": ["admin"]},
]
if env("GPULEASE_DEMO_ADMIN_TOKEN"):
    c.JupyterHub.load_roles.append({"name": "gpulease-demo", "scopes": ["list:users", "read:users", "read:servers"], "services": ["gpulease-demo"]})

# ------------------------------------------------------------------ the idle culler
# jupyterhub-idle-culler 2 (pip install jupyterhub-idle-culler), with the hook that keeps servers
# whose GPUs work and culls servers whose GPU lease sits idle sooner (idle_culler_config.py):
# README, "The idle culler".
if importlib.util.find_spec("jupyterhub_idle_culler") is not None:
    c.JupyterHub.services.append({
        "name": "idle-culler",
        "command": [sys.executable, "-m", "jupyterhub_idle_culler", "--timeout=3600",
                    f"--config={here / 'idle_culler_config.py'}"],
    })
    c.JupyterHub.load_roles.append({
        "name": "idle-culler",
        "scopes": [
            # the culler's own: who has servers, their last activity, stopping them
            "list:users", "read:users:activity", "read:servers", "delete:servers",
            # the hook's: where the broker is, reaching it, every user's leases (and releasing them)
            "read:services!service=gpulease", "access:services!service=gpulease", "custom:gpulease:admin",
        ],
        "services": ["idle-culler"],
    })

# ------------------------------------------------------------------ the hub's pages
# The home page shows each server's GPU lease (what it holds, time left, place in the queue,
# why the last one ended); the spawn page shows the place in the queue while a spawn waits.
c.JupyterHub.template_paths = [TEMPLATE_PATH]

# ------------------------------------------------------------------ the spawner
c.JupyterHub.spawner_class = "gpulease-simple" if env("GPULEASE_DEMO_DIR") else "gpulease-local"
c.GPULeaseSpawner.broker_url = f"{broker_url}/services/gpulease/"  # the hub talks to the broker directly
c.GPULeaseSpawner.broker_api_token = spawner_token
# How long a spawn may wait in the queue; the hub's start_timeout is stretched by this much.
c.GPULeaseSpawner.lease_wait_timeout = 2 * 3600
# When a lease ends (after the broker's warning): "stop" the server, or "keep" it without GPU.
c.GPULeaseSpawner.on_lease_end = "stop"
# Named options on the spawn form (leave empty for free choice of model, count, share, MIG
# profile, tier and duration). Each works through the REST API too: {"preset": "<slug>"}.
c.GPULeaseSpawner.lease_presets = []
# e.g.:
# c.GPULeaseSpawner.lease_presets = [
#     {"slug": "cpu", "display_name": "CPU only", "cpu_only": True},
#     {"slug": "l4-half", "display_name": "Half an L4", "request": {"share": 0.5, "model": "L4"},
#      "tier": "learning", "default": True},
#     {"slug": "a100", "display_name": "One A100 (80 GB)", "request": {"gpus": 1, "model": "A100*"},
#      "tier": "experiment", "duration_s": 4 * 3600},
# ]
# c.GPULeaseSpawner.allow_custom_request = False   # presets only
c.GPULeaseSpawner.allow_cpu_only = True

# The single-user server's token may reach the broker (the server extension sends heartbeats,
# extends and releases with it).
c.Spawner.server_token_scopes = ["users:activity!user", "access:servers!server", "access:services!service=gpulease"]
c.Spawner.cmd = [str(Path(sys.executable).with_name("jupyterhub-singleuser"))]
c.Spawner.default_url = "/lab"
if not env("GPULEASE_DEMO_DIR"):
    # servers run as system users: say at hub start when they could not run the command (a venv
    # made from a Python in root's home fails the first spawn with 'Permission denied')
    from jupyter_gpulease.hub.startcheck import unreachable_by_others

    if (_warning := unreachable_by_others(c.Spawner.cmd[0])):
        print(f"[W jupyterhub_config] {_warning}", file=sys.stderr)
# Seconds between the hub's checks of each server. The spawner hears of a lease's end through
# the broker's event feed and stops the server within about a second; when it missed the end
# (the broker was restarting), the next poll reads the lease: this bounds how late that is.
c.Spawner.poll_interval = 10
# The servers' GPU figures (status bar, %gpu, the widget) come from the same device backend as
# the broker's pool. Simulated GPUs (the demo without NVIDIA GPUs): the servers share one state
# file, so utilization driven there (SimulatedBackend.set_utilization) shows in every notebook.
if env("GPULEASE_DEVICE_BACKEND"):
    c.Spawner.environment.update({"GPULEASE_DEVICE_BACKEND": env("GPULEASE_DEVICE_BACKEND")})
if env("GPULEASE_DEVICE_BACKEND") == "simulated":
    c.Spawner.environment.update({"GPULEASE_DEVICE_CONFIG": json.dumps({"state_file": str(state / "sim-gpus.json")})})
if os.getuid() == 0:
    c.Spawner.args = ["--allow-root"]
if env("GPULEASE_DEMO_DIR"):
    # The demo shows the idle cycle within minutes (a real hub keeps the extension's defaults, or
    # sets its own in the servers' jupyter_server_config.py): a kernel whose GPU sits idle is
    # warned after 1 min and suspended after 2 min (on simulated GPUs by the simulated
    # cuda-checkpoint: its variables stay); a lease no kernel uses goes back after 5 min.
    c.Spawner.args.extend([f"--GPUIdleRule.gpu_idle_timeout={env('GPULEASE_DEMO_IDLE_TIMEOUT', '120')}",
                           "--GPUIdleRule.gpu_idle_timeout_learn=False",  # the same cycle every time
                           f"--ReclaimActions.warn_before={env('GPULEASE_DEMO_IDLE_WARN_BEFORE', '60')}",
                           f"--ReclaimActions.unused_lease_timeout={env('GPULEASE_DEMO_UNUSED_TIMEOUT', '300')}"])
c.SimpleLocalProcessSpawner.home_dir_template = str(state / "home" / "{username}")
