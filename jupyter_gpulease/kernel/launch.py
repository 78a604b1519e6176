"""Every Python kernel of a gpulease server starts with the `%gpu` magics loaded.

How: a kernel provisioner (jupyter_client's hook around launching a kernel) that is the local
provisioner plus two things for IPython kernels:

* ``--ext=jupyter_gpulease`` on the kernel's command line. IPython adds it to
  ``InteractiveShellApp.extra_extensions``, beside (not instead of) whatever the user's own
  ``ipython_kernel_config.py`` lists in ``extensions``: no file of the user is read or written;
* ``GPULEASE_SERVER_URL`` and ``GPULEASE_SERVER_TOKEN`` in the kernel's environment, so the
  magics and the widget reach this server's ``/gpulease/`` API without guessing;
* for every kernel, the GPU environment of the lease the server holds now
  (``CUDA_VISIBLE_DEVICES`` and the ``GPULEASE_*`` variables), from the server extension's
  kernel environment: a kernel started or restarted after the lease changed gets the new one.

The server extension makes it the default provisioner with :func:`use_in_server` (a kernel
spec that names a provisioner of its own keeps it; so does a server whose
``KernelProvisionerFactory.default_provisioner_name`` was set on purpose).
"""

from __future__ import annotations

import logging
import os
from typing import Any

from jupyter_client.provisioning import LocalProvisioner
from jupyter_client.provisioning.factory import KernelProvisionerFactory

log = logging.getLogger(__name__)

PROVISIONER_NAME = "gpulease-local-provisioner"
EXTENSION = "jupyter_gpulease"
KERNEL_ENV_SETTING = "gpulease_kernel_env"  # where the server extension keeps what kernels started now get (server/kernelenv.py)


def is_ipykernel(cmd: list[str]) -> bool:
    """Whether a kernel command line starts an IPython kernel (``-m ipykernel_launcher`` and kin)."""
    return any(os.path.basename(a).split(".")[0] in ("ipykernel_launcher", "ipykernel") for a in cmd)


def with_extension(cmd: list[str]) -> list[str]:
    """``cmd`` with ``--ext=jupyter_gpulease`` added, for IPython kernels that lack it."""
    if not is_ipykernel(cmd) or any(a in (f"--ext={EXTENSION}", f"--InteractiveShellApp.extra_extensions={EXTENSION}") for a in cmd):
        return list(cmd)
    return [*cmd, f"--ext={EXTENSION}"]


def server_environment(serverapp: Any) -> dict[str, str]:
    """Where a kernel finds its server: its URL (base URL included) and a token it accepts."""
    if serverapp is None:
        return {}
    env = {}
    url = getattr(serverapp, "connection_url", "") or ""
    if url:
        env["GPULEASE_SERVER_URL"] = url
    token = ""
    idp = getattr(serverapp, "identity_provider", None)
    if idp is not None and getattr(idp, "token", ""):
        token = idp.token
    token = token or os.environ.get("JUPYTERHUB_API_TOKEN", "")
    if token:
        env["GPULEASE_SERVER_TOKEN"] = token
    return env


def _serverapp(obj: Any) -> Any:
    """The ServerApp above a provisioner: provisioner → kernel manager → multi-kernel manager → app."""
    for _ in range(6):
        if obj is None:
            return None
        if hasattr(obj, "connection_url") and hasattr(obj, "web_app"):
            return obj
        obj = getattr(obj, "parent", None)
    return None


class GPULeaseKernelProvisioner(LocalProvisioner):
    """The local provisioner, with the `%gpu` magics loaded in IPython kernels (see the module)."""

    async def pre_launch(self, **kwargs: Any) -> dict[str, Any]:
        kwargs = await super().pre_launch(**kwargs)
        cmd = kwargs.get("cmd") or []
        kwargs["cmd"] = with_extension(cmd)
        app = _serverapp(self)
        # the GPU environment of the server's current lease (the server extension's kernel environment)
        lease_env = getattr(getattr(app, "web_app", None), "settings", {}).get(KERNEL_ENV_SETTING)
        if lease_env is not None or is_ipykernel(cmd):
            env = kwargs.get("env")
            if env is None:
                env = kwargs["env"] = dict(os.environ)
            if lease_env is not None:
                lease_env.apply(env)
            if is_ipykernel(cmd):
                env.update(server_environment(app))
        return kwargs


def use_in_server(serverapp: Any) -> bool:
    """Make :class:`GPULeaseKernelProvisioner` the server's default provisioner, unless the
    admin or user chose another one. Returns whether it is now the default."""
    factory = KernelProvisionerFactory.instance(parent=getattr(serverapp, "kernel_manager", None) or serverapp)
    current = factory.default_provisioner_name
    if current == PROVISIONER_NAME:
        return True
    chosen = os.environ.get(KernelProvisionerFactory.default_provisioner_name_env) or "default_provisioner_name" in factory.config.get(
        "KernelProvisionerFactory", {}
    )
    if current != "local-provisioner" or chosen:
        log.info("gpulease: kernels keep the provisioner %r; load the %%gpu magics with %%load_ext jupyter_gpulease", current)
        return False
    if PROVISIONER_NAME not in factory.provisioners:
        log.warning("gpulease: the kernel provisioner %s is not installed (reinstall jupyter-gpulease); "
                    "kernels start without the %%gpu magics", PROVISIONER_NAME)
        return False
    factory.default_provisioner_name = PROVISIONER_NAME
    return True
