"""Which kernel a GPU process belongs to.

A kernel is known by its local process (the provisioner's ``pid`` and process group
``pgid``). A GPU process belongs to the kernel whose process group it is in, or whose process
is among its ancestors (a kernel may start workers: DataLoader processes, ``multiprocessing``
pools, a subprocess with its own session). Answers are cached per (pid, start time), so each
GPU process is walked once, not once per sample.

NVML may report PIDs this server cannot see (those of the host's PID namespace, when the server
has one of its own, e.g. in a container). :func:`attribute` notices when a device has processes,
none of them belongs to a kernel and none exists here, and then reports device-level figures
only, saying which processes on which GPUs this server could not find (and no guess at why).

Everything here may read ``/proc``: call it from the monitor's worker thread, not the event loop.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field

import psutil

from ..devices import DeviceSample, ProcessSample

HOST_PID_MESSAGE = "GPU figures are per device, not per kernel"


def host_pid_message(pids_by_device: dict[str, list[int]]) -> str:
    """What the server sees when no GPU process is one it can find: which processes, on which
    GPUs, seen by which server; no guess at why (another PID namespace, e.g. a container, or
    processes of another host or user do this)."""
    user = os.environ.get("JUPYTERHUB_USER", "")
    name = os.environ.get("JUPYTERHUB_SERVER_NAME", "")
    server = f"{user}'s server {name!r}" if user and name else f"{user}'s server" if user else "this server"
    seen = "; ".join(f"{', '.join(map(str, sorted(pids)[:5]))}{' …' if len(pids) > 5 else ''} on {dev}"
                     for dev, pids in sorted(pids_by_device.items()))
    return (f"The GPUs list process IDs that {server} (host {os.uname().nodename}) cannot see among its processes "
            f"({seen}), and none of its kernels: {HOST_PID_MESSAGE}")


@dataclass(frozen=True)
class KernelProcess:
    """What the server knows of a running kernel's local process."""

    kernel_id: str
    pid: int | None  # None: no local process (a remote provisioner)
    pgid: int | None = None


@dataclass
class KernelGPU:
    """A kernel's use of the watched devices in one sample."""

    kernel_id: str
    pids: list[int] = field(default_factory=list)
    devices: list[str] = field(default_factory=list)
    memory_mib: int | None = 0  # None: unknown (device-level attribution)
    sm_util_pct: float | None = None  # None: the driver does not say per process
    by_device: dict[str, tuple[int | None, float | None]] = field(default_factory=dict)  # uuid -> (MiB, SM %)

    @property
    def holds_memory(self) -> bool:
        return bool(self.memory_mib)

    def to_dict(self) -> dict:
        return {"pids": self.pids, "devices": self.devices, "memory_mib": self.memory_mib, "sm_util_pct": self.sm_util_pct}


@dataclass
class Attribution:
    kernels: dict[str, KernelGPU]
    others: list[ProcessSample]  # processes on the watched devices that are not this server's kernels'
    mode: str = "process"  # "process" or "device"
    message: str = ""
    owner: dict[int, str] = field(default_factory=dict)  # GPU pid -> kernel id


class ProcessTree:
    """Finds the kernel a PID belongs to; remembers answers per (pid, start time)."""

    def __init__(self, *, proc: str = "/proc"):
        self._proc = proc if os.path.isdir(proc) else ""
        self._cache: dict[int, tuple[float, str | None]] = {}

    def _stat(self, pid: int) -> tuple[int, int, float] | None:
        """(parent pid, process group, start time) or None when no such process is visible here."""
        if self._proc:
            try:
                with open(f"{self._proc}/{pid}/stat", "rb") as f:
                    data = f.read()
            except OSError:
                return None
            # the command name (field 2) may hold spaces and parentheses: split after the last ')'
            fields = data[data.rfind(b")") + 2:].split()
            try:
                return int(fields[1]), int(fields[2]), float(fields[19])
            except (IndexError, ValueError):
                return None
        try:
            p = psutil.Process(pid)
            with p.oneshot():
                return p.ppid(), os.getpgid(pid), p.create_time()
        except (psutil.Error, OSError):
            return None

    def exists(self, pid: int) -> bool:
        return self._stat(pid) is not None

    def owner(self, pid: int, by_pid: dict[int, str], by_pgid: dict[int, str], kernel_ids: set[str] | None = None) -> tuple[str | None, bool]:
        """(kernel id or None, whether the process exists here)."""
        if kernel_ids is None:
            kernel_ids = set(by_pid.values()) | set(by_pgid.values())
        st = self._stat(pid)
        if st is None:
            self._cache.pop(pid, None)
            return None, False
        cached = self._cache.get(pid)
        # a process that was nobody's when first seen stays nobody's (a process cannot become a
        # descendant of a kernel started after it); one that was a kernel's stays that kernel's
        # while the kernel lives
        if pid in by_pid:
            return by_pid[pid], True
        if cached is not None and cached[0] == st[2] and (cached[1] is None or cached[1] in kernel_ids):
            return cached[1], True
        kid = by_pid.get(pid) or by_pgid.get(st[1])
        ppid, seen = st[0], 0
        while kid is None and ppid > 1 and seen < 64:
            kid = by_pid.get(ppid)
            if kid is not None:
                break
            parent = self._stat(ppid)
            if parent is None:
                break
            kid = by_pgid.get(parent[1])
            ppid, seen = parent[0], seen + 1
        self._cache[pid] = (st[2], kid)
        if len(self._cache) > 4096:  # forget the oldest half: PIDs of long-gone processes
            for k in list(self._cache)[:2048]:
                del self._cache[k]
        return kid, True


def attribute(samples: dict[str, DeviceSample], kernels: Iterable[KernelProcess], tree: ProcessTree) -> Attribution:
    """Per-kernel figures on the watched devices in ``samples``.

    MIG processes appear on both the GPU's and the instance's sample: each (pid, device) pair
    counts once.
    """
    kernels = list(kernels)
    by_pid = {k.pid: k.kernel_id for k in kernels if k.pid}
    by_pgid = {k.pgid: k.kernel_id for k in kernels if k.pgid and k.pgid > 1}
    kernel_ids = {k.kernel_id for k in kernels}
    out = {k.kernel_id: KernelGPU(k.kernel_id) for k in kernels}
    others: list[ProcessSample] = []
    owner: dict[int, str] = {}
    seen: set[tuple[int, str]] = set()
    device_has_procs = False
    any_match = False
    any_local = False
    for s in samples.values():
        for p in s.processes:
            if (p.pid, p.device_uuid) in seen:
                continue
            seen.add((p.pid, p.device_uuid))
            device_has_procs = True
            kid, exists = tree.owner(p.pid, by_pid, by_pgid, kernel_ids)
            any_local = any_local or exists
            if kid is None:
                others.append(p)
                continue
            any_match = True
            owner[p.pid] = kid
            k = out[kid]
            if p.pid not in k.pids:
                k.pids.append(p.pid)
            if p.device_uuid not in k.devices:
                k.devices.append(p.device_uuid)
            mem, sm = k.by_device.get(p.device_uuid, (0, None))
            mem = None if mem is None or p.used_memory_mib is None else mem + p.used_memory_mib
            if p.sm_util_pct is not None:
                sm = (sm or 0.0) + p.sm_util_pct
            k.by_device[p.device_uuid] = (mem, sm)
    for k in out.values():
        mems = [m for m, _ in k.by_device.values()]
        k.memory_mib = None if any(m is None for m in mems) else sum(mems)
        sms = [s for _, s in k.by_device.values() if s is not None]
        k.sm_util_pct = min(100.0, sum(sms)) if sms else None
        if not k.by_device:
            k.memory_mib = 0
    if kernels and device_has_procs and not any_match and not any_local:
        for k in out.values():
            k.memory_mib = None
            k.sm_util_pct = None
        unseen: dict[str, list[int]] = {}
        for p in others:
            unseen.setdefault(p.device_uuid or "?", []).append(p.pid)
        return Attribution(out, others, mode="device", message=host_pid_message(unseen), owner={})
    return Attribution(out, others, owner=owner)
