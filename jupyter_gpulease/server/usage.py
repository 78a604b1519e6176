"""Usage accounting: busy and idle seconds per kernel and device, GPU activity, the heartbeat's usage.

:class:`GPUUsage` counts, at every sample, how long each kernel and device computed or sat
idle on the lease, remembers the last GPU activity (reported as server activity, so the hub's
idle culler sees a kernel computing silently on the GPU as active), and builds the ``usage``
object the heartbeats carry (see docs/server-api.md).
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Callable
from typing import Any

from traitlets import Bool
from traitlets.config import LoggingConfigurable

from .kernels import KernelTable
from .monitor import Snapshot
from .reclaim import KernelUse

MAX_KERNELS = 20  # kernels in one heartbeat at most (those with the highest memory peak)
MAX_BYTES = 3800  # the usage object's JSON stays under the broker's cap (max_usage_bytes, 4096 by default)
PATH_CHARS = 160  # a notebook path is cut to its last characters


class GPUUsage(LoggingConfigurable):
    report_activity = Bool(
        True, help="""Report GPU activity as server activity (a ``gpulease_last_activity`` setting), so the hub and its
        idle culler see a kernel computing silently on the GPU as active.""",
    ).tag(config=True)

    def __init__(self, *, kernels: KernelTable, threshold_pct: float, sample_interval: float, clock: Callable[[], float],
                 web_settings: dict[str, Any] | None = None, lease_reclaim_at: Callable[[], float | None] = lambda: None,
                 **kwargs: Any):
        super().__init__(**kwargs)
        self.kernels = kernels
        self.threshold_pct = threshold_pct
        self.sample_interval = sample_interval
        self.clock = clock
        self.web_settings = web_settings if web_settings is not None else {}
        self.lease_reclaim_at = lease_reclaim_at
        self.device_usage: dict[str, dict[str, float]] = {}
        self.last_gpu_activity: float | None = None
        self.attribution_mode = "process"
        self.last: Snapshot | None = None

    def lease_granted(self) -> None:
        """A new lease: its usage starts from zero."""
        self.device_usage = {}
        for rec in self.kernels:
            rec.busy_s = rec.idle_s = 0.0

    def account(self, snap: Snapshot, uses: list[KernelUse], dt: float, *, lease_active: bool) -> None:
        """Busy and idle seconds per kernel and device over the last ``dt`` seconds."""
        self.last = snap
        if not dt or not lease_active:
            return
        thr = self.threshold_pct
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

    def report(self, snap: Snapshot, uses: list[KernelUse], now: float) -> None:
        """Remember GPU activity, and report it as server activity."""
        thr = self.threshold_pct
        active = any((u.sm_util_pct or 0.0) >= thr or (u.executing and u.holds_gpu) for u in uses)
        if not active and self.attribution_mode == "device":
            active = any((s.utilization_pct or 0.0) >= thr for s in snap.devices.values())
        if active:
            self.last_gpu_activity = now
            if self.report_activity:
                # jupyter_server counts every web_app setting ending in _last_activity as server activity
                self.web_settings["gpulease_last_activity"] = datetime.datetime.fromtimestamp(now, datetime.UTC)

    def gpu_busy(self) -> bool:
        """Whether a kernel used the GPU within the last few samples (the server's current_activity)."""
        return self.last_gpu_activity is not None and self.clock() - self.last_gpu_activity <= 3 * self.sample_interval

    def usage(self) -> dict[str, Any]:
        """The heartbeat's usage: per device and per kernel busy/idle seconds, memory peak, health (compact: the broker caps it)."""
        snap = self.last
        devices = {}
        for uuid, d in self.device_usage.items():
            s = snap.devices.get(uuid) if snap else None
            item = {"busy_s": round(d["busy_s"], 1), "idle_s": round(d["idle_s"], 1), "mem_peak_mib": int(d["mem_peak_mib"])}
            if s is not None and not s.health.ok:
                item["health"] = s.health.message()[:200]
            devices[uuid] = item
        kernels: dict[str, Any] = {}
        out = {
            "t": round(self.clock(), 1),
            "gpu_busy": self.gpu_busy(),
            "last_gpu_activity": self.last_gpu_activity and round(self.last_gpu_activity, 1),
            "attribution": self.attribution_mode,
            # when idle reclaim gives the lease back if nothing computes (the broker tells waiters it may come sooner)
            "lease_reclaim_at": self.lease_reclaim_at(),
            "devices": devices,
            "kernels": kernels,
        }
        size = len(json.dumps(out))
        for rec in sorted(self.kernels, key=lambda r: -r.memory_peak_mib)[:MAX_KERNELS]:
            if not (rec.busy_s or rec.idle_s or rec.memory_peak_mib):
                continue
            item = {"busy_s": round(rec.busy_s, 1), "idle_s": round(rec.idle_s, 1), "mem_peak_mib": rec.memory_peak_mib,
                    "state": rec.state, "name": rec.name[:64], "path": rec.path[-PATH_CHARS:]}
            more = len(json.dumps({rec.id: item})) + (1 if kernels else 0)
            if size + more > MAX_BYTES:
                break  # the kernels with the lower peaks stay out rather than the heartbeat being refused
            kernels[rec.id] = item
            size += more
        return out
