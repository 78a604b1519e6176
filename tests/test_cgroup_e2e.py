"""Device access follows the lease, end to end, on cgroup v1's devices controller.

A real JupyterHub with the lease spawner for local processes, the broker as its managed service
on a three-GPU pool whose GPUs are real character devices with NVIDIA's major number (made with
``mknod`` in the test's folder and named in the pool's declaration), real single-user servers
with the extension, a real kernel in alice's server that tries to open the nodes, and a process
of her server that outlives it. Without a driver an allowed open reaches the (absent) driver and
fails with ENXIO; a denied one fails with EPERM; a GPU whose node has /dev/full's numbers opens
when allowed. Needs root and a writable v1 devices
controller; skipped elsewhere.
"""

from __future__ import annotations

import json
import os
import secrets
import stat
import time
from pathlib import Path

import pytest

from hubharness import wait_for
from jupyter_gpulease.hub import cgroups
from leasehub import LeaseHub
from serverutil import SimGPUs

pytestmark = pytest.mark.timeout(600)

MINOR0 = 240  # high minors: no real GPU of a host is denied by accident


def _v1_root() -> str | None:
    if os.geteuid() != 0:
        return None
    mount = cgroups.v1_devices_mount()
    return mount if mount and os.access(mount, os.W_OK) else None


requires_v1 = pytest.mark.skipif(_v1_root() is None, reason="needs root and cgroup v1's devices controller")


def make_nodes(folder: Path, n: int) -> list[str]:
    folder.mkdir()
    paths = []
    for i in range(n):
        p = folder / f"nvidia{i}"
        os.mknod(p, stat.S_IFCHR | 0o666, os.makedev(195, MINOR0 + i))
        paths.append(str(p))
    return paths


def make_hub(tmp: Path, pool: list[dict], parent: str, mode: str = "required", *, users=("alice", "bob"),
             **hub_kw) -> tuple[LeaseHub, SimGPUs]:
    """(hub, the simulated GPUs): device access enforced (``mode``) in cgroups under ``parent``,
    servers that send a heartbeat every 5 s, a broker that waits 120 s for one."""
    sim = SimGPUs(str(tmp / "sim-gpus.json"), pool)
    hub = LeaseHub(
        tmp,
        users=users,
        pool=pool,
        server_devices=sim.config,
        server_config=["c.GPULeaseExtension.heartbeat_interval = 5"],
        broker_config=["c.GPULeaseBroker.heartbeat_timeout_s = 120"],
        hub_config=[
            f"c.GPULeaseSpawner.enforce_devices = {mode!r}",
            f"c.GPULeaseSpawner.device_cgroup_parent = {parent!r}",
            "c.Spawner.default_url = '/tree'",
            "c.Spawner.poll_interval = 2",
            "c.Spawner.http_timeout = 90",
        ],
        start_timeout=120,
        **hub_kw,
    )
    return hub.start(), sim


def pool_hub(tmp: Path, n: int) -> tuple[LeaseHub, str, dict[str, str]]:
    """(hub, its cgroups' parent folder, device node by GPU uuid): ``n`` L4s on real device nodes,
    device access required, under a parent of its own."""
    nodes = make_nodes(tmp / "dev", n)
    pool = [{"node": "n1", "model": "L4", "count": n, "memory_mib": 23034, "devices": nodes}]
    parent = f"jupyter-gpulease-test-{secrets.token_hex(4)}"
    hub, sim = make_hub(tmp, pool, parent)
    return hub, os.path.join(_v1_root(), parent), dict(zip(sim.uuids, nodes, strict=True))


def remove_cgroups(root: str, names) -> None:
    """What a failed test left under ``root`` (the users' cgroups, then the parent)."""
    for name in (*names, ""):
        path = os.path.join(root, name)
        if os.path.isdir(path):
            try:
                os.rmdir(path)
            except OSError:
                pass


# opens each of ``paths`` and writes what it saw (errno names) to ``out``
PROBE = """
import errno, json, os
def probe(p):
    try:
        os.close(os.open(p, os.O_RDONLY))
    except OSError as x:
        return errno.errorcode.get(x.errno, str(x.errno))
    return "opened"
def report(paths, out):
    json.dump({p: probe(p) for p in paths}, open(out + ".tmp", "w")); os.replace(out + ".tmp", out)
"""

class Prober:
    """Runs ``open()`` of each node in a kernel of the user's server; returns errno names."""

    def __init__(self, hub: LeaseHub, user, token, kernel_id, paths, folder: Path):
        self.hub, self.user, self.token, self.kernel_id, self.paths, self.folder = hub, user, token, kernel_id, paths, folder
        self.n = 0

    def __call__(self) -> dict[str, str]:
        self.n += 1
        out = self.folder / f"probe-{self.n}.json"
        self.hub.run_cell(self.user, self.token, self.kernel_id, f"{PROBE}report({self.paths!r}, {str(out)!r})\n")
        wait_for(out.exists, 60, "the kernel did not run the probe")
        return json.loads(out.read_text())


@requires_v1
def test_a_server_opens_only_the_gpus_it_leases_and_follows_its_leases(tmp_path):
    hub, root, node_of = pool_hub(tmp_path, 3)
    nodes = list(node_of.values())
    try:
        assert "GPU device access follows the lease (required): cgroup v1 devices controller" in hub.log_tail(400)
        alice, bob = hub.create_token("alice"), hub.create_token("bob")
        assert hub.spawn("alice", {"gpus": 1})[0] in (201, 202)
        assert hub.spawn("bob", {"gpus": 1})[0] in (201, 202)
        wait_for(lambda: hub.ready_server("alice") and hub.ready_server("bob"), 180, "the servers did not start")

        def live(user, token):
            code, body = hub.broker_get(f"api/leases?user={user}", token)
            assert code == 200, body
            return [x for x in body["leases"] if x["state"] == "active"]

        (a_lease,), (b_lease,) = live("alice", alice), live("bob", bob)
        mine, bobs = a_lease["placement"]["slices"][0]["gpu_uuid"], b_lease["placement"]["slices"][0]["gpu_uuid"]
        free = next(u for u in node_of if u not in (mine, bobs))
        # each server's process sits in a cgroup of its own under the hub's parent
        for user in ("alice", "bob"):
            with open(os.path.join(root, user, "cgroup.procs")) as f:
                assert f.read().split(), f"no process in {user}'s cgroup"

        kernel = hub.start_kernel("alice", alice)
        probe = Prober(hub, "alice", alice, kernel, nodes, tmp_path)
        seen = probe()
        # her GPU's open reaches the driver (none here: ENXIO); bob's and the free one are denied
        assert seen == {node_of[mine]: "ENXIO", node_of[bobs]: "EPERM", node_of[free]: "EPERM"}, seen

        # her lease ends (she releases it): a new open of her former GPU is denied, her server runs on
        code, body = hub.request("POST", hub.broker.url + f"api/leases/{a_lease['id']}/release", {"reason": "done with it"}, token=alice)
        assert code == 200, body
        seen = wait_for(lambda: (s := probe())[node_of[mine]] == "EPERM" and s, 60, "her former GPU was not denied")
        assert seen == dict.fromkeys(nodes, "EPERM"), seen
        assert hub.ready_server("alice")

        # she takes a lease from inside her server, onto the free GPU: that one opens
        wait_for(lambda: hub.gpu_api("alice", alice, "status")[1]["lease"] is None, 60, "her server did not see its lease end")
        code, body = hub.gpu_api("alice", alice, "lease", "POST", {"gpus": 1, "require_gpus": [free]})
        assert code == 201, body
        seen = wait_for(lambda: (s := probe())[node_of[free]] == "ENXIO" and s, 60, "the GPU she took was not allowed")
        assert seen == {node_of[mine]: "EPERM", node_of[bobs]: "EPERM", node_of[free]: "ENXIO"}, seen

        # stopped servers: their cgroups go with them, and the hub's stop takes the parent
        for user in ("alice", "bob"):
            assert hub.api("DELETE", f"users/{user}/server")[0] in (202, 204)
        wait_for(lambda: not os.path.exists(os.path.join(root, "alice")) and not os.path.exists(os.path.join(root, "bob")),
                 60, "the servers' cgroups were not removed")
        hub.close()
        assert not os.path.exists(root), "the hub's stop left its empty parent cgroup"
    finally:
        hub.close()
        remove_cgroups(root, ("alice", "bob"))


# what a leftover process sees, every 50 ms, one JSON line each: {"t": time, "seen": {node: errno name}}
WATCHER = PROBE + """
import sys, time
out, stop, paths = sys.argv[1], sys.argv[2], sys.argv[3:]
with open(out, "a") as f:
    while not os.path.exists(stop):
        f.write(json.dumps({"t": time.time(), "seen": {p: probe(p) for p in paths}}) + "\\n")
        f.flush()
        time.sleep(0.05)
"""


def read_lines(path: Path) -> list[dict]:
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]
    except OSError:
        return []


@requires_v1
def test_a_leftover_process_of_a_stopped_server_opens_no_gpu_within_a_second_while_another_user_holds_it(tmp_path):
    """alice's server takes a lease itself (as ``%gpu request`` does) on a GPU whose node has
    /dev/full's numbers (so an allowed open really succeeds), starts a process in a session of its
    own that outlives the server (``setsid``/``nohup``), and stops; bob then takes that GPU. From
    within a second of the stop, every new open the leftover makes of a pool GPU or of the control
    nodes (nvidiactl, nvidia-modeset) is refused, for as long as it lives; bob's opens succeed."""
    import subprocess
    import sys

    folder = tmp_path / "dev"
    folder.mkdir()
    full = folder / "full-as-gpu"
    os.mknod(full, stat.S_IFCHR | 0o666, os.makedev(1, 7))  # /dev/full's numbers: an allowed open succeeds
    other = folder / "nvidia1"
    os.mknod(other, stat.S_IFCHR | 0o666, os.makedev(195, MINOR0 + 1))
    control = []
    for name, minor in (("nvidiactl", 255), ("nvidia-modeset", 254)):  # the numbers the hub allows with every lease
        os.mknod(folder / name, stat.S_IFCHR | 0o666, os.makedev(195, minor))
        control.append(str(folder / name))
    pool = [{"node": "n1", "model": "L4", "count": 2, "memory_mib": 23034, "devices": [str(full), str(other)]}]
    parent = f"jupyter-gpulease-test-{secrets.token_hex(4)}"
    root = os.path.join(_v1_root(), parent)
    hub, sim = make_hub(tmp_path, pool, parent)
    gpu = sim.uuids[0]
    nodes = [str(full), str(other), *control]
    out, stop = tmp_path / "leftover.jsonl", tmp_path / "leftover.stop"
    try:
        alice, bob = hub.create_token("alice"), hub.create_token("bob")
        for user in ("alice", "bob"):
            assert hub.spawn(user, {"kind": "cpu"})[0] in (201, 202)
        wait_for(lambda: hub.ready_server("alice") and hub.ready_server("bob"), 120, "the CPU-only servers did not start")
        code, body = hub.gpu_api("alice", alice, "lease", "POST", {"gpus": 1, "require_gpus": [gpu]})
        assert code == 201, body
        kernel = hub.start_kernel("alice", alice)
        code = ("import subprocess, sys\n"
                f"subprocess.Popen([sys.executable, '-c', {WATCHER!r}, {str(out)!r}, {str(stop)!r}, *{nodes!r}], "
                "start_new_session=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\n")
        hub.run_cell("alice", alice, kernel, code)
        before = wait_for(lambda: (ls := read_lines(out)) and ls[-1]["seen"][str(full)] == "opened" and ls[-1]["seen"], 60,
                          f"the leftover process did not open her GPU while her server held it ({out.name}: see its lines)")
        assert before == {str(full): "opened", str(other): "EPERM", control[0]: "ENXIO", control[1]: "ENXIO"}, before

        asked = time.time()
        assert hub.api("DELETE", "users/alice/server")[0] in (202, 204)
        wait_for(lambda: hub.server_model("alice") is None, 60, "her server did not stop")
        stopped = time.time()
        code, body = hub.gpu_api("bob", bob, "lease", "POST", {"gpus": 1, "require_gpus": [gpu], "max_wait_s": 60})
        assert code == 201, body
        wait_for(lambda: [x for x in hub.leases("bob", "active") if x["placement"]["slices"][0]["gpu_uuid"] == gpu], 60,
                 "bob did not get her former GPU")
        run = subprocess.run([sys.executable, "-c", IN_CGROUP, os.path.join(root, "bob", "cgroup.procs"), str(full)],
                             capture_output=True, text=True, timeout=30, check=True)
        assert run.stdout.split()[0] == "opened", run.stdout  # bob's server opens it
        time.sleep(3)  # the leftover keeps trying while bob holds the GPU

        lines = [ln for ln in read_lines(out) if ln["t"] > asked]
        denied = next((ln["t"] for ln in lines if set(ln["seen"].values()) == {"EPERM"}), None)
        assert denied is not None, lines[-3:]
        print(f"leftover denied {denied - stopped:+.3f} s after the hub said her server stopped "
              f"({denied - asked:.3f} s after the stop was asked for)")
        assert denied - stopped <= 1.0, f"the leftover still opened a GPU {denied - stopped:.3f} s after the stop"
        after = [ln for ln in lines if ln["t"] >= denied and set(ln["seen"].values()) != {"EPERM"}]
        assert not after, f"the leftover opened a node again: {after[:3]}"
        assert os.path.isdir(os.path.join(root, "alice")), "the cgroup went while a process of the server lived on"
        stop.touch()  # the leftover ends: her cgroup can go
        wait_for(lambda: not os.path.exists(os.path.join(root, "alice")), 30, "her cgroup was not removed")
    finally:
        stop.touch()
        hub.close()
        remove_cgroups(root, ("alice", "bob"))


SELF_TAKEN_TRIES = 20  # two users at a time: ten rounds

# moves itself into a server's cgroup (as root) and opens the node until it is allowed or a second
# has passed: prints what it saw last and when (seconds after its start)
IN_CGROUP = """
import errno, os, sys, time
procs, node = sys.argv[1], sys.argv[2]
with open(procs, "w") as f:
    f.write(str(os.getpid()))
t0 = time.monotonic()
while True:
    try:
        os.close(os.open(node, os.O_RDONLY))
        seen = "opened"
    except OSError as x:
        seen = errno.errorcode.get(x.errno, str(x.errno))
    if seen != "EPERM" or time.monotonic() - t0 > 1.0:
        break
    time.sleep(0.01)
print(seen, round(time.monotonic() - t0, 3))
"""


@requires_v1
def test_a_lease_a_server_takes_itself_right_after_a_cpu_only_spawn_opens_within_a_second(tmp_path):
    """Twenty CPU-only spawns (two users at a time), each followed at once by a lease the server
    takes itself (as ``%gpu request`` does): every time, the GPU opens in the server's cgroup
    within a second of the lease's answer (the hub learns of such leases from its event feed)."""
    import subprocess
    import sys

    hub, root, node_of = pool_hub(tmp_path, 2)
    users = ("alice", "bob")
    seen = []
    try:
        tokens = {u: hub.create_token(u) for u in users}
        for _ in range(SELF_TAKEN_TRIES // len(users)):
            for u in users:
                assert hub.spawn(u, {"kind": "cpu"})[0] in (201, 202)
            wait_for(lambda: all(hub.ready_server(u) for u in users), 120, "the CPU-only servers did not start")
            for u in users:
                code, body = hub.gpu_api(u, tokens[u], "lease", "POST", {"gpus": 1})
                assert code == 201, body
                code, mine = hub.broker_get(f"api/leases?user={u}", tokens[u])
                (gpu,) = [x["placement"]["slices"][0]["gpu_uuid"] for x in mine["leases"] if x["state"] == "active"]
                run = subprocess.run([sys.executable, "-c", IN_CGROUP, os.path.join(root, u, "cgroup.procs"), node_of[gpu]],
                                     capture_output=True, text=True, timeout=30, check=True)
                what, after = run.stdout.split()
                seen.append((u, what, float(after)))
            for u in users:
                assert hub.api("DELETE", f"users/{u}/server")[0] in (202, 204)
            wait_for(lambda: all(hub.server_model(u) is None for u in users), 60, "the servers did not stop")
        late = [s for s in seen if s[1] != "ENXIO"]
        print(f"self-taken leases: {len(seen)}; allowed at once in {sum(1 for s in seen if s[1] == 'ENXIO' and s[2] == 0)}, "
              f"the slowest after {max(s[2] for s in seen):.3f} s")
        assert not late, f"{len(late)} of {len(seen)} self-taken leases did not open within a second: {late}"
    finally:
        hub.close()
        remove_cgroups(root, users)
