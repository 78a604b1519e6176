"""Real Unix accounts for a hub's users, and a Python they can run.

A hub as root spawns each user's server under the user's own uid (``gpulease-local``). The test
accounts are made with ``useradd`` (homes in the test's folder) and removed after. The servers
need a Python those accounts can run: the tests' own one when they can (a virtualenv made from
a system Python), otherwise a virtualenv made from the system's Python of the same version that
reads the tests' packages (one ``.pth`` line), with Jupyter's data and config paths pointed at
the tests' environment (a Python under root's home, as pyenv installs it, is unreachable to
other accounts).
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import psutil
import pytest


def can_make_accounts() -> bool:
    return os.geteuid() == 0 and shutil.which("useradd") is not None and shutil.which("runuser") is not None


class Accounts:
    """Unix accounts ``names`` with homes under ``folder`` (which other accounts must be able to
    enter), made for the test (an account of that name left by an earlier run is made again);
    :meth:`remove` ends their processes and removes them."""

    def __init__(self, folder: Path, names: list[str]):
        self.folder, self.names, self.made = folder, names, []
        for name in names:
            home = folder / "home" / name
            home.mkdir(parents=True, exist_ok=True)
            self.made.append(name)
            self._delete(name)  # left by a run that was killed: made again, with its home here
            subprocess.run(["useradd", "-M", "-U", "-d", str(home), "-s", "/bin/sh", name], check=True, capture_output=True)
            entry = pwd.getpwnam(name)
            os.chown(home, entry.pw_uid, entry.pw_gid)

    def uid(self, name: str) -> int:
        return pwd.getpwnam(name).pw_uid

    def remove(self) -> None:
        """Every process of the accounts ended, then the accounts."""
        for name in self.made:
            self._delete(name)
        self.made = []

    @staticmethod
    def _delete(name: str) -> None:
        try:
            pwd.getpwnam(name)
        except KeyError:
            return
        procs = [p for p in psutil.process_iter(["username"]) if p.info["username"] == name]
        for p in procs:
            try:
                p.kill()
            except psutil.Error:
                pass
        psutil.wait_procs(procs, timeout=10)
        subprocess.run(["userdel", name], capture_output=True, check=False)
        subprocess.run(["groupdel", name], capture_output=True, check=False)


def _runs_as(user: str, python: str) -> bool:
    return subprocess.run(["runuser", "-u", user, "--", python, "-c", "import jupyterhub, jupyter_gpulease"],
                          capture_output=True, cwd="/", timeout=60, check=False).returncode == 0


def python_for(user: str, folder: Path) -> tuple[str, dict[str, str]]:
    """(a Python ``user`` can run with the tests' packages, the servers' environment it needs);
    skips the test when there is none."""
    if _runs_as(user, sys.executable):
        return sys.executable, {}
    system = shutil.which(f"python{sys.version_info[0]}.{sys.version_info[1]}", path="/usr/bin:/usr/local/bin")
    if system is None:
        pytest.skip(f"the tests' Python cannot be run by other accounts and there is no system python{sys.version_info[0]}.{sys.version_info[1]}")
    venv = folder / "venv-for-accounts"
    subprocess.run([system, "-m", "venv", "--without-pip", str(venv)], check=True, capture_output=True)
    site = Path(subprocess.run([str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    (site / "_tests_packages.pth").write_text(f"import site; site.addsitedir({sysconfig.get_paths()['purelib']!r})\n")
    python = str(venv / "bin" / "python")
    if not _runs_as(user, python):
        pytest.skip("other accounts cannot read the tests' packages (the checkout is in a folder only root enters)")
    env = {"JUPYTER_PATH": str(Path(sys.prefix) / "share" / "jupyter"),
           "JUPYTER_CONFIG_PATH": str(Path(sys.prefix) / "etc" / "jupyter")}
    return python, env
