"""Maintenance windows: stretches of time when devices take no lease. Pure, no I/O.

A window names GPUs (by UUID) and nodes, a start, an end and a reason. The scheduler grants
no lease that would run into a window of one of its devices: it starts only where its whole
duration ends before the window begins (or, where the policy allows, it is shortened to end
there), and its ETA is the first slot after the windows in its way (see
:class:`~.reservations.Reservations`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from .model import GPU

INF = math.inf


@dataclass(frozen=True)
class MaintenanceWindow:
    id: str
    start: float
    end: float
    reason: str = ""
    devices: frozenset[str] = frozenset()  # GPU UUIDs
    nodes: frozenset[str] = frozenset()

    def covers(self, gpu: GPU) -> bool:
        return gpu.uuid in self.devices or gpu.node in self.nodes or any(m.uuid in self.devices for m in gpu.mig)

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "start": self.start, "end": self.end, "reason": self.reason,
                "devices": sorted(self.devices), "nodes": sorted(self.nodes)}


class WindowIndex:
    """The windows per GPU UUID, sorted by start (built once per change of the windows or the pool)."""

    def __init__(self, windows: Iterable[MaintenanceWindow], gpus: Mapping[str, GPU]):
        self.by_gpu: dict[str, list[MaintenanceWindow]] = {}
        ws = [w for w in windows if w.end > w.start]
        if ws:
            for u, g in gpus.items():
                mine = sorted((w for w in ws if w.covers(g)), key=lambda w: (w.start, w.end))
                if mine:
                    self.by_gpu[u] = mine

    def __bool__(self) -> bool:
        return bool(self.by_gpu)

    def first_starts(self, now: float) -> dict[str, float]:
        """GPU UUID -> when its first window still to come (or under way) at ``now`` begins."""
        out = {}
        for u, ws in self.by_gpu.items():
            for w in ws:
                if w.end > now:
                    out[u] = w.start
                    break
        return out

    def clash(self, gpu_uuid: str, start: float, end: float) -> MaintenanceWindow | None:
        """The first window of a GPU that overlaps [start, end); None: none."""
        for w in self.by_gpu.get(gpu_uuid, ()):
            if w.start < end and start < w.end:
                return w
        return None

    def covering(self, gpu_uuid: str, at: float) -> MaintenanceWindow | None:
        for w in self.by_gpu.get(gpu_uuid, ()):
            if w.start <= at < w.end:
                return w
        return None


def window_words(w: MaintenanceWindow, fmt_time=None) -> str:
    at = fmt_time or (lambda t: f"{t:.0f}")
    return f"maintenance window {at(w.start)}–{at(w.end)}" + (f": {w.reason}" if w.reason else "")


__all__ = ["MaintenanceWindow", "WindowIndex", "window_words"]
