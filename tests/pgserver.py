"""A real PostgreSQL server for tests: ``initdb`` in a temporary folder, on 127.0.0.1.

Debian's ``postgresql`` package puts ``initdb``/``postgres`` under /usr/lib/postgresql/<v>/bin;
``.ci/run`` installs it. As root the server runs as the ``postgres`` user (PostgreSQL refuses
root). Where PostgreSQL is not installed, :func:`find_postgres` says so: tests skip with that
reason on a developer's machine and fail in CI (``CI`` set), where it must be there.
"""

from __future__ import annotations

import glob
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from hubharness import free_port, wait_for


def find_postgres() -> str | None:
    """The bin folder holding initdb and postgres; None when PostgreSQL is not installed."""
    for d in sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True) + [os.path.dirname(shutil.which("initdb") or "")]:
        if d and os.path.exists(os.path.join(d, "initdb")) and os.path.exists(os.path.join(d, "postgres")):
            return d
    return None


class PostgresServer:
    def __init__(self, base: Path):
        self.bin = find_postgres()
        assert self.bin, "PostgreSQL is not installed (apt-get install postgresql)"
        self.base = Path(base)
        self.data = self.base / "data"
        self.sock = self.base / "sock"
        self.port = free_port()
        self.proc: subprocess.Popen | None = None
        self.run_as = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []

    def _chown(self, path: Path) -> None:
        if self.run_as:
            shutil.chown(path, "postgres", "postgres")

    def start(self) -> PostgresServer:
        self.base.mkdir(parents=True, exist_ok=True)
        self.sock.mkdir(exist_ok=True)
        self.data.mkdir(exist_ok=True)
        for p in (self.base, self.sock, self.data):
            self._chown(p)
        os.chmod(self.base, 0o755)
        subprocess.run([*self.run_as, f"{self.bin}/initdb", "-D", str(self.data), "-U", "postgres", "-A", "trust", "--no-sync", "-E", "UTF8"],
                       check=True, capture_output=True, timeout=120)
        with open(self.base / "postgres.log", "ab") as log:
            self.proc = subprocess.Popen(
                [*self.run_as, f"{self.bin}/postgres", "-D", str(self.data), "-k", str(self.sock), "-p", str(self.port), "-h", "127.0.0.1",
                 "-c", "fsync=on", "-c", "max_connections=200"],
                stdout=log, stderr=subprocess.STDOUT,
            )
        wait_for(self._ready, 60, f"PostgreSQL did not start (log: {self.base / 'postgres.log'})")
        return self

    def _ready(self) -> bool:
        assert self.proc.poll() is None, (self.base / "postgres.log").read_text()
        r = subprocess.run([f"{self.bin}/pg_isready", "-h", "127.0.0.1", "-p", str(self.port)], check=False, capture_output=True, timeout=10)
        return r.returncode == 0

    def create_database(self, name: str) -> str:
        """A fresh database; its SQLAlchemy URL."""
        import psycopg

        with psycopg.connect(f"host=127.0.0.1 port={self.port} user=postgres dbname=postgres", autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)

    def url(self, name: str) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/{name}"

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            # the server runs below runuser: signal the postgres process itself (fast shutdown)
            pid = self._postmaster_pid()
            try:
                os.kill(pid or self.proc.pid, signal.SIGINT)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def _postmaster_pid(self) -> int | None:
        try:
            return int((self.data / "postmaster.pid").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None


def _need_postgres() -> None:
    missing = None
    if find_postgres() is None:
        missing = "PostgreSQL is not installed (apt-get install postgresql)"
    else:
        try:
            import psycopg  # noqa: F401
        except ImportError:
            missing = "the psycopg driver is not installed (pip install 'psycopg[binary]')"
    if missing:
        if os.environ.get("CI"):
            pytest.fail(f"{missing}; .ci/run installs it")
        pytest.skip(missing)


@pytest.fixture(scope="session")
def postgres(tmp_path_factory):
    """One PostgreSQL server for the test session (each test makes its own database)."""
    _need_postgres()
    import tempfile

    # not below pytest's temporary folder: it is private to root, and the server runs as postgres
    base = Path(tempfile.mkdtemp(prefix="gpulease-pg-"))
    server = PostgresServer(base).start()
    yield server
    server.stop()
    shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request, tmp_path):
    """A fresh, empty database: a SQLite file, then a database on the real PostgreSQL server."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'store.sqlite'}"
    import uuid

    return request.getfixturevalue("postgres").create_database(f"t_{uuid.uuid4().hex[:12]}")


def wait_until(predicate, timeout: float, message: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    raise AssertionError(message)
