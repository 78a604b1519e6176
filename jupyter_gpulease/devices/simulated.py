"""Simulated GPUs: a declared pool whose utilization and processes a test or the demo drives.

Config (all keys optional)::

    {
      "gpus": [ ...declaration entries, see jupyter_gpulease.devices.declared... ],  # default: DEFAULT_POOL
      "state_file": "/path/to/sim-gpus.json",   # share the driven state with other processes
    }

Drive it in-process with :meth:`SimulatedBackend.set_utilization`,
:meth:`~SimulatedBackend.add_process` and :meth:`~SimulatedBackend.remove_process`. With a
``state_file`` every change is written to that JSON file and every :meth:`sample` re-reads
it when it changed, so one process (the demo, a test) can drive what another (the broker, a
server extension) sees. The file looks like::

    {"utilization": {"GPU-sim-…": 85.0},
     "processes": {"GPU-sim-…": [{"pid": 4242, "used_memory_mib": 10240}]}}

Writers replace the file atomically; two processes writing at the same moment: the last wins.
"""

from __future__ import annotations

import json
import logging
import math
import os
import tempfile
import threading
import time
from typing import Any

from ..core.model import GPU
from .base import Clock, DeviceBackend, DeviceSample, ProcessSample
from .declared import parse_inventory

log = logging.getLogger(__name__)

#: The pool the demo runs on: one node, four GPUs of two models, one of them in MIG mode.
DEFAULT_POOL: list[dict[str, Any]] = [
    {"node": "sim-node-1", "model": "A100-SXM4-80GB", "memory_mib": 81920, "mig": ["3g.40gb", "3g.40gb"]},
    {"node": "sim-node-1", "model": "A100-SXM4-80GB", "memory_mib": 81920},
    {"node": "sim-node-1", "model": "L4", "count": 2, "memory_mib": 23034},
]

_CONFIG_KEYS = {"gpus", "state_file", "node"}


class SimulatedBackend(DeviceBackend):
    """Fake GPUs with driven utilization and per-process memory. Thread-safe."""

    name = "simulated"

    def __init__(self, config: dict[str, Any] | None = None, *, clock: Clock | None = None):
        config = dict(config or {})
        unknown = sorted(set(config) - _CONFIG_KEYS - {"include_graphics"})  # nvml's keys pass through 'auto'
        if unknown:
            raise ValueError(f"simulated device backend: unknown config key(s) {', '.join(map(repr, unknown))}; "
                             f"allowed: {', '.join(sorted(_CONFIG_KEYS))}")
        self._gpus = parse_inventory(config.get("gpus", DEFAULT_POOL), default_node=config.get("node") or "sim-node-1")
        self._clock = clock or time.time
        self._lock = threading.RLock()
        self._parent: dict[str, str] = {}  # MIG uuid -> GPU uuid
        self._total: dict[str, int] = {}
        for g in self._gpus:
            self._total[g.uuid] = g.memory_mib
            for m in g.mig:
                self._parent[m.uuid] = g.uuid
                self._total[m.uuid] = m.memory_mib
        self._util: dict[str, float] = {}
        self._procs: dict[str, dict[int, int | None]] = {}  # device uuid -> pid -> MiB
        state_file = config.get("state_file")
        if state_file is not None and (not isinstance(state_file, (str, os.PathLike)) or not str(state_file)):
            raise ValueError(f"simulated device backend: 'state_file' must be a file path, got {state_file!r}")
        self.state_file: str | None = os.fspath(state_file) if state_file else None
        self._file_sig: tuple[int, int] | None = None
        self._reload()

    # ------------------------------------------------------------------ interface
    def inventory(self) -> list[GPU]:
        return list(self._gpus)

    def sample(self) -> dict[str, DeviceSample]:
        with self._lock:
            self._reload()
            now = self._clock()
            out: dict[str, DeviceSample] = {}
            for g in self._gpus:
                devices = [g.uuid, *(m.uuid for m in g.mig)]
                procs = tuple(ProcessSample(pid, mib, dev) for dev in devices for pid, mib in sorted(self._procs.get(dev, {}).items()))
                out[g.uuid] = DeviceSample(
                    uuid=g.uuid,
                    timestamp=now,
                    utilization_pct=self._util.get(g.uuid, 0.0),
                    memory_used_mib=sum(p.used_memory_mib or 0 for p in procs),
                    memory_total_mib=g.memory_mib,
                    processes=procs,
                )
                for m in g.mig:
                    own = tuple(p for p in procs if p.device_uuid == m.uuid)
                    out[m.uuid] = DeviceSample(
                        uuid=m.uuid,
                        timestamp=now,
                        utilization_pct=self._util.get(m.uuid, 0.0),
                        memory_used_mib=sum(p.used_memory_mib or 0 for p in own),
                        memory_total_mib=m.memory_mib,
                        processes=own,
                        parent_uuid=g.uuid,
                    )
            return out

    # ------------------------------------------------------------------ driving
    def set_utilization(self, uuid: str, pct: float) -> None:
        """Set the compute utilization (0–100) that :meth:`sample` reports for a GPU or MIG instance."""
        self._check_uuid(uuid)
        if isinstance(pct, bool) or not isinstance(pct, (int, float)) or not 0 <= pct <= 100:
            raise ValueError(f"utilization must be a number from 0 to 100, got {pct!r}")
        with self._lock:
            self._reload()
            self._util[uuid] = float(pct)
            self._save()

    def add_process(self, uuid: str, pid: int, used_memory_mib: int | None) -> None:
        """Put process ``pid`` on a GPU or MIG instance, holding ``used_memory_mib`` (replaces an earlier entry)."""
        self._check_uuid(uuid)
        if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 0:
            raise ValueError(f"pid must be a positive whole number, got {pid!r}")
        if used_memory_mib is not None and (isinstance(used_memory_mib, bool) or not isinstance(used_memory_mib, int) or used_memory_mib < 0):
            raise ValueError(f"used_memory_mib must be a whole number of MiB (or None), got {used_memory_mib!r}")
        with self._lock:
            self._reload()
            self._procs.setdefault(uuid, {})[pid] = used_memory_mib
            self._save()

    def remove_process(self, pid: int, uuid: str | None = None) -> bool:
        """Take process ``pid`` off ``uuid`` (or off every device). True when something was removed."""
        with self._lock:
            self._reload()
            removed = False
            for dev, procs in self._procs.items():
                if (uuid is None or dev == uuid) and pid in procs:
                    del procs[pid]
                    removed = True
            self._save()
            return removed

    def reset(self) -> None:
        """Forget every driven figure: all devices idle, no processes."""
        with self._lock:
            self._util.clear()
            self._procs.clear()
            self._save()

    def _check_uuid(self, uuid: str) -> None:
        if uuid not in self._total:
            raise ValueError(f"no simulated GPU or MIG instance with UUID {uuid!r}")

    # ------------------------------------------------------------------ state file
    def _reload(self) -> None:
        if not self.state_file:
            return
        try:
            st = os.stat(self.state_file)
        except FileNotFoundError:
            return
        sig = (st.st_mtime_ns, st.st_size)
        if sig == self._file_sig:
            return
        try:
            with open(self.state_file, encoding="utf-8") as f:
                data = json.load(f)
            util, procs = self._parse_state(data)
        except (OSError, ValueError) as e:
            log.warning("Simulated GPUs: ignoring state file %s: %s", self.state_file, e)
            self._file_sig = sig
            return
        self._util, self._procs, self._file_sig = util, procs, sig

    def _parse_state(self, data: Any) -> tuple[dict[str, float], dict[str, dict[int, int | None]]]:
        if not isinstance(data, dict):
            raise ValueError("it must hold a JSON object with 'utilization' and 'processes'")
        for key in ("utilization", "processes"):
            if not isinstance(data.get(key) or {}, dict):
                raise ValueError(f"its {key!r} must be a JSON object keyed by device UUID")
        util: dict[str, float] = {}
        for uuid, pct in (data.get("utilization") or {}).items():
            if uuid in self._total and isinstance(pct, (int, float)) and not isinstance(pct, bool) and math.isfinite(pct):
                util[uuid] = float(min(100.0, max(0.0, pct)))
        procs: dict[str, dict[int, int | None]] = {}
        for uuid, plist in (data.get("processes") or {}).items():
            if uuid not in self._total or not isinstance(plist, list):
                continue
            for p in plist:
                if isinstance(p, dict) and isinstance(p.get("pid"), int) and not isinstance(p["pid"], bool):
                    mib = p.get("used_memory_mib")
                    ok = isinstance(mib, (int, float)) and not isinstance(mib, bool) and math.isfinite(mib)
                    procs.setdefault(uuid, {})[p["pid"]] = int(mib) if ok else None
        return util, procs

    def _save(self) -> None:
        if not self.state_file:
            return
        data = {
            "utilization": dict(self._util),
            "processes": {u: [{"pid": pid, "used_memory_mib": mib} for pid, mib in sorted(p.items())] for u, p in self._procs.items() if p},
        }
        folder = os.path.dirname(os.path.abspath(self.state_file))
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".sim-gpus-", suffix=".json", dir=folder)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(data, f, indent=1)
            os.replace(tmp, self.state_file)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        st = os.stat(self.state_file)
        self._file_sig = (st.st_mtime_ns, st.st_size)
