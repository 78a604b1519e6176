"""Replay speed on the whole Alibaba sample (8 nodes x 8 GPUs, arrivals compressed 4x):
events per second per policy, then a cProfile of the gpulease replay.

    python benchmarks/sim/profile_replay.py > benchmarks/sim/profile.txt

"static (reservation_depth 1e6)" is the first static configuration this simulator used (a
reservation for every queued lease); "static" is the current one (no reservations: in the
core, backfill off already means nothing passes the head of the queue). "gpulease" is the
batch-pod policy ``simulate`` replays on this trace.
"""

import cProfile
import io
import os
import pstats
import re
from dataclasses import replace

from jupyter_gpulease.sim import policies as P
from jupyter_gpulease.sim.replay import replay
from jupyter_gpulease.sim.traces import SAMPLE_FILES, default_traces_dir, load_alibaba_nodes, load_alibaba_pods
from jupyter_gpulease.sim.workload import alibaba_workload, pool_from_inventory

d = default_traces_dir()
pods = load_alibaba_pods(os.path.join(d, SAMPLE_FILES["alibaba"]))
nodes = load_alibaba_nodes(os.path.join(d, SAMPLE_FILES["alibaba-nodes"]))
wl = alibaba_workload(pods, compress=4)
pool = pool_from_inventory(nodes, n_nodes=8, gpus_per_node=8, seed=0)
st = P.static()
before = replace(st, name="static (reservation_depth 1e6)", policy=replace(st.policy, reservation_depth=1_000_000))
print(f"whole shared Alibaba sample: {len(wl.jobs)} GPU pods, {len(pool)} GPUs, arrivals x4")
batch = P.gpulease_batch()  # what simulate replays on this trace
for sp in (before, st, P.static_backfill(), batch):
    r = replay(wl, pool, sp)
    print(f"{sp.name:32s} events {r.events:6d}  ticks {r.ticks:6d}  wall {r.wall_s:6.1f} s  events/s {r.events_per_s:7.0f}")
pr = cProfile.Profile()
pr.enable()
replay(wl, pool, batch)
pr.disable()
buf = io.StringIO()
pstats.Stats(pr, stream=buf).sort_stats("cumulative").print_stats(20)
# keep the figures, not this machine's paths
print(re.sub(r"\S*/(jupyter_gpulease/|python3\.\d+/)", r"\1", buf.getvalue()))
