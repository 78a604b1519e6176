"""The pool's device figures as the broker's own device backend samples them.

Every ``GPULeaseBroker.device_sample_interval`` seconds the backend's :meth:`sample` runs in a
worker thread (NVML blocks); the event loop keeps the newest sample of every device of the pool
(:attr:`DeviceTelemetry.samples`) for the metrics, the broker's own alerts and the dcgm-exporter
mapping. Backends that see no devices from the broker's machine (Kubernetes, Slurm, declared)
return no samples: then no per-device figure is exported, rather than a made-up one.

Critical XID errors are counted here as they arrive (a counter by device and XID code, with the
code's class: ``application`` errors are the holder's program's, the others the hardware's or
the driver's). The driver reports a running count per device; the increase between two samples
is what is new. A sample older than three intervals is dropped (a backend that stopped answering
exports nothing rather than stale figures).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

from ..core.health import Action, xid_action

log = logging.getLogger(__name__)

def xid_kind(code: int | None) -> str:
    """``application`` for an XID the holder's program caused (the XID table in ``core.health``
    says which), else ``device`` (the GPU or its driver)."""
    return "application" if code is not None and xid_action(code) is Action.APPLICATION else "device"


class DeviceTelemetry:
    """See the module doc. ``manager``: the :class:`LeaseManager` (the pool); ``backend``: the
    device backend; ``listeners``: called with this object after each sample (the health keeper)."""

    def __init__(self, manager, backend, *, interval_s: float = 15.0, logger: logging.Logger | None = None,
                 clock: Callable[[], float] = time.monotonic, listeners: Iterable[Callable[[DeviceTelemetry], None]] = ()):
        self.manager = manager
        self.backend = backend
        self.interval_s = float(interval_s)
        self.log = logger or log
        self.clock = clock
        self.samples: dict[str, Any] = {}  # device uuid -> DeviceSample (the newest)
        self.sampled_at: float | None = None  # self.clock() of the newest sample
        # XID errors seen by this broker: (uuid, xid) -> count; the driver's running count per device
        self.xids: dict[tuple[str, int], float] = {}
        self._xid_seen: dict[str, dict[int, int]] = {}
        self._health_seen: dict[str, Any] = {}  # device uuid -> its health report at the last look
        self.started_at = time.time()
        self.last_error = ""
        self.listeners: list[Callable[[DeviceTelemetry], None]] = list(listeners)
        self._busy = False

    def current(self) -> dict[str, Any]:
        """The newest samples, or {} when the newest is older than three intervals."""
        if self.sampled_at is None or self.clock() - self.sampled_at > 3 * max(self.interval_s, 1.0):
            return {}
        return self.samples

    def observe(self, samples: dict[str, Any]) -> None:
        """Take one sample of the backend (on the loop): keep it, count the new XIDs."""
        inventory = self.manager.inventory()
        known = {g.uuid for g in inventory}
        known.update(m.uuid for g in inventory if g.mig for m in g.mig)
        kept = {u: s for u, s in samples.items() if u in known}
        health_seen = self._health_seen
        for uuid, s in kept.items():
            if getattr(s, "parent_uuid", ""):
                continue  # an instance repeats its GPU's health
            seen = health_seen.get(uuid)
            if seen is s.health or seen == s.health:
                continue  # the same report as at the last look: no new XID, no reset
            health_seen[uuid] = s.health
            counts = s.health.xid_counts()
            before = self._xid_seen.get(uuid)
            for code, count in counts.items():
                was = (before or {}).get(code, 0)
                # the backends count since they started, across resets: errors counted before this
                # broker's first look count once; a count that went back (the backend restarted)
                # starts again from there
                new = count - was if count >= was else count
                if new > 0:
                    key = (uuid, int(code))
                    self.xids[key] = self.xids.get(key, 0.0) + new
            self._xid_seen[uuid] = dict(counts)
        self.samples = kept
        self.sampled_at = self.clock()
        for fn in list(self.listeners):
            try:
                fn(self)
            except Exception:
                self.log.exception("a listener of the device samples failed")

    async def sample(self) -> None:
        """One sample, off the loop; a failing backend keeps the previous sample until it is stale."""
        if self._busy:
            return
        self._busy = True
        try:
            try:
                samples = await asyncio.get_running_loop().run_in_executor(None, self.backend.sample)
            except Exception as e:
                if str(e) != self.last_error:
                    self.log.warning("Device figures: the device backend's sample failed: %s", e)
                self.last_error = str(e)
                return
            self.last_error = ""
            self.observe(samples or {})
        finally:
            self._busy = False
