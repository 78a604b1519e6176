"""The device-backend interface: what every source of GPU facts provides.

A backend answers two questions:

* :meth:`DeviceBackend.inventory` — which GPUs (and MIG instances) exist, as
  :class:`~jupyter_gpulease.core.model.GPU` objects the scheduler can place leases on;
* :meth:`DeviceBackend.sample` — how they are used right now: utilization, memory and the
  processes on each device, as :class:`DeviceSample` objects keyed by device UUID.

Both calls may block (NVML talks to the driver): callers on an event loop run them in an
executor, e.g. ``await loop.run_in_executor(None, backend.sample)``.
"""

from __future__ import annotations

import abc
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from ..core.health import Action, xid_action
from ..core.model import GPU

log = logging.getLogger(__name__)

Clock = Callable[[], float]


class DeviceUnavailable(Exception):
    """The backend cannot reach any devices (no driver, no library, no permission).

    ``str(err)`` is a message a person can act on; no traceback is needed to understand it.
    """


@dataclass(frozen=True)
class ProcessSample:
    """One process that holds memory on a device."""

    pid: int
    used_memory_mib: int | None  # None: the driver does not say (e.g. Windows WDDM, some MIG setups)
    device_uuid: str  # the GPU's UUID, or the MIG instance's UUID where known
    kind: str = "compute"  # "compute" or "graphics"
    # share of the device's streaming multiprocessors this process kept busy over the driver's
    # last sample period, 0–100; None: the driver does not say (e.g. MIG, old drivers)
    sm_util_pct: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"pid": self.pid, "used_memory_mib": self.used_memory_mib, "device_uuid": self.device_uuid, "kind": self.kind,
                "sm_util_pct": self.sm_util_pct}


@dataclass(frozen=True)
class DeviceHealth:
    """What the driver says is wrong with a device; the default is a healthy device.

    ``xid`` is the last critical XID error code the driver reported for the device (e.g. 79:
    fallen off the bus, 48: double-bit ECC error) and ``xid_count`` how many were seen since the
    backend started, ``xids`` the count per code ((code, count) pairs); ``ecc_uncorrected`` counts
    uncorrectable memory errors since the last driver reload (None: ECC is off or not reported);
    ``lost``: the driver answers "GPU is lost"; ``retired_pages_pending``, ``row_remap_pending``:
    a memory repair that takes effect at the next reset; ``row_remap_failed``: the GPU ran out of
    spare rows; ``throttle``: the clock throttle reasons that say something is wrong (names of
    :data:`jupyter_gpulease.core.health.THROTTLE_WORDS`); ``resets``: the resets (or driver
    reloads) the backend saw, ``xids_at_reset`` the per-code counts when it saw the last one (the
    counts go on across resets; what came after is :meth:`xids_since_reset`). What each means for
    the pool: :func:`jupyter_gpulease.core.health.assess`.
    """

    lost: bool = False
    xid: int | None = None
    xid_count: int = 0
    ecc_uncorrected: int | None = None
    xids: tuple[tuple[int, int], ...] = ()
    retired_pages_pending: bool = False
    row_remap_pending: bool = False
    row_remap_failed: bool = False
    throttle: tuple[str, ...] = ()
    resets: int = 0
    xids_at_reset: tuple[tuple[int, int], ...] = ()

    def xid_counts(self) -> dict[int, int]:
        """Critical XIDs seen, per code (the last code alone where the backend keeps no more)."""
        if self.xids:
            return dict(self.xids)
        return {int(self.xid): int(self.xid_count)} if self.xid is not None and self.xid_count else {}

    def xids_since_reset(self) -> dict[int, int]:
        """Critical XIDs seen since the last reset the backend saw, per code (all of them if none)."""
        before = dict(self.xids_at_reset)
        return {c: n - before.get(c, 0) for c, n in self.xid_counts().items() if n > before.get(c, 0)}

    @property
    def ok(self) -> bool:
        """No hardware problem now: an application's own XID (13, 31, …) does not count, nor do
        heat and throttling, nor an XID a reset since repaired."""
        hw_xid = any(xid_action(c) not in (Action.APPLICATION,) for c in self.xids_since_reset())
        return not (self.lost or hw_xid or self.ecc_uncorrected or self.retired_pages_pending or self.row_remap_pending or self.row_remap_failed)

    def message(self) -> str:
        """Plain words for a person; "" when healthy."""
        parts = []
        if self.lost:
            parts.append("the driver reports the GPU as lost (it needs a reset or a reboot)")
        recent = self.xids_since_reset()
        if recent:
            last = self.xid if self.xid in recent else max(recent)
            parts.append(f"{sum(recent.values())} critical XID error(s){' since the last reset' if self.resets else ''}, the last XID {last}")
        if self.ecc_uncorrected:
            parts.append(f"{self.ecc_uncorrected} uncorrectable ECC memory error(s)")
        if self.row_remap_failed:
            parts.append("a memory row remap failed")
        elif self.row_remap_pending or self.retired_pages_pending:
            parts.append("a memory repair is pending until the next reset")
        return "; ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "lost": self.lost, "xid": self.xid, "xid_count": self.xid_count,
                "ecc_uncorrected": self.ecc_uncorrected, "xids": {str(c): n for c, n in self.xids},
                "retired_pages_pending": self.retired_pages_pending, "row_remap_pending": self.row_remap_pending,
                "row_remap_failed": self.row_remap_failed, "throttle": list(self.throttle), "resets": self.resets,
                "xids_at_reset": {str(c): n for c, n in self.xids_at_reset}, "message": self.message()}

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> DeviceHealth:
        d = d or {}
        xids = d.get("xids") if isinstance(d.get("xids"), dict) else {}
        pairs = tuple(sorted((int(c), int(n)) for c, n in xids.items() if str(c).isdigit() and _count(n)))
        at_reset = d.get("xids_at_reset") if isinstance(d.get("xids_at_reset"), dict) else {}
        at_reset_pairs = tuple(sorted((int(c), int(n)) for c, n in at_reset.items() if str(c).isdigit() and _count(n)))
        return cls(lost=d.get("lost") is True, xid=int(d["xid"]) if _count(d.get("xid")) else None,
                   xid_count=int(d["xid_count"]) if _count(d.get("xid_count")) else 0,
                   ecc_uncorrected=int(d["ecc_uncorrected"]) if _count(d.get("ecc_uncorrected")) else None,
                   xids=pairs, retired_pages_pending=d.get("retired_pages_pending") is True,
                   row_remap_pending=d.get("row_remap_pending") is True, row_remap_failed=d.get("row_remap_failed") is True,
                   throttle=tuple(str(t) for t in d.get("throttle") or () if isinstance(t, str)),
                   resets=int(d["resets"]) if _count(d.get("resets")) else 0, xids_at_reset=at_reset_pairs)


def _count(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v and v >= 0 and v != float("inf")


HEALTHY = DeviceHealth()


@dataclass(frozen=True)
class DeviceSample:
    """How one GPU or MIG instance is used at ``timestamp``.

    Every figure may be ``None``: that means "not available" (unsupported by the device,
    no permission, no telemetry), never zero. A whole GPU's ``processes`` list every
    process on it, including those inside its MIG instances (their ``device_uuid`` names
    the instance); a MIG instance's sample lists only its own.
    """

    uuid: str
    timestamp: float
    utilization_pct: float | None = None  # compute utilization over the driver's last sample period, 0–100
    memory_used_mib: int | None = None
    memory_total_mib: int | None = None
    processes: tuple[ProcessSample, ...] = ()
    parent_uuid: str = ""  # for a MIG instance: the UUID of its GPU
    temperature_c: float | None = None  # GPU core temperature, degrees Celsius
    # the card's own slowdown threshold (NVML_TEMPERATURE_THRESHOLD_SLOWDOWN), degrees Celsius:
    # at or above it the driver slows the clocks; None: not reported
    temperature_slowdown_c: float | None = None
    power_w: float | None = None  # power draw, watts (a MIG instance reports its GPU's, or None)
    power_limit_w: float | None = None  # the power limit the driver enforces, watts
    health: DeviceHealth = HEALTHY

    @property
    def is_mig(self) -> bool:
        return bool(self.parent_uuid)

    def to_dict(self) -> dict[str, Any]:
        return {
            "uuid": self.uuid,
            "timestamp": self.timestamp,
            "utilization_pct": self.utilization_pct,
            "memory_used_mib": self.memory_used_mib,
            "memory_total_mib": self.memory_total_mib,
            "processes": [p.to_dict() for p in self.processes],
            "parent_uuid": self.parent_uuid,
            "temperature_c": self.temperature_c,
            "temperature_slowdown_c": self.temperature_slowdown_c,
            "power_w": self.power_w,
            "power_limit_w": self.power_limit_w,
            "health": self.health.to_dict(),
        }


def processes_by_pid(samples: dict[str, DeviceSample] | Iterable[DeviceSample]) -> dict[int, list[ProcessSample]]:
    """Every process seen in ``samples``, by PID, each (pid, device) pair once.

    A process inside a MIG instance appears in both the GPU's and the instance's sample;
    this folds them so that per-kernel accounting counts its memory once.
    """
    values = samples.values() if isinstance(samples, dict) else samples
    seen: dict[tuple[int, str], ProcessSample] = {}
    for s in values:
        for p in s.processes:
            key = (p.pid, p.device_uuid)
            if key not in seen or (seen[key].used_memory_mib is None and p.used_memory_mib is not None):
                seen[key] = p
    out: dict[int, list[ProcessSample]] = {}
    for p in seen.values():
        out.setdefault(p.pid, []).append(p)
    return out


class DeviceBackend(abc.ABC):
    """A source of GPU inventory and usage samples.

    Implementations must be safe to call from a worker thread; they may block.
    """

    name: str = ""

    @abc.abstractmethod
    def inventory(self) -> list[GPU]:
        """The GPUs this backend knows, MIG instances included. May raise :class:`DeviceUnavailable`."""

    @abc.abstractmethod
    def sample(self) -> dict[str, DeviceSample]:
        """Current usage by device UUID (GPUs, and MIG instances where the backend sees them).

        Blocking: run it in an executor when called from an event loop.
        """

    def start(self) -> None:  # noqa: B027 - optional hook
        """Called once on the host's running event loop (the broker's): a backend that follows a
        source (the Kubernetes node watch) starts its task there."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release driver handles and stop what :meth:`start` started. Calling it twice is harmless."""

    def __enter__(self) -> DeviceBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}>"


def check_config_keys(backend: str, config: dict[str, Any], allowed: Iterable[str], *, passed_through: Iterable[str] = ()) -> None:
    """ValueError naming the keys of a backend's ``config`` that it does not know, and the
    ``allowed`` ones (in the order given). ``passed_through``: keys it accepts without listing
    them, those another backend reads when ``auto`` hands the same config on."""
    allowed = tuple(allowed)
    unknown = sorted(set(config) - set(allowed) - set(passed_through))
    if unknown:
        raise ValueError(f"{backend} device backend: unknown config key(s) {', '.join(map(repr, unknown))}; "
                         f"allowed: {', '.join(map(repr, allowed))}")


BACKEND_NAMES = ("simulated", "static", "nvml", "auto", "kubernetes", "slurm")


def get_backend(name: str, config: dict[str, Any] | None = None, *, clock: Clock | None = None) -> DeviceBackend:
    """Build the backend called ``name`` from its ``config`` dict.

    ``auto`` uses NVML when it starts and finds at least one GPU, and otherwise the
    simulated pool (logging why). Raises ``ValueError`` for an unknown name or a bad
    config; ``nvml`` raises :class:`DeviceUnavailable` on first use when there is no driver.
    """
    config = dict(config or {})
    key = (name or "").strip().lower()
    if key == "simulated":
        from .simulated import SimulatedBackend

        return SimulatedBackend(config, clock=clock)
    if key == "static":
        from .static import StaticBackend

        return StaticBackend(config, clock=clock)
    if key == "nvml":
        from .nvml import NvmlBackend

        return NvmlBackend(config, clock=clock)
    if key == "auto":
        return _auto_backend(config, clock)
    if key == "kubernetes":
        from .kubernetes import KubernetesBackend

        return KubernetesBackend(config, clock=clock)
    if key == "slurm":
        from .slurm import SlurmBackend

        return SlurmBackend(config, clock=clock)
    raise ValueError(f"unknown device backend {name!r}: choose one of {', '.join(BACKEND_NAMES)}")


def _auto_backend(config: dict[str, Any], clock: Clock | None) -> DeviceBackend:
    from .nvml import NvmlBackend
    from .simulated import SimulatedBackend

    nvml_backend = NvmlBackend(config, clock=clock)
    try:
        gpus = nvml_backend.inventory()
    except DeviceUnavailable as e:
        log.info("Device backend 'auto': NVML is not usable (%s); using the simulated GPU pool", e)
        nvml_backend.close()
        return SimulatedBackend(config, clock=clock)
    if not gpus:
        log.info("Device backend 'auto': NVML started but found no GPUs; using the simulated GPU pool")
        nvml_backend.close()
        return SimulatedBackend(config, clock=clock)
    log.info("Device backend 'auto': using NVML, %d GPU(s) found", len(gpus))
    return nvml_backend
