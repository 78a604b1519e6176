"""The GPU monitor: samples the device backend off the event loop and keeps a short history.

:meth:`Monitor.sample` runs the backend's blocking ``sample()`` and the attribution of GPU
processes to kernels in one worker thread (one at a time: a slow driver call delays the next
sample, it never piles up threads), keeps only the devices this server leased, and returns a
:class:`Snapshot`. :meth:`Monitor.record` appends it to the history the frontends draw.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from ..devices import DeviceBackend, DeviceSample, DeviceUnavailable
from .attribution import Attribution, KernelProcess, ProcessTree, attribute

log = logging.getLogger(__name__)


@dataclass
class Snapshot:
    """One sample of the leased devices and of the kernels' use of them."""

    time: float
    devices: dict[str, DeviceSample] = field(default_factory=dict)
    attribution: Attribution | None = None
    error: str = ""  # the backend could not sample (the figures are those of no device)

    def device_util(self, uuid: str) -> float | None:
        s = self.devices.get(uuid)
        return s.utilization_pct if s else None


class Monitor:
    """Samples ``backend`` for the devices in :attr:`devices` (GPU or MIG UUIDs)."""

    def __init__(self, backend: DeviceBackend | None, *, interval: float = 1.0, history_s: float = 600.0,
                 clock: Callable[[], float] = time.time, unavailable: str = ""):
        self.backend = backend
        self.devices: set[str] = set()
        # the engine chose the devices inside the node (Kubernetes without DRA, Slurm): the lease
        # names the broker's devices, not these; every device this server sees is the leased one
        self.watch_all = False
        self.unavailable = unavailable  # why there is no telemetry ("" when the backend works)
        self._clock = clock
        self._tree = ProcessTree()
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="gpulease-monitor")
        n = max(2, math.ceil(history_s / max(interval, 0.01)) + 1)
        self._maxlen = n
        self.history: dict[str, deque[tuple[float, float | None, int | None, float | None, float | None]]] = {}
        self.kernel_history: dict[str, deque[tuple[float, int | None, float | None]]] = {}
        self.last: Snapshot | None = None
        self.samples = 0

    @property
    def available(self) -> bool:
        return self.backend is not None and not self.unavailable

    def watch(self, uuids: Iterable[str]) -> None:
        """Sample these devices from now on (the lease's); history of others is dropped."""
        self.devices = set(uuids)
        for u in list(self.history):
            if u not in self.devices:
                del self.history[u]

    async def sample(self, kernels: list[KernelProcess]) -> Snapshot:
        return await self.run_blocking(self._sample_blocking, kernels)

    async def run_blocking(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run a blocking call (``/proc`` reads and the like) in the monitor's worker thread, after
        any sample in progress: one thread for all of the extension's blocking work."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def _sample_blocking(self, kernels: list[KernelProcess]) -> Snapshot:
        now = self._clock()
        snap = Snapshot(now)
        if self.backend is not None and (self.devices or self.watch_all):
            try:
                samples = self.backend.sample()
            except DeviceUnavailable as e:
                snap.error = str(e)
            except Exception as e:  # a backend bug must not stop the monitor
                log.exception("GPU sampling failed")
                snap.error = f"sampling the GPUs failed: {e}"
            else:
                if self.watch_all:
                    split = {s.parent_uuid for s in samples.values() if s.parent_uuid}  # GPUs seen through their MIG instances
                    snap.devices = {u: s for u, s in samples.items() if u not in split}
                else:
                    snap.devices = {u: s for u, s in samples.items() if u in self.devices}
                missing = self.devices - set(snap.devices)
                if missing and not snap.devices:
                    snap.error = f"the leased device(s) {', '.join(sorted(missing))} are not visible to this server"
        snap.attribution = attribute(snap.devices, kernels, self._tree)
        return snap

    def record(self, snap: Snapshot) -> None:
        """Keep ``snap`` as the latest sample and in the history (call on the event loop)."""
        self.last = snap
        self.samples += 1
        for u, s in snap.devices.items():
            h = self.history.get(u)
            if h is None:
                h = self.history[u] = deque(maxlen=self._maxlen)
            h.append((snap.time, s.utilization_pct, s.memory_used_mib, s.power_w, s.temperature_c))
        if snap.attribution is not None:
            for kid, k in snap.attribution.kernels.items():
                h = self.kernel_history.get(kid)
                if h is None:
                    h = self.kernel_history[kid] = deque(maxlen=self._maxlen)
                h.append((snap.time, k.memory_mib, k.sm_util_pct))
            for kid in list(self.kernel_history):
                if kid not in snap.attribution.kernels:
                    del self.kernel_history[kid]

    def device_history(self, uuid: str, seconds: float | None = None) -> dict[str, list[Any]]:
        rows = list(self.history.get(uuid, ()))
        if seconds is not None and rows:
            cut = rows[-1][0] - seconds
            rows = [r for r in rows if r[0] >= cut]
        return {
            "t": [round(r[0], 3) for r in rows],
            "utilization_pct": [r[1] for r in rows],
            "memory_used_mib": [r[2] for r in rows],
            "power_w": [r[3] for r in rows],
            "temperature_c": [r[4] for r in rows],
        }

    def kernel_history_of(self, kernel_id: str, seconds: float | None = None) -> dict[str, list[Any]]:
        rows = list(self.kernel_history.get(kernel_id, ()))
        if seconds is not None and rows:
            cut = rows[-1][0] - seconds
            rows = [r for r in rows if r[0] >= cut]
        return {"t": [round(r[0], 3) for r in rows], "memory_mib": [r[1] for r in rows], "sm_util_pct": [r[2] for r in rows]}

    async def close(self) -> None:
        """Stop sampling and close the backend. The backend's close may wait for a sample still
        running (NVML's lock), so it runs in a thread of its own, never on the event loop."""
        self._executor.shutdown(wait=False, cancel_futures=True)
        if self.backend is not None:
            await asyncio.to_thread(self._close_backend, self.backend)

    @staticmethod
    def _close_backend(backend: DeviceBackend) -> None:
        try:
            backend.close()
        except Exception:  # closing must not fail a server's shutdown
            log.debug("closing the device backend failed", exc_info=True)
