"""The systemd engine (The Littlest JupyterHub's SystemdSpawner): the unit's devices follow the lease.

systemd cannot run units on the machines the tests run on (it is not PID 1 there), so the
checks stop at systemd's door: the unit properties and ``systemctl set-property`` commands the
spawner produces for each kind of lease and each change, exactly. The spawner's own start, stop
and lease changes run for real, as processes: ``systemd-run`` and ``systemctl`` on the test's
PATH are stand-ins that record their argv and keep each unit's state (active or not), and the
spawner runs through SystemdSpawner's real code against a broker stand-in (the in-memory one
of test_spawner_unit.py). What systemd does with the properties on a real host is systemd's.
"""

from __future__ import annotations

import asyncio
import json
import os
import pwd
import sys
import textwrap
import types
from importlib.metadata import entry_points
from typing import ClassVar

import pytest
from jupyterhub.objects import Hub
from systemdspawner import SystemdSpawner
from systemdspawner import systemd as systemd_units

from jupyter_gpulease.core.request import SPAWNER_META
from jupyter_gpulease.hub import devaccess
from jupyter_gpulease.hub import systemd as systemd_mod
from jupyter_gpulease.hub.link import BrokerLink
from jupyter_gpulease.hub.systemd import (
    GPULeaseSystemdSpawner,
    detect_units,
    device_allow_values,
    set_property_argv,
    unit_device_properties,
)
from test_spawner_unit import POOL, FakeBroker, until

UVM = 509  # nvidia-uvm's major number (dynamic; read from /proc/devices on a real host)
UNIT = "jupyter-alice-singleuser"
PTS = "char-pts rw"  # terminals: DevicePolicy=closed keeps /dev/ptmx, this keeps /dev/pts/N
CONTROL = ["/dev/nvidiactl rw", "/dev/nvidia-modeset rw", "/dev/nvidia-uvm rw", "/dev/nvidia-uvm-tools rw"]

# a pool whose GPU and MIG instances name their nodes, as api/pool gives them (systemd resolves the paths itself)
MIG_POOL = {"devices": [
    {"uuid": "GPU-m0", "node": "n1", "index": 0, "model": "A100-SXM4-80GB", "memory_mib": 81920,
     "device": "/dev/nvidia0",
     "mig": [{"uuid": "MIG-m0-0", "profile": "3g.40gb", "memory_mib": 40960, "index": 0, "device": "/dev/nvidia-caps/nvidia-cap21"},
             {"uuid": "MIG-m0-1", "profile": "3g.40gb", "memory_mib": 40960, "index": 1, "device": "/dev/nvidia-caps/nvidia-cap30"}]},
]}


def gpu(uuid, index, model="L4"):
    return {"gpu_uuid": uuid, "node": "n1", "index": index, "model": model, "memory_mib": 23034, "share": 1.0}


def lease(*slices, lid="L1", state="active"):
    return {"id": lid, "state": state, "user": "alice", "placement": {"node": "n1", "slices": list(slices)}}


# --------------------------------------------------------------------------- properties (unit)
def allow_for(leases, pool=POOL, uvm=UVM, extra=()):
    return device_allow_values(devaccess.leases_nodes(leases, devaccess.pool_gpu_nodes(pool), uvm=uvm), extra=extra)


def test_a_whole_gpu_allows_its_node_and_the_control_nodes_and_nothing_else():
    allow = allow_for([lease(gpu("GPU-l0", 2))])
    assert allow == [PTS, "/dev/nvidia2 rw", *CONTROL]
    assert unit_device_properties(allow) == {"DevicePolicy": "closed", "DeviceAllow": allow}


def test_two_gpus_allow_both_nodes():
    assert allow_for([lease(gpu("GPU-l0", 2), gpu("GPU-l1", 3))]) == [PTS, "/dev/nvidia2 rw", "/dev/nvidia3 rw", *CONTROL]


def test_a_mig_slice_allows_its_gpu_and_its_own_capability_node_not_the_other_slice():
    mig = {**gpu("GPU-m0", 0, "A100-SXM4-80GB"), "mig_uuid": "MIG-m0-1", "mig_profile": "3g.40gb", "memory_mib": 40960}
    allow = allow_for([lease(mig)], MIG_POOL)
    assert allow == [PTS, "/dev/nvidia0 rw", "/dev/nvidia-caps/nvidia-cap30 rw", *CONTROL]
    assert "/dev/nvidia-caps/nvidia-cap21 rw" not in allow


def test_no_lease_an_ended_or_a_queued_lease_allow_no_gpu_node_at_all():
    assert allow_for([]) == [PTS]
    assert allow_for([lease(gpu("GPU-l0", 2), state="expired")]) == [PTS]
    assert allow_for([{"id": "L2", "state": "queued", "placement": None}]) == [PTS]
    assert unit_device_properties([PTS]) == {"DevicePolicy": "closed", "DeviceAllow": [PTS]}


def test_the_servers_own_lease_and_one_it_took_itself_together():
    allow = allow_for([lease(gpu("GPU-l0", 2)), lease(gpu("GPU-a1", 1, "A100-SXM4-80GB"), lid="L7")])
    assert allow == [PTS, "/dev/nvidia2 rw", "/dev/nvidia1 rw", *CONTROL]


def test_the_admins_own_device_entries_stay_and_a_strict_policy_stays_strict():
    allow = allow_for([lease(gpu("GPU-l0", 2))], uvm=None, extra=["/dev/fuse rw"])
    assert allow == ["/dev/fuse rw", PTS, "/dev/nvidia2 rw", "/dev/nvidiactl rw", "/dev/nvidia-modeset rw"]
    assert unit_device_properties(allow, admin={"DevicePolicy": "strict"})["DevicePolicy"] == "strict"
    assert unit_device_properties(allow, admin={"DevicePolicy": "auto"})["DevicePolicy"] == "closed"


def test_set_property_resets_the_list_then_names_the_whole_new_list_in_one_call():
    assert set_property_argv(UNIT, ["/dev/nvidia1 rw", "/dev/nvidiactl rw"]) == [
        "systemctl", "set-property", "--runtime", UNIT, "DevicePolicy=closed",
        "DeviceAllow=", "DeviceAllow=/dev/nvidia1 rw", "DeviceAllow=/dev/nvidiactl rw"]
    # nothing allowed: the reset alone, so the closed policy leaves only the pseudo devices
    assert set_property_argv(UNIT, []) == ["systemctl", "set-property", "--runtime", UNIT, "DevicePolicy=closed", "DeviceAllow="]


def test_where_systemd_can_lock_the_units(tmp_path):
    found = {"systemd-run": "/usr/bin/systemd-run", "systemctl": "/usr/bin/systemctl"}
    assert detect_units(systemd_dir=str(tmp_path), which=found.get, euid=0)[0] is True
    assert "not the init system" in detect_units(systemd_dir=str(tmp_path / "no"), which=found.get, euid=0)[1]
    assert "not installed" in detect_units(systemd_dir=str(tmp_path), which=lambda name: None, euid=0)[1]
    assert "needs root" in detect_units(systemd_dir=str(tmp_path), which=found.get, euid=1000)[1]


def test_the_entry_point_resolves_through_jupyterhubs_spawner_loading():
    from jupyterhub.app import JupyterHub

    (ep,) = [e for e in entry_points(group="jupyterhub.spawners") if e.name == "gpulease-systemd"]
    assert ep.load() is GPULeaseSystemdSpawner
    hub = JupyterHub(spawner_class="gpulease-systemd")
    assert hub.spawner_class is GPULeaseSystemdSpawner
    assert issubclass(GPULeaseSystemdSpawner, SystemdSpawner)
    assert {"enforce_devices", "unit_extra_properties", "broker_url"} <= set(GPULeaseSystemdSpawner.class_trait_names(config=True))


def test_the_hub_says_at_start_what_enforces_device_access(monkeypatch):
    import logging

    from traitlets.config import Config

    monkeypatch.setattr(systemd_mod, "detect_units", lambda: (False, "systemd is not the init system (SystemdSpawner cannot start units here)"))
    c = Config()
    c.GPULeaseSpawner.enforce_devices = "required"
    hub = types.SimpleNamespace(spawner_class=GPULeaseSystemdSpawner, config=c, log=logging.getLogger("hub"))
    assert systemd_mod.log_at_hub_start(hub) == ("GPU device access: required but not possible on this host (systemd is not "
                                                 "the init system (SystemdSpawner cannot start units here)); GPU servers will not start")
    monkeypatch.setattr(systemd_mod, "detect_units", lambda: (True, "systemd units with DevicePolicy=closed and DeviceAllow= (SystemdSpawner)"))
    c.GPULeaseSpawner.enforce_devices = "best-effort"
    assert systemd_mod.log_at_hub_start(hub) == ("GPU device access follows the lease (best-effort): systemd units with "
                                                 "DevicePolicy=closed and DeviceAllow= (SystemdSpawner)")
    assert systemd_mod.log_at_hub_start(types.SimpleNamespace(spawner_class=SystemdSpawner, config=c, log=hub.log)) is None


# --------------------------------------------------------------------------- the spawner, with stand-in systemd tools
STANDIN = textwrap.dedent('''\
    #!{python}
    """Stand-in for systemd-run / systemctl: records argv, keeps each unit's state in a folder."""
    import json, os, sys
    base = {base!r}
    name = os.path.basename(sys.argv[0])
    args = sys.argv[1:]
    with open(os.path.join(base, "calls.jsonl"), "a") as f:
        f.write(json.dumps([name, *args]) + "\\n")
    def unit_file(u):
        return os.path.join(base, "units", u.removesuffix(".service"))
    if name == "systemd-run":
        unit = args[args.index("--unit") + 1]
        if os.path.exists(os.path.join(base, "refuse-run")):
            print("Failed to start transient service unit: Invalid argument", file=sys.stderr)
            sys.exit(1)
        open(unit_file(unit), "w").close()
        sys.exit(0)
    cmd = args[0]
    if cmd == "--version":
        print("systemd 252 (252.22-1)")
        sys.exit(0)
    unit = args[-1] if cmd in ("is-active", "is-failed", "stop", "reset-failed") else args[2]
    active = os.path.exists(unit_file(unit))
    if cmd == "is-active":
        print("active" if active else "inactive")
        sys.exit(0 if active else 3)
    if cmd == "is-failed":
        sys.exit(1)
    if cmd == "stop":
        if active:
            os.remove(unit_file(unit))
        sys.exit(0)
    if cmd == "set-property":
        if not active:
            print(f"Failed to set unit properties on {{unit}}.service: Unit {{unit}}.service not loaded.", file=sys.stderr)
            sys.exit(1)
        if os.path.exists(os.path.join(base, "refuse")):
            print("Failed to set unit properties: Access denied", file=sys.stderr)
            sys.exit(1)
        sys.exit(0)
    sys.exit(0)
''')


class FakeSystemd:
    def __init__(self, base):
        self.base = base

    def calls(self, *names):
        path = self.base / "calls.jsonl"
        rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
        return [r for r in rows if not names or r[0] in names or r[1] in names]

    def set_properties(self):
        return [r[1:] for r in self.calls("set-property")]

    def refuse(self, on=True):
        p = self.base / "refuse"
        p.touch() if on else p.unlink(missing_ok=True)

    def active(self, unit=UNIT):
        return (self.base / "units" / unit).exists()


@pytest.fixture
def fake_systemd(tmp_path, monkeypatch):
    base = tmp_path / "systemd"
    (base / "units").mkdir(parents=True)
    bindir = tmp_path / "bin"
    bindir.mkdir()
    for name in ("systemd-run", "systemctl"):
        exe = bindir / name
        exe.write_text(STANDIN.format(python=sys.executable, base=str(base)))
        exe.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(systemd_units, "RUN_ROOT", str(tmp_path / "run"))  # the units' environment files
    monkeypatch.setattr(devaccess, "uvm_major", lambda path=devaccess.PROC_DEVICES: UVM)
    # systemd as the init system, and a hub as root: the real check, on the stand-ins
    (tmp_path / "sd").mkdir()
    real_detect = systemd_mod.detect_units
    monkeypatch.setattr(systemd_mod, "detect_units", lambda: real_detect(systemd_dir=str(tmp_path / "sd"), euid=0))
    return FakeSystemd(base)


def make_spawner(broker, **kw):
    me = pwd.getpwuid(os.getuid()).pw_name  # the unit runs as a system user that exists here
    user = types.SimpleNamespace(name="alice", id=1, groups=[], url="/user/alice/", progress_url=lambda name: "")
    s = GPULeaseSystemdSpawner(user=user, hub=Hub(), broker_url="http://broker/", broker_api_token="t",
                               username_template=me, cmd=[sys.executable, "-c", "pass"], queue_refresh_interval=0.05, **kw)
    s._link = BrokerLink("http://broker/", "t", client=broker, queue_refresh_interval=0.05, feed_timeout=1)
    return s


def run_argv(fake):
    (run,) = fake.calls("systemd-run")
    return run


def device_props(argv):
    return [a for a in argv if a.startswith(("--property=DevicePolicy", "--property=DeviceAllow"))]


def set_prop(*allow):
    return ["set-property", "--runtime", UNIT, "DevicePolicy=closed", "DeviceAllow=", *(f"DeviceAllow={a}" for a in allow)]


async def settle(fake, n, what):
    await until(lambda: len(fake.set_properties()) >= n, timeout=20, what=what)
    await asyncio.sleep(0.2)  # and nothing more comes
    assert len(fake.set_properties()) == n, fake.set_properties()


def test_a_leased_gpu_is_the_only_gpu_the_unit_may_open_and_every_lease_change_is_one_set_property(fake_systemd):
    async def main():
        broker = FakeBroker(grant_at_once=True)
        s = make_spawner(broker, on_lease_end="keep", enforce_devices="required")
        s.user_options = {"gpus": 1, "model": "L4"}
        await s.start()
        assert s.lease_id == "L1"
        run = run_argv(fake_systemd)
        assert run[1:3] == ["--unit", UNIT]
        assert device_props(run) == ["--property=DevicePolicy=closed",
                                     *(f"--property=DeviceAllow={a}" for a in (PTS, "/dev/nvidia2 rw", *CONTROL))]
        i = run.index(sys.executable)  # the server's command follows the properties
        assert run[i:i + 3] == [sys.executable, "-c", "pass"]
        # the lease reaches the environment too (the unit's environment file)
        env = (fake_systemd.base.parent / "run" / UNIT / f"{UNIT}.env").read_text()
        assert "CUDA_VISIBLE_DEVICES=GPU-l0" in env.splitlines()
        assert fake_systemd.set_properties() == []

        # an admin revokes the lease (the hub hears it through the broker's feed): no GPU stays allowed
        broker.end("L1", "revoked", actor="admin")
        await settle(fake_systemd, 1, "the deny after the revoke")
        assert fake_systemd.set_properties()[-1] == set_prop(PTS)
        assert fake_systemd.active()  # on_lease_end = "keep": the server runs on, without a GPU

        # the server takes a lease itself (%gpu request, a resume) and is granted another GPU
        taken = await broker.request_lease({"user": "alice", "server": "", "kind": "gpu", "gpus": 1,
                                            "meta": {"spawner": SPAWNER_META, "taken_by": "server"}})
        broker.grant(taken["id"])
        broker.leases[taken["id"]]["placement"] = {"node": "n1", "slices": [gpu("GPU-a1", 1, "A100-SXM4-80GB")]}
        await settle(fake_systemd, 2, "the allow of the lease the server took")
        assert fake_systemd.set_properties()[-1] == set_prop(PTS, "/dev/nvidia1 rw", *CONTROL)
        # bob's lease is none of this unit's business
        bobs = await broker.request_lease({"user": "bob", "server": "", "kind": "gpu", "gpus": 1,
                                           "meta": {"spawner": SPAWNER_META, "taken_by": "server"}})
        broker.grant(bobs["id"])
        # the lease the server took is reclaimed (idle) or preempted: denied again
        broker.end(taken["id"], "reclaimed")
        await settle(fake_systemd, 3, "the deny after the reclaim")
        assert fake_systemd.set_properties()[-1] == set_prop(PTS)

        await s.stop()
        assert not fake_systemd.active()
        s._unfollow()

    asyncio.run(main())


class PlacingBroker(FakeBroker):
    """The in-memory broker, granting the slices a test names, from a pool whose MIG instances name their nodes."""

    def __init__(self, slices):
        super().__init__(grant_at_once=True)
        self.slices = slices

    async def pool(self, user=None, groups=None):
        pool = json.loads(json.dumps(POOL))
        for i, m in enumerate(pool["devices"][0]["mig"]):
            m["device"] = f"/dev/nvidia-caps/nvidia-cap{21 + 9 * i}"  # as the broker's api/pool names them
        return pool

    def grant(self, lid, share=1.0):
        super().grant(lid, share)
        self.leases[lid]["placement"] = {"node": "n1", "slices": self.slices}


MIG_SLICE = {**gpu("GPU-a0", 0, "A100-SXM4-80GB"), "mig_uuid": "MIG-a0-1", "mig_profile": "3g.40gb", "memory_mib": 40960}


@pytest.mark.parametrize("slices, nodes", [
    ([gpu("GPU-l1", 3)], ["/dev/nvidia3 rw"]),
    ([gpu("GPU-l0", 2), gpu("GPU-l1", 3)], ["/dev/nvidia2 rw", "/dev/nvidia3 rw"]),
    ([MIG_SLICE], ["/dev/nvidia0 rw", "/dev/nvidia-caps/nvidia-cap30 rw"]),
], ids=["one-gpu", "two-gpus", "mig-slice"])
def test_the_unit_starts_with_exactly_the_nodes_of_its_placement(fake_systemd, slices, nodes):
    async def main():
        s = make_spawner(PlacingBroker(slices))
        s.user_options = {"gpus": 1}
        await s.start()
        assert device_props(run_argv(fake_systemd)) == [
            "--property=DevicePolicy=closed", *(f"--property=DeviceAllow={a}" for a in (PTS, *nodes, *CONTROL))]
        await s.stop()
        s._unfollow()

    asyncio.run(main())


def test_a_hub_that_restarted_sets_a_running_units_devices_from_its_leases_at_once(fake_systemd):
    async def main():
        broker = FakeBroker(grant_at_once=True)
        first = make_spawner(broker)
        first.user_options = {"gpus": 1, "model": "L4"}
        await first.start()
        state = first.get_state()
        first._unfollow()
        # a new hub process: a fresh spawner from the saved state finds the unit running
        s = make_spawner(broker)
        s.load_state(state)
        assert s.unit_name == UNIT and s.lease_id == "L1"
        assert await s.poll() is None
        await settle(fake_systemd, 1, "the adopted unit's device list")
        assert fake_systemd.set_properties() == [set_prop(PTS, "/dev/nvidia2 rw", *CONTROL)]
        await s.stop()
        s._unfollow()

    asyncio.run(main())


def test_a_cpu_only_server_starts_with_no_gpu_node_allowed(fake_systemd):
    async def main():
        s = make_spawner(FakeBroker())
        s.user_options = {"kind": "cpu"}
        await s.start()
        assert device_props(run_argv(fake_systemd)) == ["--property=DevicePolicy=closed", f"--property=DeviceAllow={PTS}"]
        await s.stop()

    asyncio.run(main())


def test_enforcement_off_leaves_the_unit_as_systemdspawner_makes_it(fake_systemd):
    async def main():
        broker = FakeBroker(grant_at_once=True)
        s = make_spawner(broker, enforce_devices="off", on_lease_end="keep")
        s.user_options = {"gpus": 1}
        await s.start()
        assert device_props(run_argv(fake_systemd)) == []
        broker.end("L1", "revoked")
        await until(lambda: s.lease_id == "", what="the end")
        await asyncio.sleep(0.2)
        assert fake_systemd.set_properties() == []
        await s.stop()
        s._unfollow()

    asyncio.run(main())


def test_required_on_a_host_where_systemd_cannot_lock_units_refuses_the_spawn_saying_why(fake_systemd, monkeypatch):
    async def main():
        monkeypatch.setattr(systemd_mod, "detect_units", lambda: (False, "systemd is not the init system"))
        broker = FakeBroker(grant_at_once=True)
        s = make_spawner(broker, enforce_devices="required")
        s.user_options = {"gpus": 1}
        with pytest.raises(Exception, match=r"requires GPU device enforcement.*systemd is not the init system"):
            await s.start()
        assert fake_systemd.calls("systemd-run") == [] and broker.leases == {}
        # best-effort: the unit starts as before, and the hub said so at start
        b = make_spawner(FakeBroker(grant_at_once=True), enforce_devices="best-effort")
        b.user_options = {"gpus": 1}
        await b.start()
        assert device_props(run_argv(fake_systemd)) == []
        await b.stop()
        b._unfollow()

    asyncio.run(main())


def test_a_unit_systemd_refuses_fails_the_spawn_at_once_and_gives_the_lease_back(fake_systemd):
    async def main():
        (fake_systemd.base / "refuse-run").touch()
        broker = FakeBroker(grant_at_once=True)
        s = make_spawner(broker)
        s.user_options = {"gpus": 1, "model": "L4"}
        with pytest.raises(Exception, match=f"The server's systemd unit {UNIT} did not start"):
            await s.start()
        assert broker.leases["L1"]["state"] == "released"
        s._unfollow()

    asyncio.run(main())


def test_the_admins_unit_properties_stay_and_list_values_pass_through(fake_systemd):
    async def main():
        broker = FakeBroker(grant_at_once=True)
        s = make_spawner(broker, on_lease_end="keep",
                         unit_extra_properties={"DeviceAllow": ["/dev/fuse rw"], "MemoryHigh": "8G",
                                                "ReadWritePaths": ["/srv/{USERNAME}"]})
        s.user_options = {"gpus": 1, "model": "L4"}
        await s.start()
        run = run_argv(fake_systemd)
        assert "--property=MemoryHigh=8G" in run
        assert "--property=ReadWritePaths=/srv/alice" in run  # expanded per entry
        assert "--property=DevicePolicy=closed" in run
        assert [a for a in run if a.startswith("--property=DeviceAllow=")][:3] == [
            "--property=DeviceAllow=/dev/fuse rw", f"--property=DeviceAllow={PTS}", "--property=DeviceAllow=/dev/nvidia2 rw"]
        # the configured value is untouched for the next start
        assert s.unit_extra_properties == {"DeviceAllow": ["/dev/fuse rw"], "MemoryHigh": "8G", "ReadWritePaths": ["/srv/{USERNAME}"]}
        broker.end("L1", "expired")
        await settle(fake_systemd, 1, "the deny")
        assert fake_systemd.set_properties()[-1] == set_prop("/dev/fuse rw", PTS)
        await s.stop()
        s._unfollow()

    asyncio.run(main())


class UserCreatingStandIn(SystemdSpawner):
    """The Littlest JupyterHub's spawner, as its pattern is (tljh.user_creating_spawner): a plain
    ``start()`` that makes the ``jupyter-<name>`` system user, sets ``username_template`` to it
    and returns SystemdSpawner's coroutine. Here it records the call and names a user that exists."""

    made: ClassVar[list[str]] = []

    def start(self):
        self.made.append(f"jupyter-{self.user.name}")
        self.username_template = pwd.getpwuid(os.getuid()).pw_name
        return super().start()


class TLJHLeaseSpawner(GPULeaseSystemdSpawner, UserCreatingStandIn):
    """What the TLJH tutorial's snippet defines over TLJH's UserCreatingSpawner."""


def test_over_tljhs_user_creating_spawner_the_user_is_made_and_the_unit_locked(fake_systemd):
    async def main():
        broker = FakeBroker(grant_at_once=True)
        user = types.SimpleNamespace(name="alice", id=1, groups=[], url="/user/alice/", progress_url=lambda name: "")
        s = TLJHLeaseSpawner(user=user, hub=Hub(), broker_url="http://broker/", broker_api_token="t", unit_name_template="jupyter-{USERNAME}",
                             cmd=[sys.executable, "-c", "pass"], queue_refresh_interval=0.05)
        s._link = BrokerLink("http://broker/", "t", client=broker, queue_refresh_interval=0.05, feed_timeout=1)
        s.user_options = {"gpus": 1, "model": "L4"}
        await s.start()
        assert UserCreatingStandIn.made == ["jupyter-alice"]
        run = run_argv(fake_systemd)
        assert run[1:3] == ["--unit", "jupyter-alice"]  # TLJH's unit names
        assert device_props(run) == ["--property=DevicePolicy=closed",
                                     *(f"--property=DeviceAllow={a}" for a in (PTS, "/dev/nvidia2 rw", *CONTROL))]
        await s.stop()
        assert not fake_systemd.active("jupyter-alice")
        s._unfollow()

    asyncio.run(main())


FAKE_TLJH = '''
"""Stand-in for TLJH's module of that name: its spawner's pattern (see UserCreatingStandIn)."""
from systemdspawner import SystemdSpawner


class UserCreatingSpawner(SystemdSpawner):
    def start(self):
        return super().start()
'''


def test_the_tljh_tutorials_snippet_configures_a_hub_with_the_lease_spawner_over_tljhs(tmp_path, monkeypatch):
    """The TLJH tutorial's ``jupyterhub_config.d/gpulease.py``, run as TLJH runs it (after TLJH's own config,
    with the same ``c``), /opt/tljh moved into the test's folder and TLJH's module stood in for."""
    import re
    from pathlib import Path

    from jupyterhub.app import JupyterHub
    from traitlets.config import Config

    tutorial = (Path(__file__).resolve().parent.parent / "docs" / "tutorials" / "tljh.md").read_text()
    (snippet,) = [code for code in re.findall(r"^```python\n(.*?)^```", tutorial, re.S | re.M)
                  if code.startswith("# /opt/tljh/config/jupyterhub_config.d/gpulease.py")]
    (tmp_path / "state").mkdir()
    pkg = tmp_path / "pkgs" / "tljh"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "user_creating_spawner.py").write_text(FAKE_TLJH)
    monkeypatch.syspath_prepend(str(tmp_path / "pkgs"))
    c = Config()
    c.JupyterHub.services = [{"name": "cull-idle", "admin": True, "command": ["true"]}]  # what TLJH's config sets
    try:
        exec(compile(snippet.replace("/opt/tljh", str(tmp_path)), "gpulease.py", "exec"), {"c": c, "__name__": "gpulease_config_d"})
        from tljh.user_creating_spawner import UserCreatingSpawner
    finally:
        for name in ("tljh.user_creating_spawner", "tljh"):
            sys.modules.pop(name, None)

    hub = JupyterHub(config=c)
    cls = hub.spawner_class
    assert issubclass(cls, GPULeaseSystemdSpawner) and issubclass(cls, UserCreatingSpawner)
    assert cls.__mro__.index(GPULeaseSystemdSpawner) < cls.__mro__.index(UserCreatingSpawner)
    assert [s["name"] for s in hub.services] == ["cull-idle", "gpulease", "gpulease-spawner"]
    token = (tmp_path / "state" / "gpulease-spawner.token")
    assert token.stat().st_mode & 0o777 == 0o600 and hub.services[2]["api_token"] == token.read_text().strip()
    for section in ("GPULeaseSpawner", "Spawner"):  # a typo would be ignored by traitlets
        assert set(c[section]) <= set(cls.class_trait_names(config=True)), section
    monkeypatch.setattr(systemd_mod, "detect_units", lambda: (True, "systemd units with DevicePolicy=closed and DeviceAllow= (SystemdSpawner)"))
    assert systemd_mod.log_at_hub_start(hub).startswith("GPU device access follows the lease (required)")
