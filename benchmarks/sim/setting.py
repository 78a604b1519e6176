"""The contended Alibaba setting every script here replays (the same as ``alibaba_8x8_c4``):
the Alibaba 2023 sample from trace day 115 on, arrivals compressed 4x, on 8 nodes x 8
GPUs drawn from the trace's inventory with seed 0."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from jupyter_gpulease.sim.traces import SAMPLE_FILES, default_traces_dir, load_alibaba_nodes, load_alibaba_pods
from jupyter_gpulease.sim.workload import alibaba_workload, pool_from_inventory

DESCRIPTION = "pool 8 nodes x 8 GPUs (seed 0); arrivals from trace day 115, compressed 4x"


def alibaba_contended(compress: float = 4.0):
    """(workload, pool) of the contended Alibaba replay (``compress``: another load on the same pool)."""
    d = default_traces_dir()
    wl = alibaba_workload(load_alibaba_pods(os.path.join(d, SAMPLE_FILES["alibaba"])), compress=compress, window_days=(115.0, None))
    pool = pool_from_inventory(load_alibaba_nodes(os.path.join(d, SAMPLE_FILES["alibaba-nodes"])), n_nodes=8, gpus_per_node=8, seed=0)
    return wl, pool
