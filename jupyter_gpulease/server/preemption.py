"""The broker's warnings (expiry, preemption, unleased GPU use) and the suspend before a preemption.

:class:`BrokerWarnings` turns the warnings of the heartbeats' answers into the feed's (each
once), polls the unleased-use warnings while no heartbeat carries them (no active lease), and
suspends the kernels that hold the GPU shortly before a preemption ends the lease, so their
work survives.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..client import BrokerError
from ..core.lease import NoticeKind, WarningKind
from ..core.text import format_duration as fmt_duration
from ..tasks import BackgroundTasks
from .actions import ReclaimActions
from .announce import Announcer
from .kernels import ACTING, OK, KernelTable
from .lease import LeaseKeeper


class BrokerWarnings:
    def __init__(self, *, keeper: LeaseKeeper, kernels: KernelTable, actions: ReclaimActions, announce: Announcer,
                 tasks: BackgroundTasks, sample_interval: float, clock: Callable[[], float], log: Any):
        self.keeper = keeper
        self.kernels = kernels
        self.actions = actions
        self.announce = announce
        self.tasks = tasks
        self.sample_interval = sample_interval
        self.clock = clock
        self.log = log
        self.unleased: dict[tuple, dict[str, Any]] = {}  # the broker's unleased-use warnings now: (pid, device) -> warning
        self._warned: set[tuple] = set()
        self._suspend_at: float | None = None
        self._noticed: float | None = None  # the preemption end already warned about
        self._polled = 0.0

    async def on_warnings(self, warnings: list[dict[str, Any]], lease: dict[str, Any]) -> None:
        """The broker's warnings in a heartbeat's answer (each said once) and the lease's preemption."""
        self._unleased_now([w for w in warnings if w.get("kind") == WarningKind.UNLEASED_USE])
        for w in warnings:
            key: tuple = (str(w.get("kind")), float(w.get("at") or 0))
            if w.get("kind") == WarningKind.UNLEASED_USE:  # one per process, and again when its deadline moves
                key = (WarningKind.UNLEASED_USE, float(w.get("at") or 0), w.get("pid"), w.get("device_uuid"))
            if key in self._warned:
                continue
            self._warned.add(key)
            if w.get("kind") == WarningKind.UNLEASED_USE:
                self.announce.warn(WarningKind.UNLEASED_USE, w.get("message") or "A process of yours uses a GPU you do not lease.",
                                   deadline=w.get("deadline"), pid=w.get("pid"), device_uuid=w.get("device_uuid"))
                continue
            passed = (WarningKind.PREEMPTION, WarningKind.GPU_UNHEALTHY, WarningKind.MAINTENANCE)  # said as the broker says them
            kind = WarningKind(w["kind"]) if w.get("kind") in passed else WarningKind.EXPIRING
            message = w.get("message") or f"The GPU lease ends at {w.get('at')}."
            if kind == WarningKind.PREEMPTION:
                # what this server does about it: the broker cannot know
                message = message[:1].upper() + message[1:].rstrip(".") + "." + self.saving_words()
            self.announce.warn(kind, message, deadline=w.get("at"))
        preempt_at = lease.get("preempt_at")
        if not preempt_at and self._noticed is not None and lease:
            # called off (a waiter started elsewhere, its GPU went back into the pool): no suspend
            self.log.info("The GPU lease no longer ends early: its kernels stay as they are")
            self._noticed = self._suspend_at = None
        if preempt_at and float(preempt_at) != self._noticed:
            preempt_at = self._noticed = float(preempt_at)
            self._suspend_at = preempt_at - max(2 * self.sample_interval, 10.0)
            said = (WarningKind.PREEMPTION, WarningKind.GPU_UNHEALTHY, WarningKind.MAINTENANCE)
            if not any(w.get("kind") in said for w in warnings):  # say it ourselves if the broker did not
                self.announce.warn(WarningKind.PREEMPTION, f"{_why_it_ends(lease)}: it ends in "
                                   f"{fmt_duration(max(0.0, preempt_at - self.clock()))}.{self.saving_words()}", deadline=preempt_at)

    def lease_ended(self) -> None:
        self._suspend_at = None
        self._warned.clear()

    def _unleased_now(self, warnings: list[dict[str, Any]]) -> None:
        """The broker's unleased-use warnings now; a process that is no longer in them is said to be
        over (the status bar reads the status again and drops its notification)."""
        now_keys = {(w.get("pid"), w.get("device_uuid")) for w in warnings}
        for pid, _dev in sorted(set(self.unleased) - now_keys, key=str):
            self.announce.publish("notice", {"kind": NoticeKind.UNLEASED_USE, "message": f"Process {pid} no longer uses a GPU you do not lease."})
        self.unleased = {(w.get("pid"), w.get("device_uuid")): w for w in warnings}

    def poll(self, now: float) -> None:
        """Without an active lease no heartbeat carries the unleased-use warnings: ask for them every heartbeat interval."""
        if self.keeper.client is not None and self.keeper.active is None and now - self._polled >= self.keeper.heartbeat_interval:
            self._polled = now
            self.tasks.start(self._poll())

    async def _poll(self) -> None:
        try:
            got = await self.keeper.client.unleased()
        except BrokerError as e:
            self.log.debug("Could not read unleased GPU use from the broker: %s", e.message)
            return
        except Exception:
            self.log.exception("Reading unleased GPU use from the broker failed")
            return
        if self.keeper.active is None:
            await self.on_warnings([w for w in got.get("warnings") or [] if isinstance(w, dict)], {})

    def saving_words(self) -> str:
        return "" if self.actions.suspend_unavailable() else " Kernels holding the GPU are suspended before then: nothing is lost."

    def check(self, now: float) -> None:
        """Before a preemption ends the lease, suspend the kernels that hold the GPU: their work survives."""
        if self._suspend_at is None or now < self._suspend_at or not self.keeper.active:
            return
        self._suspend_at = None
        if self.actions.suspend_unavailable():
            return
        for rec in self.kernels:
            if rec.state == OK and rec.gpu is not None and rec.gpu.holds_memory:
                rec.state = ACTING
                rec.task = self.tasks.start(self.actions.suspend_or_leave(rec, "the GPU lease is being preempted"))


def _why_it_ends(lease: dict[str, Any]) -> str:
    """Why a lease with a deadline before its expiry ends early: an admin's revoke or a move off a
    sick GPU (their reason, from the lease), else a preemption for a higher-priority request."""
    revoke = (lease.get("meta") or {}).get("revoke")
    if isinstance(revoke, dict) and revoke.get("reason"):
        reason = str(revoke["reason"])
        return f"The GPU lease is being revoked ({reason})" if not revoke.get("drain") else f"The GPU lease is being {reason}"
    return "The GPU lease is being preempted for a higher-priority request"
