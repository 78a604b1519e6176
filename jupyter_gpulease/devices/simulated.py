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
     "pidns": 4026531836,
     "devices": {"GPU-sim-…": {"temperature_c": 71, "power_w": 250, "power_limit_w": 400,
                               "temperature_slowdown_c": 90, "health": {"xid": 79, "xid_count": 1, "ecc_uncorrected": 0, "lost": false}}}}

A process put on a GPU with its start time (``started``: as ``use_gpu`` does from a notebook's
kernel) is on it only while that process runs: once it exited (or its pid is another process's),
samples leave it out and the next write drops it, so a stopped kernel's memory does not stay on
an idle GPU. A process given without a start time (a test's made-up pid) stays until removed.

A device whose utilization is not set reports the sum of its processes' ``sm_util_pct``
(at most 100); temperature and power not set follow utilization (an idle GPU is cool and
draws little), so the demo's figures move with the work it drives.

Who writes what (a hub whose users' servers run as their own Unix accounts):

- The state file is its owner's: the account that runs the broker, or whoever made it (the demo,
  a test). Only a process of that account (or root) writes it: utilization, device figures and
  faults (XIDs, lost GPUs, resets) come from there alone. It is believed only while nobody else
  can write it: a state file writable by its group or by everyone, or in a folder others can
  write (unless that folder is sticky and the file is the folder owner's or root's), is ignored
  with an error in the log, as if it were empty.
- Every other account writes the processes of its own kernels to a file of its own,
  ``<state file>.d/<uid>.json``, in a sticky folder (mode 1777, like /tmp) that the state file's
  owner makes (the broker does at its start): one account cannot replace or remove another's
  file. Such a file says only which processes use which device: an entry is believed only for a
  running process of the file's owner (its real uid), with the start time it was put there with;
  anything else in it (another account's pid, utilization, device figures, faults) is ignored.
  A kernel cannot put another user's process on a GPU, hide one, or make a GPU sick.

Pid namespaces (servers and kernels in containers, the state file mounted into them):

- A process put on a GPU with its start time is recorded with the pid namespace of the process
  that put it there (the inode of its ``/proc/self/ns/pid``): its pid is a pid of that namespace.
  In the file, ``pidns`` is the namespace of the writer (the plain pids of ``started`` are in it);
  an entry of another namespace (one the writer read and keeps) is written ``"pid@namespace"`` in
  ``started`` and with its ``"pidns"`` in ``processes``, so one pid of two namespaces is two
  entries. A file without ``pidns`` (an older one), and every process given without a start
  time, is in the reader's namespace.
- An entry of the reader's namespace is judged as above. An entry of another one is looked for,
  as NVML does: the process this reader sees whose innermost pid (the last of ``NSpid`` in
  ``/proc/<pid>/status``) is the entry's, whose namespace is the entry's and that started then.
  Found, it is listed under the reader's pid for it (the host sees a container's kernel under its
  host pid). The answer is kept (by namespace, pid and start time): later samples only check that
  that pid still runs with that start time (once it does not, the process exited: gone), so
  ``/proc`` is scanned only when an entry not judged before turns up, never for a pool whose
  entries are all of the reader's namespace.
- Not found, it is gone (readers leave it out, writers drop it) when the reader can see that
  namespace: a reader in the initial pid namespace (inode 0xEFFFFFFC, the kernel's fixed
  ``PROC_PID_INIT_INO``: the host) sees every process of every namespace, so a namespace with no
  such process left (a container that stopped) is gone; any other reader (in a container) sees
  only its own namespace and those below it, and knows such a namespace only while it sees a
  process in it (or saw one before). Otherwise (the host's entries seen from a container, another
  container's) the entry is not visible here: it stays in the file, is not listed, and its memory
  and ``sm_util_pct`` still count in its device's used memory and utilization (NVML in a
  container counts the memory of processes it does not list). A container that stopped while no
  reader of the initial namespace ran is dropped by the next one that does.
- The rules of a user's file hold for entries of other namespaces too: one is believed only when
  it is found, running, as a process of the file's owner (its real uid, seen from the reader).
  One not visible from the reader cannot be checked, so is not believed there.
- A reader that may not look at a process's namespace (``/proc/<pid>/ns/pid``: another account's
  process, for a reader that is not root) takes the only running process with that innermost pid
  and start time in a namespace below its own; with two such, it lists neither (it counts it as
  not visible, and looks again 30 s later). Each process judges with its own ``/proc``, which must be its namespace's (as in
  a container).

Writers replace their file atomically (mode 0644: the single-user servers of other users read it
too); two processes of one account writing at the same moment: the last wins. A file that cannot
be read (yet) is tried again at every sample.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import math
import os
import re
import stat
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
        # what a sample needs of each GPU, worked out once (a pool may hold thousands):
        # the GPU, its MIG instances' UUIDs, its model's default power limit
        self._layout = [(g, tuple(m.uuid for m in g.mig), _default_power_limit_w(g.model)) for g in self._gpus]
        state_file = config.get("state_file")
        if state_file is not None and (not isinstance(state_file, (str, os.PathLike)) or not str(state_file)):
            raise ValueError(f"simulated device backend: 'state_file' must be a file path, got {state_file!r}")
        self.state_file: str | None = os.fspath(state_file) if state_file else None
        #: where accounts other than the state file's owner write their own processes (see the module doc)
        self.users_folder: str | None = self.state_file + ".d" if self.state_file else None
        self._mine = _State()  # what this process writes: the state file, or its account's file in users_folder
        self._files: dict[str, _Read] = {}  # every file read, by path
        self._said: set[str] = set()  # what the log said already (each problem once until it changes)
        self.writes_state_file = self._may_write_state_file()
        #: the file this process writes
        self.write_path: str | None = (self.state_file if self.writes_state_file or not self.state_file
                                       else os.path.join(self.users_folder, f"{os.geteuid()}.json"))
        # the merged view that samples read: devices from the state file, processes from every trusted file
        self._util: dict[str, float] = self._mine.util
        # device uuid -> process -> (MiB, SM %); a process: its pid in this process's pid namespace,
        # or (namespace, pid) for one put there from another namespace (see "Pid namespaces")
        self._procs: dict[str, dict[_Key, tuple[int | None, float | None]]] = self._mine.procs
        self._devices: dict[str, dict[str, Any]] = self._mine.devices  # device uuid -> driven temperature/power/health
        self._started: dict[_Key, float] = self._mine.started  # process -> its start time (there only while that process runs)
        self._foreign = False  # whether some process in the view is of another pid namespace
        if self.state_file and self.writes_state_file and os.path.isdir(os.path.dirname(os.path.abspath(self.state_file))):
            self._make_users_folder()
        self._reload()

    @property
    def checkpoint_store(self) -> str | None:
        """Where the simulated cuda-checkpoint keeps this account's suspended processes: next to
        the file this process writes (None without a state file)."""
        if not self.write_path:
            return None
        return (self.state_file + ".checkpoints.json" if self.writes_state_file
                else os.path.join(self.users_folder, f"{os.geteuid()}.checkpoints.json"))

    # ------------------------------------------------------------------ interface
    def inventory(self) -> list[GPU]:
        return list(self._gpus)

    def sample(self) -> dict[str, DeviceSample]:
        with self._lock:
            self._reload()
            now = self._clock()
            gone, shown = self._judge()
            out: dict[str, DeviceSample] = {}
            on = self._procs
            for g, migs, default_limit_w in self._layout:
                unlisted: tuple[tuple[str, int | None, float | None], ...] = ()  # (device, MiB, SM %) of processes not visible here
                if on and (g.uuid in on or any(m in on for m in migs)):
                    if shown is None:  # every process of this process's pid namespace (the common case)
                        procs = tuple(ProcessSample(pid, mib, dev, sm_util_pct=sm)
                                      for dev in (g.uuid, *migs) for pid, (mib, sm) in sorted(on.get(dev, {}).items()) if pid not in gone)
                    else:
                        procs, unlisted = self._listed((g.uuid, *migs), gone, shown)
                else:
                    procs = ()  # (most GPUs of a large pool run nothing)
                util = self._utilization(g.uuid, procs, unlisted)
                figures = self._figures(g.uuid, util, default_limit_w)
                used = sum(p.used_memory_mib or 0 for p in procs)
                if unlisted:
                    used += sum(mib or 0 for _, mib, _ in unlisted)
                out[g.uuid] = DeviceSample(
                    uuid=g.uuid,
                    timestamp=now,
                    utilization_pct=util,
                    memory_used_mib=used,
                    memory_total_mib=g.memory_mib,
                    processes=procs,
                    **figures,
                )
                for m in g.mig:
                    own = tuple(p for p in procs if p.device_uuid == m.uuid)
                    own_unlisted = tuple(u for u in unlisted if u[0] == m.uuid) if unlisted else ()
                    own_used = sum(p.used_memory_mib or 0 for p in own)
                    if own_unlisted:
                        own_used += sum(mib or 0 for _, mib, _ in own_unlisted)
                    driven = self._devices.get(m.uuid, {})
                    out[m.uuid] = DeviceSample(
                        uuid=m.uuid,
                        timestamp=now,
                        utilization_pct=self._utilization(m.uuid, own, own_unlisted),
                        memory_used_mib=own_used,
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

    def _utilization(self, uuid: str, procs: tuple[ProcessSample, ...], unlisted: tuple[tuple[str, int | None, float | None], ...] = ()) -> float:
        if uuid in self._util:
            return self._util[uuid]
        busy = sum(p.sm_util_pct or 0.0 for p in procs)
        if unlisted:
            busy += sum(sm or 0.0 for _, _, sm in unlisted)
        return float(min(100.0, busy))

    def _judge(self) -> tuple[set[_Key], dict[tuple[int, int], int | None] | None]:
        """The processes of the view that no longer run (to leave out), and, when some are of
        another pid namespace, what each of those is here: its pid here, or None when it is not
        visible from here (not listed, counted). None for the second when there are none."""
        if not self._foreign:
            return _gone_here(self._started), None
        verdicts = _NAMESPACES.judge([(k, t) for k, t in self._started.items() if type(k) is tuple])
        gone: set[_Key] = {k for k, t in self._started.items() if type(k) is int and not _runs(k, t)}
        gone.update(k for k, v in verdicts.items() if v is _GONE)
        return gone, {k: (v if type(v) is int else None) for k, v in verdicts.items() if v is not _GONE}

    def _listed(self, devices: tuple[str, ...], gone: set[_Key], shown: dict[tuple[int, int], int | None]
                ) -> tuple[tuple[ProcessSample, ...], tuple[tuple[str, int | None, float | None], ...]]:
        """The processes on ``devices`` as this process sees them (those of another pid namespace
        under their pid here), and (device, MiB, SM %) of those not visible from here."""
        procs: list[ProcessSample] = []
        unlisted: list[tuple[str, int | None, float | None]] = []
        for dev in devices:
            rows: dict[int, tuple[int | None, float | None]] = {}
            for key, (mib, sm) in self._procs.get(dev, {}).items():
                if key in gone:
                    continue
                here = shown.get(key) if type(key) is tuple else key
                if here is None:
                    unlisted.append((dev, mib, sm))
                    continue
                rows.setdefault(here, (mib, sm))  # (a process put there from both namespaces: listed once)
            procs.extend(ProcessSample(pid, mib, dev, sm_util_pct=sm) for pid, (mib, sm) in sorted(rows.items()))
        return tuple(procs), tuple(unlisted)

    def _key_of(self, started: dict[_Key, float], pid: int) -> _Key | None:
        """The entry of ``started`` that is process ``pid`` (a pid of this process's namespace): the
        pid itself, or an entry put there from another namespace that is that process here."""
        if pid in started:
            return pid
        foreign = [(k, t) for k, t in started.items() if type(k) is tuple]
        if foreign:
            for k, v in _NAMESPACES.judge(foreign).items():
                if type(v) is int and v == pid:
                    return k
        return None

    def _figures(self, uuid: str, util: float, default_limit_w: float) -> dict[str, Any]:
        driven = self._devices.get(uuid, {})
        limit = driven.get("power_limit_w", default_limit_w)
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
        self._check_drives_devices("utilization")
        with self._lock:
            self._reload_mine()
            self._mine.util[uuid] = float(pct)
            self._save()

    def add_process(self, uuid: str, pid: int, used_memory_mib: int | None, sm_util_pct: float | None = None, *,
                    started: float | None = None) -> None:
        """Put process ``pid`` on a GPU or MIG instance, holding ``used_memory_mib`` and keeping
        ``sm_util_pct`` (0–100) of its compute busy (replaces an earlier entry). ``started``: the
        process's start time (:func:`process_started`): it is then on the GPU only while it runs,
        and recorded with this process's pid namespace (``pid`` is a pid of it: see "Pid namespaces").
        A process that does not write the state file puts its own account's processes only (and
        always with their start time): another account's pid is refused with PermissionError."""
        self._check_uuid(uuid)
        if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 0:
            raise ValueError(f"pid must be a positive whole number, got {pid!r}")
        if used_memory_mib is not None and (isinstance(used_memory_mib, bool) or not isinstance(used_memory_mib, int) or used_memory_mib < 0):
            raise ValueError(f"used_memory_mib must be a whole number of MiB (or None), got {used_memory_mib!r}")
        if sm_util_pct is not None and not _is_pct(sm_util_pct):
            raise ValueError(f"sm_util_pct must be a number from 0 to 100 (or None), got {sm_util_pct!r}")
        if started is not None and not _is_number(started):
            raise ValueError(f"started must be a process's start time in POSIX seconds (or None), got {started!r}")
        if not self.writes_state_file:
            owner = _uid_of(pid)
            if owner is None:
                raise ValueError(f"there is no process {pid}")
            if owner != os.geteuid():
                raise PermissionError(f"process {pid} is not this account's (uid {owner}, not {os.geteuid()}): "
                                      "a user puts only their own processes on the simulated GPUs")
            started = started if started is not None else process_started(pid)
        with self._lock:
            self._reload_mine()
            other = self._key_of(self._mine.started, pid)
            if type(other) is tuple and other in self._mine.procs.get(uuid, {}):  # put there from another namespace: replaced
                del self._mine.procs[uuid][other]
                if not any(other in p for p in self._mine.procs.values()):
                    self._mine.started.pop(other, None)
            self._mine.procs.setdefault(uuid, {})[pid] = (used_memory_mib, None if sm_util_pct is None else float(sm_util_pct))
            if started is not None:
                self._mine.started[pid] = float(started)
            self._save()

    def started_at(self, pid: int) -> float | None:
        """The start time ``pid`` was put on a GPU with (None: none given)."""
        with self._lock:
            self._reload()
            key = self._key_of(self._started, pid) if self._foreign else pid
            return self._started.get(key) if key is not None else None

    def remove_process(self, pid: int, uuid: str | None = None) -> bool:
        """Take process ``pid`` off ``uuid`` (or off every device), in the file this process
        writes. True when something was removed."""
        with self._lock:
            self._reload_mine()
            removed = False
            key: _Key = pid
            if not any(pid in procs for procs in self._mine.procs.values()):
                key = self._key_of(self._mine.started, pid) or pid  # (one put there from another namespace)
            for dev, procs in self._mine.procs.items():
                if (uuid is None or dev == uuid) and key in procs:
                    del procs[key]
                    removed = True
            if not any(key in procs for procs in self._mine.procs.values()):
                self._mine.started.pop(key, None)
            self._save()
            return removed

    def forget_dead_processes(self, *, untimed: bool = False) -> list[int]:
        """Take the processes that no longer run off every device (those put on one with a start
        time; with ``untimed``, also those without one whose pid does not exist now), as a demo
        does at its start: nothing of its last run runs any more. The pids taken off (of the file
        this process writes)."""
        with self._lock:
            self._reload_mine()
            gone = self._mine.gone()
            if untimed:
                gone |= {pid for procs in self._mine.procs.values() for pid in procs
                         if pid not in self._mine.started and type(pid) is int and not psutil.pid_exists(pid)}
            self._mine.drop(gone)
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
        self._check_drives_devices("device figures and health")
        with self._lock:
            self._reload_mine()
            self._mine.devices.setdefault(uuid, {}).update(change)
            self._save()

    def inject_xid(self, uuid: str, code: int, count: int = 1) -> DeviceHealth:
        """The driver reports critical XID ``code`` on a GPU (``count`` times), as NVML's event set
        would: counted per code, ``xid`` the last; XID 79 also loses the GPU, 48 counts an
        uncorrectable ECC error, 63 leaves a row remap pending, 64 a failed one."""
        if isinstance(code, bool) or not isinstance(code, int) or code <= 0 or isinstance(count, bool) or not isinstance(count, int) or count <= 0:
            raise ValueError(f"an XID is a positive whole number and its count at least 1, got {code!r} x {count!r}")
        self._check_uuid(uuid)
        self._check_drives_devices("faults (XIDs)")
        with self._lock:
            self._reload_mine()
            d = self._mine.devices.setdefault(uuid, {})
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
        self._check_drives_devices("resets")
        with self._lock:
            self._reload_mine()
            d = self._mine.devices.setdefault(uuid, {})
            h: DeviceHealth = d.get("health", HEALTHY)
            d["health"] = dataclasses.replace(h, lost=False, ecc_uncorrected=0 if h.ecc_uncorrected is not None else None,
                                              retired_pages_pending=False, row_remap_pending=False, resets=h.resets + 1,
                                              xids_at_reset=tuple(sorted(h.xid_counts().items())))
            self._save()
            return d["health"]

    def reset(self) -> None:
        """Forget every driven figure of the file this process writes: all devices idle, no processes."""
        with self._lock:
            self._mine = _State()
            self._save()

    def _check_uuid(self, uuid: str) -> None:
        if uuid not in self._total:
            raise ValueError(f"no simulated GPU or MIG instance with UUID {uuid!r}")

    def _check_drives_devices(self, what: str) -> None:
        if not self.writes_state_file:
            raise PermissionError(f"only the owner of the simulated GPUs' state file {self.state_file} drives {what}: "
                                  f"this account writes its own processes only (to {self.write_path})")

    # ------------------------------------------------------------------ state files
    def _may_write_state_file(self) -> bool:
        """Whether this process writes the state file itself (its owner, root, or the first
        writer of a file not there yet) rather than a file of its account's in users_folder."""
        if not self.state_file:
            return True
        euid = os.geteuid()
        if euid == 0:
            return True
        try:
            return os.stat(self.state_file).st_uid == euid
        except FileNotFoundError:
            return os.access(os.path.dirname(os.path.abspath(self.state_file)), os.W_OK)
        except OSError:
            return False

    def _make_users_folder(self) -> None:
        """The sticky folder where other accounts write their processes (as /tmp: anyone makes a
        file there, nobody replaces or removes another's)."""
        try:
            os.mkdir(self.users_folder)
            os.chmod(self.users_folder, 0o1777)  # mkdir's mode goes through the umask
        except FileExistsError:
            pass
        except OSError as e:
            self._say(f"Simulated GPUs: cannot make the folder for users' processes {self.users_folder} ({e}); "
                      "users' kernels cannot put work on the simulated GPUs")

    def _reload(self) -> None:
        """Read every file that changed since the last read, and merge what is believed."""
        if not self.state_file:
            return
        changed = self._read(self.state_file, main=True)
        seen = {self.state_file}
        for path in self._user_files():
            seen.add(path)
            changed |= self._read(path, main=False)
        for path in set(self._files) - seen:
            del self._files[path]
            changed = True
        if changed:
            self._merge()

    def _reload_mine(self) -> None:
        """Before a change: the latest of the file this process writes (another process of this
        account may have written it), as the base of the change."""
        self._reload()
        if self.write_path:
            read = self._files.get(self.write_path)
            self._mine = read.state.copy() if read else _State()
            unseen, self._mine.unseen = self._mine.unseen, None
            if unseen is not None:  # (a user's file: its processes not visible from here stay in it)
                for dev, procs in unseen.procs.items():
                    self._mine.procs.setdefault(dev, {}).update(procs)
                self._mine.started.update(unseen.started)

    def _user_files(self) -> list[str]:
        """The users' files to read: none when the folder is not the state file owner's."""
        folder = self.users_folder
        try:
            st = os.lstat(folder)
        except FileNotFoundError:
            return []
        except OSError as e:
            self._say(f"Simulated GPUs: cannot read {folder} ({e}); users' processes are not seen")
            return []
        main = self._files.get(self.state_file)  # read just before: no second stat of it
        owner = main.owner if main is not None else os.stat(os.path.dirname(os.path.abspath(self.state_file))).st_uid
        why = ""
        if not stat.S_ISDIR(st.st_mode):
            why = "is not a folder"
        elif st.st_uid not in (0, owner):
            why = f"belongs to uid {st.st_uid}, not to the state file's owner (uid {owner})"
        elif st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
            why = f"can be written by others without the sticky bit (mode {stat.S_IMODE(st.st_mode):o}): one account could replace another's file"
        if why:
            self._say(f"Simulated GPUs: ignoring the users' processes in {folder}: it {why}", error=True)
            return []
        try:
            return sorted(os.path.join(folder, name) for name in os.listdir(folder) if _USER_FILE.fullmatch(name))
        except OSError as e:
            self._say(f"Simulated GPUs: cannot read {folder} ({e}); users' processes are not seen")
            return []

    def _read(self, path: str, *, main: bool) -> bool:
        """Read one file when it changed (True then). A file that cannot be read (yet) is tried
        again at the next read, said once; one that does not parse is ignored until it changes."""
        try:
            fd = os.open(path, os.O_RDONLY | (0 if main else os.O_NOFOLLOW))
        except FileNotFoundError:
            return self._files.pop(path, None) is not None
        except OSError as e:
            if e.errno == errno.ELOOP:
                self._say(f"Simulated GPUs: ignoring {path}: it is a symbolic link", error=True)
            else:
                self._say(f"Simulated GPUs: cannot read the state file {path} ({e}); trying again at each sample")
            return self._files.pop(path, None) is not None
        with os.fdopen(fd, encoding="utf-8") as f:
            st = os.fstat(f.fileno())
            sig = _signature(st)
            known = self._files.get(path)
            if known is not None and known.sig == sig:
                return False
            why = self._distrust(path, st, main)
            try:
                state = self._parse_state(json.load(f), None if main else st.st_uid, path)
            except (ValueError, OSError) as e:  # the last good content stays until the file changes again
                self._say(f"Simulated GPUs: ignoring state file {path}: {e}")
                state = known.state if known is not None else _State()
        if why:
            self._say(f"Simulated GPUs: ignoring {path}: it {why}", error=True)
        else:  # read and believed: a later problem with it is said again
            self._said = {m for m in self._said if path not in m}
        self._files[path] = _Read(sig, st.st_uid, state, trusted=not why)
        return True

    def _distrust(self, path: str, st: os.stat_result, main: bool) -> str:
        """Why a file may not be believed ("" when it may)."""
        if not stat.S_ISREG(st.st_mode):
            return "is not a regular file"
        if not main:
            return ""  # checked entry by entry: its owner's own processes only
        if st.st_mode & 0o022:
            return (f"can be written by {'everyone' if st.st_mode & 0o002 else 'its group'} (mode {stat.S_IMODE(st.st_mode):o}): "
                    f"anyone could forge the GPUs' state; make it 0644 (users' kernels write to {self.users_folder})")
        folder = os.path.dirname(os.path.abspath(path))
        try:
            fst = os.stat(folder)
        except OSError:
            return ""
        if fst.st_mode & 0o022 and not (fst.st_mode & stat.S_ISVTX and st.st_uid in (0, fst.st_uid)):
            return (f"is in a folder others can write ({folder}, mode {stat.S_IMODE(fst.st_mode):o}): anyone could replace it; "
                    "keep it in a folder only its owner writes")
        return ""

    def _merge(self) -> None:
        """The view samples read: utilization and devices from the state file, processes from it
        and from the users' files (each already cut to its owner's own processes)."""
        main = self._files.get(self.state_file)
        base = main.state if main is not None and main.trusted else _State()
        procs = {dev: dict(p) for dev, p in base.procs.items()}
        started = dict(base.started)
        for path, read in self._files.items():
            if path == self.state_file or not read.trusted:
                continue
            for dev, p in read.state.procs.items():
                procs.setdefault(dev, {}).update(p)
            started.update(read.state.started)
        self._util, self._devices, self._procs, self._started = base.util, base.devices, procs, started
        self._foreign = any(type(k) is tuple for k in started)

    def _say(self, message: str, *, error: bool = False) -> None:
        if message not in self._said:
            self._said.add(message)
            (log.error if error else log.warning)(message)

    def _parse_state(self, data: Any, owner: int | None = None, path: str = "") -> _State:
        """One file's content; with ``owner`` (a user's file), only the running processes of that
        account, each with its start time, and nothing about the devices."""
        if not isinstance(data, dict):
            raise ValueError("it must hold a JSON object with 'utilization' and 'processes'")
        for key in ("utilization", "processes", "devices"):
            if not isinstance(data.get(key) or {}, dict):
                raise ValueError(f"its {key!r} must be a JSON object keyed by device UUID")
        out = _State()
        # the processes put there with their start time, by (pid namespace, pid): see "Pid namespaces"
        file_ns = data.get("pidns") if _is_pidns(data.get("pidns")) else None  # None: the reader's
        timed: dict[tuple[int | None, int], float] = {}
        for name, t in (data.get("started") or {}).items() if isinstance(data.get("started"), dict) else ():
            pid, _, ns = str(name).partition("@")
            if pid.isdecimal() and (not ns or ns.isdecimal()) and _is_number(t):
                timed[(int(ns) if ns else file_ns, int(pid))] = float(t)
        here = pid_namespace()
        for (ns, pid), t in timed.items():
            out.started[pid if ns is None or ns == here or here is None else (ns, pid)] = t
        for uuid, pct in (data.get("utilization") or {}).items():
            if uuid in self._total and _is_number(pct):
                out.util[uuid] = float(min(100.0, max(0.0, pct)))
        for uuid, plist in (data.get("processes") or {}).items():
            if uuid not in self._total or not isinstance(plist, list):
                continue
            for p in plist:
                if isinstance(p, dict) and isinstance(p.get("pid"), int) and not isinstance(p["pid"], bool):
                    mib, sm = p.get("used_memory_mib"), p.get("sm_util_pct")
                    pid, said_ns = p["pid"], p.get("pidns") if _is_pidns(p.get("pidns")) else None
                    ns = said_ns if said_ns is not None else file_ns
                    if (ns, pid) not in timed:  # given without a start time: the reader's namespace
                        if said_ns is not None and said_ns != here and here is not None:
                            continue  # said to be of another namespace, with nothing to judge it by
                        ns = None
                    key: _Key = pid if ns is None or ns == here or here is None else (ns, pid)
                    out.procs.setdefault(uuid, {})[key] = (int(mib) if _is_number(mib) else None,
                                                           float(min(100.0, max(0.0, sm))) if _is_number(sm) else None)
        for uuid, d in (data.get("devices") or {}).items():
            if uuid not in self._total or not isinstance(d, dict):
                continue
            figures: dict[str, Any] = {k: float(d[k]) for k in _DEVICE_FIGURES if _is_number(d.get(k)) and d[k] >= 0}
            if isinstance(d.get("health"), dict):
                figures["health"] = DeviceHealth.from_dict(d["health"])
            out.devices[uuid] = figures
        if owner is not None:
            out = self._owners_own(out, owner, path)
        return out

    def _owners_own(self, state: _State, owner: int, path: str) -> _State:
        """What a user's file may say: the processes of its owner that run now (with the start
        time they were put there with); the rest ignored, and said."""
        if state.util or state.devices:
            self._say(f"Simulated GPUs: ignoring the utilization and device figures in {path} (uid {owner}): "
                      "only the state file's owner drives the devices", error=True)
        kept = _State()
        foreign = [(k, t) for k, t in state.started.items() if type(k) is tuple]
        verdicts = _NAMESPACES.judge(foreign) if foreign else {}
        for dev, plist in state.procs.items():
            for key, entry in plist.items():
                t = state.started.get(key)
                if type(key) is tuple:  # of another pid namespace: the process it is here, if visible
                    here = verdicts.get(key)
                    pid, what = (here if type(here) is int else None), f"{key[1]} (pid namespace {key[0]})"
                else:
                    pid, what = key, str(key)
                if pid is None and t is not None and verdicts.get(key) is _HIDDEN:
                    # not visible from here, so not believed; the file's writer keeps it (see "Pid namespaces")
                    kept.unseen = kept.unseen or _State()
                    kept.unseen.procs.setdefault(dev, {})[key] = entry
                    kept.unseen.started[key] = t
                    continue
                uid = _uid_of(pid) if pid is not None else None
                if t is None or uid != owner or not _runs(pid, t):
                    if uid is not None and uid != owner:
                        self._say(f"Simulated GPUs: ignoring process {what} in {path}: it is uid {uid}'s, "
                                  f"not the file owner's (uid {owner})", error=True)
                    continue
                kept.procs.setdefault(dev, {})[key] = entry
                kept.started[key] = t
        return kept

    def _save(self) -> None:
        self._mine.drop(self._mine.gone())  # a writer drops the processes that exited (not those it cannot see)
        if not self.write_path:
            self._util, self._procs, self._devices, self._started = self._mine.util, self._mine.procs, self._mine.devices, self._mine.started
            return
        content = json.dumps(self._mine.to_json(pid_namespace()), indent=1)
        if self.writes_state_file and not os.path.isdir(self.users_folder):
            write_atomically(self.write_path, content, mode=0o644)
            self._make_users_folder()
        else:
            try:
                # readable by all: servers of other users read the same GPUs
                write_atomically(self.write_path, content, mode=0o644)
            except FileNotFoundError:
                raise PermissionError(f"the folder for users' work on the simulated GPUs, {self.users_folder}, is not there: "
                                      "the owner of the state file makes it (the broker does at its start)") from None
        st = os.stat(self.write_path)
        self._files[self.write_path] = _Read(_signature(st), st.st_uid,
                                             self._mine.copy() if self.writes_state_file else self._owners_own(self._mine, st.st_uid, self.write_path),
                                             trusted=not self._distrust(self.write_path, st, self.writes_state_file))
        self._merge()


_USER_FILE = re.compile(r"[0-9]+\.json")

#: A process on a GPU: its pid in this process's pid namespace, or (namespace, pid) for one put
#: there from another pid namespace (see "Pid namespaces" in the module doc).
_Key = int | tuple[int, int]


@dataclasses.dataclass
class _State:
    """What one state file says (or, without a state file, what this process drove)."""

    util: dict[str, float] = dataclasses.field(default_factory=dict)
    procs: dict[str, dict[_Key, tuple[int | None, float | None]]] = dataclasses.field(default_factory=dict)
    devices: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    started: dict[_Key, float] = dataclasses.field(default_factory=dict)
    #: (a user's file, as read) its processes of a pid namespace not visible from here: not
    #: believed, but kept when this process writes that file
    unseen: _State | None = None

    def copy(self) -> _State:
        return _State(dict(self.util), {dev: dict(p) for dev, p in self.procs.items()},
                      {dev: dict(d) for dev, d in self.devices.items()}, dict(self.started),
                      self.unseen.copy() if self.unseen is not None else None)

    def gone(self) -> set[_Key]:
        """The processes put on a GPU with a start time that no longer run (not those of a pid
        namespace not visible from here)."""
        return _gone(self.started)

    def drop(self, pids: set[_Key]) -> None:
        for pid in pids:
            self.started.pop(pid, None)
            for procs in self.procs.values():
                procs.pop(pid, None)

    def to_json(self, pidns: int | None = None) -> dict[str, Any]:
        """The file's content, written by a process of pid namespace ``pidns`` (the namespace of
        the pids given as plain numbers; None: not known)."""
        data: dict[str, Any] = {
            "utilization": dict(self.util),
            "processes": {u: [{"pid": _pid(key), **({"pidns": key[0]} if type(key) is tuple else {}),
                               "used_memory_mib": mib, **({"sm_util_pct": sm} if sm is not None else {})}
                              for key, (mib, sm) in sorted(p.items(), key=_order)] for u, p in self.procs.items() if p},
        }
        devices = {u: {k: (v.to_dict() if isinstance(v, DeviceHealth) else v) for k, v in d.items()} for u, d in self.devices.items() if d}
        if devices:
            data["devices"] = devices
        if self.started:
            data["started"] = {(f"{key[1]}@{key[0]}" if type(key) is tuple else str(key)): t
                               for key, t in sorted(self.started.items(), key=_order)}
            if pidns is not None:
                data["pidns"] = pidns
        return data


@dataclasses.dataclass
class _Read:
    """One file as last read: its signature (changed when it is rewritten), owner, content, and
    whether it is believed."""

    sig: tuple[int, ...]
    owner: int
    state: _State
    trusted: bool = True


def _signature(st: os.stat_result) -> tuple[int, ...]:
    """What changes when a file is rewritten (replaced, resized, given another mode or owner)."""
    return (st.st_mtime_ns, st.st_size, st.st_ino, st.st_mode, st.st_uid)


def _gone_here(started: dict[int, float]) -> set[int]:
    """Of pids (of this process's pid namespace) and the start times they were put on a GPU
    with, those whose process no longer runs."""
    return {pid for pid, t in started.items() if not _runs(pid, t)}


def _gone(started: dict[_Key, float]) -> set[_Key]:
    """Of processes and the start times they were put on a GPU with, those that no longer run:
    of this pid namespace, judged directly; of another, when it is visible from here and the
    process is not found in it."""
    foreign = [(k, t) for k, t in started.items() if type(k) is tuple]
    if not foreign:
        return _gone_here(started)  # type: ignore[arg-type]
    gone: set[_Key] = {k for k, t in started.items() if type(k) is int and not _runs(k, t)}
    gone.update(k for k, v in _NAMESPACES.judge(foreign).items() if v is _GONE)
    return gone


def _pid(key: _Key) -> int:
    return key[1] if type(key) is tuple else key  # type: ignore[index,return-value]


def _order(item: tuple[_Key, Any]) -> tuple[int, int]:
    key = item[0]
    return (key[1], key[0]) if type(key) is tuple else (key, 0)  # type: ignore[index,return-value]


# ---------------------------------------------------------------------- pid namespaces
#: The initial pid namespace's inode number (the kernel's PROC_PID_INIT_INO, fixed since Linux
#: 3.8): a process in it (on the host) sees the processes of every pid namespace.
INITIAL_PID_NAMESPACE = 0xEFFFFFFC

_GONE = "gone"  # a verdict: the process exited
_HIDDEN = "hidden"  # a verdict: its namespace is not visible from here (kept, not listed, counted)


def _namespace_of(pid: int | str) -> int | None:
    """The pid namespace of process ``pid`` (its inode number), None when it cannot be told (no
    such process, no /proc, or not allowed to look)."""
    try:
        return os.stat(f"/proc/{pid}/ns/pid").st_ino
    except OSError:
        return None


_this_namespace: list[int | None] = []  # [the namespace of this process] once known


def pid_namespace() -> int | None:
    """The pid namespace this process runs in (the inode number of ``/proc/self/ns/pid``; None
    without /proc): the one its pids are pids of."""
    if not _this_namespace:
        _this_namespace.append(_namespace_of("self"))
    return _this_namespace[0]


class _Namespaces:
    """What this process found of the processes of other pid namespaces (see "Pid namespaces" in
    the module doc): each verdict kept by (namespace, pid, start time)."""

    LIMIT = 20_000  # verdicts kept at most (then forgotten, found again)
    AGAIN_S = 30.0  # a process told from another only by a namespace not allowed to look at: judged again after that

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.verdicts: dict[tuple[int, int, float], int | str] = {}  # -> its pid here, _GONE or _HIDDEN
        self.again: dict[tuple[int, int, float], float] = {}  # verdicts to judge again (time.monotonic() after which)
        self.seen: set[int] = set()  # namespaces this process saw a process in (descendants of its own)

    def judge(self, entries: list[tuple[tuple[int, int], float]]) -> dict[tuple[int, int], int | str]:
        """For each (namespace, pid) and start time: its pid here, _GONE or _HIDDEN. Scans /proc
        at most once, and only for entries not judged before."""
        out: dict[tuple[int, int], int | str] = {}
        todo: list[tuple[tuple[int, int], float]] = []
        with self.lock:
            for key, t in entries:
                k = (key[0], key[1], t)
                v = self.verdicts.get(k)
                if type(v) is int and not _runs(v, t):
                    v = self.verdicts[k] = _GONE  # found before, it exited since
                elif self.again and k in self.again and self.again[k] < time.monotonic():
                    del self.again[k], self.verdicts[k]
                    v = None
                if v is None:
                    todo.append((key, t))
                else:
                    out[key] = v
            if todo:
                if len(self.verdicts) > self.LIMIT:
                    self.verdicts.clear()
                    self.again.clear()
                index = self._scan()
                for key, t in todo:
                    out[key] = self._find(index, key, t)
        return out

    def _scan(self) -> dict[int, list[tuple[int, int | None]]]:
        """The processes visible here that are in a pid namespace below this /proc's: innermost
        pid -> [(pid here, namespace or None when not allowed to look)]."""
        index: dict[int, list[tuple[int, int | None]]] = {}
        try:
            names = os.listdir("/proc")
        except OSError:
            return index
        for name in names:
            if not name.isdigit():
                continue
            try:
                with open(f"/proc/{name}/status", "rb") as f:
                    ids = next((line.split()[1:] for line in f if line.startswith(b"NSpid:")), [])
            except OSError:
                continue
            if len(ids) < 2:
                continue  # in this /proc's own namespace (or NSpid unknown)
            ns = _namespace_of(name)
            if ns is not None:
                self.seen.add(ns)
            index.setdefault(int(ids[-1]), []).append((int(name), ns))
        if len(self.seen) > self.LIMIT:
            self.seen.clear()
        return index

    def _find(self, index: dict[int, list[tuple[int, int | None]]], key: tuple[int, int], t: float) -> int | str:
        ns, pid = key
        sure: list[int] = []
        unsure: list[int] = []  # running with that pid and start time, in a namespace we may not look at
        for here, its_ns in index.get(pid, ()):
            if (its_ns is None or its_ns == ns) and _runs(here, t):
                (sure if its_ns == ns else unsure).append(here)
        if sure or len(unsure) == 1:
            v: int | str = (sure or unsure)[0]
        elif unsure:
            v = _HIDDEN  # two candidates: neither listed (judged again in a while: one of them may have exited)
            self.again[(ns, pid, t)] = time.monotonic() + self.AGAIN_S
        elif pid_namespace() == INITIAL_PID_NAMESPACE or ns in self.seen:
            v = _GONE  # its namespace is visible from here and the process is not in it
        else:
            v = _HIDDEN
        self.verdicts[(ns, pid, t)] = v
        return v

    def forget(self) -> None:
        self.verdicts.clear()
        self.again.clear()
        self.seen.clear()


_NAMESPACES = _Namespaces()


def _after_fork() -> None:
    """In a forked child (that may run in another pid namespace): judge afresh."""
    _this_namespace.clear()
    _NAMESPACES.lock = threading.Lock()
    _NAMESPACES.forget()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork)


def _uid_of(pid: int) -> int | None:
    """The real uid of process ``pid`` (None: no such process)."""
    try:
        return psutil.Process(pid).uids().real
    except (psutil.Error, OSError):
        return None


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


def _is_pidns(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0
