"""The extension's loop: sample, attribute, decide, act, resume, report — wiring the parts.

:class:`GPUController` is a child of the extension; it creates the parts (each a child of it,
each declaring its own settings) and runs them on the server's event loop:

* every ``sample_interval`` the :class:`~.kernels.KernelTable` reads the kernels, the
  :class:`~.monitor.Monitor` samples the leased devices and attributes GPU processes to
  kernels (in its worker thread), :class:`~.usage.GPUUsage` counts, the idle rule
  (:class:`~.idletimeout.GPUIdleRule`) learns, :class:`~.actions.ReclaimActions` warns and acts,
  :class:`~.preemption.BrokerWarnings` suspends before a preemption, :class:`~.resumer.Resumer`
  resumes a suspended kernel that started a cell;
* lease changes from the :class:`~.lease.LeaseKeeper` reach the monitor, the usage and
  :class:`~.kernelenv.KernelEnvironment` (what kernels started from now on get);
* the REST handlers call its user actions and read :meth:`status` (built by :mod:`.views`).
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Callable
from typing import Any

from traitlets.config import LoggingConfigurable

from ..client import BrokerError
from ..core.lease import NoticeKind, WarningKind, lease_devices
from ..core.text import format_duration
from ..tasks import BackgroundTasks
from . import views
from .actions import ReclaimActions
from .announce import Announcer
from .checkpoint import CudaCheckpoint
from .feed import Feed
from .idletimeout import GPUIdleRule
from .kernelenv import KernelEnvironment
from .kernels import KernelTable
from .lease import LeaseKeeper
from .monitor import Monitor, Snapshot
from .preemption import BrokerWarnings
from .resumer import Resumer
from .usage import GPUUsage

PARTS = (GPUIdleRule, ReclaimActions, Resumer, GPUUsage)  # the parts with settings of their own


class GPUController(LoggingConfigurable):
    """See the module. ``kernel_manager`` is the server's MappingKernelManager."""

    def __init__(self, *, kernel_manager: Any, monitor: Monitor, keeper: LeaseKeeper, feed: Feed, sample_interval: float = 1.0,
                 history_s: float = 600.0, session_manager: Any = None, checkpoint: CudaCheckpoint | None = None,
                 checkpoint_missing: str = "", web_settings: dict[str, Any] | None = None,
                 stop_server: Callable[[], None] | None = None, user: str = "", broker_url: str = "",
                 environ: Callable[[], dict[str, str]] | None = None, clock: Callable[[], float] = time.time, **kwargs: Any):
        super().__init__(**kwargs)
        self.monitor = monitor
        self.keeper = keeper
        self.feed = feed
        self.sample_interval = sample_interval
        self.history_s = history_s
        self.user = user
        self.clock = clock
        self.environ = environ or (lambda: dict(os.environ))
        self.tasks = BackgroundTasks(self.log)
        self.announce = Announcer(feed, clock)
        self.kernels = KernelTable(parent=self, kernel_manager=kernel_manager, session_manager=session_manager, monitor=monitor,
                                   tasks=self.tasks, clock=clock)
        self.idle = GPUIdleRule(parent=self)
        self.kernel_env = KernelEnvironment(parent=self, broker_url=broker_url, base=self.environ)
        self.resumer = Resumer(parent=self, kernels=self.kernels, keeper=keeper, announce=self.announce, tasks=self.tasks,
                               checkpoint=checkpoint, sample_interval=sample_interval, clock=clock, stopping=lambda: self._stopping)
        self.actions = ReclaimActions(parent=self, idle=self.idle, kernels=self.kernels, keeper=keeper, announce=self.announce,
                                      tasks=self.tasks, set_kernel_env=self.set_kernel_env, checkpoint=checkpoint,
                                      checkpoint_missing=checkpoint_missing, stop_server=stop_server,
                                      resume_on_execute=self.resumer.resume_on_execute, clock=clock)
        self.usage = GPUUsage(parent=self, kernels=self.kernels, threshold_pct=self.idle.threshold_pct,
                              sample_interval=sample_interval, clock=clock, web_settings=web_settings,
                              lease_reclaim_at=self.actions.lease_reclaim_at)
        self.warnings = BrokerWarnings(keeper=keeper, kernels=self.kernels, actions=self.actions, announce=self.announce,
                                       tasks=self.tasks, sample_interval=sample_interval, clock=clock, log=self.log)
        self._task: asyncio.Task | None = None
        self._stopping = False
        self._last_tick: float | None = None
        keeper.on_change = self._lease_changed
        keeper.on_warnings = self.warnings.on_warnings
        keeper.usage = self.usage.usage

    @property
    def tracker(self):
        return self.actions.tracker

    # ------------------------------------------------------------------ life
    async def start(self) -> None:
        env = self.environ()
        self.monitor.watch_all = env.get("GPULEASE_DEVICE_CHOICE") == "engine"
        await self.keeper.start()
        if self.keeper.lease_id and not self.monitor.devices:
            placement = env.get("GPULEASE_PLACEMENT")
            if placement:  # watch the spawner's placement until the broker answers
                try:
                    self.monitor.watch(lease_devices({"placement": json.loads(placement)}))
                except (ValueError, KeyError, TypeError):
                    self.log.warning("GPULEASE_PLACEMENT is not a placement JSON; waiting for the broker to say which GPUs are leased")
            self.tracker.lease_granted(self.clock())
        self._task = asyncio.ensure_future(self._loop())

    async def stop(self) -> None:
        """Stop sampling, release the lease the server took itself, close the backend; once (a
        second call, e.g. the server's clean-up after an earlier stop, does nothing)."""
        if self._stopping:
            return
        self._stopping = True
        if self._task is not None:
            self._task.cancel()
        for rec in self.kernels:
            self.kernels.mark_suspended(rec, False)
        await self.tasks.cancel()
        await self.keeper.stop(release=True)
        await self.monitor.close()

    async def _loop(self) -> None:
        while not self._stopping:
            t0 = time.monotonic()
            try:
                await self.tick()
            except asyncio.CancelledError:
                raise
            except Exception:  # one bad sample must not end the monitor
                self.log.exception("GPU monitor: a sample failed")
            await asyncio.sleep(max(0.0, self.sample_interval - (time.monotonic() - t0)))

    # ------------------------------------------------------------------ one sample
    async def tick(self) -> Snapshot:
        now = self.clock()
        dt = 0.0 if self._last_tick is None else max(0.0, min(now - self._last_tick, 10 * self.sample_interval))
        self._last_tick = now
        self.kernels.refresh()
        snap = await self.monitor.sample(self.kernels.process_list())
        await self.kernels.read_environments()
        await self.kernels.read_paths(now)
        self.monitor.record(snap)
        self._attribution_changed(snap)
        uses = self.kernels.uses(snap)
        active = self.keeper.active
        self.usage.account(snap, uses, dt, lease_active=bool(active))
        for gap in self.tracker.observe(now, uses):
            self.idle.learn(gap)
        self.usage.report(snap, uses, now)
        if active and not self.actions.returning:
            self.actions.plan(now, self.sample_interval)
            self.actions.check_shares(snap, now)
        self.warnings.check(now)
        if not self.actions.returning:
            self.resumer.park(now)
        self.resumer.check(now)
        if self.announce.notice_of(NoticeKind.ENV_STALE):
            self.env_notice()  # a stale kernel restarted or went away: say so
        self.warnings.poll(now)
        self.feed.publish("sample", views.sample_json(snap, list(self.kernels), self._idle_since(), now))
        return snap

    def _attribution_changed(self, snap: Snapshot) -> None:
        att = snap.attribution
        if att is None or att.mode == self.usage.attribution_mode:
            return
        self.usage.attribution_mode = att.mode
        if att.mode == "device":
            self.log.warning("GPU monitor: %s", att.message)
            self.announce.notice(NoticeKind.ATTRIBUTION, att.message)
        else:
            self.log.info("GPU monitor: per-kernel attribution works again")

    def _idle_since(self) -> dict[str, float | None]:
        return {kid: k.idle_since for kid, k in self.tracker.kernels.items()}

    def gpu_busy(self) -> bool:
        return self.usage.gpu_busy()

    def timeout(self) -> float | None:
        return self.actions.timeout()

    # ------------------------------------------------------------------ the lease and the kernels' environment
    async def _lease_changed(self, kind: str, lease: dict[str, Any] | None) -> None:
        now = self.clock()
        if kind == "granted":
            self.monitor.watch(lease_devices(lease))
            self.tracker.lease_granted(now)
            self.usage.lease_granted()
            self.set_kernel_env(lease)
            self.feed.publish("lease", {"event": "granted", "lease": views.lease_json(lease, now),
                                        "message": f"GPU lease {lease['id']} is active: {views.placement_words(lease)}."})
        elif kind == "queued":
            self.feed.publish("lease", {"event": "queued", "lease": views.lease_json(lease, now), "message": views.queue_words(lease, now)})
        elif kind == "updated":
            self.feed.publish("lease", {"event": "updated", "lease": views.lease_json(lease, now), "message": ""})
        elif kind == "ended":
            self.monitor.watch([])
            self.monitor.watch_all = False  # the engine's devices went with the lease
            self.warnings.lease_ended()
            if not self.actions.returning:
                self.set_kernel_env(None)
                state = (lease or {}).get("state")
                if state != "reclaimed":
                    self.feed.publish("lease", {"event": "ended", "lease": views.lease_json(lease, now),
                                                "message": f"The GPU lease ended ({state}): {(lease or {}).get('end_reason') or 'no reason given'}."})

    def set_kernel_env(self, lease: dict[str, Any] | None) -> None:
        """Kernels started from now on get ``lease``'s environment; running ones keep theirs (and are told)."""
        if self.kernel_env.set_lease(lease):
            self.env_notice()

    def env_notice(self) -> None:
        """The standing env_stale notice, said again when what is true changed: it names the
        kernels stale now, against the environment kernels get now (none stale: no notice)."""
        devices, stale = self.kernel_env.stale_kernels(self.kernels, self.kernels.env_of)
        current = self.announce.notice_of(NoticeKind.ENV_STALE)
        ids = [k.id for k in stale]
        if not stale:
            self.announce.clear_notice(NoticeKind.ENV_STALE, kernel_ids=[])
            return
        if current is not None and current.get("kernel_ids") == ids and current.get("devices") == devices:
            return
        names = ", ".join(k.label for k in stale)
        what = f"the GPU {devices}" if devices else "no GPU"
        self.announce.notice(NoticeKind.ENV_STALE, f"New kernels get {what}; running kernel(s) {names} keep the devices they started with "
                             "until restarted.", kernel_ids=ids, devices=devices)

    # ------------------------------------------------------------------ user actions
    async def request(self, body: dict[str, Any]) -> dict[str, Any]:
        return await self.keeper.request(body)

    async def extend(self, *, by_s: float | None, until: float | None) -> dict[str, Any]:
        return await self.keeper.extend(by_s=by_s, until=until)

    async def release(self, *, reason: str = "", force: bool = False) -> dict[str, Any]:
        holders = self.actions.holders()
        if holders and not force and self.keeper.active:
            names = ", ".join(f"{k.label} ({k.gpu.memory_mib} MiB)" for k in holders)
            raise BrokerError(409, f"kernel(s) {names} still hold GPU memory: shut them down or free it first, "
                              "or release with force (they keep running, but the GPU is no longer yours)", "force")
        self.actions.returning = True
        try:
            self.set_kernel_env(None)
            got = await self.keeper.release(state="released", reason=reason or "released from the server", keep_server=True)
        finally:
            self.actions.returning = False
        self.feed.publish("lease", {"event": "released", "lease": self.lease_json(got),
                                    "message": "The GPU lease was given back; this server keeps running without a GPU."})
        return got

    def keep(self, for_s: float) -> float | None:
        """Postpone idle reclaim by ``for_s`` seconds (0: end the keep in force); when it is postponed until."""
        until = self.actions.keep(for_s)
        if until is None:
            self.feed.publish("notice", {"kind": NoticeKind.KEEP, "message": "Idle reclaim is no longer postponed.", "until": None})
            return None
        self.feed.publish("notice", {"kind": NoticeKind.KEEP, "message": f"Idle reclaim postponed until {views.clock_words(until)} "
                                     f"(at most {format_duration(self.actions.max_keep)} past each kernel's idle deadline).",
                                     "until": until})
        return until

    @property
    def max_keep_s(self) -> float:
        return self.actions.max_keep

    def kernel_sees(self, kernel_id: str, devices: str) -> None:
        """A kernel says which devices it uses now (``CUDA_VISIBLE_DEVICES``; "" for none): it took
        a lease's environment itself (``%gpu request``) or dropped it (``%gpu release``), which its
        process environment at start no longer shows. KeyError for a kernel this server does not run."""
        self.kernels[kernel_id].env_devices = devices
        self.env_notice()

    async def resume_now(self, kernel_id: str | None = None) -> list[str]:
        return await self.resumer.resume_now(kernel_id)

    async def resume_lease(self) -> dict[str, Any] | None:
        return await self.resumer.resume_lease()

    # ------------------------------------------------------------------ JSON
    def lease_json(self, lease: dict[str, Any] | None) -> dict[str, Any] | None:
        return views.lease_json(lease, self.clock())

    def status(self, *, history: bool = True, history_s: float | None = None) -> dict[str, Any]:
        now = self.clock()
        snap = self.monitor.last
        timeout = self.timeout()
        lease = self.keeper.lease
        message = views.status_message(has_broker=bool(self.keeper.client), lease=lease, telemetry_ok=self.monitor.available,
                                       unavailable=self.monitor.unavailable, sample_error=snap.error if snap is not None else "")
        devices = [views.device_json(uuid, s, snap, self.monitor.device_history(uuid, history_s) if history else None)
                   for uuid, s in (snap.devices.items() if snap is not None else ())]
        devs = self.kernel_env.devices
        keep_until = self.tracker.keep_until if (self.tracker.keep_until or 0) > now else None
        kernels = [views.kernel_json(
            rec, now=now, idle=self.tracker.kernels.get(rec.id),
            reclaim_at=self.tracker.kernel_deadline(rec.id, timeout) if self.keeper.active else None, kept_until=keep_until,
            env=self.kernels.env_of(rec), sight=self.kernel_env.sight(rec, self.kernels.env_of(rec), devs), resume=self.announce.resume,
            history=self.monitor.kernel_history_of(rec.id, history_s) if history else None) for rec in self.kernels]
        standing = views.standing_warnings([e.to_dict() for e in self.feed.recent(("warning",), 50)], now=now, tracker=self.tracker,
                                           kernels=self.kernels.records, lease_active=self.keeper.active is not None,
                                           ends_early_at=(self.keeper.lease or {}).get("preempt_at"))
        return {
            "version": views.STATUS_VERSION,
            "now": now,
            "user": self.user,
            "message": message,
            "lease": self.lease_json(lease),
            "last_lease": self.lease_json(self.keeper.ended),
            "lease_origin": self.keeper.origin or None,
            "queue": (lease or {}).get("queue") if (lease or {}).get("state") == "queued" else None,
            "kernel_env": {"cuda_visible_devices": devs, "lease_id": self.kernel_env.get("GPULEASE_LEASE_ID")},
            "telemetry": views.telemetry_json(self.monitor, snap, sample_interval=self.sample_interval, history_s=self.history_s),
            "devices": devices,
            "kernels": kernels,
            "reclaim": self._reclaim_json(now, timeout),
            "resume": self.announce.resume,
            "actions": views.actions_json(lease, list(self.kernels), self.keeper.ended),
            # the broker's unleased-use warnings from one place (heartbeat answers, or the poll without a lease)
            "warnings": [w for w in standing + list(self.keeper.warnings) if w.get("kind") != WarningKind.UNLEASED_USE]
            + list(self.warnings.unleased.values()),
            "notices": list(self.announce.notices),
            "heartbeat": dict(self.keeper.heartbeat),
            "gpu_last_activity": self.usage.last_gpu_activity,
            "feed_last_id": self.feed.last_id,
        }

    def _reclaim_json(self, now: float, timeout: float | None) -> dict[str, Any]:
        a, unavailable = self.actions, self.actions.suspend_unavailable()
        keep_until = self.tracker.keep_until
        return {
            "enabled": timeout is not None,
            "action": a.reclaim_action,
            "fallback_action": a.fallback_action,
            "suspend_available": not unavailable,
            "suspend_unavailable_reason": unavailable,
            "suspend_note": getattr(a.checkpoint, "note", ""),  # "simulated: ..." on simulated GPUs
            "threshold_pct": self.idle.threshold_pct,
            "reclaim_busy": a.reclaim_busy,
            "timeout_s": timeout,
            "timeout_rule": self.idle.describe(a.effective_action()),
            "unused_lease_timeout_s": a.lease_timeout(),
            "warn_before_s": a.warn_before,
            "keep_until": keep_until if keep_until and keep_until > now else None,
            "max_keep_s": a.max_keep,
            "lease_reclaim_at": a.lease_reclaim_at(),
            "on_reclaim": a.on_reclaim,
            "resume_on_execute": self.resumer.resume_on_execute,
        }
