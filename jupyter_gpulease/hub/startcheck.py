"""A check at hub start: can other users run the single-user server command?

A hub that spawns servers as system users runs ``c.Spawner.cmd`` as each of them. A venv made
from a Python in root's home (``/root/.pyenv/...``, mode 700, as pyenv installs it) has a
``jupyterhub-singleuser`` whose interpreter other users cannot reach: the hub starts, and the
first spawn fails with ``Permission denied trying to run .../jupyterhub-singleuser``.
:func:`unreachable_by_others` says so before anyone logs in (the example config logs it).
"""

from __future__ import annotations

import os
import shutil
import stat


def _blocked(path: str) -> str:
    """Why users other than the owner cannot run ``path`` ("" when they can): a folder on its
    way they may not enter, or the file not executable by others."""
    real = os.path.realpath(path)
    parts = real.split(os.sep)
    for i in range(1, len(parts)):
        folder = os.sep.join(parts[:i]) or os.sep
        try:
            mode = os.stat(folder).st_mode
        except OSError:
            return ""
        if not mode & stat.S_IXOTH:
            return f"{folder} (mode {stat.S_IMODE(mode):o}) cannot be entered by other users"
    try:
        mode = os.stat(real).st_mode
    except OSError:
        return ""
    if not mode & stat.S_IXOTH:
        return f"{real} (mode {stat.S_IMODE(mode):o}) is not executable by other users"
    return ""


def unreachable_by_others(cmd: str) -> str:
    """A warning when other users could not run ``cmd`` (or the interpreter of its ``#!`` line);
    "" when they can or it cannot be told (not found)."""
    path = cmd if os.sep in cmd else (shutil.which(cmd) or "")
    if not path or not os.path.exists(path):
        return ""
    why = _blocked(path)
    if not why:
        try:
            with open(path, "rb") as f:
                head = f.readline(512)
        except OSError:
            head = b""
        if head.startswith(b"#!"):
            interp = head[2:].decode(errors="replace").strip().split()
            if interp and interp[0] != "/usr/bin/env" and os.path.exists(interp[0]):
                blocked = _blocked(interp[0])
                if blocked:
                    why = f"its interpreter {interp[0]} -> {os.path.realpath(interp[0])}: {blocked}"
    if not why:
        return ""
    return (f"c.Spawner.cmd {path} cannot be run by other users ({why}): spawns as system users will fail with "
            "'Permission denied'. Make the venv from a Python every user can run (e.g. /usr/bin/python3 -m venv /opt/jupyterhub/venv).")
