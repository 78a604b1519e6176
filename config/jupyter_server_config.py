# The GPU lease extension of each single-user server: an annotated example.
#
# The extension is enabled when jupyter-gpulease is installed (a jupyter_server_config.d file in
# the wheel). Put these lines in the single-user servers' jupyter_server_config.py (e.g.
# /etc/jupyter/jupyter_server_config.py in the image, or $PREFIX/etc/jupyter/ of the venv).
# What the spawner passes in the environment (GPULEASE_LEASE_ID, GPULEASE_BROKER_URL,
# CUDA_VISIBLE_DEVICES, JUPYTERHUB_API_TOKEN) needs no configuration.

c = get_config()  # noqa: F821 - provided by Jupyter
#
# Each part of the extension has its own settings: c.GPULeaseExtension (where things are, the
# monitor, heartbeats, cuda-checkpoint), c.GPUIdleRule (when a GPU is idle), c.ReclaimActions
# (what reclaim does), c.Resumer (resume), c.GPUUsage (activity). The older
# c.GPULeaseExtension.<name> of a setting that moved still works.

# ------------------------------------------------------------------ the monitor
# Where GPU figures come from: "nvml" on GPU machines; the demo uses "simulated" (set through
# GPULEASE_DEVICE_BACKEND / GPULEASE_DEVICE_CONFIG by the demo's hub config).
# c.GPULeaseExtension.device_backend = "nvml"
c.GPULeaseExtension.sample_interval = 1.0  # seconds; NVML runs in a worker thread
c.GPULeaseExtension.history_seconds = 600  # what the GPU panel draws

# ------------------------------------------------------------------ when is a GPU idle
# A kernel's GPU is idle while its processes keep under 5% of the GPU's compute busy and it
# runs no cell (reclaim_busy = True: a cell that does not use the GPU does not protect it).
c.GPUIdleRule.gpu_idle_threshold = 5.0
c.ReclaimActions.reclaim_busy = False
# How long a GPU may sit idle: learnt per user from their own idle gaps (the time from the GPU
# falling idle to its next use), 2 minutes until the first gap; 0 turns idle reclaim off. These
# values are the defaults: `jupyter gpulease simulate --trace notebook` replays them as its
# gpulease row, and `--server-config` replays this file. (The older c.GPULeaseExtension.gpu_idle_*
# names still work.)
c.GPUIdleRule.gpu_idle_timeout = 120
c.GPUIdleRule.gpu_idle_timeout_learn = True  # False: gpu_idle_timeout, fixed
# The learnt timeout is the candidate that costs least in idle GPU holding plus this much per
# regretted reclaim (the GPU needed again within 10 min), in seconds of idle holding: little when
# the reclaim suspends (the state waits in host memory), a lot when it restarts the kernel
# (also where suspend cannot work and fallback_action restarts).
c.GPUIdleRule.gpu_idle_regret_suspend = 120
c.GPUIdleRule.gpu_idle_regret_restart = 1800
c.GPUIdleRule.gpu_idle_timeout_candidates = [60, 120, 180, 300, 420, 600, 900, 1200, 1800, 2700, 3600]
c.GPUIdleRule.gpu_idle_timeout_min = 60  # admin bounds of the learnt timeout, seconds
c.GPUIdleRule.gpu_idle_timeout_max = 4 * 3600

# ------------------------------------------------------------------ what reclaim does
# "suspend" moves an idle kernel's GPU memory to host memory with NVIDIA's cuda-checkpoint
# (driver >= 550, x86-64, no MIG): nothing is lost, the next cell gets a GPU back and goes on.
# Where it cannot work, fallback_action is used and the user is told why.
c.ReclaimActions.reclaim_action = "suspend"  # suspend | restart | interrupt | shutdown | notify
c.ReclaimActions.fallback_action = "restart"  # restart | interrupt | shutdown | notify
# c.GPULeaseExtension.cuda_checkpoint = "/usr/bin/cuda-checkpoint"
# On simulated GPUs (the demo) the suspend is simulated (jupyter_gpulease.devices.simcheckpoint)
# unless cuda_checkpoint is set; the status and the messages say so. Never used with real GPUs.
c.ReclaimActions.warn_before = 300  # seconds of warning in the notebook before the action
# When no kernel holds GPU memory, the lease goes back to the pool as "reclaimed" after this long
# without GPU use (0: the kernels' idle timeout); the server keeps running without a GPU ("keep"),
# or stops ("stop"). Its kernels' next cell then asks for a GPU again and waits its turn.
c.ReclaimActions.unused_lease_timeout = 0
c.ReclaimActions.on_reclaim = "keep"
# Users may postpone reclaim ("%gpu keep 2h", the widget's Keep button) by at most this much.
c.ReclaimActions.max_keep = 4 * 3600
# A suspended kernel that starts a cell asks for a GPU again (its former GPU first).
c.Resumer.resume_on_execute = True
# A process over its share's memory is warned, then acted on after this many seconds.
c.ReclaimActions.share_grace = 60

# ------------------------------------------------------------------ reporting
# Heartbeats with usage to the broker; keep it well under the broker's heartbeat_timeout_s.
c.GPULeaseExtension.heartbeat_interval = 30
# GPU work counts as server activity for the hub and jupyterhub-idle-culler.
c.GPUUsage.report_activity = True
