"""The extension's work: sample, attribute, decide, act, resume, report.

:class:`GPUSupervisor` wires the parts together on the server's event loop:

* every ``sample_interval`` it gathers the kernels (on the loop: cheap attribute reads), has the
  :class:`~.monitor.Monitor` sample the leased devices and attribute GPU processes to kernels
  (in a worker thread), feeds the :class:`~.reclaim.ReclaimTracker` and carries out its
  decisions: warnings in the feed, then the reclaim action per kernel, then the lease returned
  to the broker as *reclaimed*;
* it watches each share's memory cap (warn, then act the same way);
* it resumes a suspended kernel that starts a cell (a new lease of the same shape, its former
  GPU preferred, then a restore), reporting queue position and ETA meanwhile;
* it keeps kernels' environment in step with the lease: kernels started after a change get the
  new ``CUDA_VISIBLE_DEVICES``; running ones keep theirs and the user is told;
* it reports GPU activity as server activity and builds the heartbeats' usage.

All decisions that do not need I/O live in :mod:`.reclaim` and :mod:`jupyter_gpulease.core.idle`.
"""

from __future__ import annotations

import asyncio
import datetime
import inspect
import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import psutil

from ..client import BrokerError
from ..core.idle import IdleRule
from ..core.text import format_duration as fmt_duration
from ..core.unleased import WARNING_KIND as UNLEASED_WARNING
from ..hub.placement import cpu_only_environment, lease_environment
from ..kernel.resume import marker_path
from .attribution import KernelGPU, KernelProcess
from .checkpoint import CheckpointError, CudaCheckpoint, unavailable_reason
from .feed import Feed
from .lease import LeaseKeeper, lease_devices, lease_gpus, same_shape_request
from .monitor import Monitor, Snapshot
from .reclaim import Decision, KernelUse, ReclaimTracker

log = logging.getLogger(__name__)

ACTIONS = ("suspend", "restart", "interrupt", "shutdown", "notify")
FALLBACK_ACTIONS = ("restart", "interrupt", "shutdown", "notify")
STATUS_VERSION = 1


@dataclass
class Settings:
    """What the extension's traits configure (see :mod:`.app` for the help of each)."""

    sample_interval: float = 1.0
    history_s: float = 600.0
    threshold_pct: float = 5.0
    idle_rule: IdleRule = field(default_factory=lambda: IdleRule(timeout_s=1800.0))
    reclaim_busy: bool = False
    action: str = "suspend"
    fallback_action: str = "restart"
    warn_before_s: float = 300.0
    on_reclaim: str = "keep"
    max_keep_s: float = 4 * 3600.0
    resume_on_execute: bool = True
    resume_max_wait_s: float | None = None
    share_grace_s: float = 60.0
    report_activity: bool = True
    broker_url: str = ""
    gaps_file: str = ""


@dataclass
class KernelRecord:
    """What the extension remembers of one kernel."""

    id: str
    name: str = ""
    pid: int | None = None
    pgid: int | None = None
    execution_state: str = ""
    last_activity: float | None = None
    connections: int = 0
    env_devices: str | None = None  # its CUDA_VISIBLE_DEVICES (None: not known yet)
    gpu: KernelGPU | None = None
    state: str = "ok"  # ok | acting | suspended | resuming | reclaimed
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

    @property
    def executing(self) -> bool:
        return self.execution_state == "busy"


class GPUSupervisor:
    """See the module docstring. ``kernel_manager`` is the server's MappingKernelManager."""

    def __init__(
        self,
        *,
        kernel_manager: Any,
        monitor: Monitor,
        keeper: LeaseKeeper,
        feed: Feed,
        settings: Settings,
        checkpoint: CudaCheckpoint | None = None,
        checkpoint_missing: str = "",
        web_settings: dict[str, Any] | None = None,
        stop_server: Callable[[], None] | None = None,
        user: str = "",
        clock: Callable[[], float] = time.time,
    ):
        self.km = kernel_manager
        self.monitor = monitor
        self.keeper = keeper
        self.feed = feed
        self.settings = settings
        self.checkpoint = checkpoint
        self.checkpoint_missing = checkpoint_missing
        self.web_settings = web_settings if web_settings is not None else {}
        self.stop_server = stop_server
        self.user = user
        self.clock = clock
        self.kernels: dict[str, KernelRecord] = {}
        self.tracker = ReclaimTracker(
            settings.idle_rule,
            threshold_pct=settings.threshold_pct,
            reclaim_busy=settings.reclaim_busy,
            warn_before_s=settings.warn_before_s,
            max_keep_s=settings.max_keep_s,
        )
        self.gaps: list[float] = self._load_gaps()
        self.last_gpu_activity: float | None = None
        self.device_usage: dict[str, dict[str, float]] = {}
        self.returning = False  # the lease is being returned (env already CPU-only)
        self.resume: dict[str, Any] | None = None  # the resume in progress, for the status
        self.notices: list[dict[str, Any]] = []  # standing notices (env, attribution), for the status
        self._task: asyncio.Task | None = None
        self._tasks: set[asyncio.Task] = set()
        self._stopping = False
        self._last_tick: float | None = None
        self._env_saved: dict[str, str | None] = {}
        self._env_cache: dict[int, str | None] = {}
        self._attribution_mode = "process"
        self._broker_warned: set[tuple[str, float]] = set()
        self._preempt_suspend_at: float | None = None
        self._preempt_noticed: float | None = None  # the preemption end already warned about
        self._unleased: dict[tuple, dict[str, Any]] = {}  # the broker's unleased-use warnings now: (pid, device) -> warning
        self._unleased_polled = 0.0
        keeper.on_change = self._lease_changed
        keeper.on_warnings = self._broker_warnings
        keeper.usage = self.usage
        # kernels started from now on get the environment of the lease the server starts with
        self._kernel_env_lease_id = os.environ.get("GPULEASE_LEASE_ID", "")

    # ------------------------------------------------------------------ life
    async def start(self) -> None:
        self.monitor.watch_all = os.environ.get("GPULEASE_DEVICE_CHOICE") == "engine"
        await self.keeper.start()
        if self.keeper.lease_id and not self.monitor.devices:
            placement = os.environ.get("GPULEASE_PLACEMENT")
            if placement:  # watch the spawner's placement until the broker answers
                try:
                    self.monitor.watch(lease_devices({"placement": json.loads(placement)}))
                except (ValueError, KeyError, TypeError):
                    log.warning("GPULEASE_PLACEMENT is not a placement JSON; waiting for the broker to say which GPUs are leased")
            self.tracker.lease_granted(self.clock())
        self._task = asyncio.ensure_future(self._loop())

    async def stop(self) -> None:
        self._stopping = True
        if self._task is not None:
            self._task.cancel()
        for rec in self.kernels.values():
            self._mark_suspended(rec, False)
        for t in list(self._tasks):
            t.cancel()
        await self.keeper.stop(release=True)
        self.monitor.close()
        for k, v in self._env_saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v

    def _spawn(self, coro) -> asyncio.Task:
        t = asyncio.ensure_future(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)
        return t

    async def _loop(self) -> None:
        while not self._stopping:
            t0 = time.monotonic()
            try:
                await self.tick()
            except asyncio.CancelledError:
                raise
            except Exception:  # one bad sample must not end the monitor
                log.exception("GPU monitor: a sample failed")
            await asyncio.sleep(max(0.0, self.settings.sample_interval - (time.monotonic() - t0)))

    # ------------------------------------------------------------------ one sample
    async def tick(self) -> Snapshot:
        now = self.clock()
        dt = 0.0 if self._last_tick is None else max(0.0, min(now - self._last_tick, 10 * self.settings.sample_interval))
        self._last_tick = now
        self._refresh_kernels()
        procs = [KernelProcess(k.id, k.pid, k.pgid) for k in self.kernels.values()]
        new_pids = [k.pid for k in self.kernels.values() if k.pid and k.pid not in self._env_cache]
        snap = await self.monitor.sample(procs)
        if new_pids:
            envs = await asyncio.get_running_loop().run_in_executor(self.monitor._executor, _read_cuda_env, new_pids)
            self._env_cache.update(envs)
        self.monitor.record(snap)
        att = snap.attribution
        if att is not None and att.mode != self._attribution_mode:
            self._attribution_mode = att.mode
            log.warning("GPU monitor: %s", att.message) if att.mode == "device" else log.info("GPU monitor: per-kernel attribution works again")
            if att.mode == "device":
                self._notice("attribution", att.message)
        uses = self._uses(snap)
        self._account(snap, uses, dt)
        for gap in self.tracker.observe(now, uses):
            self._learn(gap)
        self._report_activity(snap, uses, now)
        if self.keeper.active and not self.returning:
            timeout = self.timeout()
            # samples drift by milliseconds: a deadline that falls on a sample is due at that sample, not the next
            for d in self.tracker.plan(now + 0.05 * self.settings.sample_interval, timeout, lease_active=True):
                self._decide(d, now)
            self._check_shares(snap, now)
        self._check_preemption(now)
        self._check_resume(now)
        if any(n["kind"] == "env_stale" for n in self.notices):
            self._env_notice()  # a stale kernel restarted or went away: say so
        if self.keeper.client is not None and self.keeper.active is None and now - self._unleased_polled >= self.keeper.heartbeat_interval:
            self._unleased_polled = now
            self._spawn(self._poll_unleased())
        self.feed.publish("sample", self.sample_json(snap))
        return snap

    def _refresh_kernels(self) -> None:
        seen = set()
        for kid in list(self.km.list_kernel_ids()):
            try:
                kernel = self.km.get_kernel(kid)
            except KeyError:
                continue
            seen.add(kid)
            rec = self.kernels.get(kid)
            if rec is None:
                rec = self.kernels[kid] = KernelRecord(kid)
            prov = getattr(kernel, "provisioner", None)
            pid = _int_or_none(getattr(prov, "pid", None))
            if pid is None:
                pid = getattr(kernel, "gpulease_reported_pid", None)
            if pid != rec.pid:
                # a new process (a restart): its GPU past is gone with the old one
                if rec.pid is not None:
                    rec.had_gpu = False
                    rec.memory_peak_mib = 0
                    if rec.state in ("suspended", "reclaimed") and not (rec.task and not rec.task.done()):
                        rec.state, rec.suspended = "ok", None
                        self._mark_suspended(rec, False)
                rec.pid = pid
                rec.env_devices = None
            rec.pgid = _int_or_none(getattr(prov, "pgid", None))
            rec.name = getattr(kernel, "kernel_name", "") or ""
            rec.execution_state = getattr(kernel, "execution_state", "") or ""
            if rec.executing:
                rec.busy_since = rec.busy_since or self.clock()
            else:
                rec.busy_since = None
            last = getattr(kernel, "last_activity", None)
            rec.last_activity = last.timestamp() if isinstance(last, datetime.datetime) else None
            try:
                rec.connections = int(self.km._kernel_connections.get(kid, 0))
            except (AttributeError, TypeError, ValueError):
                rec.connections = 0
            if rec.pid is None and not getattr(kernel, "gpulease_pid_asked", False):
                kernel.gpulease_pid_asked = True
                self._spawn(self._ask_kernel_pid(kernel))
        for kid in list(self.kernels):
            if kid not in seen:
                rec = self.kernels.pop(kid)
                self._mark_suspended(rec, False)
                if rec.task and not rec.task.done():
                    rec.task.cancel()

    async def _ask_kernel_pid(self, kernel: Any) -> None:
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
                    kernel.gpulease_reported_pid = pid
            finally:
                client.stop_channels()
        except Exception as e:  # a kernel that cannot say is attributed at device level
            log.debug("Kernel %s did not report its pid: %s", getattr(kernel, "kernel_id", "?"), e)

    def _uses(self, snap: Snapshot) -> list[KernelUse]:
        att = snap.attribution
        device_mode = att is not None and att.mode == "device"
        device_util = [s.utilization_pct for s in snap.devices.values() if s.utilization_pct is not None]
        dev_sm = max(device_util) if device_util else None
        dev_mem = sum(s.memory_used_mib or 0 for s in snap.devices.values())
        uses = []
        for rec in self.kernels.values():
            gpu = att.kernels.get(rec.id) if att is not None else None
            rec.gpu = gpu
            if device_mode:
                # which kernel uses what is unknown: every kernel that may use the GPU counts
                may = rec.state not in ("suspended",) and rec.env_devices not in ("", None)
                holds = bool(may and dev_mem)
                sm = dev_sm
            else:
                holds = bool(gpu and gpu.holds_memory)
                sm = gpu.sm_util_pct if gpu is not None else None
                if holds and sm is None and gpu is not None:
                    # the driver does not say per process: the device's figure, if only this kernel is on it
                    others = [o for o in att.others if o.device_uuid in gpu.devices]
                    alone = not others and all(
                        k2.id == rec.id or not (k2.gpu and set(k2.gpu.devices) & set(gpu.devices)) for k2 in self.kernels.values())
                    if alone:
                        vals = [snap.devices[d].utilization_pct for d in gpu.devices if d in snap.devices and snap.devices[d].utilization_pct is not None]
                        sm = max(vals) if vals else None
                if holds:
                    rec.had_gpu = True
            if gpu is not None and gpu.memory_mib:
                rec.memory_peak_mib = max(rec.memory_peak_mib, gpu.memory_mib)
            uses.append(KernelUse(rec.id, rec.executing, holds, sm))
        return uses

    def _account(self, snap: Snapshot, uses: list[KernelUse], dt: float) -> None:
        """Busy and idle seconds per kernel and device, for the heartbeats."""
        if not dt or not self.keeper.active:
            return
        thr = self.settings.threshold_pct
        for u in uses:
            rec = self.kernels.get(u.kernel_id)
            if rec is None or not u.holds_gpu:
                continue
            if (u.sm_util_pct or 0.0) >= thr or u.executing:
                rec.busy_s += dt
            else:
                rec.idle_s += dt
        for uuid, s in snap.devices.items():
            d = self.device_usage.setdefault(uuid, {"busy_s": 0.0, "idle_s": 0.0, "mem_peak_mib": 0})
            if (s.utilization_pct or 0.0) >= thr:
                d["busy_s"] += dt
            else:
                d["idle_s"] += dt
            d["mem_peak_mib"] = max(d["mem_peak_mib"], s.memory_used_mib or 0)

    # ------------------------------------------------------------------ idle timeouts
    def timeout(self) -> float | None:
        return self.settings.idle_rule.timeout(self.gaps)

    def _load_gaps(self) -> list[float]:
        path = self.settings.gaps_file
        if not path or not os.path.exists(path):
            return []
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
            return [float(g) for g in data.get("gaps", []) if isinstance(g, (int, float)) and g > 0][-200:]
        except (OSError, ValueError, AttributeError) as e:
            log.warning("GPU idle rule: ignoring %s (%s)", path, e)
            return []

    def _learn(self, gap: float) -> None:
        self.gaps = (self.gaps + [round(gap, 1)])[-200:]
        path = self.settings.gaps_file
        if not path or not self.settings.idle_rule.learn:
            return
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            tmp = path + ".tmp"
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump({"user": self.user, "gaps": self.gaps}, f)
            os.replace(tmp, path)
        except OSError as e:
            log.debug("Could not save idle gaps to %s: %s", path, e)

    # ------------------------------------------------------------------ hub activity
    def _report_activity(self, snap: Snapshot, uses: list[KernelUse], now: float) -> None:
        thr = self.settings.threshold_pct
        active = any((u.sm_util_pct or 0.0) >= thr or (u.executing and u.holds_gpu) for u in uses)
        if not active and self._attribution_mode == "device":
            active = any((s.utilization_pct or 0.0) >= thr for s in snap.devices.values())
        if active:
            self.last_gpu_activity = now
            if self.settings.report_activity:
                # jupyter_server counts every web_app setting ending in _last_activity as server activity
                self.web_settings["gpulease_last_activity"] = datetime.datetime.fromtimestamp(now, datetime.UTC)

    def gpu_busy(self) -> bool:
        """Whether a kernel used the GPU within the last few samples (the server's current_activity)."""
        return self.last_gpu_activity is not None and self.clock() - self.last_gpu_activity <= 3 * self.settings.sample_interval

    # ------------------------------------------------------------------ reclaim
    def _decide(self, d: Decision, now: float) -> None:
        action = self.settings.action
        if d.kind == "warn":
            rec = self.kernels.get(d.kernel_id)
            what = self._action_words(action, rec)
            self._warn("reclaim", f"Kernel {self._kname(rec)} has not used its GPU for {fmt_duration(d.idle_s)}: "
                       f"{what} in {fmt_duration(d.deadline - now)} unless it computes again (or you keep the GPU).",
                       deadline=d.deadline, kernel_id=d.kernel_id, action=action)
        elif d.kind == "act":
            rec = self.kernels.get(d.kernel_id)
            if rec is not None and rec.state == "ok":
                rec.state = "acting"
                rec.task = self._spawn(self._act(rec, action, f"its GPU sat idle for {fmt_duration(d.idle_s)}"))
        elif d.kind == "warn_lease":
            self._warn("lease_reclaim", f"No kernel has used the GPU for {fmt_duration(d.idle_s)}: the GPU lease goes back to the pool in "
                       f"{fmt_duration(d.deadline - now)} ({'the server then stops' if self.settings.on_reclaim == 'stop' else 'the server keeps running without a GPU'}).",
                       deadline=d.deadline)
        elif d.kind == "return_lease" and not any(k.task and not k.task.done() for k in self.kernels.values()):
            self.returning = True
            self._spawn(self._return_lease(f"idle: no kernel used the GPU for {fmt_duration(d.idle_s)}"))

    def _action_words(self, action: str, rec: KernelRecord | None) -> str:
        reason = self.suspend_unavailable(rec)
        if action == "suspend" and reason:
            action = self.settings.fallback_action
        return {
            "suspend": "its GPU memory will be moved to host memory (nothing is lost; the next cell waits for a GPU)",
            "restart": "it will be restarted (its variables are lost)",
            "interrupt": "it will be interrupted",
            "shutdown": "it will be shut down (its variables are lost)",
            "notify": "you will be asked to free the GPU",
        }[action]

    def suspend_unavailable(self, rec: KernelRecord | None = None) -> str:
        """Why a kernel cannot be suspended here ("" when it can)."""
        if self.checkpoint is None:
            return self.checkpoint_missing or "cuda-checkpoint is not available"
        lease = self.keeper.active or {}
        mig = any(s.get("mig_uuid") for s in (lease.get("placement") or {}).get("slices", []))
        return unavailable_reason(self.checkpoint.path, self.checkpoint.path, mig=mig)

    async def _act(self, rec: KernelRecord, action: str, why: str, *, idle: bool = True) -> None:
        """Free a kernel's GPU by ``action``; suspend falls back (and says why) where it cannot work.

        ``idle``: the kernel was reclaimed for idleness, so when no other kernel holds GPU memory
        the lease goes back right after (not so for a share's memory overrun: the GPU is in use)."""
        try:
            if action == "suspend":
                reason = self.suspend_unavailable(rec)
                if reason:
                    fb = self.settings.fallback_action
                    self._reclaim_event(rec, "suspend", "fallback", f"Kernel {self._kname(rec)} cannot be suspended ({reason}); "
                                        f"doing '{fb}' instead.")
                    action = fb
                elif await self._suspend(rec, why):
                    if idle and self.keeper.active and not self._others_hold_gpu(rec):
                        # its memory is in host memory now and nobody else holds any: the lease goes back
                        # at once, not at the next sample
                        await self._return_lease(f"idle: {why}")
                    return
                else:
                    action = self.settings.fallback_action
            await self._plain_action(rec, action, why, idle=idle)
        finally:
            if rec.state == "acting":
                rec.state = "reclaimed"

    async def _plain_action(self, rec: KernelRecord, action: str, why: str, *, idle: bool = True) -> None:
        name = self._kname(rec)
        if idle and action in ("restart", "shutdown") and self.keeper.active and not self._others_hold_gpu(rec):
            # the lease goes back right after: the restarted kernel comes up without the GPU
            self.returning = True
            self._set_kernel_env(None)
        try:
            if action == "restart":
                await _maybe_await(self.km.restart_kernel(rec.id))
                msg = f"Kernel {name} was restarted to free its GPU: {why}. Its variables are gone; run your notebook again."
            elif action == "shutdown":
                await _maybe_await(self.km.shutdown_kernel(rec.id))
                msg = f"Kernel {name} was shut down to free its GPU: {why}."
            elif action == "interrupt":
                await _maybe_await(self.km.interrupt_kernel(rec.id))
                msg = f"Kernel {name} was interrupted: {why}. Free its GPU memory (or restart it) to give the GPU back."
            else:
                msg = f"Kernel {name} holds GPU memory while idle ({why}). Free it (del the tensors, restart the kernel) to give the GPU back."
        except Exception as e:  # report, do not crash the monitor
            log.warning("Reclaim action %s on kernel %s failed: %s", action, rec.id, e)
            self._reclaim_event(rec, action, "failed", f"Could not {action} kernel {name}: {e}")
            if self.returning and not self.keeper.active:
                return
            self.returning = False
            self._set_kernel_env(self.keeper.active)
            return
        rec.message = msg
        self._reclaim_event(rec, action, "done", msg)
        if action in ("restart", "shutdown") and self.returning:
            await self._return_lease(f"idle: {why}")

    async def _suspend(self, rec: KernelRecord, why: str) -> bool:
        """Suspend a kernel's GPU processes; False (and the user told) when it failed."""
        pids = list(rec.gpu.pids) if rec.gpu and rec.gpu.pids else await self._kernel_tree(rec)
        devices = list(rec.gpu.devices) if rec.gpu and rec.gpu.devices else lease_devices(self.keeper.active)
        memory = rec.gpu.memory_mib if rec.gpu else None
        lease = self.keeper.active or self.keeper.ended or {}
        t0 = time.monotonic()
        try:
            await self.checkpoint.suspend(pids)
        except CheckpointError as e:
            self._reclaim_event(rec, "suspend", "failed", f"Suspending kernel {self._kname(rec)} failed ({e}); "
                                f"doing '{self.settings.fallback_action}' instead.")
            return False
        rec.state = "suspended"
        self._mark_suspended(rec, True)
        rec.suspended = {"pids": pids, "devices": devices, "gpus": lease_gpus(lease) or devices, "memory_mib": memory,
                         "at": self.clock(), "lease": lease, "suspend_s": round(time.monotonic() - t0, 3)}
        msg = (f"Kernel {self._kname(rec)} was suspended ({why}): its GPU memory"
               f"{f' ({memory} MiB)' if memory else ''} is kept in host memory and nothing is lost"
               f"{f' ({note})' if (note := getattr(self.checkpoint, 'note', '')) else ''}. "
               + ("Its next cell waits for a GPU, then goes on." if self.settings.resume_on_execute
                  else "Resume it (%gpu resume, or the GPU panel) to get a GPU back."))
        rec.message = msg
        self._reclaim_event(rec, "suspend", "done", msg, memory_mib=memory, seconds=rec.suspended["suspend_s"])
        return True

    async def _kernel_tree(self, rec: KernelRecord) -> list[int]:
        if not rec.pid:
            return []
        return await asyncio.get_running_loop().run_in_executor(self.monitor._executor, _process_tree, rec.pid)

    def _others_hold_gpu(self, rec: KernelRecord) -> bool:
        return any(k.id != rec.id and k.state != "suspended" and k.gpu is not None and k.gpu.holds_memory for k in self.kernels.values())

    async def _return_lease(self, reason: str) -> None:
        lease = self.keeper.active
        if lease is None:
            self.returning = False
            return
        self.returning = True
        self._set_kernel_env(None)
        stop = self.settings.on_reclaim == "stop"
        try:
            await self.keeper.release(state="reclaimed", reason=reason, keep_server=not stop)
        except BrokerError as e:
            log.warning("Could not return GPU lease %s as reclaimed: %s", lease["id"], e.message)
            self.returning = False
            self._set_kernel_env(self.keeper.active)
            self._notice("broker", f"The idle GPU lease could not be returned yet ({e.message}); retrying.")
            return
        self.returning = False
        self.feed.publish("lease", {"event": "reclaimed", "lease": self.lease_json(self.keeper.ended),
                                    "message": f"The GPU lease went back to the pool ({reason}). "
                                    + ("The server stops now." if stop else "This server keeps running without a GPU; "
                                       "your next GPU cell asks for one again.")})
        if stop and self.stop_server is not None:
            self.stop_server()

    # ------------------------------------------------------------------ shares
    def _check_shares(self, snap: Snapshot, now: float) -> None:
        lease = self.keeper.active
        slices = ((lease or {}).get("placement") or {}).get("slices") or []
        caps = {(s.get("mig_uuid") or s["gpu_uuid"]): int(s["memory_mib"]) for s in slices if float(s.get("share", 1.0)) < 1.0}
        if not caps or snap.attribution is None or snap.attribution.mode != "process":
            return
        by_pid = {}
        for s in snap.devices.values():
            for p in s.processes:
                by_pid[(p.pid, p.device_uuid)] = p
        for rec in self.kernels.values():
            over = [(p.pid, p.device_uuid, p.used_memory_mib) for (pid, dev), p in by_pid.items()
                    if snap.attribution.owner.get(pid) == rec.id and dev in caps and (p.used_memory_mib or 0) > caps[dev]]
            if not over:
                rec.share_warned_at = None
                continue
            pid, dev, mib = over[0]
            if rec.share_warned_at is None:
                rec.share_warned_at = now
                self._warn("share_memory", f"Kernel {self._kname(rec)} (process {pid}) uses {mib} MiB of GPU memory, over this server's share "
                           f"of {caps[dev]} MiB: free some within {fmt_duration(self.settings.share_grace_s)} or "
                           f"{self._action_words(self.settings.action, rec).split(' (')[0]}.",
                           deadline=now + self.settings.share_grace_s, kernel_id=rec.id, action=self.settings.action)
            elif now - rec.share_warned_at >= self.settings.share_grace_s and rec.state == "ok":
                rec.state = "acting"
                rec.task = self._spawn(self._act(rec, self.settings.action, f"it used {mib} MiB, over the share's {caps[dev]} MiB", idle=False))

    # ------------------------------------------------------------------ broker warnings, preemption, ends
    async def _broker_warnings(self, warnings: list[dict[str, Any]], lease: dict[str, Any]) -> None:
        self._unleased_seen([w for w in warnings if w.get("kind") == UNLEASED_WARNING])
        for w in warnings:
            key = (str(w.get("kind")), float(w.get("at") or 0))
            if w.get("kind") == UNLEASED_WARNING:  # one per process, and again when its deadline moves
                key = (UNLEASED_WARNING, float(w.get("at") or 0), w.get("pid"), w.get("device_uuid"))
            if key in self._broker_warned:
                continue
            self._broker_warned.add(key)
            if w.get("kind") == UNLEASED_WARNING:
                self._warn(UNLEASED_WARNING, w.get("message") or "A process of yours uses a GPU you do not lease.", deadline=w.get("deadline"),
                           pid=w.get("pid"), device_uuid=w.get("device_uuid"))
                continue
            kind = "preemption" if w.get("kind") == "preemption" else "expiring"
            message = w.get("message") or f"The GPU lease ends at {w.get('at')}."
            if kind == "preemption":
                # what this server does about it: the broker cannot know
                message = message[:1].upper() + message[1:].rstrip(".") + "." + self._preemption_saving()
            self._warn(kind, message, deadline=w.get("at"))
        preempt_at = lease.get("preempt_at")
        if preempt_at and float(preempt_at) != self._preempt_noticed:
            preempt_at = self._preempt_noticed = float(preempt_at)
            self._preempt_suspend_at = preempt_at - max(2 * self.settings.sample_interval, 10.0)
            if not any(w.get("kind") == "preemption" for w in warnings):  # say it ourselves if the broker did not
                self._warn("preemption", f"The GPU lease is being preempted for a higher-priority request: it ends in "
                           f"{fmt_duration(max(0.0, preempt_at - self.clock()))}.{self._preemption_saving()}", deadline=preempt_at)

    def _unleased_seen(self, warnings: list[dict[str, Any]]) -> None:
        """The broker's unleased-use warnings now; a process that is no longer in them is said to be
        over (the status bar reads the status again and drops its notification)."""
        now_keys = {(w.get("pid"), w.get("device_uuid")) for w in warnings}
        for pid, _dev in sorted(set(self._unleased) - now_keys, key=str):
            self.feed.publish("notice", {"kind": UNLEASED_WARNING, "message": f"Process {pid} no longer uses a GPU you do not lease."})
        self._unleased = {(w.get("pid"), w.get("device_uuid")): w for w in warnings}

    async def _poll_unleased(self) -> None:
        """Without an active lease no heartbeat carries the broker's unleased-use warnings: ask for them."""
        try:
            got = await self.keeper.client.unleased()
        except BrokerError as e:
            log.debug("Could not read unleased GPU use from the broker: %s", e.message)
            return
        except Exception:
            log.exception("Reading unleased GPU use from the broker failed")
            return
        if self.keeper.active is None:
            await self._broker_warnings([w for w in got.get("warnings") or [] if isinstance(w, dict)], {})

    def _preemption_saving(self) -> str:
        return "" if self.suspend_unavailable() else " Kernels holding the GPU are suspended before then: nothing is lost."

    def _check_preemption(self, now: float) -> None:
        """Before a preemption ends the lease, suspend the kernels that hold the GPU: their work survives."""
        if self._preempt_suspend_at is None or now < self._preempt_suspend_at or not self.keeper.active:
            return
        self._preempt_suspend_at = None
        if self.suspend_unavailable():
            return
        for rec in self.kernels.values():
            if rec.state == "ok" and rec.gpu is not None and rec.gpu.holds_memory:
                rec.state = "acting"
                rec.task = self._spawn(self._suspend_or_leave(rec, "the GPU lease is being preempted"))

    async def _suspend_or_leave(self, rec: KernelRecord, why: str) -> None:
        try:
            if not await self._suspend(rec, why):
                rec.state = "ok"
        finally:
            if rec.state == "acting":
                rec.state = "ok"

    async def _lease_changed(self, kind: str, lease: dict[str, Any] | None) -> None:
        now = self.clock()
        if kind == "granted":
            self.monitor.watch(lease_devices(lease))
            self.tracker.lease_granted(now)
            self.device_usage = {}
            for rec in self.kernels.values():
                rec.busy_s = rec.idle_s = 0.0
            self._set_kernel_env(lease)
            self.feed.publish("lease", {"event": "granted", "lease": self.lease_json(lease),
                                        "message": f"GPU lease {lease['id']} is active: {_placement_words(lease)}."})
        elif kind == "queued":
            self.feed.publish("lease", {"event": "queued", "lease": self.lease_json(lease), "message": _queue_words(lease)})
        elif kind == "updated":
            self.feed.publish("lease", {"event": "updated", "lease": self.lease_json(lease), "message": ""})
        elif kind == "ended":
            self.monitor.watch([])
            self.monitor.watch_all = False  # the engine's devices went with the lease
            self._preempt_suspend_at = None
            self._broker_warned.clear()
            if not self.returning:
                self._set_kernel_env(None)
                state = (lease or {}).get("state")
                if state != "reclaimed":
                    self.feed.publish("lease", {"event": "ended", "lease": self.lease_json(lease),
                                                "message": f"The GPU lease ended ({state}): {(lease or {}).get('end_reason') or 'no reason given'}."})

    def _set_kernel_env(self, lease: dict[str, Any] | None) -> None:
        """The environment kernels started from now on get; running kernels keep theirs (and are told)."""
        broker = self.settings.broker_url
        try:
            env = lease_environment(lease, broker_url=broker) if lease else cpu_only_environment(broker_url=broker)
        except (ValueError, KeyError):
            env = cpu_only_environment(broker_url=broker)
        new_id = env.get("GPULEASE_LEASE_ID", "")
        keys = set(env) | {k for k in os.environ if k.startswith("GPULEASE_")} - {"GPULEASE_BROKER_URL", "GPULEASE_TOKEN"}
        for k in keys:
            if k in ("GPULEASE_DEVICE_BACKEND", "GPULEASE_DEVICE_CONFIG"):
                continue
            if k not in self._env_saved:
                self._env_saved[k] = os.environ.get(k)
            if k in env:
                os.environ[k] = env[k]
            elif k.startswith("GPULEASE_") or k == "CUDA_VISIBLE_DEVICES":
                os.environ.pop(k, None)
        if new_id == self._kernel_env_lease_id:
            return
        self._kernel_env_lease_id = new_id
        self._env_notice()

    def _stale(self, rec: KernelRecord, devices: str) -> bool:
        """Whether a running kernel sees other devices than kernels started now (a suspended or
        resuming kernel gets the lease's devices by its restore: not stale)."""
        env = self._env_of(rec)
        return env is not None and rec.state not in ("suspended", "resuming") and env != devices

    def _env_notice(self) -> None:
        """The standing env_stale notice, said again when what is true changed: it names the
        kernels stale now, against the environment kernels get now (none stale: no notice)."""
        devices = os.environ.get("CUDA_VISIBLE_DEVICES", "")
        stale = [k for k in self.kernels.values() if self._stale(k, devices)]
        current = next((n for n in self.notices if n["kind"] == "env_stale"), None)
        ids = [k.id for k in stale]
        if not stale:
            if current is not None:
                self.notices = [n for n in self.notices if n["kind"] != "env_stale"]
                self.feed.publish("notice", {"kind": "env_stale", "message": "", "kernel_ids": [], "cleared": True})
            return
        if current is not None and current.get("kernel_ids") == ids and current.get("devices") == devices:
            return
        names = ", ".join(self._kname(k) for k in stale)
        what = f"the GPU {devices}" if devices else "no GPU"
        self._notice("env_stale", f"New kernels get {what}; running kernel(s) {names} keep the devices they started with "
                     "until restarted.", kernel_ids=ids, devices=devices)

    def _mark_suspended(self, rec: KernelRecord, on: bool) -> None:
        """The file beside the kernel's connection file that tells its %gpu extension it is suspended
        (its next cell then asks for the resume and waits for it: see kernel/resume.py)."""
        try:
            cf = getattr(self.km.get_kernel(rec.id), "connection_file", "")
        except Exception:
            cf = ""
        cf = cf or getattr(rec, "connection_file", "")
        if not cf:
            return
        rec.connection_file = cf
        path = marker_path(cf)
        try:
            if on:
                with open(path, "w", encoding="utf-8") as f:
                    json.dump({"kernel_id": rec.id, "at": self.clock()}, f)
            elif os.path.exists(path):
                os.remove(path)
        except OSError as e:
            log.debug("Could not %s %s: %s", "write" if on else "remove", path, e)

    def _env_of(self, rec: KernelRecord) -> str | None:
        if rec.env_devices is None and rec.pid:
            rec.env_devices = self._env_cache.get(rec.pid)
        return rec.env_devices

    # ------------------------------------------------------------------ resume
    def _check_resume(self, now: float) -> None:
        if not self.settings.resume_on_execute:
            return
        # busy for a moment only (a frontend asking for kernel_info) is not a cell that needs the GPU
        settle = max(2 * self.settings.sample_interval, 1.0)
        for rec in self.kernels.values():
            if rec.state == "suspended" and rec.executing and now - (rec.busy_since or now) >= settle and not (rec.task and not rec.task.done()):
                rec.task = self._spawn(self.resume_kernel(rec, why="it started a cell"))

    async def resume_kernel(self, rec: KernelRecord, why: str = "asked") -> bool:
        """Get a GPU for a suspended kernel (a new lease if needed) and restore it. True when restored."""
        if rec.state != "suspended" or not rec.suspended:
            return False
        rec.state = "resuming"
        sus = rec.suspended
        t0 = self.clock()
        name = self._kname(rec)
        self._resume_event(rec, "waiting", f"Kernel {name} {why}: getting a GPU back for it.")
        device_map_ok = await self.checkpoint.supports_device_map() if self.checkpoint else False
        lease = self.keeper.active
        try:
            if lease is None:
                lease = await self._resume_lease(rec, sus, device_map_ok)
            if lease is None:
                raise _ResumeFailed("no GPU was granted")
            mapping = _device_map(sus["devices"], lease_devices(lease))
            if mapping is None:
                raise _ResumeFailed("the new lease has fewer devices than the kernel used")
            moved = {o: n for o, n in mapping.items() if o != n}
            if moved and not device_map_ok:
                raise _ResumeFailed("the GPU granted is another one and this cuda-checkpoint cannot restore onto another GPU")
            waited = self.clock() - t0
            self._resume_event(rec, "restoring", f"Restoring kernel {name} onto {', '.join(lease_devices(lease))}…", waited_s=round(waited, 1))
            t1 = time.monotonic()
            await self.checkpoint.restore(sus["pids"], mapping if moved else None)
            restore_s = time.monotonic() - t1
        except (CheckpointError, _ResumeFailed, BrokerError) as e:
            return await self._resume_failed(rec, str(getattr(e, "message", e)))
        rec.state, rec.suspended = "ok", None
        rec.message = ""
        self.resume = None
        self._mark_suspended(rec, False)
        # restored in place: the process uses the new lease's devices, whatever its environment said at start
        rec.env_devices = ",".join(mapping.get(d, d) for d in (rec.env_devices or ",".join(sus["devices"])).split(",") if d)
        self._resume_event(rec, "done", f"Kernel {name} has its GPU back after {fmt_duration(self.clock() - t0)} "
                           f"(waiting {fmt_duration(waited)}, restore {restore_s:.1f} s"
                           f"{'; ' + note if (note := getattr(self.checkpoint, 'note', '')) else ''}); the cell goes on.",
                           waited_s=round(waited, 1), restore_s=round(restore_s, 3))
        return True

    async def _resume_lease(self, rec: KernelRecord, sus: dict[str, Any], device_map_ok: bool) -> dict[str, Any] | None:
        former = sus.get("lease") or self.keeper.ended or {}
        if self.keeper.queued is None:
            if not former.get("request"):
                raise _ResumeFailed("the shape of the former lease is unknown")
            body = same_shape_request(former)
            body["prefer_gpus" if device_map_ok else "require_gpus"] = list(dict.fromkeys(sus.get("gpus") or []))
            body["meta"] = {"resume_of": former.get("id"), "kernel": rec.id}
            if self.settings.resume_max_wait_s:
                body["max_wait_s"] = self.settings.resume_max_wait_s
            await self.keeper.request(body)
        while not self._stopping:
            got = await self.keeper.wait_active(timeout=2.0)
            if got is not None:
                return got
            q = self.keeper.queued
            if q is None:
                ended = self.keeper.ended or {}
                raise _ResumeFailed(f"the lease request ended ({ended.get('state')}: {ended.get('end_reason') or 'no reason'})")
            info = q.get("queue") or {}
            self._resume_event(rec, "waiting", f"Kernel {self._kname(rec)} waits for a GPU: {_queue_words(q)}",
                               position=info.get("position"), eta=info.get("eta"), lease_id=q.get("id"), quiet=True)
        return None

    async def _resume_failed(self, rec: KernelRecord, why: str) -> bool:
        name = self._kname(rec)
        log.warning("Resuming kernel %s failed: %s; restarting it", rec.id, why)
        rec.state, rec.suspended = "ok", None
        self.resume = None
        self._mark_suspended(rec, False)
        try:
            await _maybe_await(self.km.restart_kernel(rec.id))
            msg = (f"Kernel {name} could not get its GPU state back ({why}); it was restarted and its variables are lost. "
                   "Run your notebook again.")
        except Exception as e:
            msg = f"Kernel {name} could not get its GPU state back ({why}) and restarting it failed ({e}): restart it yourself."
        rec.message = msg
        self._resume_event(rec, "failed", msg)
        return False

    # ------------------------------------------------------------------ user actions
    async def request(self, body: dict[str, Any]) -> dict[str, Any]:
        return await self.keeper.request(body)

    async def extend(self, *, by_s: float | None, until: float | None) -> dict[str, Any]:
        return await self.keeper.extend(by_s=by_s, until=until)

    async def release(self, *, reason: str = "", force: bool = False) -> dict[str, Any]:
        holders = [k for k in self.kernels.values() if k.state not in ("suspended",) and k.gpu is not None and k.gpu.holds_memory]
        if holders and not force and self.keeper.active:
            names = ", ".join(f"{self._kname(k)} ({k.gpu.memory_mib} MiB)" for k in holders)
            raise BrokerError(409, f"kernel(s) {names} still hold GPU memory: shut them down or free it first, "
                              "or release with force (they keep running, but the GPU is no longer yours)", "force")
        self.returning = True
        try:
            self._set_kernel_env(None)
            got = await self.keeper.release(state="released", reason=reason or "released from the server", keep_server=True)
        finally:
            self.returning = False
        self.feed.publish("lease", {"event": "released", "lease": self.lease_json(got),
                                    "message": "The GPU lease was given back; this server keeps running without a GPU."})
        return got

    def keep(self, for_s: float) -> float:
        if for_s > self.settings.max_keep_s:
            raise BrokerError(400, f"a keep of {fmt_duration(for_s)} is longer than this server allows: "
                              f"it keeps an idle GPU for at most {fmt_duration(self.settings.max_keep_s)}", "for_s")
        until = self.tracker.keep(self.clock(), for_s)
        self.feed.publish("notice", {"kind": "keep", "message": f"Idle reclaim postponed until {_clock_words(until)} "
                                     f"(at most {fmt_duration(self.settings.max_keep_s)} past each kernel's idle deadline).",
                                     "until": until})
        return until

    async def resume_now(self, kernel_id: str | None = None) -> list[str]:
        """Resume the suspended kernels (or one): their ids, those already resuming included."""
        recs = [k for k in self.kernels.values() if k.state in ("suspended", "resuming") and (kernel_id is None or k.id == kernel_id)]
        for rec in recs:
            if rec.state == "suspended" and not (rec.task and not rec.task.done()):
                rec.task = self._spawn(self.resume_kernel(rec, why="was asked to resume"))
        return [r.id for r in recs]

    async def resume_lease(self) -> dict[str, Any] | None:
        """No kernel is suspended, but the server's last lease was reclaimed: ask for one of the same
        shape again (what "resume" means for a server whose unused GPU went back). None when there
        is nothing to resume (a lease is held or waited for, or the last one was not reclaimed)."""
        former = self.keeper.ended or {}
        if self.keeper.active or self.keeper.queued or former.get("state") != "reclaimed" or not former.get("request"):
            return None
        body = same_shape_request(former)
        body["meta"] = {"resume_of": former.get("id")}
        return await self.keeper.request(body)

    # ------------------------------------------------------------------ feed helpers
    def _kname(self, rec: KernelRecord | None) -> str:
        if rec is None:
            return "?"
        return f"{rec.id[:8]}" + (f" ({rec.name})" if rec.name else "")

    def _warn(self, kind: str, message: str, **extra: Any) -> None:
        log.info("GPU warning (%s): %s", kind, message)
        self.feed.publish("warning", {"kind": kind, "message": message, **{k: v for k, v in extra.items() if v is not None}})

    def _notice(self, kind: str, message: str, **extra: Any) -> None:
        self.notices = [n for n in self.notices if n["kind"] != kind] + [{"kind": kind, "message": message, "time": self.clock(), **extra}]
        self.feed.publish("notice", {"kind": kind, "message": message, **extra})

    def _reclaim_event(self, rec: KernelRecord, action: str, outcome: str, message: str, **extra: Any) -> None:
        log.info("GPU reclaim: kernel %s %s %s: %s", rec.id, action, outcome, message)
        self.feed.publish("reclaim", {"kernel_id": rec.id, "action": action, "outcome": outcome, "message": message,
                                      **{k: v for k, v in extra.items() if v is not None}})

    def _resume_event(self, rec: KernelRecord, stage: str, message: str, *, quiet: bool = False, **extra: Any) -> None:
        data = {"kernel_id": rec.id, "stage": stage, "message": message, **{k: v for k, v in extra.items() if v is not None}}
        before = self.resume
        self.resume = data if stage in ("waiting", "restoring") else None
        if quiet and before and before.get("position") == data.get("position") and before.get("stage") == stage:
            return  # nothing new to say: only the status changes
        self.feed.publish("resume", data)

    # ------------------------------------------------------------------ JSON
    def lease_json(self, lease: dict[str, Any] | None) -> dict[str, Any] | None:
        if not lease:
            return None
        now = self.clock()
        keys = ("id", "state", "tier", "request", "placement", "granted_at", "expires_at", "ended_at", "end_reason", "ended_by",
                "end_message", "preempt_at", "duration_s", "created_at", "queue")
        out = {k: lease.get(k) for k in keys if k in lease}
        if lease.get("expires_at") and lease.get("state") == "active":
            out["time_left_s"] = max(0.0, float(lease["expires_at"]) - now)
        out["devices"] = lease_devices(lease)
        return out

    def sample_json(self, snap: Snapshot) -> dict[str, Any]:
        att = snap.attribution
        return {
            "t": snap.time,
            "devices": [_device_figures(s) for s in snap.devices.values()],
            "kernels": [{"id": k.id, "state": k.state, "execution_state": k.execution_state,
                         "memory_mib": k.gpu.memory_mib if k.gpu else None, "sm_util_pct": k.gpu.sm_util_pct if k.gpu else None,
                         "idle_s": self._idle_s(k)} for k in self.kernels.values()],
            "attribution": att.mode if att else "process",
            "error": snap.error,
        }

    def _idle_s(self, rec: KernelRecord) -> float | None:
        k = self.tracker.kernels.get(rec.id)
        if k is None or k.idle_since is None:
            return None
        return round(self.clock() - k.idle_since, 1)

    def status(self, *, history: bool = True, history_s: float | None = None) -> dict[str, Any]:
        now = self.clock()
        snap = self.monitor.last
        timeout = self.timeout()
        lease = self.keeper.lease
        message = ""
        if not self.keeper.client:
            message = "No lease broker is configured for this server (GPULEASE_BROKER_URL): GPU leases cannot be requested here."
        elif lease is None:
            message = "This server holds no GPU lease: kernels run without a GPU."
        elif not self.monitor.available:
            message = f"No GPU telemetry on this server: {self.monitor.unavailable}"
        elif snap is not None and snap.error:
            message = snap.error
        devices = []
        if snap is not None:
            for uuid, s in snap.devices.items():
                d = _device_figures(s)
                d["processes"] = [{"pid": p.pid, "kernel_id": (snap.attribution.owner.get(p.pid) if snap.attribution else None),
                                   "used_memory_mib": p.used_memory_mib, "sm_util_pct": p.sm_util_pct, "kind": p.kind} for p in s.processes]
                if history:
                    d["history"] = self.monitor.device_history(uuid, history_s)
                devices.append(d)
        kernels = []
        for rec in self.kernels.values():
            k = self.tracker.kernels.get(rec.id)
            deadline = self.tracker.kernel_deadline(rec.id, timeout) if self.keeper.active else None
            env = self._env_of(rec)
            item = {
                "id": rec.id, "name": rec.name, "execution_state": rec.execution_state, "connections": rec.connections,
                "last_activity": rec.last_activity, "pid": rec.pid, "state": rec.state, "message": rec.message,
                "gpu": rec.gpu.to_dict() if rec.gpu else None,
                "idle": {"gpu_idle": bool(k and k.idle_since is not None), "idle_since": k.idle_since if k else None,
                         "idle_s": self._idle_s(rec), "reclaim_at": deadline, "warned": bool(k and k.warned_for)},
                "cuda_visible_devices": env,
                "env_stale": self._stale(rec, os.environ.get("CUDA_VISIBLE_DEVICES", "")),
                "resume": {kk: v for kk, v in self.resume.items() if kk != "kernel_id"} if self.resume and self.resume.get("kernel_id") == rec.id else None,
                "suspended": {kk: rec.suspended[kk] for kk in ("devices", "memory_mib", "at", "suspend_s")} if rec.suspended else None,
                "busy_s": round(rec.busy_s, 1), "idle_total_s": round(rec.idle_s, 1), "memory_peak_mib": rec.memory_peak_mib,
            }
            if history:
                item["history"] = self.monitor.kernel_history_of(rec.id, history_s)
            kernels.append(item)
        return {
            "version": STATUS_VERSION,
            "now": now,
            "user": self.user,
            "message": message,
            "lease": self.lease_json(lease),
            "last_lease": self.lease_json(self.keeper.ended),
            "lease_origin": self.keeper.origin or None,
            "queue": (lease or {}).get("queue") if (lease or {}).get("state") == "queued" else None,
            "kernel_env": {"cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES", ""), "lease_id": os.environ.get("GPULEASE_LEASE_ID", "")},
            "telemetry": {
                "backend": getattr(self.monitor.backend, "name", None),
                "available": self.monitor.available,
                "message": self.monitor.unavailable,
                "sample_interval_s": self.settings.sample_interval,
                "history_s": self.settings.history_s,
                "attribution": snap.attribution.mode if snap and snap.attribution else "process",
                "attribution_message": snap.attribution.message if snap and snap.attribution else "",
                "samples": self.monitor.samples,
            },
            "devices": devices,
            "kernels": kernels,
            "reclaim": {
                "enabled": timeout is not None,
                "action": self.settings.action,
                "fallback_action": self.settings.fallback_action,
                "suspend_available": not self.suspend_unavailable(),
                "suspend_unavailable_reason": self.suspend_unavailable(),
                "suspend_note": getattr(self.checkpoint, "note", ""),  # "simulated: ..." on simulated GPUs
                "threshold_pct": self.settings.threshold_pct,
                "reclaim_busy": self.settings.reclaim_busy,
                "timeout_s": timeout,
                "timeout_rule": self.settings.idle_rule.describe(),
                "warn_before_s": self.settings.warn_before_s,
                "keep_until": self.tracker.keep_until if self.tracker.keep_until and self.tracker.keep_until > now else None,
                "max_keep_s": self.settings.max_keep_s,
                "lease_reclaim_at": self._lease_reclaim_at(),
                "on_reclaim": self.settings.on_reclaim,
                "resume_on_execute": self.settings.resume_on_execute,
            },
            "resume": self.resume,
            # the broker's unleased-use warnings from one place (heartbeat answers, or the poll without a lease)
            "warnings": [w for w in self._standing_warnings(now) + list(self.keeper.warnings) if w.get("kind") != UNLEASED_WARNING]
            + list(self._unleased.values()),
            "notices": list(self.notices),
            "heartbeat": dict(self.keeper.heartbeat),
            "gpu_last_activity": self.last_gpu_activity,
            "feed_last_id": self.feed.last_id,
        }

    def _standing_warnings(self, now: float) -> list[dict[str, Any]]:
        """The warnings of the feed that still hold: their deadline is ahead and nothing since made them moot."""
        out = []
        for e in self.feed.recent(("warning",), 50):
            w = e.to_dict()
            deadline = w.get("deadline")
            if deadline is None or deadline <= now:
                continue
            kid = w.get("kernel_id")
            if w["kind"] == "reclaim" and (self.tracker.kernels.get(kid) is None or self.tracker.kernels[kid].warned_for != deadline):
                continue  # the kernel computed again (or was kept): no reclaim at that time
            if w["kind"] == "lease_reclaim" and self.tracker.lease_warned_for != deadline:
                continue
            if w["kind"] == "share_memory" and (kid not in self.kernels or self.kernels[kid].share_warned_at is None):
                continue
            if w["kind"] in ("preemption", "expiring", "lease_reclaim", "reclaim", "share_memory") and self.keeper.active is None:
                continue
            out.append(w)
        return out

    def usage(self) -> dict[str, Any]:
        """The heartbeat's usage: per device and per kernel busy/idle seconds, memory peak, health (compact: the broker caps it)."""
        snap = self.monitor.last
        devices = {}
        for uuid, d in self.device_usage.items():
            s = snap.devices.get(uuid) if snap else None
            item = {"busy_s": round(d["busy_s"], 1), "idle_s": round(d["idle_s"], 1), "mem_peak_mib": int(d["mem_peak_mib"])}
            if s is not None and not s.health.ok:
                item["health"] = s.health.message()[:200]
            devices[uuid] = item
        kernels = {}
        for rec in sorted(self.kernels.values(), key=lambda r: -r.memory_peak_mib)[:20]:
            if rec.busy_s or rec.idle_s or rec.memory_peak_mib:
                kernels[rec.id[:8]] = {"busy_s": round(rec.busy_s, 1), "idle_s": round(rec.idle_s, 1), "mem_peak_mib": rec.memory_peak_mib,
                                       "state": rec.state}
        return {
            "t": round(self.clock(), 1),
            "gpu_busy": self.gpu_busy(),
            "last_gpu_activity": self.last_gpu_activity and round(self.last_gpu_activity, 1),
            "attribution": self._attribution_mode,
            # when idle reclaim gives the lease back if nothing computes (the broker tells waiters it may come sooner)
            "lease_reclaim_at": self._lease_reclaim_at(),
            "devices": devices,
            "kernels": kernels,
        }

    def _lease_reclaim_at(self) -> float | None:
        if not self.keeper.active or self.returning:
            return None
        timeout = self.timeout()
        at = self.tracker.lease_deadline(timeout)
        if at is None and timeout is not None:
            # kernels hold the GPU: when each is reclaimed (an action that frees it), the lease goes back right after
            action = self.settings.action
            if action == "suspend" and self.suspend_unavailable():
                action = self.settings.fallback_action
            holders = [kid for kid, k in self.tracker.kernels.items() if k.holds_gpu]
            deadlines = [self.tracker.kernel_deadline(kid, timeout) for kid in holders]
            if holders and action in ("suspend", "restart", "shutdown") and all(d is not None for d in deadlines):
                at = max(deadlines)
        return None if at is None else round(at, 1)


class _ResumeFailed(Exception):
    pass


def _device_figures(s) -> dict[str, Any]:
    return {
        "uuid": s.uuid,
        "parent_uuid": s.parent_uuid or None,
        "utilization_pct": s.utilization_pct,
        "memory_used_mib": s.memory_used_mib,
        "memory_total_mib": s.memory_total_mib,
        "temperature_c": s.temperature_c,
        "power_w": s.power_w,
        "power_limit_w": s.power_limit_w,
        "health": s.health.to_dict(),
    }


def _device_map(old: list[str], new: list[str]) -> dict[str, str] | None:
    """Old device → new device, keeping devices that stayed where they were."""
    if len(new) < len(old):
        return None
    stay = [d for d in old if d in new]
    free = [d for d in new if d not in stay]
    out = {d: d for d in stay}
    for d in old:
        if d not in out:
            out[d] = free.pop(0)
    return out


def _placement_words(lease: dict[str, Any]) -> str:
    slices = (lease.get("placement") or {}).get("slices") or []
    parts = []
    for s in slices:
        what = f"MIG {s['mig_profile']} of " if s.get("mig_uuid") else (f"a {float(s.get('share', 1)):g} share of " if float(s.get("share", 1)) < 1 else "")
        parts.append(f"{what}{s.get('model', 'GPU')} {s.get('mig_uuid') or s['gpu_uuid']}")
    return ", ".join(parts) or "no devices"


def _queue_words(lease: dict[str, Any]) -> str:
    q = lease.get("queue") or {}
    if q.get("position") is None:
        return "queued for a GPU"
    eta = q.get("eta")
    when = f", expected in about {fmt_duration(max(0.0, eta - time.time()))}" if eta else ""
    return f"queued for a GPU: number {q['position']} of {q.get('length', '?')}{when}"


def _clock_words(t: float) -> str:
    return datetime.datetime.fromtimestamp(t).strftime("%H:%M")


def _int_or_none(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None


async def _maybe_await(v: Any) -> Any:
    if inspect.isawaitable(v):
        return await v
    return v


def _read_cuda_env(pids: list[int]) -> dict[int, str | None]:
    """CUDA_VISIBLE_DEVICES of each process (None where it is not set or cannot be read). Blocking."""
    out: dict[int, str | None] = {}
    for pid in pids:
        try:
            out[pid] = psutil.Process(pid).environ().get("CUDA_VISIBLE_DEVICES")
        except (psutil.Error, OSError):
            out[pid] = None
    return out


def _process_tree(pid: int) -> list[int]:
    try:
        p = psutil.Process(pid)
        return [pid] + [c.pid for c in p.children(recursive=True)]
    except psutil.Error:
        return [pid]
