"""GPULeaseSystemdSpawner: each server a systemd unit whose device access follows its lease.

`jupyterhub-systemdspawner`_ (what The Littlest JupyterHub runs) starts every single-user server
as a transient systemd service (``systemd-run --unit jupyter-<user>-singleuser``). systemd's
device controller is the lock: the unit starts with ``DevicePolicy=closed`` (only the standard
pseudo devices: ``/dev/null``, ``/dev/zero``, ``/dev/full``, ``/dev/random``, ``/dev/urandom``,
``/dev/tty``, ``/dev/ptmx`` and terminals) and one ``DeviceAllow=`` per device node of its
leases (see :mod:`.devaccess`): the leased ``/dev/nvidiaN``, a MIG instance's
``/dev/nvidia-caps/nvidia-capN``, and ``/dev/nvidiactl``, ``/dev/nvidia-modeset``,
``/dev/nvidia-uvm``, ``/dev/nvidia-uvm-tools`` that every CUDA process opens. A server without a
lease gets no GPU node at all, not even the control nodes. Every process of the unit (kernels,
terminals) is in its cgroup. systemd applies it on both cgroup versions (v1: the ``devices``
controller; v2: a BPF device program).

Which leases a server holds, and when that changes (granted, resumed, ended, revoked, reclaimed,
preempted, a lease the server took itself), is the hub's one device guard
(:class:`~.cgroups.DeviceGuard`, the same that follows local-process servers); this module is
its backend for SystemdSpawner's units (:class:`ServiceUnits`). A change is one call::

    systemctl set-property --runtime jupyter-alice-singleuser DevicePolicy=closed \\
        DeviceAllow= "DeviceAllow=char-pts rw" "DeviceAllow=/dev/nvidia2 rw" ...

The empty ``DeviceAllow=`` comes first because ``set-property`` *adds* to the unit's list: the
empty assignment resets it, and the assignments after it in the same call are the new list.
``--runtime`` keeps the change out of ``/etc`` (the unit is transient too). Device entries the
admin put in ``unit_extra_properties["DeviceAllow"]`` (``/dev/fuse``, ...) are part of every list.

A device cgroup checks ``open()``: a process that already holds a GPU keeps it after a deny.

.. _jupyterhub-systemdspawner: https://github.com/jupyterhub/systemdspawner
"""

from __future__ import annotations

import copy
import os
import shutil
import subprocess
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from systemdspawner import SystemdSpawner
from systemdspawner import systemd as systemd_units

from . import cgroups, devaccess
from .cgroups import DeviceStart, Mechanism, SystemdScopes
from .devaccess import DeviceNode
from .spawner import GPULeaseSpawner, spawn_error

SYSTEMCTL = "systemctl"
DEVICE_POLICY = "closed"
SYSTEMD_RUN_DIR = "/run/systemd/system"  # exists where systemd is the init system (sd_booted)
EXTRA_ALLOW = SystemdScopes.EXTRA_ALLOW  # terminals, as for the local engine's scopes


def as_list(value: Any) -> list[str]:
    """A ``unit_extra_properties`` value (one string or a list of them) as a list."""
    if value is None or value == "":
        return []
    if isinstance(value, str):
        return [value]
    return [str(v) for v in value]


def device_allow_values(allowed: Iterable[DeviceNode], *, extra: Sequence[str] = ()) -> list[str]:
    """The unit's ``DeviceAllow=`` values: the admin's ``extra`` entries and the terminals first,
    then one per allowed node (:func:`~.devaccess.leases_nodes`: nothing without a lease)."""
    return list(dict.fromkeys([*extra, *EXTRA_ALLOW, *devaccess.systemd_device_allow(allowed)]))


def device_policy(admin: dict[str, Any] | None = None) -> str:
    """``closed``, or ``strict`` where the admin's ``unit_extra_properties`` asks for it (stricter)."""
    return "strict" if str((admin or {}).get("DevicePolicy", "")).strip() == "strict" else DEVICE_POLICY


def unit_device_properties(allow: Sequence[str], *, admin: dict[str, Any] | None = None) -> dict[str, Any]:
    """The ``systemd-run`` properties (SystemdSpawner's ``unit_extra_properties`` form) that lock
    the unit's devices to ``allow``."""
    return {"DevicePolicy": device_policy(admin), "DeviceAllow": list(allow)}


def set_property_argv(unit: str, allow: Sequence[str], *, policy: str = DEVICE_POLICY, systemctl: str = SYSTEMCTL) -> list[str]:
    """The ``systemctl set-property`` command that makes ``allow`` the running unit's whole
    device list: the empty ``DeviceAllow=`` resets the list, the entries after it are the list."""
    return [systemctl, "set-property", "--runtime", unit, f"DevicePolicy={policy}", "DeviceAllow=",
            *(f"DeviceAllow={v}" for v in allow)]


def detect_units(*, systemd_dir: str | None = None, which: Callable[[str], str | None] = shutil.which,
                 euid: int | None = None) -> tuple[bool, str]:
    """Whether this host can lock SystemdSpawner's units to their devices, and in words why (not)."""
    systemd_dir = SYSTEMD_RUN_DIR if systemd_dir is None else systemd_dir
    euid = os.geteuid() if euid is None else euid
    if not os.path.isdir(systemd_dir):
        return False, "systemd is not the init system (SystemdSpawner cannot start units here)"
    if not (which("systemd-run") and which(SYSTEMCTL)):
        return False, "systemd-run/systemctl are not installed"
    if euid != 0:
        return False, f"setting the device properties of the servers' units needs root (the hub runs as uid {euid})"
    return True, "systemd units with DevicePolicy=closed and DeviceAllow= (SystemdSpawner)"


@dataclass(frozen=True)
class UnitDevices:
    """A server's systemd unit as the device guard needs it: its name, the admin's own
    ``DeviceAllow=`` entries (part of every list) and the ``DevicePolicy``."""

    unit: str
    extra: tuple[str, ...] = ()
    policy: str = DEVICE_POLICY


class ServiceUnits:
    """The device guard's backend for SystemdSpawner's units (one transient service per server).

    The unit is made by ``systemd-run`` with the server's command, its device properties given
    at that moment (what :meth:`start` returns); a change is :func:`set_property_argv`. ``run``
    runs a command (``subprocess.run``'s signature; the guard calls the methods off the event
    loop). Each server's unit comes with its start or adopt (:class:`UnitDevices`)."""

    kind = "systemd-unit"

    def __init__(self, run: Callable[..., Any] = subprocess.run):
        self.run = run
        self.units: dict[str, UnitDevices] = {}  # server name (cgroups.cgroup_name) -> its unit

    def allow_values(self, name: str, allowed: Iterable[DeviceNode]) -> list[str]:
        unit = self.units.get(name)
        return device_allow_values(allowed, extra=unit.extra if unit is not None else ())

    def set_property_command(self, name: str, allowed: Iterable[DeviceNode]) -> list[str]:
        unit = self.units[name]
        return set_property_argv(unit.unit, self.allow_values(name, allowed), policy=unit.policy)

    # the guard's backend interface (see cgroups.V1Devices, cgroups.SystemdScopes)
    def start(self, name: str, allowed: list[DeviceNode], denied: list[DeviceNode], unit: UnitDevices | None = None) -> DeviceStart:
        """The unit about to start: its ``DeviceAllow=`` values (they go into the unit itself,
        not in front of the command)."""
        if unit is not None:
            self.units[name] = unit
        return DeviceStart(device_allow=tuple(self.allow_values(name, allowed)))

    def apply(self, name: str, allowed: list[DeviceNode], denied: list[DeviceNode]) -> None:
        if name not in self.units:
            return
        r = self.run(self.set_property_command(name, allowed), capture_output=True, text=True, timeout=30)
        if getattr(r, "returncode", 0) != 0:
            raise OSError(f"systemctl set-property failed: {(getattr(r, 'stderr', '') or '').strip()}")

    def adopt(self, name: str, allowed: list[DeviceNode], denied: list[DeviceNode], unit: UnitDevices | None = None) -> None:
        """A running server's unit, again (the hub restarted): its device list now."""
        if unit is not None:
            self.units[name] = unit
        self.apply(name, allowed, denied)

    def retire(self, name: str, denied: list[DeviceNode]) -> None:
        pass  # SystemdSpawner stopped the unit, and systemd every process in it

    def attach(self, name: str, pid: int) -> None:
        pass  # systemd-run started the server inside its unit

    def holds(self, name: str, pid: int) -> bool:
        return True

    def remove(self, name: str) -> bool:
        self.units.pop(name, None)
        return True  # SystemdSpawner stops the unit; systemd drops its cgroup with it


class DeviceAllowSystemdSpawner(SystemdSpawner):
    """SystemdSpawner whose unit starts with the device properties :meth:`unit_device_allow` gives.

    The engine half of :class:`GPULeaseSystemdSpawner`: its ``start()`` is what the lease
    spawner calls once the lease is granted (or at once for a CPU-only server)."""

    _admin_unit_properties: dict[str, Any] | None = None

    def _expand_user_vars(self, string):
        # SystemdSpawner documents list values in unit_extra_properties (one --property per
        # entry) but expands them with str.format, which a list does not have; it offers no
        # public hook for the expansion, so this override expands each entry instead
        # (tests/test_systemd_spawner.py runs it through SystemdSpawner's own start())
        if isinstance(string, list | tuple):
            return [self._expand_user_vars(s) for s in string]
        return super()._expand_user_vars(string)

    @property
    def admin_unit_properties(self) -> dict[str, Any]:
        """The admin's ``unit_extra_properties`` as configured (the start adds the device lock)."""
        if self._admin_unit_properties is None:
            self._admin_unit_properties = copy.deepcopy(dict(self.unit_extra_properties))
        return self._admin_unit_properties

    def unit_device_allow(self) -> list[str] | None:
        """``DeviceAllow=`` values for the unit about to start; None: leave its devices alone."""
        return None

    async def start(self):
        admin = self.admin_unit_properties
        allow = self.unit_device_allow()
        props = copy.deepcopy(admin)
        if allow is not None:
            props.update(unit_device_properties(allow, admin=admin))
            if self.isolate_devices and any(v.startswith("/dev/nvidia") for v in allow):
                self.log.warning("%s: isolate_devices (PrivateDevices=yes) gives the unit a /dev without the GPUs' nodes: "
                                 "its lease's GPUs cannot be opened", self.unit_name)
        # SystemdSpawner has no hook for a unit's properties at one start: its start() builds
        # systemd-run's --property list from its traits and unit_extra_properties (into which it
        # writes the expanded values). So this start's list (the admin's entries and the device
        # lock) is that trait's value for the call, and the admin's value is back after it.
        self.unit_extra_properties = props
        try:
            url = await super().start()
        finally:
            self.unit_extra_properties = copy.deepcopy(admin)
        if url is not None and not await systemd_units.service_running(self.unit_name):
            # systemd-run refused the unit (SystemdSpawner does not look at its exit status):
            # say so now instead of letting the hub wait for a server that never comes
            raise spawn_error(f"The server's systemd unit {self.unit_name} did not start; the administrator finds "
                              f"systemd's reason in the hub's log and in `journalctl -u {self.unit_name}`.",
                              reason="gpulease_unit", status_code=500)
        return url


class GPULeaseSystemdSpawner(GPULeaseSpawner, DeviceAllowSystemdSpawner):
    """Servers as systemd units whose devices follow their leases (entry point ``gpulease-systemd``).

    The lease spawner over jupyterhub-systemdspawner's SystemdSpawner (The Littlest
    JupyterHub's spawner). ``enforce_devices`` as for the local engines: ``"off"`` leaves the
    unit's devices as SystemdSpawner sets them (every GPU of the host can be opened;
    ``CUDA_VISIBLE_DEVICES`` only names the lease); otherwise the unit allows exactly the nodes
    of its leases, and ``"required"`` refuses GPU spawns on a host where systemd cannot do it."""

    # the hub's device guard, with this engine's mechanism (ServiceUnits) instead of a device
    # cgroup or scope of its own; the line at hub start names it (log_at_hub_start below)
    enforces_devices = True

    @classmethod
    def log_device_access_at_hub_start(cls, hub) -> None:
        log_at_hub_start(hub)

    @classmethod
    def device_access_at_hub_stop(cls, hub) -> None:
        pass  # the units are SystemdSpawner's, named by its unit_name_template

    def find_device_mechanism(self) -> Mechanism:
        ok, why = detect_units()
        return Mechanism(ServiceUnits.kind, why, ServiceUnits() if ok else None)

    def device_unit(self) -> UnitDevices:
        admin = self.admin_unit_properties
        extra = self._expand_user_vars(as_list(admin.get("DeviceAllow")))  # as SystemdSpawner's start expands them
        return UnitDevices(self.unit_name, tuple(extra), device_policy(admin))

    def unit_device_allow(self) -> list[str] | None:
        allow = self.device_start.device_allow
        if allow is None:
            return None
        self.log.info("%s: unit %s starts with DevicePolicy=%s and DeviceAllow=%s", self._log_name, self.unit_name,
                      device_policy(self.admin_unit_properties), ", ".join(allow))
        return list(allow)


def log_at_hub_start(hub: Any) -> str | None:
    """Log the line about device enforcement when the hub's spawner is this engine; returns it."""
    cls = getattr(hub, "spawner_class", None)
    if not (isinstance(cls, type) and issubclass(cls, GPULeaseSystemdSpawner)):
        return None
    mode = cgroups._config_value(cls, hub.config, "enforce_devices")
    ok, why = (False, "off") if mode == "off" else detect_units()
    line = cgroups.hub_start_line(mode, Mechanism(ServiceUnits.kind if ok else "none", why))
    (hub.log.info if ok or mode == "off" else hub.log.warning)(line)
    return line
