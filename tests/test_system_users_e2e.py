"""A hub whose users are Unix accounts, end to end: what one user cannot forge.

A real JupyterHub as root with the lease spawner for local processes (``gpulease-local``: each
server runs under its user's own uid), two real accounts, the broker on simulated GPUs whose
nodes are real character devices, device access required (a cgroup per server), and real
kernels. The simulated GPUs' state file is the admin's (root's, in a folder users cannot write);
each user's kernels write their own work to a file of their own (see
``jupyter_gpulease.devices.simulated``). Needs root, ``useradd`` and cgroup v1's devices
controller; skipped elsewhere.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import tempfile
from pathlib import Path

import psutil
import pytest

from hubharness import wait_for
from jupyter_gpulease.devices.simulated import SimulatedBackend
from leasehub import LeaseHub
from serverutil import SimGPUs
from sysusers import Accounts, can_make_accounts, python_for
from test_cgroup_e2e import _v1_root, make_nodes, remove_cgroups

pytestmark = [
    pytest.mark.timeout(600),
    pytest.mark.skipif(not can_make_accounts() or _v1_root() is None,
                       reason="needs root, useradd and cgroup v1's devices controller"),
]

ALICE, BOB = "lease-alice", "lease-bob"

# in alice's kernel: everything she might try against the simulated GPUs and bob; what happened, in words
TRIES = """
import json, os
from jupyter_gpulease.devices.simulated import SimulatedBackend
cfg = json.loads(os.environ["GPULEASE_DEVICE_CONFIG"])
sim = SimulatedBackend(cfg)
def attempt(fn):
    try:
        fn()
    except (OSError, ValueError) as e:
        return f"{type(e).__name__}: {e}"
    return "done"
tries = {
    "xid on bob's GPU": attempt(lambda: sim.inject_xid(BOB_GPU, 79)),
    "bob's GPU at 100%": attempt(lambda: sim.set_utilization(BOB_GPU, 100)),
    "rewrite the state file": attempt(lambda: open(cfg["state_file"], "w")),
    "remove bob's file": attempt(lambda: os.unlink(cfg["state_file"] + ".d/" + str(BOB_UID) + ".json")),
    "put bob's kernel on her GPU": attempt(lambda: sim.add_process(HER_GPU, BOB_PID, 8192)),
}
json.dump(tries, open(os.path.expanduser("~/tries.json"), "w"))
"""

# a process that leaves alice's server (a session of its own, its launcher gone) claiming to be bob's, and computes on bob's GPU
FORGED = """
import json, os, subprocess, sys
env = {**os.environ, "JUPYTERHUB_USER": BOB_NAME}
code = '''
import json, os, sys, time
from jupyter_gpulease.devices.simulated import SimulatedBackend, process_started
SimulatedBackend(json.loads(os.environ["GPULEASE_DEVICE_CONFIG"])).add_process(
    sys.argv[1], os.getpid(), 8192, sm_util_pct=90.0, started=process_started(os.getpid()))
open(sys.argv[2] + ".pid", "w").write(str(os.getpid()))
while not os.path.exists(sys.argv[2]):
    time.sleep(0.2)
'''
launcher = ("import subprocess, sys; subprocess.Popen([sys.executable, '-c', " + repr(code) + ", *sys.argv[1:]], "
            "start_new_session=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)")
# started through a launcher that exits at once: its parent is then init, not her kernel (as nohup ... & from a shell)
subprocess.run([sys.executable, "-c", launcher, BOB_GPU, STOP], env=env, check=True)
"""


def kernel_pids(user: str) -> list[int]:
    return [p.pid for p in psutil.process_iter(["username", "cmdline"])
            if p.info["username"] == user and "ipykernel_launcher" in " ".join(p.info["cmdline"] or ())]


def server_uids() -> dict[str, int]:
    """The uid each user's single-user server runs under."""
    out = {}
    for p in psutil.process_iter(["cmdline", "uids"]):
        cmd = " ".join(p.info["cmdline"] or ())
        if "jupyterhub.singleuser" in cmd or "jupyterhub-singleuser" in cmd:
            try:
                user = p.environ().get("JUPYTERHUB_USER")
            except psutil.Error:
                continue
            out[user] = p.info["uids"].real
    return out


def test_a_user_cannot_forge_gpu_work_faults_or_another_users_name(tmp_path):
    folder = Path(tempfile.mkdtemp(prefix="gpulease-accounts-", dir="/tmp"))
    folder.chmod(0o755)  # the users' servers read their config and the simulated GPUs here
    accounts = Accounts(folder, [ALICE, BOB])
    parent = f"jupyter-gpulease-test-{secrets.token_hex(4)}"
    root = os.path.join(_v1_root(), parent)
    hub = None
    try:
        python, env = python_for(ALICE, folder)
        nodes = make_nodes(folder / "dev", 2)
        pool = [{"node": "n1", "model": "L4", "count": 2, "memory_mib": 23034, "devices": nodes}]
        sim = SimGPUs(str(folder / "sim-gpus.json"), pool)  # root's, in root's folder
        sim.backend.reset()  # the admin's state file: every GPU idle
        hub = LeaseHub(
            folder / "hub", users=(ALICE, BOB), spawner_class="gpulease-local", pool=pool, broker_devices=sim.config,
            server_devices=sim.config, server_env=env,
            server_config=["c.GPULeaseExtension.heartbeat_interval = 5"],
            broker_config=["c.GPULeaseBroker.heartbeat_timeout_s = 120", "c.GPULeaseBroker.unleased_check_interval = 1"],
            hub_config=[
                f"c.Spawner.cmd = [{python!r}, '-m', 'jupyterhub.singleuser']",
                "c.GPULeaseSpawner.enforce_devices = 'required'",
                f"c.GPULeaseSpawner.device_cgroup_parent = {parent!r}",
                "c.Spawner.default_url = '/tree'",
                "c.Spawner.http_timeout = 90",
            ],
            start_timeout=120,
        )
        (folder / "hub").chmod(0o755)
        hub.start()
        tokens = {u: hub.create_token(u) for u in (ALICE, BOB)}
        for user in (ALICE, BOB):
            assert hub.spawn(user, {"gpus": 1})[0] in (201, 202)
        wait_for(lambda: hub.ready_server(ALICE) and hub.ready_server(BOB), 180,
                 f"the servers did not start\n{hub.log_tail(40)}")
        uids = server_uids()
        assert {u: uids.get(u) for u in (ALICE, BOB)} == {ALICE: accounts.uid(ALICE), BOB: accounts.uid(BOB)}  # each its own
        gpu_of = {u: hub.leases(u, "active")[0]["placement"]["slices"][0]["gpu_uuid"] for u in (ALICE, BOB)}

        # both compute on their own GPUs: each kernel writes its own account's file, the state file stays root's
        kernels = {u: hub.start_kernel(u, tokens[u]) for u in (ALICE, BOB)}
        for user in (ALICE, BOB):
            hub.run_cell(user, tokens[user], kernels[user],
                         "from jupyter_gpulease.sim.gpu import use_gpu\nuse_gpu(util=40, memory_gb=2, seconds=0.5, quiet=True)\n")
        broker_view = SimulatedBackend(sim.config)

        def on_gpus():
            seen = broker_view.sample()
            return {u: [p.pid for p in seen[gpu_of[u]].processes] for u in (ALICE, BOB)}

        wait_for(lambda: all(on_gpus()[u] for u in (ALICE, BOB)), 90, "the kernels' GPU work is not seen")
        (bob_pid,) = on_gpus()[BOB]
        assert on_gpus() == {ALICE: kernel_pids(ALICE), BOB: kernel_pids(BOB)}
        users_folder = Path(sim.state_file + ".d")
        for user in (ALICE, BOB):
            assert (users_folder / f"{accounts.uid(user)}.json").stat().st_uid == accounts.uid(user)
        assert os.stat(sim.state_file).st_uid == 0 and json.loads(Path(sim.state_file).read_text())["processes"] == {}

        # what alice tries against bob and the GPUs: all refused, nothing changed
        tries = (TRIES.replace("BOB_GPU", repr(gpu_of[BOB])).replace("HER_GPU", repr(gpu_of[ALICE]))
                 .replace("BOB_UID", str(accounts.uid(BOB))).replace("BOB_PID", str(bob_pid)))
        hub.run_cell(ALICE, tokens[ALICE], kernels[ALICE], tries)
        out = folder / "home" / ALICE / "tries.json"
        said = wait_for(lambda: out.exists() and json.loads(out.read_text()), 60, f"her kernel did not try\n{hub.log_tail(60)}")
        assert said["xid on bob's GPU"].startswith("PermissionError: only the owner of the simulated GPUs' state file"), said
        assert said["bob's GPU at 100%"].startswith("PermissionError: only the owner"), said
        assert said["rewrite the state file"].startswith("PermissionError"), said
        assert said["remove bob's file"].startswith("PermissionError"), said  # the sticky folder
        assert said["put bob's kernel on her GPU"].startswith(f"PermissionError: process {bob_pid} is not this account's"), said
        now = broker_view.sample()
        assert now[gpu_of[BOB]].health.ok and now[gpu_of[BOB]].utilization_pct < 100
        assert on_gpus() == {ALICE: kernel_pids(ALICE), BOB: [bob_pid]}

        # a process that left her server claiming to be bob's, on bob's GPU: reported as hers, the claim named
        stop = folder / "home" / ALICE / "forged.stop"
        hub.run_cell(ALICE, tokens[ALICE], kernels[ALICE],
                     FORGED.replace("BOB_NAME", repr(BOB)).replace("BOB_GPU", repr(gpu_of[BOB])).replace("STOP", repr(str(stop))))
        pid_file = Path(str(stop) + ".pid")
        forged = int(wait_for(lambda: pid_file.exists() and pid_file.read_text(), 60, "the forged process did not start"))
        assert psutil.Process(forged).ppid() not in kernel_pids(ALICE)  # out of her server's tree

        def finding():
            code, body = hub.broker_get("api/unleased")
            assert code == 200, body
            return next((f for f in body["findings"] if f["pid"] == forged), None)

        try:
            found = wait_for(finding, 60, f"the forged process {forged} on bob's GPU was not found")
        except AssertionError as e:
            raise AssertionError(f"{e}: {hub.broker_get('api/unleased')[1]}; on the GPUs: {on_gpus()}\n{hub.log_tail(30)}") from None
        assert (found["user"], found["uid"], found["unix_user"], found["claimed_user"]) == (ALICE, accounts.uid(ALICE), ALICE, BOB), found
        assert found["cgroup"] == f"/{parent}/{ALICE}", found  # still in her server's cgroup
        assert found["gpu_uuid"] == gpu_of[BOB] and found["holders"] == [BOB], found
        assert found["owner"] == f"{ALICE}, claiming to be {BOB}'s", found
        # she is the one told (in her notebook), not bob
        _, hers = hub.broker_get("api/unleased", tokens[ALICE])
        assert [w["pid"] for w in hers["warnings"]] == [forged] and f"Process {forged}" in hers["warnings"][0]["message"], hers
        _, his = hub.broker_get("api/unleased", tokens[BOB])
        assert his["warnings"] == [] and his["findings"] == [], his
        # the kernels computing on their own leases are not unleased use
        _, body = hub.broker_get("api/unleased")
        assert {f["pid"] for f in body["findings"]} == {forged}, body
        stop.touch()
        wait_for(lambda: finding() is None, 60, "the finding did not end with the process")
    finally:
        if hub is not None:
            hub.close()
        remove_cgroups(root, (ALICE, BOB))
        accounts.remove()
        shutil.rmtree(folder, ignore_errors=True)
