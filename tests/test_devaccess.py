"""Device access follows the lease: the pure rules (devaccess), the mechanism found on a host,
the systemd scope's exact commands (systemd cannot run here), and the hub's guard following a
server's leases through the event feed, on a stand-in cgroup folder."""

from __future__ import annotations

import asyncio
import os
import stat
from types import SimpleNamespace

import pytest

from jupyter_gpulease.core.model import GPU, MigInstance
from jupyter_gpulease.devices.declared import parse_inventory
from jupyter_gpulease.hub import cgroups, devaccess
from jupyter_gpulease.hub.devaccess import NVIDIA_MAJOR, DeviceNode

N = DeviceNode


def pool_json(*gpus: GPU) -> dict:
    return {"devices": [g.to_dict() for g in gpus]}


def lease(lid: str, *slices: tuple[str, str], state: str = "active", **kw) -> dict:
    return {"id": lid, "state": state, "placement": {"slices": [{"gpu_uuid": g, "mig_uuid": m} for g, m in slices]}, **kw}


G0 = GPU("GPU-0", "n1", 0, "L4", 23034)
G1 = GPU("GPU-1", "n1", 1, "L4", 23034)
GM = GPU("GPU-2", "n1", 2, "A100", 81920, mig=(MigInstance("MIG-a", "3g.40gb", 40960, 0, device="/dev/nvidia-caps/nvidia-cap21"),
                                                 MigInstance("MIG-b", "3g.40gb", 40960, 1, device="/dev/nvidia-caps/nvidia-cap30")),
         device="/dev/nvidia2")
CTL = [N("/dev/nvidiactl", 195, 255), N("/dev/nvidia-modeset", 195, 254)]


# --------------------------------------------------------------------------- the pure module
def test_a_gpu_without_a_named_node_is_dev_nvidia_index():
    assert devaccess.pool_gpu_nodes(pool_json(G0, G1)) == {"GPU-0": N("/dev/nvidia0", NVIDIA_MAJOR, 0), "GPU-1": N("/dev/nvidia1", 195, 1)}


def test_named_nodes_take_their_numbers_from_the_json_or_from_stat_and_stay_unresolved_without():
    gpu = {"uuid": "GPU-x", "index": 0, "device": "/tmp/x/nvidia0", "device_major": 195, "device_minor": 7}
    assert devaccess.pool_gpu_nodes({"devices": [gpu]}) == {"GPU-x": N("/tmp/x/nvidia0", 195, 7)}
    nodes = devaccess.pool_gpu_nodes(pool_json(GM))
    assert nodes["GPU-2"] == N("/dev/nvidia2", -1, -1) and not nodes["GPU-2"].resolved
    assert nodes["MIG-a"].path == "/dev/nvidia-caps/nvidia-cap21"
    fake = {"/dev/nvidia2": (195, 2), "/dev/nvidia-caps/nvidia-cap21": (508, 21), "/dev/nvidia-caps/nvidia-cap30": (508, 30)}

    def fake_stat(path):
        if path not in fake:
            raise FileNotFoundError(path)
        return SimpleNamespace(st_mode=stat.S_IFCHR | 0o666, st_rdev=os.makedev(*fake[path]))

    nodes = devaccess.pool_gpu_nodes(pool_json(GM), stat=fake_stat)
    assert nodes == {"GPU-2": N("/dev/nvidia2", 195, 2), "MIG-a": N("/dev/nvidia-caps/nvidia-cap21", 508, 21),
                     "MIG-b": N("/dev/nvidia-caps/nvidia-cap30", 508, 30)}
    # a missing node or a plain file: unresolved, so neither allowed nor denied
    assert not devaccess.pool_gpu_nodes({"devices": [{"uuid": "G", "index": 0, "device": "/nope"}]}, stat=fake_stat)["G"].resolved


def test_a_lease_allows_its_gpus_and_the_control_nodes_only_while_it_holds_them():
    nodes = devaccess.pool_gpu_nodes(pool_json(G0, G1))
    assert devaccess.lease_nodes(lease("a", ("GPU-1", "")), nodes) == [N("/dev/nvidia1", 195, 1), *CTL]
    assert devaccess.lease_nodes(lease("a", ("GPU-1", ""), state="released"), nodes) == []
    assert devaccess.lease_nodes({"id": "q", "state": "queued", "placement": None}, nodes) == []
    assert devaccess.lease_nodes(None, nodes) == []
    uvm = devaccess.lease_nodes(lease("a", ("GPU-0", "")), nodes, uvm=510)
    assert uvm[-2:] == [N("/dev/nvidia-uvm", 510, 0), N("/dev/nvidia-uvm-tools", 510, 1)]


def test_a_mig_lease_allows_its_gpu_and_its_own_instance_not_the_neighbour():
    nodes = devaccess.pool_gpu_nodes(pool_json(GM), stat=lambda p: SimpleNamespace(st_mode=stat.S_IFCHR, st_rdev=os.makedev(195 if "cap" not in p else 508, int(p[-2:]) if "cap" in p else 2)))
    allowed = devaccess.lease_nodes(lease("m", ("GPU-2", "MIG-a")), nodes)
    assert allowed[:2] == [N("/dev/nvidia2", 195, 2), N("/dev/nvidia-caps/nvidia-cap21", 508, 21)]
    assert devaccess.denied_nodes(allowed, nodes) == [N("/dev/nvidia-caps/nvidia-cap30", 508, 30)]


def test_a_mig_lease_allows_both_access_nodes_of_its_instance_and_neither_of_the_neighbours():
    """CUDA opens a MIG slice through two capability nodes: its GPU instance's and its compute instance's."""
    gpus = parse_inventory([{"model": "A100", "memory_mib": 81920, "mig": ["3g.40gb", "3g.40gb"], "devices": [
        {"device": "/dev/nvidia2", "mig": [["/dev/nvidia-caps/nvidia-cap21", "/dev/nvidia-caps/nvidia-cap22"],
                                           ["/dev/nvidia-caps/nvidia-cap30", "/dev/nvidia-caps/nvidia-cap31"]]}]}])
    d = gpus[0].to_dict()
    assert [(m["device"], m["compute_device"]) for m in d["mig"]] == [
        ("/dev/nvidia-caps/nvidia-cap21", "/dev/nvidia-caps/nvidia-cap22"), ("/dev/nvidia-caps/nvidia-cap30", "/dev/nvidia-caps/nvidia-cap31")]
    assert GPU.from_dict(d).mig[1].compute_device == "/dev/nvidia-caps/nvidia-cap31"
    numbers = {"/dev/nvidia2": (195, 2), **{f"/dev/nvidia-caps/nvidia-cap{n}": (508, n) for n in (21, 22, 30, 31)}}
    nodes = devaccess.pool_gpu_nodes({"devices": [d]}, stat=lambda p: SimpleNamespace(st_mode=stat.S_IFCHR, st_rdev=os.makedev(*numbers[p])))
    first, _second = (m["uuid"] for m in d["mig"])
    allowed = devaccess.lease_nodes(lease("m", (d["uuid"], first)), nodes)
    assert allowed[:3] == [N("/dev/nvidia2", 195, 2), N("/dev/nvidia-caps/nvidia-cap21", 508, 21), N("/dev/nvidia-caps/nvidia-cap22", 508, 22)]
    assert devaccess.denied_nodes(allowed, nodes) == [N("/dev/nvidia-caps/nvidia-cap30", 508, 30), N("/dev/nvidia-caps/nvidia-cap31", 508, 31)]
    allow, deny = devaccess.v1_rules(allowed, devaccess.denied_nodes(allowed, nodes))
    assert "c 508:22 rwm" in allow and deny == ["c 508:30 rwm", "c 508:31 rwm"]


def test_a_server_without_a_lease_is_denied_every_gpu_and_the_control_nodes():
    nodes = devaccess.pool_gpu_nodes(pool_json(G0, G1))
    assert devaccess.denied_nodes([], nodes) == [N("/dev/nvidia0", 195, 0), N("/dev/nvidia1", 195, 1), *CTL]
    allow, deny = devaccess.v1_rules([], devaccess.denied_nodes([], nodes))
    assert allow == [] and deny == ["c 195:0 rwm", "c 195:1 rwm", "c 195:255 rwm", "c 195:254 rwm"]


def test_rules_in_both_syntaxes():
    nodes = devaccess.pool_gpu_nodes(pool_json(G0, G1))
    allowed = devaccess.leases_nodes([lease("a", ("GPU-0", "")), lease("b", ("GPU-0", ""))], nodes)
    assert devaccess.systemd_device_allow(allowed) == ["/dev/nvidia0 rw", "/dev/nvidiactl rw", "/dev/nvidia-modeset rw"]
    allow, deny = devaccess.v1_rules(allowed, devaccess.denied_nodes(allowed, nodes))
    assert allow == ["c 195:0 rwm", "c 195:255 rwm", "c 195:254 rwm"] and deny == ["c 195:1 rwm"]
    # unresolved nodes are left out; a node both allowed and denied is allowed
    assert devaccess.v1_rules([N("/x", -1, -1), N("/a", 195, 3)], [N("/a", 195, 3)]) == (["c 195:3 rwm"], [])


def test_proc_devices_gives_the_uvm_major(tmp_path):
    p = tmp_path / "devices"
    p.write_text("Character devices:\n  1 mem\n195 nvidia-frontend\n195 nvidia\n508 nvidia-uvm\n\nBlock devices:\n  8 sd\n508 nvidia-uvm-bogus\n")
    assert devaccess.uvm_major(str(p)) == 508
    assert devaccess.read_char_majors(str(p))["nvidia"] == 195
    assert devaccess.uvm_major(str(tmp_path / "missing")) is None


def test_the_declared_pool_names_each_gpus_node_and_refuses_a_bad_list():
    gpus = parse_inventory([{"model": "L4", "count": 2, "memory_mib": 100, "devices": ["/tmp/x/nvidia0", "/tmp/x/nvidia1"]},
                            {"model": "A100", "memory_mib": 81920, "mig": ["3g.40gb", "3g.40gb"],
                             "devices": [{"device": "/dev/nvidia2", "mig": ["/dev/nvidia-caps/nvidia-cap21", "/dev/nvidia-caps/nvidia-cap30"]}]}])
    d = [g.to_dict() for g in gpus]
    assert [x["device"] for x in d] == ["/tmp/x/nvidia0", "/tmp/x/nvidia1", "/dev/nvidia2"]
    assert [m["device"] for m in d[2]["mig"]] == ["/dev/nvidia-caps/nvidia-cap21", "/dev/nvidia-caps/nvidia-cap30"]
    assert GPU.from_dict(d[0]).device == "/tmp/x/nvidia0"
    assert "device" not in parse_inventory([{"model": "L4", "memory_mib": 100}])[0].to_dict()  # unchanged JSON without it
    for bad, says in ((["/a"], "one device node per GPU (2)"), (["/a", "b"], "not an absolute path"),
                      ([{"device": "/a", "mig": ["/c", "/d"]}, "/b"], "per MIG instance (1), its access node or the pair"),
                      ([{"device": "/a", "mig": [["/c"]]}, "/b"], "per MIG instance (1), its access node or the pair")):
        with pytest.raises(ValueError, match=says.replace("(", r"\(").replace(")", r"\)")):
            parse_inventory([{"model": "L4", "count": 2, "memory_mib": 81920, "devices": bad, **({"mig": ["1g.10gb"]} if "MIG" in says else {})}])


# --------------------------------------------------------------------------- the host's mechanism
MOUNTINFO_V1 = """31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
36 31 0:33 / /sys/fs/cgroup/devices rw,relatime - cgroup cgroup rw,devices
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
"""
MOUNTINFO_V2 = "30 23 0:27 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n"


def test_the_mechanism_found_on_a_host(tmp_path):
    v1 = tmp_path / "v1"
    v1.write_text(MOUNTINFO_V1.replace("/sys/fs/cgroup/devices", str(tmp_path / "devices")))
    (tmp_path / "devices").mkdir()
    m = cgroups.detect("gp", mountinfo=str(v1), euid=0)
    assert m.kind == "v1" and isinstance(m.backend, cgroups.V1Devices) and (tmp_path / "devices" / "gp").is_dir()
    assert cgroups.detect("gp", mountinfo=str(v1), euid=1000, systemd_dir=str(tmp_path / "none")).kind == "none"
    v2 = tmp_path / "v2"
    v2.write_text(MOUNTINFO_V2)
    (tmp_path / "systemd").mkdir()
    m = cgroups.detect("gp", mountinfo=str(v2), euid=0, systemd_dir=str(tmp_path / "systemd"), which=lambda n: f"/usr/bin/{n}")
    assert m.kind == "systemd" and isinstance(m.backend, cgroups.SystemdScopes)
    m = cgroups.detect("gp", mountinfo=str(v2), euid=0, systemd_dir=str(tmp_path / "nosystemd"), which=lambda n: f"/usr/bin/{n}")
    assert m.kind == "none" and m.why == "no cgroup v1 devices controller is mounted; systemd is not the init system (no systemd scopes)"
    assert "GPU servers will not start" in cgroups.hub_start_line("required", m)
    assert "not enforced on this host" in cgroups.hub_start_line("best-effort", m)


def test_one_hub_per_parent_a_second_is_refused_with_the_holders_pid_and_a_stop_removes_what_is_empty(tmp_path):
    import subprocess
    import sys

    parent = f"gp-claim-{os.getpid()}"
    lock = tmp_path / f"jupyter-gpulease-{parent}.lock"
    # another hub (a process of its own) holds the parent
    other = subprocess.Popen([sys.executable, "-c", f"import fcntl, os, time; fd = os.open({str(lock)!r}, os.O_RDWR | os.O_CREAT); "
                              "fcntl.flock(fd, fcntl.LOCK_EX); os.write(fd, str(os.getpid()).encode()); print('held', flush=True); time.sleep(60)"],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert other.stdout.readline().strip() == "held"
        why = cgroups.claim_parent(parent, lock_dir=str(tmp_path))
        assert why == (f"another hub on this host (pid {other.pid}) uses the device cgroup parent {parent!r}; "
                       "give each hub its own c.GPULeaseSpawner.device_cgroup_parent")
        assert cgroups.detect(parent, euid=0).why == why and cgroups.detect(parent, euid=0).backend is None
    finally:
        other.kill()
        other.wait()
    # a parent nobody holds: this process takes it (again: still its own); its stop removes the
    # empty cgroups and the parent, and lets go of the lock
    mine = parent + "-mine"
    assert cgroups.claim_parent(mine, lock_dir=str(tmp_path)) == "" and cgroups.claim_parent(mine, lock_dir=str(tmp_path)) == ""
    v1 = tmp_path / "v1"
    v1.write_text(MOUNTINFO_V1.replace("/sys/fs/cgroup/devices", str(tmp_path / "devices")))
    (tmp_path / "devices" / mine / "alice").mkdir(parents=True)
    cgroups.release_parent(mine, mountinfo=str(v1))
    assert not (tmp_path / "devices" / mine).exists()
    assert mine not in cgroups._held


# --------------------------------------------------------------------------- systemd (v2), as commands
def test_the_systemd_scope_and_its_changes_are_these_commands():
    ran = []
    scopes = cgroups.SystemdScopes("jupyter-gpulease", run=lambda cmd, **kw: ran.append(cmd) or SimpleNamespace(returncode=0, stderr=""))
    nodes = devaccess.pool_gpu_nodes(pool_json(G0, G1))
    allowed = devaccess.lease_nodes(lease("a", ("GPU-1", "")), nodes)
    assert scopes.unit("alice") == "jupyter-gpulease-alice.scope"
    assert scopes.unit("j.doe:gpu 2") == "jupyter-gpulease-j.doe:gpu\\x202.scope"
    unit = scopes.unit("alice")
    assert scopes.command_prefix("alice", allowed) == [
        "systemd-run", "--scope", "--quiet", "--collect", f"--unit={unit}",
        "-p", "DevicePolicy=closed", "-p", "DeviceAllow=char-pts rw", "-p", "DeviceAllow=/dev/nvidia1 rw",
        "-p", "DeviceAllow=/dev/nvidiactl rw", "-p", "DeviceAllow=/dev/nvidia-modeset rw", "--"]
    scopes.attach("alice", 1234)
    scopes.apply("alice", [], devaccess.denied_nodes([], nodes))  # the lease ended: nothing but the terminals
    assert ran == [["systemctl", "set-property", "--runtime", unit, "DevicePolicy=closed", "DeviceAllow=", "DeviceAllow=char-pts rw"]]
    scopes.apply("alice", allowed, [])
    assert ran[-1][-3:] == ["DeviceAllow=/dev/nvidia1 rw", "DeviceAllow=/dev/nvidiactl rw", "DeviceAllow=/dev/nvidia-modeset rw"]
    assert scopes.remove("alice")
    scopes.apply("alice", allowed, [])  # a scope it no longer runs: no command
    assert len(ran) == 2
    failing = cgroups.SystemdScopes(run=lambda cmd, **kw: SimpleNamespace(returncode=1, stderr="Unit x.scope not loaded."))
    failing.command_prefix("bob", [])
    with pytest.raises(OSError, match="not loaded"):
        failing.apply("bob", [], [])


# --------------------------------------------------------------------------- the guard, on a stand-in folder
class FakeClient:
    def __init__(self, pool, leases):
        self._pool, self.leases, self.gets = pool, leases, []

    async def pool(self):
        return self._pool

    async def get_lease(self, lid):
        self.gets.append(lid)
        return self.leases[lid]

    async def list_leases(self, state=None, user=None):
        return [x for x in self.leases.values() if user is None or x.get("user") == user]


class FakeLink:
    def __init__(self, client):
        self.client, self.listeners = client, []

    def add_event_listener(self, cb):
        self.listeners.append(cb)

    def send(self, ev):
        for cb in self.listeners:
            cb(ev)


def _rules(folder, name):
    out = {}
    for f in ("devices.allow", "devices.deny", "cgroup.procs"):
        p = folder / "gp" / name / f
        out[f] = p.read_text() if p.exists() else ""
    return out


class RecordingV1(cgroups.V1Devices):
    """V1Devices on a plain folder: each file keeps the last rule written, so record them all."""

    def __init__(self, mount):
        super().__init__(mount, "gp")
        self.written: dict[str, list[str]] = {}

    def apply(self, name, allowed, denied):
        os.makedirs(self.path(name), exist_ok=True)
        allow, deny = devaccess.v1_rules(allowed, denied)
        self.written[name] = [*(f"deny {r}" for r in deny), *(f"allow {r}" for r in allow)]


def test_the_guard_follows_a_servers_own_lease_and_those_it_takes_itself(tmp_path):
    async def main():
        gpus = [G0, G1]
        own = lease("L1", ("GPU-0", ""), user="alice", server="", meta={"spawner": "jupyter-gpulease"})
        taken = lease("L2", ("GPU-1", ""), user="alice", server="", meta={"spawner": "jupyter-gpulease", "taken_by": "server"})
        other = lease("L3", ("GPU-1", ""), user="bob", server="", meta={"spawner": "jupyter-gpulease", "taken_by": "server"})
        client = FakeClient(pool_json(*gpus), {"L2": taken, "L3": other})
        link = FakeLink(client)
        backend = RecordingV1(str(tmp_path))
        guard = cgroups.DeviceGuard(link, "required", cgroups.Mechanism("v1", "test", backend), proc_devices=str(tmp_path / "none"))
        assert await guard.server_starting("alice", "", own) == cgroups.DeviceStart()  # nothing in front of the command
        assert backend.written["alice"] == ["deny c 195:1 rwm", "allow c 195:0 rwm", "allow c 195:255 rwm", "allow c 195:254 rwm"]
        await guard.server_started("alice", "", os.getpid())
        assert (tmp_path / "gp" / "alice" / "cgroup.procs").read_text() == str(os.getpid())

        async def settle():
            for _ in range(20):
                await asyncio.sleep(0)
            await asyncio.gather(*guard._tasks)

        # her own lease ends: every GPU denied, the control nodes too
        link.send({"lease_id": "L1", "kind": "ended", "to_state": "reclaimed"})
        await settle()
        assert backend.written["alice"] == ["deny c 195:0 rwm", "deny c 195:1 rwm", "deny c 195:255 rwm", "deny c 195:254 rwm"]
        # bob's lease is granted: read once, not hers, never read again
        link.send({"lease_id": "L3", "kind": "granted", "data": {"placement": other["placement"]}})
        await settle()
        link.send({"lease_id": "L3", "kind": "ended", "to_state": "released"})
        await settle()
        assert client.gets == ["L3"]
        # the lease her server took itself: allowed while it lasts
        link.send({"lease_id": "L2", "kind": "granted", "data": {"placement": taken["placement"]}})
        await settle()
        assert backend.written["alice"] == ["deny c 195:0 rwm", "allow c 195:1 rwm", "allow c 195:255 rwm", "allow c 195:254 rwm"]
        link.send({"lease_id": "L2", "kind": "ended", "to_state": "preempted"})
        await settle()
        assert backend.written["alice"][0:2] == ["deny c 195:0 rwm", "deny c 195:1 rwm"]
        # stopped: its cgroup goes (a folder here, so rmdir of an empty one)
        (tmp_path / "gp" / "alice" / "cgroup.procs").unlink()
        await guard.server_stopped("alice", "")
        assert not (tmp_path / "gp" / "alice").exists() and not guard.by_lease

    asyncio.run(main())


def test_required_without_a_mechanism_says_why():
    guard = cgroups.DeviceGuard(FakeLink(FakeClient({}, {})), "required", cgroups.Mechanism("none", "no cgroup v1 devices controller is mounted"))
    assert not guard.active
    assert "enforce_devices = 'required'" in guard.required_failure() and "no cgroup v1 devices controller" in guard.required_failure()
    assert cgroups.DeviceGuard(FakeLink(FakeClient({}, {})), "best-effort", cgroups.Mechanism("none", "x")).required_failure() == ""


def test_cgroup_and_unit_names():
    assert cgroups.cgroup_name("alice") == "alice" and cgroups.cgroup_name("alice", "gpu2") == "alice:gpu2"
    assert cgroups.cgroup_name("a/b", "c d") == "a_b:c_d"
    assert cgroups.systemd_escape("jupyter-gpulease") == "jupyter\\x2dgpulease"


def test_a_hub_that_restarted_takes_up_a_running_servers_cgroup_and_its_leases(tmp_path):
    async def main():
        own = lease("L1", ("GPU-0", ""), user="alice", server="", meta={"spawner": "jupyter-gpulease"})
        taken = lease("L2", ("GPU-1", ""), user="alice", server="", meta={"spawner": "jupyter-gpulease", "taken_by": "server"})
        elsewhere = lease("L3", ("GPU-1", ""), user="alice", server="other", meta={"spawner": "jupyter-gpulease", "taken_by": "server"})
        backend = RecordingV1(str(tmp_path))
        guard = cgroups.DeviceGuard(FakeLink(FakeClient(pool_json(G0, G1, GPU("GPU-9", "n1", 9, "L4", 1)), {"L1": own, "L2": taken, "L3": elsewhere})),
                                    "best-effort", cgroups.Mechanism("v1", "test", backend), proc_devices=str(tmp_path / "none"))
        await guard.adopt("alice", "", os.getpid(), "L1")
        assert guard.known("alice", "") and set(guard.by_lease) == {"L1", "L2"}
        assert backend.written["alice"] == ["deny c 195:9 rwm", "allow c 195:0 rwm", "allow c 195:1 rwm", "allow c 195:255 rwm", "allow c 195:254 rwm"]
        assert (tmp_path / "gp" / "alice" / "cgroup.procs").read_text() == str(os.getpid())

    asyncio.run(main())


def test_a_systemd_scope_taken_up_after_a_hub_restart_gets_its_properties_at_once():
    ran = []
    scopes = cgroups.SystemdScopes(run=lambda cmd, **kw: ran.append(cmd) or SimpleNamespace(returncode=0, stderr=""))
    scopes.adopt("alice", [N("/dev/nvidia3", 195, 3)], [])
    assert ran == [["systemctl", "set-property", "--runtime", "jupyter-gpulease-alice.scope", "DevicePolicy=closed", "DeviceAllow=",
                    "DeviceAllow=char-pts rw", "DeviceAllow=/dev/nvidia3 rw"]]


def test_a_hub_start_sweeps_the_empty_cgroups_an_earlier_hub_left(tmp_path):
    backend = cgroups.V1Devices(str(tmp_path), "gp")
    (tmp_path / "gp" / "left").mkdir(parents=True)
    (tmp_path / "gp" / "running").mkdir()
    (tmp_path / "gp" / "running" / "cgroup.procs").write_text("1234")  # a plain folder with a file: rmdir refuses, like a busy cgroup
    assert backend.sweep() == ["left"]
    assert sorted(p.name for p in (tmp_path / "gp").iterdir()) == ["running"]


# --------------------------------------------------------------------------- the spawner, with a fake broker and engine
def _spawner(tmp_path, mode, mechanism):
    from jupyter_gpulease.hub.spawner import GPULeaseSpawner
    from test_spawner_unit import FakeBroker, FakeEngine, make_spawner

    class Local(GPULeaseSpawner, FakeEngine):
        enforces_devices = True

    broker = FakeBroker(grant_at_once=True)
    s = make_spawner(broker)
    s.__class__ = type("LocalFake", (Local,), {})  # the fake engine, as a local-process engine
    s.enforce_devices = mode
    cgroups.DeviceGuard.for_link(s.link, mode=mode, mechanism=mechanism, proc_devices=str(tmp_path / "none"))
    return s, broker


def test_required_enforcement_that_the_host_cannot_give_fails_the_spawn_before_asking_for_a_gpu(tmp_path):
    async def main():
        s, broker = _spawner(tmp_path, "required", cgroups.Mechanism("none", "no cgroup v1 devices controller is mounted"))
        s.user_options = {"gpus": 1, "model": "L4"}
        with pytest.raises(Exception) as e:
            await s.start()
        return e.value, broker

    e, broker = asyncio.run(main())
    assert "enforce_devices = 'required'" in e.jupyterhub_message and "no cgroup v1 devices controller is mounted" in e.jupyterhub_message
    assert not broker.leases and not lease_requests(broker)


def lease_requests(broker):
    return [c for c in broker.calls if c[0] == "request_lease"]


def test_the_spawner_makes_the_cgroup_with_its_lease_and_follows_the_lease_through_the_feed(tmp_path):
    async def main():
        backend = RecordingV1(str(tmp_path))
        s, broker = _spawner(tmp_path, "best-effort", cgroups.Mechanism("v1", "test", backend))
        s.user_options = {"gpus": 1, "model": "L4"}
        await s.start()
        first = list(backend.written["alice"])
        s.up = True
        broker.end(s.lease_id, "reclaimed")
        await until(lambda: backend.written["alice"] != first, what="the end denies the GPU")
        after = list(backend.written["alice"])
        await s.stop()
        await until(lambda: not (tmp_path / "gp" / "alice").exists(), what="the stopped server's cgroup is removed")
        return first, after

    from test_spawner_unit import until

    first, after = asyncio.run(main())
    assert first[0].startswith("deny") and "allow c 195:2 rwm" in first  # GPU-l0 is index 2 in the fake pool
    assert "deny c 195:2 rwm" in after and not [r for r in after if r.startswith("allow")]


def test_after_the_feed_was_away_the_guard_reads_what_holds_now(tmp_path):
    async def main():
        own = lease("L1", ("GPU-0", ""), user="alice", server="", meta={"spawner": "jupyter-gpulease"})
        taken = lease("L2", ("GPU-1", ""), user="alice", server="", meta={"spawner": "jupyter-gpulease", "taken_by": "server"})
        client = FakeClient(pool_json(G0, G1), {})
        link = FakeLink(client)
        backend = RecordingV1(str(tmp_path))
        guard = cgroups.DeviceGuard(link, "required", cgroups.Mechanism("v1", "test", backend), proc_devices=str(tmp_path / "none"))
        await guard.server_starting("alice", "", own)
        # meanwhile (no events heard): her lease ended and her server took another
        client.leases = {"L2": taken}
        link.send({"kind": "resync", "lease_id": ""})
        for _ in range(5):
            await asyncio.sleep(0.01)
            await asyncio.gather(*guard._tasks)
        return backend.written["alice"]

    assert asyncio.run(main()) == ["deny c 195:0 rwm", "allow c 195:1 rwm", "allow c 195:255 rwm", "allow c 195:254 rwm"]
