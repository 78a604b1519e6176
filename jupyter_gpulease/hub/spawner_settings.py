"""The lease spawner's settings (``c.GPULeaseSpawner.*``).

Declared on a class of their own, config traits only, so :class:`.spawner.GPULeaseSpawner`
reads as what it does; an admin still sets them as ``c.GPULeaseSpawner.<name>`` (traitlets
applies every config section of a spawner's classes), or on the engine's class
(``c.GPULeaseKubeSpawner.<name>``). :func:`stop_at_lease_end` is the check of ``on_lease_end``
for the engines whose servers keep their GPUs until they stop.
"""

from __future__ import annotations

import os

from traitlets import Bool, Dict, Enum, Float, Int, List, TraitError, Unicode, default, validate
from traitlets.config import LoggingConfigurable

from .options import parse_presets


def stop_at_lease_end(engine: str, why: str):
    """The ``on_lease_end`` check of an engine whose servers keep their GPUs until they stop
    (a pod, a batch job): only ``"stop"``, else a config error naming ``engine`` and ``why``
    (what keeps the GPUs). Assign it in the engine's class body."""

    @validate("on_lease_end")
    def _check_on_lease_end(self, proposal):
        if proposal.value != "stop":
            raise TraitError(f"on_lease_end must be 'stop' on {engine}: {why}, so a server that outlived its lease "
                             "would hold GPUs the broker gave to someone else")
        return proposal.value

    return _check_on_lease_end


class GPULeaseSettings(LoggingConfigurable):
    """What an admin configures for GPU leases (config traits only)."""

    broker_url = Unicode(
        help="""The lease broker's base URL, service prefix included, as the hub reaches it.

        Example: ``http://127.0.0.1:10101/services/gpulease/`` (the service's own URL) or
        ``http://127.0.0.1:8000/services/gpulease/`` (through the proxy).
        Default: the environment variable ``GPULEASE_BROKER_URL``. The hub checks it (and the
        token) when it starts and logs one line saying whether both work.
        """,
    ).tag(config=True)

    @default("broker_url")
    def _default_broker_url(self):
        return os.environ.get("GPULEASE_BROKER_URL", "")

    server_broker_url = Unicode(
        help="""The broker's URL as single-user servers reach it (``GPULEASE_BROKER_URL`` in their
        environment). Default: ``broker_url``. Set it when servers run where the hub's address
        for the broker does not work (containers, other hosts). Example:
        ``http://hub.example.org/services/gpulease/`` (through the proxy).
        """,
    ).tag(config=True)

    broker_api_token = Unicode(
        help="""Token the spawner uses to call the broker: the ``api_token`` of a service in
        ``c.JupyterHub.services`` (e.g. ``{"name": "gpulease-spawner", "api_token": ...}``) whose
        role grants the scopes ``custom:gpulease:admin`` (it asks for leases on behalf of users)
        and ``access:services!service=gpulease``. Default: the environment variable
        ``GPULEASE_HUB_TOKEN``.
        """,
    ).tag(config=True)

    @default("broker_api_token")
    def _default_broker_api_token(self):
        return os.environ.get("GPULEASE_HUB_TOKEN", "")

    broker_timeout = Float(30, help="Seconds one call to the broker may take before it counts as failed. Example: 30.").tag(config=True)

    broker_max_connections = Int(
        64,
        help="""Connections the hub opens to the broker at most, for all spawners together (one
        of them holds the event feed). The hub's own HTTP client for the broker: waits of one
        kind cannot starve releases and confirms. Example: 64.""",
    ).tag(config=True)

    lease_presets = List(
        help="""Named GPU options shown on the spawn form instead of (or besides) free choice,
        like KubeSpawner's ``profile_list``. Each entry::

            {"slug": "a100",                       # what user_options {"preset": "a100"} names
             "display_name": "One A100 (80 GB)",
             "description": "training runs",
             "request": {"gpus": 1, "model": "A100*"},   # or {"share": 0.5}, {"mig_profile": "3g.40gb"}
             "tier": "experiment",                 # optional; default: the broker's default tier
             "duration_s": 7200,                   # optional; default: the tier's default
             "max_wait_s": 1800,                   # optional
             "default": True}                      # the one chosen when user_options is empty

        ``{"slug": "cpu", "display_name": "CPU only", "cpu_only": True}`` offers a server
        without a GPU.
        """,
    ).tag(config=True)

    @validate("lease_presets")
    def _check_presets(self, proposal):
        try:
            parse_presets(proposal.value)
        except ValueError as e:
            raise TraitError(str(e)) from None
        return proposal.value

    allow_custom_request = Bool(
        True,
        help="""Let users choose model, count / share / MIG profile, tier and duration freely
        (form and REST API). False: only the ``lease_presets``.""",
    ).tag(config=True)

    allow_cpu_only = Bool(True, help="Offer a server without a GPU (no lease).").tag(config=True)

    default_user_options = Dict(
        help="""What a spawn without options asks for, when no preset is marked default.
        Example: ``{"gpus": 1}``. Empty: a CPU-only server if ``allow_cpu_only``, else one whole GPU.""",
    ).tag(config=True)

    lease_wait_timeout = Float(
        4 * 3600,
        help="""Longest time, in seconds, a spawn waits in the lease queue before it gives up
        (the broker also withdraws the lease then). The hub's ``start_timeout`` is stretched by
        this much for the spawn, so a long wait is not cut off by the hub's default of 60 s;
        ``start_timeout`` keeps its meaning for the engine's own start after the grant.
        A user may ask for a shorter wait (``max_wait_s``). A queue position whose estimate is
        later than this says that the spawn will give up first. Example: 1800 (half an hour).""",
    ).tag(config=True)

    queue_refresh_interval = Float(
        5,
        help="""Seconds between refreshes of the queue positions and ETAs of waiting spawns (one
        call for all of them; a grant, and any change in the queue, is noticed at once through
        the broker's event feed). Example: 5.""",
    ).tag(config=True)

    on_lease_end = Enum(
        ("stop", "keep"),
        "stop",
        help="""What happens to a running server when the broker or an admin ends its lease
        (expired, preempted, revoked): ``"stop"`` stops the server (after the broker's
        warning); ``"keep"`` leaves it running without a lease: its processes still see the
        GPU in their environment, so keep this for engines where something else takes the
        device away (the server extension's reclaim, or a container engine).

        The hub hears of an end through the broker's event feed and stops the server within
        about a second. When the feed is down (the broker restarting), the hub's periodic
        ``poll()`` of each server, every ``c.Spawner.poll_interval`` seconds (JupyterHub's
        default: 30), also reads the lease: that interval bounds how late a missed end stops
        a server.

        A lease moved off a sick GPU (its health, an admin's drain) is not such an end: the
        server keeps running and its suspended kernels take a healthy GPU at their next cell,
        whatever this says (except on Kubernetes and Slurm, where a server keeps the devices
        it started with and is stopped).""",
    ).tag(config=True)

    on_release_by_user = Enum(
        ("stop", "keep"),
        "keep",
        help="""What happens to a running server when its own user gives the lease back from
        inside it (``%gpu release``, ``jupyter gpulease release`` in its terminal, the server
        extension's idle reclaim) or from the my-leases page: ``"keep"`` (default) keeps the
        server running without a GPU lease (CPU only; the user may ask for a GPU again);
        ``"stop"`` stops it as for any other end.""",
    ).tag(config=True)

    cuda_mps = Bool(
        False,
        help="""The pool's GPUs are served by CUDA MPS (an ``nvidia-cuda-mps-control`` daemon per
        GPU whose pipe directory the servers see, e.g. through ``c.Spawner.environment =
        {"CUDA_MPS_PIPE_DIRECTORY": "/tmp/nvidia-mps"}``). A server holding a share then gets
        the MPS client limits ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` (its compute share) and
        ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`` (its memory), which the MPS server enforces.
        Without MPS a share's limits are not enforced by the GPU: see the README's section on
        shares. Whole GPUs and MIG slices are unaffected.""",
    ).tag(config=True)

    release_when_stopping = Bool(
        True,
        help="""When a server stops, give its lease back as soon as the stop begins, while the
        engine shuts the server's processes down (JupyterHub has already taken the server off
        its proxy), so the next spawn in the queue is granted at once; its own server takes
        longer to start than this one takes to stop. False: only once the engine reports the
        server stopped, for engines that give a device to the next server before the last one
        let go of it.""",
    ).tag(config=True)

    lease_meta = Dict(help="Extra labels stored with every lease this spawner requests. Example: ``{'hub': 'teaching'}``.").tag(config=True)

    pending_ends_file = Unicode(
        "jupyterhub-gpulease-pending.json",
        help="""File where the hub keeps the lease ends the broker has not confirmed yet (a server
        stopped while the broker was down or restarting), until the broker has them; a hub that
        starts again sends what it finds there as soon as its broker answers. A relative path is
        taken from the hub's working directory, like ``jupyterhub.sqlite``. Empty: keep them in
        memory only (a hub that exits before the broker is back then leaves those leases to the
        broker's own check with the hub). Example: ``/srv/jupyterhub/gpulease-pending.json``.""",
    ).tag(config=True)

    enforce_devices = Enum(
        ["required", "best-effort", "off"],
        "best-effort",
        help="""Whether each single-user server may open only the GPUs it leases (local-process
        spawners: a device cgroup per server that allows the device nodes of its leases and
        denies the pool's other GPUs, changed with every grant and end; kernels and terminals
        inherit it). Needs root for the hub and either cgroup v1's ``devices`` controller or
        systemd on cgroup v2; the hub logs one line at start saying which is in force.

        ``"required"``: where neither works, GPU servers do not start (the spawn fails saying
        why). ``"best-effort"`` (default): enforce where the host allows it, else run servers as
        before (every GPU of the host can be opened) and say so in that line; the default because
        it never stops a hub that ran before (hub not root, a container without the cgroup
        mount). ``"off"``: never enforce.""",
    ).tag(config=True)

    device_cgroup_parent = Unicode(
        "jupyter-gpulease",
        help="""Name of the parent cgroup (cgroup v1) or unit-name prefix (systemd scopes) of the
        per-server device cgroups: ``<devices mount>/<this>/<user>`` (``<user>:<server>`` for named
        servers). Two hubs on one host need different names: a hub takes the host's lock of its
        name at start (a file in ``/run/lock``), and a second hub with the same name gets no
        device access (its GPU spawns fail where ``enforce_devices = "required"``) and says why.
        At its stop a hub removes the empty cgroups and the parent. Example: ``jupyter-gpulease``.""",
    ).tag(config=True)
