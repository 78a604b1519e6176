"""A fake ``pynvml`` module for tests: simulated machines, the REAL error classes.

The error classes, constants and the library-mismatch error are taken from the installed
nvidia-ml-py, so the code under test catches exactly what it would catch on a GPU machine.
Every function raises ``NVMLError_Uninitialized`` before ``nvmlInit``, as NVML does.

Machines: :func:`two_gpu_machine` (an A100 in MIG mode with two 3g.40gb instances and a
whole L4, with knobs for unsupported utilization and old drivers) and :func:`no_driver`.
Figures a test can move on a :class:`FakeGPU`: temperature, power draw and limit, the
uncorrected ECC count, per-process SM utilization, and critical XID events
(:meth:`FakeNVML.raise_xid`), each answering NotSupported when set to ``None``. The machine's
driver version and the CUDA version it supports are :class:`FakeNVML` arguments.
"""

from __future__ import annotations

import types
from dataclasses import dataclass, field
from types import SimpleNamespace

import pynvml as real

MIB = 1024 * 1024
NO_INSTANCE = 0xFFFFFFFF


@dataclass
class FakeProcess:
    pid: int
    used_mib: int | None
    gpu_instance_id: int = NO_INSTANCE
    graphics: bool = False
    sm_util: int | None = None  # None: no utilization sample for this process in the period asked about


@dataclass
class FakeMig:
    uuid: str
    profile: str
    memory_mib: int
    gpu_instance_id: int
    slices: int
    used_mib: int = 0
    compute_instance_id: int = 0


@dataclass
class FakeGPU:
    uuid: str
    name: str
    memory_mib: int
    used_mib: int = 0
    utilization: int | None = 0  # None: NotSupported
    processes: list[FakeProcess] = field(default_factory=list)
    mig: list[FakeMig] = field(default_factory=list)
    mig_slots: int = 0  # max MIG device count (empty slots answer NotFound)
    lost: bool = False
    temperature: int | None = 40  # °C; None: NotSupported
    power_mw: int | None = 60_000  # None: NotSupported
    power_limit_mw: int | None = 300_000
    ecc_uncorrected: int | None = 0  # None: ECC off / NotSupported
    process_utilization: bool = True  # False: nvmlDeviceGetProcessUtilization answers NotSupported
    events: bool = True  # False: XID events cannot be registered (NotSupported)
    slowdown_c: int | None = 90  # the card's slowdown temperature threshold; None: NotSupported
    retired_pages_pending: bool | None = False  # None: NotSupported (no page retirement on this GPU)
    remapped_rows: tuple[int, int, int, int] | None = (0, 0, 0, 0)  # (correctable, uncorrectable, pending, failed); None: NotSupported
    throttle_reasons: int = 0  # NVML's clocks event reasons bitmask


class FakeNVML(types.ModuleType):
    """Stands in for the ``pynvml`` module. ``calls`` records every function called, in order."""

    def __init__(self, gpus: list[FakeGPU], *, init_error: type[Exception] | None = None, driver_has_v3: bool = True,
                 binding_has_v3: bool = True, binding_has_v2: bool = True, binding_has_memory_v2: bool = True, mig_process_lists: bool = True,
                 driver_version: str | type[Exception] = "550.54.15", cuda_driver_version: int | type[Exception] = 12040,
                 cuda_driver_version_v2: bool = True):
        super().__init__("pynvml")
        self.gpus = gpus
        # the driver's version and the CUDA version it supports (NVML's integer, 12040 = 12.4); an
        # NVML error class instead makes the call raise it. cuda_driver_version_v2=False: the
        # driver's library has no _v2 of it (FunctionNotFound), as older drivers
        self.driver_version = driver_version
        self.cuda_driver_version = cuda_driver_version
        self._cuda_v2 = cuda_driver_version_v2
        self.calls: list[str] = []
        self.init_calls = 0
        self.shutdown_calls = 0
        self._init_error = init_error
        self._inited = False
        self._driver_has_v3 = driver_has_v3
        self._mig_process_lists = mig_process_lists
        # the real error classes and the constants our code reads
        for name in dir(real):
            if name.startswith(("NVMLError", "NVML_ERROR_", "NVML_DEVICE_MIG")):
                setattr(self, name, getattr(real, name))
        self.NVMLLibraryMismatchError = real.NVMLLibraryMismatchError
        for name in ("NVML_TEMPERATURE_GPU", "NVML_MEMORY_ERROR_TYPE_UNCORRECTED", "NVML_VOLATILE_ECC", "nvmlEventTypeXidCriticalError",
                     "NVML_TEMPERATURE_THRESHOLD_SLOWDOWN", "NVML_FEATURE_ENABLED", "NVML_FEATURE_DISABLED"):
            setattr(self, name, getattr(real, name))
        self._event_sets: list[dict] = []
        self.process_utilization_timestamps: list[tuple[str, int]] = []  # (device UUID, lastSeenTimeStamp) of every call
        if binding_has_memory_v2:
            self.nvmlMemory_v2 = real.nvmlMemory_v2
        if binding_has_v3:
            self.nvmlDeviceGetComputeRunningProcesses_v3 = self._compute_v3
            self.nvmlDeviceGetGraphicsRunningProcesses_v3 = self._graphics_v3
        if binding_has_v2:
            self.nvmlDeviceGetComputeRunningProcesses_v2 = self._compute_v2
            self.nvmlDeviceGetGraphicsRunningProcesses_v2 = self._graphics_v2

    # ------------------------------------------------------------------ plumbing
    def _enter(self, name: str) -> None:
        self.calls.append(name)
        if not self._inited:
            raise real.NVMLError_Uninitialized()

    def _device(self, h):
        if isinstance(h, FakeGPU) and h.lost:
            raise real.NVMLError_GpuIsLost()
        return h

    def nvmlInit(self):
        self.calls.append("nvmlInit")
        self.init_calls += 1
        if self._init_error is not None:
            raise self._init_error()
        self._inited = True

    def nvmlShutdown(self):
        self._enter("nvmlShutdown")
        self.shutdown_calls += 1
        self._inited = False

    def nvmlSystemGetDriverVersion(self):
        self._enter("nvmlSystemGetDriverVersion")
        return self._answer(self.driver_version)

    def nvmlSystemGetCudaDriverVersion(self):
        self._enter("nvmlSystemGetCudaDriverVersion")
        return self._answer(self.cuda_driver_version)

    def nvmlSystemGetCudaDriverVersion_v2(self):
        self._enter("nvmlSystemGetCudaDriverVersion_v2")
        if not self._cuda_v2:
            raise real.NVMLError_FunctionNotFound()
        return self._answer(self.cuda_driver_version)

    @staticmethod
    def _answer(value):
        if isinstance(value, type) and issubclass(value, Exception):
            raise value()
        return value

    # ------------------------------------------------------------------ devices
    def nvmlDeviceGetCount(self):
        self._enter("nvmlDeviceGetCount")
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, i):
        self._enter("nvmlDeviceGetHandleByIndex")
        if not 0 <= i < len(self.gpus):
            raise real.NVMLError_InvalidArgument()
        return self.gpus[i]

    def nvmlDeviceGetIndex(self, h):
        self._enter("nvmlDeviceGetIndex")
        return self.gpus.index(h)

    def nvmlDeviceGetUUID(self, h):
        self._enter("nvmlDeviceGetUUID")
        return h.uuid

    def nvmlDeviceGetName(self, h):
        self._enter("nvmlDeviceGetName")
        if isinstance(h, FakeMig):
            parent = next(g for g in self.gpus if h in g.mig)
            return f"{parent.name} MIG {h.profile}"
        return h.name

    def nvmlDeviceGetMemoryInfo(self, h, version=None):
        self._enter("nvmlDeviceGetMemoryInfo" + ("_v2" if version else ""))
        self._device(h)
        if version is not None and version != real.nvmlMemory_v2:
            raise real.NVMLError_ArgumentVersionMismatch()
        total, used = h.memory_mib * MIB, h.used_mib * MIB
        if version:
            return SimpleNamespace(version=version, total=total, reserved=0, free=total - used, used=used)
        return SimpleNamespace(total=total, free=total - used, used=used)

    def nvmlDeviceGetUtilizationRates(self, h):
        self._enter("nvmlDeviceGetUtilizationRates")
        self._device(h)
        if isinstance(h, FakeMig) or h.utilization is None:
            raise real.NVMLError_NotSupported()
        return SimpleNamespace(gpu=h.utilization, memory=0)

    def nvmlDeviceGetTemperature(self, h, sensor):
        self._enter("nvmlDeviceGetTemperature")
        self._device(h)
        if isinstance(h, FakeMig) or h.temperature is None or sensor != real.NVML_TEMPERATURE_GPU:
            raise real.NVMLError_NotSupported()
        return h.temperature

    def nvmlDeviceGetTemperatureThreshold(self, h, threshold):
        self._enter("nvmlDeviceGetTemperatureThreshold")
        self._device(h)
        if isinstance(h, FakeMig) or h.slowdown_c is None or threshold != real.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN:
            raise real.NVMLError_NotSupported()
        return h.slowdown_c

    def nvmlDeviceGetRetiredPagesPendingStatus(self, h):
        self._enter("nvmlDeviceGetRetiredPagesPendingStatus")
        self._device(h)
        if isinstance(h, FakeMig) or h.retired_pages_pending is None:
            raise real.NVMLError_NotSupported()
        return real.NVML_FEATURE_ENABLED if h.retired_pages_pending else real.NVML_FEATURE_DISABLED

    def nvmlDeviceGetRemappedRows(self, h):
        self._enter("nvmlDeviceGetRemappedRows")
        self._device(h)
        if isinstance(h, FakeMig) or h.remapped_rows is None:
            raise real.NVMLError_NotSupported()
        return tuple(h.remapped_rows)

    def nvmlDeviceGetCurrentClocksEventReasons(self, h):
        self._enter("nvmlDeviceGetCurrentClocksEventReasons")
        self._device(h)
        if isinstance(h, FakeMig):
            raise real.NVMLError_NotSupported()
        return h.throttle_reasons

    def nvmlDeviceGetPowerUsage(self, h):
        self._enter("nvmlDeviceGetPowerUsage")
        self._device(h)
        if isinstance(h, FakeMig) or h.power_mw is None:
            raise real.NVMLError_NotSupported()
        return h.power_mw

    def nvmlDeviceGetEnforcedPowerLimit(self, h):
        self._enter("nvmlDeviceGetEnforcedPowerLimit")
        self._device(h)
        if isinstance(h, FakeMig) or h.power_limit_mw is None:
            raise real.NVMLError_NotSupported()
        return h.power_limit_mw

    def nvmlDeviceGetTotalEccErrors(self, h, error_type, counter_type):
        self._enter("nvmlDeviceGetTotalEccErrors")
        self._device(h)
        if isinstance(h, FakeMig) or h.ecc_uncorrected is None:
            raise real.NVMLError_NotSupported()
        if (error_type, counter_type) != (real.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, real.NVML_VOLATILE_ECC):
            raise real.NVMLError_InvalidArgument()
        return h.ecc_uncorrected

    def nvmlDeviceGetProcessUtilization(self, h, last_seen_timestamp):
        self._enter("nvmlDeviceGetProcessUtilization")
        self._device(h)
        self.process_utilization_timestamps.append((h.uuid, last_seen_timestamp))
        if isinstance(h, FakeMig) or not h.process_utilization:
            raise real.NVMLError_NotSupported()
        samples = [SimpleNamespace(pid=p.pid, timeStamp=last_seen_timestamp + 1000, smUtil=p.sm_util, memUtil=0, encUtil=0, decUtil=0)
                   for p in h.processes if p.sm_util is not None]
        if not samples:  # what the driver answers when no process ran since the time stamp
            raise real.NVMLError_NotFound()
        return samples

    # ------------------------------------------------------------------ events (XID)
    def nvmlEventSetCreate(self):
        self._enter("nvmlEventSetCreate")
        es = {"devices": set(), "pending": []}
        self._event_sets.append(es)
        return es

    def nvmlDeviceRegisterEvents(self, h, event_types, event_set):
        self._enter("nvmlDeviceRegisterEvents")
        self._device(h)
        if not h.events:
            raise real.NVMLError_NotSupported()
        if event_types & real.nvmlEventTypeXidCriticalError:
            event_set["devices"].add(id(h))

    def nvmlEventSetWait_v2(self, event_set, timeout_ms):
        self._enter("nvmlEventSetWait_v2")
        if not event_set["pending"]:
            raise real.NVMLError_Timeout()
        return event_set["pending"].pop(0)

    def nvmlEventSetFree(self, event_set):
        self._enter("nvmlEventSetFree")
        self._event_sets.remove(event_set)

    def raise_xid(self, gpu: FakeGPU, xid: int) -> None:
        """The driver reports critical XID error ``xid`` on ``gpu`` to every event set registered for it."""
        for es in self._event_sets:
            if id(gpu) in es["devices"]:
                es["pending"].append(SimpleNamespace(device=gpu, eventType=real.nvmlEventTypeXidCriticalError, eventData=xid,
                                                     gpuInstanceId=NO_INSTANCE, computeInstanceId=NO_INSTANCE))

    # ------------------------------------------------------------------ processes
    def _procs(self, h, graphics: bool):
        self._device(h)
        if isinstance(h, FakeMig):
            if not self._mig_process_lists:
                raise real.NVMLError_NotSupported()
            parent = next(g for g in self.gpus if h in g.mig)
            plist = [p for p in parent.processes if p.gpu_instance_id == h.gpu_instance_id]
        else:
            plist = h.processes
        return [SimpleNamespace(pid=p.pid, usedGpuMemory=None if p.used_mib is None else p.used_mib * MIB,
                                gpuInstanceId=p.gpu_instance_id, computeInstanceId=0 if p.gpu_instance_id != NO_INSTANCE else NO_INSTANCE)
                for p in plist if p.graphics == graphics]

    def _compute_v3(self, h):
        self._enter("nvmlDeviceGetComputeRunningProcesses_v3")
        if not self._driver_has_v3:  # the binding has it, the driver's library does not
            raise real.NVMLError_FunctionNotFound()
        return self._procs(h, False)

    def _graphics_v3(self, h):
        self._enter("nvmlDeviceGetGraphicsRunningProcesses_v3")
        if not self._driver_has_v3:
            raise real.NVMLError_FunctionNotFound()
        return self._procs(h, True)

    def _compute_v2(self, h):
        self._enter("nvmlDeviceGetComputeRunningProcesses_v2")
        return self._procs(h, False)

    def _graphics_v2(self, h):
        self._enter("nvmlDeviceGetGraphicsRunningProcesses_v2")
        return self._procs(h, True)

    def nvmlDeviceGetComputeRunningProcesses(self, h):
        self._enter("nvmlDeviceGetComputeRunningProcesses")
        return self._procs(h, False)

    def nvmlDeviceGetGraphicsRunningProcesses(self, h):
        self._enter("nvmlDeviceGetGraphicsRunningProcesses")
        return self._procs(h, True)

    # ------------------------------------------------------------------ MIG
    def nvmlDeviceGetMigMode(self, h):
        self._enter("nvmlDeviceGetMigMode")
        if not h.mig_slots:
            raise real.NVMLError_NotSupported()  # not a MIG-capable GPU
        mode = real.NVML_DEVICE_MIG_ENABLE if h.mig else real.NVML_DEVICE_MIG_DISABLE
        return [mode, mode]

    def nvmlDeviceGetMaxMigDeviceCount(self, h):
        self._enter("nvmlDeviceGetMaxMigDeviceCount")
        return h.mig_slots

    def nvmlDeviceGetMigDeviceHandleByIndex(self, h, k):
        self._enter("nvmlDeviceGetMigDeviceHandleByIndex")
        if k >= h.mig_slots:
            raise real.NVMLError_InvalidArgument()
        if k >= len(h.mig):
            raise real.NVMLError_NotFound()
        return h.mig[k]

    def nvmlDeviceGetGpuInstanceId(self, mh):
        self._enter("nvmlDeviceGetGpuInstanceId")
        return mh.gpu_instance_id

    def nvmlDeviceGetComputeInstanceId(self, mh):
        self._enter("nvmlDeviceGetComputeInstanceId")
        if not isinstance(mh, FakeMig):
            raise real.NVMLError_InvalidArgument()
        return mh.compute_instance_id

    def nvmlDeviceGetMinorNumber(self, h):
        self._enter("nvmlDeviceGetMinorNumber")
        if not isinstance(h, FakeGPU):
            raise real.NVMLError_InvalidArgument()
        return self.gpus.index(h)

    def nvmlDeviceGetAttributes(self, mh):
        self._enter("nvmlDeviceGetAttributes")
        if not isinstance(mh, FakeMig):
            raise real.NVMLError_NotSupported()
        return SimpleNamespace(gpuInstanceSliceCount=mh.slices, computeInstanceSliceCount=mh.slices, memorySizeMB=mh.memory_mib,
                               multiprocessorCount=14 * mh.slices)


A100_UUID = "GPU-a1a1a1a1-0000-1111-2222-333344445555"
L4_UUID = "GPU-14141414-0000-1111-2222-333344445555"
MIG_A = "MIG-aaaaaaaa-0000-1111-2222-333344445555"
MIG_B = "MIG-bbbbbbbb-0000-1111-2222-333344445555"


def two_gpu_machine(*, l4_utilization: int | None = 37, **kwargs) -> FakeNVML:
    """GPU 0: A100-SXM4-80GB in MIG mode (two 3g.40gb instances, one busy); GPU 1: a whole L4 running two processes.

    ``l4_utilization=None`` makes the L4's utilization NotSupported. Other keywords go to
    :class:`FakeNVML` (``driver_has_v3=False``, ``binding_has_v3=False``, …).
    """
    a100 = FakeGPU(
        uuid=A100_UUID, name="NVIDIA A100-SXM4-80GB", memory_mib=81920, used_mib=12000, utilization=None,
        mig=[FakeMig(MIG_A, "3g.40gb", 40192, gpu_instance_id=1, slices=3, used_mib=12000),
             FakeMig(MIG_B, "3g.40gb", 40192, gpu_instance_id=2, slices=3)],
        mig_slots=7,
        processes=[FakeProcess(pid=5001, used_mib=12000, gpu_instance_id=1)],
    )
    l4 = FakeGPU(
        uuid=L4_UUID, name="NVIDIA L4", memory_mib=23034, used_mib=6144, utilization=l4_utilization,
        processes=[FakeProcess(pid=6001, used_mib=4096, sm_util=30), FakeProcess(pid=6002, used_mib=2048), FakeProcess(pid=700, used_mib=None, graphics=True)],
        temperature=61, power_mw=41_500, power_limit_mw=72_000,
    )
    return FakeNVML([a100, l4], **kwargs)


def no_driver(kind: str = "library") -> FakeNVML:
    """A machine without a driver: ``nvmlInit`` raises the real LibraryNotFound (or DriverNotLoaded)."""
    err = {"library": real.NVMLError_LibraryNotFound, "driver": real.NVMLError_DriverNotLoaded,
           "permission": real.NVMLError_NoPermission}[kind]
    return FakeNVML([], init_error=err)
