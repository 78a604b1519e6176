"""Resume: a suspended kernel gets a GPU back and its GPU memory restored.

:class:`Resumer` starts a resume when a suspended kernel starts a cell (or when asked), asks
the broker for a lease of the same shape if the server holds none (its former GPU preferred,
or required when cuda-checkpoint cannot restore onto another GPU), reports queue position and
ETA meanwhile, then restores the kernel's processes; a resume that cannot work restarts the
kernel and says why.

A server whose lease went back unused (reclaimed while no kernel held GPU memory) *parks* the
kernels that saw its GPUs (:meth:`Resumer.park`): they are suspended with nothing to restore, so a cell that
finds the lease gone waits for a GPU of the same shape, as a suspended kernel's cell does,
instead of running without one; the kernel then takes the new lease's environment itself
(``kernel/resume.py``). A parked kernel that cannot get a GPU runs on without one (no restart:
there is nothing to lose).
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable
from typing import Any

from traitlets import Bool, Float
from traitlets.config import LoggingConfigurable

from ..client import BrokerError
from ..core.lease import lease_devices
from ..core.text import format_duration as fmt_duration
from ..tasks import BackgroundTasks
from .announce import Announcer
from .checkpoint import CheckpointError, CudaCheckpoint
from .kernels import OK, RESUMING, SUSPENDED, KernelRecord, KernelTable
from .lease import LeaseKeeper, lease_gpus, same_shape_request
from .views import queue_words


class ResumeFailed(Exception):
    pass


class Resumer(LoggingConfigurable):
    resume_on_execute = Bool(
        True, help="""When a suspended kernel starts a cell, get it a lease of the same shape (its former GPU first) and
        restore it; the cell waits meanwhile, with queue position and ETA in the feed.""",
    ).tag(config=True)
    resume_max_wait = Float(0.0, min=0.0, help="""Longest a resuming kernel waits in the queue, seconds; 0: as long as it takes.""").tag(config=True)

    def __init__(self, *, kernels: KernelTable, keeper: LeaseKeeper, announce: Announcer, tasks: BackgroundTasks,
                 checkpoint: CudaCheckpoint | None, sample_interval: float, clock: Callable[[], float],
                 stopping: Callable[[], bool] = lambda: False, **kwargs: Any):
        super().__init__(**kwargs)
        self.kernels = kernels
        self.keeper = keeper
        self.announce = announce
        self.tasks = tasks
        self.checkpoint = checkpoint
        self.sample_interval = sample_interval
        self.clock = clock
        self.stopping = stopping
        self._given_up = ""  # the reclaimed lease whose kernels are no longer parked (a GPU could not be had)

    def park(self, now: float) -> None:
        """At each sample: while the server's last lease went back unused and no other is held or
        asked for, its kernels that saw GPUs and hold no GPU memory wait for a GPU at their next cell (see the module)."""
        former = self.keeper.ended or {}
        if (not self.resume_on_execute or self.keeper.lease is not None or former.get("state") != "reclaimed"
                or not former.get("request") or former.get("id") == self._given_up):
            return
        for rec in self.kernels:
            # those that saw the lease's GPUs: a kernel started since runs without a GPU, as it was told
            if rec.state == OK and not rec.working and not rec.holds_gpu and rec.pid and self.kernels.env_of(rec):
                rec.state = SUSPENDED  # (its message, what reclaim did to it, stays: the notebook says it)
                rec.suspended = {"pids": [], "devices": [], "gpus": lease_gpus(former), "memory_mib": None, "at": now, "lease": former,
                                 "suspend_s": 0.0, "parked": True}
                self.kernels.mark_suspended(rec, True)

    def check(self, now: float) -> None:
        """At each sample: resume the suspended kernels that started a cell."""
        if not self.resume_on_execute:
            return
        # busy for a moment only (a frontend asking for kernel_info) is not a cell that needs the GPU
        settle = max(2 * self.sample_interval, 1.0)
        for rec in self.kernels:
            if rec.state == SUSPENDED and rec.executing and now - (rec.busy_since or now) >= settle and not rec.working:
                rec.task = self.tasks.start(self.resume_kernel(rec, why="it started a cell"))

    async def resume_now(self, kernel_id: str | None = None) -> list[str]:
        """Resume the suspended kernels (or one): their ids, those already resuming included."""
        recs = [k for k in self.kernels if k.state in (SUSPENDED, RESUMING) and (kernel_id is None or k.id == kernel_id)]
        for rec in recs:
            if rec.state == SUSPENDED and not rec.working:
                rec.task = self.tasks.start(self.resume_kernel(rec, why="was asked to resume"))
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

    async def resume_kernel(self, rec: KernelRecord, why: str = "asked") -> bool:
        """Get a GPU for a suspended kernel (a new lease if needed) and restore it. True when restored."""
        if rec.state != SUSPENDED or not rec.suspended:
            return False
        rec.state = RESUMING
        sus = rec.suspended
        parked = bool(sus.get("parked"))
        t0 = self.clock()
        self.announce.resume_event(rec, "waiting", f"Kernel {rec.label} {why}: getting a GPU back for it.")
        # a parked kernel has nothing to restore: any GPU of the same shape does
        device_map_ok = parked or (await self.checkpoint.supports_device_map() if self.checkpoint else False)
        lease = self.keeper.active
        try:
            if lease is None:
                lease = await self._lease_for(rec, sus, device_map_ok)
            if lease is None:
                raise ResumeFailed("no GPU was granted")
            waited = self.clock() - t0
            mapping, restore_s = ({}, 0.0) if parked else await self._restore(rec, sus, lease, device_map_ok, waited)
        except (CheckpointError, ResumeFailed, BrokerError) as e:
            return await self._failed(rec, str(getattr(e, "message", e)))
        rec.state, rec.suspended = OK, None
        rec.message = ""
        self.announce.resume = None
        self.kernels.mark_suspended(rec, False)
        took = fmt_duration(self.clock() - t0)
        if parked:  # the kernel takes the lease's environment at its cell (and says so): what it sees is its word
            self.announce.resume_event(rec, "done", f"Kernel {rec.label} has a GPU again after {took} "
                                       f"({', '.join(lease_devices(lease))}); the cell goes on.", waited_s=round(waited, 1))
            return True
        # restored in place: the process uses the new lease's devices, whatever its environment said at start
        rec.env_devices = ",".join(mapping.get(d, d) for d in (rec.env_devices or ",".join(sus["devices"])).split(",") if d)
        note = getattr(self.checkpoint, "note", "")
        self.announce.resume_event(rec, "done", f"Kernel {rec.label} has its GPU back after {took} "
                                   f"(waiting {fmt_duration(waited)}, restore {restore_s:.1f} s"
                                   f"{'; ' + note if note else ''}); the cell goes on.",
                                   waited_s=round(waited, 1), restore_s=round(restore_s, 3))
        return True

    async def _restore(self, rec: KernelRecord, sus: dict[str, Any], lease: dict[str, Any], device_map_ok: bool,
                       waited: float) -> tuple[dict[str, str], float]:
        """Restore a suspended kernel's GPU memory onto ``lease``'s devices: (the device map, seconds it took)."""
        mapping = device_map(sus["devices"], lease_devices(lease))
        if mapping is None:
            raise ResumeFailed("the new lease has fewer devices than the kernel used")
        moved = {o: n for o, n in mapping.items() if o != n}
        if moved and not device_map_ok:
            raise ResumeFailed("the GPU granted is another one and this cuda-checkpoint cannot restore onto another GPU")
        self.announce.resume_event(rec, "restoring", f"Restoring kernel {rec.label} onto {', '.join(lease_devices(lease))}…",
                                   waited_s=round(waited, 1))
        t1 = time.monotonic()
        await self.checkpoint.restore(sus["pids"], mapping if moved else None)
        return mapping, time.monotonic() - t1

    async def _lease_for(self, rec: KernelRecord, sus: dict[str, Any], device_map_ok: bool) -> dict[str, Any] | None:
        """Ask for a lease like the one the kernel was suspended from, and wait for it (with the queue in the feed)."""
        former = sus.get("lease") or self.keeper.ended or {}
        if self.keeper.lease is None:
            if not former.get("request"):
                raise ResumeFailed("the shape of the former lease is unknown")
            body = same_shape_request(former)
            body["prefer_gpus" if device_map_ok else "require_gpus"] = list(dict.fromkeys(sus.get("gpus") or []))
            body["meta"] = {"resume_of": former.get("id"), "kernel": rec.id}
            if self.resume_max_wait:
                body["max_wait_s"] = self.resume_max_wait
            try:
                await self.keeper.request(body)
            except BrokerError as e:
                if not (e.status == 409 and e.field == "lease"):
                    raise  # (409 "lease": another kernel's resume asked first: wait for that one)
        while not self.stopping():
            got = await self.keeper.wait_active(timeout=2.0)
            if got is not None:
                return got
            q = self.keeper.queued
            if q is None:
                ended = self.keeper.ended or {}
                raise ResumeFailed(f"the lease request ended ({ended.get('state')}: {ended.get('end_reason') or 'no reason'})")
            info = q.get("queue") or {}
            self.announce.resume_event(rec, "waiting", f"Kernel {rec.label} waits for a GPU: {queue_words(q, self.clock())}",
                                       position=info.get("position"), eta=info.get("eta"),
                                       may_start_sooner_at=info.get("may_start_sooner_at"), lease_id=q.get("id"), quiet=True)
        return None

    async def _failed(self, rec: KernelRecord, why: str) -> bool:
        sus = rec.suspended or {}
        parked = bool(sus.get("parked"))
        rec.state, rec.suspended = OK, None
        self.announce.resume = None
        self.kernels.mark_suspended(rec, False)
        if parked:  # nothing was put aside: the kernel runs on without a GPU (and is not parked again for that lease)
            self.log.warning("No GPU for kernel %s whose lease went back unused: %s", rec.id, why)
            self._given_up = str((sus.get("lease") or {}).get("id") or "")
            rec.message = f"Kernel {rec.label} could not get a GPU again ({why}); the cell runs without one (%gpu request asks for one)."
            self.announce.resume_event(rec, "failed", rec.message)
            return False
        self.log.warning("Resuming kernel %s failed: %s; restarting it", rec.id, why)
        try:
            await _maybe_await(self.kernels.km.restart_kernel(rec.id))
            msg = (f"Kernel {rec.label} could not get its GPU state back ({why}); it was restarted and its variables are lost. "
                   "Run your notebook again.")
        except Exception as e:
            msg = f"Kernel {rec.label} could not get its GPU state back ({why}) and restarting it failed ({e}): restart it yourself."
        rec.message = msg
        self.announce.resume_event(rec, "failed", msg)
        return False


def device_map(old: list[str], new: list[str]) -> dict[str, str] | None:
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


async def _maybe_await(v: Any) -> Any:
    if inspect.isawaitable(v):
        return await v
    return v
