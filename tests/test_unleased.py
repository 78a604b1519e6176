"""Unleased GPU use, the fast part: the pure rule (processes + leases -> findings), the tracker
(since when, when the grace is over), the words the user reads, and the owner lookup against a
fake /proc."""

from __future__ import annotations

import dataclasses
import os

import pytest

from jupyter_gpulease.broker.owners import ProcReader
from jupyter_gpulease.core.unleased import (
    KILL,
    REPORT,
    WARN,
    GPUProcess,
    Owner,
    UnleasedTracker,
    find_unleased,
    warning,
)

pytestmark = pytest.mark.timeout(30)

A100, L4, MIGGPU = "GPU-a100", "GPU-l4", "GPU-mig"
MIG1, MIG2 = "MIG-one", "MIG-two"


def lease(user: str, *slices: dict, state: str = "active") -> dict:
    return {"user": user, "state": state, "placement": {"slices": list(slices)}}


def whole(uuid: str) -> dict:
    return {"gpu_uuid": uuid, "model": "L4", "node": "n1", "index": 0}


def mig(gpu: str, instance: str) -> dict:
    return {"gpu_uuid": gpu, "mig_uuid": instance, "model": "A100", "node": "n1", "index": 2}


def proc(pid: int, device: str, user: str = "", *, gpu: str | None = None, uid: int | None = 1000, name: str = "", mib: int = 1024) -> GPUProcess:
    return GPUProcess(pid=pid, device_uuid=device, gpu_uuid=gpu or device, node="n1", model="L4", index=0, used_memory_mib=mib,
                      owner=Owner(uid=uid, name=name or user or f"uid {uid}", hub_user=user), start=str(pid * 10))


# --------------------------------------------------------------------------- the rule
def test_a_process_of_bob_on_the_gpu_leased_to_alice_is_unleased_use_naming_her_as_the_holder():
    leases = [lease("alice", whole(L4))]
    found = find_unleased([proc(10, L4, "alice"), proc(11, L4, "bob")], leases)
    assert [(f.process.pid, f.holders) for f in found] == [(11, ("alice",))]


def test_a_process_on_a_gpu_nobody_leases_is_unleased_use_without_holders():
    found = find_unleased([proc(11, A100, "bob")], [lease("alice", whole(L4))])
    assert [(f.process.pid, f.holders) for f in found] == [(11, ())]


def test_only_active_leases_count():
    found = find_unleased([proc(10, L4, "alice")], [lease("alice", whole(L4), state="queued")])
    assert [f.process.pid for f in found] == [10]


def test_two_users_sharing_one_gpu_each_under_a_share_lease_are_both_fine():
    share = {**whole(L4), "share_milli": 500}
    assert find_unleased([proc(10, L4, "alice"), proc(11, L4, "bob")], [lease("alice", share), lease("bob", share)]) == []


def test_mig_a_process_in_its_owners_instance_is_fine_in_another_instance_of_the_same_gpu_it_is_not():
    leases = [lease("alice", mig(MIGGPU, MIG1)), lease("bob", mig(MIGGPU, MIG2))]
    ok = proc(10, MIG1, "alice", gpu=MIGGPU)
    wrong = proc(11, MIG2, "alice", gpu=MIGGPU)
    found = find_unleased([ok, wrong], leases)
    assert [(f.process.pid, f.holders) for f in found] == [(11, ("bob",))]


def test_mig_a_process_the_driver_puts_on_the_gpu_without_naming_the_instance_counts_for_a_holder_of_an_instance():
    leases = [lease("alice", mig(MIGGPU, MIG1))]
    assert find_unleased([proc(10, MIGGPU, "alice")], leases) == []
    assert [f.process.pid for f in find_unleased([proc(11, MIGGPU, "bob")], leases)] == [11]


def test_processes_of_people_the_hub_does_not_know_are_always_reported_as_such():
    found = find_unleased([proc(12, L4, uid=1234), proc(13, L4, uid=0, name="root")], [lease("alice", whole(L4))])
    assert [f.process.owner.words() for f in found] == ["uid 1234 (not a hub user)", "root (not a hub user)"]


# --------------------------------------------------------------------------- over time
def test_the_tracker_knows_since_when_a_finding_stands_and_why_it_ended():
    t = UnleasedTracker(action=WARN, grace_s=60)
    bob = proc(11, L4, "bob")
    ch = t.observe(100.0, find_unleased([bob], []), [bob.key])
    assert [st.since for st in ch.new] == [100.0] and ch.new[0].stop_at is None and not ch.due
    ch = t.observe(200.0, find_unleased([bob], []), [bob.key])
    assert not ch.new and not ch.due and t.standing[bob.key].since == 100.0
    # bob leases the GPU now: the same process, no longer unleased
    ch = t.observe(210.0, find_unleased([bob], [lease("bob", whole(L4))]), [bob.key])
    assert [(st.finding.process.pid, why) for st, why in ch.ended] == [(11, "leased")]
    ch = t.observe(220.0, find_unleased([bob], []), [bob.key])
    ch = t.observe(230.0, [], [])
    assert [why for _, why in ch.ended] == ["gone"] and not t.standing


def test_under_kill_a_finding_is_due_after_the_grace_and_roots_processes_never_are():
    t = UnleasedTracker(action=KILL, grace_s=30)
    bob, system = proc(11, L4, "bob"), proc(12, L4, uid=0, name="root")
    ch = t.observe(100.0, find_unleased([bob, system], []), [])
    assert {st.finding.process.pid: st.stop_at for st in ch.new} == {11: 130.0, 12: None}
    assert not t.observe(129.0, find_unleased([bob, system], []), []).due
    assert [st.finding.process.pid for st in t.observe(130.0, find_unleased([bob, system], []), []).due] == [11]


def test_a_finding_whose_stop_is_under_way_is_left_to_the_stop_even_when_its_process_is_gone():
    t = UnleasedTracker(action=KILL, grace_s=30)
    bob = proc(11, L4, "bob")
    t.observe(100.0, find_unleased([bob], []), [])
    [due] = t.observe(130.0, find_unleased([bob], []), []).due
    due.stop = {"outcome": "stopping", "at": 130.0}  # the broker sent SIGTERM; the process ends before the stop sees it
    assert not t.observe(130.25, [], []).ended and list(t.standing.values()) == [due]
    due.stop = {"outcome": "not_stopped", "at": 131.0}  # a stop that failed: the next check ends it as it finds it
    assert [why for _, why in t.observe(131.25, [], []).ended] == ["gone"] and not t.standing


def test_a_pid_reused_by_another_process_is_another_finding():
    t = UnleasedTracker(action=KILL, grace_s=30)
    t.observe(100.0, find_unleased([proc(11, L4, "bob")], []), [])
    again = GPUProcess(**{**proc(11, L4, "bob").__dict__, "start": "999"})
    ch = t.observe(120.0, find_unleased([again], []), [])
    assert [st.since for st in ch.new] == [120.0] and [why for _, why in ch.ended] == ["gone"]


def test_an_unknown_action_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="report, warn, kill"):
        UnleasedTracker(action="shoot")


def test_the_users_warning_says_which_gpu_whose_it_is_and_what_happens():
    t = UnleasedTracker(action=KILL, grace_s=120)
    t.observe(100.0, find_unleased([proc(11, L4, "bob", mib=3072)], [lease("alice", whole(L4))]), [])
    st = t.for_user("bob")[0]
    w = warning(st, 100.0, KILL)
    assert w["kind"] == "unleased_use" and w["deadline"] == 220.0 and w["pid"] == 11
    assert w["message"] == ("Process 11 uses L4 #0 on n1, another user's GPU: it is stopped in 2 min unless it lets go of it. "
                            "It holds 3072 MiB. Ask for a lease of that GPU instead.")
    assert "uses L4 #0 on n1, alice's GPU: it is stopped" in warning(st, 100.0, KILL, names=True)["message"]  # GPULeaseBroker.show_preemptor_names
    t2 = UnleasedTracker(action=REPORT)
    t2.observe(100.0, find_unleased([proc(11, A100, "bob")], []), [])
    assert "uses L4 #0 on n1, a GPU you do not lease. It holds 1024 MiB. Stop it, or ask for a lease" in warning(t2.for_user("bob")[0], 100.0, REPORT)["message"]


# --------------------------------------------------------------------------- the owner, from a fake /proc
def fake_process(root, pid: int, ppid: int, uid: int, name: str, env: dict[str, str] | None = None, cgroup: str = "0::/user.slice\n") -> None:
    d = root / str(pid)
    d.mkdir()
    (d / "status").write_text(f"Name:\t{name}\nPPid:\t{ppid}\nUid:\t{uid}\t{uid}\t{uid}\t{uid}\n")
    fields = ["S", str(ppid)] + ["0"] * 17 + [str(pid * 100)] + ["0"] * 10
    (d / "stat").write_text(f"{pid} ({name} with) spaces) " + " ".join(fields) + "\n")
    (d / "environ").write_bytes(b"".join(f"{k}={v}\0".encode() for k, v in (env or {}).items()))
    (d / "cgroup").write_text(cgroup)


def test_the_owner_is_the_server_of_the_outermost_ancestor_that_has_one(tmp_path):
    fake_process(tmp_path, 1, 0, 0, "init")
    fake_process(tmp_path, 50, 1, 0, "jupyterhub")
    fake_process(tmp_path, 60, 50, 61234, "jupyterhub-singleuser", {"JUPYTERHUB_USER": "bob", "JUPYTERHUB_SERVER_NAME": "big"},
                 cgroup="12:devices:/jupyter/bob\n11:memory:/x\n")
    fake_process(tmp_path, 70, 60, 61234, "python", {"JUPYTERHUB_USER": "bob"})
    # bob's process claims to be alice's in its own environment: the server's word counts
    fake_process(tmp_path, 80, 70, 61234, "python3", {"JUPYTERHUB_USER": "alice"}, cgroup="12:devices:/jupyter/bob\n11:memory:/x\n")
    info = ProcReader(str(tmp_path), account_uid={"bob": 61234, "alice": 61235}.get).info(80)
    assert info.owner.hub_user == "bob" and info.owner.server == "big" and not info.owner.claimed
    assert info.owner.uid == 61234 and info.owner.name == "uid 61234"
    assert info.owner.cgroup == "/jupyter/bob"
    assert info.command == "python3" and info.start == "8000"


def test_a_detached_process_with_a_forged_hub_user_is_its_unix_users_and_the_forgery_is_named(tmp_path):
    fake_process(tmp_path, 1, 0, 0, "init")
    # bob's process left his server's tree (setsid, parent 1) and claims to be alice's
    fake_process(tmp_path, 95, 1, 61234, "train.py", {"JUPYTERHUB_USER": "alice"},
                 cgroup="12:devices:/jupyter-gpulease/bob\n11:memory:/x\n0::/user.slice/user-61234.slice\n")
    accounts = {"bob": 61234, "alice": 61235}.get
    info = ProcReader(str(tmp_path), account_uid=accounts).info(95)
    o = info.owner
    assert (o.hub_user, o.server, o.claimed, o.uid) == ("", "", "alice", 61234)
    assert o.cgroup == "/jupyter-gpulease/bob"  # the v1 devices path that names the server, on a hybrid host too
    assert o.words() == "uid 61234 (not a hub user, claiming to be alice's)"
    # the broker learns that uid 61234 is bob, a hub user: bob's use, the forgery named
    bobs = dataclasses.replace(o, name="bob", hub_user="bob")
    assert bobs.words() == "bob, claiming to be alice's"
    p = dataclasses.replace(proc(95, L4, "alice"), owner=bobs)
    (finding,) = find_unleased([p], [lease("alice", whole(L4))])
    assert finding.holders == ("alice",)  # on alice's GPU: reported, not taken for hers
    d = UnleasedTracker().observe(0.0, [finding]).new[0].to_dict(0.0)
    assert (d["user"], d["claimed_user"], d["uid"], d["cgroup"]) == ("bob", "alice", 61234, "/jupyter-gpulease/bob")
    # a claimed user with no Unix account here (a container's server): the claim is all there is
    fake_process(tmp_path, 96, 1, 1000, "train.py", {"JUPYTERHUB_USER": "carol"})
    assert ProcReader(str(tmp_path), account_uid=accounts).info(96).owner.hub_user == "carol"


def test_a_real_detached_process_claiming_another_accounts_hub_user_is_not_believed():
    import pwd
    import subprocess
    import sys

    other = next(u for u in pwd.getpwall() if u.pw_uid != os.getuid())
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], start_new_session=True,
                             env={**os.environ, "JUPYTERHUB_USER": other.pw_name})
    try:
        info = ProcReader().info(child.pid)
        assert info.owner.uid == os.getuid() and info.owner.claimed == other.pw_name and info.owner.hub_user == ""
    finally:
        child.kill()
        child.wait()


def test_a_process_outside_every_server_has_its_unix_user_only_and_a_vanished_one_is_none(tmp_path):
    fake_process(tmp_path, 1, 0, 0, "init")
    fake_process(tmp_path, 90, 1, 0, "sshd")
    fake_process(tmp_path, 91, 90, 0, "train.py", {"PATH": "/usr/bin"})
    info = ProcReader(str(tmp_path)).info(91)
    assert info.owner.hub_user == "" and info.owner.name == "root" and info.owner.cgroup == "/user.slice"
    assert info.owner.words() == "root (not a hub user)"
    assert ProcReader(str(tmp_path)).info(4242) is None


def test_the_owner_of_a_real_process_from_the_real_proc():
    info = ProcReader().info(os.getpid())
    assert info is not None and info.owner.uid == os.getuid() and info.start
