"""A real JupyterHub running the lease broker as its managed service, as README tells admins to.

Shared by the end-to-end broker tests (authorization, the chaos test, the hub tests): the
broker is started by the hub through its supervisor (one active process, one standby), users'
tokens and their servers' tokens may reach it, carol holds the lease admin scope.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from hubharness import HubHarness, free_port, pid_alive, wait_for

POOL = [
    {"node": "n1", "model": "A100-SXM4-80GB", "count": 2, "memory_mib": 81920},
    {"node": "n2", "model": "L4", "count": 4, "memory_mib": 23034},
]

BROKER_CONFIG = """
c.GPULeaseBroker.db_url = {db_url!r}
c.GPULeaseBroker.device_backend = "simulated"
c.GPULeaseBroker.devices = {{"gpus": {pool!r}}}
c.GPULeaseBroker.tick_interval = 1
c.GPULeaseBroker.confirm_timeout_s = 0
"""


def hub_for_broker(tmp_path: Path, *, db_url: str | None = None, pool=None, users=("alice", "bob", "carol"), extra_config: str = "",
                   broker_args: tuple[str, ...] = (), server_role: bool = False, **hub_kw) -> HubHarness:
    """A hub whose managed service "gpulease" is the broker (roles as README says).

    ``server_role``: single-user servers' own tokens may reach the broker too (what the server
    extension needs).
    """
    port = free_port()
    cfg = tmp_path / "gpulease_config.py"
    cfg.write_text(BROKER_CONFIG.format(db_url=db_url or f"sqlite:///{tmp_path / 'gpulease.sqlite'}", pool=pool or POOL) + extra_config)
    roles = [
        {"name": "gpulease-admin", "scopes": ["custom:gpulease:admin", "access:services!service=gpulease"], "users": ["carol"]},
        {"name": "gpulease-service", "scopes": ["read:users", "read:servers", "read:groups", "list:groups", "admin:servers"], "services": ["gpulease"]},
    ]
    if server_role:
        roles.append({"name": "server", "scopes": ["users:activity!user", "access:servers!server", "access:services!service=gpulease"]})
    return HubHarness(
        tmp_path,
        users=list(users),
        admin_users=["root"],
        groups={"physics": ["alice"]},
        services=[
            {
                "name": "gpulease",
                "url": f"http://127.0.0.1:{port}",
                "command": [sys.executable, "-m", "jupyter_gpulease.broker", "--config", str(cfg), *broker_args],
                "cwd": str(tmp_path),
                "oauth_no_confirm": True,
                "oauth_client_allowed_scopes": ["custom:gpulease:admin"],
                "display": True,
            }
        ],
        custom_scopes={"custom:gpulease:admin": {"description": "see and change every GPU lease; request leases for users"}},
        roles=roles,
        user_scopes=["access:services!service=gpulease"],
        **hub_kw,
    )


def wait_for_broker(hub: HubHarness, token: str, timeout: float = 60) -> None:
    def up():
        status, _ = hub.request("GET", hub.service_url("gpulease") + "api/pool", token=token)
        return status == 200

    try:
        wait_for(up, timeout, "the broker did not answer through the proxy")
    except AssertionError as e:
        raise AssertionError(f"{e}\n--- hub log ---\n{hub.log_tail(60)}") from None


def process_env(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)


def server_token(hub: HubHarness, user: str, timeout: float = 200) -> str:
    """Start ``user``'s server and return the token the hub gave it (its JUPYTERHUB_API_TOKEN)."""
    status, body = hub.api("POST", f"users/{user}/server")
    assert status in (201, 202), (status, body)

    def ready():
        s, model = hub.api("GET", f"users/{user}")
        return s == 200 and (model.get("servers") or {}).get("", {}).get("ready")

    wait_for(ready, timeout, f"{user}'s server did not become ready")
    for pid, cmd in hub.descendants():
        if "jupyterhub-singleuser" in cmd:
            env = process_env(pid)
            if env.get("JUPYTERHUB_USER") == user:
                return env["JUPYTERHUB_API_TOKEN"]
    raise AssertionError(f"no single-user server process of {user} found below the hub")


def active_broker_pid(hub: HubHarness) -> int | None:
    """The broker process that holds the database's lock (the one serving), by its lock."""
    workers = [pid for pid, cmd in hub.descendants() if "jupyter_gpulease.broker" in cmd and "worker=True" in cmd]
    locks = Path("/proc/locks").read_text().splitlines() if os.path.exists("/proc/locks") else []
    holders = {int(line.split()[4]) for line in locks if "FLOCK" in line and "WRITE" in line}
    for pid in workers:
        if pid in holders:
            return pid
    return None


def active_broker_pid_postgres(port: int, dbname: str) -> int | None:
    """The broker process that holds the advisory lock of PostgreSQL database ``dbname`` (each
    broker names its connection ``gpulease-broker pid=N``; the brokers that wait hold a shared one)."""
    import psycopg

    with psycopg.connect(f"host=127.0.0.1 port={port} user=postgres dbname={dbname}", autocommit=True) as conn:
        rows = conn.execute(
            "SELECT a.application_name FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid "
            "WHERE l.locktype = 'advisory' AND l.granted AND l.mode = 'ExclusiveLock' AND a.datname = %s",
            (dbname,),
        ).fetchall()
    pids = [int(name.split("pid=")[1]) for (name,) in rows if name and "pid=" in name]
    return pids[0] if pids and pid_alive(pids[0]) else None
