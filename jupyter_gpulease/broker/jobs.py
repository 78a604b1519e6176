"""The broker's periodic jobs: scheduling ticks, event and usage pruning, the database lock's
check, the check for unleased GPU use, device samples, alerts and re-reads of the pool.

Started once the broker serves (``_start_jobs``) and stopped first when it stops; each job logs
its own failure and runs again at its next turn. A part of :class:`.app.GPULeaseBroker`.
"""

from __future__ import annotations

import asyncio

from tornado.ioloop import PeriodicCallback

from ..core.events import ENDED


class PeriodicJobs:
    """What the broker does on its own, every so often."""

    def _start_jobs(self) -> None:
        """The scheduling ticks and every periodic job this broker's config asks for, from now on (some
        also run once right away); ``stop_async`` stops them first."""
        self.ticker = PeriodicCallback(self.manager.tick, self.tick_interval * 1000)
        self.ticker.start()
        self.periodic = [self.ticker]
        if self.reconcile_interval > 0:
            self.periodic.append(PeriodicCallback(self._reconcile, self.reconcile_interval * 1000))
            self._background(self._reconcile())  # once at start
        if self.event_retention_days > 0:
            self.periodic.append(PeriodicCallback(self._prune, 3600 * 1000))
            self._background(self._prune())
        if self.usage_settings.sample_retention_days > 0:
            self.periodic.append(PeriodicCallback(self._prune_usage, 3600 * 1000))
            self._background(self._prune_usage())
        if self.store.dialect == "postgresql":
            self.periodic.append(PeriodicCallback(self._check_lock, 1000))
        if self.unleased is not None:
            self.periodic.append(PeriodicCallback(self._check_unleased, self.unleased_check_interval * 1000))
            self.log.info("Checking for unleased GPU use every %g s (%s; grace %g s)", self.unleased_check_interval, self.unleased.action, self.unleased_grace_s)
        if self.telemetry is not None:
            self.periodic.append(PeriodicCallback(self.telemetry.sample, self.device_sample_interval * 1000))
            self._background(self.telemetry.sample())
        if self.alerts is not None:
            self.periodic.append(PeriodicCallback(self.alerts.check, self.alert_check_interval * 1000))
        if self.dcgm is not None:
            self.dcgm.start()
        every = self.inventory_interval or float(getattr(self.backend, "inventory_refresh_s", 0) or 0)
        if every > 0:
            self.periodic.append(PeriodicCallback(self._refresh_inventory, every * 1000))
        for p in self.periodic[1:]:
            p.start()

    async def _check_unleased(self) -> None:
        try:
            await self.unleased.check()
        except Exception:
            self.log.exception("the check for unleased GPU use failed")

    async def _prune(self) -> None:
        try:
            n = await self.manager.prune_events(self.event_retention_days * 86400)
            if n:
                self.log.info("Deleted %d event(s) of ended leases older than %g days", n, self.event_retention_days)
        except Exception:
            self.log.exception("pruning old events failed")

    async def _prune_usage(self) -> None:
        try:
            n = await self.manager.prune_usage_samples(self.usage_settings.sample_retention_days * 86400)
            if n:
                self.log.info("Deleted %d raw usage sample(s) older than %g days (the hourly roll-ups stay)", n, self.usage_settings.sample_retention_days)
        except Exception:
            self.log.exception("pruning old usage samples failed")

    async def _refresh_inventory(self) -> None:
        """Read the pool again (off the loop: backends may block) and apply it if it changed."""
        if self._refreshing:
            return
        self._refreshing = True
        try:
            try:
                gpus = await asyncio.get_running_loop().run_in_executor(None, self.backend.inventory)
            except Exception as e:
                self.log.warning("Pool not re-read from the %r device backend (kept as it was): %s", self.device_backend, e)
                return
            if gpus == self._inventory:
                return
            before = {g.uuid for g in self._inventory}
            events = await self.manager.set_inventory(gpus)
            self._inventory = list(gpus)
            ended = sum(1 for e in events if e.kind == ENDED)
            self.log.info("Pool changed: %d GPU(s) (%d new, %d gone, %d unhealthy); %d lease(s) ended", len(gpus),
                          len({g.uuid for g in gpus} - before), len(before - {g.uuid for g in gpus}),
                          sum(1 for g in gpus if not g.healthy), ended)
        except Exception:
            self.log.exception("applying the re-read pool failed")
        finally:
            self._refreshing = False

    async def _check_lock(self) -> None:
        try:
            await asyncio.get_running_loop().run_in_executor(self.manager._writer, self.store.check_leadership)
        except Exception as e:  # the connection holding the lock is gone
            self.manager._fail(e, asyncio.get_running_loop().create_future())
