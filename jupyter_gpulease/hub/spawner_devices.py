"""Device access for the local engines: the server runs in a device cgroup that opens only the
GPUs of its lease (see :mod:`.cgroups`, :mod:`.devaccess`). A part of
:class:`.spawner.GPULeaseSpawner`; engines with a mechanism of their own (systemd's
``DeviceAllow=``, Kubernetes' device plugin) override the hooks.
"""

from __future__ import annotations

from traitlets.config import LoggingConfigurable

from .link import LeaseWatch
from .spawner_settings import spawn_error


class SpawnerDevices(LoggingConfigurable):
    """The device cgroup around the engine's start, and following the lease's devices."""

    enforces_devices = False  # the engines that run the server as a local process set it

    @classmethod
    def log_device_access_at_hub_start(cls, hub) -> None:
        """Log the one line about device enforcement when the hub starts (the local engines'
        mechanism; an engine with a mechanism of its own overrides this)."""
        from .cgroups import log_at_hub_start

        log_at_hub_start(hub)

    def _device_guard(self, *, check: bool = True):
        """The hub's :class:`~.cgroups.DeviceGuard` when this spawner enforces device access
        (None: not this engine, off, or not possible and not required). ``check``: raise the
        spawn error where enforcement is required and impossible."""
        if not self.enforces_devices or self.enforce_devices == "off" or not self.broker_url:
            return None
        from .cgroups import DeviceGuard

        guard = DeviceGuard.for_spawner(self)
        message = guard.required_failure()
        if message and check:
            raise spawn_error(message, reason="gpulease_devices", status_code=500)
        return guard if guard.active else None

    def _device_problem(self, e: BaseException, doing: str) -> None:
        message = f"Could not {doing} the device cgroup of this server: {e}"
        if self.enforce_devices == "required":
            raise spawn_error(message + " (GPU device enforcement is required on this hub)", reason="gpulease_devices",
                              status_code=500) from None
        self.log.warning("%s (%s); it runs without device enforcement (best-effort)", message, self._log_name)

    async def _start_engine(self):
        """The engine's start, inside the server's device cgroup where this spawner enforces
        device access: the cgroup is made with the rules of the lease (none: every GPU denied)
        before, the server's process moved into it right after."""
        guard = self._device_guard()
        if guard is None:
            return await super().start()
        user, server = self.user.name, self.name or ""
        lease = self.lease if self.lease_id and isinstance(self.lease, dict) else None
        prefix: list[str] = []
        try:
            prefix = await guard.server_starting(user, server, lease)
        except Exception as e:
            self._device_problem(e, "make")
        saved = self.cmd
        if prefix:  # systemd: the server runs in a transient scope
            self.cmd = [*prefix, *saved]
        try:
            url = await super().start()
        finally:
            if prefix:
                self.cmd = saved
        try:
            await guard.server_started(user, server, getattr(self, "pid", 0))
        except Exception as e:
            if self.enforce_devices == "required":
                await super().stop(now=True)
            self._device_problem(e, "move the server into")
        return url

    def _existing_guard(self):
        from .cgroups import DeviceGuard

        guard = DeviceGuard._guards.get(self._link) if self._link is not None and self.enforces_devices else None
        return guard if guard is not None and guard.active else None

    def _devices_stopped(self) -> None:
        guard = self._existing_guard()
        if guard is not None and self.user is not None:
            guard.server_stopped(self.user.name, self.name or "")

    def _devices_adopt(self) -> None:
        """A running server this hub process did not start (the hub restarted): its cgroup again."""
        if not self.enforces_devices or self._lease_pending or self._stopping or self.user is None:
            return
        guard = self._device_guard(check=False)
        if guard is not None and not guard.known(self.user.name, self.name or ""):
            self._background(guard.adopt(self.user.name, self.name or "", getattr(self, "pid", 0), self.lease_id))

    def _devices_follow(self, w: LeaseWatch) -> None:
        guard = self._existing_guard()
        if guard is not None and self.user is not None and isinstance(w.lease, dict):
            guard.lease_changed(self.user.name, self.name or "", {"id": w.lease_id, **w.lease})
