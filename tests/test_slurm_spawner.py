"""The Slurm engine: GPULeaseSlurmSpawner through a real JupyterHub onto a real slurmctld/slurmd.

A single-node Slurm cluster (tests/slurmharness.py: munged, slurmctld, slurmd with four GPU
GRES of type ``l4``) runs the jobs; the broker's pool comes from it through the ``slurm``
device backend (``scontrol show node``); the hub spawns through batchspawner's machinery
(sbatch, squeue, scancel, batchspawner-singleuser reporting its port). Asserted on Slurm's own
answers: the job's node, GRES, time limit and ``CUDA_VISIBLE_DEVICES``, and on the broker's
leases. The unit tests at the top check the job spec for every kind of lease.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from hubharness import process_env, wait_for
from jupyter_gpulease.hub.slurm import (
    SlurmPlacementError,
    job_field,
    minutes_until,
    parse_job_gpu_indices,
    slurm_job_spec,
    slurm_time,
)
from leasehub import LeaseHub
from slurmharness import SlurmCluster, require_slurm

VENV_BIN = Path(sys.executable).parent
T0 = 1_800_000_000.0

# The hub's users are not system users on a test machine: their home directories live under
# GPULEASE_TEST_HOMES, and the server binds to 127.0.0.1 (batchspawner resets ``ip`` to the class
# default before each start, so the default is what counts). Nothing about GPUs changes.
TEST_SPAWNER = '''
import os
from pathlib import Path

from traitlets import Unicode, default

from jupyter_gpulease.hub.slurm import GPULeaseSlurmSpawner


class TestSlurmSpawner(GPULeaseSlurmSpawner):
    ip = Unicode("127.0.0.1")

    @default("req_homedir")
    def _homedir_default(self):
        home = Path(os.environ["GPULEASE_TEST_HOMES"]) / self.user.name
        home.mkdir(parents=True, exist_ok=True)
        return str(home)

    def user_env(self, env):
        env["USER"] = self.user.name
        env["HOME"] = self.req_homedir
        env["SHELL"] = "/bin/bash"
        return env
'''


# --------------------------------------------------------------------------- the job spec (unit)
def lease(slices, *, expires_in=3600.0, lease_id="L1"):
    return {"id": lease_id, "state": "active", "tier": "experiment", "expires_at": T0 + expires_in,
            "placement": {"node": slices[0]["node"], "slices": slices}}


def gpu_slice(index, node="gpu-07", model="a100", **kw):
    return {"gpu_uuid": f"GPU-slurm-{index}", "node": node, "index": index, "model": model, "memory_mib": 81920, "share": 1.0, **kw}


def test_whole_gpus_become_nodelist_gres_of_their_type_and_time_with_a_margin():
    spec = slurm_job_spec(lease([gpu_slice(1), gpu_slice(2)], expires_in=3600), now=T0, margin_s=120)
    assert spec.nodelist == "gpu-07"
    assert spec.gres == "gpu:a100:2"
    assert spec.time_limit_min == 62  # 60 min of lease + 2 min margin
    assert spec.gpu_indices == (1, 2)
    assert slurm_time(spec.time_limit_min) == "0-01:02:00"


def test_a_mig_lease_asks_for_the_typed_mig_gres_as_slurm_names_it():
    s = gpu_slice(0, memory_mib=40960, share=0.428, mig_uuid="MIG-slurm-0", mig_profile="3g.40gb")
    spec = slurm_job_spec(lease([s]), now=T0)
    assert spec.gres == "gpu:a100_3g.40gb:1"
    assert spec.gpu_indices == ()


def test_a_share_is_refused_without_shards_and_becomes_shards_with_them():
    s = gpu_slice(0, share=0.5, memory_mib=40960)
    with pytest.raises(SlurmPlacementError, match="does not offer shares of a GPU on Slurm"):
        slurm_job_spec(lease([s]), now=T0)
    assert slurm_job_spec(lease([s]), now=T0, shard_gres="shard", shards_per_gpu=8).gres == "shard:a100:4"
    tiny = gpu_slice(0, share=0.1, memory_mib=8192)
    assert slurm_job_spec(lease([tiny]), now=T0, shard_gres="shard", shards_per_gpu=8).gres == "shard:a100:1"


def test_slurm_times_round_up_to_whole_minutes_and_days():
    assert minutes_until(T0 + 61, T0, 0) == 2
    assert minutes_until(T0 + 60, T0, 0) == 1
    assert minutes_until(T0 - 500, T0, 0) == 1  # already past: the shortest limit, never 0 (= unlimited)
    assert slurm_time(1) == "0-00:01:00"
    assert slurm_time(25 * 60 + 7) == "1-01:07:00"


def test_shares_and_keeping_servers_are_refused_on_slurm_with_a_message():
    from traitlets import TraitError

    from jupyter_gpulease.hub.slurm import GPULeaseSlurmSpawner

    sp = GPULeaseSlurmSpawner()
    with pytest.raises(Exception) as info:
        sp.lease_choice({"share": 0.5})
    assert getattr(info.value, "status_code", None) == 400 and "does not offer shares of a GPU on Slurm" in str(info.value)
    assert sp.lease_choice({"gpus": 1}).request["gpus"] == 1
    sp.share_gres, sp.shards_per_gpu = "shard", 8
    assert sp.lease_choice({"share": 0.5}).request["kind"] == "share"
    with pytest.raises(TraitError, match="on_lease_end must be 'stop' on Slurm"):
        sp.on_lease_end = "keep"


def test_the_gpus_slurm_gave_a_job_are_read_from_scontrol():
    show = ("JobId=7 JobName=spawner-jupyterhub\n   JOB_GRES=gpu:l4:3\n"
            "     Nodes=localhost CPU_IDs=1 Mem=0 GRES=gpu:l4:3(IDX:0,2-3)\n   TimeLimit=01:02:00 StartTime=2026-11-30T09:50:00\n")
    assert parse_job_gpu_indices(show) == (0, 2, 3)
    assert job_field(show, "TimeLimit") == "01:02:00"
    assert job_field(show, "StartTime") == "2026-11-30T09:50:00"
    assert parse_job_gpu_indices("JobId=8 GRES=(null)") == ()


# --------------------------------------------------------------------------- a real hub on real Slurm
def make_slurm_hub(tmp_path: Path, slurm: SlurmCluster, *, users=("alice", "bob"), config_lines=(), spawner="slurm_test_spawner.TestSlurmSpawner",
                   env: dict | None = None) -> LeaseHub:
    """A started hub whose spawner runs servers as Slurm jobs, with the broker's pool read from Slurm."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "slurm_test_spawner.py").write_text(TEST_SPAWNER)
    hub = LeaseHub(
        tmp_path,
        users=users,
        spawner_class=spawner,
        env={"GPULEASE_TEST_HOMES": str(tmp_path / "homes"), "SLURM_CONF": str(slurm.conf), **(env or {})},
        device_backend="slurm",
        broker_devices={"slurm_conf": str(slurm.conf), "memory_mib": {"l4": 23034}},
        broker_config=[
            "c.GPULeaseBroker.inventory_interval = 1",
            "c.GPULeaseBroker.warn_before_s = 10",
            "c.GPULeaseBroker.min_duration_s = 20",  # the 'short' tier's leases last 45 s
            "c.GPULeaseBroker.tiers = {",
            "    'experiment': {'priority': 20, 'max_duration_s': 8 * 3600, 'default_duration_s': 3600},",
            "    'short': {'priority': 20, 'max_duration_s': 120, 'default_duration_s': 45},",
            "    'learning': {'priority': 10, 'max_duration_s': 3600, 'default_duration_s': 3600, 'preemptible': True, 'grace_s': 15},",
            "    'urgent': {'priority': 40, 'max_duration_s': 3600, 'default_duration_s': 1800},",
            "}",
            "c.GPULeaseBroker.default_tier = 'experiment'",
        ],
        server_env={"SLURM_CONF": str(slurm.conf)},
        hub_config=[
            "c.GPULeaseSpawner.queue_refresh_interval = 0.5",
            "c.GPULeaseSpawner.lease_wait_timeout = 300",
            "c.Spawner.start_timeout = 120",
            "c.BatchSpawnerBase.exec_prefix = ''",
            f"c.BatchSpawnerBase.batchspawner_singleuser_cmd = {str(VENV_BIN / 'batchspawner-singleuser')!r}",
            "c.BatchSpawnerBase.startup_poll_interval = 0.2",
            "c.BatchSpawnerRegexStates.state_exechost_exp = '127.0.0.1'",
            *config_lines,
        ],
    )
    return hub.start()


def job_of(slurm: SlurmCluster, user: str) -> str | None:
    """The id of ``user``'s server job (the one whose working directory is the user's home), or None."""
    out = slurm.run("squeue", "-h", "-o", "%i %Z %T", check=False).stdout
    for line in out.splitlines():
        job, workdir, _state = line.split(None, 2)
        if workdir.rstrip("/").endswith("/" + user):
            return job
    return None


def job_env(slurm: SlurmCluster, job: str, user: str) -> dict[str, str]:
    """The environment of the single-user server process running in ``job`` (from /proc)."""
    out = slurm.run("scontrol", "listpids", job, check=False).stdout
    for line in out.splitlines()[1:]:
        pid = line.split()[0]
        if not pid.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            env = process_env(int(pid))
        except OSError:
            continue
        if "jupyterhub-singleuser" in cmd and env.get("JUPYTERHUB_USER") == user:
            return env
    raise AssertionError(f"no single-user server of {user} in job {job}: {out}")


def time_limit_minutes(slurm: SlurmCluster, job: str) -> int:
    value = job_field(slurm.show_job(job), "TimeLimit")  # [D-]HH:MM:SS
    days, _, hms = value.rpartition("-")
    h, m, s = (int(x) for x in hms.split(":"))
    return int(days or 0) * 1440 + h * 60 + m + (1 if s else 0)


@pytest.fixture(scope="module")
def slurm_hub(tmp_path_factory):
    require_slurm()
    tmp = tmp_path_factory.mktemp("slurmhub")
    slurm = SlurmCluster(tmp / "slurm", gpus=4, gpu_type="l4").start()
    hub = None
    try:
        hub = make_slurm_hub(tmp / "hub", slurm)
        yield hub, slurm
    finally:
        if hub is not None:
            hub.close()
        slurm.stop()


@pytest.fixture
def shub(slurm_hub):
    hub, slurm = slurm_hub
    yield slurm_hub
    for user in ("alice", "bob"):
        if hub.server_model(user) is not None:
            hub.api("DELETE", f"users/{user}/server")
            hub.wait_gone(user)
    wait_for(lambda: not hub.leases(state="live"), 30, "leases left live after a test")
    wait_for(lambda: not slurm.jobs(), 30, "jobs left in Slurm after a test")


e2e = pytest.mark.timeout(600)


def the_lease(hub, user, state="active"):
    leases = hub.leases(user, state)
    assert len(leases) == 1, leases
    return leases[0]


def running(hub, slurm, user, options) -> tuple[dict, str | None]:
    """``user`` spawns with ``options``; once the server is ready, (its lease, its job's id)."""
    status, body = hub.spawn(user, options)
    assert status in (201, 202), body
    hub.wait_ready(user, timeout=120)
    return the_lease(hub, user), job_of(slurm, user)


@e2e
def test_a_gpu_spawn_runs_as_a_slurm_job_on_the_leased_node_and_gpus_and_stopping_it_cancels_the_job(shub):
    hub, slurm = shub
    lease, job = running(hub, slurm, "alice", {"gpus": 2, "model": "l4"})
    assert job, slurm.run("squeue").stdout
    show = slurm.show_job(job)
    assert "JobState=RUNNING" in show
    assert job_field(show, "NodeList") == lease["placement"]["node"] == "localhost"
    assert "gpu:l4:2" in job_field(show, "TresPerNode")
    # the server process in the job sees the GPUs Slurm gave it, and those are the leased ones
    env = job_env(slurm, job, "alice")
    given = parse_job_gpu_indices(show)
    assert env["CUDA_VISIBLE_DEVICES"] == ",".join(str(i) for i in given)
    assert sorted(given) == sorted(s["index"] for s in lease["placement"]["slices"])
    assert env["GPULEASE_LEASE_ID"] == lease["id"] and env["GPULEASE_DEVICE_CHOICE"] == "engine"
    assert env["GPULEASE_ENGINE"] == "slurm"
    # the job's time limit is the lease's time left plus the margin (rounded up to minutes)
    left = (lease["expires_at"] - time.time()) / 60
    assert left + 1 <= time_limit_minutes(slurm, job) <= left + 4
    # the server answers through the proxy
    user_token = hub.create_token("alice")
    status, _ = hub.request("GET", f"{hub.url}/user/alice/api/status", token=user_token)
    assert status == 200

    status, _ = hub.api("DELETE", "users/alice/server")
    assert status in (202, 204)
    hub.wait_gone("alice")
    wait_for(lambda: job not in slurm.jobs(), 30, f"job {job} still in Slurm after the server stopped")
    assert the_lease(hub, "alice", state="all")["state"] == "released"


@e2e
def test_a_cpu_only_server_is_a_job_without_gpus_and_a_later_gpu_spawn_gets_its_lease(shub):
    hub, slurm = shub
    status, body = hub.spawn("bob", {"kind": "cpu"})
    assert status in (201, 202), body
    hub.wait_ready("bob", timeout=120)
    job = job_of(slurm, "bob")
    assert "gpu" not in job_field(slurm.show_job(job), "TresPerNode")
    env = job_env(slurm, job, "bob")
    assert env["CUDA_VISIBLE_DEVICES"] == "" and env["GPULEASE_LEASE_ID"] == ""
    assert not hub.leases("bob", "live")
    hub.api("DELETE", "users/bob/server")
    hub.wait_gone("bob")
    # the same spawner object, now with a lease: every GPULEASE_* variable reaches the job
    lease, job = running(hub, slurm, "bob", {"gpus": 1})
    env = job_env(slurm, job, "bob")
    assert env["GPULEASE_LEASE_ID"] == lease["id"]
    assert env["GPULEASE_EXPIRES_AT"] and env["GPULEASE_PLACEMENT"] and env["GPULEASE_DEVICE_CHOICE"] == "engine"
    assert env["CUDA_VISIBLE_DEVICES"] == ",".join(str(i) for i in parse_job_gpu_indices(slurm.show_job(job)))


@e2e
def test_extending_the_lease_moves_the_jobs_time_limit_in_slurm(shub):
    hub, slurm = shub
    lease, job = running(hub, slurm, "alice", {"gpus": 1})
    before = time_limit_minutes(slurm, job)

    user_token = hub.create_token("alice")
    extended = hub.broker.call(user_token, "extend", lease["id"], by_s=1800)
    assert extended["expires_at"] == pytest.approx(lease["expires_at"] + 1800, abs=1)
    wait_for(lambda: time_limit_minutes(slurm, job) >= before + 30, 30,
             f"the job's TimeLimit stayed at {before} min after a 30-min extension")
    assert time_limit_minutes(slurm, job) <= before + 31


@e2e
def test_a_job_that_ends_in_slurm_ends_its_lease(shub):
    hub, slurm = shub
    lease, job = running(hub, slurm, "bob", {"gpus": 1})
    slurm.run("scancel", job)  # an admin cancels it, or it hits its time limit, or the node dies
    wait_for(lambda: hub.server_model("bob") is None, 60, "the hub did not notice the job ended")
    wait_for(lambda: hub.broker_call("get_lease", lease["id"])["state"] not in ("active", "queued"), 30,
             "the lease outlived its job")


@e2e
def test_an_expired_lease_cancels_its_job_after_the_warning(shub):
    hub, slurm = shub
    status, body = hub.spawn("alice", {"gpus": 1, "tier": "short"})
    assert status in (201, 202), body
    job = wait_for(lambda: job_of(slurm, "alice"), 120, "no job for alice's server")
    # Slurm's own limit is minutes away (45 s lease + 2 min margin): if the job goes now, the lease's end did it
    assert time_limit_minutes(slurm, job) >= 3
    lease = the_lease(hub, "alice")
    wait_for(lambda: job not in slurm.jobs(), 120, f"job {job} still runs after its lease expired")
    ended = hub.broker_call("get_lease", lease["id"])
    assert ended["state"] == "expired"
    assert ended["warned_at"] is not None and ended["warned_at"] < ended["ended_at"]
    hub.wait_gone("alice")


@e2e
def test_a_preempted_lease_cancels_its_job_after_the_grace_and_the_gpus_go_to_the_higher_tier(shub):
    hub, slurm = shub
    alice_lease, alice_job = running(hub, slurm, "alice", {"gpus": 4, "tier": "learning"})
    status, body = hub.spawn("bob", {"gpus": 2, "tier": "urgent"})
    assert status == 202, body  # every GPU is alice's: bob waits while she is warned
    warned = wait_for(lambda: hub.broker_call("get_lease", alice_lease["id"]).get("preempt_at"), 30,
                      "alice's lease was not marked for preemption")
    assert alice_job in slurm.jobs()  # during the grace period her job still runs
    wait_for(lambda: alice_job not in slurm.jobs(), 90, f"alice's job {alice_job} outlived her preempted lease")
    ended = hub.broker_call("get_lease", alice_lease["id"])
    assert ended["state"] == "preempted" and ended["ended_at"] >= warned - 1
    hub.wait_ready("bob", timeout=120)
    bob_job = job_of(slurm, "bob")
    assert "gpu:l4:2" in job_field(slurm.show_job(bob_job), "TresPerNode")
    hub.wait_gone("alice")


@e2e
def test_the_broker_pool_is_slurms_gres_and_a_drained_node_takes_no_new_lease(shub):
    hub, slurm = shub
    pool = hub.broker_call("pool")
    devices = pool["devices"]
    assert [(d["node"], d["index"], d["model"], d["memory_mib"]) for d in devices] == [("localhost", i, "l4", 23034) for i in range(4)]
    slurm.run("scontrol", "update", "NodeName=localhost", "State=DRAIN", "Reason=maintenance")
    try:
        wait_for(lambda: not any(d.get("healthy", True) for d in hub.broker_call("pool")["devices"]), 40,
                 "the broker did not see the drained node")
        status, body = hub.spawn("alice", {"gpus": 1})
        assert status == 202, (body, hub.broker_call("pool")["devices"],  # waits: no healthy GPU
                               hub.leases("alice"))
        time.sleep(2)
        assert the_lease(hub, "alice", state="queued")["state"] == "queued"
        assert job_of(slurm, "alice") is None
    finally:
        slurm.run("scontrol", "update", "NodeName=localhost", "State=RESUME")
    hub.wait_ready("alice", timeout=120)  # the node came back: the queued lease is granted, the job runs
    assert job_of(slurm, "alice")


def test_slurm_harness_runs_a_gpu_job_with_cuda_visible_devices(tmp_path):
    """The test cluster itself: a GRES job sees CUDA_VISIBLE_DEVICES (the recipe's File= trick)."""
    require_slurm()
    with SlurmCluster(tmp_path, gpus=2) as slurm:
        out = tmp_path / "out.txt"
        job = slurm.run("sbatch", "--parsable", "--gres=gpu:l4:2", f"--output={out}", "--wrap", "echo CVD=$CUDA_VISIBLE_DEVICES").stdout.strip()
        wait_for(lambda: out.exists() and "CVD=" in out.read_text() and job not in slurm.jobs(), 60, "the job did not run")
        assert out.read_text().strip() == "CVD=0,1"

