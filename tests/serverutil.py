"""Helpers for tests of the server extension: a real Jupyter server (pytest-jupyter) with real
ipykernel kernels, simulated GPUs driven through their state file, and a real broker.

Test modules import the fixtures they use from here (``from serverutil import server, ...``):
``server`` is a pytest-jupyter server whose extension holds alice's lease (granted before it
starts, as the spawner does) from a real broker in its own thread (fake hub auth: the token
names the user); ``ext_config`` (parametrize it indirectly) changes extension settings.

The simulated GPUs need one thing a real driver does by itself: when a process exits, its GPU
memory is freed. :meth:`SimGPUs.prune` removes processes that no longer exist; the waits here
call it at every turn.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
import urllib.error
import urllib.request
from typing import Any

import pytest

import standin_cuda_checkpoint as standin
from brokerutil import broker_in_thread, broker_url, patch_auth
from jupyter_gpulease.broker.manager import SystemClock
from jupyter_gpulease.devices.simulated import SimulatedBackend

POOL = [{"node": "n1", "model": "L4", "count": 2, "memory_mib": 23034}]


class SimGPUs:
    """The simulated GPUs a test drives (the extension reads the same state file)."""

    def __init__(self, state_file: str, pool: list[dict] | None = None):
        self.pool = pool or POOL
        self.state_file = state_file
        self.backend = SimulatedBackend({"gpus": self.pool, "state_file": state_file})
        self.uuids = [g.uuid for g in self.backend.inventory()]

    @property
    def config(self) -> dict[str, Any]:
        return {"gpus": self.pool, "state_file": self.state_file}

    def run(self, pid: int, mib: int, sm: float | None = 0.0, uuid: str | None = None) -> None:
        """Process ``pid`` holds ``mib`` MiB on ``uuid`` (default: the first GPU) and keeps ``sm`` % of it busy."""
        self.backend.remove_process(pid)
        self.backend.add_process(uuid or self.uuids[0], pid, mib, sm_util_pct=sm)

    def stop(self, pid: int) -> None:
        self.backend.remove_process(pid)

    def processes(self) -> dict[int, tuple[str, int | None]]:
        out = {}
        for uuid, s in self.backend.sample().items():
            for p in s.processes:
                out[p.pid] = (uuid, p.used_memory_mib)
        return out

    def prune(self) -> None:
        """What the driver does when a process exits: its memory is freed."""
        for pid in list(self.processes()):
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                self.backend.remove_process(pid)


def broker_call(url: str, method: str, path: str, body: Any = None, *, token: str = "alice") -> tuple[int, Any]:
    """A blocking call to the broker (it runs in its own thread); returns (status, JSON)."""
    data = None if body is None else json.dumps(body).encode()
    if data is None and method == "POST":
        data = b"{}"
    req = urllib.request.Request(url.rstrip("/") + "/" + path.lstrip("/"), data=data, method=method,
                                 headers={"Authorization": f"token {token}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


async def broker_call_async(*args, **kwargs) -> tuple[int, Any]:
    return await asyncio.get_running_loop().run_in_executor(None, lambda: broker_call(*args, **kwargs))


async def wait_for(predicate, *, timeout: float = 60.0, message: str = "", sim: SimGPUs | None = None, interval: float = 0.1):
    """Await ``predicate()`` (sync or async) until truthy; AssertionError(message) after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        if sim is not None:
            sim.prune()
        value = predicate()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return value
        last = value
        await asyncio.sleep(interval)
    raise AssertionError(f"{message or 'condition'} not met within {timeout:g} s (last: {last!r})")


class Kernel:
    """A real ipykernel started through the server's REST API, with a client to run cells."""

    def __init__(self, app, kid: str):
        self.app = app
        self.id = kid
        self.client = None

    @property
    def manager(self):
        return self.app.kernel_manager.get_kernel(self.id)

    @property
    def pid(self) -> int:
        return self.manager.provisioner.pid

    async def execute(self, code: str) -> str:
        """Send a cell (without waiting for it to finish); returns the message id."""
        if self.client is None:
            self.client = self.manager.client()
            self.client.start_channels()
            await self.client.wait_for_ready(timeout=60)
        return self.client.execute(code)

    async def run(self, code: str, timeout: float = 60) -> dict:
        """Run a cell to its end; returns the execute_reply content."""
        msg_id = await self.execute(code)
        while True:
            reply = await self.client.get_shell_msg(timeout=timeout)
            if reply["parent_header"].get("msg_id") == msg_id:
                return reply["content"]

    def close(self) -> None:
        if self.client is not None:
            self.client.stop_channels()
            self.client = None


async def start_kernel(app, fetch) -> Kernel:
    r = await fetch("api", "kernels", method="POST", body=json.dumps({"name": "python3"}))
    return Kernel(app, json.loads(r.body)["id"])


async def status(fetch, **params) -> dict:
    r = await fetch("gpulease", "api", "status", params=params or {"history": "0"})
    return json.loads(r.body)


def kernel_status(st: dict, kid: str) -> dict | None:
    return next((k for k in st["kernels"] if k["id"] == kid), None)


# ---------------------------------------------------------------------- fixtures
IDLE_TIMEOUT = 2.0
WARN_BEFORE = 1.0


@pytest.fixture
def sim(tmp_path):
    return SimGPUs(str(tmp_path / "sim-gpus.json"))


def run_broker(tmp_path, **kw):
    """A broker serving from its own thread: returns (app, stop); ``stop()`` may be called early, and again."""
    cm = broker_in_thread(tmp_path, **kw)
    app = cm.__enter__()
    stopped = []

    def stop():
        if not stopped:
            stopped.append(True)
            cm.__exit__(None, None, None)

    return app, stop


@pytest.fixture
def broker_traits(request):
    """Broker settings (parametrize indirectly to change them)."""
    return getattr(request, "param", {})


@pytest.fixture
def broker(tmp_path, monkeypatch, broker_traits):
    patch_auth(monkeypatch)
    app, stop = run_broker(tmp_path, pool=POOL, clock=SystemClock(), **broker_traits)
    app.test_stop = stop
    yield app
    stop()


@pytest.fixture
def checkpoint_dir(tmp_path, sim, monkeypatch):
    folder = tmp_path / "standin"
    folder.mkdir()
    monkeypatch.setenv("STANDIN_CUDA_CHECKPOINT_DIR", str(folder))
    monkeypatch.setenv("STANDIN_CUDA_CHECKPOINT_SIM_STATE", sim.state_file)
    monkeypatch.setenv("STANDIN_CUDA_CHECKPOINT_REMAP", "1")
    standin.install(str(folder))
    return str(folder)


@pytest.fixture
def ext_config(request):
    """Per-test extension settings (parametrize indirectly to change them)."""
    return getattr(request, "param", {})


@pytest.fixture
def lease_request(request):
    """What alice's lease asks for (parametrize indirectly to change it)."""
    return getattr(request, "param", None) or {"gpus": 1, "duration_s": 3600}


@pytest.fixture
def lease(broker, lease_request):
    """alice's lease, granted before her server starts (what the spawner does)."""
    url = broker_url(broker)
    status_code, body = broker_call(url, "POST", "api/leases", lease_request)
    assert status_code == 201 and body["state"] == "active", body
    broker_call(url, "POST", f"api/leases/{body['id']}/confirm")
    return body


@pytest.fixture
def jp_server_config(broker, lease, sim, checkpoint_dir, ext_config):
    cfg = {
        "device_backend": "simulated",
        "device_config": sim.config,
        "broker_url": broker_url(broker),
        "broker_token": "alice",
        "lease_id": lease["id"],
        "sample_interval": 0.25,
        "gpu_idle_timeout": IDLE_TIMEOUT,
        "warn_before": WARN_BEFORE,
        "heartbeat_interval": 1.0,
        "cuda_checkpoint": os.path.join(checkpoint_dir, "cuda-checkpoint"),
        "gaps_file": "",
        "gpu_idle_timeout_learn": False,  # the fixed timeout the tests wait for
    }
    cfg.update(ext_config)
    return {"ServerApp": {"jpserver_extensions": {"jupyter_gpulease.server": True}}, **extension_config(cfg)}


def extension_config(settings: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Flat extension settings as config sections: each under the part that declares it
    (``ReclaimActions.reclaim_action``), the rest under ``GPULeaseExtension``."""
    from jupyter_gpulease.server.controller import PARTS

    out: dict[str, dict[str, Any]] = {"GPULeaseExtension": {}}
    for name, value in settings.items():
        owner = next((c.__name__ for c in PARTS if name in c.class_trait_names(config=True)), "GPULeaseExtension")
        out.setdefault(owner, {})[name] = value
    return out


@pytest.fixture
def server(jp_serverapp, jp_asyncio_loop):
    """The server with its extensions started (pytest-jupyter does not run that hook itself), and
    stopped while the test's broker still runs: pytest-jupyter's own clean-up comes after every
    other fixture's, the broker's too, when the extension's release would wait for a broker gone."""
    jp_asyncio_loop.run_until_complete(jp_serverapp.extension_manager.start_all_extensions())
    yield jp_serverapp
    jp_asyncio_loop.run_until_complete(jp_serverapp.extension_manager.stop_all_extensions())


async def active_lease(fetch) -> dict:
    async def ready():
        st = await status(fetch)
        return st if st["lease"] and st["lease"]["state"] == "active" else None

    return await wait_for(ready, message="the server has its lease from the broker")


def feed_events(server, kind: str) -> list[dict]:
    sup = server.web_app.settings["gpulease_controller"]
    return [e.to_dict() for e in sup.feed.recent((kind,), 256)]


async def lease_state(broker, lease_id: str) -> str:
    _, body = await broker_call_async(broker_url(broker), "GET", f"api/leases/{lease_id}")
    return body["state"]




async def _is(coro, value):
    return (await coro) == value
