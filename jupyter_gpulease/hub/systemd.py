"""GPULeaseSystemdSpawner: each server a systemd unit whose device access follows its lease.

`jupyterhub-systemdspawner`_ (what The Littlest JupyterHub runs) starts every single-user server
as a transient systemd service (``systemd-run --unit jupyter-<user>-singleuser``). systemd's
device controller is the lock: the unit starts with ``DevicePolicy=closed`` (only the standard
pseudo devices ``/dev/null``, ``/dev/zero``, ``/dev/full``, ``/dev/random``, ``/dev/urandom``,
``/dev/tty``, ``/dev/ptmx`` and the terminals ``/dev/pts/*``) and one ``DeviceAllow=`` per
device node of its lease (see :mod:`.devaccess`): the leased ``/dev/nvidiaN``, a MIG
instance's ``/dev/nvidia-caps/nvidia-capN``, and ``/dev/nvidiactl``, ``/dev/nvidia-modeset``,
``/dev/nvidia-uvm``, ``/dev/nvidia-uvm-tools`` that every CUDA process opens. A server without
a lease gets no ``DeviceAllow=`` at all: no GPU, not even the control nodes. Every process of
the unit (kernels, terminals) is in its cgroup, so they all follow it. systemd applies it on
both cgroup versions (v1: the ``devices`` controller; v2: a BPF device program).

A lease change (granted, resumed, ended, revoked, reclaimed, preempted, a lease the server took
itself) changes the running unit with one call::

    systemctl set-property --runtime jupyter-alice-singleuser DevicePolicy=closed \\
        DeviceAllow= "DeviceAllow=/dev/nvidia2 rw" "DeviceAllow=/dev/nvidiactl rw" ...

The empty ``DeviceAllow=`` comes first because ``set-property`` *adds* to the unit's list: the
empty assignment resets it, and the assignments after it in the same call are the new list.
``--runtime`` keeps the change out of ``/etc`` (the unit is transient too). Device entries
the admin put in ``unit_extra_properties["DeviceAllow"]`` (``/dev/fuse``, ...) are part of
every list.

A device cgroup checks ``open()``: a process that already holds a GPU keeps it after a deny. The
lease spawner's end and reclaim paths take care of those processes (see the device-access
section of the README); this module only sets what may be opened.

.. _jupyterhub-systemdspawner: https://github.com/jupyterhub/systemdspawner
"""

from __future__ import annotations

import asyncio
import copy
import os
from collections.abc import Iterable, Sequence
from typing import Any

from systemdspawner import SystemdSpawner
from systemdspawner import systemd as systemd_units

from . import devaccess
from .spawner import GPULeaseSpawner, spawn_error

SYSTEMCTL = "systemctl"
DEVICE_POLICY = "closed"
DEVICE_ACCESS_TIMEOUT_S = 30.0


def as_list(value: Any) -> list[str]:
    """A ``unit_extra_properties`` value (one string or a list of them) as a list."""
    if value is None or value == "":
        return []
    if isinstance(value, str):
        return [value]
    return [str(v) for v in value]


def device_allow_values(leases: Iterable[dict], pool_nodes: dict[str, devaccess.DeviceNode], *,
                        uvm: int | None = None, extra: Sequence[str] = ()) -> list[str]:
    """``DeviceAllow=`` values of a unit whose server holds ``leases`` (lease JSON; ended and
    queued ones count for nothing): the admin's ``extra`` entries first, then the lease's nodes."""
    nodes = devaccess.leases_nodes(list(leases), pool_nodes, uvm=uvm)
    return list(dict.fromkeys([*extra, *devaccess.systemd_device_allow(nodes)]))


def unit_device_properties(allow: Sequence[str], *, admin: dict[str, Any] | None = None) -> dict[str, Any]:
    """The unit properties for ``systemd-run`` that lock the unit's devices to ``allow``.

    ``admin``: the admin's ``unit_extra_properties``; its ``DevicePolicy=strict`` is kept (it
    is stricter), any other policy becomes ``closed``."""
    policy = "strict" if str((admin or {}).get("DevicePolicy", "")).strip() == "strict" else DEVICE_POLICY
    return {"DevicePolicy": policy, "DeviceAllow": list(allow)}


def set_property_argv(unit: str, allow: Sequence[str], *, policy: str = DEVICE_POLICY, systemctl: str = SYSTEMCTL) -> list[str]:
    """The ``systemctl set-property`` command that makes ``allow`` the running unit's whole
    device list: the empty ``DeviceAllow=`` resets the list, the entries after it are the list."""
    return [systemctl, "set-property", "--runtime", unit, f"DevicePolicy={policy}", "DeviceAllow=",
            *(f"DeviceAllow={v}" for v in allow)]


class DeviceAllowSystemdSpawner(SystemdSpawner):
    """SystemdSpawner whose unit starts with the device properties :meth:`unit_device_allow` gives.

    The engine half of :class:`GPULeaseSystemdSpawner`: its ``start()`` is what the lease
    mixin calls once the lease is granted (or at once for a CPU-only server)."""

    _admin_unit_properties: dict[str, Any] | None = None

    def _expand_user_vars(self, string):
        # SystemdSpawner documents list values in unit_extra_properties (one --property per
        # entry) but expands them with str.format: expand each entry instead
        if isinstance(string, list | tuple):
            return [self._expand_user_vars(s) for s in string]
        return super()._expand_user_vars(string)

    @property
    def admin_unit_properties(self) -> dict[str, Any]:
        """The admin's ``unit_extra_properties`` as configured (the start adds the device lock)."""
        if self._admin_unit_properties is None:
            self._admin_unit_properties = copy.deepcopy(dict(self.unit_extra_properties))
        return self._admin_unit_properties

    async def unit_device_allow(self) -> list[str] | None:
        """``DeviceAllow=`` values for the unit about to start; None: leave devices alone."""
        return None

    async def start(self):
        admin = self.admin_unit_properties
        allow = await self.unit_device_allow()
        props = copy.deepcopy(admin)
        if allow is not None:
            props.update(unit_device_properties(allow, admin=admin))
            if self.isolate_devices and any(v.startswith("/dev/nvidia") for v in allow):
                self.log.warning("%s: isolate_devices (PrivateDevices=yes) gives the unit a /dev without the GPUs' nodes: "
                                 "its lease's GPUs cannot be opened", self.unit_name)
        self.unit_extra_properties = props
        try:
            url = await super().start()
        finally:
            self.unit_extra_properties = copy.deepcopy(admin)
        if url is not None and not await systemd_units.service_running(self.unit_name):
            # systemd-run refused the unit (SystemdSpawner does not look at its exit status):
            # say so now instead of letting the hub wait for a server that never comes
            raise spawn_error(f"The server's systemd unit {self.unit_name} did not start; the administrator finds "
                              "systemd's reason in the hub's log and in `journalctl -u " + self.unit_name + "`.",
                              reason="gpulease_unit", status_code=500)
        return url


class GPULeaseSystemdSpawner(GPULeaseSpawner, DeviceAllowSystemdSpawner):
    """Servers as systemd units whose devices follow their leases (entry point ``gpulease-systemd``).

    The lease spawner over `jupyterhub-systemdspawner`'s SystemdSpawner (The Littlest
    JupyterHub's spawner). ``enforce_devices`` (see :class:`~.spawner.GPULeaseSpawner`):
    ``"off"`` leaves the unit's devices as SystemdSpawner sets them (only ``CUDA_VISIBLE_DEVICES``
    names the lease); otherwise the unit allows exactly its lease's nodes. A change systemd
    refuses while the unit runs is logged; under ``"required"`` a refused change that should
    have *denied* a GPU stops the server, so that no server keeps a GPU it no longer leases."""

    _device_lock: asyncio.Lock | None = None
    _device_allow_applied: list[str] | None = None
    _pool_nodes: dict[str, devaccess.DeviceNode] | None = None

    # ------------------------------------------------------------------ what the unit may open
    @property
    def _enforce(self) -> str:
        return str(getattr(self, "enforce_devices", "required") or "required")

    async def _device_nodes(self, leases: list[dict]) -> tuple[dict[str, devaccess.DeviceNode], int | None]:
        """The pool's device nodes (read once per spawn; again when a lease names a GPU the pool
        read did not have) and nvidia-uvm's major number, read off the event loop."""
        loop = asyncio.get_running_loop()
        # every GPU has a node (a MIG instance may have none of its own)
        wanted = {s.get("gpu_uuid") for lease in leases if devaccess.lease_holds(lease)
                  for s in lease["placement"]["slices"]} - {None, ""}
        nodes = self._pool_nodes
        if nodes is None and self._spawn_pool:
            nodes = await loop.run_in_executor(None, lambda: devaccess.pool_gpu_nodes(self._spawn_pool, stat=os.stat))
        if wanted and (nodes is None or not wanted <= set(nodes)):
            pool = await asyncio.wait_for(self.fetch_pool(), timeout=min(10.0, self.broker_timeout))
            nodes = await loop.run_in_executor(None, lambda: devaccess.pool_gpu_nodes(pool, stat=os.stat))
        self._pool_nodes = nodes
        uvm = await loop.run_in_executor(None, devaccess.uvm_major)
        return nodes or {}, uvm

    async def device_allow_for(self, leases: list[dict]) -> list[str]:
        """The unit's ``DeviceAllow=`` list while its server holds ``leases``."""
        nodes, uvm = await self._device_nodes(leases)
        extra = as_list(self.admin_unit_properties.get("DeviceAllow"))
        return device_allow_values(leases, nodes, uvm=uvm, extra=extra)

    async def unit_device_allow(self) -> list[str] | None:
        if self._enforce == "off":
            return None
        self._pool_nodes = None  # a new spawn reads the pool it was granted from
        leases = [self.lease] if self.lease_id and isinstance(self.lease, dict) else []
        allow = await self.device_allow_for(leases)
        self._device_allow_applied = allow
        self.log.info("%s: unit %s starts with DevicePolicy=closed and DeviceAllow=%s", self._log_name, self.unit_name,
                      ", ".join(allow) or "(nothing: no GPU)")
        return allow

    # ------------------------------------------------------------------ changes while it runs
    async def apply_device_access(self, leases: list[dict]) -> bool:
        """Make the running unit allow exactly the nodes of ``leases`` (the server's live leases:
        its own and those it took itself), with ``systemctl set-property``. True when the unit
        has that list now (or enforcement is off)."""
        if self._enforce == "off":
            return True
        if self._device_lock is None:
            self._device_lock = asyncio.Lock()
        async with self._device_lock:  # changes reach systemd in the order they were made
            allow = await self.device_allow_for(list(leases))
            if allow == self._device_allow_applied:
                return True
            before = self._device_allow_applied or []
            policy = unit_device_properties(allow, admin=self.admin_unit_properties)["DevicePolicy"]
            argv = set_property_argv(self.unit_name, allow, policy=policy)
            rc, err = await _run(argv, timeout=DEVICE_ACCESS_TIMEOUT_S)
            if rc == 0:
                self._device_allow_applied = allow
                self.log.info("%s: unit %s now allows %s", self._log_name, self.unit_name, ", ".join(allow) or "no GPU")
                return True
            if not await systemd_units.service_running(self.unit_name):
                self._device_allow_applied = None
                return True  # the server is gone: nothing left to allow or deny
            denies = bool(set(before) - set(allow))
            self.log.error("%s: systemd refused the device change of unit %s (%s): %s", self._log_name, self.unit_name,
                           " ".join(argv[4:]), err or f"exit status {rc}")
            if denies and self._enforce == "required":
                self.log.error("%s: enforce_devices is 'required' and unit %s may still open a GPU it no longer "
                               "leases: stopping the server", self._log_name, self.unit_name)
                await DeviceAllowSystemdSpawner.stop(self)
                self._device_allow_applied = None
                self._background(self.poll_and_notify())
            return False

    async def stop(self, now=False):
        try:
            await super().stop(now=now)
        finally:
            self._device_allow_applied = None
            self._pool_nodes = None


async def _run(argv: list[str], *, timeout: float) -> tuple[int, str]:
    """Run a command without blocking the event loop: (exit status, its stderr)."""
    try:
        proc = await asyncio.create_subprocess_exec(*argv, stdin=asyncio.subprocess.DEVNULL,
                                                    stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
    except OSError as e:
        return 127, str(e)
    try:
        _, err = await asyncio.wait_for(proc.communicate(), timeout)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        return 124, f"no answer within {timeout:g} s"
    return proc.returncode or 0, err.decode(errors="replace").strip()
