"""Simulated GPUs on a hub whose users are Unix accounts: nobody but the state file's owner drives
the GPUs, and a user puts only their own processes on them.

The state file is the admin's (root's here, in a folder only root writes); a user (the ``nobody``
account, in a forked child that drops to its uid) writes the processes of its own account to a
file of its own in the sticky ``<state file>.d`` folder. Needs root (to be two accounts).
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import shutil
import stat
import tempfile
from contextlib import contextmanager
from pathlib import Path

import pytest

from jupyter_gpulease.devices import simcheckpoint
from jupyter_gpulease.devices.simulated import SimulatedBackend, process_started

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root, to act as two accounts")

USER = 65534  # nobody
POOL = [{"node": "n1", "model": "L4", "count": 2, "memory_mib": 23034}]


@pytest.fixture
def admin_folder():
    """A folder only root writes, that other accounts can enter (pytest's own tmp_path cannot be)."""
    top = Path(tempfile.mkdtemp(prefix="simusers-", dir="/tmp"))
    top.chmod(0o755)
    try:
        yield top
    finally:
        shutil.rmtree(top)


@contextmanager
def as_user(fn, *args):
    """Run ``fn(*args)`` in a child process with the user's uid; yields (its pid, what it returned
    or the exception it raised). The child lives on (its process runs) until the block ends."""
    result_r, result_w = os.pipe()
    done_r, done_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        try:
            os.close(result_r)
            os.close(done_w)
            os.setgid(USER)
            os.setuid(USER)
            try:
                out = ("ok", fn(*args))
            except BaseException as e:  # handed to the parent
                out = ("raised", e)
            with os.fdopen(result_w, "wb") as w:
                pickle.dump(out, w)
            os.read(done_r, 1)
        finally:
            os._exit(0)
    os.close(result_w)
    os.close(done_r)
    try:
        with os.fdopen(result_r, "rb") as r:
            yield pid, pickle.load(r)
    finally:
        os.write(done_w, b"x")
        os.close(done_w)
        os.waitpid(pid, 0)


def config(folder: Path) -> dict:
    return {"gpus": POOL, "state_file": str(folder / "sim-gpus.json")}


def put_myself_on(cfg: dict, gpu: str, mib: int = 4096):
    sim = SimulatedBackend(cfg)
    sim.add_process(gpu, os.getpid(), mib, sm_util_pct=70.0)
    return sim.write_path, sim.writes_state_file


def try_to(cfg: dict, what: str, gpu: str):
    """What a user tries against the GPUs: each attempt's error, in words."""
    sim = SimulatedBackend(cfg)
    attempts = {
        "xid": lambda: sim.inject_xid(gpu, 79),
        "utilization": lambda: sim.set_utilization(gpu, 100),
        "someone else's process": lambda: sim.add_process(gpu, 1, 8192),  # pid 1: root's
        "reset": lambda: sim.reset_device(gpu),
    }
    try:
        attempts[what]()
    except (PermissionError, ValueError) as e:
        return f"{type(e).__name__}: {e}"
    return "done"


def test_the_owner_makes_a_sticky_folder_where_a_user_puts_only_their_own_process(admin_folder):
    cfg = config(admin_folder)
    broker = SimulatedBackend(cfg)  # root: the state file's owner
    gpu, other = [g.uuid for g in broker.inventory()]
    broker.set_utilization(other, 20)
    folder = admin_folder / "sim-gpus.json.d"
    assert stat.S_IMODE(folder.stat().st_mode) == 0o1777
    with as_user(put_myself_on, cfg, gpu) as (pid, (how, (path, writes_state_file))):
        assert how == "ok" and not writes_state_file and path == str(folder / f"{USER}.json")
        assert os.stat(path).st_uid == USER and stat.S_IMODE(os.stat(path).st_mode) == 0o644
        seen = broker.sample()[gpu]
        assert [(p.pid, p.used_memory_mib) for p in seen.processes] == [(pid, 4096)] and seen.utilization_pct == 70.0
        assert broker.sample()[other].utilization_pct == 20.0  # the owner's figures stay
        # the state file is untouched by the user
        assert json.loads((admin_folder / "sim-gpus.json").read_text())["processes"] == {}
    # the process ended: it is on no GPU
    assert broker.sample()[gpu].processes == ()


@pytest.mark.parametrize("what", ["xid", "utilization", "someone else's process", "reset"])
def test_a_user_cannot_make_a_gpu_sick_busy_or_put_another_accounts_process_on_it(admin_folder, what):
    cfg = config(admin_folder)
    broker = SimulatedBackend(cfg)
    gpu = broker.inventory()[0].uuid
    with as_user(try_to, cfg, what, gpu) as (_, (how, said)):
        assert how == "ok" and said.startswith("PermissionError"), said
    if what == "someone else's process":
        assert "process 1 is not this account's" in said
    else:
        assert "only the owner of the simulated GPUs' state file" in said and f"{USER}.json" in said
    s = broker.sample()[gpu]
    assert s.processes == () and s.utilization_pct == 0.0 and s.health.ok


def forge(cfg: dict, gpu: str, victim: int):
    """A user writes their own file by hand: someone else's process, a fault and full utilization."""
    path = Path(cfg["state_file"] + ".d") / f"{os.getuid()}.json"
    path.write_text(json.dumps({
        "utilization": {gpu: 100},
        "processes": {gpu: [{"pid": victim, "used_memory_mib": 8192, "sm_util_pct": 90},
                            {"pid": os.getpid(), "used_memory_mib": 1024, "sm_util_pct": 10}]},
        "started": {str(victim): process_started(victim), str(os.getpid()): process_started(os.getpid())},
        "devices": {gpu: {"health": {"xid": 79, "xid_count": 1, "lost": True}}},
    }))
    return str(path)


def test_a_hand_written_user_file_is_believed_for_its_owners_running_processes_only(admin_folder, caplog):
    cfg = config(admin_folder)
    broker = SimulatedBackend(cfg)
    gpu = broker.inventory()[0].uuid
    victim = os.getpid()  # root's process (this test)
    with caplog.at_level(logging.ERROR), as_user(forge, cfg, gpu, victim) as (pid, (how, path)):
        assert how == "ok"
        s = broker.sample()[gpu]
        assert [p.pid for p in s.processes] == [pid]  # only the user's own
        assert s.utilization_pct == 10.0 and s.health.ok and not s.health.lost
    assert f"ignoring process {victim} in {path}: it is uid 0's" in caplog.text
    assert "ignoring the utilization and device figures" in caplog.text


def test_a_state_file_others_can_write_is_not_believed(admin_folder, caplog):
    cfg = config(admin_folder)
    broker = SimulatedBackend(cfg)
    gpu = broker.inventory()[0].uuid
    broker.inject_xid(gpu, 79)
    assert not broker.sample()[gpu].health.ok
    os.chmod(cfg["state_file"], 0o666)  # as an older README said to make it
    reader = SimulatedBackend(cfg)
    with caplog.at_level(logging.ERROR):
        assert reader.sample()[gpu].health.ok
    assert "can be written by everyone (mode 666): anyone could forge the GPUs' state" in caplog.text
    os.chmod(cfg["state_file"], 0o644)
    assert not reader.sample()[gpu].health.ok  # its owner's again: believed


def test_a_state_file_in_a_folder_everyone_writes_is_not_believed_nor_a_users_folder_of_another_owner(admin_folder, caplog):
    open_folder = admin_folder / "open"
    open_folder.mkdir()
    open_folder.chmod(0o777)  # not sticky: anyone could replace the file
    cfg = config(open_folder)
    SimulatedBackend(cfg).inject_xid(SimulatedBackend(cfg).inventory()[0].uuid, 79)
    with caplog.at_level(logging.ERROR):
        reader = SimulatedBackend(cfg)
        assert all(s.health.ok for s in reader.sample().values())
    assert "is in a folder others can write" in caplog.text
    # a users' folder that someone else made first is not read
    cfg = config(admin_folder)
    folder = Path(cfg["state_file"] + ".d")
    folder.mkdir()
    os.chown(folder, USER, USER)
    folder.chmod(0o1777)
    broker = SimulatedBackend(cfg)
    with caplog.at_level(logging.ERROR), as_user(put_myself_on, cfg, broker.inventory()[0].uuid) as (_, (how, _path)):
        assert how == "ok"
        assert broker.sample()[broker.inventory()[0].uuid].processes == ()
    assert f"belongs to uid {USER}, not to the state file's owner" in caplog.text


def link_to_state_file(cfg: dict, gpu: str):
    os.symlink(cfg["state_file"], Path(cfg["state_file"] + ".d") / f"{os.getuid()}.json")


def test_a_link_in_the_users_folder_is_not_followed(admin_folder, caplog):
    cfg = config(admin_folder)
    broker = SimulatedBackend(cfg)
    gpu = broker.inventory()[0].uuid
    broker.add_process(gpu, 4242, 1024)  # the admin's own declaration
    with caplog.at_level(logging.ERROR), as_user(link_to_state_file, cfg, gpu) as (_, (how, _)):
        assert how == "ok"
        assert [p.pid for p in broker.sample()[gpu].processes] == [4242]
    assert "is a symbolic link" in caplog.text


def suspend_and_resume_myself(cfg: dict, gpu: str, onto: str):
    env = {"GPULEASE_DEVICE_BACKEND": "simulated", "GPULEASE_DEVICE_CONFIG": json.dumps(cfg)}
    sim = SimulatedBackend(cfg)
    sim.add_process(gpu, os.getpid(), 2048, sm_util_pct=0.0)
    pid = str(os.getpid())
    seen = []
    for action in ("lock", "checkpoint"):
        simcheckpoint.run(["--action", action, "--pid", pid], env)
    seen.append(sorted((u, [p.pid for p in s.processes]) for u, s in sim.sample().items()))
    for action in ("restore", "unlock"):
        simcheckpoint.run(["--action", action, "--pid", pid, *(["--device-map", f"{gpu}={onto}"] if action == "restore" else [])], env)
    seen.append(sorted((u, [p.pid for p in s.processes]) for u, s in sim.sample().items()))
    return seen, sim.checkpoint_store


def test_a_users_simulated_suspend_keeps_its_process_aside_in_its_own_file_and_restores_it_elsewhere(admin_folder):
    cfg = config(admin_folder)
    broker = SimulatedBackend(cfg)
    gpu, onto = [g.uuid for g in broker.inventory()]
    with as_user(suspend_and_resume_myself, cfg, gpu, onto) as (pid, (how, out)):
        assert how == "ok", out
        (suspended, resumed), store = out
        assert suspended == [(gpu, []), (onto, [])]
        assert resumed == [(gpu, []), (onto, [pid])]
        assert store == cfg["state_file"] + f".d/{USER}.checkpoints.json" and os.stat(store).st_uid == USER
        assert [p.pid for p in broker.sample()[onto].processes] == [pid]
