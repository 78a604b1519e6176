"""Simulated GPUs shared across pid namespaces, as with servers and kernels in containers that
have the state file mounted: real pid namespaces (``unshare --pid --fork --mount-proc``, no
container runtime), a Python process in each that puts itself on the simulated GPUs.

What NVML does, the simulated GPUs do: the host lists a namespaced process under its host pid and
keeps it while it runs; a reader inside a namespace lists its own processes under its own pids,
does not list (but counts the memory of) the processes it cannot see, and does not drop them when
it writes. Needs root (to make pid namespaces); the last test (no /proc scan per sample) does not.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from jupyter_gpulease.devices import simulated
from jupyter_gpulease.devices.simulated import INITIAL_PID_NAMESPACE, SimulatedBackend, pid_namespace, process_started

USER = 65534  # nobody
POOL = [
    {"node": "n1", "model": "A100-SXM4-80GB", "memory_mib": 81920, "mig": ["3g.40gb", "3g.40gb"]},
    {"node": "n1", "model": "L4", "count": 2, "memory_mib": 23034},
]


def _why_no_namespaces() -> str:
    if os.geteuid() != 0:
        return "needs root, to make pid namespaces"
    if not shutil.which("unshare"):
        return "needs unshare (util-linux), to make pid namespaces"
    r = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "--kill-child", "true"], capture_output=True, text=True, check=False)
    if r.returncode != 0:
        return f"cannot make a pid namespace here: {r.stderr.strip() or r.returncode}"
    return ""


needs_namespaces = pytest.mark.skipif(bool(_why_no_namespaces()), reason=_why_no_namespaces() or "-")

# The program that runs as pid 1 of a new pid namespace (with its own /proc): it answers one JSON
# line per command, and forks workers (each puts itself on a GPU, then waits to be killed).
DRIVER = r"""
import json, os, signal, sys
from jupyter_gpulease.devices.simulated import SimulatedBackend, pid_namespace, process_started

cfg = json.loads(sys.argv[1])
sim = SimulatedBackend(cfg)


def answer(v):
    sys.stdout.write(json.dumps(v) + "\n")
    sys.stdout.flush()


def put(backend, c):
    backend.add_process(c["gpu"], os.getpid(), c["mib"], c.get("sm"), started=process_started(os.getpid()))


answer({"pid": os.getpid(), "ns": pid_namespace()})
for line in sys.stdin:
    c = json.loads(line)
    try:
        if c["op"] == "put":
            put(sim, c)
            answer({"pid": os.getpid()})
        elif c["op"] == "spawn":
            if c.get("last_pid"):  # the next pid handed out: last_pid + 1
                with open("/proc/sys/kernel/ns_last_pid", "w") as f:
                    f.write(str(c["last_pid"]))
            r, w = os.pipe()
            pid = os.fork()
            if pid == 0:
                said = "ok"
                try:
                    os.close(r)
                    if c.get("uid"):
                        os.setgid(c["uid"])
                        os.setuid(c["uid"])
                    if c.get("gpu"):
                        put(SimulatedBackend(cfg), c)
                except BaseException as e:
                    said = repr(e)
                os.write(w, said.encode())
                os.close(w)
                while True:
                    signal.pause()
            os.close(w)
            said = os.read(r, 4096).decode()
            os.close(r)
            answer({"pid": pid, "said": said})
        elif c["op"] == "kill":
            os.kill(c["pid"], signal.SIGKILL)
            os.waitpid(c["pid"], 0)
            answer({})
        elif c["op"] == "sample":
            answer({u: {"pids": [p.pid for p in s.processes], "used": s.memory_used_mib, "util": s.utilization_pct}
                    for u, s in sim.sample().items()})
        elif c["op"] == "checkpoint":
            from jupyter_gpulease.devices import simcheckpoint
            env = {"GPULEASE_DEVICE_BACKEND": "simulated", "GPULEASE_DEVICE_CONFIG": json.dumps(cfg)}
            answer({"out": simcheckpoint.run(c["argv"], env)})
        elif c["op"] == "exit":
            break
    except Exception as e:
        answer({"error": repr(e)})
"""


class Namespace:
    """A new pid namespace with the driver as its pid 1."""

    def __init__(self, cfg: dict):
        self.proc = subprocess.Popen(["unshare", "--pid", "--fork", "--mount-proc", "--kill-child",
                                      sys.executable, "-c", DRIVER, json.dumps(cfg)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        hello = self._answer()
        self.ns: int = hello["ns"]
        assert hello["pid"] == 1 and self.ns != pid_namespace()
        self.host_pid = host_pid(self.ns, 1)  # the driver, as the host sees it

    def _answer(self) -> dict:
        line = self.proc.stdout.readline()
        assert line, "the namespace's driver ended"
        out = json.loads(line)
        assert "error" not in out, out["error"]
        return out

    def do(self, op: str, **args) -> dict:
        self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.proc.stdin.flush()
        return self._answer()

    def put(self, gpu: str, mib: int, sm: float | None = None) -> None:
        self.do("put", gpu=gpu, mib=mib, sm=sm)

    def spawn(self, gpu: str | None = None, mib: int = 0, sm: float | None = None, **more) -> int:
        out = self.do("spawn", gpu=gpu, mib=mib, sm=sm, **more)
        assert out["said"] == "ok", out["said"]
        return out["pid"]

    def sample(self) -> dict:
        return self.do("sample")

    def exit(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"op": "exit"}) + "\n")
                self.proc.stdin.close()
            except OSError:
                pass
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc.stdout.close()


@pytest.fixture
def namespaces():
    made: list[Namespace] = []

    def make(cfg: dict) -> Namespace:
        made.append(Namespace(cfg))
        return made[-1]

    try:
        yield make
    finally:
        for n in made:
            n.exit()


@pytest.fixture
def folder():
    """A folder only root writes, that other accounts can enter (for the users' files)."""
    top = Path(tempfile.mkdtemp(prefix="simpidns-", dir="/tmp"))
    top.chmod(0o755)
    try:
        yield top
    finally:
        shutil.rmtree(top)


@pytest.fixture
def host_process():
    """A process of the host (a kernel there), started now."""
    procs: list[subprocess.Popen] = []

    def start() -> int:
        procs.append(subprocess.Popen(["sleep", "600"]))
        return procs[-1].pid

    try:
        yield start
    finally:
        for p in procs:
            p.kill()
            p.wait()


@pytest.fixture
def host_user_process():
    """A process of the user's account on the host that puts itself on a GPU (a user's kernel)."""
    made: list[int] = []

    def start(cfg: dict, gpu: str, mib: int) -> int:
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: never returns into pytest
            said = "ok"
            try:
                os.close(r)
                os.setgid(USER)
                os.setuid(USER)
                SimulatedBackend(cfg).add_process(gpu, os.getpid(), mib, started=process_started(os.getpid()))
            except BaseException as e:
                said = repr(e)
            finally:
                os.write(w, said.encode())
                os.close(w)
                while True:
                    time.sleep(60)
        os.close(w)
        made.append(pid)
        with os.fdopen(r, "rb") as f:
            assert f.read().decode() == "ok"
        return pid

    try:
        yield start
    finally:
        for pid in made:
            os.kill(pid, 9)
            os.waitpid(pid, 0)


def host_pid(ns: int, pid: int) -> int:
    """The host's pid of process ``pid`` of pid namespace ``ns``."""
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            try:
                with open(f"/proc/{name}/status") as f:
                    nspid = next(line.split()[1:] for line in f if line.startswith("NSpid:"))
                if nspid[-1] == str(pid) and os.stat(f"/proc/{name}/ns/pid").st_ino == ns:
                    return int(name)
            except (OSError, StopIteration):
                continue
        time.sleep(0.05)
    raise AssertionError(f"no process {pid} of pid namespace {ns}")


def config(folder: Path) -> dict:
    return {"gpus": POOL, "state_file": str(folder / "sim-gpus.json")}


def gpus(sim: SimulatedBackend) -> tuple[str, str, str, str]:
    """The A100, its first MIG instance, the two L4s."""
    a100, l4a, l4b = sim.inventory()
    return a100.uuid, a100.mig[0].uuid, l4a.uuid, l4b.uuid


def pids(sim: SimulatedBackend, uuid: str) -> list[int]:
    return [p.pid for p in sim.sample()[uuid].processes]


def saved(cfg: dict) -> dict:
    return json.loads(Path(cfg["state_file"]).read_text())


def fresh_reader(cfg: dict) -> dict:
    """What a reader in another process of the host (knowing nothing yet) sees."""
    code = ("import json, sys; from jupyter_gpulease.devices.simulated import SimulatedBackend\n"
            "print(json.dumps({u: {'pids': [p.pid for p in s.processes], 'used': s.memory_used_mib}\n"
            "                  for u, s in SimulatedBackend(json.loads(sys.argv[1])).sample().items()}))")
    return json.loads(subprocess.run([sys.executable, "-c", code, json.dumps(cfg)], capture_output=True, text=True, check=True).stdout)


@needs_namespaces
def test_the_host_lists_a_namespaced_process_under_its_host_pid_and_its_writes_keep_it(folder, namespaces, host_process):
    cfg = config(folder)
    host = SimulatedBackend(cfg)
    _, _, l4a, l4b = gpus(host)
    ns = namespaces(cfg)
    ns.put(l4a, 2048, sm=30)  # pid 1 of its namespace

    data = saved(cfg)
    assert data["pidns"] == ns.ns and data["started"].keys() == {"1"}  # written from in there: plain pids are its own
    s = host.sample()[l4a]
    assert [p.pid for p in s.processes] == [ns.host_pid] and s.memory_used_mib == 2048 and s.utilization_pct == 30.0
    assert fresh_reader(cfg)[l4a] == {"pids": [ns.host_pid], "used": 2048}  # found by a reader that knew nothing of it
    assert host.started_at(ns.host_pid) == pytest.approx(process_started(ns.host_pid), abs=1)

    # the host's writes keep it (its namespace's pid 1 is not the host's pid 1)
    host.set_utilization(l4b, 10)
    kernel = host_process()
    host.add_process(l4b, kernel, 1024, 20, started=process_started(kernel))
    data = saved(cfg)
    assert data["pidns"] == pid_namespace() and data["started"].keys() == {f"1@{ns.ns}", str(kernel)}
    assert data["processes"][l4a] == [{"pid": 1, "pidns": ns.ns, "used_memory_mib": 2048, "sm_util_pct": 30.0}]
    assert pids(host, l4a) == [ns.host_pid] and pids(host, l4b) == [kernel]
    assert fresh_reader(cfg)[l4a] == {"pids": [ns.host_pid], "used": 2048}


@needs_namespaces
def test_the_host_drops_a_namespaced_process_once_it_exits_and_a_namespace_once_it_ended(folder, namespaces):
    cfg = config(folder)
    host = SimulatedBackend(cfg)
    _, mig, l4a, l4b = gpus(host)
    ns = namespaces(cfg)
    worker = ns.spawn(l4a, 4096, sm=50)
    ns.put(mig, 1024)
    seen = host_pid(ns.ns, worker)
    assert pids(host, l4a) == [seen] and pids(host, mig) == [ns.host_pid]

    ns.do("kill", pid=worker)  # one process exits, its namespace lives on
    s = host.sample()[l4a]
    assert s.processes == () and s.memory_used_mib == 0 and s.utilization_pct == 0.0
    assert fresh_reader(cfg)[l4a] == {"pids": [], "used": 0}
    host.set_utilization(l4b, 5)  # a write drops it
    assert f"{worker}@{ns.ns}" not in saved(cfg)["started"] and l4a not in saved(cfg)["processes"]
    assert saved(cfg)["processes"][mig] == [{"pid": 1, "pidns": ns.ns, "used_memory_mib": 1024}]

    ns.exit()  # the whole namespace ends
    assert pids(host, mig) == [] and host.sample()[mig].memory_used_mib == 0
    after = fresh_reader(cfg)[mig]  # a reader that never saw that namespace
    if pid_namespace() == INITIAL_PID_NAMESPACE:
        assert after == {"pids": [], "used": 0}  # on the host every namespace is visible: that one ended
    else:  # (these tests run inside a container: a namespace never seen may be one not visible from here)
        assert after == {"pids": [], "used": 1024}
    host.set_utilization(l4b, 6)
    assert saved(cfg).get("started", {}) == {}
    assert mig not in saved(cfg)["processes"]


@needs_namespaces
def test_a_reader_in_a_namespace_lists_its_own_and_counts_but_keeps_what_it_cannot_see(folder, namespaces, host_process):
    cfg = config(folder)
    host = SimulatedBackend(cfg)
    a100, mig, l4a, _ = gpus(host)
    kernel = host_process()
    host.add_process(mig, kernel, 4096, 20, started=process_started(kernel))
    first, second = namespaces(cfg), namespaces(cfg)
    first.put(mig, 1024, sm=10)  # a write from in there: the host's process stays
    second.put(mig, 512, sm=5)  # pid 1 again, of another namespace: another process
    second.put(l4a, 256)

    data = saved(cfg)
    assert data["pidns"] == second.ns
    assert data["started"].keys() == {f"{kernel}@{pid_namespace()}", f"1@{first.ns}", "1"}
    assert sorted((p["pid"], p.get("pidns", 0)) for p in data["processes"][mig]) == [(1, 0), (1, first.ns), (kernel, pid_namespace())]

    # inside: its own process under its own pid; the others not listed, their memory and work counted
    inside = first.sample()
    assert inside[mig] == {"pids": [1], "used": 4096 + 1024 + 512, "util": 35.0}
    assert inside[a100] == {"pids": [1], "used": 4096 + 1024 + 512, "util": 35.0}
    assert inside[l4a] == {"pids": [], "used": 256, "util": 0.0}
    assert second.sample()[mig] == {"pids": [1], "used": 4096 + 1024 + 512, "util": 35.0}
    # the host: all of them, under their host pids
    assert sorted(pids(host, mig)) == sorted([kernel, first.host_pid, second.host_pid])
    s = host.sample()[a100]
    assert s.memory_used_mib == 4096 + 1024 + 512 and s.utilization_pct == 35.0
    assert sorted(fresh_reader(cfg)[mig]["pids"]) == sorted([kernel, first.host_pid, second.host_pid])

    # the host process exits: the host drops it; a namespace's reader cannot tell, and keeps it until then
    host_kernel = psutil.Process(kernel)
    host_kernel.kill()
    host_kernel.wait()
    second.put(l4a, 128)
    assert f"{kernel}@{pid_namespace()}" in saved(cfg)["started"]
    host.set_utilization(l4a, 1)
    assert str(kernel) not in saved(cfg)["started"] and first.sample()[mig]["used"] == 1024 + 512


@needs_namespaces
def test_a_pid_given_again_in_the_namespace_to_another_process_is_not_believed(folder, namespaces):
    cfg = config(folder)
    host = SimulatedBackend(cfg)
    _, _, l4a, l4b = gpus(host)
    ns = namespaces(cfg)
    gone = ns.spawn(l4a, 4096, sm=50)
    assert pids(host, l4a) == [host_pid(ns.ns, gone)]
    time.sleep(1.2)  # (start times are told apart to the second)
    ns.do("kill", pid=gone)
    again = ns.spawn(last_pid=gone - 1)  # another process, given the same pid, puts nothing on a GPU
    assert again == gone
    assert saved(cfg)["pidns"] == ns.ns and str(gone) in saved(cfg)["started"]  # (nobody wrote since)

    fresh = SimulatedBackend(cfg)  # (knows nothing of the first)
    for reader in (host, fresh):
        s = reader.sample()[l4a]
        assert s.processes == () and s.memory_used_mib == 0 and s.utilization_pct == 0.0
    assert fresh_reader(cfg)[l4a] == {"pids": [], "used": 0}
    assert ns.sample()[l4a] == {"pids": [], "used": 0, "util": 0.0}
    host.set_utilization(l4b, 3)
    assert saved(cfg).get("started", {}) == {} and l4a not in saved(cfg)["processes"]


@needs_namespaces
def test_a_users_file_is_believed_for_its_owners_processes_of_another_namespace_only(folder, namespaces, caplog):
    cfg = config(folder)
    broker = SimulatedBackend(cfg)  # root's: makes the users' folder
    _, _, l4a, l4b = gpus(broker)
    ns = namespaces(cfg)
    users = ns.spawn(l4a, 2048, sm=40, uid=USER)  # a user's kernel in a container: writes its own file
    path = Path(cfg["state_file"] + ".d") / f"{USER}.json"
    assert json.loads(path.read_text())["pidns"] == ns.ns and path.stat().st_uid == USER
    s = broker.sample()[l4a]
    assert [p.pid for p in s.processes] == [host_pid(ns.ns, users)] and s.memory_used_mib == 2048
    assert ns.sample()[l4a] == {"pids": [users], "used": 2048, "util": 40.0}

    # the user's file says that the namespace's pid 1 (root's) is theirs, and a process of a namespace nobody sees
    data = json.loads(path.read_text())
    data["processes"][l4b] = [{"pid": 1, "used_memory_mib": 8192}, {"pid": 7, "pidns": 4_000_000_123, "used_memory_mib": 8192}]
    data["started"].update({"1": process_started(ns.host_pid), "7@4000000123": time.time()})
    fd = os.open(path, os.O_WRONLY | os.O_TRUNC)  # (no O_CREAT: another account's file in a sticky folder)
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(data))
    with caplog.at_level(logging.ERROR):
        s = broker.sample()
    assert s[l4b].processes == () and s[l4b].memory_used_mib == 0
    assert [p.pid for p in s[l4a].processes] == [host_pid(ns.ns, users)]
    assert f"ignoring process 1 (pid namespace {ns.ns})" in caplog.text and "it is uid 0's" in caplog.text
    assert ns.sample()[l4b] == {"pids": [], "used": 0, "util": 0.0}


@needs_namespaces
def test_a_user_writing_their_file_from_a_namespace_keeps_their_processes_it_cannot_see(folder, namespaces, host_user_process):
    cfg = config(folder)
    broker = SimulatedBackend(cfg)
    _, _, l4a, l4b = gpus(broker)
    on_host = host_user_process(cfg, l4a, 1024)  # the user's kernel on the host
    ns = namespaces(cfg)
    inside = ns.spawn(l4b, 2048, uid=USER)  # and one in a container: the same file, written from there
    data = json.loads((Path(cfg["state_file"] + ".d") / f"{USER}.json").read_text())
    assert data["pidns"] == ns.ns and data["started"].keys() == {f"{on_host}@{pid_namespace()}", str(inside)}
    s = broker.sample()
    assert [p.pid for p in s[l4a].processes] == [on_host] and [p.pid for p in s[l4b].processes] == [host_pid(ns.ns, inside)]
    # inside, the host's process of a user's file cannot be checked (whose it is, whether it runs): not believed
    assert ns.sample()[l4a] == {"pids": [], "used": 0, "util": 0.0}


@needs_namespaces
def test_the_simulated_cuda_checkpoint_works_inside_the_namespace_of_its_process(folder, namespaces, host_process):
    cfg = config(folder)
    host = SimulatedBackend(cfg)
    _, _, l4a, l4b = gpus(host)
    ns = namespaces(cfg)
    kernel = ns.spawn(l4a, 6144, sm=0)
    seen = host_pid(ns.ns, kernel)
    other = host_process()  # a host process on the same GPU, under a pid the namespace does not have
    host.add_process(l4a, other, 1024, started=process_started(other))
    for action in ("lock", "checkpoint"):
        ns.do("checkpoint", argv=["--action", action, "--pid", str(kernel)])
    assert ns.do("checkpoint", argv=["--get-state", "--pid", str(kernel)])["out"] == "checkpointed"
    store = json.loads(Path(cfg["state_file"] + ".checkpoints.json").read_text())
    assert list(store) == [f"{kernel}@{ns.ns}"]
    assert pids(host, l4a) == [other] and host.sample()[l4a].memory_used_mib == 1024
    for action, more in (("restore", ["--device-map", f"{l4a}={l4b}"]), ("unlock", [])):
        ns.do("checkpoint", argv=["--action", action, "--pid", str(kernel), *more])
    assert pids(host, l4b) == [seen] and host.sample()[l4b].memory_used_mib == 6144
    assert pids(host, l4a) == [other]
    assert ns.sample()[l4b]["pids"] == [kernel] and not json.loads(Path(cfg["state_file"] + ".checkpoints.json").read_text())
    ns.do("kill", pid=kernel)
    assert pids(host, l4b) == []  # restored with its start time: it leaves the GPU when it exits


def test_a_sample_scans_proc_only_for_entries_of_another_namespace_not_judged_before(tmp_path, monkeypatch):
    cfg = {"gpus": POOL, "state_file": str(tmp_path / "sim-gpus.json")}
    sim = SimulatedBackend(cfg)
    _, mig, l4a, _ = gpus(sim)
    scans = []
    real = simulated._Namespaces._scan
    monkeypatch.setattr(simulated._Namespaces, "_scan", lambda self: scans.append(1) or real(self))
    sim.add_process(l4a, os.getpid(), 1024, started=process_started(os.getpid()))
    for _ in range(3):
        assert pids(sim, l4a) == [os.getpid()]
    assert scans == []  # every entry of this process's namespace: no scan

    # an entry of a namespace with no such process (made up), written by hand
    data = saved(cfg)
    data["processes"][mig] = [{"pid": 7, "pidns": 4_000_000_321, "used_memory_mib": 512}]
    data["started"]["7@4000000321"] = time.time()
    Path(cfg["state_file"]).write_text(json.dumps(data))
    samples = [sim.sample() for _ in range(5)]
    assert len(scans) == 1  # judged once
    assert all(s[mig].processes == () for s in samples)
    # judged gone where every namespace is visible (the host), else not visible from here: counted
    expected = 0 if pid_namespace() == INITIAL_PID_NAMESPACE else 512
    assert {s[mig].memory_used_mib for s in samples} == {expected}


@pytest.mark.skipif(pid_namespace() is None, reason="needs /proc (Linux), to tell pid namespaces")
def test_the_file_says_the_namespace_of_its_pids_and_older_files_are_the_readers(tmp_path):
    cfg = {"gpus": POOL, "state_file": str(tmp_path / "sim-gpus.json")}
    _, mig, l4a, l4b = gpus(SimulatedBackend(cfg))
    me, started = os.getpid(), process_started(os.getpid())
    Path(cfg["state_file"]).write_text(json.dumps({  # as written before pid namespaces were told apart
        "processes": {l4a: [{"pid": me, "used_memory_mib": 100}],
                      l4b: [{"pid": 3_999_999, "used_memory_mib": 50}, {"pid": 5, "pidns": 4_000_000_999, "used_memory_mib": 70}]},
        "started": {str(me): started},
    }))
    sim = SimulatedBackend(cfg)
    assert pids(sim, l4a) == [me]  # no namespace said: the reader's
    assert pids(sim, l4b) == [3_999_999]  # without a start time: stays (one said to be of another namespace: ignored)
    sim.add_process(mig, me, 10, started=started)
    data = saved(cfg)
    assert data["pidns"] == pid_namespace() and data["started"] == {str(me): started}
    assert data["processes"][l4a] == [{"pid": me, "used_memory_mib": 100}]

    # written from another namespace: this one's process as "pid@namespace"
    Path(cfg["state_file"]).write_text(json.dumps({
        "pidns": 4_000_000_555,
        "processes": {l4a: [{"pid": me, "pidns": pid_namespace(), "used_memory_mib": 100}]},
        "started": {f"{me}@{pid_namespace()}": started},
    }))
    sim = SimulatedBackend(cfg)
    assert pids(sim, l4a) == [me] and sim.started_at(me) == started
    sim.remove_process(me)
    assert saved(cfg)["processes"] == {} and saved(cfg).get("started", {}) == {}
