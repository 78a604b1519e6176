"""Where the tests find the tools they run but do not install with pip: the proxy and the browser.

- configurable-http-proxy (Node.js): ``GPULEASE_CHP`` when set (and then only there), else
  ``PATH``, else the project's ``.ci/node_modules`` (where ``npm install --prefix .ci`` and
  ``bash .ci/run`` put the version pinned in ``.ci/package.json``). When none is there, the
  first test that needs it runs that npm command once (under a file lock, so two test runs
  never install at the same time); without npm it fails with the command to run.
- Chromium for the browser tests: ``GPULEASE_CHROMIUM`` when set, else the usual names on
  ``PATH`` and the usual install paths. Without one the browser tests skip with a one-line
  reason, except in CI (``CI`` set), where a missing browser is a failure.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CI_DIR = ROOT / ".ci"
PROJECT_CHP = CI_DIR / "node_modules" / ".bin" / "configurable-http-proxy"
CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable", "chrome")
CHROMIUM_PATHS = ("/usr/bin/chromium", "/usr/lib/chromium/chromium", "/usr/bin/chromium-browser", "/snap/bin/chromium",
                  "/usr/bin/google-chrome", "/opt/google/chrome/chrome",
                  "/Applications/Chromium.app/Contents/MacOS/Chromium",
                  "/Applications/Google Chrome.app/Contents/MacOS/Google Chrome")


def in_ci() -> bool:
    """Whether the tests run in CI, where a missing tool is a failure rather than a skip."""
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def _executable(path: str | Path) -> bool:
    return os.path.isfile(path) and os.access(path, os.X_OK)


def chp_install_command() -> list[str]:
    return ["npm", "install", "--prefix", str(CI_DIR), "--no-audit", "--no-fund", "--loglevel=error"]


def find_chp(*, install: bool = True) -> str:
    """The configurable-http-proxy executable; installs the pinned one into ``.ci`` when none is found.

    Raises AssertionError with what to do when it cannot be found or installed (a test that
    needs a real hub must fail, not skip).
    """
    explicit = os.environ.get("GPULEASE_CHP")
    if explicit:
        if not _executable(explicit):
            raise AssertionError(f"GPULEASE_CHP={explicit} is not an executable file; unset it to use the project's "
                                 f"{PROJECT_CHP.relative_to(ROOT)} (installed with: npm install --prefix .ci)")
        return explicit
    on_path = shutil.which("configurable-http-proxy")
    if on_path:
        return on_path
    if _executable(PROJECT_CHP):
        return str(PROJECT_CHP)
    if not install:
        raise AssertionError("configurable-http-proxy not found; install it with: npm install --prefix .ci")
    return _install_chp()


def _install_chp() -> str:
    if shutil.which("npm") is None:
        raise AssertionError(
            "configurable-http-proxy is needed by the tests that run a real JupyterHub, and npm is not installed to "
            "install it. Install Node.js 20 or newer with npm (e.g. apt-get install nodejs npm), then run the tests "
            "again; they install the proxy into .ci/node_modules themselves.")
    CI_DIR.mkdir(exist_ok=True)
    with open(CI_DIR / ".install.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another test run may be installing right now
        if not _executable(PROJECT_CHP):
            r = subprocess.run(chp_install_command(), cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
            if r.returncode != 0 or not _executable(PROJECT_CHP):
                raise AssertionError(f"installing configurable-http-proxy failed ({' '.join(chp_install_command())}, "
                                     f"exit {r.returncode}):\n{(r.stdout + r.stderr)[-2000:]}")
    return str(PROJECT_CHP)


def find_chromium() -> str | None:
    """Chromium (or Chrome) for the browser tests, or None."""
    explicit = os.environ.get("GPULEASE_CHROMIUM")
    if explicit:
        return explicit if _executable(explicit) else None
    for name in CHROMIUM_NAMES:
        found = shutil.which(name)
        if found:
            return found
    for path in CHROMIUM_PATHS:
        if _executable(path):
            return path
    return None


def chromium_missing_reason() -> str:
    explicit = os.environ.get("GPULEASE_CHROMIUM")
    if explicit:
        return f"GPULEASE_CHROMIUM={explicit} is not an executable file"
    return "Chromium not found (apt-get install chromium, or set GPULEASE_CHROMIUM to a Chromium or Chrome executable)"
