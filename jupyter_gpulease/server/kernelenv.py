"""The environment kernels are started with: the only code that decides a kernel's GPU environment.

The server starts with the spawner's environment (the lease it was started with). When the
lease changes, :class:`KernelEnvironment` computes the environment of the new lease (or the
CPU-only one) and the kernel provisioner (``kernel/launch.py``) applies it to every kernel
started or restarted from then on, through jupyter_client's launch path (``pre_launch``'s
``env``). The server's own process environment is never written. Running kernels keep the
devices they started with; :meth:`KernelEnvironment.stale` and the ``env_stale`` notice say so.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from typing import Any

from traitlets.config import LoggingConfigurable

from ..core.lease import cpu_only_environment, lease_environment
from .kernels import RESUMING, SUSPENDED, KernelRecord

SETTING = "gpulease_kernel_env"  # the web_app setting the provisioner finds it under
# kept from the server's environment whatever the lease: where the broker and the server are, the device backend
KEEP = frozenset({"GPULEASE_BROKER_URL", "GPULEASE_TOKEN", "GPULEASE_DEVICE_BACKEND", "GPULEASE_DEVICE_CONFIG",
                  "GPULEASE_SERVER_URL", "GPULEASE_SERVER_TOKEN"})


class KernelEnvironment(LoggingConfigurable):
    """What kernels started from now on get (see the module)."""

    def __init__(self, *, broker_url: str = "", base: Callable[[], dict[str, str]] | None = None, **kwargs: Any):
        super().__init__(**kwargs)
        self.broker_url = broker_url
        self._base = base or (lambda: dict(os.environ))
        self.overlay: dict[str, str] | None = None  # None: the server's own environment, unchanged
        self.lease_id = self._base().get("GPULEASE_LEASE_ID", "")  # the lease of kernels started now

    def set_lease(self, lease: dict[str, Any] | None) -> bool:
        """Kernels started from now on get ``lease``'s environment (None: no GPU). True when that is
        another lease than before (running kernels may now see other devices than new ones)."""
        try:
            env = lease_environment(lease, broker_url=self.broker_url) if lease else cpu_only_environment(broker_url=self.broker_url)
        except (ValueError, KeyError):
            env = cpu_only_environment(broker_url=self.broker_url)
        self.overlay = env
        new_id = env.get("GPULEASE_LEASE_ID", "")
        if new_id == self.lease_id:
            return False
        self.lease_id = new_id
        return True

    def apply(self, env: dict[str, str]) -> dict[str, str]:
        """Turn a kernel's launch environment (a copy of the server's) into the lease's, in place."""
        if self.overlay is None:
            return env
        for k in [k for k in env if k.startswith("GPULEASE_") and k not in KEEP and k not in self.overlay]:
            del env[k]
        env.update({k: v for k, v in self.overlay.items() if k not in ("GPULEASE_DEVICE_BACKEND", "GPULEASE_DEVICE_CONFIG")})
        return env

    def get(self, key: str) -> str:
        """A variable of the environment kernels get now ("" when unset)."""
        return self.apply(self._base()).get(key, "")

    @property
    def devices(self) -> str:
        """CUDA_VISIBLE_DEVICES of kernels started now."""
        return self.get("CUDA_VISIBLE_DEVICES")

    def stale(self, rec: KernelRecord, env_devices: str | None, devices: str | None = None) -> bool:
        """Whether a running kernel sees other devices than kernels started now (a suspended or
        resuming kernel gets the lease's devices by its restore: not stale)."""
        return bool(self.sight(rec, env_devices, devices))

    def sight(self, rec: KernelRecord, env_devices: str | None, devices: str | None = None) -> str:
        """What a running kernel sees against what kernels started now get, in words; "" when it
        sees the same (or it is not known, or its restore gives it the lease's devices). The one
        place that says it: the status's kernels and ``%gpu status`` read it."""
        devices = self.devices if devices is None else devices
        if env_devices is None or rec.state in (SUSPENDED, RESUMING) or env_devices == devices:
            return ""
        if not devices:
            return "still sees a GPU this server no longer leases: restart it to drop it"
        if not env_devices:
            return "started without a GPU: restart it to see the new GPU"
        return "sees the GPU of an earlier lease: restart it to see the new GPU"

    def stale_kernels(self, kernels: Iterable[KernelRecord], env_of: Callable[[KernelRecord], str | None]) -> tuple[str, list[KernelRecord]]:
        devices = self.devices
        return devices, [k for k in kernels if self.stale(k, env_of(k), devices)]
