"""Device backends: where the pool's GPUs and their usage figures come from.

* ``nvml`` — real NVIDIA GPUs through nvidia-ml-py (:mod:`.nvml`);
* ``simulated`` — a declared pool with driven utilization and processes (:mod:`.simulated`);
* ``static`` — a declared pool with no telemetry (:mod:`.static`);
* ``auto`` — ``nvml`` when it finds GPUs, else ``simulated``;
* ``kubernetes`` — a cluster's GPU nodes, from their labels and capacity (:mod:`.kubernetes`);
* ``slurm`` — a Slurm cluster's GPU nodes, from ``scontrol show node`` (:mod:`.slurm`).

Build one with :func:`get_backend`. ``inventory()`` and ``sample()`` block: call them in an
executor from async code. Importing this package never touches the NVIDIA driver.
"""

from .base import BACKEND_NAMES, DeviceBackend, DeviceHealth, DeviceSample, DeviceUnavailable, ProcessSample, get_backend, processes_by_pid
from .declared import parse_inventory, parse_mig_profile

__all__ = [
    "BACKEND_NAMES",
    "DeviceBackend",
    "DeviceHealth",
    "DeviceSample",
    "DeviceUnavailable",
    "ProcessSample",
    "get_backend",
    "parse_inventory",
    "parse_mig_profile",
    "processes_by_pid",
]
