"""GPU leases in Docker containers, end to end: a real JupyterHub with GPULeaseDockerSpawner.

A real JupyterHub with configurable-http-proxy on 127.0.0.1, the broker as its managed service
on a pool of two L4s whose GPUs are real character devices with NVIDIA's major number (made with
``mknod`` in the test's folder), and real containers from the single-user image built here from
Debian packages and the project's wheel (``tests/dockerhost.py``), run by a private Docker
daemon on the host's network. Each container runs jupyterhub-singleuser with the extension and
real kernels; the simulated GPUs' state file and the servers' config are in the test's folder,
mounted at the same path inside.

Without a driver, an open the device cgroup allows reaches the (absent) driver and fails with
ENXIO; a denied one fails with EPERM. Needs root, Docker and cgroup v1 (``.ci/run`` installs and
starts them); skipped elsewhere with the reason, never in CI.
"""

from __future__ import annotations

import json
import os
import secrets
import stat
import subprocess
import time
from pathlib import Path

import pytest

import dockerhost
import standin_cuda_checkpoint
from hubharness import wait_for
from leasehub import LeaseHub
from serverutil import SimGPUs

pytestmark = [pytest.mark.timeout(900), dockerhost.requires_docker()]

MINOR0 = 244  # high minors: no real GPU of a host is denied by accident
TWO_L4 = [{"node": "n1", "model": "L4", "count": 2, "memory_mib": 23034}]

# opens each node and says what happened (errno names)
PROBE = ("import errno, json, os, sys\n"
         "def probe(p):\n"
         "    try:\n"
         "        os.close(os.open(p, os.O_RDONLY))\n"
         "    except OSError as x:\n"
         "        return errno.errorcode.get(x.errno, str(x.errno))\n"
         "    return 'opened'\n"
         "print(json.dumps({p: probe(p) for p in sys.argv[1:]}))\n")


def make_nodes(folder: Path, n: int) -> list[str]:
    folder.mkdir()
    paths = []
    for i in range(n):
        p = folder / f"nvidia{i}"
        os.mknod(p, stat.S_IFCHR | 0o666, os.makedev(195, MINOR0 + i))
        os.chmod(p, 0o666)  # mknod is subject to the umask
        paths.append(str(p))
    return paths


def docker_hub(tmp: Path, *, users=("alice", "bob", "carol"), server_config=(), hub_config=(), image: str = "",
               pool_keys: dict | None = None) -> tuple[LeaseHub, SimGPUs, list[str], str]:
    """(hub, the simulated GPUs, the GPUs' device nodes, the stand-in cuda-checkpoint's folder).

    ``pool_keys``: more keys of the pool's entry (its node's ``cuda_version`` and ``driver_version``)."""
    sock = dockerhost.ensure_dockerd()
    image = image or dockerhost.ensure_test_image()
    nodes = make_nodes(tmp / "dev", 2)
    pool = [{**TWO_L4[0], **(pool_keys or {}), "devices": nodes}]
    sim = SimGPUs(str(tmp / "sim-gpus.json"), pool)
    standin = tmp / "standin"
    standin.mkdir()
    prefix = f"gpulease-test-{secrets.token_hex(3)}"
    hub = LeaseHub(
        tmp,
        users=users,
        spawner_class="gpulease-docker",
        pool=pool,
        broker_devices=sim.config,
        server_devices=sim.config,
        server_config=[
            "c.GPULeaseExtension.sample_interval = 0.5",
            "c.GPULeaseExtension.heartbeat_interval = 2",
            "c.GPULeaseExtension.cuda_checkpoint = '/usr/local/bin/cuda-checkpoint'",
            *server_config,
        ],
        # the stand-in restores onto another GPU with a device map, as cuda-checkpoint does with driver 580
        server_env={"STANDIN_CUDA_CHECKPOINT_DIR": str(standin), "STANDIN_CUDA_CHECKPOINT_SIM_STATE": sim.state_file,
                    "STANDIN_CUDA_CHECKPOINT_REMAP": "1"},
        broker_config=["c.GPULeaseBroker.heartbeat_timeout_s = 120"],
        hub_config=[
            "c.GPULeaseSpawner.enforce_devices = 'required'",
            "c.GPULeaseSpawner.lease_wait_timeout = 300",
            f"c.DockerSpawner.client_kwargs = {{'base_url': {sock!r}}}",
            f"c.DockerSpawner.image = {image!r}",
            "c.DockerSpawner.network_name = 'host'",
            f"c.DockerSpawner.prefix = {prefix!r}",
            # the test's folder (servers' config, the simulated GPUs, the stand-in's log) at the same path
            f"c.DockerSpawner.volumes = {{{str(tmp)!r}: {str(tmp)!r}}}",
            "c.Spawner.cmd = ['jupyterhub-singleuser']",
            # the servers run as root in their containers (the harness passes --allow-root): the
            # test's folder is root's, and the simulated GPUs' state file with it
            "c.DockerSpawner.extra_create_kwargs = {'user': 'root'}",
            "c.Spawner.default_url = '/tree'",
            "c.Spawner.start_timeout = 180",
            "c.Spawner.http_timeout = 120",
            *hub_config,
        ],
        start_timeout=120,
    )
    hub.docker_prefix = prefix
    return hub.start(), sim, nodes, str(standin)


def container_of(hub: LeaseHub, user: str) -> str:
    return f"{hub.docker_prefix}-{user}"


def probe_in_container(hub: LeaseHub, user: str, nodes: list[str]) -> dict[str, str]:
    """Open each node from a new process in the user's container (``docker exec``: it joins the
    container's cgroups), as any process of the server would."""
    r = subprocess.run(["docker", "-H", dockerhost.ensure_dockerd(), "exec", container_of(hub, user), "python3", "-c", PROBE, *nodes],
                       capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def probe_in_kernel(hub: LeaseHub, user: str, token: str, kid: str, nodes: list[str], out: Path) -> dict[str, str]:
    """The same from the user's kernel (a cell, as JupyterLab sends it)."""
    out.unlink(missing_ok=True)
    code = PROBE.replace("print(json.dumps(", f"open({str(out)!r} + '.tmp', 'w').write(json.dumps(").replace(
        "sys.argv[1:]}))", f"{nodes!r}}})); os.replace({str(out)!r} + '.tmp', {str(out)!r})")
    hub.run_cell(user, token, kid, code)
    wait_for(out.exists, 60, f"{user}'s kernel probed the GPUs")
    return json.loads(out.read_text())


def remove_containers(hub: LeaseHub) -> None:
    """Whatever a failed test left running (the hub's stop removes its containers otherwise)."""
    import docker

    c = docker.DockerClient(base_url=dockerhost.ensure_dockerd())
    for ct in c.containers.list(all=True, filters={"name": hub.docker_prefix}):
        ct.remove(force=True)


def close(hub: LeaseHub) -> None:
    try:
        hub.close()
    finally:
        remove_containers(hub)


def running(hub: LeaseHub, user: str) -> bool:
    import docker

    c = docker.DockerClient(base_url=dockerhost.ensure_dockerd())
    try:
        return c.containers.get(container_of(hub, user)).status == "running"
    except docker.errors.NotFound:
        return False


def test_a_container_opens_its_leases_gpus_only_and_the_lock_follows_the_lease_without_a_restart(tmp_path):
    hub, sim, (n0, n1), standin = docker_hub(
        tmp_path,
        # her idle kernel is suspended after 12 s; a lease no kernel uses stays (carol and bob hold theirs)
        server_config=["c.GPUIdleRule.gpu_idle_timeout = 12", "c.ReclaimActions.warn_before = 2",
                       "c.ReclaimActions.unused_lease_timeout = 3600"],
        # a lease the server gave back itself (reclaimed) keeps the server: the container goes on
        hub_config=["c.GPULeaseSpawner.on_lease_end = 'keep'"],
    )
    node_of = dict(zip(sim.uuids, (n0, n1), strict=True))
    try:
        alice = hub.create_token("alice")
        assert hub.spawn("alice", {"gpus": 1})[0] in (201, 202)
        hub.wait_ready("alice", timeout=240)
        [mine] = [le for le in hub.leases("alice", "active")]
        her_gpu = mine["placement"]["slices"][0]["gpu_uuid"]
        her_node = node_of[her_gpu]
        other_node = n1 if her_node == n0 else n0
        assert hub.spawn("bob", {"gpus": 1})[0] in (201, 202)
        hub.wait_ready("bob", timeout=240)
        [bobs] = hub.leases("bob", "active")
        assert node_of[bobs["placement"]["slices"][0]["gpu_uuid"]] == other_node

        # her kernel reaches her GPU (ENXIO: the open got to the node) and not bob's (EPERM)
        kid = hub.start_kernel("alice", alice)
        seen = probe_in_kernel(hub, "alice", alice, kid, [her_node, other_node], tmp_path / "probe.json")
        assert seen == {her_node: "ENXIO", other_node: "EPERM"}, seen
        assert probe_in_container(hub, "bob", [her_node, other_node]) == {her_node: "EPERM", other_node: "ENXIO"}

        # she keeps a variable and computes on her GPU; idle, her kernel is suspended and her lease given back
        hub.run_cell("alice", alice, kid, "x = 41\nfrom jupyter_gpulease.sim.gpu import use_gpu\n"
                                          "use_gpu(util=80, memory_gb=2, seconds=1, quiet=True)")

        def kernel() -> dict:
            code, st = hub.gpu_api("alice", alice, "status")
            assert code == 200, (code, st)
            return next(k for k in st["kernels"] if k["id"] == kid)

        wait_for(lambda: kernel()["state"] == "suspended", 120, "her idle kernel is suspended")
        ended = wait_for(lambda: (le := hub.lease(mine["id"]))["state"] not in ("active", "queued") and le, 60,
                         "her lease ended")
        ended_at = time.monotonic()

        # the lease ended: her former GPU is closed to her container, which keeps running
        denied = wait_for(lambda: probe_in_container(hub, "alice", [her_node])[her_node] == "EPERM" and time.monotonic(),
                          30, "her former GPU is closed in her container")
        assert running(hub, "alice")
        print(f"lease end -> EPERM in the container: {denied - ended_at:.2f} s (lease {ended['state']})")

        # carol takes her former GPU; bob stops, so his GPU is the free one
        assert hub.spawn("carol", {"gpus": 1})[0] in (201, 202)
        hub.wait_ready("carol", timeout=240)
        [carols] = hub.leases("carol", "active")
        assert node_of[carols["placement"]["slices"][0]["gpu_uuid"]] == her_node
        hub.stop_server("bob", timeout=120)

        # her next cell resumes her kernel on the other GPU, with her variables; the lock follows
        seen = probe_in_kernel(hub, "alice", alice, kid, [her_node, other_node], tmp_path / "probe2.json")
        assert seen == {her_node: "EPERM", other_node: "ENXIO"}, seen
        hub.run_cell("alice", alice, kid, f"open({str(tmp_path / 'x.txt')!r}, 'w').write(str(x + 1))")
        wait_for(lambda: (tmp_path / "x.txt").exists() and (tmp_path / "x.txt").read_text() == "42", 60,
                 "her next cell saw x")
        resumed = kernel()
        assert resumed["state"] == "ok", resumed
        actions = [c["action"] for c in standin_cuda_checkpoint.calls(standin)]
        assert actions[:2] == ["lock", "checkpoint"] and "restore" in actions, actions
        [now] = hub.leases("alice", "active")
        assert node_of[now["placement"]["slices"][0]["gpu_uuid"]] == other_node
        assert running(hub, "alice")
    finally:
        close(hub)


def test_a_restarted_hub_finds_the_running_container_and_its_lease_and_still_moves_its_lock(tmp_path):
    hub, sim, (n0, n1), _ = docker_hub(
        tmp_path, users=("alice",),
        hub_config=["c.JupyterHub.cleanup_servers = False", "c.GPULeaseSpawner.on_lease_end = 'keep'"],
    )
    node_of = dict(zip(sim.uuids, (n0, n1), strict=True))
    try:
        assert hub.spawn("alice", {"gpus": 1})[0] in (201, 202)
        hub.wait_ready("alice", timeout=240)
        [lease] = hub.leases("alice", "active")
        her_node = node_of[lease["placement"]["slices"][0]["gpu_uuid"]]
        other = n1 if her_node == n0 else n0
        assert probe_in_container(hub, "alice", [her_node, other]) == {her_node: "ENXIO", other: "EPERM"}
        before = hub.server_model("alice")["state"]

        hub.keep_servers = True
        hub.restart()
        hub.wait_for_broker()
        assert running(hub, "alice")
        model = wait_for(lambda: (m := hub.ready_server("alice")) and m, 60, "the restarted hub lists her server")
        assert model["state"]["object_id"] == before["object_id"] and model["state"]["gpulease"]["lease_id"] == lease["id"]
        assert probe_in_container(hub, "alice", [her_node, other]) == {her_node: "ENXIO", other: "EPERM"}

        # an admin ends her lease: the new hub process closes the GPU in her running container
        hub.broker_call("release", lease["id"], "ended by the admin", state="revoked")
        wait_for(lambda: probe_in_container(hub, "alice", [her_node])[her_node] == "EPERM", 30,
                 "her GPU is closed in her container after the restart")
        assert running(hub, "alice")
    finally:
        hub.keep_servers = False
        close(hub)


def test_a_cpu_only_container_opens_no_gpu_until_its_kernel_asks_with_gpu_request(tmp_path):
    hub, sim, (n0, n1), _ = docker_hub(tmp_path, users=("alice",), server_config=["c.ReclaimActions.unused_lease_timeout = 3600"])
    node_of = dict(zip(sim.uuids, (n0, n1), strict=True))
    try:
        alice = hub.create_token("alice")
        assert hub.spawn("alice", {"kind": "cpu"})[0] in (201, 202)
        hub.wait_ready("alice", timeout=240)
        assert probe_in_container(hub, "alice", [n0, n1]) == {n0: "EPERM", n1: "EPERM"}

        # %gpu request in her notebook: the new lease's GPU opens in her running container
        kid = hub.start_kernel("alice", alice)
        hub.run_cell("alice", alice, kid, "%gpu request --gpus 1 --model L4")
        [lease] = wait_for(lambda: hub.leases("alice", "active"), 60, "her %gpu request was granted")
        assert lease["meta"].get("taken_by") == "server", lease["meta"]
        mine = node_of[lease["placement"]["slices"][0]["gpu_uuid"]]
        other = n1 if mine == n0 else n0
        wait_for(lambda: probe_in_container(hub, "alice", [mine, other]) == {mine: "ENXIO", other: "EPERM"}, 30,
                 "the requested GPU opens in her container")
        assert running(hub, "alice")
    finally:
        close(hub)
