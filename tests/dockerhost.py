"""A private Docker host for the Docker engine's tests: dockerd, a registry and the images.

Everything runs from Debian packages on this machine, with no image registry on the network:

- :func:`ensure_dockerd`: a dockerd (``docker.io``) of its own, with its own data root, exec
  root, pidfile and unix socket under ``build/docker/`` of the checkout: overlay2, cgroupfs,
  no bridge, no iptables (containers use the host's network, ``network_mode="host"``). Started
  detached (its own session: it outlives the test run), reused while it answers.
- :func:`ensure_registry`: Debian's ``docker-registry`` on 127.0.0.1 (a port chosen once and
  kept in ``build/docker/registry.port``); dockerd pulls from it over plain HTTP, since Docker
  trusts registries on 127.0.0.0/8 without TLS.
- :func:`ensure_base_image`: ``gpulease-base:bookworm``, a Debian bookworm root file system
  made by ``debootstrap --variant=minbase`` (with python3, python3-venv, ca-certificates) and
  ``docker import``-ed; the tarball is cached, so debootstrap runs once.
- :func:`ensure_singleuser_image`: ``gpulease-singleuser:<hash>`` (and ``:latest``) from
  ``deploy/docker/singleuser/Dockerfile``: the project's wheel with jupyterhub, jupyter_server
  and ipykernel in /opt/gpulease. The wheels are downloaded here (pip's cache makes that quick
  the second time) and served to the build over HTTP on 127.0.0.1. The hash covers the
  Dockerfile, the base, pyproject.toml and the package's sources: rebuilt only when they change.
- :func:`ensure_test_image`: ``gpulease-singleuser-test:<hash>`` (and ``:latest``): the
  single-user image with the stand-in ``cuda-checkpoint`` (tests/standin_cuda_checkpoint.py)
  at /usr/local/bin, the image the end-to-end tests run.
- :func:`push_to_registry`, :func:`remove_image`: for tests of a spawn that must pull.
- :func:`docker_client`: docker-py's client on the private socket.
- :func:`skip_reason`, :func:`require`, :func:`requires_docker`: whether this machine can run
  Docker tests; without one they skip with the reason, except in CI (``CI`` set), where they fail.

Concurrent callers (two pytest-xdist workers) wait on a file lock per step instead of starting
a second daemon or building an image twice.

Run as a script (``.ci/run`` runs ``setup``), timing each step::

    python tests/dockerhost.py setup    # dockerd, registry, images, a smoke run
    python tests/dockerhost.py build    # the images only
    python tests/dockerhost.py status
    python tests/dockerhost.py stop     # registry and dockerd (images and data stay)
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import http.server
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tooling  # after the path is set

ROOT = Path(__file__).resolve().parent.parent
STATE = ROOT / "build" / "docker"
DOCKERFILE = ROOT / "deploy" / "docker" / "singleuser" / "Dockerfile"
STANDIN = ROOT / "tests" / "standin_cuda_checkpoint.py"

DOCKERD = "/usr/sbin/dockerd"
REGISTRY = "/usr/bin/docker-registry"
DEBOOTSTRAP = "/usr/sbin/debootstrap"

BASE_IMAGE = "gpulease-base:bookworm"
SINGLEUSER_REPO = "gpulease-singleuser"
TEST_REPO = "gpulease-singleuser-test"
LABEL = "org.gpulease.source"  # the hash an image was made from

SUITE, MIRROR = "bookworm", "http://deb.debian.org/debian"
INCLUDE = ("python3", "python3-venv", "ca-certificates")
# bookworm's python3 is 3.11: the wheels downloaded for the image are for that Python and glibc
# (pip takes each accepted platform tag by name: bookworm's glibc 2.36 runs manylinux_2_5 to _2_36)
IMAGE_PYTHON = "3.11"
IMAGE_PLATFORMS = (*(f"manylinux_2_{minor}_x86_64" for minor in range(36, 4, -1)),
                   "manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64")
IMAGE_PACKAGES = ("jupyterhub", "jupyter_server", "ipykernel")  # with the project's wheel
# in the image at the versions the tests' hub and servers run here (the venv running this), so
# that a hub and its containers' single-user servers are of the same JupyterHub
PINNED = ("jupyterhub", "jupyter_server", "ipykernel", "jupyterlab")

# what the single-user image's hash covers, besides the Dockerfile and the base (the wheel's
# sources; jupyter_gpulease/labextension is the extension built from labextension/)
SOURCES = ("pyproject.toml", "jupyter_gpulease", "labextension/package.json", "labextension/install.json",
           "labextension/src", "labextension/style", "jupyter-config", "config")
SKIP_PARTS = {"__pycache__", "node_modules", ".ipynb_checkpoints"}

# The stand-in installs itself with its own install() (a wrapper named cuda-checkpoint that runs
# it with the Python that called install), as the tests do on the host; here with the venv's Python.
TEST_DOCKERFILE = """\
FROM {singleuser}
USER root
COPY standin_cuda_checkpoint.py /opt/gpulease/share/standin/standin_cuda_checkpoint.py
RUN /opt/gpulease/bin/python -c "import sys; sys.path.insert(0, '/opt/gpulease/share/standin'); \\
import standin_cuda_checkpoint as s; print(s.install('/usr/local/bin'))" \\
 && cuda-checkpoint --help
USER jovyan
"""


def _log(msg: str) -> None:
    print(f"[dockerhost] {msg}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def _timed(what: str, times: dict | None = None):
    t0 = time.monotonic()
    yield
    dt = time.monotonic() - t0
    if times is not None:
        times[what] = dt
    _log(f"{what}: {dt:.1f} s")


def _runtime_dir() -> Path:
    """Where the sockets go: build/docker/ itself, or a short folder under /run when the
    checkout's path is too long for a unix socket (dockerd's containerd puts its socket in the
    exec root)."""
    if len(str(STATE)) <= 60:
        return STATE
    return Path("/run") / f"gpulease-docker-{hashlib.sha256(str(STATE).encode()).hexdigest()[:10]}"


DATA_ROOT = STATE / "data"
EXEC_ROOT = _runtime_dir() / "exec"
SOCKET = _runtime_dir() / "docker.sock"
PIDFILE = STATE / "dockerd.pid"
DOCKERD_LOG = STATE / "dockerd.log"
REGISTRY_DIR = STATE / "registry"
REGISTRY_PIDFILE = STATE / "registry.pid"
REGISTRY_PORTFILE = STATE / "registry.port"
REGISTRY_LOG = STATE / "registry.log"
CLI_CONFIG = STATE / "cli"  # the docker CLI's config folder: nothing from ~/.docker (proxies, credential helpers)


def socket_url() -> str:
    return f"unix://{SOCKET}"


# ------------------------------------------------------------------ helpers


@contextlib.contextmanager
def _lock(name: str):
    """An exclusive file lock (fcntl) shared by every process on this checkout."""
    STATE.mkdir(parents=True, exist_ok=True)
    with open(STATE / f"{name}.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DOCKER_")}
    env["DOCKER_CONFIG"] = str(CLI_CONFIG)
    env["DOCKER_BUILDKIT"] = "0"  # the classic builder: dockerd 20.10 has it, and no buildx is needed
    env["PATH"] = env.get("PATH", "/usr/bin:/bin") + ":/usr/sbin:/sbin"
    return env


def docker(*args: str, check: bool = True, capture: bool = True, timeout: float = 600, input: bytes | None = None
           ) -> subprocess.CompletedProcess:
    """Run the docker CLI on the private daemon."""
    CLI_CONFIG.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["docker", "-H", socket_url(), *args], check=False, env=_env(), timeout=timeout, input=input,
                       stdout=subprocess.PIPE if capture else None, stderr=subprocess.PIPE if capture else None)
    if check and r.returncode != 0:
        err = (r.stderr or b"").decode(errors="replace").strip() if capture else ""
        raise RuntimeError(f"docker {' '.join(args)} failed (exit {r.returncode}): {err[-2000:]}")
    return r


def _pid_alive(pidfile: Path, must_contain: str) -> int | None:
    """The pid in ``pidfile`` when that process runs and its command line names ``must_contain``
    (so that a pid reused by another process is never taken for ours)."""
    try:
        pid = int(pidfile.read_text().strip())
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except (FileNotFoundError, ValueError, ProcessLookupError, PermissionError):
        return None
    return pid if must_contain in cmdline else None


def _tail(path: Path, n: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except FileNotFoundError:
        return "(no log)"


def _ping() -> bool:
    """Whether the private dockerd answers its API (GET /_ping) on the socket."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(5)
            s.connect(str(SOCKET))
            s.sendall(b"GET /_ping HTTP/1.0\r\nHost: docker\r\n\r\n")
            data = b""
            while chunk := s.recv(4096):
                data += chunk
        return data.startswith(b"HTTP/1.") and b" 200 " in data.split(b"\r\n", 1)[0] and data.endswith(b"OK")
    except OSError:
        return False


def _wait(predicate, timeout: float, failed) -> None:
    """Wait until ``predicate()``; ``failed()`` returns a message when waiting is pointless."""
    deadline = time.monotonic() + timeout
    while not predicate():
        msg = failed()
        if msg or time.monotonic() > deadline:
            raise RuntimeError(msg or f"timed out after {timeout:.0f} s")
        time.sleep(0.2)


def image_exists(ref: str) -> bool:
    return docker("image", "inspect", ref, check=False).returncode == 0


def _label(ref: str) -> str | None:
    r = docker("image", "inspect", "-f", f'{{{{index .Config.Labels "{LABEL}"}}}}', ref, check=False)
    return r.stdout.decode().strip() if r.returncode == 0 else None


def _hash_paths(h, paths) -> None:
    for rel in paths:
        p = ROOT / rel
        files = [p] if p.is_file() else sorted(f for f in p.rglob("*") if f.is_file()) if p.is_dir() else []
        for f in files:
            parts = f.relative_to(ROOT).parts
            if SKIP_PARTS.intersection(parts) or f.suffix == ".pyc" or parts[:2] == ("jupyter_gpulease", "labextension"):
                continue
            h.update(b"\0" + "/".join(parts).encode() + b"\0" + f.read_bytes())


# ------------------------------------------------------------------ dockerd


def ensure_dockerd() -> str:
    """Start the private dockerd unless it answers already; its socket URL (``unix:///…/docker.sock``).

    overlay2 on ``build/docker/data``, cgroupfs, no default bridge, no iptables rules, no
    change to IP forwarding: the host's network is left alone (containers use
    ``network_mode="host"``). Its own containerd (under the exec root) and containerd
    namespace, so a containerd or Docker of the machine is never shared. Detached: it outlives
    the caller; :func:`stop` stops it.
    """
    if _ping():
        return socket_url()
    with _lock("dockerd"):
        if _ping():
            return socket_url()
        for d in (DATA_ROOT, EXEC_ROOT, CLI_CONFIG):
            d.mkdir(parents=True, exist_ok=True)
        if not _pid_alive(PIDFILE, str(DATA_ROOT)):
            config = STATE / "daemon.json"
            config.write_text("{}\n")  # not /etc/docker/daemon.json: nothing of the machine's Docker settings
            cmd = [
                DOCKERD, "--config-file", str(config),
                "--data-root", str(DATA_ROOT), "--exec-root", str(EXEC_ROOT), "--pidfile", str(PIDFILE),
                "-H", socket_url(),
                "--storage-driver", "overlay2", "--exec-opt", "native.cgroupdriver=cgroupfs",
                "--bridge", "none", "--iptables=false", "--ip-forward=false", "--ip-masq=false",
                "--userland-proxy=false",
                "--containerd-namespace", "gpulease-test", "--containerd-plugins-namespace", "gpulease-test-plugins",
            ]
            _log(f"starting dockerd (log: {DOCKERD_LOG})")
            with open(DOCKERD_LOG, "ab") as log:
                # setsid --fork: its own session, and not our child: it outlives the test run
                subprocess.run(["setsid", "--fork", *cmd], stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                               env=_env(), check=True, timeout=30)
        started = time.monotonic()

        def failed():
            if time.monotonic() - started > 5 and not _pid_alive(PIDFILE, str(DATA_ROOT)):
                return f"dockerd did not start; the end of {DOCKERD_LOG}:\n{_tail(DOCKERD_LOG)}"
            return None

        try:
            _wait(_ping, 90, failed)
        except RuntimeError as e:
            raise RuntimeError(f"dockerd does not answer on {SOCKET}: {e}\n{_tail(DOCKERD_LOG)}") from None
    return socket_url()


def docker_client():
    """docker-py's client (``docker.DockerClient``) on the private dockerd, started when needed."""
    import docker as dockerpy

    return dockerpy.DockerClient(base_url=ensure_dockerd(), version="auto", timeout=300)


# ------------------------------------------------------------------ registry


def _registry_answers(port: int) -> bool:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(f"http://127.0.0.1:{port}/v2/", timeout=5) as r:
            return r.status == 200 and r.headers.get("Docker-Distribution-Api-Version", "").startswith("registry/2")
    except OSError:
        return False


def _recorded_port() -> int | None:
    try:
        return int(REGISTRY_PORTFILE.read_text().strip())
    except (FileNotFoundError, ValueError):
        return None


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def ensure_registry() -> str:
    """Start the private registry (Debian's docker-registry) unless it answers; ``"127.0.0.1:PORT"``.

    Its storage is ``build/docker/registry/``; the port is chosen free once and kept in
    ``build/docker/registry.port``. Plain HTTP: dockerd treats registries on 127.0.0.0/8 as
    insecure (no TLS) by default.
    """
    port = _recorded_port()
    if port and _registry_answers(port):
        return f"127.0.0.1:{port}"
    with _lock("registry"):
        port = _recorded_port()
        if port and _registry_answers(port):
            return f"127.0.0.1:{port}"
        REGISTRY_DIR.mkdir(parents=True, exist_ok=True)
        if not _pid_alive(REGISTRY_PIDFILE, str(REGISTRY_DIR)):
            if not port or not _port_free(port):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", 0))
                    port = s.getsockname()[1]
                REGISTRY_PORTFILE.write_text(f"{port}\n")
            config = REGISTRY_DIR / "config.yml"
            config.write_text(json.dumps({  # YAML is a superset of JSON
                "version": 0.1,
                "log": {"level": "warn", "fields": {"service": "registry"}},
                "storage": {"filesystem": {"rootdirectory": str(REGISTRY_DIR / "data")}, "delete": {"enabled": True},
                            "cache": {"blobdescriptor": "inmemory"}},
                "http": {"addr": f"127.0.0.1:{port}"},
            }, indent=2) + "\n")
            _log(f"starting docker-registry on 127.0.0.1:{port} (log: {REGISTRY_LOG})")
            with open(REGISTRY_LOG, "ab") as log:
                subprocess.run(["setsid", "--fork", "sh", "-c", 'echo $$ > "$0"; exec "$1" serve "$2"',
                                str(REGISTRY_PIDFILE), REGISTRY, str(config)],
                               stdin=subprocess.DEVNULL, stdout=log, stderr=log, check=True, timeout=30)
        started = time.monotonic()

        def failed():
            if time.monotonic() - started > 5 and not _pid_alive(REGISTRY_PIDFILE, str(REGISTRY_DIR)):
                return f"docker-registry did not start; the end of {REGISTRY_LOG}:\n{_tail(REGISTRY_LOG)}"
            return None

        _wait(lambda: _registry_answers(port), 30, failed)
    return f"127.0.0.1:{port}"


def push_to_registry(image: str, name: str) -> str:
    """Tag ``image`` as ``<registry>/<name>`` and push it to the private registry; that reference."""
    ref = f"{ensure_registry()}/{name}"
    docker("tag", image, ref)
    docker("push", ref)
    return ref


def remove_image(ref: str) -> None:
    """Drop the local tag ``ref`` (``docker rmi``), so that a spawn of it must pull. Layers that
    other local images share stay: such a pull fetches the manifest and only the missing layers."""
    r = docker("rmi", ref, check=False)
    if r.returncode != 0 and image_exists(ref):
        raise RuntimeError(f"docker rmi {ref} failed: {r.stderr.decode(errors='replace').strip()}")


# ------------------------------------------------------------------ images


def _rootfs_key() -> str:
    return hashlib.sha256(json.dumps([SUITE, "minbase", MIRROR, sorted(INCLUDE), "v1"]).encode()).hexdigest()[:12]


def _make_rootfs(tarball: Path, times: dict | None) -> None:
    """debootstrap a bookworm root file system and pack it as ``tarball``."""
    work = tarball.with_suffix(".d")
    if work.exists():
        shutil.rmtree(work)
    try:
        with _timed("debootstrap", times):
            r = subprocess.run([DEBOOTSTRAP, "--variant=minbase", f"--include={','.join(INCLUDE)}", SUITE, str(work), MIRROR],
                               stdin=subprocess.DEVNULL, capture_output=True, timeout=1200, check=False)
            if r.returncode != 0:
                raise RuntimeError(f"debootstrap failed (exit {r.returncode}):\n{r.stdout.decode(errors='replace')[-3000:]}"
                                   f"\n{r.stderr.decode(errors='replace')[-2000:]}")
        # what an image does without: downloaded packages, package lists, docs (but the copyright
        # files), man pages; the device nodes and mounts of /dev and /proc are Docker's
        subprocess.run(["sh", "-c", "rm -rf var/cache/apt/archives/*.deb var/cache/apt/*.bin var/lib/apt/lists/* var/log/*.log "
                        "usr/share/man/* usr/share/info/* dev/* proc/* sys/* && "
                        "find usr/share/doc -mindepth 1 ! -type d ! -name copyright -delete"],
                       cwd=work, check=True, timeout=120)
        tmp = tarball.with_suffix(".tmp")
        with _timed("root file system tarball", times):
            subprocess.run(["tar", "--numeric-owner", "--xattrs", "-C", str(work), "-cf", str(tmp), "."], check=True, timeout=600)
        tmp.replace(tarball)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def ensure_base_image(times: dict | None = None) -> str:
    """``gpulease-base:bookworm``: debootstrap's minbase bookworm with python3, python3-venv and
    ca-certificates, ``docker import``-ed. The root file system's tarball is kept in
    ``build/docker/rootfs/`` (named by the suite, variant, packages and mirror), so debootstrap
    runs once; the import happens again only when the image is missing."""
    ensure_dockerd()
    key = _rootfs_key()
    with _lock("base"):
        if _label(BASE_IMAGE) == key:
            return BASE_IMAGE
        tarball = STATE / "rootfs" / f"{SUITE}-minbase-{key}.tar"
        tarball.parent.mkdir(parents=True, exist_ok=True)
        if not tarball.exists():
            _make_rootfs(tarball, times)
        with _timed("base image import", times):
            docker("import", "--change", f"LABEL {LABEL}={key}", "--change", "ENV LANG=C.UTF-8",
                   "--change", 'CMD ["/bin/bash"]', "--message", f"debootstrap --variant=minbase {SUITE} {key}",
                   str(tarball), BASE_IMAGE)
    return BASE_IMAGE


def _pins() -> list[str]:
    """``name==version`` of :data:`PINNED` as installed in the running Python (those installed)."""
    from importlib import metadata

    pins = []
    for name in PINNED:
        try:
            pins.append(f"{name}=={metadata.version(name)}")
        except metadata.PackageNotFoundError:
            pass
    return pins


def singleuser_hash() -> str:
    h = hashlib.sha256(b"singleuser-v1\0")
    h.update(json.dumps([_rootfs_key(), IMAGE_PYTHON, IMAGE_PLATFORMS, IMAGE_PACKAGES, _pins()]).encode())
    h.update(DOCKERFILE.read_bytes())
    _hash_paths(h, SOURCES)
    return h.hexdigest()[:12]


def testimage_hash() -> str:
    h = hashlib.sha256(b"test-v1\0" + singleuser_hash().encode())
    h.update(TEST_DOCKERFILE.encode() + b"\0" + STANDIN.read_bytes())
    return h.hexdigest()[:12]


@contextlib.contextmanager
def _serve(folder: Path):
    """Serve ``folder`` over HTTP on 127.0.0.1 (a free port) while inside; its URL."""

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(folder)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


def _remove_other_tags(repo: str, keep: str) -> None:
    """Drop this repository's tags of earlier sources (an image a container still uses stays)."""
    r = docker("images", repo, "--format", "{{.Repository}}:{{.Tag}}", check=False)
    for ref in r.stdout.decode().split():
        tag = ref.rsplit(":", 1)[-1]
        if tag not in (keep, "latest", "<none>"):
            docker("rmi", ref, check=False)


def _build(tag: str, context: Path, key: str, *extra: str) -> None:
    r = docker("build", "--network", "host", "--label", f"{LABEL}={key}", "-t", tag, *extra, str(context),
               check=False, capture=True, timeout=1800)
    if r.returncode != 0:
        raise RuntimeError(f"docker build of {tag} failed (exit {r.returncode}):\n"
                           f"{r.stdout.decode(errors='replace')[-4000:]}\n{r.stderr.decode(errors='replace')[-2000:]}")


def ensure_singleuser_image(times: dict | None = None) -> str:
    """``gpulease-singleuser:<hash>`` (also ``:latest``), built from
    ``deploy/docker/singleuser/Dockerfile`` when no image of these sources exists; its reference.

    The project's wheel is built from the checkout (``pip wheel --no-deps``); it and its
    dependencies with jupyterhub, jupyter_server and ipykernel are downloaded as wheels for
    bookworm's Python (pip's cache serves repeats) and served to the build over HTTP on
    127.0.0.1 (the build runs on the host's network), so that the image keeps no copy of them.
    """
    ensure_base_image(times)
    key = singleuser_hash()
    ref = f"{SINGLEUSER_REPO}:{key}"
    with _lock("singleuser"):
        if _label(ref) == key:
            docker("tag", ref, f"{SINGLEUSER_REPO}:latest")
            return ref
        wheels = STATE / "wheels" / key
        shutil.rmtree(wheels, ignore_errors=True)
        wheels.mkdir(parents=True)
        pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input"]
        with _timed("project wheel", times):
            r = subprocess.run([*pip, "wheel", "-q", "--no-deps", "-w", str(wheels), str(ROOT)],
                               capture_output=True, timeout=1200, cwd=ROOT, check=False)
            if r.returncode != 0:
                raise RuntimeError(f"pip wheel of the project failed:\n{r.stdout.decode(errors='replace')[-3000:]}"
                                   f"\n{r.stderr.decode(errors='replace')[-3000:]}")
        (wheel,) = wheels.glob("jupyter_gpulease-*.whl")
        with _timed("wheels for the image (pip download)", times):
            r = subprocess.run([*pip, "download", "-q", "-d", str(wheels), "--only-binary=:all:",
                                "--python-version", IMAGE_PYTHON, "--implementation", "cp", "--abi", f"cp{IMAGE_PYTHON.replace('.', '')}", "--abi", "abi3", "--abi", "none",
                                *(a for p in IMAGE_PLATFORMS for a in ("--platform", p)), str(wheel), *IMAGE_PACKAGES, *_pins()],
                               capture_output=True, timeout=1200, check=False)
            if r.returncode != 0:
                raise RuntimeError(f"pip download for the image failed:\n{r.stdout.decode(errors='replace')[-3000:]}"
                                   f"\n{r.stderr.decode(errors='replace')[-3000:]}")
        context = STATE / "context" / "singleuser"
        shutil.rmtree(context, ignore_errors=True)
        context.mkdir(parents=True)
        shutil.copy2(DOCKERFILE, context / "Dockerfile")
        with _timed("single-user image build", times), _serve(wheels) as url:
            _build(ref, context, key, "--build-arg", f"WHEELS={url}", "--build-arg", f"BASE_IMAGE={BASE_IMAGE}")
        docker("tag", ref, f"{SINGLEUSER_REPO}:latest")
        _remove_other_tags(SINGLEUSER_REPO, key)
        for old in (STATE / "wheels").iterdir():
            if old.name != key:
                shutil.rmtree(old, ignore_errors=True)
    return ref


def ensure_test_image(times: dict | None = None) -> str:
    """``gpulease-singleuser-test:<hash>`` (also ``:latest``): the single-user image with the
    stand-in cuda-checkpoint as /usr/local/bin/cuda-checkpoint; its reference. The image the
    end-to-end tests run."""
    singleuser = ensure_singleuser_image(times)
    key = testimage_hash()
    ref = f"{TEST_REPO}:{key}"
    with _lock("test-image"):
        if _label(ref) == key:
            docker("tag", ref, f"{TEST_REPO}:latest")
            return ref
        context = STATE / "context" / "test"
        shutil.rmtree(context, ignore_errors=True)
        context.mkdir(parents=True)
        (context / "Dockerfile").write_text(TEST_DOCKERFILE.format(singleuser=singleuser))
        shutil.copy2(STANDIN, context / STANDIN.name)
        with _timed("test image build", times):
            _build(ref, context, key)
        docker("tag", ref, f"{TEST_REPO}:latest")
        _remove_other_tags(TEST_REPO, key)
    return ref


# ------------------------------------------------------------------ can this machine run them?


def _which(name: str, path: str) -> str | None:
    return path if os.access(path, os.X_OK) else shutil.which(name, path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin")


def skip_reason() -> str:
    """'' when the Docker tests can run here, else why not (one line)."""
    if os.geteuid() != 0:
        return "Docker tests need root (they start a private dockerd)"
    for name, path, package in (("dockerd", DOCKERD, "docker.io"), ("docker", "/usr/bin/docker", "docker.io"),
                                ("docker-registry", REGISTRY, "docker-registry"), ("debootstrap", DEBOOTSTRAP, "debootstrap"),
                                ("setsid", "/usr/bin/setsid", "util-linux")):
        if not _which(name, path):
            return f"Docker tests need {name} (apt-get install {package})"
    if not os.path.exists("/sys/fs/cgroup/devices/devices.allow"):
        return "Docker tests need cgroup v1's devices controller (mounted at /sys/fs/cgroup/devices)"
    try:
        import docker  # noqa: F401
    except ImportError:
        return "Docker tests need the Python package docker (pip install -e '.[test]')"
    return ""


def require() -> None:
    """Skip the calling test (or fixture) with the reason when Docker tests cannot run here; in
    CI (``CI`` set) fail instead."""
    reason = skip_reason()
    if reason:
        import pytest

        if tooling.in_ci():
            pytest.fail(f"{reason} (CI is set: Docker tests must run)", pytrace=False)
        pytest.skip(reason)


def requires_docker():
    """A mark: skip with the reason where Docker tests cannot run; in CI no skip (:func:`require`
    in a fixture then fails the tests)."""
    import pytest

    reason = skip_reason()
    return pytest.mark.skipif(bool(reason) and not tooling.in_ci(), reason=reason or "Docker tests can run")


# ------------------------------------------------------------------ stop, status, setup


def _stop_pid(pidfile: Path, must_contain: str, what: str, timeout: float) -> None:
    pid = _pid_alive(pidfile, must_contain)
    if pid is None:
        _log(f"{what}: not running")
        return
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while _pid_alive(pidfile, must_contain) == pid and time.monotonic() < deadline:
        time.sleep(0.2)
    if _pid_alive(pidfile, must_contain) == pid:
        os.kill(pid, signal.SIGKILL)
        _log(f"{what}: killed (pid {pid})")
    else:
        _log(f"{what}: stopped (pid {pid})")


def _unmount_leftovers() -> None:
    """Unmount what a stopped dockerd leaves mounted under its folders (its network namespace's
    nsfs mount stays behind), so that ``rm -rf build/docker`` works."""
    roots = tuple(f"{p}/" for p in (DATA_ROOT, EXEC_ROOT))
    with open("/proc/self/mountinfo") as f:
        points = [line.split()[4].encode().decode("unicode_escape") for line in f]
    for point in sorted((p for p in points if p.startswith(roots)), key=len, reverse=True):
        subprocess.run(["umount", "--lazy", point], check=False, capture_output=True, timeout=30)


def stop() -> None:
    """Stop the registry and dockerd (their data and the images stay in build/docker/)."""
    with _lock("registry"):
        _stop_pid(REGISTRY_PIDFILE, str(REGISTRY_DIR), "docker-registry", 10)
    with _lock("dockerd"):
        _stop_pid(PIDFILE, str(DATA_ROOT), "dockerd", 60)
        if not _ping():
            _unmount_leftovers()


def status() -> int:
    up = _ping()
    print(f"dockerd:  {'answers on ' + socket_url() if up else 'not running'}")
    if up:
        print("          " + docker("version", "--format", "server {{.Server.Version}}, API {{.Server.APIVersion}}").stdout.decode().strip())
        print("          " + docker("info", "--format", "{{.Driver}}, cgroup driver {{.CgroupDriver}}").stdout.decode().strip())
    port = _recorded_port()
    print(f"registry: {'answers on 127.0.0.1:' + str(port) if port and _registry_answers(port) else 'not running'}")
    if up:
        print(docker("images", "--filter", "reference=gpulease-*", "--format", "{{.Repository}}:{{.Tag}}  {{.Size}}").stdout.decode().rstrip())
    return 0 if up else 1


def smoke(image: str) -> None:
    """A container of ``image`` on the host's network runs the single-user server's commands."""
    r = docker("run", "--rm", "--network", "host", image, "sh", "-c",
               "jupyterhub-singleuser --version && python -c 'import jupyter_gpulease' && cuda-checkpoint --help >/dev/null && id -un",
               timeout=120)
    _log(f"smoke run of {image}: {r.stdout.decode().split()}")


def setup(build_only: bool = False) -> int:
    times: dict[str, float] = {}
    t0 = time.monotonic()
    if not build_only:
        with _timed("dockerd", times):
            ensure_dockerd()
        with _timed("registry", times):
            _log(f"registry at {ensure_registry()}")
    singleuser = ensure_singleuser_image(times)
    test_image = ensure_test_image(times)
    with _timed("smoke run", times):
        smoke(test_image)
    _log(f"ready in {time.monotonic() - t0:.1f} s: {socket_url()}, {BASE_IMAGE}, {singleuser}, {test_image}")
    return 0


def main(argv: list[str]) -> int:
    cmd = argv[1] if len(argv) > 1 else ""
    if cmd in ("setup", "build", "stop", "status"):
        if cmd != "status":
            reason = skip_reason()
            if reason and cmd != "stop":
                print(f"dockerhost: {reason}", file=sys.stderr)
                return 2
        return {"setup": setup, "build": lambda: setup(build_only=True), "stop": lambda: stop() or 0,
                "status": status}[cmd]()
    print(f"usage: {argv[0]} setup|build|stop|status", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv))
