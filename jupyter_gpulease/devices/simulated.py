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
        self._procs: dict[str, dict[int, tuple[int | None, float | None]]] = self._mine.procs  # device uuid -> pid -> (MiB, SM %)
        self._devices: dict[str, dict[str, Any]] = self._mine.devices  # device uuid -> driven temperature/power/health
        self._started: dict[int, float] = self._mine.started  # pid -> its process's start time (there only while that process runs)
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
            gone = self._gone()
            out: dict[str, DeviceSample] = {}
            on = self._procs
            for g, migs, default_limit_w in self._layout:
                if on and (g.uuid in on or any(m in on for m in migs)):
                    procs = tuple(ProcessSample(pid, mib, dev, sm_util_pct=sm)
                                  for dev in (g.uuid, *migs) for pid, (mib, sm) in sorted(on.get(dev, {}).items()) if pid not in gone)
                else:
                    procs = ()  # (most GPUs of a large pool run nothing)
                util = self._utilization(g.uuid, procs)
                figures = self._figures(g.uuid, util, default_limit_w)
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
        process's start time (:func:`process_started`): it is then on the GPU only while it runs.
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
            self._mine.procs.setdefault(uuid, {})[pid] = (used_memory_mib, None if sm_util_pct is None else float(sm_util_pct))
            if started is not None:
                self._mine.started[pid] = float(started)
            self._save()

    def started_at(self, pid: int) -> float | None:
        """The start time ``pid`` was put on a GPU with (None: none given)."""
        with self._lock:
            self._reload()
            return self._started.get(pid)

    def remove_process(self, pid: int, uuid: str | None = None) -> bool:
        """Take process ``pid`` off ``uuid`` (or off every device), in the file this process
        writes. True when something was removed."""
        with self._lock:
            self._reload_mine()
            removed = False
            for dev, procs in self._mine.procs.items():
                if (uuid is None or dev == uuid) and pid in procs:
                    del procs[pid]
                    removed = True
            if not any(pid in procs for procs in self._mine.procs.values()):
                self._mine.started.pop(pid, None)
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
                         if pid not in self._mine.started and not psutil.pid_exists(pid)}
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
        for uuid, pct in (data.get("utilization") or {}).items():
            if uuid in self._total and _is_number(pct):
                out.util[uuid] = float(min(100.0, max(0.0, pct)))
        for uuid, plist in (data.get("processes") or {}).items():
            if uuid not in self._total or not isinstance(plist, list):
                continue
            for p in plist:
                if isinstance(p, dict) and isinstance(p.get("pid"), int) and not isinstance(p["pid"], bool):
                    mib, sm = p.get("used_memory_mib"), p.get("sm_util_pct")
                    out.procs.setdefault(uuid, {})[p["pid"]] = (int(mib) if _is_number(mib) else None,
                                                                float(min(100.0, max(0.0, sm))) if _is_number(sm) else None)
        for uuid, d in (data.get("devices") or {}).items():
            if uuid not in self._total or not isinstance(d, dict):
                continue
            figures: dict[str, Any] = {k: float(d[k]) for k in _DEVICE_FIGURES if _is_number(d.get(k)) and d[k] >= 0}
            if isinstance(d.get("health"), dict):
                figures["health"] = DeviceHealth.from_dict(d["health"])
            out.devices[uuid] = figures
        for pid, t in (data.get("started") or {}).items() if isinstance(data.get("started"), dict) else ():
            if str(pid).isdigit() and _is_number(t):
                out.started[int(pid)] = float(t)
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
        for dev, plist in state.procs.items():
            for pid, entry in plist.items():
                t = state.started.get(pid)
                uid = _uid_of(pid)
                if t is None or uid != owner or not _runs(pid, t):
                    if uid is not None and uid != owner:
                        self._say(f"Simulated GPUs: ignoring process {pid} in {path}: it is uid {uid}'s, "
                                  f"not the file owner's (uid {owner})", error=True)
                    continue
                kept.procs.setdefault(dev, {})[pid] = entry
                kept.started[pid] = t
        return kept

    def _gone(self) -> set[int]:
        """The pids put on a GPU with a start time whose process no longer runs."""
        return _gone(self._started)

    def _save(self) -> None:
        self._mine.drop(self._mine.gone())  # a writer drops the processes that exited
        if not self.write_path:
            self._util, self._procs, self._devices, self._started = self._mine.util, self._mine.procs, self._mine.devices, self._mine.started
            return
        if self.writes_state_file and not os.path.isdir(self.users_folder):
            write_atomically(self.write_path, json.dumps(self._mine.to_json(), indent=1), mode=0o644)
            self._make_users_folder()
        else:
            try:
                # readable by all: servers of other users read the same GPUs
                write_atomically(self.write_path, json.dumps(self._mine.to_json(), indent=1), mode=0o644)
            except FileNotFoundError:
                raise PermissionError(f"the folder for users' work on the simulated GPUs, {self.users_folder}, is not there: "
                                      "the owner of the state file makes it (the broker does at its start)") from None
        st = os.stat(self.write_path)
        self._files[self.write_path] = _Read(_signature(st), st.st_uid,
                                             self._mine.copy() if self.writes_state_file else self._owners_own(self._mine, st.st_uid, self.write_path),
                                             trusted=not self._distrust(self.write_path, st, self.writes_state_file))
        self._merge()


_USER_FILE = re.compile(r"[0-9]+\.json")


@dataclasses.dataclass
class _State:
    """What one state file says (or, without a state file, what this process drove)."""

    util: dict[str, float] = dataclasses.field(default_factory=dict)
    procs: dict[str, dict[int, tuple[int | None, float | None]]] = dataclasses.field(default_factory=dict)
    devices: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    started: dict[int, float] = dataclasses.field(default_factory=dict)

    def copy(self) -> _State:
        return _State(dict(self.util), {dev: dict(p) for dev, p in self.procs.items()},
                      {dev: dict(d) for dev, d in self.devices.items()}, dict(self.started))

    def gone(self) -> set[int]:
        """The pids put on a GPU with a start time whose process no longer runs."""
        return _gone(self.started)

    def drop(self, pids: set[int]) -> None:
        for pid in pids:
            self.started.pop(pid, None)
            for procs in self.procs.values():
                procs.pop(pid, None)

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "utilization": dict(self.util),
            "processes": {u: [{"pid": pid, "used_memory_mib": mib, **({"sm_util_pct": sm} if sm is not None else {})}
                              for pid, (mib, sm) in sorted(p.items())] for u, p in self.procs.items() if p},
        }
        devices = {u: {k: (v.to_dict() if isinstance(v, DeviceHealth) else v) for k, v in d.items()} for u, d in self.devices.items() if d}
        if devices:
            data["devices"] = devices
        if self.started:
            data["started"] = {str(pid): t for pid, t in sorted(self.started.items())}
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


def _gone(started: dict[int, float]) -> set[int]:
    """Of pids and the start times they were put on a GPU with, those whose process no longer runs."""
    return {pid for pid, t in started.items() if not _runs(pid, t)}


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
