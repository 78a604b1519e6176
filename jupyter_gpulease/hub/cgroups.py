"""Device access follows the lease, for single-user servers that run as local processes.

Each server of a local-process lease spawner runs in a device cgroup of its own that allows the
device nodes of the leases bound to it (the spawner's own lease and those the server took
itself, ``%gpu request`` or a resume) and denies every other GPU of the pool; a server without
a lease is denied every GPU (and the driver's control nodes). Kernels and terminals the server
starts inherit its cgroup. Every change of those leases (a grant, a resume, an end, a revoke,
a reclaim, a preemption) changes the rules, as the hub's shared event feed reports it.

Two mechanisms, behind one interface (:class:`V1Devices`, :class:`SystemdScopes`):

* **cgroup v1** ``devices`` controller (found in ``/proc/self/mountinfo``): a cgroup
  ``<mount>/<device_cgroup_name>/<user>[:<server>]`` made at spawn, the server's process moved
  into it (``cgroup.procs``) right after the engine started it, ``devices.deny`` for the GPUs it
  may not use and ``devices.allow`` for those it leases; when the server stops, every GPU of the
  pool and the control nodes are denied in it, then it is removed (left in place, denying every
  GPU, while a process of the server lives on).
* **cgroup v2 through systemd** (systemd is PID 1, ``systemd-run`` and ``systemctl`` exist):
  the server's command runs under ``systemd-run --scope -p DevicePolicy=closed -p
  DeviceAllow=...`` and a change is ``systemctl set-property --runtime <scope>
  DeviceAllow= DeviceAllow=...`` (the empty value resets the list). ``closed`` keeps the
  standard pseudo devices (``/dev/null``, ``/dev/tty``, ``/dev/ptmx``, ...); pseudo terminals
  (``char-pts``) are allowed explicitly for terminals.

One door moves the rules: the hub's :class:`DeviceGuard`. It hears of lease changes from one
source, the hub's event feed (grants and ends; after a gap in the feed, a resync of every
server's leases from the broker), and reads a lease itself only when one is granted that it does
not know (a lease a server may have taken itself). A spawner tells it only that its server
starts (with the spawner's own lease, or none), runs (its pid), stops, or runs already after a
hub restart (adopt), through the server's :class:`ServerDevices`.

A device cgroup checks ``open()``: a process that already holds a GPU keeps its file
descriptors after a deny. Every write happens off the hub's event loop.
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import os
import re
import shutil
import subprocess
import tempfile
import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from ..core.request import SPAWNER_META
from ..tasks import BackgroundTasks
from . import devaccess
from .devaccess import DeviceNode

log = logging.getLogger("jupyter_gpulease.hub.cgroups")

MODES = ("required", "best-effort", "off")
MOUNTINFO = "/proc/self/mountinfo"
SYSTEMD_RUN_DIR = "/run/systemd/system"


# --------------------------------------------------------------------------- finding a mechanism
def _mounts(mountinfo: str) -> list[tuple[str, str, set[str]]]:
    """``(mount point, fs type, super options)`` of each line of a mountinfo file."""
    out = []
    try:
        with open(mountinfo, encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return out
    for line in lines:
        left, sep, right = line.partition(" - ")
        if not sep:
            continue
        fields, tail = left.split(), right.split()
        if len(fields) < 5 or len(tail) < 3:
            continue
        point = fields[4].replace("\\040", " ")
        out.append((point, tail[0], set(tail[2].split(","))))
    return out


def v1_devices_mount(mountinfo: str = MOUNTINFO) -> str | None:
    """Where the cgroup v1 ``devices`` controller is mounted; None without it."""
    for point, fstype, opts in _mounts(mountinfo):
        if fstype == "cgroup" and "devices" in opts:
            return point
    return None


def cgroup2_mount(mountinfo: str = MOUNTINFO) -> str | None:
    for point, fstype, _ in _mounts(mountinfo):
        if fstype == "cgroup2":
            return point
    return None


def cgroup_name(user: str, server: str = "") -> str:
    """The per-server cgroup's name: ``alice`` (default server) or ``alice:gpu2``."""
    name = f"{user}:{server}" if server else user
    return re.sub(r"[/\s]", "_", name) or "_"


def systemd_escape(name: str) -> str:
    """Like ``systemd-escape``: a string that can stand in a unit name."""
    out = []
    for i, ch in enumerate(name):
        if ch.isascii() and (ch.isalnum() or ch in ":_" or (ch == "." and i > 0)):
            out.append(ch)
        elif ch == "/":
            out.append("-")
        else:
            out.extend(f"\\x{b:02x}" for b in ch.encode())
    return "".join(out)


class Mechanism:
    """What enforces device access on this host: ``kind`` "v1", "systemd" or "none", and why."""

    def __init__(self, kind: str, why: str, backend: Any = None):
        self.kind = kind
        self.why = why
        self.backend = backend

    def __repr__(self) -> str:
        return f"Mechanism({self.kind!r}, {self.why!r})"


# --------------------------------------------------------------------------- one hub per parent
LOCK_DIR = "/run/lock" if os.path.isdir("/run/lock") else tempfile.gettempdir()
_held: dict[str, int] = {}  # parent -> the open lock file this hub process holds
_refused: dict[str, str] = {}  # parent -> why this hub process may not use it


def claim_parent(parent: str, lock_dir: str = LOCK_DIR) -> str:
    """Take the host's lock of the device cgroup parent ``parent`` for this hub process (held
    until it exits): two hubs with one parent would sweep each other's cgroups and put their
    same-named users in one. Returns "" when held (now or before), else why not; a refusal is
    kept, and :func:`detect` then offers no mechanism under that parent."""
    if parent in _held:
        return ""
    if parent in _refused:
        return _refused[parent]
    path = os.path.join(lock_dir, "jupyter-gpulease-" + re.sub(r"[^A-Za-z0-9_.-]", "_", parent) + ".lock")
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        return f"cannot open the lock of device cgroup parent {parent!r} ({path}): {e.strerror}"
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
        os.close(fd)
        why = (f"another hub on this host (pid {holder}) uses the device cgroup parent {parent!r}; give each hub its own "
               "c.GPULeaseSpawner.device_cgroup_parent")
        _refused[parent] = why
        return why
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    _held[parent] = fd
    return ""


def release_parent(parent: str, mountinfo: str = MOUNTINFO) -> None:
    """At the hub's stop: remove the empty cgroups under ``parent`` and the parent itself when
    empty (a server that runs on keeps its cgroup, and so the parent), then let go of the lock."""
    mount = v1_devices_mount(mountinfo)
    if mount is not None and parent in _held:
        backend = V1Devices(mount, parent)
        backend.sweep()
        try:
            os.rmdir(backend.root)
        except OSError:
            pass  # a server still runs in it, or it was never made
    fd = _held.pop(parent, None)
    if fd is not None:
        os.close(fd)


def detect(parent: str = "jupyter-gpulease", *, mountinfo: str = MOUNTINFO, systemd_dir: str = SYSTEMD_RUN_DIR,
           which: Callable[[str], str | None] = shutil.which, euid: int | None = None, probe: bool = True) -> Mechanism:
    """The mechanism this host offers: v1's devices controller where it is mounted and writable
    (``probe``: make the parent cgroup to be sure), else systemd scopes where systemd runs on a
    cgroup v2 host, else none (with the reason; also when another hub holds ``parent``, see
    :func:`claim_parent`)."""
    if parent in _refused:
        return Mechanism("none", _refused[parent])
    euid = os.geteuid() if euid is None else euid
    why_not = []
    mount = v1_devices_mount(mountinfo)
    if mount is None:
        why_not.append("no cgroup v1 devices controller is mounted")
    elif euid != 0:
        why_not.append(f"the cgroup v1 devices controller at {mount} needs root (the hub runs as uid {euid})")
    else:
        root = os.path.join(mount, parent)
        try:
            if probe:
                os.makedirs(root, exist_ok=True)
            return Mechanism("v1", f"cgroup v1 devices controller, one cgroup per server under {root}", V1Devices(mount, parent))
        except OSError as e:
            why_not.append(f"cannot make {root}: {e.strerror}")
    v2 = cgroup2_mount(mountinfo)
    if v2 is None:
        why_not.append("no cgroup v2 hierarchy is mounted")
    elif not os.path.isdir(systemd_dir):
        why_not.append("systemd is not the init system (no systemd scopes)")
    elif not (which("systemd-run") and which("systemctl")):
        why_not.append("systemd-run/systemctl are not installed")
    elif euid != 0:
        why_not.append(f"systemd scopes with device rules need root (the hub runs as uid {euid})")
    else:
        return Mechanism("systemd", f"systemd scopes (cgroup v2 at {v2}) with DevicePolicy=closed and DeviceAllow=",
                         SystemdScopes(parent))
    return Mechanism("none", "; ".join(why_not))


# --------------------------------------------------------------------------- the two backends
@dataclass(frozen=True)
class DeviceStart:
    """What the engine's start needs for the device lock of the server it starts."""

    command_prefix: tuple[str, ...] = ()  # the server's command runs under this (a systemd scope)
    device_allow: tuple[str, ...] | None = None  # the DeviceAllow= values its systemd unit starts with (None: no unit)
    devices: tuple[str, ...] = ()  # a container's device nodes, Docker's "host:container:permissions"


def write_v1_rules(path: str, allowed: list[DeviceNode], denied: list[DeviceNode]) -> None:
    """Write the rules into the v1 device cgroup at ``path``: one rule per write (the kernel reads
    one per call), denies first (never both at once)."""
    allow, deny = devaccess.v1_rules(allowed, denied)
    for file, rules in (("devices.deny", deny), ("devices.allow", allow)):
        for rule in rules:
            with open(os.path.join(path, file), "w") as f:
                f.write(rule)


class V1Devices:
    """cgroup v1 ``devices`` controller: one cgroup per server under ``<mount>/<parent>``."""

    kind = "v1"

    def __init__(self, mount: str, parent: str = "jupyter-gpulease"):
        self.root = os.path.join(mount, parent)

    def path(self, name: str) -> str:
        return os.path.join(self.root, name)

    def start(self, name: str, allowed: list[DeviceNode], denied: list[DeviceNode], unit: Any = None) -> DeviceStart:
        """The server's cgroup, made with its rules before the engine starts the server (its
        process is moved in right after: nothing goes in front of its command)."""
        self.prepare(name, allowed, denied)
        return DeviceStart()

    def prepare(self, name: str, allowed: list[DeviceNode], denied: list[DeviceNode]) -> None:
        os.makedirs(self.path(name), exist_ok=True)
        self.apply(name, allowed, denied)

    def apply(self, name: str, allowed: list[DeviceNode], denied: list[DeviceNode]) -> None:
        write_v1_rules(self.path(name), allowed, denied)

    def adopt(self, name: str, allowed: list[DeviceNode], denied: list[DeviceNode], unit: Any = None) -> None:
        """A running server's cgroup, again (the hub restarted): made if gone, the rules now."""
        self.prepare(name, allowed, denied)

    def retire(self, name: str, denied: list[DeviceNode]) -> None:
        """The server stopped: ``denied`` (every GPU and the control nodes) in its cgroup, for
        whatever of it lives on until the cgroup can be removed."""
        if os.path.isdir(self.path(name)):
            self.apply(name, [], denied)

    def attach(self, name: str, pid: int) -> None:
        with open(os.path.join(self.path(name), "cgroup.procs"), "w") as f:
            f.write(str(int(pid)))

    def pids(self, name: str) -> list[int]:
        try:
            with open(os.path.join(self.path(name), "cgroup.procs")) as f:
                return [int(x) for x in f.read().split()]
        except OSError:
            return []

    def holds(self, name: str, pid: int) -> bool:
        return int(pid) in self.pids(name)

    def sweep(self) -> list[str]:
        """Remove the servers' cgroups that hold no process (left by a hub that exited before
        it could); those with processes stay. Returns the names removed."""
        try:
            names = [e.name for e in os.scandir(self.root) if e.is_dir(follow_symlinks=False)]
        except OSError:
            return []
        return [n for n in names if self.remove(n)]

    def remove(self, name: str) -> bool:
        """rmdir the server's cgroup; False while a process of it lives on (it stays, denying)."""
        try:
            os.rmdir(self.path(name))
        except FileNotFoundError:
            return True
        except OSError:
            return False
        return True


class SystemdScopes:
    """cgroup v2 through systemd: a transient scope per server, its ``DeviceAllow=`` the lease.

    ``run`` runs a command (``subprocess.run``'s signature); tests pass one that records it.
    """

    kind = "systemd"
    EXTRA_ALLOW = ("char-pts rw",)  # terminals; DevicePolicy=closed keeps /dev/null, /dev/ptmx, ...

    def __init__(self, parent: str = "jupyter-gpulease", run: Callable[..., Any] = subprocess.run):
        self.parent = parent
        self.run = run
        self._started: set[str] = set()

    def unit(self, name: str) -> str:
        return f"{self.parent}-{systemd_escape(name)}.scope"

    def properties(self, allowed: Iterable[DeviceNode]) -> list[str]:
        """The scope's device properties: ``DevicePolicy=closed`` and one ``DeviceAllow=`` each."""
        return ["DevicePolicy=closed", *(f"DeviceAllow={v}" for v in (*self.EXTRA_ALLOW, *devaccess.systemd_device_allow(allowed)))]

    def scope_command(self, name: str, allowed: Iterable[DeviceNode]) -> list[str]:
        """What the server's command runs under: ``systemd-run --scope`` (it execs the command, so
        the engine's pid is the server's)."""
        cmd = ["systemd-run", "--scope", "--quiet", "--collect", f"--unit={self.unit(name)}"]
        for p in self.properties(allowed):
            cmd += ["-p", p]
        return [*cmd, "--"]

    def set_property_command(self, name: str, allowed: Iterable[DeviceNode]) -> list[str]:
        """A change at run time; ``DeviceAllow=`` alone first resets the list."""
        props = self.properties(allowed)
        return ["systemctl", "set-property", "--runtime", self.unit(name), props[0], "DeviceAllow=", *props[1:]]

    def command_prefix(self, name: str, allowed: list[DeviceNode]) -> list[str]:
        self._started.add(name)
        return self.scope_command(name, allowed)

    def start(self, name: str, allowed: list[DeviceNode], denied: list[DeviceNode], unit: Any = None) -> DeviceStart:
        """The server's command runs under ``systemd-run --scope`` with its rules (systemd makes
        the scope with the server's process)."""
        return DeviceStart(command_prefix=tuple(self.command_prefix(name, allowed)))

    def apply(self, name: str, allowed: list[DeviceNode], denied: list[DeviceNode]) -> None:
        if name not in self._started:
            return
        r = self.run(self.set_property_command(name, allowed), capture_output=True, text=True, timeout=30)
        if getattr(r, "returncode", 0) != 0:
            raise OSError(f"systemctl set-property failed: {(getattr(r, 'stderr', '') or '').strip()}")

    def adopt(self, name: str, allowed: list[DeviceNode], denied: list[DeviceNode], unit: Any = None) -> None:
        """A running server's scope, again (the hub restarted): its properties now."""
        self._started.add(name)
        self.apply(name, allowed, denied)

    def retire(self, name: str, denied: list[DeviceNode]) -> None:
        """The server stopped: a scope that lives on (a process of the server still in it) opens
        no GPU; one that went with the server's last process (``--collect``) needs nothing."""
        try:
            self.apply(name, [], denied)
        except OSError as e:
            if "not loaded" not in str(e):
                raise

    def attach(self, name: str, pid: int) -> None:
        pass  # systemd-run put the process in the scope before it exec'd the server

    def holds(self, name: str, pid: int) -> bool:
        return True

    def remove(self, name: str) -> bool:
        self._started.discard(name)  # --collect: systemd drops the scope once its processes are gone
        return True


# --------------------------------------------------------------------------- the hub's guard
REMOVE_DELAYS = (0, 0.2, 0.5, 1, 2, 5, 10, 10)  # seconds between tries to remove a stopped server's cgroup
LIVE = ("queued", "active")


def bound_to(lease: dict, user: str, server: str) -> bool:
    """A lease a server took itself (``%gpu request``, a resume): it follows that server."""
    meta = lease.get("meta") or {}
    return (lease.get("user") == user and (lease.get("server") or "") == (server or "")
            and meta.get("spawner") == SPAWNER_META and meta.get("taken_by") == "server")


class _Recent:
    """The last ``size`` ids added (the oldest forgotten first), for membership tests."""

    def __init__(self, size: int = 10000):
        self.size = size
        self._ids: dict[str, None] = {}

    def add(self, key: str) -> None:
        self._ids.pop(key, None)
        self._ids[key] = None
        if len(self._ids) > self.size:
            del self._ids[next(iter(self._ids))]

    def __contains__(self, key: object) -> bool:
        return key in self._ids


class _Server:
    def __init__(self, user: str, server: str, lock: asyncio.Lock):
        self.user = user
        self.server = server
        self.name = cgroup_name(user, server)
        self.leases: dict[str, dict] = {}  # lease id -> its JSON as last heard
        self.own = ""  # the spawner's lease
        self.lock = lock  # shared by every server of this name: a stop's clean-up and the next start take turns
        self.applied: tuple[tuple[str, ...], tuple[str, ...]] | None = None
        self.applied_at = 0.0  # time.monotonic() of the last rules written
        self.attached = False


class DeviceGuard:
    """One per hub process and broker link: the device cgroups of the servers of this hub.

    The only thing that moves device rules. It learns of lease changes from the hub's event feed
    alone (``link.add_event_listener``): a grant or an end of a lease of one of its servers
    changes that server's rules; ``{"kind": "resync"}`` (the feed is back after a gap) makes it
    read what holds now; a lease granted that it does not know is read once (a server may have
    taken it itself, ``meta.taken_by == "server"``). Spawners reach it through
    :class:`ServerDevices`; :meth:`for_link` gives the hub's guard of a link.
    """

    _guards: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # link -> guard

    def __init__(self, link: Any, mode: str, mechanism: Mechanism, *, logger: logging.Logger | None = None,
                 proc_devices: str = devaccess.PROC_DEVICES, stat: Callable[[str], Any] = os.stat,
                 remove_delays: Sequence[float] = REMOVE_DELAYS):
        self.link = link
        self.mode = mode
        self.mechanism = mechanism
        self.backend = mechanism.backend if mode != "off" else None
        self.log = logger or log
        self.proc_devices = proc_devices
        self.stat = stat
        self.remove_delays = tuple(remove_delays)
        self.servers: dict[tuple[str, str], _Server] = {}
        self.by_lease: dict[str, _Server] = {}
        self.pool_nodes: dict[str, DeviceNode] = {}
        self.uvm: int | None = None
        self._pool_read = False
        self._locks: dict[str, asyncio.Lock] = {}  # cgroup name -> its lock
        self._foreign = _Recent()  # leases read once and found to be no server's of ours
        self._ended = _Recent()  # leases the feed said ended
        self._learning: set[str] = set()
        self._tasks = BackgroundTasks(log)
        if self.backend is not None:
            link.add_event_listener(self._on_event)

    @classmethod
    def for_link(cls, link: Any, *, mode: str, mechanism: Mechanism | Callable[[], Mechanism],
                 logger: logging.Logger | None = None, **kw: Any) -> DeviceGuard:
        """The hub's guard of ``link``, made on first use with ``mode`` (``enforce_devices``) and
        ``mechanism`` (or a function that finds it, called only then); ``kw`` as for the class."""
        guard = cls._guards.get(link)
        if guard is None:
            if mode == "off":
                mech = Mechanism("none", "off (c.GPULeaseSpawner.enforce_devices = 'off')")
            else:
                mech = mechanism() if callable(mechanism) else mechanism
            guard = cls._guards[link] = cls(link, mode, mech, logger=logger, **kw)
        return guard

    @property
    def active(self) -> bool:
        return self.backend is not None

    def background(self, coro) -> asyncio.Task:
        """Run ``coro`` on the hub's loop, referenced until done (its failure is logged)."""
        return self._tasks.start(coro, what="GPU device access")

    async def _off_loop(self, fn: Callable, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(None, fn, *args)

    def required_failure(self) -> str:
        """The message a spawn fails with where enforcement is required and impossible; "" otherwise."""
        if self.mode == "required" and self.backend is None:
            return ("This hub requires GPU device enforcement (c.GPULeaseSpawner.enforce_devices = 'required'), "
                    f"but this host offers no way to enforce it: {self.mechanism.why}. Ask the administrator.")
        return ""

    # ------------------------------------------------------------------ the pool
    async def _read_pool(self, force: bool = False) -> None:
        if self._pool_read and not force:
            return
        pool = await self.link.client.pool()
        self.pool_nodes, self.uvm = await self._off_loop(self._resolve_pool, pool)
        self._pool_read = True

    def _resolve_pool(self, pool: dict) -> tuple[dict[str, DeviceNode], int | None]:
        return devaccess.pool_gpu_nodes(pool, stat=self.stat), devaccess.uvm_major(self.proc_devices)

    def rules(self, srv: _Server) -> tuple[list[DeviceNode], list[DeviceNode]]:
        allowed = devaccess.leases_nodes(srv.leases.values(), self.pool_nodes, uvm=self.uvm)
        return allowed, devaccess.denied_nodes(allowed, self.pool_nodes, uvm=self.uvm)

    def _unknown_gpus(self, srv: _Server) -> bool:
        for lease in srv.leases.values():
            if devaccess.lease_holds(lease):
                for s in lease["placement"]["slices"]:
                    if s.get("gpu_uuid") and s["gpu_uuid"] not in self.pool_nodes:
                        return True
        return False

    # ------------------------------------------------------------------ a server's life
    def _new_server(self, user: str, server: str) -> _Server:
        lock = self._locks.setdefault(cgroup_name(user, server), asyncio.Lock())
        srv = self.servers[(user, server)] = _Server(user, server, lock)
        return srv

    def _track(self, srv: _Server, lease: dict | None) -> None:
        if lease and lease.get("id"):
            lid = lease["id"]
            if lid in self._ended and lease.get("state") in LIVE:
                lease = {**lease, "state": "ended"}  # the feed told its end before this server's start did
            srv.leases[lid] = lease
            self.by_lease[lid] = srv

    def _note_applied(self, srv: _Server, allowed: list[DeviceNode], denied: list[DeviceNode]) -> None:
        srv.applied = (tuple(map(str, allowed)), tuple(map(str, denied)))
        srv.applied_at = time.monotonic()

    async def server_starting(self, user: str, server: str, lease: dict | None, *, unit: Any = None) -> DeviceStart:
        """Make the server's cgroup with the rules of ``lease`` (None: no GPU); returns what the
        engine's start needs (a command prefix for a systemd scope, a unit's device list).
        ``unit``: where the server runs, for a backend that does not name it itself."""
        if self.backend is None:
            return DeviceStart()
        srv = self.servers.get((user, server)) or self._new_server(user, server)
        for lid in list(srv.leases):
            self.by_lease.pop(lid, None)
        srv.leases.clear()
        srv.attached = False
        srv.own = (lease or {}).get("id", "")
        self._track(srv, lease)
        async with srv.lock:
            await self._read_pool(force=self._unknown_gpus(srv))
            allowed, denied = self.rules(srv)
            start = await self._off_loop(self.backend.start, srv.name, allowed, denied, unit)
            self._note_applied(srv, allowed, denied)
            return start

    async def server_started(self, user: str, server: str, pid: int) -> None:
        """Move the server's process into its cgroup (right after the engine started it)."""
        srv = self.servers.get((user, server))
        if self.backend is None or srv is None or not pid:
            return
        await self._off_loop(self.backend.attach, srv.name, pid)
        srv.attached = True
        await self._apply(srv)  # a change heard while it started (a scope takes changes once it runs)

    async def adopt(self, user: str, server: str, pid: int, own_lease_id: str, *, unit: Any = None) -> None:
        """A server this hub process did not start (the hub restarted): its cgroup again, its
        bound leases read from the broker, its process (still) in the cgroup."""
        if self.backend is None or (user, server) in self.servers:
            return
        srv = self._new_server(user, server)
        try:
            leases = await self.link.client.list_leases(state="live", user=user)
        except Exception as e:
            self.servers.pop((user, server), None)
            self.log.debug("Device access of %s/%s: could not list leases yet: %s", user, server, e)
            return
        srv.own = own_lease_id
        for lease in leases:
            if lease.get("id") == own_lease_id or bound_to(lease, user, server):
                self._track(srv, lease)
        async with srv.lock:
            await self._read_pool()
            allowed, denied = self.rules(srv)
            await self._off_loop(self.backend.adopt, srv.name, allowed, denied, unit)
            self._note_applied(srv, allowed, denied)
        if pid and not await self._off_loop(self.backend.holds, srv.name, pid):
            await self.server_started(user, server, pid)

    def known(self, user: str, server: str) -> bool:
        return (user, server) in self.servers

    def server_stopped(self, user: str, server: str) -> asyncio.Task | None:
        """The server stopped: its cgroup denies every GPU at once, and goes once nothing of the
        server is left in it (returns the task that does it)."""
        srv = self.servers.pop((user, server), None)
        if srv is None or self.backend is None:
            return None
        for lid in list(srv.leases):
            if self.by_lease.get(lid) is srv:
                del self.by_lease[lid]
        return self.background(self._retire(srv))

    def _started_again(self, srv: _Server) -> bool:
        return (srv.user, srv.server) in self.servers

    async def _retire(self, srv: _Server) -> None:
        async with srv.lock:
            if self._started_again(srv):
                return  # the new server has its rules already
            try:
                await self._read_pool()
            except Exception as e:
                self.log.debug("Device access: could not read the pool for the stopped server %s: %s", srv.name, e)
            denied = devaccess.denied_nodes([], self.pool_nodes, uvm=self.uvm)
            try:
                await self._off_loop(self.backend.retire, srv.name, denied)
            except Exception as e:
                self.log.error("Could not deny the GPUs in the device cgroup of the stopped server %s: %s", srv.name, e)
        for delay in self.remove_delays:  # its kernels may outlive the server a moment
            await asyncio.sleep(delay)
            async with srv.lock:
                if self._started_again(srv):
                    return  # started again meanwhile: the new server uses it
                if await self._off_loop(self.backend.remove, srv.name):
                    return
        self.log.info("Device cgroup of %s still holds processes of the stopped server; it stays, denying the GPUs", srv.name)

    async def _apply(self, srv: _Server) -> None:
        async with srv.lock:
            if self.servers.get((srv.user, srv.server)) is not srv:
                return
            try:
                if self._unknown_gpus(srv):
                    await self._read_pool(force=True)
                allowed, denied = self.rules(srv)
                key = (tuple(map(str, allowed)), tuple(map(str, denied)))
                if key == srv.applied:
                    return
                await self._off_loop(self.backend.apply, srv.name, allowed, denied)
                self._note_applied(srv, allowed, denied)
                gpus = set(self.pool_nodes.values())
                self.log.info("Device access of server %s now: %s", srv.name,
                              ", ".join(n.path for n in allowed if n in gpus) or "no GPU")
            except Exception as e:
                self.log.error("Could not change the device access of %s: %s", srv.name, e)

    # ------------------------------------------------------------------ the feed: the one source of changes
    def _on_event(self, ev: dict) -> None:
        kind, lid = ev.get("kind"), ev.get("lease_id")
        if kind == "resync" and self.servers:
            self.background(self._resync())
            return
        if kind not in ("granted", "ended") or not lid:
            return
        srv = self.by_lease.get(lid)
        if kind == "ended":
            self._ended.add(lid)
        if srv is not None:
            old = srv.leases.get(lid) or {"id": lid}
            if kind == "granted":
                data = ev.get("data") or {}
                new = {**old, "state": "active", "placement": data.get("placement") or old.get("placement")}
            else:
                new = {**old, "state": ev.get("to_state") or "ended"}
            srv.leases[lid] = new
            self.background(self._apply(srv))
        elif kind == "granted" and self.servers and lid not in self._foreign and lid not in self._learning:
            # a lease none of our servers is known to hold: one a server took itself, or a lease
            # of a server about to start (counted at server_starting), or someone else's
            self._learning.add(lid)
            self.background(self._learn(lid))

    async def _resync(self) -> None:
        """The feed was away: what holds now, for every server of ours, from the broker's list."""
        try:
            live = await self.link.client.list_leases(state="live")
        except Exception as e:
            self.log.debug("Device access: could not list the live leases after the feed came back: %s", e)
            return
        live_by_id = {x.get("id"): x for x in live}
        for (user, server), srv in list(self.servers.items()):
            for lid, old in list(srv.leases.items()):
                if lid not in live_by_id and old.get("state") in LIVE:
                    srv.leases[lid] = {**old, "state": "ended"}
            for lease in live:
                if lease.get("id") == srv.own or bound_to(lease, user, server):
                    self._track(srv, lease)
            self.background(self._apply(srv))

    async def _learn(self, lid: str) -> None:
        """A lease granted that no server of ours is known to hold: read whose it is."""
        try:
            lease = await self.link.client.get_lease(lid)
        except Exception as e:
            self.log.debug("Device access: could not read lease %s: %s", lid, e)
            return
        finally:
            self._learning.discard(lid)
        if lid in self.by_lease:
            return  # its server started meanwhile and counts it
        srv = next((s for (u, sv), s in self.servers.items() if bound_to(lease, u, sv)), None)
        if srv is None:
            self._foreign.add(lid)
            return
        self._track(srv, lease)
        await self._apply(srv)


# --------------------------------------------------------------------------- a server's door to the guard
class DeviceAccessError(Exception):
    """Device access this hub requires could not be set up for a server (the message is for the
    spawn page and the REST API)."""


class ServerDevices:
    """One server's door to the hub's :class:`DeviceGuard`, held by its spawner.

    The spawner says only that the server starts (:meth:`starting`, with the spawner's own lease
    or none; returns what the engine's start needs), runs (:meth:`running`, its pid), stopped
    (:meth:`stopped`), or runs already after a hub restart (:meth:`adopt`); which leases it holds
    later, and every change of its rules, is the guard's. ``unit``: where the server runs, for a
    backend that does not name it itself (SystemdSpawner's unit). Where ``enforce_devices`` is
    ``"required"`` a failure raises :class:`DeviceAccessError`; where ``"best-effort"`` it is
    logged and the server runs without enforcement.
    """

    def __init__(self, guard: DeviceGuard, user: str, server: str = "", *, unit: Any = None, who: str = "",
                 logger: logging.Logger | None = None):
        self.guard = guard
        self.user = user
        self.server = server
        self.unit = unit
        self.who = who or cgroup_name(user, server)
        self.log = logger or log

    @property
    def refusal(self) -> str:
        """Why no server may start here ("" when it may): enforcement required, and impossible."""
        return self.guard.required_failure()

    def _problem(self, e: BaseException, doing: str) -> None:
        message = f"Could not {doing} the device cgroup of this server: {e}"
        if self.guard.mode == "required":
            raise DeviceAccessError(message + " (GPU device enforcement is required on this hub)") from None
        self.log.warning("%s (%s); it runs without device enforcement (best-effort)", message, self.who)

    async def starting(self, lease: dict | None) -> DeviceStart:
        """The server is about to start, holding ``lease`` (None: no GPU): its cgroup with those
        rules; returns what the engine's start needs."""
        if self.refusal:
            raise DeviceAccessError(self.refusal)
        if not self.guard.active:
            return DeviceStart()
        try:
            return await self.guard.server_starting(self.user, self.server, lease, unit=self.unit)
        except Exception as e:
            self._problem(e, "make")
        return DeviceStart()

    async def running(self, pid: int) -> None:
        """The engine started the server as process ``pid`` (0: the engine placed it itself)."""
        if not self.guard.active:
            return
        try:
            await self.guard.server_started(self.user, self.server, pid)
        except Exception as e:
            self._problem(e, "move the server into")

    def stopped(self) -> None:
        """The server stopped: every GPU denied in its cgroup, which goes once it is empty."""
        if self.guard.active:
            self.guard.server_stopped(self.user, self.server)

    def adopt(self, pid: int, lease_id: str) -> None:
        """The server runs already and this hub process did not start it (the hub restarted):
        its cgroup and rules again, in the background (nothing when the guard knows it)."""
        if self.guard.active and not self.guard.known(self.user, self.server):
            self.guard.background(self.guard.adopt(self.user, self.server, pid, lease_id, unit=self.unit))


def hub_start_line(mode: str, mechanism: Mechanism) -> str:
    """The one line the hub logs at start about device enforcement."""
    if mode == "off":
        return "GPU device access: not enforced (enforce_devices = 'off'); servers can open every GPU of the host"
    if mechanism.kind != "none":
        return f"GPU device access follows the lease ({mode}): {mechanism.why}"
    if mode == "required":
        return f"GPU device access: required but not possible on this host ({mechanism.why}); GPU servers will not start"
    return f"GPU device access: not enforced on this host ({mechanism.why}); servers can open every GPU (best-effort)"


def _config_value(cls: type, config: Any, name: str) -> Any:
    """A trait's configured value for ``cls`` (its bases' sections first), without an instance."""
    value = cls.class_traits()[name].default()  # a container trait's default is made here
    for klass in reversed(cls.__mro__):
        section = config.get(klass.__name__)
        if section is not None and name in section:
            value = section[name]
    return value


def at_hub_stop(hub: Any) -> None:
    """The hub stops: see :func:`release_parent` (its servers were stopped first, or run on)."""
    cls = getattr(hub, "spawner_class", None)
    if getattr(cls, "enforces_devices", False):
        release_parent(_config_value(cls, hub.config, "device_cgroup_parent"))


def log_at_hub_start(hub: Any) -> Mechanism | None:
    """Log the one line about device enforcement when the hub starts (its spawner is a lease
    spawner for local processes); returns the mechanism found (None: not such a spawner)."""
    cls = getattr(hub, "spawner_class", None)
    if not getattr(cls, "enforces_devices", False):
        return None
    mode = _config_value(cls, hub.config, "enforce_devices")
    parent = _config_value(cls, hub.config, "device_cgroup_parent")
    taken = "" if mode == "off" else claim_parent(parent)
    mech = Mechanism("none", "off") if mode == "off" else Mechanism("none", taken) if taken else detect(parent)
    if isinstance(mech.backend, V1Devices):
        mech.backend.sweep()  # a server still running keeps its cgroup (not empty); adopt() takes it up
    line = hub_start_line(mode, mech)
    (hub.log.warning if mech.kind == "none" and mode != "off" else hub.log.info)(line)
    return mech
