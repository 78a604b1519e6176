"""A granted lease turned into what a single-user server sees, and the words the spawn page shows.

Both come from the one lease view (:mod:`jupyter_gpulease.core.lease`, :mod:`jupyter_gpulease.core.words`);
this module keeps the names the spawner and the form import. The environment is the contract with the server extension and the kernels:

``CUDA_VISIBLE_DEVICES``   the leased devices by UUID (MIG instances by their MIG UUID); empty
                           for a CPU-only server, so that no GPU is visible at all
``GPULEASE_LEASE_ID``      the lease's id ("" for a CPU-only server)
``GPULEASE_BROKER_URL``    the broker's base URL (the server extension talks to it with the
                           server's own JUPYTERHUB_API_TOKEN)
``GPULEASE_EXPIRES_AT``    POSIX seconds when the lease was due to end *when the server
                           started*. It is not updated: an extension moves the lease's end, a
                           preemption brings it forward. The live value is the lease's
                           ``expires_at`` in the broker's API (``GET api/leases/<id>``, what
                           ``jupyter gpulease leases`` shows)
``GPULEASE_SHARE``         compute share of each slice (1 = whole GPU, 0.5 = half)
``GPULEASE_MEMORY_MIB``    memory cap of each slice in MiB (comma-separated, one per device)
``GPULEASE_MEMORY_FRACTION`` the same cap as a fraction of each device's memory (``0.5``):
                           what a framework's own cap takes, e.g. PyTorch's
                           ``torch.cuda.set_per_process_memory_fraction``
``GPULEASE_GPU_UUIDS``     physical GPU UUIDs (for a MIG slice: its parent GPU)
``GPULEASE_TIER``          the lease's tier
``GPULEASE_PLACEMENT``     the whole placement as JSON

What a share's limits mean depends on the GPU (say so to users as it is):

* **MIG slice**: isolated by the hardware (memory and compute); nothing to enforce.
* **Share of a GPU served by CUDA MPS** (``GPULeaseSpawner.cuda_mps``): the MPS server
  enforces ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` (the share of the GPU's SMs, e.g. 50) and
  ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`` (a hard cap on the memory the server's processes may
  allocate, e.g. ``0=11517M``), both set here for every process of the server.
* **Share of a GPU without MPS**: nothing stops a process from using the whole GPU. The limits
  are in the environment for cooperating code (a framework's memory cap at kernel start), and
  the server extension's monitor watches the share's memory and acts on a share over it.
"""

from __future__ import annotations

import time
from typing import Any

from ..core.lease import cpu_only_environment, lease_environment, mps_environment
from ..core.words import display_model, sooner_words
from ..core.words import granted_message as _granted_message
from ..core.words import queue_message as _queue_message
from ..core.words import request_words as describe_request
from ..core.words import wait_words as describe_wait

__all__ = ["ENV_PREFIX", "cpu_only_environment", "describe_request", "describe_wait", "display_model", "granted_message",
           "lease_environment", "mps_environment", "queue_message", "sooner_words"]

ENV_PREFIX = "GPULEASE_"


def queue_message(lease: dict[str, Any], pool: dict | None = None, now: float | None = None, *, gives_up_at: float | None = None) -> str:
    """:func:`jupyter_gpulease.core.words.queue_message` at ``now`` (default: the clock)."""
    return _queue_message(lease, pool, time.time() if now is None else now, gives_up_at=gives_up_at)


def granted_message(lease: dict[str, Any], now: float | None = None) -> str:
    """:func:`jupyter_gpulease.core.words.granted_message` at ``now`` (default: the clock)."""
    return _granted_message(lease, time.time() if now is None else now)
