"""Fakes for the server extension's parts: a kernel manager, a session manager, a lease keeper,
a cuda-checkpoint and a clock the test moves; and :func:`rig`, a controller wired with them
over simulated GPUs (no server, no broker, no kernels: the parts alone, in seconds)."""

from __future__ import annotations

import asyncio
import datetime
import os
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Any

from traitlets.config import Config

from jupyter_gpulease.devices.simulated import SimulatedBackend
from jupyter_gpulease.server.controller import GPUController
from jupyter_gpulease.server.feed import Feed
from jupyter_gpulease.server.monitor import Monitor

POOL = [{"node": "n1", "model": "L4", "count": 2, "memory_mib": 23034}]


class Clock:
    """Time the test moves (epoch seconds)."""

    def __init__(self, t: float = 1_700_000_000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t

    def move(self, s: float) -> None:
        self.t += s


@dataclass
class FakeProvisioner:
    pid: int | None
    pgid: int | None = None


@dataclass
class FakeKernel:
    kernel_id: str
    pid: int | None
    kernel_name: str = "python3"
    execution_state: str = "idle"
    connections: int = 1
    last_activity: datetime.datetime = field(default_factory=lambda: datetime.datetime.now(datetime.UTC))
    connection_file: str = ""

    @property
    def provisioner(self) -> FakeProvisioner:
        return FakeProvisioner(self.pid)


class FakeKernelManager:
    """jupyter_server's MappingKernelManager, as far as the extension uses it (its public API)."""

    def __init__(self):
        self.kernels: dict[str, FakeKernel] = {}
        self.calls: list[tuple[str, str]] = []
        self.fail: set[str] = set()  # actions that raise

    def add(self, kid: str, pid: int | None, **kw: Any) -> FakeKernel:
        k = self.kernels[kid] = FakeKernel(kid, pid, **kw)
        return k

    def list_kernel_ids(self) -> list[str]:
        return list(self.kernels)

    def get_kernel(self, kid: str) -> FakeKernel:
        return self.kernels[kid]

    def kernel_model(self, kid: str) -> dict[str, Any]:
        k = self.kernels[kid]
        return {"id": kid, "name": k.kernel_name, "last_activity": k.last_activity.isoformat().replace("+00:00", "Z"),
                "execution_state": k.execution_state, "connections": k.connections}

    async def _call(self, action: str, kid: str) -> None:
        self.calls.append((action, kid))
        if action in self.fail:
            raise RuntimeError(f"{action} failed on purpose")

    async def restart_kernel(self, kid: str) -> None:
        await self._call("restart", kid)
        self.kernels[kid].pid = (self.kernels[kid].pid or 0) + 100_000  # a new process

    async def shutdown_kernel(self, kid: str) -> None:
        await self._call("shutdown", kid)
        self.kernels.pop(kid, None)

    async def interrupt_kernel(self, kid: str) -> None:
        await self._call("interrupt", kid)


class FakeSessions:
    def __init__(self, paths: dict[str, str] | None = None):
        self.paths = paths or {}

    async def list_sessions(self) -> list[dict[str, Any]]:
        return [{"id": f"s-{kid}", "path": p, "kernel": {"id": kid}} for kid, p in self.paths.items()]


def lease_json(lease_id: str = "L1", uuid: str = "GPU-0", *, share: float = 1.0, memory_mib: int = 23034,
               state: str = "active", expires_in: float | None = 3600.0, now: float = 1_700_000_000.0, **extra: Any) -> dict[str, Any]:
    slices = [{"gpu_uuid": uuid, "model": "L4", "node": "n1", "index": 0, "share": share, "memory_mib": memory_mib}]
    out = {"id": lease_id, "state": state, "tier": "standard", "request": {"gpus": 1}, "duration_s": 3600,
           "placement": {"slices": slices} if state == "active" else None, "created_at": now,
           "granted_at": now if state == "active" else None, "expires_at": now + expires_in if expires_in and state == "active" else None}
    out.update(extra)
    return out


class FakeKeeper:
    """The LeaseKeeper as the parts use it: the lease, its changes, release and request."""

    def __init__(self, lease: dict[str, Any] | None = None, *, client: Any = True):
        self.lease = lease
        self.lease_id = lease["id"] if lease else ""
        self.ended: dict[str, Any] | None = None
        self.client = client
        self.origin = "spawner" if lease else ""
        self.heartbeat_interval = 30.0
        self.heartbeat: dict[str, Any] = {"sent": 0, "failures": 0}
        self.warnings: list[dict[str, Any]] = []
        self.on_change = self.on_warnings = None
        self.usage = dict
        self.released: list[dict[str, Any]] = []
        self.requested: list[dict[str, Any]] = []
        self.grant: dict[str, Any] | None = None  # what a request gets
        self.stopped = False

    @property
    def active(self) -> dict[str, Any] | None:
        return self.lease if self.lease and self.lease.get("state") == "active" else None

    @property
    def queued(self) -> dict[str, Any] | None:
        return self.lease if self.lease and self.lease.get("state") == "queued" else None

    async def start(self) -> None:
        pass

    async def stop(self, *, release: bool = True) -> None:
        self.stopped = True

    async def end(self, state: str, **kw: Any) -> dict[str, Any]:
        ended = dict(self.lease or {}, state=state, end_reason=kw.get("reason", ""))
        self.lease, self.ended = None, ended
        await self.on_change("ended", ended)
        return ended

    async def release(self, *, state: str, reason: str = "", keep_server: bool = True) -> dict[str, Any]:
        self.released.append({"state": state, "reason": reason, "keep_server": keep_server})
        return await self.end(state, reason=reason)

    async def request(self, body: dict[str, Any]) -> dict[str, Any]:
        self.requested.append(body)
        self.lease = self.grant
        await self.on_change("granted" if self.grant and self.grant["state"] == "active" else "queued", self.grant)
        return self.grant

    async def wait_active(self, timeout: float = 0.0) -> dict[str, Any] | None:
        return self.active


class FakeCheckpoint:
    """cuda-checkpoint as the parts call it; it records the calls and frees or restores the simulated memory."""

    def __init__(self, sim: SimulatedBackend, *, device_map: bool = True, fail: bool = False):
        self.path = sys.executable  # an executable, so suspending counts as available
        self.note = ""
        self.sim = sim
        self.device_map = device_map
        self.fail = fail
        self.calls: list[tuple[str, list[int], Any]] = []
        self._held: dict[int, tuple[str, int | None]] = {}

    async def suspend(self, pids: list[int]) -> None:
        from jupyter_gpulease.server.checkpoint import CheckpointError

        self.calls.append(("suspend", list(pids), None))
        if self.fail:
            raise CheckpointError("the stand-in was told to fail")
        for uuid, s in self.sim.sample().items():
            for p in s.processes:
                if p.pid in pids:
                    self._held[p.pid] = (uuid, p.used_memory_mib)
                    self.sim.remove_process(p.pid)

    async def restore(self, pids: list[int], mapping: dict[str, str] | None = None) -> None:
        self.calls.append(("restore", list(pids), mapping))
        for pid in pids:
            if pid in self._held:
                uuid, mib = self._held.pop(pid)
                self.sim.add_process((mapping or {}).get(uuid, uuid), pid, mib, sm_util_pct=0.0)

    async def supports_device_map(self) -> bool:
        return self.device_map


@dataclass
class Rig:
    ctrl: GPUController
    km: FakeKernelManager
    keeper: FakeKeeper
    sim: SimulatedBackend
    clock: Clock
    checkpoint: FakeCheckpoint | None
    sessions: FakeSessions
    environ: dict[str, str]
    web_settings: dict[str, Any]
    stops: list[bool]

    @property
    def uuid(self) -> str:
        return self.sim.inventory()[0].uuid

    async def tick(self, n: int = 1, every: float = 1.0):
        snap = None
        for _ in range(n):
            self.clock.move(every)
            snap = await self.ctrl.tick()
            await settle()
        return snap

    def events(self, kind: str) -> list[dict[str, Any]]:
        return [e.to_dict() for e in self.ctrl.feed.recent((kind,), 256)]


async def settle() -> None:
    """Let the parts' background tasks run to their next wait."""
    for _ in range(5):
        await asyncio.sleep(0)


def rig(tmp_path, config: dict[str, dict[str, Any]] | None = None, *, lease: dict[str, Any] | None = None, checkpoint: bool = True,
        environ: dict[str, str] | None = None) -> Rig:
    clock = Clock()
    sim = SimulatedBackend({"gpus": POOL, "state_file": str(tmp_path / "sim.json")})
    uuid = sim.inventory()[0].uuid
    lease = lease if lease is not None else lease_json(uuid=uuid, now=clock())
    km, keeper, sessions = FakeKernelManager(), FakeKeeper(lease or None), FakeSessions()
    monitor = Monitor(sim, interval=1.0, history_s=60.0, clock=clock)
    if keeper.active:
        monitor.watch([uuid])
    cp = FakeCheckpoint(sim) if checkpoint else None
    env = environ if environ is not None else {"GPULEASE_LEASE_ID": lease["id"] if lease else "", "CUDA_VISIBLE_DEVICES": uuid if lease else "",
                                               "GPULEASE_BROKER_URL": "http://broker/", "PATH": os.environ.get("PATH", "")}
    cfg = {"GPUIdleRule": {"gpu_idle_timeout": 60.0, "gpu_idle_timeout_learn": False, "gaps_file": ""},
           "ReclaimActions": {"warn_before": 20.0}}
    for section, values in (config or {}).items():
        cfg.setdefault(section, {}).update(values)
    web_settings: dict[str, Any] = {}
    stops: list[bool] = []
    ctrl = GPUController(config=Config(cfg), kernel_manager=km, session_manager=sessions, monitor=monitor, keeper=keeper, feed=Feed(),
                         sample_interval=1.0, history_s=60.0, checkpoint=cp, checkpoint_missing="" if cp else "no cuda-checkpoint here",
                         web_settings=web_settings, stop_server=lambda: stops.append(True), user="alice", broker_url="http://broker/",
                         environ=lambda: dict(env), clock=clock)
    if keeper.active:
        ctrl.tracker.lease_granted(clock())  # what start() does for the lease the server starts with
    return Rig(ctrl, km, keeper, sim, clock, cp, sessions, env, web_settings, stops)


def child_process() -> subprocess.Popen:
    """A real process to stand for a kernel (attribution follows real process trees)."""
    return subprocess.Popen(["sleep", "60"])


def run(coro_fn):
    """A test body written as a coroutine, run on its own event loop."""
    import functools

    @functools.wraps(coro_fn)
    def wrapper(*args, **kwargs):
        return asyncio.run(coro_fn(*args, **kwargs))

    return wrapper
