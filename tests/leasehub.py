"""JupyterHub with GPU leases, the whole stack as README's "Add GPU leases to a JupyterHub" sets it up.

A real JupyterHub with configurable-http-proxy on 127.0.0.1 (:class:`hubharness.HubHarness`),
the broker as its managed service on a simulated pool (:class:`brokerhub.BrokerService`), the
lease spawner (``gpulease-simple`` by default, or another engine's class), README's roles and
scopes and home-page templates, and real single-user servers with the server extension (enabled
by the file the package installs). The servers are configured as an admin configures them: a
jupyter_server_config.py (``server_config``) with the parts' settings under their own names
(``c.GPUIdleRule.*``, ``c.ReclaimActions.*``, ``c.Resumer.*``, ``c.GPUUsage.*``) and the
extension's (``c.GPULeaseExtension.sample_interval``, ``heartbeat_interval``, ``cuda_checkpoint``),
and, with ``server_devices``, the simulated GPUs the test drives, as README's "Simulated GPUs on
a hub" says. Only what a hub admin configures is used: config lines, entry points, public
settings, the REST APIs.

Usage::

    sim = SimGPUs(str(tmp_path / "sim-gpus.json"), POOL)      # serverutil: GPUs the test drives
    hub = LeaseHub(tmp_path, pool=POOL, server_devices=sim.config,
                   broker_config=["c.GPULeaseBroker.heartbeat_timeout_s = 60"],
                   server_config=["c.GPUIdleRule.gpu_idle_timeout = 15"],
                   hub_config=["c.GPULeaseSpawner.on_lease_end = 'keep'"]).start()
    hub.spawn("alice", {"gpus": 1})
    hub.wait_ready("alice")
    token = hub.create_token("alice")
    hub.leases("alice", "active")                        # the broker's, with the spawner's token
    hub.gpu_api("alice", token, "status")                # her server's extension, through the proxy
    kernel = hub.start_kernel("alice", token)
    hub.run_cell("alice", token, kernel, "print(1)")     # as JupyterLab sends it
    hub.close()                                          # every server, then the hub
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
import uuid
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from tornado.httpclient import HTTPRequest
from tornado.websocket import websocket_connect

from brokerhub import (
    BROKER_ACCESS,
    CUSTOM_SCOPES,
    SERVER_TOKEN_SCOPES,
    SPAWNER_SERVICE,
    BrokerService,
    broker_supervisor_pid,
    readme_roles,
)
from hubharness import HubHarness

ONE_L4 = [{"node": "n1", "model": "L4", "count": 1, "memory_mib": 23034}]


def _lines(value: Iterable[str] | str) -> list[str]:
    return [value] if isinstance(value, str) else list(value)


class LeaseHub(HubHarness):
    """A hub, its broker, the lease spawner and single-user servers with the extension (see the module doc).

    Hub: ``users``, ``spawner_class``, ``hub_config`` (lines of jupyterhub_config.py after the
    harness's, so they win), ``lease_admins`` (users with README's lease admin role), ``services``
    and ``roles`` (more of them), and what :class:`HubHarness` takes. Broker: ``pool`` (or
    ``broker_devices``, the device backend's whole config, with ``device_backend``),
    ``broker_config`` (lines of gpulease_config.py), ``broker_tick``, ``broker_command_prefix``.
    Servers: ``server_config`` (lines of their jupyter_server_config.py), ``server_devices`` (the
    simulated device backend's config they read; None: their default backend), ``server_env``.
    """

    def __init__(
        self,
        tmp_path: Path | str,
        *,
        users: Sequence[str] = ("alice", "bob"),
        spawner_class: str = "gpulease-simple",
        hub_config: Iterable[str] | str = (),
        lease_admins: Sequence[str] = (),
        services: Sequence[dict[str, Any]] = (),
        roles: Sequence[dict[str, Any]] = (),
        pool: list[dict] | None = None,
        broker_devices: dict[str, Any] | None = None,
        device_backend: str = "simulated",
        broker_config: Iterable[str] | str = (),
        broker_tick: float = 0.5,
        broker_command_prefix: Sequence[str] = (),
        server_config: Iterable[str] | str = (),
        server_devices: dict[str, Any] | None = None,
        server_env: dict[str, str] | None = None,
        log_level: str = "INFO",
        **hub_kw,
    ):
        folder = Path(tmp_path)
        self.broker = BrokerService(folder, pool=pool or ONE_L4, devices=broker_devices, device_backend=device_backend,
                                    tick=broker_tick, config=broker_config, command_prefix=broker_command_prefix)
        self.spawner_token = secrets.token_hex(16)
        self.server_config_dir = folder / "jupyter-config"
        environment = self._server_environment(_lines(server_config), server_devices, server_env or {})
        super().__init__(
            folder,
            users=list(users),
            services=[self.broker.service(), {"name": SPAWNER_SERVICE, "api_token": self.spawner_token}, *services],
            custom_scopes=CUSTOM_SCOPES,
            roles=[*readme_roles(lease_admins=lease_admins), *roles],
            user_scopes=[BROKER_ACCESS],
            spawner_class=spawner_class,
            log_level=log_level,
            config_lines=[
                # README's jupyterhub_config.py
                f"c.GPULeaseSpawner.broker_url = {self.broker.url!r}",
                f"c.GPULeaseSpawner.broker_api_token = {self.spawner_token!r}",
                f"c.Spawner.server_token_scopes = {SERVER_TOKEN_SCOPES!r}",
                "from jupyter_gpulease.hub.pages import TEMPLATE_PATH",
                "c.JupyterHub.template_paths = [TEMPLATE_PATH]",
                # a test's pace: the hub checks its servers every second
                "c.Spawner.poll_interval = 1",
                "c.Spawner.http_timeout = 60",
                *([f"c.Spawner.environment = {environment!r}"] if environment else []),
                *_lines(hub_config),
            ],
            **hub_kw,
        )

    def _server_environment(self, config: list[str], devices: dict[str, Any] | None, extra: dict[str, str]) -> dict[str, str]:
        """The servers' environment: where their jupyter_server_config.py is (written here) and the
        simulated GPUs they read."""
        env: dict[str, str] = {}
        if config:
            self.server_config_dir.mkdir(parents=True, exist_ok=True)
            (self.server_config_dir / "jupyter_server_config.py").write_text("\n".join(["c = get_config()  # noqa", *config]) + "\n")
            env["JUPYTER_CONFIG_DIR"] = str(self.server_config_dir)
        if devices is not None:
            env.update(GPULEASE_DEVICE_BACKEND="simulated", GPULEASE_DEVICE_CONFIG=json.dumps(devices))
        return {**env, **extra}

    # ------------------------------------------------------------------ lifecycle
    def start(self, timeout: float | None = None) -> LeaseHub:
        """Start the hub, and wait until the broker it started answers the spawner's token."""
        super().start(timeout)
        self.wait_for_broker()
        return self

    def wait_for_broker(self, timeout: float = 90) -> None:
        try:
            self.broker.wait_up(self.spawner_token, timeout)
        except AssertionError as e:
            raise AssertionError(f"{e}\n--- hub log ---\n{self.log_tail(30)}") from None

    def close(self) -> None:
        """Stop every server the hub lists (so that each ends its lease), then the hub."""
        if self.proc is not None and self.proc.poll() is None:
            self.stop_servers()
        self.stop()

    def __exit__(self, *exc) -> None:
        self.close()

    def broker_supervisor_pid(self) -> int | None:
        """The process the hub started for the broker (its supervisor), or None."""
        return broker_supervisor_pid(self)

    # ------------------------------------------------------------------ the broker, with the spawner's token
    def broker_call(self, method: str, *args, **kw):
        """A :class:`jupyter_gpulease.client.BrokerClient` call with the spawner's token (the admin scope)."""
        return self.broker.call(self.spawner_token, method, *args, **kw)

    def leases(self, user: str | None = None, state: str = "all") -> list[dict]:
        return self.broker_call("list_leases", state=state, user=user)

    def lease(self, lease_id: str) -> dict:
        return self.broker_call("get_lease", lease_id)

    def broker_get(self, path: str, token: str | None = None) -> tuple[int, Any]:
        """GET a path of the broker's REST API (e.g. ``api/leases?user=bob``), as the hub's side reaches it."""
        return self.request("GET", self.broker.url + path.lstrip("/"), token=token or self.spawner_token)

    # ------------------------------------------------------------------ inside a user's server
    def gpu_api(self, user: str, token: str, path: str = "status", method: str = "GET", body: Any = None) -> tuple[int, Any]:
        """The server extension's REST API in ``user``'s server, through the proxy."""
        return self.request(method, self.user_url(user, f"gpulease/api/{path}"), body, token=token)

    def start_kernel(self, user: str, token: str, name: str = "python3") -> str:
        """A kernel started through ``user``'s server's REST API; its id."""
        code, kernel = self.request("POST", self.user_url(user, "api/kernels"), {"name": name}, token=token)
        assert code == 201, kernel
        return kernel["id"]

    def start_session(self, user: str, token: str, path: str, kernel: str = "python3") -> str:
        """A notebook session (as JupyterLab opens a notebook at ``path``); its kernel's id."""
        code, session = self.request("POST", self.user_url(user, "api/sessions"),
                                     {"path": path, "name": Path(path).name, "type": "notebook", "kernel": {"name": kernel}}, token=token)
        assert code == 201, session
        return session["kernel"]["id"]

    def run_cell(self, user: str, token: str, kernel_id: str, code: str) -> None:
        """Send a cell to a kernel through the proxy's websocket (as JupyterLab does); does not wait for it to run."""
        asyncio.run(self._send_cell(user, token, kernel_id, code))

    async def _send_cell(self, user: str, token: str, kernel_id: str, code: str) -> None:
        ws = await websocket_connect(HTTPRequest(f"ws://127.0.0.1:{self.port}/user/{user}/api/kernels/{kernel_id}/channels",
                                                 headers={"Authorization": f"token {token}"}))
        msg = {"header": {"msg_id": uuid.uuid4().hex, "username": user, "session": uuid.uuid4().hex, "msg_type": "execute_request",
                          "version": "5.3", "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())},
               "parent_header": {}, "metadata": {}, "channel": "shell", "buffers": [],
               "content": {"code": code, "silent": False, "store_history": False, "user_expressions": {}, "allow_stdin": False,
                           "stop_on_error": True}}
        await ws.write_message(json.dumps(msg))
        await asyncio.sleep(1.0)  # delivered; the kernel runs the cell whether or not this client stays
        ws.close()
