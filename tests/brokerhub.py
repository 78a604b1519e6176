"""The lease broker as a JupyterHub's managed service, as README's jupyterhub_config.py declares it.

:class:`BrokerService` is the broker's part of a hub: its gpulease_config.py (a simulated pool
by default), README's service entry for it (run by the hub through the broker's supervisor: one
active process, one standby) and calls to it. :func:`readme_roles` and :data:`CUSTOM_SCOPES`
are README's roles and scope. :func:`hub_for_broker` is a hub with the broker and no lease
spawner, for the end-to-end broker tests (authorization, the chaos test, the hub tests): users'
tokens and their servers' tokens may reach it, carol holds the lease admin scope. The whole
stack with the lease spawner and servers is :class:`leasehub.LeaseHub`.
"""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from hubharness import HubHarness, free_port, pid_alive, wait_for
from jupyter_gpulease.client import BrokerClient

SERVICE = "gpulease"
SPAWNER_SERVICE = "gpulease-spawner"
ADMIN_SCOPE = "custom:gpulease:admin"
BROKER_ACCESS = f"access:services!service={SERVICE}"
CUSTOM_SCOPES = {ADMIN_SCOPE: {"description": "See and change every GPU lease, and ask for leases on behalf of users."},
                 "custom:gpulease:metrics": {"description": "Read the GPU lease broker's metrics (every lease, each group's use)."}}
# README: what the broker may do on the hub (groups for tiers and quotas, servers it checks and stops)
BROKER_SCOPES = ["read:users", "read:servers", "read:groups", "list:groups", "admin:servers"]
# README's c.Spawner.server_token_scopes: a server's own token reaches the broker (its extension, %gpu)
SERVER_TOKEN_SCOPES = ["users:activity!user", "access:servers!server", BROKER_ACCESS]

# the docs' c.JupyterHub.proxy_class: API paths the proxy cannot reach answered with JSON, not the hub's page
JSON_ERRORS_PROXY = "c.JupyterHub.proxy_class = 'jupyter_gpulease.hub.proxy.GPULeaseProxy'"

POOL = [
    {"node": "n1", "model": "A100-SXM4-80GB", "count": 2, "memory_mib": 81920},
    {"node": "n2", "model": "L4", "count": 4, "memory_mib": 23034},
]


def readme_roles(*, spawner: str | None = SPAWNER_SERVICE, lease_admins: Sequence[str] = (), lease_admin_groups: Sequence[str] = ()) -> list[dict]:
    """README's c.JupyterHub.load_roles but the ``user`` role (see HubHarness's ``user_scopes``):
    the spawner's service (``spawner``; None: none), the broker, and lease admins when given."""
    roles = [{"name": "gpulease-broker", "scopes": BROKER_SCOPES, "services": [SERVICE]}]
    if spawner:
        roles.insert(0, {"name": "gpulease-spawner", "scopes": [ADMIN_SCOPE, BROKER_ACCESS], "services": [spawner]})
    if lease_admins or lease_admin_groups:
        admins = {"name": "gpulease-admins", "scopes": [ADMIN_SCOPE, BROKER_ACCESS]}
        admins.update({k: list(v) for k, v in (("users", lease_admins), ("groups", lease_admin_groups)) if v})
        roles.append(admins)
    return roles


class BrokerService:
    """The broker as the hub's managed service "gpulease": its config file, service entry and API.

    ``folder`` holds gpulease_config.py (and the SQLite database unless ``db_url`` says otherwise);
    the pool is ``devices`` (the device backend's config) or else ``{"gpus": pool}``;
    ``config``: more lines of gpulease_config.py, after the harness's own (so they win);
    ``command_prefix``: a wrapper the hub runs the broker through (e.g. one that holds its start).
    """

    def __init__(self, folder: Path | str, *, pool: list[dict] | None = None, devices: dict[str, Any] | None = None,
                 device_backend: str = "simulated", db_url: str | None = None, tick: float = 0.5,
                 config: Iterable[str] | str = (), args: Sequence[str] = (), command_prefix: Sequence[str] = ()):
        self.dir = Path(folder)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/services/{SERVICE}/"  # where the hub's side reaches it, as README's broker_url
        self.db_url = db_url or f"sqlite:///{self.dir / 'gpulease.sqlite'}"
        self.config_file = self.dir / "gpulease_config.py"
        self.device_backend = device_backend
        self.devices = devices if devices is not None else {"gpus": pool or POOL}
        self.tick = tick
        self.config = [config] if isinstance(config, str) else list(config)
        self.args = list(args)
        self.command_prefix = list(command_prefix)
        self.config_file.write_text(self.config_text())

    def config_text(self) -> str:
        """The gpulease_config.py the hub's broker reads."""
        lines = [
            "c = get_config()  # noqa",
            f"c.GPULeaseBroker.db_url = {self.db_url!r}",
            f"c.GPULeaseBroker.device_backend = {self.device_backend!r}",
            f"c.GPULeaseBroker.devices = {self.devices!r}",
            f"c.GPULeaseBroker.tick_interval = {self.tick!r}",
            *self.config,
        ]
        return "\n".join(lines) + "\n"

    def service(self) -> dict[str, Any]:
        """README's entry of c.JupyterHub.services for the broker."""
        return {
            "name": SERVICE,
            "url": f"http://127.0.0.1:{self.port}",
            "command": [*self.command_prefix, sys.executable, "-m", "jupyter_gpulease.broker", "--config", str(self.config_file), *self.args],
            "cwd": str(self.dir),
            "oauth_no_confirm": True,
            "oauth_client_allowed_scopes": [ADMIN_SCOPE],
            "display": True,
        }

    def call(self, token: str, method: str, *args, **kw):
        """A call of :class:`jupyter_gpulease.client.BrokerClient` (``method`` by name) with ``token``, blocking."""
        async def go():
            return await getattr(BrokerClient(self.url, token), method)(*args, **kw)
        return asyncio.run(go())

    def wait_up(self, token: str, timeout: float = 60) -> None:
        """Wait until the broker answers ``token``'s api/pool."""
        wait_for(lambda: self.call(token, "pool"), timeout, "the broker did not answer")


def hub_for_broker(tmp_path: Path, *, db_url: str | None = None, pool=None, users=("alice", "bob", "carol"), extra_config: str = "",
                   broker_args: tuple[str, ...] = (), server_role: bool = False, **hub_kw) -> HubHarness:
    """A hub whose managed service "gpulease" is the broker (roles as README says), no lease spawner.

    ``server_role``: single-user servers' own tokens may reach the broker too (what the server
    extension needs).
    """
    broker = BrokerService(tmp_path, pool=pool, db_url=db_url, tick=1, config=["c.GPULeaseBroker.confirm_timeout_s = 0", extra_config],
                           args=broker_args)
    roles = readme_roles(spawner=None, lease_admins=["carol"])
    if server_role:
        roles.append({"name": "server", "scopes": SERVER_TOKEN_SCOPES})
    return HubHarness(
        tmp_path,
        users=list(users),
        admin_users=["root"],
        groups={"physics": ["alice"]},
        services=[broker.service()],
        custom_scopes=CUSTOM_SCOPES,
        roles=roles,
        user_scopes=[BROKER_ACCESS],
        **hub_kw,
    )


def wait_for_broker(hub: HubHarness, token: str, timeout: float = 60) -> None:
    """Wait until the broker answers ``token`` through the hub's proxy."""
    def up():
        status, _ = hub.request("GET", hub.service_url(SERVICE) + "api/pool", token=token)
        return status == 200

    try:
        wait_for(up, timeout, "the broker did not answer through the proxy")
    except AssertionError as e:
        raise AssertionError(f"{e}\n--- hub log ---\n{hub.log_tail(60)}") from None


def server_token(hub: HubHarness, user: str, timeout: float = 200) -> str:
    """Start ``user``'s server and return the token the hub gave it (its JUPYTERHUB_API_TOKEN)."""
    status, body = hub.spawn(user)
    assert status in (201, 202), (status, body)
    wait_for(lambda: hub.ready_server(user), timeout, f"{user}'s server did not become ready")
    return hub.server_token(user)


def broker_processes(hub: HubHarness) -> list[tuple[int, str]]:
    """(pid, command line) of the broker's processes below the hub: its supervisor and its workers."""
    return [(pid, cmd) for pid, cmd in hub.descendants() if "jupyter_gpulease.broker" in cmd]


def broker_supervisor_pid(hub: HubHarness) -> int | None:
    """The broker's supervisor (the process the hub started for the service), or None."""
    return next((pid for pid, cmd in broker_processes(hub) if "worker=True" not in cmd and pid_alive(pid)), None)


def active_broker_pid(hub: HubHarness) -> int | None:
    """The broker process that holds the database's lock (the one serving), by its lock."""
    workers = [pid for pid, cmd in broker_processes(hub) if "worker=True" in cmd]
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
