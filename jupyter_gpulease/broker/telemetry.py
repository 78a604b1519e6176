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

A device whose figures did not change since the last sample keeps the sample object it had (its
``timestamp`` says since when it reads so; :attr:`DeviceTelemetry.sampled_at` says when the pool
was last sampled): the comparison is made in the worker thread, and the backend's new objects for
those devices are dropped there. A large pool's samples are long-lived containers, thousands per
sample; keeping the unchanged ones keeps them out of the garbage collector's young generations,
whose collections stall the event loop (``benchmarks/bench_broker.py --stalls``), and leaves
only the devices that changed for the loop to look at.

The backend's sample is shared (:class:`SharedSample`): the unleased-use check also reads every
device of the pool, and when it asks while a sample is under way it gets that one instead of
sampling the pool a second time at the same moment.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import operator
import threading
import time
from collections.abc import Callable, Collection, Iterable
from typing import Any

from ..core.health import Action, xid_action
from ..devices.base import DeviceSample

log = logging.getLogger(__name__)

def xid_kind(code: int | None) -> str:
    """``application`` for an XID the holder's program caused (the XID table in ``core.health``
    says which), else ``device`` (the GPU or its driver)."""
    return "application" if code is not None and xid_action(code) is Action.APPLICATION else "device"


# what a device's sample says, all but when it was taken
_FIGURES = operator.attrgetter(*(f.name for f in dataclasses.fields(DeviceSample) if f.name != "timestamp"))


def same_figures(old: Any, new: Any) -> bool:
    """Whether two samples of a device say the same (every field but ``timestamp``)."""
    return type(old) is type(new) is DeviceSample and _FIGURES(old) == _FIGURES(new)


def keep_unchanged(previous: dict[str, Any], fresh: dict[str, Any], known: Collection[str]) -> tuple[dict[str, Any], list[str]]:
    """(the samples to keep, the devices whose sample is new) from a ``fresh`` sample, for the
    devices in ``known`` only: a device that reads as in ``previous`` keeps its previous sample
    object. When nothing changed, the samples to keep are ``previous`` itself."""
    kept: dict[str, Any] = {}
    changed: list[str] = []
    for uuid, s in fresh.items():
        if uuid not in known:
            continue
        old = previous.get(uuid)
        if old is not None and same_figures(old, s):
            kept[uuid] = old
        else:
            kept[uuid] = s
            changed.append(uuid)
    if not changed and len(kept) == len(previous):
        return previous, changed
    return kept, changed


class SharedSample:
    """The device backend's sample, shared by the callers that ask for it at the same time (see
    the module doc): a caller that asks while another caller's sample is under way waits for that
    one and gets the same dict (read it, never change it). Blocking, like the backend's own
    :meth:`sample`: call it off the event loop. ``name``: the backend's."""

    def __init__(self, backend):
        self.backend = backend
        self.name = backend.name
        self._lock = threading.Lock()
        self._under_way: concurrent.futures.Future | None = None

    def sample(self) -> dict[str, Any]:
        with self._lock:
            shared = self._under_way
            if shared is None:
                self._under_way = mine = concurrent.futures.Future()
        if shared is not None:
            return shared.result()
        try:
            out = self.backend.sample()
        except BaseException as e:
            mine.set_exception(e)
            raise
        else:
            mine.set_result(out)
            return out
        finally:
            with self._lock:
                self._under_way = None


class DeviceTelemetry:
    """See the module doc. ``manager``: the :class:`LeaseManager` (the pool); ``backend``: the
    device backend, or the :class:`SharedSample` of it; ``listeners``: called with this object
    after each sample (the health keeper)."""

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

    def known(self) -> set[str]:
        """The devices of the pool (GPUs and MIG instances), as the manager has it now."""
        inventory = self.manager.inventory()
        known = {g.uuid for g in inventory}
        known.update(m.uuid for g in inventory if g.mig for m in g.mig)
        return known

    def observe(self, samples: dict[str, Any]) -> None:
        """Take one sample of the backend (on the loop): keep it, count the new XIDs."""
        self._keep(*keep_unchanged(self.samples, samples, self.known()))

    def _take(self, previous: dict[str, Any], known: set[str]) -> tuple[dict[str, Any], list[str]]:
        """One sample of the backend and what to keep of it (a worker thread)."""
        return keep_unchanged(previous, self.backend.sample() or {}, known)

    def _keep(self, kept: dict[str, Any], changed: list[str]) -> None:
        """Keep a sample (on the loop), count the new XIDs of the devices that changed, tell the listeners."""
        health_seen = self._health_seen
        for uuid in changed:
            s = kept[uuid]
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
                # the comparison with the last sample is made off the loop too (see the module doc)
                previous = self.samples
                kept, changed = await asyncio.get_running_loop().run_in_executor(None, self._take, previous, self.known())
            except Exception as e:
                if str(e) != self.last_error:
                    self.log.warning("Device figures: the device backend's sample failed: %s", e)
                self.last_error = str(e)
                return
            self.last_error = ""
            if self.samples is not previous:  # a sample was kept meanwhile (observe): look at every device
                changed = list(kept)
            self._keep(kept, changed)
        finally:
            self._busy = False
