"""The jupyter_server extension: configuration, and wiring it into the parts.

Enabled on install (``jupyter_server_config.d/jupyter_gpulease.json`` in the wheel). Configure
it in ``jupyter_server_config.py`` as ``c.GPULeaseExtension.<option>`` (see
config/jupyter_server_config.py). Without a lease, a broker or GPUs it logs one line, says so in
its status and otherwise stays out of the way.
"""

from __future__ import annotations

import json
import os

from jupyter_core.paths import jupyter_data_dir
from jupyter_server.extension.application import ExtensionApp
from traitlets import Bool, Dict, Enum, Float, Unicode, default, validate

from ..client import BrokerClient, default_broker_url
from ..core.idle import IdleRule
from ..devices import DeviceUnavailable, get_backend
from .checkpoint import CudaCheckpoint, find_cuda_checkpoint, simulated_checkpoint, unavailable_reason
from .feed import Feed
from .handlers import handlers
from .lease import LeaseKeeper
from .monitor import Monitor
from .supervisor import ACTIONS, FALLBACK_ACTIONS, GPUSupervisor, Settings


class GPULeaseExtension(ExtensionApp):
    """GPU leases inside a Jupyter server: monitor, idle reclaim, resume, heartbeats, REST and feed."""

    name = "jupyter_gpulease"
    load_other_extensions = True

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

    # ------------------------------------------------------------------ idle rule
    gpu_idle_threshold = Float(
        5.0, help="""A kernel's GPU counts as idle while its processes keep under this many percent of the GPU's
        compute busy (NVML per-process SM utilization). Example: 5.""",
    ).tag(config=True)
    gpu_idle_timeout = Float(
        1800.0, help="""Seconds a kernel may hold GPU memory while GPU-idle before it is reclaimed (and a lease no kernel
        uses, before it goes back); 0: never reclaim. With ``gpu_idle_timeout_learn`` this is the starting value.
        Example: 1800 (30 min).""",
    ).tag(config=True)
    gpu_idle_timeout_learn = Bool(
        False, help="""Learn the timeout per user from their own earlier idle gaps (the time from the GPU falling idle to
        its next use), between ``gpu_idle_timeout_min`` and ``gpu_idle_timeout_max``. The gaps are kept in the user's
        Jupyter data directory.""",
    ).tag(config=True)
    gpu_idle_timeout_min = Float(300.0, help="""Shortest learnt timeout, seconds (admin bound). Example: 300.""").tag(config=True)
    gpu_idle_timeout_max = Float(4 * 3600.0, help="""Longest learnt timeout, seconds (admin bound). Example: 14400.""").tag(config=True)
    reclaim_busy = Bool(
        False, help="""Count a kernel that is executing a cell without using the GPU as idle (like jupyter_server's
        ``cull_busy``). Default False: a running cell protects its kernel's GPU.""",
    ).tag(config=True)

    # ------------------------------------------------------------------ actions
    reclaim_action = Enum(
        list(ACTIONS), "suspend",
        help="""What happens to an idle kernel's GPU: ``suspend`` (NVIDIA cuda-checkpoint moves its GPU memory to host
        memory; nothing is lost and its next cell resumes it), ``restart``, ``interrupt``, ``shutdown``, or ``notify``
        (only tell the user). Where suspend cannot work, ``fallback_action`` is used and the user is told why.""",
    ).tag(config=True)
    fallback_action = Enum(
        list(FALLBACK_ACTIONS), "restart",
        help="""The action when ``suspend`` cannot be used (no cuda-checkpoint, not x86-64, a MIG slice) or fails.""",
    ).tag(config=True)
    warn_before = Float(300.0, help="""Seconds before a reclaim that the warning goes out in the feed. Example: 300.""").tag(config=True)
    on_reclaim = Enum(
        ["keep", "stop"], "keep",
        help="""After the idle lease went back: ``keep`` the server running without a GPU (new kernels get none until a
        lease comes back), or ``stop`` it.""",
    ).tag(config=True)
    max_keep = Float(
        4 * 3600.0, help="""Longest a user may postpone reclaim ("keep" the idle GPU), seconds past each idle deadline;
        0: users may not postpone. Example: 14400 (4 h).""",
    ).tag(config=True)
    resume_on_execute = Bool(
        True, help="""When a suspended kernel starts a cell, get it a lease of the same shape (its former GPU first) and
        restore it; the cell waits meanwhile, with queue position and ETA in the feed.""",
    ).tag(config=True)
    resume_max_wait = Float(0.0, help="""Longest a resuming kernel waits in the queue, seconds; 0: as long as it takes.""").tag(config=True)
    share_grace = Float(
        60.0, help="""Seconds a process may stay over its share's memory after the warning before it is acted on.""",
    ).tag(config=True)
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
    report_activity = Bool(
        True, help="""Report GPU activity as server activity (a ``gpulease_last_activity`` setting), so the hub and its
        idle culler see a kernel computing silently on the GPU as active.""",
    ).tag(config=True)
    gaps_file = Unicode(help="""Where the learnt timeout keeps the user's idle gaps. Default: ``<jupyter data dir>/gpulease/idle-gaps.json``.""").tag(config=True)

    @default("gaps_file")
    def _gaps_file_default(self):
        return os.path.join(jupyter_data_dir(), "gpulease", "idle-gaps.json")

    # ------------------------------------------------------------------ wiring
    def initialize_settings(self):
        self.supervisor = None
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
        learn = self.gpu_idle_timeout_learn
        rule = IdleRule(timeout_s=self.gpu_idle_timeout or None, learn=learn and bool(self.gpu_idle_timeout),
                        min_s=self.gpu_idle_timeout_min if learn else 0.0,
                        max_s=self.gpu_idle_timeout_max if learn else float("inf"),
                        default_s=self.gpu_idle_timeout or 1800.0)
        settings = Settings(
            sample_interval=self.sample_interval, history_s=self.history_seconds, threshold_pct=self.gpu_idle_threshold,
            idle_rule=rule, reclaim_busy=self.reclaim_busy, action=self.reclaim_action, fallback_action=self.fallback_action,
            warn_before_s=self.warn_before, on_reclaim=self.on_reclaim, max_keep_s=self.max_keep,
            resume_on_execute=self.resume_on_execute, resume_max_wait_s=self.resume_max_wait or None,
            share_grace_s=self.share_grace, report_activity=self.report_activity, broker_url=self.broker_url,
            gaps_file=self.gaps_file,
        )
        user = os.environ.get("JUPYTERHUB_USER", "")
        self.supervisor = GPUSupervisor(
            kernel_manager=self.serverapp.kernel_manager, monitor=monitor, keeper=keeper, feed=Feed(), settings=settings,
            checkpoint=checkpoint, checkpoint_missing=missing, web_settings=self.serverapp.web_app.settings,
            stop_server=self.serverapp.stop, user=user,
        )
        self.settings["gpulease_supervisor"] = self.supervisor
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
            self.log.info("GPU leases: lease %s, %s backend, sampling every %g s, idle reclaim: %s, %s", self.lease_id,
                          self.device_backend, self.sample_interval, rule.describe(), self.reclaim_action)

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
        if self.supervisor is not None:
            await self.supervisor.start()

    async def stop_extension(self):
        if self.supervisor is not None:
            await self.supervisor.stop()

    def current_activity(self):
        """GPU work counts as activity for the server's own idle shutdown."""
        return self.supervisor is not None and self.supervisor.gpu_busy()

