"""The lease spawner's parts, each built alone: the spawn page's progress (SpawnProgress), a
server's door to the hub's device guard (ServerDevices) and the guard's clean-up when a server
stops; then the spawner's shape (one class in hub/spawner.py) and the one place where it puts a
command in front of the server's, run through JupyterHub's real LocalProcessSpawner."""

from __future__ import annotations

import ast
import asyncio
import inspect
import logging
import os
import pathlib
import sys
import types

import pytest
from jupyterhub.objects import Hub
from jupyterhub.spawner import Spawner

from jupyter_gpulease.hub import cgroups, devaccess
from jupyter_gpulease.hub.cgroups import DeviceAccessError, DeviceGuard, DeviceStart, Mechanism, ServerDevices
from jupyter_gpulease.hub.devaccess import DeviceNode
from jupyter_gpulease.hub.link import BrokerLink
from jupyter_gpulease.hub.progress import SpawnProgress
from jupyter_gpulease.hub.spawner import GPULeaseSimpleLocalProcessSpawner, GPULeaseSpawner
from jupyter_gpulease.hub.spawner_settings import GPULeaseSettings
from test_spawner_unit import FakeBroker, until

HUB = pathlib.Path(__file__).resolve().parent.parent / "jupyter_gpulease" / "hub"


# --------------------------------------------------------------------------- SpawnProgress
async def _collect(stream, into: list) -> None:
    async for event in stream:
        into.append(event)


async def _engine_events():
    yield {"message": "engine: pod scheduled"}
    yield {"message": "engine: pod running"}


def test_a_stream_opened_before_the_spawn_waits_for_its_events_then_follows_the_engine():
    async def main():
        said = []
        progress = SpawnProgress(announce=said.append)
        events: list = []
        stream = asyncio.ensure_future(_collect(progress.stream(then=_engine_events), events))
        await asyncio.sleep(0.01)
        assert not stream.done() and events == []  # no spawn yet: it waits instead of ending
        progress.begin()
        progress.emit("Asking for 1 × L4", 5)
        progress.emit("Asking for 1 × L4", 5)  # the same event twice is one event
        progress.emit("Waiting: position 2 of 3", 20, lease_id="L1", state="queued", position=2)
        await until(lambda: len(events) == 2, what="the first events")
        progress.finish(engine_starts=True)
        progress.emit("too late", 50)  # the lease part is over: nothing more of it
        await asyncio.wait_for(stream, 5)
        # a stream opened later replays the whole spawn
        late: list = []
        await asyncio.wait_for(_collect(progress.stream(), late), 5)
        return said, events, late

    said, events, late = asyncio.run(main())
    assert [e["message"] for e in events] == ["Asking for 1 × L4", "Waiting: position 2 of 3", "engine: pod scheduled", "engine: pod running"]
    assert events[0] == {"message": "Asking for 1 × L4", "progress": 5}
    assert events[1]["gpulease"] == {"lease_id": "L1", "state": "queued", "position": 2}
    assert said == ["Asking for 1 × L4", "Waiting: position 2 of 3"]
    assert late == events[:2]


def test_a_stream_of_a_spawn_that_fails_or_is_closed_ends_without_the_engines_events():
    async def main():
        progress = SpawnProgress()
        progress.begin()
        progress.emit("Asking for a GPU", 5)
        failed: list = []
        progress.finish()  # failed before the engine started
        await asyncio.wait_for(_collect(progress.stream(then=_engine_events), failed), 5)

        progress.begin()
        progress.emit("Asking again", 5)
        closed: list = []
        stream = asyncio.ensure_future(_collect(progress.stream(then=_engine_events), closed))
        await until(lambda: closed, what="the event")
        progress.close()  # the server stopped (a cancelled spawn)
        await asyncio.wait_for(stream, 5)
        return failed, closed, progress.events

    failed, closed, left = asyncio.run(main())
    assert [e["message"] for e in failed] == ["Asking for a GPU"]
    assert [e["message"] for e in closed] == ["Asking again"]
    assert left == []


def test_a_stream_that_follows_one_spawn_ends_when_a_new_spawn_begins():
    async def main():
        progress = SpawnProgress()
        progress.begin()
        progress.emit("first spawn", 5)
        first: list = []
        stream = asyncio.ensure_future(_collect(progress.stream(then=_engine_events), first))
        await until(lambda: first, what="the first spawn's event")
        progress.begin()
        progress.emit("second spawn", 5)
        await asyncio.wait_for(stream, 5)
        return first, progress.events

    first, now = asyncio.run(main())
    assert [e["message"] for e in first] == ["first spawn"]
    assert [e["message"] for e in now] == ["second spawn"]


# --------------------------------------------------------------------------- the guard and a server's door to it
GPU0, GPU1 = DeviceNode("/dev/nvidia0", 195, 0), DeviceNode("/dev/nvidia1", 195, 1)
CTL = devaccess.control_nodes(None)
POOL = {"devices": [{"uuid": "GPU-0", "index": 0}, {"uuid": "GPU-1", "index": 1}]}


def held(lid: str, uuid: str, **kw) -> dict:
    return {"id": lid, "state": "active", "user": "alice", "server": "", "placement": {"slices": [{"gpu_uuid": uuid}]}, **kw}


class FakeClient:
    def __init__(self, leases: dict | None = None):
        self.leases = leases or {}

    async def pool(self):
        return POOL

    async def get_lease(self, lid):
        return self.leases[lid]

    async def list_leases(self, state=None, user=None):
        return [x for x in self.leases.values() if user is None or x.get("user") == user]


class FakeLink:
    """The link as the guard uses it: its client and its event feed."""

    def __init__(self, client):
        self.client, self.listeners = client, []

    def add_event_listener(self, listener):
        self.listeners.append(listener)
        return lambda: self.listeners.remove(listener)

    def send(self, event):
        for listener in list(self.listeners):
            listener(event)


class RecordingBackend:
    """A device backend that records what it is told; ``removable``: whether the cgroup is empty."""

    kind = "recording"

    def __init__(self, *, prefix=(), removable=True, fail_start=False):
        self.calls: list[tuple] = []
        self.rules: dict[str, tuple[list, list]] = {}  # name -> (allowed, denied) last written
        self.prefix = tuple(prefix)
        self.removable = removable
        self.fail_start = fail_start

    def start(self, name, allowed, denied, unit=None):
        if self.fail_start:
            raise OSError("Permission denied")
        self.calls.append(("start", name, unit))
        self.rules[name] = (list(allowed), list(denied))
        return DeviceStart(command_prefix=self.prefix)

    def apply(self, name, allowed, denied):
        self.calls.append(("apply", name))
        self.rules[name] = (list(allowed), list(denied))

    def adopt(self, name, allowed, denied, unit=None):
        self.calls.append(("adopt", name, unit))
        self.rules[name] = (list(allowed), list(denied))

    def retire(self, name, denied):
        self.calls.append(("retire", name))
        self.rules[name] = ([], list(denied))

    def attach(self, name, pid):
        self.calls.append(("attach", name, pid))

    def holds(self, name, pid):
        return False

    def remove(self, name):
        self.calls.append(("remove", name))
        return self.removable


def make_guard(backend, *, mode="required", leases=None, **kw):
    link = FakeLink(FakeClient(leases))
    guard = DeviceGuard(link, mode, Mechanism("recording", "test", backend), proc_devices="/nonexistent", **kw)
    return guard, link


async def settle(guard):
    for _ in range(10):
        await asyncio.sleep(0)
    while guard._tasks:
        await asyncio.gather(*guard._tasks)
        await asyncio.sleep(0)


def test_a_servers_door_starts_runs_and_stops_its_server_and_the_guard_follows_the_feed():
    async def main():
        backend = RecordingBackend(prefix=("systemd-run", "--scope", "--"))
        guard, link = make_guard(backend)
        devices = ServerDevices(guard, "alice", "", unit="unit-of-alice")
        assert devices.refusal == ""
        start = await devices.starting(held("L1", "GPU-0"))
        assert start.command_prefix == ("systemd-run", "--scope", "--")
        allowed_at_start = backend.rules["alice"][0]
        await devices.running(4242)
        link.send({"kind": "ended", "lease_id": "L1", "to_state": "expired"})
        await settle(guard)
        after_end = backend.rules["alice"]
        devices.stopped()
        await settle(guard)
        return backend.calls, allowed_at_start, after_end, guard

    calls, allowed_at_start, after_end, guard = asyncio.run(main())
    assert calls[0] == ("start", "alice", "unit-of-alice") and ("attach", "alice", 4242) in calls
    assert allowed_at_start == [GPU0, *CTL]
    assert after_end == ([], [GPU0, GPU1, *CTL])  # the feed's end: every GPU denied, the control nodes too
    assert calls[-2:] == [("retire", "alice"), ("remove", "alice")] and not guard.known("alice", "")


def test_a_stopped_server_whose_cgroup_cannot_go_keeps_denying_every_gpu(caplog):
    async def main():
        backend = RecordingBackend(removable=False)  # a process of the server lives on in it
        taken = held("L2", "GPU-1", meta={"spawner": "jupyter-gpulease", "taken_by": "server"})
        guard, link = make_guard(backend, leases={"L2": taken}, remove_delays=(0, 0.01, 0.01), logger=logging.getLogger("guard"))
        devices = ServerDevices(guard, "alice")
        await devices.starting(held("L1", "GPU-0"))
        await devices.running(4242)
        link.send({"kind": "granted", "lease_id": "L2", "data": {"placement": taken["placement"]}})  # her server took one itself
        await settle(guard)
        both = backend.rules["alice"][0]
        devices.stopped()
        await settle(guard)
        # the feed goes on after the stop (her leases end): nothing touches the stopped server's cgroup
        link.send({"kind": "ended", "lease_id": "L2", "to_state": "released"})
        link.send({"kind": "granted", "lease_id": "L2", "data": {"placement": taken["placement"]}})
        await settle(guard)
        return backend, both

    with caplog.at_level(logging.INFO, logger="guard"):
        backend, both = asyncio.run(main())
    assert both == [GPU0, GPU1, *CTL]
    writes = [c for c in backend.calls if c[0] in ("apply", "retire", "remove")]
    first_after_stop = writes.index(("retire", "alice"))
    assert writes[first_after_stop + 1:] == [("remove", "alice")] * 3, "deny first, then the tries to remove it"
    assert backend.rules["alice"] == ([], [GPU0, GPU1, *CTL]), "every pool GPU and the control nodes denied"
    assert "alice still holds processes of the stopped server; it stays, denying the GPUs" in caplog.text


def test_a_server_started_again_before_the_old_cgroup_went_keeps_its_new_rules():
    async def main():
        backend = RecordingBackend(removable=False)
        guard, _ = make_guard(backend, remove_delays=(0.05,))
        devices = ServerDevices(guard, "alice")
        await devices.starting(None)
        devices.stopped()
        await devices.starting(held("L3", "GPU-1"))  # started again at once, with a lease
        await settle(guard)
        return backend

    backend = asyncio.run(main())
    assert backend.rules["alice"][0] == [GPU1, *CTL]
    assert ("remove", "alice") not in backend.calls


def test_an_end_the_feed_told_before_the_server_started_is_counted_at_its_start():
    async def main():
        backend = RecordingBackend()
        guard, link = make_guard(backend)
        link.send({"kind": "ended", "lease_id": "L1", "to_state": "revoked"})  # its server not started yet
        await ServerDevices(guard, "alice").starting(held("L1", "GPU-0"))
        return backend

    assert asyncio.run(main()).rules["alice"] == ([], [GPU0, GPU1, *CTL])


def test_required_enforcement_that_fails_raises_and_best_effort_runs_on_saying_why(caplog):
    async def main(mode):
        guard, _ = make_guard(RecordingBackend(fail_start=True), mode=mode)
        return await ServerDevices(guard, "alice", who="alice:").starting(None)

    with pytest.raises(DeviceAccessError, match=r"Could not make the device cgroup of this server: Permission denied "
                                                r"\(GPU device enforcement is required on this hub\)"):
        asyncio.run(main("required"))
    with caplog.at_level(logging.WARNING):
        assert asyncio.run(main("best-effort")) == DeviceStart()
    assert "it runs without device enforcement (best-effort)" in caplog.text
    impossible = ServerDevices(DeviceGuard(FakeLink(FakeClient()), "required", Mechanism("none", "no cgroup v1 devices controller")), "alice")
    assert "no cgroup v1 devices controller" in impossible.refusal
    with pytest.raises(DeviceAccessError, match="requires GPU device enforcement"):
        asyncio.run(impossible.starting(None))


def test_a_server_that_runs_already_is_adopted_once_with_its_leases():
    async def main():
        backend = RecordingBackend()
        guard, _ = make_guard(backend, leases={"L1": held("L1", "GPU-0")})
        devices = ServerDevices(guard, "alice", unit="u")
        devices.adopt(4242, "L1")
        devices.adopt(4242, "L1")
        await settle(guard)
        devices.adopt(4242, "L1")  # known now: nothing
        await settle(guard)
        return backend

    backend = asyncio.run(main())
    assert [c for c in backend.calls if c[0] == "adopt"] == [("adopt", "alice", "u")]
    assert ("attach", "alice", 4242) in backend.calls and backend.rules["alice"][0] == [GPU0, *CTL]


def test_the_hubs_guard_of_a_link_is_made_once_and_finds_its_mechanism_only_then():
    async def main():
        link = FakeLink(FakeClient())
        found = []

        def find():
            found.append(1)
            return Mechanism("recording", "test", RecordingBackend())
        first = DeviceGuard.for_link(link, mode="best-effort", mechanism=find)
        again = DeviceGuard.for_link(link, mode="best-effort", mechanism=find)
        return first, again, found, link

    first, again, found, link = asyncio.run(main())
    assert first is again and found == [1] and first.active and link.listeners == [first._on_event]


# --------------------------------------------------------------------------- the spawner's shape
def test_the_lease_spawner_is_one_class_in_one_file_over_its_settings_and_jupyterhubs_spawner():
    assert GPULeaseSpawner.__bases__ == (GPULeaseSettings, Spawner)
    ours = [c for c in GPULeaseSpawner.__mro__ if c.__module__.startswith("jupyter_gpulease")]
    assert ours == [GPULeaseSpawner, GPULeaseSettings], "no parts of the spawner in other classes of the package"
    assert inspect.getsourcefile(GPULeaseSpawner) == str(HUB / "spawner.py")
    # the settings: config traits only (with the defaults and checks that declare them)
    (settings,) = [n for n in ast.parse((HUB / "spawner_settings.py").read_text()).body
                   if isinstance(n, ast.ClassDef) and n.name == "GPULeaseSettings"]
    for node in settings.body:
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue  # the docstring
        if isinstance(node, ast.FunctionDef):
            decorators = {ast.unparse(d.func) for d in node.decorator_list if isinstance(d, ast.Call)}
            assert decorators and decorators <= {"default", "validate"}, node.name
            continue
        assert isinstance(node, ast.Assign) and ".tag(config=True)" in ast.unparse(node.value), ast.unparse(node)
    for gone in ("spawner_end", "spawner_devices"):
        assert not (HUB / f"{gone}.py").exists()


def test_only_the_guards_module_touches_its_registry_and_the_guard_has_one_source_of_changes():
    for path in sorted(HUB.glob("*.py")):
        if path.name != "cgroups.py":
            assert "_guards" not in path.read_text(), f"{path.name} reaches into DeviceGuard's registry"
    assert not hasattr(DeviceGuard, "lease_changed")
    tree = ast.parse((HUB / "cgroups.py").read_text())
    names = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    assert "watches" not in names  # it never looks at what the link's spawners follow


# --------------------------------------------------------------------------- a command in front of the server's, for real
def test_a_scope_prefix_goes_in_front_of_the_servers_command_in_localprocessspawner_and_cmd_stays(tmp_path):
    out = tmp_path / "env.txt"
    backend = RecordingBackend(prefix=("env", "GPULEASE_TEST_SCOPED=yes"))
    code = ("import os, sys, time; open(sys.argv[1], 'w').write(os.environ.get('GPULEASE_TEST_SCOPED', 'no')); "
            "time.sleep(60)")
    cmd = [sys.executable, "-c", code, str(out)]

    async def main():
        broker = FakeBroker()
        user = types.SimpleNamespace(name=os.environ.get("USER") or "root", groups=[], url="/user/x/", progress_url=lambda name: "")
        s = GPULeaseSimpleLocalProcessSpawner(user=user, hub=Hub(), broker_url="http://broker/", broker_api_token="t",
                                              cmd=cmd, home_dir_template=str(tmp_path), enforce_devices="required")
        s._link = BrokerLink("http://broker/", "t", client=broker, feed_timeout=1)
        DeviceGuard.for_link(s._link, mode="required", mechanism=Mechanism("recording", "test", backend))
        s.user_options = {"kind": "cpu"}
        await s.start()
        try:
            await until(out.exists, timeout=30, what="the server's command to run")
            pid = s.pid
        finally:
            await s.stop(now=True)
            await s.link.close()
        return s, pid

    s, pid = asyncio.run(main())
    assert out.read_text() == "yes"  # the server ran under the prefix
    assert s.cmd == cmd  # and the configured command is as it was
    assert ("attach", cgroups.cgroup_name(s.user.name), pid) in backend.calls


class _NotesItsStart(Spawner):
    """An engine that, like KubeSpawner, notes its start in start() and follows it in progress()."""

    starts = 0

    def start(self):
        self.starts += 1
        return asyncio.ensure_future(asyncio.sleep(0, result="http://127.0.0.1:9999"))

    async def stop(self, now=False):
        pass

    async def poll(self):
        return None

    async def progress(self):
        yield {"message": f"engine start {self.starts}"}


class _SlowBeforeStart(GPULeaseSpawner, _NotesItsStart):
    async def before_engine_start(self):
        await asyncio.sleep(0.05)  # e.g. a ResourceClaim made before the pod


def test_the_spawn_page_follows_the_engines_progress_of_this_start_not_the_last():
    async def main():
        user = types.SimpleNamespace(name="alice", groups=[], url="/user/alice/", progress_url=lambda name: "")
        s = _SlowBeforeStart(user=user, hub=Hub())
        s.user_options = {"kind": "cpu"}
        events: list = []
        stream = asyncio.ensure_future(_collect(s.progress(), events))
        await asyncio.sleep(0.01)
        await s.start()
        await asyncio.wait_for(stream, 5)
        return events

    assert [e["message"] for e in asyncio.run(main())] == ["No GPU for this server (CPU only)", "engine start 1"]



def test_a_systemd_scope_that_outlives_its_server_opens_no_gpu_and_one_that_went_needs_nothing():
    ran = []
    ok = types.SimpleNamespace(returncode=0, stderr="")
    scopes = cgroups.SystemdScopes("jupyter-gpulease", run=lambda cmd, **kw: ran.append(cmd) or ok)
    scopes.start("alice", [GPU0, *CTL], [GPU1])
    scopes.retire("alice", [GPU0, GPU1, *CTL])
    assert ran == [["systemctl", "set-property", "--runtime", "jupyter-gpulease-alice.scope", "DevicePolicy=closed",
                    "DeviceAllow=", "DeviceAllow=char-pts rw"]]
    gone = cgroups.SystemdScopes(run=lambda cmd, **kw: types.SimpleNamespace(returncode=1, stderr="Unit x.scope not loaded."))
    gone.start("bob", [], [])
    gone.retire("bob", [GPU0])  # the scope went with the server's last process
    refused = cgroups.SystemdScopes(run=lambda cmd, **kw: types.SimpleNamespace(returncode=1, stderr="Access denied"))
    refused.start("bob", [], [])
    with pytest.raises(OSError, match="Access denied"):
        refused.retire("bob", [GPU0])


@pytest.mark.parametrize("engine, words", [
    ("kube", "on_lease_end must be 'stop' on Kubernetes: a pod keeps its GPUs until it stops, so a server that outlived "
             "its lease would hold GPUs the broker gave to someone else"),
    ("slurm", "on_lease_end must be 'stop' on Slurm: a job keeps its GPUs until it ends, so a server that outlived "
              "its lease would hold GPUs the broker gave to someone else"),
])
def test_the_engines_that_keep_gpus_until_their_server_stops_refuse_a_server_outliving_its_lease(engine, words):
    from traitlets import TraitError

    if engine == "kube":
        from jupyter_gpulease.hub.kube import GPULeaseKubeSpawner as cls
    else:
        from jupyter_gpulease.hub.slurm import GPULeaseSlurmSpawner as cls
    spawner = cls.__new__(cls)
    with pytest.raises(TraitError) as e:
        spawner.on_lease_end = "keep"
    assert str(e.value) == words
    spawner.on_lease_end = "stop"
