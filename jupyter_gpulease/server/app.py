"""The jupyter_server extension: configuration, and wiring it into the parts.

Enabled on install (``jupyter_server_config.d/jupyter_gpulease.json`` in the wheel). Configure
it in ``jupyter_server_config.py`` (see config/jupyter_server_config.py): where things are, the
monitor and the heartbeats as ``c.GPULeaseExtension.<option>``; the parts' own settings under
their names (``c.GPUIdleRule``, ``c.ReclaimActions``, ``c.Resumer``, ``c.GPUUsage``). The older
``c.GPULeaseExtension.<option>`` of a moved setting is still read: each config the extension
loads is migrated first, with a warning (:mod:`jupyter_gpulease.core.renames`). Without a lease,
a broker or GPUs it logs one line, says so in its status and otherwise stays out of the way.
"""

from __future__ import annotations

import json
import os

from jupyter_server.extension.application import ExtensionApp
from traitlets import Bool, Dict, Enum, Float, Set, Unicode, default, validate

from ..client import BrokerClient, default_broker_url
from ..core.renames import migrated
from ..devices import DeviceUnavailable, get_backend
from . import kernelenv
from .checkpoint import CudaCheckpoint, find_cuda_checkpoint, simulated_checkpoint, unavailable_reason
from .controller import PARTS, GPUController
from .feed import Feed
from .handlers import CONTROLLER_SETTING, handlers
from .lease import LeaseKeeper
from .monitor import Monitor


class GPULeaseExtension(ExtensionApp):
    """GPU leases inside a Jupyter server: monitor, idle reclaim, resume, heartbeats, REST and feed."""

    name = "jupyter_gpulease"
    load_other_extensions = True
    classes = list(PARTS)  # each part declares its own settings (c.ReclaimActions.reclaim_action, ...)

    # old option names (core/renames.py) move to their new names before any option is set from a
    # config: traitlets' two public hooks, the config given at construction and every loaded one
    _renames_said = Set()  # each old-name warning once

    @validate("config")
    def _config_with_new_names(self, proposal):
        return migrated(self, proposal.value, self._renames_said)

    def update_config(self, config):
        super().update_config(migrated(self, config, self._renames_said))

    enabled = Bool(True, help="""Run the GPU lease extension. False: it loads but does nothing (no sampling, no REST).""").tag(config=True)

    # ------------------------------------------------------------------ where things are
    broker_url = Unicode(
        help="""The lease broker's base URL. Default: ``GPULEASE_BROKER_URL`` (set by the spawner),
        else derived from the hub's environment. Example: ``http://127.0.0.1:8000/services/gpulease/``.""",
    ).tag(config=True)

    @default("broker_url")
    def _broker_url_default(self):
        return default_broker_url()

    broker_token = Unicode(
        help="""Token for the broker. Default: ``GPULEASE_TOKEN``, else the server's own ``JUPYTERHUB_API_TOKEN``
        (it needs the scope ``access:services!service=gpulease``).""",
    ).tag(config=True)

    @default("broker_token")
    def _broker_token_default(self):
        return os.environ.get("GPULEASE_TOKEN") or os.environ.get("JUPYTERHUB_API_TOKEN", "")

    lease_id = Unicode(help="""The lease the server starts with. Default: ``GPULEASE_LEASE_ID`` (set by the spawner); empty: none.""").tag(config=True)

    @default("lease_id")
    def _lease_id_default(self):
        return os.environ.get("GPULEASE_LEASE_ID", "")

    server_name = Unicode(help="""This server's name on the hub, for leases it asks for. Default: ``JUPYTERHUB_SERVER_NAME`` ("" = the default server).""").tag(config=True)

    @default("server_name")
    def _server_name_default(self):
        return os.environ.get("JUPYTERHUB_SERVER_NAME", "")

    device_backend = Enum(
        ["nvml", "simulated", "static", "auto"],
        help="""Where GPU figures come from: ``nvml`` (real GPUs), ``simulated`` (the demo's fake GPUs, driven through
        their state file), ``static`` (no figures), ``auto`` (NVML if it finds GPUs, else simulated).
        Default: ``GPULEASE_DEVICE_BACKEND``, else ``nvml``.""",
    ).tag(config=True)

    @default("device_backend")
    def _device_backend_default(self):
        value = os.environ.get("GPULEASE_DEVICE_BACKEND", "nvml").strip().lower()
        return value if value in ("nvml", "simulated", "static", "auto") else "nvml"

    device_config = Dict(
        help="""Configuration of the device backend (see jupyter_gpulease.devices). Default: the JSON in
        ``GPULEASE_DEVICE_CONFIG``. Example: ``{"state_file": "/srv/demo/sim-gpus.json"}``.""",
    ).tag(config=True)

    @default("device_config")
    def _device_config_default(self):
        raw = os.environ.get("GPULEASE_DEVICE_CONFIG", "")
        if not raw:
            return {}
        try:
            value = json.loads(raw)
        except ValueError:
            self.log.warning("GPULEASE_DEVICE_CONFIG is not JSON; ignoring it")
            return {}
        return value if isinstance(value, dict) else {}

    # ------------------------------------------------------------------ monitor
    sample_interval = Float(1.0, help="""Seconds between GPU samples (NVML runs in a worker thread). Example: 1.""").tag(config=True)
    history_seconds = Float(600.0, help="""Seconds of per-device and per-kernel history kept for the frontends. Example: 600 (10 min).""").tag(config=True)

    @validate("sample_interval", "history_seconds")
    def _positive(self, proposal):
        if proposal.value <= 0:
            raise ValueError(f"{proposal.trait.name} must be more than 0 seconds, got {proposal.value}")
        return proposal.value

    # ------------------------------------------------------------------ suspend
    cuda_checkpoint = Unicode(
        "cuda-checkpoint", help="""The cuda-checkpoint executable: a name looked up on PATH, or a path; ``simulated``: the
        simulated one for simulated GPUs (jupyter_gpulease.devices.simcheckpoint), which is also what the simulated
        device backend uses when this is not set. Never used with real GPUs.""",
    ).tag(config=True)
    checkpoint_timeout = Float(300.0, help="""Seconds one cuda-checkpoint call may take before it counts as failed.""").tag(config=True)

    # ------------------------------------------------------------------ reporting
    heartbeat_interval = Float(
        30.0, help="""Seconds between heartbeats to the broker (usage per device and kernel). Keep it well under the
        broker's ``heartbeat_timeout_s``. Example: 30.""",
    ).tag(config=True)

    # ------------------------------------------------------------------ wiring
    def initialize_settings(self):
        self.controller = None
        if not self.enabled:
            self.log.info("GPU lease extension is disabled (GPULeaseExtension.enabled = False)")
            return
        backend, unavailable = None, ""
        try:
            backend = get_backend(self.device_backend, self.device_config)
            if self.lease_id or self.device_backend != "nvml":
                backend.inventory()  # fail here, once, rather than at every sample
        except (DeviceUnavailable, ValueError) as e:
            unavailable = str(e)
            backend = None
        client = None
        if self.broker_url:
            try:
                client = BrokerClient(self.broker_url, self.broker_token)
            except Exception as e:  # a bad URL must not fail the server
                self.log.warning("GPU leases: broker client not usable: %s", e)
        monitor = Monitor(backend, interval=self.sample_interval, history_s=self.history_seconds, unavailable=unavailable)
        checkpoint, missing = self._checkpoint(backend)
        keeper = LeaseKeeper(client, lease_id=self.lease_id, server_name=self.server_name, heartbeat_interval=self.heartbeat_interval)
        self.controller = GPUController(
            parent=self, kernel_manager=self.serverapp.kernel_manager, session_manager=getattr(self.serverapp, "session_manager", None),
            monitor=monitor, keeper=keeper, feed=Feed(), sample_interval=self.sample_interval, history_s=self.history_seconds,
            checkpoint=checkpoint, checkpoint_missing=missing, web_settings=self.serverapp.web_app.settings,
            stop_server=self.serverapp.stop, user=os.environ.get("JUPYTERHUB_USER", ""), broker_url=self.broker_url,
        )
        self.settings[CONTROLLER_SETTING] = self.controller
        self.settings[kernelenv.SETTING] = self.controller.kernel_env
        # kernels get the %gpu magics and this server's URL and token (unless a provisioner was chosen on purpose)
        from ..kernel.launch import use_in_server

        use_in_server(self.serverapp)
        # one line, whatever the situation: a server without a lease or GPU must not flood its log
        if not self.lease_id:
            self.log.info("GPU leases: this server holds no GPU lease%s; kernels run without a GPU.",
                          "" if client else " and has no broker to ask for one (GPULEASE_BROKER_URL is not set)")
        elif unavailable:
            self.log.warning("GPU leases: lease %s, but no GPU telemetry: %s", self.lease_id, unavailable)
        else:
            actions = self.controller.actions
            self.log.info("GPU leases: lease %s, %s backend, sampling every %g s, idle reclaim: %s, %s", self.lease_id,
                          self.device_backend, self.sample_interval, self.controller.idle.describe(actions.effective_action()),
                          actions.reclaim_action)

    def _checkpoint(self, backend) -> tuple[CudaCheckpoint | None, str]:
        """(the cuda-checkpoint to suspend with, or None; why there is none). On simulated GPUs
        with ``cuda_checkpoint`` not set: the simulated one, which says so; never on real GPUs."""
        simulated = getattr(backend, "name", "") == "simulated"
        wanted = self.cuda_checkpoint
        if wanted == "simulated" or (simulated and "cuda_checkpoint" not in self.config.get("GPULeaseExtension", {})):
            if not simulated:
                return None, "the simulated cuda-checkpoint works on simulated GPUs only (this server's are not)"
            return simulated_checkpoint(self.device_config, timeout_s=self.checkpoint_timeout), ""
        path = find_cuda_checkpoint(wanted)
        missing = unavailable_reason(path, wanted, mig=False)
        return (CudaCheckpoint(path, timeout_s=self.checkpoint_timeout) if path else None), missing

    def initialize_handlers(self):
        if not self.enabled:
            return
        self.handlers.extend(handlers())

    async def _start_jupyter_server_extension(self, serverapp):
        if self.controller is not None:
            await self.controller.start()

    async def stop_extension(self):
        if self.controller is not None:
            await self.controller.stop()  # closes the device backend too, off the event loop

    def current_activity(self):
        """GPU work counts as activity for the server's own idle shutdown."""
        return self.controller is not None and self.controller.gpu_busy()
