"""Reclaim actions: what happens to an idle kernel's GPU, to a share's overrun, and to the idle lease.

:class:`ReclaimActions` owns the :class:`~.reclaim.ReclaimTracker` (the pure decisions) and
carries them out: warnings in the feed, then the action per kernel (``suspend`` through
cuda-checkpoint, falling back where it cannot work, ``restart``, ``interrupt``, ``shutdown``,
``notify``), then the lease returned to the broker as *reclaimed*. It also watches each share's
memory cap (warn, then act the same way) and suspends the kernels that hold the GPU before a
preemption ends the lease (:meth:`suspend_or_leave`).
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable
from typing import Any

from traitlets import Bool, Enum, Float
from traitlets.config import LoggingConfigurable

from ..client import BrokerError
from ..core.lease import NoticeKind, WarningKind, lease_devices
from ..core.text import format_duration as fmt_duration
from ..tasks import BackgroundTasks
from .announce import Announcer
from .checkpoint import CheckpointError, CudaCheckpoint, unavailable_reason
from .idletimeout import GPUIdleRule
from .kernels import ACTING, OK, RECLAIMED, SUSPENDED, KernelRecord, KernelTable, kernel_label
from .lease import LeaseKeeper, lease_gpus
from .monitor import Snapshot
from .reclaim import Decision, ReclaimTracker
from .views import lease_json

ACTIONS = ("suspend", "restart", "interrupt", "shutdown", "notify")
FALLBACK_ACTIONS = ("restart", "interrupt", "shutdown", "notify")
FREES_GPU = ("suspend", "restart", "shutdown")
ACTION_WORDS = {
    "suspend": "its GPU memory will be moved to host memory (nothing is lost; the next cell waits for a GPU)",
    "restart": "it will be restarted (its variables are lost)",
    "interrupt": "it will be interrupted",
    "shutdown": "it will be shut down (its variables are lost)",
    "notify": "you will be asked to free the GPU",
}


class ReclaimActions(LoggingConfigurable):
    """See the module. The idle rule (``idle``) gives the timeout; the rest is configured here."""

    reclaim_action = Enum(
        list(ACTIONS), "suspend",
        help="""What happens to an idle kernel's GPU: ``suspend`` (NVIDIA cuda-checkpoint moves its GPU memory to host
        memory; nothing is lost and its next cell resumes it), ``restart``, ``interrupt``, ``shutdown``, or ``notify``
        (only tell the user). Where suspend cannot work, ``fallback_action`` is used and the user is told why.""",
    ).tag(config=True)
    fallback_action = Enum(
        list(FALLBACK_ACTIONS), "restart",
        help="""The action when ``suspend`` cannot be used (no cuda-checkpoint, not x86-64, a MIG slice) or fails.""",
    ).tag(config=True)
    warn_before = Float(300.0, min=0.0, help="""Seconds before a reclaim that the warning goes out in the feed, at most half the idle timeout (a 2-min timeout warns after 1 min idle, not at once). Example: 300.""").tag(config=True)
    on_reclaim = Enum(
        ["keep", "stop"], "keep",
        help="""After the idle lease went back: ``keep`` the server running without a GPU (new kernels get none until a
        lease comes back), or ``stop`` it.""",
    ).tag(config=True)
    max_keep = Float(
        4 * 3600.0, min=0.0, help="""Longest a user may postpone reclaim ("keep" the idle GPU), seconds past each idle deadline;
        0: users may not postpone. Example: 14400 (4 h).""",
    ).tag(config=True)
    unused_lease_timeout = Float(
        0.0, min=0.0, help="""Seconds a GPU lease may sit unused (no kernel holds memory on it, none computed) before it goes
        back to the pool; 0: the kernels' idle timeout (``GPUIdleRule``). Longer gives a person time to open a notebook and
        write the first cell after the server started. Example: 600.""",
    ).tag(config=True)
    share_grace = Float(
        60.0, min=0.0, help="""Seconds a process may stay over its share's memory after the warning before it is acted on.""",
    ).tag(config=True)
    reclaim_busy = Bool(
        False, help="""Count a kernel that is executing a cell without using the GPU as idle (like jupyter_server's
        ``cull_busy``). Default False: a running cell protects its kernel's GPU.""",
    ).tag(config=True)

    def __init__(self, *, idle: GPUIdleRule, kernels: KernelTable, keeper: LeaseKeeper, announce: Announcer, tasks: BackgroundTasks,
                 set_kernel_env: Callable[[dict[str, Any] | None], None], checkpoint: CudaCheckpoint | None = None,
                 checkpoint_missing: str = "", stop_server: Callable[[], None] | None = None,
                 resume_on_execute: bool = True, clock: Callable[[], float] = time.time, **kwargs: Any):
        super().__init__(**kwargs)
        self.idle = idle
        self.kernels = kernels
        self.keeper = keeper
        self.announce = announce
        self.tasks = tasks
        self.set_kernel_env = set_kernel_env
        self.checkpoint = checkpoint
        self.checkpoint_missing = checkpoint_missing
        self.stop_server = stop_server
        self.clock = clock
        self.resume_on_execute = resume_on_execute  # what the suspended kernel's message says of its resume
        self.returning = False  # the lease is being returned (new kernels already get no GPU)
        self.tracker = ReclaimTracker(threshold_pct=idle.threshold_pct, reclaim_busy=self.reclaim_busy,
                                      warn_before_s=self.warn_before, max_keep_s=self.max_keep)

    # ------------------------------------------------------------------ what will happen
    def suspend_unavailable(self, rec: KernelRecord | None = None) -> str:
        """Why a kernel cannot be suspended here ("" when it can)."""
        if self.checkpoint is None:
            return self.checkpoint_missing or "cuda-checkpoint is not available"
        lease = self.keeper.active or {}
        mig = any(s.get("mig_uuid") for s in (lease.get("placement") or {}).get("slices", []))
        return unavailable_reason(self.checkpoint.path, self.checkpoint.path, mig=mig)

    def effective_action(self, rec: KernelRecord | None = None) -> str:
        """The action that really happens to an idle kernel: suspend falls back where it cannot work."""
        if self.reclaim_action == "suspend" and self.suspend_unavailable(rec):
            return self.fallback_action
        return self.reclaim_action

    def timeout(self) -> float | None:
        return self.idle.timeout(self.effective_action())

    def lease_timeout(self) -> float | None:
        """How long the lease may sit unused (None: idle reclaim is off)."""
        timeout = self.timeout()
        return None if timeout is None else (self.unused_lease_timeout or timeout)

    def action_words(self, rec: KernelRecord | None = None) -> str:
        return ACTION_WORDS[self.effective_action(rec)]

    def lease_reclaim_at(self) -> float | None:
        """When idle reclaim gives the lease back if nothing computes (None: not planned)."""
        if not self.keeper.active or self.returning:
            return None
        timeout = self.timeout()
        at = self.tracker.lease_deadline(self.lease_timeout())
        if at is None and timeout is not None:
            # kernels hold the GPU: when each is reclaimed (an action that frees it), the lease goes back right after
            holders = [kid for kid, k in self.tracker.kernels.items() if k.holds_gpu]
            deadlines = [self.tracker.kernel_deadline(kid, timeout) for kid in holders]
            if holders and self.effective_action() in FREES_GPU and all(d is not None for d in deadlines):
                at = max(deadlines)
        return None if at is None else round(at, 1)

    def keep(self, for_s: float) -> float | None:
        """Postpone idle reclaim by ``for_s``; the time it is postponed until. 0 ends the keep in
        force (None): each kernel's idle deadline is its own again."""
        if for_s <= 0:
            self.tracker.end_keep()
            return None
        if for_s > self.max_keep:
            raise BrokerError(400, f"a keep of {fmt_duration(for_s)} is longer than this server allows: "
                              f"it keeps an idle GPU for at most {fmt_duration(self.max_keep)}", "for_s")
        return self.tracker.keep(self.clock(), for_s)

    # ------------------------------------------------------------------ at each sample
    def plan(self, now: float, sample_interval: float) -> None:
        """Warn and act on what is due now."""
        timeout = self.timeout()
        # samples drift by milliseconds: a deadline that falls on a sample is due at that sample, not the next
        for d in self.tracker.plan(now + 0.05 * sample_interval, timeout, lease_active=True, lease_timeout_s=self.lease_timeout()):
            self.decide(d, now)

    def decide(self, d: Decision, now: float) -> None:
        action = self.reclaim_action
        if d.kind == "warn":
            rec = self.kernels.get(d.kernel_id)
            self.announce.warn(WarningKind.RECLAIM, f"Kernel {kernel_label(rec)} has not used its GPU for {fmt_duration(d.idle_s)}: "
                               f"{self.action_words(rec)} in {fmt_duration(d.deadline - now)} unless it computes again (or you keep the GPU).",
                               deadline=d.deadline, kernel_id=d.kernel_id, action=action, reclaim_action=self.effective_action(rec))
        elif d.kind == "act":
            rec = self.kernels.get(d.kernel_id)
            if rec is not None and rec.state == OK:
                rec.state = ACTING
                rec.task = self.tasks.start(self.act(rec, action, f"its GPU sat idle for {fmt_duration(d.idle_s)}"))
        elif d.kind == "warn_lease":
            after = "the server then stops" if self.on_reclaim == "stop" else "the server keeps running without a GPU"
            self.announce.warn(WarningKind.LEASE_RECLAIM, f"No kernel has used the GPU for {fmt_duration(d.idle_s)}: the GPU lease goes back "
                               f"to the pool in {fmt_duration(d.deadline - now)} ({after}).", deadline=d.deadline)
        elif d.kind == "return_lease" and not any(k.working for k in self.kernels):
            self.returning = True
            self.tasks.start(self.return_lease(f"idle: no kernel used the GPU for {fmt_duration(d.idle_s)}"))

    def check_shares(self, snap: Snapshot, now: float) -> None:
        """A process over its share's memory: warned, then acted on after ``share_grace``."""
        slices = ((self.keeper.active or {}).get("placement") or {}).get("slices") or []
        caps = {(s.get("mig_uuid") or s["gpu_uuid"]): int(s["memory_mib"]) for s in slices if float(s.get("share", 1.0)) < 1.0}
        if not caps or snap.attribution is None or snap.attribution.mode != "process":
            return
        procs = [p for s in snap.devices.values() for p in s.processes]
        for rec in self.kernels:
            over = [(p.pid, p.device_uuid, p.used_memory_mib) for p in procs
                    if snap.attribution.owner.get(p.pid) == rec.id and p.device_uuid in caps and (p.used_memory_mib or 0) > caps[p.device_uuid]]
            if not over:
                rec.share_warned_at = None
                continue
            pid, dev, mib = over[0]
            if rec.share_warned_at is None:
                rec.share_warned_at = now
                self.announce.warn(WarningKind.SHARE_MEMORY, f"Kernel {rec.label} (process {pid}) uses {mib} MiB of GPU memory, over this server's "
                                   f"share of {caps[dev]} MiB: free some within {fmt_duration(self.share_grace)} or "
                                   f"{self.action_words(rec).split(' (')[0]}.",
                                   deadline=now + self.share_grace, kernel_id=rec.id, action=self.reclaim_action)
            elif now - rec.share_warned_at >= self.share_grace and rec.state == OK:
                rec.state = ACTING
                rec.task = self.tasks.start(self.act(rec, self.reclaim_action, f"it used {mib} MiB, over the share's {caps[dev]} MiB", idle=False))

    # ------------------------------------------------------------------ the actions
    async def act(self, rec: KernelRecord, action: str, why: str, *, idle: bool = True) -> None:
        """Free a kernel's GPU by ``action``; suspend falls back (and says why) where it cannot work.

        ``idle``: the kernel was reclaimed for idleness, so when no other kernel holds GPU memory
        the lease goes back right after (not so for a share's memory overrun: the GPU is in use)."""
        try:
            if action == "suspend":
                reason = self.suspend_unavailable(rec)
                if reason:
                    fb = self.fallback_action
                    self.announce.reclaim_event(rec, "suspend", "fallback", f"Kernel {rec.label} cannot be suspended ({reason}); "
                                                f"doing '{fb}' instead.")
                    action = fb
                elif await self.suspend(rec, why):
                    if idle and self.keeper.active and not self.kernels.others_hold_gpu(rec):
                        # its memory is in host memory now and nobody else holds any: the lease goes back
                        # at once, not at the next sample
                        await self.return_lease(f"idle: {why}")
                    return
                else:
                    action = self.fallback_action
            await self.plain_action(rec, action, why, idle=idle)
        finally:
            if rec.state == ACTING:
                rec.state = RECLAIMED

    async def plain_action(self, rec: KernelRecord, action: str, why: str, *, idle: bool = True) -> None:
        name = rec.label
        if idle and action in ("restart", "shutdown") and self.keeper.active and not self.kernels.others_hold_gpu(rec):
            # the lease goes back right after: the restarted kernel comes up without the GPU
            self.returning = True
            self.set_kernel_env(None)
        km = self.kernels.km
        try:
            if action == "restart":
                await _maybe_await(km.restart_kernel(rec.id))
                msg = f"Kernel {name} was restarted to free its GPU: {why}. Its variables are gone; run your notebook again."
            elif action == "shutdown":
                await _maybe_await(km.shutdown_kernel(rec.id))
                msg = f"Kernel {name} was shut down to free its GPU: {why}."
            elif action == "interrupt":
                await _maybe_await(km.interrupt_kernel(rec.id))
                msg = f"Kernel {name} was interrupted: {why}. Free its GPU memory (or restart it) to give the GPU back."
            else:
                msg = f"Kernel {name} holds GPU memory while idle ({why}). Free it (del the tensors, restart the kernel) to give the GPU back."
        except Exception as e:  # report, do not crash the monitor
            self.log.warning("Reclaim action %s on kernel %s failed: %s", action, rec.id, e)
            self.announce.reclaim_event(rec, action, "failed", f"Could not {action} kernel {name}: {e}")
            if self.returning and not self.keeper.active:
                return
            self.returning = False
            self.set_kernel_env(self.keeper.active)
            return
        rec.message = msg
        self.announce.reclaim_event(rec, action, "done", msg)
        if action in ("restart", "shutdown") and self.returning:
            await self.return_lease(f"idle: {why}")

    async def suspend(self, rec: KernelRecord, why: str) -> bool:
        """Suspend a kernel's GPU processes; False (and the user told) when it failed."""
        pids = list(rec.gpu.pids) if rec.gpu and rec.gpu.pids else await self.kernels.process_tree(rec)
        devices = list(rec.gpu.devices) if rec.gpu and rec.gpu.devices else lease_devices(self.keeper.active)
        memory = rec.gpu.memory_mib if rec.gpu else None
        lease = self.keeper.active or self.keeper.ended or {}
        t0 = time.monotonic()
        try:
            await self.checkpoint.suspend(pids)
        except CheckpointError as e:
            self.announce.reclaim_event(rec, "suspend", "failed", f"Suspending kernel {rec.label} failed ({e}); "
                                        f"doing '{self.fallback_action}' instead.")
            return False
        rec.state = SUSPENDED
        self.kernels.mark_suspended(rec, True)
        rec.suspended = {"pids": pids, "devices": devices, "gpus": lease_gpus(lease) or devices, "memory_mib": memory,
                         "at": self.clock(), "lease": lease, "suspend_s": round(time.monotonic() - t0, 3)}
        note = getattr(self.checkpoint, "note", "")
        msg = (f"Kernel {rec.label} was suspended ({why}): its GPU memory"
               f"{f' ({memory} MiB)' if memory else ''} is kept in host memory and nothing is lost"
               f"{f' ({note})' if note else ''}. "
               + ("Its next cell waits for a GPU, then goes on." if self.resume_on_execute
                  else "Resume it (%gpu resume, or the GPU panel) to get a GPU back."))
        rec.message = msg
        self.announce.reclaim_event(rec, "suspend", "done", msg, memory_mib=memory, seconds=rec.suspended["suspend_s"])
        return True

    async def suspend_or_leave(self, rec: KernelRecord, why: str) -> None:
        """Suspend a kernel if it can be; else leave it as it was (a preemption's last resort)."""
        try:
            if not await self.suspend(rec, why):
                rec.state = OK
        finally:
            if rec.state == ACTING:
                rec.state = OK

    async def return_lease(self, reason: str) -> None:
        """Give the idle lease back as reclaimed (and stop the server if so configured)."""
        lease = self.keeper.active
        if lease is None:
            self.returning = False
            return
        self.returning = True
        self.set_kernel_env(None)
        stop = self.on_reclaim == "stop"
        try:
            await self.keeper.release(state="reclaimed", reason=reason, keep_server=not stop)
        except BrokerError as e:
            self.log.warning("Could not return GPU lease %s as reclaimed: %s", lease["id"], e.message)
            self.returning = False
            self.set_kernel_env(self.keeper.active)
            self.announce.notice(NoticeKind.BROKER, f"The idle GPU lease could not be returned yet ({e.message}); retrying.")
            return
        self.returning = False
        self.announce.publish("lease", {"event": "reclaimed", "lease": lease_json(self.keeper.ended, self.clock()),
                                        "message": f"The GPU lease went back to the pool ({reason}). "
                                        + ("The server stops now." if stop else "This server keeps running without a GPU; "
                                           "the next cell you run asks for one again.")})
        if stop and self.stop_server is not None:
            self.stop_server()

    def holders(self) -> list[KernelRecord]:
        return [k for k in self.kernels if k.holds_gpu]


async def _maybe_await(v: Any) -> Any:
    if inspect.isawaitable(v):
        return await v
    return v
