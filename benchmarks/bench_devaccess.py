"""Device access following the lease: what it costs a spawn, and how fast an end denies the GPU.

One real JupyterHub + configurable-http-proxy + broker, the lease spawner for local processes on
a pool of GPUs that are real character devices (``mknod``, NVIDIA's major number) named in the
pool's declaration, cgroup v1's devices controller (root). Two users on the same hub, spawns
alternating so both see the same load: "enforced" gets its device cgroup (made, rules written,
the server's process moved in), "plain" skips it (the same spawner with enforcement off for it).

1. spawn-to-ready (POST /users/{name}/server until ready), medians of both and their ratio;
   the hub polls a new server every 20-50 ms (as in bench_spawn.py), so the figures show the
   spawners' own cost;
2. end-to-deny: a probe process in the enforced server's cgroup opens her GPU's node in a loop;
   the time from just before the lease's release is sent to the broker until the first open
   that fails with EPERM (one monotonic clock for both processes);
3. the device-cgroup work alone, without a hub (make + rules, move a process in, change the
   rules, remove), medians of 50: spawn-to-ready on a loaded machine varies by more than it.

    sudo .venv/bin/python benchmarks/bench_devaccess.py [--rounds 6]

Saves benchmarks/results/devaccess.json.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
sys.path.insert(0, str(HERE))

from bench_spawn import spawn_to_ready  # noqa: E402

from test_cgroup_e2e import _v1_root, make_hub, make_nodes  # noqa: E402

BENCH_SPAWNER = '''
import jupyterhub.utils as _hub_utils
from jupyter_gpulease.hub.spawner import GPULeaseSimpleLocalProcessSpawner

_backoff = _hub_utils.exponential_backoff


async def _fine_backoff(pass_func, fail_message, start_wait=0.2, scale_factor=2, max_wait=5, timeout=10, timeout_tolerance=0.1, *args, **kwargs):
    return await _backoff(pass_func, fail_message, 0.02, 1.0, 0.05, timeout, timeout_tolerance, *args, **kwargs)


_hub_utils.exponential_backoff = _fine_backoff


class BenchSpawner(GPULeaseSimpleLocalProcessSpawner):
    """User 'plain': the same lease spawner, without a device cgroup."""

    def _server_devices(self):
        if self.user.name == "plain":
            return None
        return super()._server_devices()
'''

PROBE = r"""
import errno, os, sys, time
path = sys.argv[1]
sys.stdout.write("ready\n"); sys.stdout.flush()
sys.stdin.readline()  # moved into the cgroup: go
while True:
    try:
        os.close(os.open(path, os.O_RDONLY))
    except OSError as e:
        if e.errno == errno.EPERM:
            print(repr(time.monotonic()), flush=True)
            break
    time.sleep(0.0005)
"""


def lease_of(hub, token, user):
    code, body = hub.broker_get(f"api/leases?user={user}", token)
    assert code == 200, body
    return next(x for x in body["leases"] if x["state"] == "active")


def end_to_deny(hub, token, root: str, node_of: dict[str, str]) -> float:
    lease = lease_of(hub, token, "enforced")
    path = node_of[lease["placement"]["slices"][0]["gpu_uuid"]]
    probe = subprocess.Popen([sys.executable, "-c", PROBE, path], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert probe.stdout.readline().strip() == "ready"
        with open(os.path.join(root, "enforced", "cgroup.procs"), "w") as f:
            f.write(str(probe.pid))
        probe.stdin.write("go\n")
        probe.stdin.flush()
        time.sleep(0.2)  # it opens its GPU meanwhile (ENXIO)
        assert probe.poll() is None, "the probe was denied before the lease ended"
        t0 = time.monotonic()
        code, body = hub.request("POST", hub.broker.url + f"api/leases/{lease['id']}/release", {"reason": "bench"}, token=token)
        assert code == 200, body
        line = probe.stdout.readline()
        return float(line) - t0
    finally:
        probe.kill()
        probe.wait()


def cgroup_ops(root_mount: str, parent: str, nodes: list[str], reps: int = 50) -> dict[str, float]:
    """The device-cgroup work of one spawn and one change, alone: make the cgroup and write the
    rules (a server without a lease: every GPU denied), move a process in, change the rules
    (a grant), remove it after the process left. Medians in ms."""
    from jupyter_gpulease.hub import cgroups, devaccess

    backend = cgroups.V1Devices(root_mount, parent)
    pool = {"devices": [{"uuid": f"G{i}", "index": i, "device": p} for i, p in enumerate(nodes)]}
    pool_nodes = devaccess.pool_gpu_nodes(pool, stat=os.stat)
    lease = {"state": "active", "placement": {"slices": [{"gpu_uuid": "G0"}]}}
    allowed = devaccess.lease_nodes(lease, pool_nodes)
    out: dict[str, list[float]] = {"prepare": [], "attach": [], "change": [], "remove": []}
    for _ in range(reps):
        child = subprocess.Popen(["sleep", "30"])
        try:
            t = time.perf_counter()
            backend.prepare("bench", [], devaccess.denied_nodes([], pool_nodes))
            out["prepare"].append(time.perf_counter() - t)
            t = time.perf_counter()
            backend.attach("bench", child.pid)
            out["attach"].append(time.perf_counter() - t)
            t = time.perf_counter()
            backend.apply("bench", allowed, devaccess.denied_nodes(allowed, pool_nodes))
            out["change"].append(time.perf_counter() - t)
        finally:
            child.kill()
            child.wait()
        t = time.perf_counter()
        while not backend.remove("bench"):  # the killed child leaves the cgroup a moment later
            time.sleep(0.001)
        out["remove"].append(time.perf_counter() - t)
    return {k: round(statistics.median(v) * 1000, 3) for k, v in out.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=6, help="spawns per user and lease ends (default 6)")
    ap.add_argument("--out", default=str(HERE / "results" / "devaccess.json"))
    args = ap.parse_args(argv)
    mount = _v1_root()
    if mount is None:
        print("needs root and cgroup v1's devices controller", file=sys.stderr)
        return 2
    parent = f"jupyter-gpulease-bench-{secrets.token_hex(4)}"
    root = os.path.join(mount, parent)
    with tempfile.TemporaryDirectory(prefix="bench-devaccess-") as tmp_name:
        tmp = Path(tmp_name)
        (tmp / "bench_devaccess_spawner.py").write_text(BENCH_SPAWNER)
        nodes = make_nodes(tmp / "dev", 2)
        ops = cgroup_ops(mount, parent, nodes)
        print(f"device-cgroup work alone (median ms): {ops}", flush=True)
        pool = [{"node": "n1", "model": "L4", "count": 2, "memory_mib": 23034, "devices": nodes}]
        hub, sim = make_hub(tmp, pool, parent, users=("enforced", "plain"), spawner_class="bench_devaccess_spawner.BenchSpawner")
        node_of = dict(zip(sim.uuids, nodes, strict=True))
        times: dict[str, list[float]] = {"enforced": [], "plain": []}
        deny: list[float] = []
        try:
            tokens = {u: hub.create_token(u) for u in times}
            for user in times:  # warm-up, not counted
                spawn_to_ready(hub, user, {"gpus": 1})
                hub.api("DELETE", f"users/{user}/server")
                hub.wait_gone(user)
            for i in range(args.rounds):
                order = ("enforced", "plain") if i % 2 == 0 else ("plain", "enforced")
                for user in order:
                    times[user].append(spawn_to_ready(hub, user, {"gpus": 1}))
                    if user == "enforced":
                        deny.append(end_to_deny(hub, tokens[user], root, node_of))
                    hub.api("DELETE", f"users/{user}/server")
                    hub.wait_gone(user)
                print(f"round {i + 1}: enforced {times['enforced'][-1]:.3f} s, plain {times['plain'][-1]:.3f} s, "
                      f"end-to-deny {deny[-1] * 1000:.1f} ms", flush=True)
        finally:
            hub.close()
            for name in ("enforced", "bench", ""):
                try:
                    os.rmdir(os.path.join(root, name))
                except OSError:
                    pass

    med = {k: statistics.median(v) for k, v in times.items()}
    result = {
        "what": "spawn-to-ready with and without the server's device cgroup (same hub, alternating, hub readiness polled "
                "every 20-50 ms); end-to-deny: from sending the lease's release to the first EPERM of a process in the server's cgroup",
        "command": "python benchmarks/bench_devaccess.py" + "".join(f" {a}" for a in (argv if argv is not None else sys.argv[1:])),
        "mechanism": "cgroup v1 devices controller",
        "rounds": args.rounds,
        "spawn_seconds": times,
        "spawn_median_s": med,
        "spawn_ratio_enforced_to_plain": med["enforced"] / med["plain"],
        "end_to_deny_ms": [round(d * 1000, 1) for d in deny],
        "end_to_deny_median_ms": round(statistics.median(deny) * 1000, 1),
        "end_to_deny_max_ms": round(max(deny) * 1000, 1),
        "cgroup_ops_median_ms": ops,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nmedian spawn-to-ready: enforced {med['enforced']:.3f} s, plain {med['plain']:.3f} s "
          f"(ratio {result['spawn_ratio_enforced_to_plain']:.3f}); end-to-deny median {result['end_to_deny_median_ms']} ms, "
          f"max {result['end_to_deny_max_ms']} ms")
    print(f"saved {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
