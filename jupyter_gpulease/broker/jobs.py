"""The broker's periodic jobs: scheduling ticks, event and usage pruning, the database lock's
check, the check with the hub, the check for unleased GPU use, device samples, alerts and
re-reads of the pool.

Started once the broker serves (:meth:`PeriodicJobs.start`) and stopped first when it stops
(:meth:`PeriodicJobs.stop`); each job logs its own failure and runs again at its next turn.
Held by :class:`.app.GPULeaseBroker`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable

from tornado.ioloop import PeriodicCallback

from ..core.events import ENDED
from ..tasks import BackgroundTasks

log = logging.getLogger(__name__)

HOUR_MS = 3600 * 1000


class PeriodicJobs:
    """What the broker does on its own, every so often.

    ``manager``: ticks, pruning, the lock's check and the pool's changes go to it; ``backend``:
    the device backend (``backend_name``, as configured) whose pool is re-read every
    ``inventory_s`` (0: never), starting from ``inventory`` (the pool as read at start);
    ``tasks``: where the jobs that also run once at start run. The other parts, each None where
    the broker runs none: ``hub_check`` (every ``reconcile_s``, and at start), the ``unleased``
    detector (every ``unleased_check_s``), device ``telemetry`` (every ``sample_s``, and at
    start), ``alerts`` (every ``alert_check_s``), the ``dcgm`` job map (started with the jobs).
    ``event_retention_days`` and ``usage_retention_days``: pruning, hourly (0: never);
    ``lock_check``: check every second that this broker still holds the database's lock
    (PostgreSQL)."""

    def __init__(self, manager, *, backend, tasks: BackgroundTasks, logger: logging.Logger | None = None, tick_s: float = 5.0,
                 inventory: Iterable = (), inventory_s: float = 0.0, backend_name: str = "",
                 hub_check: Callable[[], Awaitable[None]] | None = None, reconcile_s: float = 0.0,
                 event_retention_days: float = 0.0, usage_retention_days: float = 0.0, lock_check: bool = False,
                 unleased=None, unleased_check_s: float = 0.0, telemetry=None, sample_s: float = 0.0,
                 alerts=None, alert_check_s: float = 30.0, dcgm=None):
        self.manager = manager
        self.backend = backend
        self.tasks = tasks
        self.log = logger or log
        self.tick_s = tick_s
        self.inventory = list(inventory)  # the pool as last applied
        self.inventory_s = inventory_s
        self.backend_name = backend_name
        self.hub_check = hub_check
        self.reconcile_s = reconcile_s
        self.event_retention_days = event_retention_days
        self.usage_retention_days = usage_retention_days
        self.lock_check = lock_check
        self.unleased = unleased
        self.unleased_check_s = unleased_check_s
        self.telemetry = telemetry
        self.sample_s = sample_s
        self.alerts = alerts
        self.alert_check_s = alert_check_s
        self.dcgm = dcgm
        self.periodic: list[PeriodicCallback] = []
        self._refreshing = False

    def start(self) -> None:
        """The scheduling ticks and every periodic job asked for, from now on (some also run once
        right away); :meth:`stop` stops them."""
        ticker = PeriodicCallback(self.manager.tick, self.tick_s * 1000)
        ticker.start()
        self.periodic = [ticker]
        if self.hub_check is not None and self.reconcile_s > 0:
            self.periodic.append(PeriodicCallback(self.hub_check, self.reconcile_s * 1000))
            self._once(self.hub_check())
        if self.event_retention_days > 0:
            self.periodic.append(PeriodicCallback(self.prune_events, HOUR_MS))
            self._once(self.prune_events())
        if self.usage_retention_days > 0:
            self.periodic.append(PeriodicCallback(self.prune_usage, HOUR_MS))
            self._once(self.prune_usage())
        if self.lock_check:
            self.periodic.append(PeriodicCallback(self.manager.check_lock, 1000))
        if self.unleased is not None:
            self.periodic.append(PeriodicCallback(self.check_unleased, self.unleased_check_s * 1000))
            self.log.info("Checking for unleased GPU use every %g s (%s; grace %g s)", self.unleased_check_s, self.unleased.action,
                          self.unleased.tracker.grace_s)
        if self.telemetry is not None:
            self.periodic.append(PeriodicCallback(self.telemetry.sample, self.sample_s * 1000))
            self._once(self.telemetry.sample())
        if self.alerts is not None:
            self.periodic.append(PeriodicCallback(self.alerts.check, self.alert_check_s * 1000))
        if self.dcgm is not None:
            self.dcgm.start()
        if self.inventory_s > 0:
            self.periodic.append(PeriodicCallback(self.refresh_inventory, self.inventory_s * 1000))
        for p in self.periodic[1:]:
            p.start()

    def stop(self) -> None:
        for p in self.periodic:
            p.stop()

    def _once(self, coro) -> None:
        self.tasks.start(coro, what="a background task of the broker")

    async def check_unleased(self) -> None:
        try:
            await self.unleased.check()
        except Exception:
            self.log.exception("the check for unleased GPU use failed")

    async def prune_events(self) -> None:
        try:
            n = await self.manager.prune_events(self.event_retention_days * 86400)
            if n:
                self.log.info("Deleted %d event(s) of ended leases older than %g days", n, self.event_retention_days)
        except Exception:
            self.log.exception("pruning old events failed")

    async def prune_usage(self) -> None:
        try:
            n = await self.manager.prune_usage_samples(self.usage_retention_days * 86400)
            if n:
                self.log.info("Deleted %d raw usage sample(s) older than %g days (the hourly roll-ups stay)", n, self.usage_retention_days)
        except Exception:
            self.log.exception("pruning old usage samples failed")

    async def refresh_inventory(self) -> None:
        """Read the pool again (off the loop: backends may block) and apply it if it changed."""
        if self._refreshing:
            return
        self._refreshing = True
        try:
            try:
                gpus = await asyncio.get_running_loop().run_in_executor(None, self.backend.inventory)
            except Exception as e:
                self.log.warning("Pool not re-read from the %r device backend (kept as it was): %s", self.backend_name, e)
                return
            if gpus == self.inventory:
                return
            before = {g.uuid for g in self.inventory}
            events = await self.manager.set_inventory(gpus)
            self.inventory = list(gpus)
            ended = sum(1 for e in events if e.kind == ENDED)
            self.log.info("Pool changed: %d GPU(s) (%d new, %d gone, %d unhealthy); %d lease(s) ended", len(gpus),
                          len({g.uuid for g in gpus} - before), len(before - {g.uuid for g in gpus}),
                          sum(1 for g in gpus if not g.healthy), ended)
        except Exception:
            self.log.exception("applying the re-read pool failed")
        finally:
            self._refreshing = False
