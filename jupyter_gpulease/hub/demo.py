"""`jupyter gpulease demo`: JupyterHub, its proxy, the lease broker and the spawner on 127.0.0.1.

Runs ``jupyterhub -f config/jupyterhub_config.py`` (the annotated example) with its state in
one folder, says which GPUs the pool has (simulated ones on a machine without NVIDIA GPUs,
and why), prints the URL and how to log in. On Ctrl-C it stops the hub, which first stops
granting leases, withdraws the spawns waiting in the queue and stops the servers while the
broker still runs (see :mod:`.lifecycle`), and makes sure no process it started is left behind.
"""

from __future__ import annotations

import argparse
import hmac
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from jupyterhub.auth import Authenticator
from traitlets import Unicode

DEFAULT_STATE_DIR = "demo-state"
DEFAULT_PASSWORD = "gpulease"
#: The demo's idle reclaim, short enough to see the whole cycle in minutes and long enough to follow
#: it at a reader's pace: a kernel whose GPU sits idle is warned after IDLE_WARN_S and suspended
#: after IDLE_RECLAIM_S; a lease no kernel uses goes back after UNUSED_LEASE_S (time to open a
#: notebook and write a first cell, or to read on while holding a GPU).
IDLE_RECLAIM_S = 120
IDLE_WARN_S = 60
UNUSED_LEASE_S = 300


class DemoAuthenticator(Authenticator):
    """The demo's login: any user name with the one shared password, admins included (config:
    ``c.JupyterHub.authenticator_class = "jupyter_gpulease.hub.demo.DemoAuthenticator"``).

    What ``DummyAuthenticator.password`` did before JupyterHub 5.3 deprecated it; JupyterHub's
    ``SharedPasswordAuthenticator`` would need a second, 32-character password for the admin."""

    password = Unicode("", help="""The password every user logs in with; empty: nobody can log in.""").tag(config=True)

    async def authenticate(self, handler, data):
        password = str((data or {}).get("password") or "")
        if self.password and hmac.compare_digest(password.encode(), self.password.encode()):
            return data["username"]
        return None


def find_config_dir() -> Path | None:
    """The folder of the example configs: the checkout's config/, or a copy shipped in the package."""
    pkg = Path(__file__).resolve().parent.parent
    for cand in (pkg.parent / "config", pkg / "config_examples"):
        if (cand / "jupyterhub_config.py").exists():
            return cand
    return None


def _checkout() -> Path | None:
    """The source checkout this package runs from (an editable install), if any."""
    root = Path(__file__).resolve().parent.parent.parent
    return root if (root / "pyproject.toml").exists() and (root / ".ci" / "package.json").exists() else None


def chp_candidates(state_dir: Path) -> list[Path]:
    """Where the demo looks for configurable-http-proxy after $GPULEASE_CHP and PATH: the
    node_modules of the checkout (``.ci/``, where ``npm install --prefix .ci`` puts it, or its
    root), of the current folder and of the state folder."""
    bases = []
    root = _checkout()
    if root is not None:
        bases += [root / ".ci", root]
    bases += [Path.cwd() / ".ci", Path.cwd(), state_dir]
    out = []
    for base in bases:
        p = base / "node_modules" / ".bin" / "configurable-http-proxy"
        if p not in out:
            out.append(p)
    return out


def _executable(path: str | Path) -> bool:
    return os.path.isfile(path) and os.access(path, os.X_OK)


def find_chp(state_dir: Path) -> str | None:
    """configurable-http-proxy: $GPULEASE_CHP when set (and only it), else PATH, else a
    project-local node_modules (see :func:`chp_candidates`)."""
    explicit = os.environ.get("GPULEASE_CHP")
    if explicit:
        return explicit if _executable(explicit) else None
    on_path = shutil.which("configurable-http-proxy")
    if on_path:
        return on_path
    for c in chp_candidates(state_dir):
        if _executable(c):
            return str(c)
    return None


def chp_install_command(state_dir: Path) -> str:
    """The one command that installs configurable-http-proxy where :func:`find_chp` finds it."""
    root = _checkout()
    if root is not None:
        # the version the project pins in .ci/package.json
        return f"npm install --prefix {root / '.ci'}"
    return f"npm install --prefix {state_dir} configurable-http-proxy"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_is_free(port: int) -> bool:
    """Whether the hub's proxy could listen on ``port`` of 127.0.0.1 now.

    Checked the way servers bind (tornado and Node.js set SO_REUSEADDR): connections of a
    run that just ended, still in TIME-WAIT, do not make the port busy; a listener does."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            s.listen(1)
        except OSError:
            return False
    return True


def _token(path: Path) -> str:
    if path.exists():
        tok = path.read_text().strip()
        if tok:
            return tok
    tok = secrets.token_hex(32)
    # created private: write-then-chmod would leave the token readable by everyone for a moment
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(tok + "\n")
    path.chmod(0o600)  # an empty file that existed keeps its mode through os.open
    return tok


def _get(url: str, token: str = "", timeout: float = 2):
    """(status, JSON or None) of a GET; (0, None) when nothing answers."""
    req = urllib.request.Request(url, headers={"Authorization": f"token {token}"} if token else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            body = r.read()
            return r.status, json.loads(body) if body else None
    except urllib.error.HTTPError as e:
        return e.code, None
    except (urllib.error.URLError, OSError, ValueError):
        return 0, None


def demo_ready(env: dict[str, str]) -> bool:
    """The hub, the broker and the proxy's routes to both are up.

    Asked of each on its own port (the hub's, the broker's with the spawner's token, the
    proxy's API), never through the proxy: a request through it before its routes exist
    would fill the log with 404 errors, and an anonymous one to the broker with 401s."""
    status, _ = _get(f"http://127.0.0.1:{env['GPULEASE_DEMO_HUB_PORT']}/hub/api")
    if status != 200:
        return False
    status, _ = _get(f"http://127.0.0.1:{env['GPULEASE_DEMO_BROKER_PORT']}/services/gpulease/api/pool", env["GPULEASE_HUB_TOKEN"])
    if status != 200:
        return False
    status, routes = _get(f"http://127.0.0.1:{env['GPULEASE_DEMO_PROXY_API_PORT']}/api/routes", env["CONFIGPROXY_AUTH_TOKEN"])
    return status == 200 and isinstance(routes, dict) and "/" in routes and "/services/gpulease" in routes


def choose_backend(requested: str) -> tuple[str, str]:
    """(backend to run, why, in words). ``auto`` is decided here, so the demo can say it: NVML
    when it finds GPUs, else the simulated pool (with NVML's reason)."""
    if requested != "auto":
        return requested, f"--device-backend {requested}"
    from ..devices import DeviceUnavailable, get_backend

    try:
        backend = get_backend("nvml")
        try:
            gpus = backend.inventory()
        finally:
            backend.close()
    except DeviceUnavailable as e:
        return "simulated", str(e).split(". Use the")[0]
    except Exception as e:
        return "simulated", f"NVML failed: {e}"
    if not gpus:
        return "simulated", "NVML works but finds no GPU"
    return "nvml", f"NVML finds {len(gpus)} GPU(s)"


def describe_pool(pool: dict | None) -> list[str]:
    """The broker's pool in lines: '2 × L4 (22 GB) on sim-node-1', MIG instances included."""
    if not pool:
        return []
    groups: dict[tuple, int] = {}
    for d in pool.get("devices") or []:
        mig = ", ".join(sorted({m.get("profile", "") for m in d.get("mig") or []}))
        mig_n = len(d.get("mig") or [])
        key = (d.get("model", "?"), round(int(d.get("memory_mib") or 0) / 1024), d.get("node", ""), mig, mig_n)
        groups[key] = groups.get(key, 0) + 1
    out = []
    for (model, gb, node, mig, mig_n), n in sorted(groups.items()):
        what = f"{n} × {model} ({gb} GB)"
        if mig:
            what += f" in MIG mode: {mig_n} × {mig}" + (" each" if n > 1 else "")
        out.append(f"{what} on {node}")
    return out


_OURS = ("jupyterhub", "configurable-http-proxy", "jupyter_gpulease", "jupyter-gpulease", "ipykernel", "jupyter-lab", "jupyter_server")


def _ancestors() -> set[int]:
    out, pid = set(), os.getpid()
    while pid > 1 and pid not in out:
        out.add(pid)
        try:
            with open(f"/proc/{pid}/stat") as f:
                pid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            break
    return out


def _procs_in(state_dir: Path) -> list[int]:
    """Jupyter processes working inside the state folder: the servers and kernels the hub started.

    (Single-user servers run in sessions of their own, so the hub's process group misses them
    if the hub itself died.) Never this process or its parents, such as a shell in that folder.
    """
    out = []
    skip = _ancestors()
    root = str(state_dir.resolve())
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) in skip:
            continue
        try:
            cwd = os.readlink(f"/proc/{d}/cwd")
            with open(f"/proc/{d}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if (cwd == root or cwd.startswith(root + os.sep)) and any(w in cmd for w in _OURS):
            out.append(int(d))
    return out


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a whole number of seconds, not {text!r}") from None
    if value < 2:
        raise argparse.ArgumentTypeError(f"at least 2 seconds, not {value}")
    return value


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="jupyter gpulease demo",
        description="Run JupyterHub with GPU leases on 127.0.0.1: the hub, configurable-http-proxy, the lease broker "
        "on a simulated GPU pool (real GPUs when NVML finds them) and the lease spawner. Ctrl-C stops everything.",
    )
    p.add_argument("--state-dir", default=os.environ.get("GPULEASE_DEMO_DIR", DEFAULT_STATE_DIR),
                   help=f"folder for the demo's databases, logs, tokens and home folders (default: ./{DEFAULT_STATE_DIR})")
    p.add_argument("--port", type=int, default=8000, help="port of the hub on 127.0.0.1 (default: 8000; 0: any free port)")
    p.add_argument("--password", default=os.environ.get("GPULEASE_DEMO_PASSWORD", DEFAULT_PASSWORD),
                   help=f"the password every demo user logs in with (default: {DEFAULT_PASSWORD})")
    p.add_argument("--device-backend", choices=("auto", "simulated", "nvml", "static"), default="auto",
                   help="GPUs of the pool: auto (NVML when it finds GPUs, else 4 simulated GPUs), simulated, nvml, static")
    p.add_argument("--config-dir", default=None, help="folder with jupyterhub_config.py and gpulease_config.py (default: the examples in config/)")
    p.add_argument("--idle-timeout", type=_positive_int, default=IDLE_RECLAIM_S,
                   help=f"seconds a kernel's GPU may sit idle before it is suspended (warned at half of it; "
                        f"default: {IDLE_RECLAIM_S}, to see the cycle in minutes)")
    p.add_argument("--unused-timeout", type=_positive_int, default=None,
                   help=f"seconds a lease no kernel uses may sit unused before it goes back (default: {UNUSED_LEASE_S}, "
                        "or the idle timeout when that is longer)")
    p.add_argument("--fresh", action="store_true", help="delete the state folder first (users, leases, logs)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    state = Path(args.state_dir).resolve()
    if args.fresh and state.exists():
        shutil.rmtree(state)
    state.mkdir(parents=True, exist_ok=True)

    checked = _preflight(args, state)
    if isinstance(checked, int):
        return checked
    config_dir, chp, port = checked
    backend, why = choose_backend(args.device_backend)

    if backend == "simulated":
        forget_last_run(state)
    env = _hub_env(args, state, port, chp, backend)
    env["GPULEASE_BROKER_CONFIG"] = str(write_broker_config(state, config_dir, backend))
    # the hub's own command-line entry in this Python's environment
    cmd = [sys.executable, "-m", "jupyterhub", "-f", str(config_dir / "jupyterhub_config.py")]
    log_path = state / "jupyterhub.log"
    url = f"http://127.0.0.1:{port}"

    stop_requested = False

    def on_signal(signum, frame):
        nonlocal stop_requested
        stop_requested = True

    old_int = signal.signal(signal.SIGINT, on_signal)
    old_term = signal.signal(signal.SIGTERM, on_signal)
    print(f"Starting JupyterHub with GPU leases (state folder: {state}) ...", flush=True)
    if backend == "simulated":
        print(f"The GPUs are simulated: {why}. Leases, the queue and placement are real; the GPUs and their "
              "figures are not (no CUDA program can run on them: a notebook makes simulated GPU work with "
              "jupyter_gpulease.sim.gpu.use_gpu, and suspends are simulated).", flush=True)
    last = _last_stop(state)
    if last:
        print(last, flush=True)
    with open(log_path, "ab") as log:
        log.write(f"\n===== jupyter gpulease demo {time.strftime('%Y-%m-%d %H:%M:%S')} =====\n".encode())
        log.flush()
        hub = subprocess.Popen(cmd, cwd=state, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        rc = 0
        try:
            rc = _run_hub(hub, env, args, url, state, log_path, backend, lambda: stop_requested)
        finally:
            if hub.poll() is None:
                print(f"Stopping: {_what_runs(url, env['GPULEASE_DEMO_ADMIN_TOKEN'])}. No new GPU grants; waiting spawns "
                      "are withdrawn, then the servers stop (their leases are given back), then the broker and the proxy ...",
                      flush=True)
            _shutdown(hub, state)
            summary = _shutdown_summary(log_path)
            if summary:
                print(summary, flush=True)
                _remember_stop(state, summary)
            signal.signal(signal.SIGINT, old_int)
            signal.signal(signal.SIGTERM, old_term)
    print("Stopped; nothing is left running.", flush=True)
    return rc


def _preflight(args, state: Path) -> tuple[Path, str, int] | int:
    """The config folder, configurable-http-proxy and a free port; an exit status (2) after saying what is missing."""
    config_dir = Path(args.config_dir).resolve() if args.config_dir else find_config_dir()
    if config_dir is None or not (config_dir / "jupyterhub_config.py").exists():
        print("jupyter gpulease demo: config/jupyterhub_config.py not found; pass --config-dir", file=sys.stderr)
        return 2
    chp = find_chp(state)
    if chp is None:
        bad = os.environ.get("GPULEASE_CHP")
        why = f" (GPULEASE_CHP={bad} is not an executable file)" if bad else ""
        print(
            f"jupyter gpulease demo: configurable-http-proxy is missing{why}. Install it (npm, Node.js 18 or newer) with:\n\n"
            f"    {chp_install_command(state)}\n\n"
            "and run the demo again. (Or put it on PATH, or set GPULEASE_CHP to its path.)",
            file=sys.stderr,
        )
        return 2
    port = args.port or free_port()
    if not port_is_free(port):
        print(f"jupyter gpulease demo: port {port} on 127.0.0.1 is in use (another program listens there); "
              "choose another with --port", file=sys.stderr)
        return 2
    return config_dir, chp, port


def _hub_env(args, state: Path, port: int, chp: str, backend: str) -> dict[str, str]:
    """The hub's environment: the demo's ports, tokens, device backend and idle timeouts for its config."""
    env = dict(os.environ)
    env.pop("JUPYTERHUB_API_TOKEN", None)
    env["PATH"] = path_with(Path(sys.executable).parent, env.get("PATH", ""))
    env.update(
        GPULEASE_DEMO_DIR=str(state),
        GPULEASE_DEMO_PORT=str(port),
        GPULEASE_DEMO_HUB_PORT=str(free_port()),
        GPULEASE_DEMO_PROXY_API_PORT=str(free_port()),
        GPULEASE_DEMO_BROKER_PORT=str(free_port()),
        GPULEASE_DEMO_PASSWORD=args.password,
        GPULEASE_HUB_TOKEN=_token(state / "spawner-token"),
        GPULEASE_CHP=chp,
        GPULEASE_DEVICE_BACKEND=backend,
        CONFIGPROXY_AUTH_TOKEN=_token(state / "proxy-token"),
        GPULEASE_DEMO_ADMIN_TOKEN=_token(state / "demo-token"),
        GPULEASE_DEMO_IDLE_TIMEOUT=str(args.idle_timeout),
        GPULEASE_DEMO_UNUSED_TIMEOUT=str(unused_timeout(args)),
        GPULEASE_DEMO_IDLE_WARN_BEFORE=str(args.idle_timeout - args.idle_timeout * IDLE_WARN_S // IDLE_RECLAIM_S),
    )
    return env


def forget_last_run(state: Path) -> list[int]:
    """The simulated GPUs as a new run finds them: the kernels of the last run stopped with it, so
    their processes (and what the simulated cuda-checkpoint kept of them) are taken off the GPUs;
    the pids taken off. Without this, an idle GPU would show a stopped kernel's memory as used."""
    from ..devices.simulated import SimulatedBackend

    state_file = state / "sim-gpus.json"
    if not state_file.exists():
        return []
    gone = SimulatedBackend({"state_file": str(state_file)}).forget_dead_processes(untimed=True)
    Path(str(state_file) + ".checkpoints.json").unlink(missing_ok=True)
    return gone


def path_with(bin_dir: Path, path: str) -> str:
    """``path`` with ``bin_dir`` first: the hub, its servers and their kernels find this Python's
    commands (``jupyter``, ``jupyter-gpulease``) though the virtual environment is not activated."""
    rest = [p for p in path.split(os.pathsep) if p and p != str(bin_dir)]
    return os.pathsep.join([str(bin_dir), *rest])


def unused_timeout(args: argparse.Namespace) -> int:
    """Seconds an unused lease stays: ``--unused-timeout``, else UNUSED_LEASE_S or the idle timeout if longer."""
    return args.unused_timeout or max(UNUSED_LEASE_S, args.idle_timeout)


def _run_hub(hub: subprocess.Popen, env: dict[str, str], args, url: str, state: Path, log_path: Path, backend: str,
             stop_requested) -> int:
    """Wait for the hub to come up (banner), then until it exits or a stop is asked for; the exit status."""
    rc = 0
    deadline = time.monotonic() + 120
    while not demo_ready(env):
        if hub.poll() is not None:
            print(f"JupyterHub exited with status {hub.returncode}. The end of its log ({log_path}):\n", file=sys.stderr)
            print(_tail(log_path), file=sys.stderr)
            return 1
        if stop_requested():
            break
        if time.monotonic() > deadline:
            print(f"JupyterHub did not come up within 120 s; see {log_path}", file=sys.stderr)
            rc = 1
            break
        time.sleep(0.3)
    else:
        _, pool = _get(f"http://127.0.0.1:{env['GPULEASE_DEMO_BROKER_PORT']}/services/gpulease/api/pool", env["GPULEASE_HUB_TOKEN"])
        print(_banner(url, args.password, state, log_path, describe_pool(pool), backend, idle_timeout=args.idle_timeout,
                      unused_timeout=unused_timeout(args)), flush=True)
    while not stop_requested() and rc == 0:
        if hub.poll() is not None:
            print(f"JupyterHub exited with status {hub.returncode}; see {log_path}", file=sys.stderr)
            rc = 1
            break
        time.sleep(0.3)
    return rc


def write_broker_config(state: Path, config_dir: Path, backend: str) -> Path:
    """The broker's config for the demo: the annotated example, with the demo's pool and database."""
    example = config_dir / "gpulease_config.py"
    lines = [
        "# Written by `jupyter gpulease demo` on every start: the example config with the demo's",
        "# database and pool. Edit the example (or pass --config-dir) instead of this file.",
        "c = get_config()  # noqa: F821",
    ]
    if example.exists():
        lines.append(f"load_subconfig({str(example)!r})  # noqa: F821")
    lines += [
        f"c.GPULeaseBroker.db_url = {('sqlite:///' + str(state / 'gpulease.sqlite'))!r}",
        f"c.GPULeaseBroker.device_backend = {backend!r}",
        "c.GPULeaseBroker.tick_interval = 1.0  # a lively demo: decisions within a second",
    ]
    if backend in ("auto", "simulated"):
        # the simulated pool: 4 GPUs of two models, one A100 in MIG mode (real GPUs instead when
        # NVML finds them); its figures in a file the servers' extension reads too
        lines.append(f"c.GPULeaseBroker.devices = {{'state_file': {str(state / 'sim-gpus.json')!r}}}")
    path = state / "gpulease_config.py"
    path.write_text("\n".join(lines) + "\n")
    return path


def _banner(url: str, password: str, state: Path, log_path: Path, pool_lines: list[str] = (), backend: str = "", *,
            idle_timeout: int = IDLE_RECLAIM_S, unused_timeout: int = UNUSED_LEASE_S) -> str:
    from ..core.text import format_duration

    warn = idle_timeout * IDLE_WARN_S // IDLE_RECLAIM_S
    gpus = []
    if pool_lines:
        gpus = ["  GPUs of the pool" + (" (simulated)" if backend == "simulated" else "") + ":"]
        gpus += [f"      {line}" for line in pool_lines]
    return "\n".join([
        "",
        f"JupyterHub with GPU leases is running at {url}/",
        "",
        f"  Log in with any user name (alice, bob, ...) and the password {password!r}.",
        "  Pick a GPU option on the spawn form; a second user asking for a busy GPU sees their place in the queue.",
        *gpus,
        f"  Idle reclaim{' is short in the demo' if idle_timeout <= 600 else ''}: a kernel whose GPU sits idle is warned "
        f"after {warn} s and suspended after {idle_timeout} s",
        "  (its variables stay; its next cell gets a GPU back); a lease no kernel uses goes back after "
        f"{format_duration(unused_timeout)} (the next cell asks for one again).",
        *(["  In a notebook, make simulated GPU work with:",
           "      from jupyter_gpulease.sim.gpu import use_gpu; use_gpu(util=80, memory_gb=6, seconds=20)"]
          if backend == "simulated" else []),
        "  User 'admin' is a hub admin and sees every lease on the broker's admin page:",
        f"      {url}/services/gpulease/admin",
        f"  State folder: {state}   (logs: {log_path.name}; delete the folder, or use --fresh, to start afresh)",
        "",
        "Press Ctrl-C to stop.",
        "",
    ])


def _tail(path: Path, n: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def _what_runs(url: str, token: str) -> str:
    """'3 servers and 2 waiting spawns' from the Hub API (the demo's own token)."""
    status, users = _get(f"{url}/hub/api/users?state=active", token, timeout=10)
    if status != 200 or not isinstance(users, list):
        return "the hub"
    running = waiting = 0
    for u in users:
        for server in (u.get("servers") or {}).values():
            if (server or {}).get("pending") == "spawn":
                waiting += 1
            elif (server or {}).get("ready"):
                running += 1
    return f"{running} server(s) running, {waiting} spawn(s) waiting"


SHUTDOWN_MARK = "GPU leases at shutdown"


def _shutdown_summary(log_path: Path) -> str:
    """What the hub said about the leases at its shutdown (the last such line of its log)."""
    try:
        lines = [line for line in log_path.read_text(errors="replace").splitlines() if SHUTDOWN_MARK in line]
    except OSError:
        return ""
    if not lines:
        return ""
    said = lines[-1].split(SHUTDOWN_MARK, 1)[1].split(": ", 1)[-1].strip()
    return f"GPU leases: {said}."


def _remember_stop(state: Path, summary: str) -> None:
    (state / "last-stop.txt").write_text(summary + "\n")


def _last_stop(state: Path) -> str:
    """At the next start: what the last stop did to waiting spawns, said to whoever restarts."""
    try:
        text = (state / "last-stop.txt").read_text().strip()
    except OSError:
        return ""
    import re

    m = re.search(r"(\d+) waiting spawn\(s\) withdrawn", text)
    if not m or m.group(1) == "0":
        return ""
    return (f"At the last stop, {m.group(1)} spawn(s) were waiting for GPUs and were withdrawn (their spawn page said so): "
            "those users start their servers again.")


def terminate(proc: subprocess.Popen, timeout: float) -> None:
    """SIGTERM ``proc`` and wait up to ``timeout`` seconds for it; SIGKILL it if it is still there."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def _signal_alive(pids: list[int], sig: int) -> None:
    for pid in pids:
        if pid_alive(pid):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass


def _shutdown(hub: subprocess.Popen, state: Path) -> None:
    """SIGTERM the hub (it stops the servers, its services and the proxy); then make sure of it."""
    terminate(hub, 45)
    # the hub's process group: the broker service and the proxy, should they have outlived it
    try:
        os.killpg(hub.pid, signal.SIGTERM)
    except (ProcessLookupError, PermissionError):
        pass
    pid_file = state / "jupyterhub-proxy.pid"
    pids = []
    if pid_file.exists():
        try:
            pids.append(int(pid_file.read_text().strip()))
        except ValueError:
            pass
    # single-user servers run in sessions of their own, with their home under the state folder
    pids += _procs_in(state)
    _signal_alive(pids, signal.SIGTERM)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(pid_alive(p) for p in pids):
        time.sleep(0.2)
    _signal_alive(pids, signal.SIGKILL)
    try:
        os.killpg(hub.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


if __name__ == "__main__":
    sys.exit(main())
