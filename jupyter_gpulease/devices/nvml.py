"""Real NVIDIA GPUs through NVML (the ``pynvml`` module of the ``nvidia-ml-py`` distribution).

Config (all keys optional)::

    {"node": "gpu-01",            # node name for the inventory; default: this host's name
     "include_graphics": True}    # also list graphics processes (display servers, Vulkan)

(``gpus`` and ``state_file`` are accepted and ignored: they configure the simulated pool that
the ``auto`` backend falls back to.)

Habits that keep NVML from hurting a server:

* Nothing happens at import: ``pynvml`` is imported and ``nvmlInit`` called on first use, once,
  under a lock. A machine without a driver gets :class:`DeviceUnavailable` with a plain message.
* The driver's version and the highest CUDA version it supports are read once per inventory
  (``nvmlSystemGetCudaDriverVersion_v2``, else the unversioned call) into every GPU; an
  error there leaves them empty.
* Every query goes through :meth:`NvmlBackend._query`, which turns ``NotSupported``,
  ``NoPermission``, ``GpuIsLost``, ``Unknown`` and every other NVML error into ``None``
  ("not available") instead of raising; unexpected ones are logged once per function.
* Process lists try ``_v3``, then ``_v2``, then the unversioned call, so old drivers work.
* MIG instances are found by index under their GPU and addressed by their ``MIG-…`` UUID.
* Health: a GPU that answers "GPU is lost" is reported ``lost``; critical XID errors come from
  an NVML event set drained (without waiting) at each sample; the uncorrected ECC count is the
  volatile one (since the last driver reload). A MIG instance carries its GPU's health.
* Per-process SM utilization comes from ``nvmlDeviceGetProcessUtilization`` for the period
  since the previous sample; a process without a sample in that period was not computing (0).

All calls block on the driver: run :meth:`inventory` and :meth:`sample` in an executor when on
an event loop. Inside containers NVML reports host PIDs; mapping them to local processes is
the caller's business (see ``ProcessSample.pid``).
"""

from __future__ import annotations

import logging
import re
import socket
import threading
import time
from types import ModuleType
from typing import Any

from ..core.model import GPU, MigInstance, cuda_version_text
from .base import Clock, DeviceBackend, DeviceHealth, DeviceSample, DeviceUnavailable, ProcessSample, check_config_keys

log = logging.getLogger(__name__)

MIB = 1024 * 1024
# where the driver lists the MIG capability nodes' minors ("gpu0/gi1/access 30",
# "gpu0/gi1/ci0/access 31"), and where their nodes are: CUDA opens a MIG slice through both
MIG_MINORS = "/proc/driver/nvidia-caps/mig-minors"
MIG_CAP_DIR = "/dev/nvidia-caps"
_MIG_NAME_RE = re.compile(r"MIG\s+(\S+)\s*$")
_NO_INSTANCE = 0xFFFFFFFF  # gpuInstanceId of a process on a GPU without MIG
# NVML's clocks event (throttle) reasons that say something is wrong, by the names of core.health.THROTTLE_WORDS
THROTTLE_BITS = (("hw_slowdown", 0x8), ("sw_thermal", 0x20), ("hw_thermal", 0x40), ("hw_power_brake", 0x80))


class _Missing(Exception):
    """This NVML function does not exist in the binding or in the driver."""


class NvmlBackend(DeviceBackend):
    """GPUs and MIG instances of this machine, sampled through NVML. Thread-safe; calls block."""

    name = "nvml"

    def __init__(self, config: dict[str, Any] | None = None, *, clock: Clock | None = None, nvml: ModuleType | None = None):
        config = dict(config or {})
        check_config_keys("nvml", config, ("node", "include_graphics"), passed_through=("gpus", "state_file"))  # simulated's, through 'auto'
        node = config.get("node")
        if node is not None and (not isinstance(node, str) or not node.strip()):
            raise ValueError(f"nvml device backend: 'node' must be a non-empty string, got {node!r}")
        self.node = node.strip() if node else socket.gethostname()
        self.include_graphics = bool(config.get("include_graphics", True))
        self._clock = clock or time.time
        self._nvml = nvml  # injected module (tests), else imported on first use
        self._lock = threading.RLock()
        self._initialised = False
        self._handles: dict[str, Any] = {}  # uuid -> handle (GPUs and MIG instances)
        self.mig_minors_path = MIG_MINORS  # (tests point it at a file of their own)
        self._gpus: list[GPU] | None = None
        self._gi_ids: dict[str, int] = {}  # MIG uuid -> GPU instance id
        self._warned: set[tuple[str, str]] = set()
        self._lost_seen = False  # set by _query when the driver answers GpuIsLost
        self._event_set: Any = None  # XID events; False when the driver cannot give them
        self._xids: dict[str, tuple[int, int]] = {}  # GPU uuid -> (last XID, count)
        self._xid_codes: dict[str, dict[int, int]] = {}  # GPU uuid -> count per XID code
        self._resets: dict[str, int] = {}  # GPU uuid -> resets seen (a lost GPU that answers again)
        self._xids_at_reset: dict[str, tuple[tuple[int, int], ...]] = {}  # GPU uuid -> its XID counts at the last reset
        self._was_lost: set[str] = set()
        self._pending_repair: dict[str, tuple[int, bool]] = {}  # GPU uuid -> (volatile ECC count, a repair pending) last seen
        self._proc_util_seen: dict[str, int] = {}  # uuid -> last process-utilization time stamp (µs)

    # ------------------------------------------------------------------ init
    def _lib(self) -> ModuleType:
        if self._nvml is None:
            try:
                import pynvml
            except ImportError as e:
                raise DeviceUnavailable(f"The NVIDIA management library binding is not installed ({e}); "
                                        "install 'nvidia-ml-py', or use the 'simulated' or 'static' device backend.") from None
            self._nvml = pynvml
        return self._nvml

    def _ensure_init(self) -> ModuleType:
        with self._lock:
            nv = self._lib()
            if self._initialised:
                return nv
            try:
                nv.nvmlInit()
            except nv.NVMLError as e:
                raise DeviceUnavailable(_init_message(nv, e)) from None
            except OSError as e:  # a broken libnvidia-ml.so
                raise DeviceUnavailable(f"The NVIDIA driver library could not be loaded ({e}); "
                                        "use the 'simulated' or 'static' device backend on machines without GPUs.") from None
            self._initialised = True
            return nv

    def close(self) -> None:
        with self._lock:
            if self._initialised and self._event_set:
                try:
                    self._nvml.nvmlEventSetFree(self._event_set)
                except (self._nvml.NVMLError, AttributeError) as e:
                    log.debug("nvmlEventSetFree failed: %s", e)
            self._event_set = None
            if self._initialised:
                try:
                    self._nvml.nvmlShutdown()
                except self._nvml.NVMLError as e:
                    log.debug("nvmlShutdown failed: %s", e)
            self._initialised = False
            self._handles.clear()
            self._gpus = None
            self._gi_ids.clear()

    # ------------------------------------------------------------------ the one query wrapper
    def _call(self, fn_name: str, *args: Any, **kwargs: Any) -> Any:
        """Call an NVML function; raise :class:`_Missing` when it does not exist, NVMLError otherwise."""
        nv = self._nvml
        fn = getattr(nv, fn_name, None)
        if fn is None:
            raise _Missing(fn_name)
        try:
            return fn(*args, **kwargs)
        except nv.NVMLError_FunctionNotFound:
            raise _Missing(fn_name) from None
        except getattr(nv, "NVMLLibraryMismatchError", _Missing):
            raise _Missing(fn_name) from None
        except TypeError:  # an older binding without this keyword argument
            if kwargs:
                raise _Missing(fn_name) from None
            raise

    def _query(self, fn_name: str, *args: Any, **kwargs: Any) -> Any:
        """``_call``, with every NVML error and a missing function mapped to ``None`` ("not available")."""
        nv = self._nvml
        try:
            return self._call(fn_name, *args, **kwargs)
        except _Missing:
            return None
        except nv.NVMLError as e:
            if isinstance(e, getattr(nv, "NVMLError_GpuIsLost", ())):
                self._lost_seen = True
            quiet = (getattr(nv, "NVMLError_NotSupported", ()), getattr(nv, "NVMLError_NotFound", ()))
            if not isinstance(e, quiet) and (fn_name, type(e).__name__) not in self._warned:
                self._warned.add((fn_name, type(e).__name__))
                log.warning("NVML %s failed: %s; reporting it as not available", fn_name, e)
            return None

    # ------------------------------------------------------------------ inventory
    def inventory(self) -> list[GPU]:
        """Discover GPUs and MIG instances. Raises :class:`DeviceUnavailable` without a driver. Blocks."""
        with self._lock:
            self._ensure_init()
            self._discover()
            return list(self._gpus or [])

    def _discover(self) -> None:
        nv = self._nvml
        count = self._query("nvmlDeviceGetCount") or 0
        gpus: list[GPU] = []
        handles: dict[str, Any] = {}
        gi_ids: dict[str, int] = {}
        driver_version, cuda_version = self._driver_versions() if count else ("", "")
        for i in range(count):
            h = self._query("nvmlDeviceGetHandleByIndex", i)
            if h is None:
                log.warning("NVML: GPU %d cannot be opened; leaving it out of the pool", i)
                continue
            uuid = _text(self._query("nvmlDeviceGetUUID", h))
            if not uuid:
                log.warning("NVML: GPU %d has no readable UUID; leaving it out of the pool", i)
                continue
            index = self._query("nvmlDeviceGetIndex", h)
            name = _model_name(_text(self._query("nvmlDeviceGetName", h)) or "unknown GPU")
            healthy = True
            try:
                mem = self._memory_info(h, strict=True)
            except nv.NVMLError as e:
                healthy = not isinstance(e, getattr(nv, "NVMLError_GpuIsLost", ()))
                mem = None
            total = int(mem.total // MIB) if mem is not None else 0
            minor = self._query("nvmlDeviceGetMinorNumber", h)  # its /dev/nvidiaN (device enforcement)
            mig = self._discover_mig(h, uuid, handles, gi_ids, minor if isinstance(minor, int) else None)
            handles[uuid] = h
            gpus.append(GPU(uuid=uuid, node=self.node, index=int(index if index is not None else i), model=name,
                            memory_mib=total, mig=tuple(mig), healthy=healthy,
                            device=f"/dev/nvidia{int(minor)}" if isinstance(minor, int) else "",
                            driver_version=driver_version, cuda_version=cuda_version))
        self._gpus, self._handles, self._gi_ids = gpus, handles, gi_ids

    def _driver_versions(self) -> tuple[str, str]:
        """This machine's driver version ("550.54.15") and the highest CUDA version it supports
        ("12.4", nvidia-smi's "CUDA Version"); "" where NVML does not say (never an error)."""
        driver = _text(self._query("nvmlSystemGetDriverVersion"))
        cuda = self._query("nvmlSystemGetCudaDriverVersion_v2")
        if cuda is None:
            cuda = self._query("nvmlSystemGetCudaDriverVersion")
        try:
            cuda_words = cuda_version_text(cuda) if cuda else ""
        except (TypeError, ValueError):
            cuda_words = ""
        return driver, cuda_words

    def _discover_mig(self, h: Any, gpu_uuid: str, handles: dict[str, Any], gi_ids: dict[str, int],
                      gpu_minor: int | None = None) -> list[MigInstance]:
        nv = self._nvml
        mode = self._query("nvmlDeviceGetMigMode", h)
        if not mode or mode[0] != getattr(nv, "NVML_DEVICE_MIG_ENABLE", 1):
            return []
        caps = read_mig_minors(self.mig_minors_path) if gpu_minor is not None else {}
        out: list[MigInstance] = []
        for k in range(self._query("nvmlDeviceGetMaxMigDeviceCount", h) or 0):
            mh = self._query("nvmlDeviceGetMigDeviceHandleByIndex", h, k)
            if mh is None:  # NotFound: no instance in this slot
                continue
            mig_uuid = _text(self._query("nvmlDeviceGetUUID", mh))
            if not mig_uuid:
                continue
            attrs = self._query("nvmlDeviceGetAttributes", mh)
            mem = self._memory_info(mh)
            if mem is not None:
                memory = int(mem.total // MIB)
            else:
                memory = int(getattr(attrs, "memorySizeMB", 0) or 0)
            profile = _mig_profile(_text(self._query("nvmlDeviceGetName", mh)), attrs, memory)
            gi = self._query("nvmlDeviceGetGpuInstanceId", mh)
            if gi is not None:
                gi_ids[mig_uuid] = int(gi)
            ci = self._query("nvmlDeviceGetComputeInstanceId", mh)
            gi_cap = caps.get(f"gpu{gpu_minor}/gi{gi}/access") if gi is not None else None
            ci_cap = caps.get(f"gpu{gpu_minor}/gi{gi}/ci{ci}/access") if gi is not None and ci is not None else None
            handles[mig_uuid] = mh
            out.append(MigInstance(uuid=mig_uuid, profile=profile, memory_mib=memory, index=k,
                                   device=f"{MIG_CAP_DIR}/nvidia-cap{gi_cap}" if gi_cap is not None else "",
                                   compute_device=f"{MIG_CAP_DIR}/nvidia-cap{ci_cap}" if ci_cap is not None else ""))
        if not out:
            log.info("NVML: GPU %s is in MIG mode but has no MIG instances yet", gpu_uuid)
        return out

    def _memory_info(self, h: Any, strict: bool = False) -> Any:
        """Memory info, v2 (``used`` without driver-reserved memory) where the driver has it."""
        nv = self._nvml
        version = getattr(nv, "nvmlMemory_v2", None)
        if version is not None:
            try:
                return self._call("nvmlDeviceGetMemoryInfo", h, version=version)
            except _Missing:
                pass
            except nv.NVMLError as e:
                if not isinstance(e, (nv.NVMLError_NotSupported, getattr(nv, "NVMLError_ArgumentVersionMismatch", ()))):
                    if strict:
                        raise
                    return self._query("nvmlDeviceGetMemoryInfo", h)  # logs once, returns None
        if strict:
            try:
                return self._call("nvmlDeviceGetMemoryInfo", h)
            except _Missing:
                return None
        return self._query("nvmlDeviceGetMemoryInfo", h)

    # ------------------------------------------------------------------ sampling
    def sample(self) -> dict[str, DeviceSample]:
        """Utilization, memory and processes of every GPU and MIG instance. Blocks: run it in an executor."""
        with self._lock:
            self._ensure_init()
            if self._gpus is None:
                self._discover()
            now = self._clock()
            self._drain_xid_events()
            out: dict[str, DeviceSample] = {}
            for g in self._gpus or []:
                h = self._handles[g.uuid]
                self._lost_seen = False
                util = self._query("nvmlDeviceGetUtilizationRates", h)
                mem = self._memory_info(h)
                by_gi = {self._gi_ids[m.uuid]: m.uuid for m in g.mig if m.uuid in self._gi_ids}
                procs = self._processes(h, g.uuid, by_gi)
                if procs:
                    procs = self._with_sm_util(h, g.uuid, procs)
                temperature = self._query("nvmlDeviceGetTemperature", h, getattr(self._nvml, "NVML_TEMPERATURE_GPU", 0))
                slowdown = self._query("nvmlDeviceGetTemperatureThreshold", h, getattr(self._nvml, "NVML_TEMPERATURE_THRESHOLD_SLOWDOWN", 1))
                power = self._query("nvmlDeviceGetPowerUsage", h)
                limit = self._query("nvmlDeviceGetEnforcedPowerLimit", h)
                ecc = self._query("nvmlDeviceGetTotalEccErrors", h, getattr(self._nvml, "NVML_MEMORY_ERROR_TYPE_UNCORRECTED", 1),
                                  getattr(self._nvml, "NVML_VOLATILE_ECC", 0))
                xid, xid_count = self._xids.get(g.uuid, (None, 0))
                lost = self._lost_seen
                if lost:
                    self._was_lost.add(g.uuid)
                elif g.uuid in self._was_lost and util is not None:  # answers again: it was reset
                    self._was_lost.discard(g.uuid)
                    self._reset_seen(g.uuid)
                repairs = self._memory_repairs(h)
                pending = repairs["row_remap_pending"] or repairs["retired_pages_pending"]
                was_ecc, was_pending = self._pending_repair.get(g.uuid, (0, False))
                if not lost and ((was_ecc and ecc == 0) or (was_pending and not pending)):
                    # the volatile ECC count went back to 0, or a pending repair took effect: a reset
                    self._reset_seen(g.uuid)
                if not lost:
                    self._pending_repair[g.uuid] = (int(ecc or 0), pending)
                health = DeviceHealth(lost=lost, xid=xid, xid_count=xid_count, ecc_uncorrected=None if ecc is None else int(ecc),
                                      xids=tuple(sorted(self._xid_codes.get(g.uuid, {}).items())), resets=self._resets.get(g.uuid, 0),
                                      xids_at_reset=self._xids_at_reset.get(g.uuid, ()),
                                      **repairs, throttle=self._throttle(h))
                out[g.uuid] = DeviceSample(
                    uuid=g.uuid,
                    timestamp=now,
                    utilization_pct=_pct(util),
                    memory_used_mib=int(mem.used // MIB) if mem is not None else None,
                    memory_total_mib=int(mem.total // MIB) if mem is not None else (g.memory_mib or None),
                    processes=procs if procs is not None else (),
                    temperature_c=None if temperature is None else float(temperature),
                    temperature_slowdown_c=None if slowdown is None else float(slowdown),
                    power_w=None if power is None else power / 1000.0,
                    power_limit_w=None if limit is None else limit / 1000.0,
                    health=health,
                )
                for m in g.mig:
                    mh = self._handles.get(m.uuid)
                    if mh is None:
                        continue
                    mmem = self._memory_info(mh)
                    own = self._processes(mh, m.uuid, {})
                    if own is None or (not own and procs):  # per-instance lists unsupported: take the GPU's, by instance id
                        own = tuple(p for p in (procs or ()) if p.device_uuid == m.uuid)
                    else:
                        own = tuple(ProcessSample(p.pid, p.used_memory_mib, m.uuid, p.kind, p.sm_util_pct) for p in own)
                    out[m.uuid] = DeviceSample(
                        uuid=m.uuid,
                        timestamp=now,
                        utilization_pct=_pct(self._query("nvmlDeviceGetUtilizationRates", mh)),  # usually not supported on MIG
                        memory_used_mib=int(mmem.used // MIB) if mmem is not None else None,
                        memory_total_mib=int(mmem.total // MIB) if mmem is not None else m.memory_mib,
                        processes=own,
                        parent_uuid=g.uuid,
                        temperature_c=out[g.uuid].temperature_c,  # one die: the GPU's temperature
                        temperature_slowdown_c=out[g.uuid].temperature_slowdown_c,
                        health=health,
                    )
            return out

    def _with_sm_util(self, h: Any, uuid: str, procs: tuple[ProcessSample, ...]) -> tuple[ProcessSample, ...]:
        """The processes with their SM utilization since the previous sample, where the driver reports it."""
        nv = self._nvml
        # the driver keeps a short buffer of samples stamped in CPU microseconds; ask for those
        # since the last one seen (first time: the last two seconds)
        since = self._proc_util_seen.get(uuid) or int(time.time() * 1e6) - 2_000_000
        try:
            samples = self._call("nvmlDeviceGetProcessUtilization", h, since)
        except _Missing:
            return procs
        except nv.NVMLError as e:
            if isinstance(e, getattr(nv, "NVMLError_NotFound", ())):
                samples = []  # no process ran a kernel since `since`
            else:
                self._query("nvmlDeviceGetProcessUtilization", h, since)  # logs once (not for NotSupported)
                return procs
        busy: dict[int, float] = {}
        latest = since
        for smp in samples:
            pid = int(smp.pid)
            busy[pid] = max(busy.get(pid, 0.0), float(smp.smUtil))
            latest = max(latest, int(smp.timeStamp))
        self._proc_util_seen[uuid] = latest
        return tuple(ProcessSample(p.pid, p.used_memory_mib, p.device_uuid, p.kind, min(100.0, busy.get(p.pid, 0.0))) for p in procs)

    def _reset_seen(self, uuid: str) -> None:
        """A reset of GPU ``uuid``: its XID counts go on; those up to now were repaired by it."""
        self._resets[uuid] = self._resets.get(uuid, 0) + 1
        self._xids_at_reset[uuid] = tuple(sorted(self._xid_codes.get(uuid, {}).items()))

    def _drain_xid_events(self) -> None:
        """Count the critical XID errors the driver reported since the last sample (never waits)."""
        nv = self._nvml
        if self._event_set is None:
            self._event_set = False
            es = self._query("nvmlEventSetCreate")
            if es is not None:
                registered = False
                for g in self._gpus or []:
                    try:
                        self._call("nvmlDeviceRegisterEvents", self._handles[g.uuid], getattr(nv, "nvmlEventTypeXidCriticalError", 8), es)
                        registered = True
                    except (_Missing, nv.NVMLError) as e:
                        log.debug("NVML: no XID events for GPU %s: %s", g.uuid, e)
                if registered:
                    self._event_set = es
                else:
                    self._query("nvmlEventSetFree", es)
        if not self._event_set:
            return
        by_handle = {id(h): u for u, h in self._handles.items()}
        for _ in range(1000):  # bounded: a storm of events must not keep the sampler here
            try:
                ev = self._call("nvmlEventSetWait_v2", self._event_set, 0)
            except _Missing:
                self._event_set = False
                return
            except nv.NVMLError:  # Timeout: nothing (more) pending
                return
            uuid = by_handle.get(id(ev.device)) or _text(self._query("nvmlDeviceGetUUID", ev.device))
            if uuid:
                _, count = self._xids.get(uuid, (None, 0))
                self._xids[uuid] = (int(ev.eventData), count + 1)
                codes = self._xid_codes.setdefault(uuid, {})
                codes[int(ev.eventData)] = codes.get(int(ev.eventData), 0) + 1
                log.warning("NVML: critical XID error %s on GPU %s", int(ev.eventData), uuid)

    def _memory_repairs(self, h: Any) -> dict[str, bool]:
        return memory_repairs(self._query, h, int(getattr(self._nvml, "NVML_FEATURE_ENABLED", 1)))

    def _throttle(self, h: Any) -> tuple[str, ...]:
        return throttle_reasons(self._query, h)

    def _processes(self, h: Any, uuid: str, by_gi: dict[int, str]) -> tuple[ProcessSample, ...] | None:
        """Compute (and graphics) processes on a device; ``None`` when the driver won't say."""
        found: dict[int, ProcessSample] = {}
        kinds = [("compute", "nvmlDeviceGetComputeRunningProcesses")]
        if self.include_graphics:
            kinds.append(("graphics", "nvmlDeviceGetGraphicsRunningProcesses"))
        answered = False
        for kind, base in kinds:
            infos = self._process_list(base)(h)
            if infos is None:
                continue
            answered = True
            for info in infos:
                pid = int(info.pid)
                if pid in found:
                    continue
                used = getattr(info, "usedGpuMemory", None)
                gi = getattr(info, "gpuInstanceId", _NO_INSTANCE)
                dev = by_gi.get(gi, uuid) if gi is not None else uuid
                found[pid] = ProcessSample(pid=pid, used_memory_mib=int(used // MIB) if used is not None else None, device_uuid=dev, kind=kind)
        return tuple(found[p] for p in sorted(found)) if answered else None

    def _process_list(self, base: str):
        """The newest process-list function the binding and driver both have: ``_v3``, ``_v2``, then plain."""

        def query(h: Any) -> list | None:
            for suffix in ("_v3", "_v2", ""):
                try:
                    return list(self._call(base + suffix, h))
                except _Missing:
                    continue
                except self._nvml.NVMLError:
                    return self._query(base + suffix, h)  # logs once, returns None
            return None

        return query


# ---------------------------------------------------------------------- helpers
def memory_repairs(query: Any, h: Any, enabled: int = 1) -> dict[str, bool]:
    """Retired pages pending (older GPUs) and row remapping pending or failed (Ampere on);
    ``query(fn_name, handle)`` answers None where the driver does not say."""
    out = {"retired_pages_pending": False, "row_remap_pending": False, "row_remap_failed": False}
    pending = query("nvmlDeviceGetRetiredPagesPendingStatus", h)
    if pending is not None:
        out["retired_pages_pending"] = int(pending) == enabled
    rows = query("nvmlDeviceGetRemappedRows", h)
    if rows is not None and len(rows) >= 4:
        out["row_remap_pending"], out["row_remap_failed"] = bool(rows[2]), bool(rows[3])
    return out


def throttle_reasons(query: Any, h: Any) -> tuple[str, ...]:
    """The clock throttle reasons that say something is wrong (heat, power), by name."""
    reasons = query("nvmlDeviceGetCurrentClocksEventReasons", h)
    if reasons is None:
        reasons = query("nvmlDeviceGetCurrentClocksThrottleReasons", h)
    if reasons is None:
        return ()
    return tuple(name for name, bit in THROTTLE_BITS if int(reasons) & bit)

def _init_message(nv: ModuleType, e: Exception) -> str:
    fallback = "Use the 'simulated' or 'static' device backend on machines without NVIDIA GPUs."
    if isinstance(e, getattr(nv, "NVMLError_LibraryNotFound", ())):
        return f"No NVIDIA driver found on this machine (the NVML library libnvidia-ml.so.1 could not be loaded: {e}). {fallback}"
    if isinstance(e, getattr(nv, "NVMLError_DriverNotLoaded", ())):
        return f"No NVIDIA driver found on this machine (the NVIDIA kernel driver is not loaded: {e}). {fallback}"
    if isinstance(e, getattr(nv, "NVMLError_NoPermission", ())):
        return f"NVML refused access to the GPUs ({e}): check the permissions on /dev/nvidia*. {fallback}"
    if isinstance(e, getattr(nv, "NVMLError_LibRmVersionMismatch", ())):
        return f"The NVIDIA driver and its NVML library differ in version ({e}); reboot or reload the driver. {fallback}"
    return f"NVML could not start ({type(e).__name__}: {e}). {fallback}"


def _text(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, bytes):
        return v.decode("utf-8", "replace").strip()
    return str(v).strip()


def _model_name(name: str) -> str:
    """'NVIDIA A100-SXM4-80GB' → 'A100-SXM4-80GB' (policies match model globs such as 'A100*')."""
    for prefix in ("NVIDIA ", "Tesla "):
        if name.startswith(prefix):
            name = name[len(prefix):]
    return name.strip() or "unknown GPU"


def _mig_profile(name: str, attrs: Any, memory_mib: int) -> str:
    """The MIG profile of an instance: from its name ('… MIG 3g.40gb'), else from slices and memory."""
    m = _MIG_NAME_RE.search(name or "")
    if m:
        return m.group(1).lower()
    slices = int(getattr(attrs, "gpuInstanceSliceCount", 0) or 0)
    if slices and memory_mib:
        return f"{slices}g.{-(-memory_mib // 1024)}gb"  # profile names round memory up to whole GB
    return "unknown"


def _pct(util: Any) -> float | None:
    if util is None:
        return None
    gpu = getattr(util, "gpu", None)
    return float(gpu) if gpu is not None else None


def read_mig_minors(path: str = MIG_MINORS) -> dict[str, int]:
    """``{"gpu0/gi1/access": 30, "gpu0/gi1/ci0/access": 31, ...}`` from the driver's list of MIG
    capabilities; empty where there is none (no driver, no MIG). Blocks (a /proc read)."""
    out: dict[str, int] = {}
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            for line in f:
                name, _, minor = line.strip().rpartition(" ")
                if name and minor.isdigit():
                    out[name] = int(minor)
    except OSError:
        pass
    return out
