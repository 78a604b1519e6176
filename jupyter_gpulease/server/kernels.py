"""The kernel table: what the extension knows of each kernel of this server.

:class:`KernelTable` reads jupyter_server's kernel manager through its public API (the kernel
model: name, execution state, last activity, connections; the kernel's provisioner for its
pid), the session manager for each kernel's notebook path, and keeps one :class:`KernelRecord`
per kernel: its process, its GPU use at the last sample, its reclaim state, its usage figures.
It also keeps the marker file that tells a suspended kernel's ``%gpu`` extension to wait for
its resume (see ``kernel/resume.py``).
"""

from __future__ import annotations

import asyncio
import datetime
import inspect
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import psutil
from traitlets.config import LoggingConfigurable

from ..core.lease import KernelState
from ..kernel.resume import marker_path
from ..tasks import BackgroundTasks
from .attribution import KernelGPU, KernelProcess
from .monitor import Snapshot
from .reclaim import KernelUse

# a kernel's reclaim state (the status's kernels[].state)
OK, ACTING, SUSPENDED, RESUMING, RECLAIMED = (KernelState.OK, KernelState.ACTING, KernelState.SUSPENDED, KernelState.RESUMING,
                                             KernelState.RECLAIMED)
PATHS_EVERY_S = 5.0  # how often the notebook paths are read again from the session manager


@dataclass
class KernelRecord:
    """What the extension remembers of one kernel."""

    id: str
    name: str = ""
    path: str = ""  # the notebook (session) path, "" for a kernel without a session
    pid: int | None = None
    pgid: int | None = None
    execution_state: str = ""
    last_activity: float | None = None
    connections: int = 0
    env_devices: str | None = None  # its CUDA_VISIBLE_DEVICES (None: not known yet)
    gpu: KernelGPU | None = None
    state: KernelState = OK
    had_gpu: bool = False  # held GPU memory in this process's life
    suspended: dict[str, Any] | None = None  # pids, devices, gpus, memory, lease of a suspended kernel
    message: str = ""
    busy_s: float = 0.0
    idle_s: float = 0.0
    memory_peak_mib: int = 0
    share_warned_at: float | None = None
    busy_since: float | None = None  # executing since (None while idle)
    task: asyncio.Task | None = None
    connection_file: str = ""
    reported_pid: int | None = None  # the pid a kernel without a local process told us
    pid_asked: bool = False

    @property
    def executing(self) -> bool:
        return self.execution_state == "busy"

    @property
    def working(self) -> bool:
        """A reclaim or resume task of this kernel is still running."""
        return self.task is not None and not self.task.done()

    @property
    def holds_gpu(self) -> bool:
        """Holds GPU memory now (a suspended kernel's memory is in host memory)."""
        return self.state != SUSPENDED and self.gpu is not None and self.gpu.holds_memory

    @property
    def label(self) -> str:
        """How messages name the kernel: its short id and kernel name."""
        return f"{self.id[:8]}" + (f" ({self.name})" if self.name else "")


def kernel_label(rec: KernelRecord | None) -> str:
    return "?" if rec is None else rec.label


class KernelTable(LoggingConfigurable):
    """The kernels of this server, refreshed at every sample (see the module)."""

    def __init__(self, *, kernel_manager: Any, monitor: Any, tasks: BackgroundTasks, clock: Callable[[], float],
                 session_manager: Any = None, **kwargs: Any):
        super().__init__(**kwargs)
        self.km = kernel_manager
        self.sessions = session_manager
        self.monitor = monitor
        self.tasks = tasks
        self.clock = clock
        self.records: dict[str, KernelRecord] = {}
        self._env_cache: dict[int, str | None] = {}
        self._paths_read: float | None = None

    # ------------------------------------------------------------------ mapping
    def __iter__(self):
        return iter(list(self.records.values()))

    def __len__(self) -> int:
        return len(self.records)

    def __contains__(self, kernel_id: object) -> bool:
        return kernel_id in self.records

    def __getitem__(self, kernel_id: str) -> KernelRecord:
        return self.records[kernel_id]

    def get(self, kernel_id: str | None) -> KernelRecord | None:
        return self.records.get(kernel_id) if kernel_id else None

    # ------------------------------------------------------------------ refresh
    def refresh(self) -> None:
        """Read the kernels from the kernel manager (on the loop: attribute reads only)."""
        seen = set()
        for kid in list(self.km.list_kernel_ids()):
            try:
                kernel = self.km.get_kernel(kid)
                model = self.km.kernel_model(kid)
            except Exception:  # gone meanwhile (KeyError, or jupyter_server's 404)
                continue
            seen.add(kid)
            rec = self.records.get(kid)
            if rec is None:
                rec = self.records[kid] = KernelRecord(kid)
                self._paths_read = None  # a new kernel: read its notebook path at the next sample
            self._update(rec, kernel, model)
        for kid in list(self.records):
            if kid not in seen:
                rec = self.records.pop(kid)
                self.mark_suspended(rec, False)
                if rec.working:
                    rec.task.cancel()

    def _update(self, rec: KernelRecord, kernel: Any, model: dict[str, Any]) -> None:
        prov = getattr(kernel, "provisioner", None)
        pid = _int_or_none(getattr(prov, "pid", None)) or rec.reported_pid
        if pid != rec.pid:
            # a new process (a restart): its GPU past is gone with the old one
            if rec.pid is not None:
                rec.had_gpu = False
                rec.memory_peak_mib = 0
                if rec.state in (SUSPENDED, RECLAIMED) and not rec.working:
                    rec.state, rec.suspended = OK, None
                    self.mark_suspended(rec, False)
            rec.pid = pid
            rec.env_devices = None
        rec.pgid = _int_or_none(getattr(prov, "pgid", None))
        rec.name = model.get("name") or ""
        rec.execution_state = model.get("execution_state") or ""
        rec.busy_since = (rec.busy_since or self.clock()) if rec.executing else None
        rec.last_activity = _epoch(model.get("last_activity"))
        try:
            rec.connections = int(model.get("connections") or 0)
        except (TypeError, ValueError):
            rec.connections = 0
        cf = getattr(kernel, "connection_file", "")
        if cf:
            rec.connection_file = cf
        if rec.pid is None and not rec.pid_asked:
            rec.pid_asked = True
            self.tasks.start(self.ask_kernel_pid(rec, kernel))

    async def ask_kernel_pid(self, rec: KernelRecord, kernel: Any) -> int | None:
        """A kernel without a local process (remote provisioner): ask it for its pid (ipykernel's usage_request)."""
        try:
            client = kernel.client()
            client.start_channels(shell=False, iopub=False, stdin=False, hb=False, control=True)
            try:
                msg = client.session.msg("usage_request", {})
                client.control_channel.send(msg)
                reply = await asyncio.wait_for(_maybe_await(client.control_channel.get_msg(timeout=10)), 15)
                pid = reply.get("content", {}).get("pid")
                if isinstance(pid, int) and pid > 0:
                    rec.reported_pid = pid
                    return pid
            finally:
                client.stop_channels()
        except Exception as e:  # a kernel that cannot say is attributed at device level
            self.log.debug("Kernel %s did not report its pid: %s", rec.id, e)
        return None

    async def read_paths(self, now: float) -> None:
        """Each kernel's notebook path, from the session manager (every few seconds, and for new kernels)."""
        if self.sessions is None or (self._paths_read is not None and now - self._paths_read < PATHS_EVERY_S):
            return
        self._paths_read = now
        try:
            sessions = await _maybe_await(self.sessions.list_sessions())
        except Exception as e:  # the session store must not stop the monitor
            self.log.debug("GPU monitor: could not list the sessions: %s", e)
            return
        paths = {}
        for s in sessions or []:
            kid = (s.get("kernel") or {}).get("id")
            if kid:
                paths[kid] = s.get("path") or ""
        for rec in self.records.values():
            rec.path = paths.get(rec.id, "")

    async def read_environments(self) -> None:
        """CUDA_VISIBLE_DEVICES of new kernel processes, read from ``/proc`` in the monitor's thread."""
        new_pids = [k.pid for k in self.records.values() if k.pid and k.pid not in self._env_cache]
        if new_pids:
            self._env_cache.update(await self.monitor.run_blocking(read_cuda_env, new_pids))

    def env_of(self, rec: KernelRecord) -> str | None:
        """The devices a kernel's process started with (None: not known)."""
        if rec.env_devices is None and rec.pid:
            rec.env_devices = self._env_cache.get(rec.pid)
        return rec.env_devices

    async def process_tree(self, rec: KernelRecord) -> list[int]:
        if not rec.pid:
            return []
        return await self.monitor.run_blocking(process_tree, rec.pid)

    # ------------------------------------------------------------------ GPU use
    def uses(self, snap: Snapshot) -> list[KernelUse]:
        """How each kernel uses the leased GPU in ``snap`` (and its record updated with it)."""
        att = snap.attribution
        device_mode = att is not None and att.mode == "device"
        device_util = [s.utilization_pct for s in snap.devices.values() if s.utilization_pct is not None]
        dev_sm = max(device_util) if device_util else None
        dev_mem = sum(s.memory_used_mib or 0 for s in snap.devices.values())
        uses = []
        for rec in self.records.values():
            gpu = att.kernels.get(rec.id) if att is not None else None
            rec.gpu = gpu
            if device_mode:
                # which kernel uses what is unknown: every kernel that may use the GPU counts
                may = rec.state != SUSPENDED and rec.env_devices not in ("", None)
                holds = bool(may and dev_mem)
                sm = dev_sm
            else:
                holds = bool(gpu and gpu.holds_memory)
                sm = gpu.sm_util_pct if gpu is not None else None
                if holds and sm is None and gpu is not None:
                    sm = self._alone_util(rec, gpu, snap)
                if holds:
                    rec.had_gpu = True
            if gpu is not None and gpu.memory_mib:
                rec.memory_peak_mib = max(rec.memory_peak_mib, gpu.memory_mib)
            uses.append(KernelUse(rec.id, rec.executing, holds, sm))
        return uses

    def _alone_util(self, rec: KernelRecord, gpu: KernelGPU, snap: Snapshot) -> float | None:
        """The driver does not say per process: the device's figure, if only this kernel is on it."""
        others = [o for o in snap.attribution.others if o.device_uuid in gpu.devices]
        alone = not others and all(
            k2.id == rec.id or not (k2.gpu and set(k2.gpu.devices) & set(gpu.devices)) for k2 in self.records.values())
        if not alone:
            return None
        vals = [snap.devices[d].utilization_pct for d in gpu.devices if d in snap.devices and snap.devices[d].utilization_pct is not None]
        return max(vals) if vals else None

    def others_hold_gpu(self, rec: KernelRecord) -> bool:
        return any(k.id != rec.id and k.holds_gpu for k in self.records.values())

    def process_list(self) -> list[KernelProcess]:
        return [KernelProcess(k.id, k.pid, k.pgid) for k in self.records.values()]

    # ------------------------------------------------------------------ the suspended marker
    def mark_suspended(self, rec: KernelRecord, on: bool) -> None:
        """The file beside the kernel's connection file that tells its %gpu extension it is suspended
        (its next cell then asks for the resume and waits for it: see kernel/resume.py)."""
        if not rec.connection_file:
            try:
                rec.connection_file = getattr(self.km.get_kernel(rec.id), "connection_file", "") or ""
            except Exception:
                pass
        if not rec.connection_file:
            return
        path = marker_path(rec.connection_file)
        try:
            if on:
                with open(path, "w", encoding="utf-8") as f:
                    # parked: nothing was put aside, the kernel takes the new lease's environment itself
                    json.dump({"kernel_id": rec.id, "at": self.clock(), "parked": bool((rec.suspended or {}).get("parked"))}, f)
            elif os.path.exists(path):
                os.remove(path)
        except OSError as e:
            self.log.debug("Could not %s %s: %s", "write" if on else "remove", path, e)


def _int_or_none(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None


def _epoch(v: Any) -> float | None:
    """The kernel model's ``last_activity`` (ISO 8601, or a datetime) as epoch seconds."""
    if isinstance(v, datetime.datetime):
        return v.timestamp()
    if isinstance(v, str) and v:
        try:
            return datetime.datetime.fromisoformat(v.replace("Z", "+00:00")).timestamp()
        except ValueError:
            return None
    return None


async def _maybe_await(v: Any) -> Any:
    if inspect.isawaitable(v):
        return await v
    return v


def read_cuda_env(pids: list[int]) -> dict[int, str | None]:
    """CUDA_VISIBLE_DEVICES of each process (None where it is not set or cannot be read). Blocking."""
    out: dict[int, str | None] = {}
    for pid in pids:
        try:
            out[pid] = psutil.Process(pid).environ().get("CUDA_VISIBLE_DEVICES")
        except (psutil.Error, OSError):
            out[pid] = None
    return out


def process_tree(pid: int) -> list[int]:
    """A process and its descendants. Blocking."""
    try:
        p = psutil.Process(pid)
        return [pid] + [c.pid for c in p.children(recursive=True)]
    except psutil.Error:
        return [pid]
