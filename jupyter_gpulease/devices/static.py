"""A declared inventory with no telemetry: GPUs the broker schedules but cannot see.

For pools on other nodes (Kubernetes, Slurm) where usage is reported by the servers that
hold the leases, not sampled here. Config::

    {"gpus": [{"node": "gpu-01", "model": "A100-SXM4-80GB", "count": 8, "memory_mib": 81920}, ...]}

:meth:`StaticBackend.sample` returns one sample per GPU and MIG instance with the declared
memory total and every measured figure ``None`` ("not available").
"""

from __future__ import annotations

import time
from typing import Any

from ..core.model import GPU
from .base import Clock, DeviceBackend, DeviceSample, check_config_keys
from .declared import parse_inventory


class StaticBackend(DeviceBackend):
    """GPUs from config; nothing measured."""

    name = "static"

    def __init__(self, config: dict[str, Any] | None = None, *, clock: Clock | None = None):
        config = dict(config or {})
        check_config_keys("static", config, ("gpus", "node"))
        if "gpus" not in config:
            raise ValueError("static device backend: config needs 'gpus', the list of GPUs in the pool, e.g. "
                             "[{'node': 'gpu-01', 'model': 'A100-SXM4-80GB', 'count': 8, 'memory_mib': 81920}]")
        self._gpus = parse_inventory(config["gpus"], default_node=config.get("node") or "localhost", uuid_prefix="static")
        self._clock = clock or time.time

    def inventory(self) -> list[GPU]:
        return list(self._gpus)

    def sample(self) -> dict[str, DeviceSample]:
        now = self._clock()
        out: dict[str, DeviceSample] = {}
        for g in self._gpus:
            out[g.uuid] = DeviceSample(uuid=g.uuid, timestamp=now, memory_total_mib=g.memory_mib)
            for m in g.mig:
                out[m.uuid] = DeviceSample(uuid=m.uuid, timestamp=now, memory_total_mib=m.memory_mib, parent_uuid=g.uuid)
        return out
