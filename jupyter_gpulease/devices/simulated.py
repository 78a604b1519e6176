"""Simulated GPUs: a declared pool whose utilization and processes a test or the demo drives.

Config (all keys optional)::

    {
      "gpus": [ ...declaration entries, see jupyter_gpulease.devices.declared... ],  # default: DEFAULT_POOL
      "state_file": "/path/to/sim-gpus.json",   # share the driven state with other processes
    }

Drive it in-process with :meth:`SimulatedBackend.set_utilization`,
:meth:`~SimulatedBackend.add_process`, :meth:`~SimulatedBackend.remove_process` and
:meth:`~SimulatedBackend.set_device` (temperature, power, health). With a ``state_file`` every
change is written to that JSON file and every :meth:`sample` re-reads it when it changed, so
one process (the demo, a test) can drive what another (the broker, a server extension) sees.
The file looks like::

    {"utilization": {"GPU-sim-…": 85.0},
     "processes": {"GPU-sim-…": [{"pid": 4242, "used_memory_mib": 10240, "sm_util_pct": 80}]},
     "started": {"4242": 1767225600.25},
     "devices": {"GPU-sim-…": {"temperature_c": 71, "power_w": 250, "power_limit_w": 400,
                               "temperature_slowdown_c": 90, "health": {"xid": 79, "xid_count": 1, "ecc_uncorrected": 0, "lost": false}}}}

A process put on a GPU with its start time (``started``: as ``use_gpu`` does from a notebook's
kernel) is on it only while that process runs: once it exited (or its pid is another process's),
samples leave it out and the next write drops it, so a stopped kernel's memory does not stay on
an idle GPU. A process given without a start time (a test's made-up pid) stays until removed.

A device whose utilization is not set reports the sum of its processes' ``sm_util_pct``
(at most 100); temperature and power not set follow utilization (an idle GPU is cool and
draws little), so the demo's figures move with the work it drives.

Writers replace the file atomically (mode 0644: the single-user servers of other users read it
too); two processes writing at the same moment: the last wins. A file that cannot be read (yet)
is tried again at every sample.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import threading
import time
from typing import Any

import psutil

from ..core.model import GPU
from ..files import write_atomically
from .base import HEALTHY, Clock, DeviceBackend, DeviceHealth, DeviceSample, ProcessSample, check_config_keys
from .declared import parse_inventory

log = logging.getLogger(__name__)

#: The pool the demo runs on: one node, four GPUs of two models, one of them in MIG mode.
DEFAULT_POOL: list[dict[str, Any]] = [
    {"node": "sim-node-1", "model": "A100-SXM4-80GB", "memory_mib": 81920, "mig": ["3g.40gb", "3g.40gb"]},
    {"node": "sim-node-1", "model": "A100-SXM4-80GB", "memory_mib": 81920},
    {"node": "sim-node-1", "model": "L4", "count": 2, "memory_mib": 23034},
]

_CONFIG_KEYS = {"gpus", "state_file", "node"}
_DEVICE_FIGURES = ("temperature_c", "temperature_slowdown_c", "power_w", "power_limit_w")
SLOWDOWN_C = 90.0  # the simulated cards' slowdown threshold, unless driven


def _default_power_limit_w(model: str) -> float:
    """A plausible board power limit for a simulated model, in watts."""
    m = model.upper()
    for prefix, watts in (("H200", 700.0), ("H100", 700.0), ("A100", 400.0), ("L40", 300.0), ("L4", 72.0), ("T4", 70.0)):
        if m.startswith(prefix):
            return watts
    return 300.0


class SimulatedBackend(DeviceBackend):
    """Fake GPUs with driven utilization and per-process memory. Thread-safe."""

    name = "simulated"

    def __init__(self, config: dict[str, Any] | None = None, *, clock: Clock | None = None):
        config = dict(config or {})
        check_config_keys("simulated", config, sorted(_CONFIG_KEYS), passed_through=("include_graphics",))  # nvml's, through 'auto'
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
        self._model: dict[str, str] = {g.uuid: g.model for g in self._gpus}
        self._util: dict[str, float] = {}
        self._procs: dict[str, dict[int, tuple[int | None, float | None]]] = {}  # device uuid -> pid -> (MiB, SM %)
        self._devices: dict[str, dict[str, Any]] = {}  # device uuid -> driven temperature/power/health
        self._started: dict[int, float] = {}  # pid -> its process's start time (there only while that process runs)
        state_file = config.get("state_file")
        if state_file is not None and (not isinstance(state_file, (str, os.PathLike)) or not str(state_file)):
            raise ValueError(f"simulated device backend: 'state_file' must be a file path, got {state_file!r}")
        self.state_file: str | None = os.fspath(state_file) if state_file else None
        self._file_sig: tuple[int, int] | None = None
        self._unreadable = ""
        self._reload()

    # ------------------------------------------------------------------ interface
    def inventory(self) -> list[GPU]:
        return list(self._gpus)

    def sample(self) -> dict[str, DeviceSample]:
        with self._lock:
            self._reload()
            now = self._clock()
            gone = self._gone()
            out: dict[str, DeviceSample] = {}
            for g in self._gpus:
                devices = [g.uuid, *(m.uuid for m in g.mig)]
                procs = tuple(ProcessSample(pid, mib, dev, sm_util_pct=sm)
                              for dev in devices for pid, (mib, sm) in sorted(self._procs.get(dev, {}).items()) if pid not in gone)
                util = self._utilization(g.uuid, procs)
                figures = self._figures(g.uuid, util, self._model[g.uuid])
                out[g.uuid] = DeviceSample(
                    uuid=g.uuid,
                    timestamp=now,
                    utilization_pct=util,
                    memory_used_mib=sum(p.used_memory_mib or 0 for p in procs),
                    memory_total_mib=g.memory_mib,
                    processes=procs,
                    **figures,
                )
                for m in g.mig:
                    own = tuple(p for p in procs if p.device_uuid == m.uuid)
                    driven = self._devices.get(m.uuid, {})
                    out[m.uuid] = DeviceSample(
                        uuid=m.uuid,
                        timestamp=now,
                        utilization_pct=self._utilization(m.uuid, own),
                        memory_used_mib=sum(p.used_memory_mib or 0 for p in own),
                        memory_total_mib=m.memory_mib,
                        processes=own,
                        parent_uuid=g.uuid,
                        # like NVML: an instance reports its GPU's temperature, and no power of its own
                        temperature_c=driven.get("temperature_c", figures["temperature_c"]),
                        temperature_slowdown_c=driven.get("temperature_slowdown_c", figures["temperature_slowdown_c"]),
                        power_w=driven.get("power_w"),
                        power_limit_w=driven.get("power_limit_w"),
                        health=driven.get("health", figures["health"]),
                    )
            return out

    def _utilization(self, uuid: str, procs: tuple[ProcessSample, ...]) -> float:
        if uuid in self._util:
            return self._util[uuid]
        return float(min(100.0, sum(p.sm_util_pct or 0.0 for p in procs)))

    def _figures(self, uuid: str, util: float, model: str) -> dict[str, Any]:
        driven = self._devices.get(uuid, {})
        limit = driven.get("power_limit_w", _default_power_limit_w(model))
        return {
            "temperature_c": driven.get("temperature_c", round(34.0 + 0.45 * util, 1)),
            "temperature_slowdown_c": driven.get("temperature_slowdown_c", SLOWDOWN_C),
            "power_w": driven.get("power_w", round(limit * (0.12 + 0.8 * util / 100.0), 1)),
            "power_limit_w": limit,
            "health": driven.get("health", HEALTHY),
        }

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

    def add_process(self, uuid: str, pid: int, used_memory_mib: int | None, sm_util_pct: float | None = None, *,
                    started: float | None = None) -> None:
        """Put process ``pid`` on a GPU or MIG instance, holding ``used_memory_mib`` and keeping
        ``sm_util_pct`` (0–100) of its compute busy (replaces an earlier entry). ``started``: the
        process's start time (:func:`process_started`): it is then on the GPU only while it runs."""
        self._check_uuid(uuid)
        if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 0:
            raise ValueError(f"pid must be a positive whole number, got {pid!r}")
        if used_memory_mib is not None and (isinstance(used_memory_mib, bool) or not isinstance(used_memory_mib, int) or used_memory_mib < 0):
            raise ValueError(f"used_memory_mib must be a whole number of MiB (or None), got {used_memory_mib!r}")
        if sm_util_pct is not None and not _is_pct(sm_util_pct):
            raise ValueError(f"sm_util_pct must be a number from 0 to 100 (or None), got {sm_util_pct!r}")
        if started is not None and not _is_number(started):
            raise ValueError(f"started must be a process's start time in POSIX seconds (or None), got {started!r}")
        with self._lock:
            self._reload()
            self._procs.setdefault(uuid, {})[pid] = (used_memory_mib, None if sm_util_pct is None else float(sm_util_pct))
            if started is not None:
                self._started[pid] = float(started)
            self._save()

    def started_at(self, pid: int) -> float | None:
        """The start time ``pid`` was put on a GPU with (None: none given)."""
        with self._lock:
            self._reload()
            return self._started.get(pid)

    def remove_process(self, pid: int, uuid: str | None = None) -> bool:
        """Take process ``pid`` off ``uuid`` (or off every device). True when something was removed."""
        with self._lock:
            self._reload()
            removed = False
            for dev, procs in self._procs.items():
                if (uuid is None or dev == uuid) and pid in procs:
                    del procs[pid]
                    removed = True
            if not any(pid in procs for procs in self._procs.values()):
                self._started.pop(pid, None)
            self._save()
            return removed

    def forget_dead_processes(self, *, untimed: bool = False) -> list[int]:
        """Take the processes that no longer run off every device (those put on one with a start
        time; with ``untimed``, also those without one whose pid does not exist now), as a demo
        does at its start: nothing of its last run runs any more. The pids taken off."""
        with self._lock:
            self._reload()
            gone = self._gone()
            if untimed:
                gone |= {pid for procs in self._procs.values() for pid in procs if pid not in self._started and not psutil.pid_exists(pid)}
            for procs in self._procs.values():
                for pid in gone & set(procs):
                    del procs[pid]
            if gone:
                self._save()
            return sorted(gone)

    def set_device(self, uuid: str, *, temperature_c: float | None = None, power_w: float | None = None,
                   power_limit_w: float | None = None, health: DeviceHealth | dict | None = None,
                   temperature_slowdown_c: float | None = None) -> None:
        """Drive a device's temperature and slowdown threshold (°C), power draw and limit (W) and
        health; the figures not given keep their driven value (or the default that follows utilization)."""
        self._check_uuid(uuid)
        change: dict[str, Any] = {}
        for name, value in (("temperature_c", temperature_c), ("power_w", power_w), ("power_limit_w", power_limit_w),
                            ("temperature_slowdown_c", temperature_slowdown_c)):
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(f"{name} must be a number of at least 0, got {value!r}")
            change[name] = float(value)
        if health is not None:
            change["health"] = health if isinstance(health, DeviceHealth) else DeviceHealth.from_dict(health)
        with self._lock:
            self._reload()
            self._devices.setdefault(uuid, {}).update(change)
            self._save()

    def inject_xid(self, uuid: str, code: int, count: int = 1) -> DeviceHealth:
        """The driver reports critical XID ``code`` on a GPU (``count`` times), as NVML's event set
        would: counted per code, ``xid`` the last; XID 79 also loses the GPU, 48 counts an
        uncorrectable ECC error, 63 leaves a row remap pending, 64 a failed one."""
        if isinstance(code, bool) or not isinstance(code, int) or code <= 0 or isinstance(count, bool) or not isinstance(count, int) or count <= 0:
            raise ValueError(f"an XID is a positive whole number and its count at least 1, got {code!r} x {count!r}")
        self._check_uuid(uuid)
        with self._lock:
            self._reload()
            d = self._devices.setdefault(uuid, {})
            h: DeviceHealth = d.get("health", HEALTHY)
            xids = dict(h.xids) or h.xid_counts()
            xids[code] = xids.get(code, 0) + count
            change: dict[str, Any] = {"xid": code, "xid_count": h.xid_count + count, "xids": tuple(sorted(xids.items()))}
            if code == 79:
                change["lost"] = True
            if code == 48:
                change["ecc_uncorrected"] = (h.ecc_uncorrected or 0) + count
            if code == 63:
                change["row_remap_pending"] = True
            if code == 64:
                change["row_remap_failed"] = True
            d["health"] = dataclasses.replace(h, **change)
            self._save()
            return d["health"]

    def reset_device(self, uuid: str) -> DeviceHealth:
        """A GPU reset: the GPU answers again, pending repairs took effect, the volatile ECC count
        is back to 0; the XID counts stay (they count since the monitor started), ``resets`` goes up
        and ``xids_at_reset`` keeps the counts as they were (what the reset repaired)."""
        self._check_uuid(uuid)
        with self._lock:
            self._reload()
            d = self._devices.setdefault(uuid, {})
            h: DeviceHealth = d.get("health", HEALTHY)
            d["health"] = dataclasses.replace(h, lost=False, ecc_uncorrected=0 if h.ecc_uncorrected is not None else None,
                                              retired_pages_pending=False, row_remap_pending=False, resets=h.resets + 1,
                                              xids_at_reset=tuple(sorted(h.xid_counts().items())))
            self._save()
            return d["health"]

    def reset(self) -> None:
        """Forget every driven figure: all devices idle, no processes."""
        with self._lock:
            self._util.clear()
            self._procs.clear()
            self._started.clear()
            self._devices.clear()
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
            util, procs, devices, started = self._parse_state(data)
        except OSError as e:
            # not readable (yet): tried again at the next sample, said once until it is readable
            if self._unreadable != str(e):
                log.warning("Simulated GPUs: cannot read the state file %s (%s); trying again at each sample", self.state_file, e)
                self._unreadable = str(e)
            return
        except ValueError as e:
            log.warning("Simulated GPUs: ignoring state file %s: %s", self.state_file, e)
            self._file_sig = sig
            return
        self._unreadable = ""
        self._util, self._procs, self._devices, self._started, self._file_sig = util, procs, devices, started, sig

    def _parse_state(self, data: Any) -> tuple[dict[str, float], dict[str, dict[int, tuple[int | None, float | None]]],
                                               dict[str, dict[str, Any]], dict[int, float]]:
        if not isinstance(data, dict):
            raise ValueError("it must hold a JSON object with 'utilization' and 'processes'")
        for key in ("utilization", "processes", "devices"):
            if not isinstance(data.get(key) or {}, dict):
                raise ValueError(f"its {key!r} must be a JSON object keyed by device UUID")
        util: dict[str, float] = {}
        for uuid, pct in (data.get("utilization") or {}).items():
            if uuid in self._total and _is_number(pct):
                util[uuid] = float(min(100.0, max(0.0, pct)))
        procs: dict[str, dict[int, tuple[int | None, float | None]]] = {}
        for uuid, plist in (data.get("processes") or {}).items():
            if uuid not in self._total or not isinstance(plist, list):
                continue
            for p in plist:
                if isinstance(p, dict) and isinstance(p.get("pid"), int) and not isinstance(p["pid"], bool):
                    mib, sm = p.get("used_memory_mib"), p.get("sm_util_pct")
                    procs.setdefault(uuid, {})[p["pid"]] = (int(mib) if _is_number(mib) else None,
                                                            float(min(100.0, max(0.0, sm))) if _is_number(sm) else None)
        devices: dict[str, dict[str, Any]] = {}
        for uuid, d in (data.get("devices") or {}).items():
            if uuid not in self._total or not isinstance(d, dict):
                continue
            figures: dict[str, Any] = {k: float(d[k]) for k in _DEVICE_FIGURES if _is_number(d.get(k)) and d[k] >= 0}
            if isinstance(d.get("health"), dict):
                figures["health"] = DeviceHealth.from_dict(d["health"])
            devices[uuid] = figures
        started: dict[int, float] = {}
        for pid, t in (data.get("started") or {}).items() if isinstance(data.get("started"), dict) else ():
            if str(pid).isdigit() and _is_number(t):
                started[int(pid)] = float(t)
        return util, procs, devices, started

    def _gone(self) -> set[int]:
        """The pids put on a GPU with a start time whose process no longer runs."""
        return {pid for pid, t in self._started.items() if not _runs(pid, t)}

    def _save(self) -> None:
        for pid in self._gone():  # a writer drops the processes that exited
            self._started.pop(pid, None)
            for procs in self._procs.values():
                procs.pop(pid, None)
        if not self.state_file:
            return
        data: dict[str, Any] = {
            "utilization": dict(self._util),
            "processes": {u: [{"pid": pid, "used_memory_mib": mib, **({"sm_util_pct": sm} if sm is not None else {})}
                              for pid, (mib, sm) in sorted(p.items())] for u, p in self._procs.items() if p},
        }
        devices = {u: {k: (v.to_dict() if isinstance(v, DeviceHealth) else v) for k, v in d.items()} for u, d in self._devices.items() if d}
        if devices:
            data["devices"] = devices
        if self._started:
            data["started"] = {str(pid): t for pid, t in sorted(self._started.items())}
        # readable by all: servers of other users read the same GPUs
        write_atomically(self.state_file, json.dumps(data, indent=1), mode=0o644)
        st = os.stat(self.state_file)
        self._file_sig = (st.st_mtime_ns, st.st_size)


def process_started(pid: int) -> float | None:
    """When process ``pid`` started (POSIX seconds), None when there is no such process: what
    :meth:`SimulatedBackend.add_process` takes as ``started``."""
    try:
        proc = psutil.Process(pid)
        return None if proc.status() == psutil.STATUS_ZOMBIE else proc.create_time()  # a zombie has exited
    except (psutil.Error, OSError):
        return None


def _runs(pid: int, started: float) -> bool:
    """Process ``pid`` runs and is the one that started at ``started`` (not a later one given its pid)."""
    t = process_started(pid)
    return t is not None and abs(t - started) < 1.0


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _is_pct(v: Any) -> bool:
    return _is_number(v) and 0 <= v <= 100
