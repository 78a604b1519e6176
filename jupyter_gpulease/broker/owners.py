"""Who a process works for, read from ``/proc`` (injectable: tests pass a fake folder).

For one PID: its real uid and Unix user name (``pwd``), its command, its start time (a PID that
is reused is another process), its cgroup, and the single-user server it belongs to: the
``JUPYTERHUB_USER`` and ``JUPYTERHUB_SERVER_NAME`` of the *outermost* of its ancestors that has
them (the server process the spawner started, whose environment the user cannot change after
the start; a process's own environment is only used when no ancestor has them, e.g. a process
that left its server's tree). Anyone can set an environment, so the claim is believed only when
the process runs under the uid of the claimed user's Unix account, or no account has that name
(servers of containers, whose users are not the host's); otherwise the owner is the process's
own Unix user and the claim is kept to be named (``Owner.claimed``). Reading another user's
``environ`` needs root (or the same uid).
"""

from __future__ import annotations

import os
import pwd
from dataclasses import dataclass

from ..core.unleased import Owner

MAX_DEPTH = 64  # ancestors walked at most


@dataclass(frozen=True)
class ProcessInfo:
    pid: int
    owner: Owner
    command: str = ""
    start: str = ""


class ProcReader:
    """Reads process facts under ``root`` (``/proc``). Every method returns None/"" for a
    process that is gone or unreadable; nothing raises for a vanished process."""

    def __init__(self, root: str = "/proc", *, account_uid=None):
        self.root = root
        self.account_uid = account_uid or _account_uid  # a Unix user name -> its uid (None: no such account)

    def _read(self, pid: int, name: str) -> bytes | None:
        try:
            with open(os.path.join(self.root, str(pid), name), "rb") as f:
                return f.read()
        except OSError:
            return None

    def status(self, pid: int) -> dict[str, str]:
        raw = self._read(pid, "status")
        out: dict[str, str] = {}
        for line in (raw or b"").decode(errors="replace").splitlines():
            k, _, v = line.partition(":")
            out[k.strip()] = v.strip()
        return out

    def start(self, pid: int) -> str:
        """Field 22 of ``stat`` (start time in clock ticks since boot): with the PID, a process's identity."""
        raw = self._read(pid, "stat")
        if not raw:
            return ""
        rest = raw.decode(errors="replace").rpartition(")")[2].split()
        return rest[19] if len(rest) > 19 else ""

    def environ(self, pid: int) -> dict[str, str]:
        raw = self._read(pid, "environ")
        out = {}
        for item in (raw or b"").split(b"\0"):
            k, sep, v = item.partition(b"=")
            if sep:
                out[k.decode(errors="replace")] = v.decode(errors="replace")
        return out

    def cgroup(self, pid: int) -> str:
        """The process's cgroup: the v1 ``devices`` one (where the hub puts each server on a v1 or
        hybrid host), else the v2 path (``0::/…``), else the first."""
        raw = self._read(pid, "cgroup")
        lines = [ln for ln in (raw or b"").decode(errors="replace").splitlines() if ln.count(":") >= 2]
        for ln in lines:
            if "devices" in ln.split(":", 2)[1].split(","):
                return ln.split(":", 2)[2]
        for ln in lines:
            if ln.startswith("0::"):
                return ln.split(":", 2)[2]
        return lines[0].split(":", 2)[2] if lines else ""

    def info(self, pid: int) -> ProcessInfo | None:
        """Everything :class:`Owner` needs about ``pid``; None when the process is not visible
        (gone, or in another PID namespace than the broker's)."""
        st = self.status(pid)
        if not st:
            return None
        uid = _first_int(st.get("Uid", ""))
        name = user_name(uid)
        hub_user, server = "", ""
        cur, depth = pid, 0
        while cur > 1 and depth < MAX_DEPTH:
            env = self.environ(cur) if cur != pid else self.environ(pid)
            if env.get("JUPYTERHUB_USER"):
                hub_user, server = env["JUPYTERHUB_USER"], env.get("JUPYTERHUB_SERVER_NAME", "")
            parent = _first_int((self.status(cur) if cur != pid else st).get("PPid", ""))
            if parent is None or parent == cur:
                break
            cur, depth = parent, depth + 1
        claimed = ""
        if hub_user:
            account = self.account_uid(hub_user)
            if account is not None and account != uid:  # set by hand: not that user's process
                claimed, hub_user, server = hub_user, "", ""
        owner = Owner(uid=uid, name=name, hub_user=hub_user, server=server, cgroup=self.cgroup(pid), claimed=claimed)
        return ProcessInfo(pid, owner, command=st.get("Name", ""), start=self.start(pid))


def user_name(uid: int | None) -> str:
    if uid is None:
        return ""
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


def _account_uid(name: str) -> int | None:
    try:
        return pwd.getpwnam(name).pw_uid
    except KeyError:
        return None


def _first_int(s: str) -> int | None:
    parts = s.split()
    try:
        return int(parts[0]) if parts else None
    except ValueError:
        return None
