"""Helpers for tests of the server extension: a real Jupyter server (pytest-jupyter) with real
ipykernel kernels, simulated GPUs driven through their state file, and a real broker.

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
