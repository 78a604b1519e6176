"""The durable lease store: SQL tables for leases and their events, migrations, leadership.

The broker is the only writer. A batch of scheduler decisions is written in ONE transaction
together with the leases they changed (:meth:`LeaseStore.write`), so after a crash the store
holds either all of a decision or none of it. The event rows are the audit log and the feed
(`GET api/events`); their autoincrement id is the feed's cursor.

SQLite by default (a file, WAL journal, ``synchronous=FULL``: a commit is on disk even after a
power cut, at one fsync per commit); PostgreSQL (``postgresql+psycopg://…``) for larger sites
and for a hot standby. The schema is versioned with Alembic (``jupyter_gpulease/migrations``);
:meth:`LeaseStore.upgrade` brings any earlier database up to date, including the unversioned
schema of the first releases.

Leadership: of the brokers that share one database, only the holder of the store's lock
writes (:meth:`LeaseStore.acquire_leadership`). PostgreSQL: a session advisory lock, held by
the very connection the writes go through, so a broker that lost its connection (and with it
the lock) can write nothing more. SQLite: an exclusive ``flock`` on ``<database>.lock``,
released by the kernel when the process dies.

A broker waiting for the lock says so (:meth:`LeaseStore.successor_waiting` sees it): a shared
lock that the leader tests without waiting (PostgreSQL: a second, shared advisory lock; SQLite:
a shared ``flock`` on ``<database>.lock.wait``). A broker whose supervisor died serves on until
a broker of the new supervisor waits, then hands over (:mod:`jupyter_gpulease.broker.supervisor`).

The store is synchronous. The broker calls writes from one thread (commits stay in the order
the scheduler decided) and reads from others; it never blocks the event loop on it.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import shutil
import sqlite3
import threading
import time
import zlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy import JSON, Float, Integer, String, Text, create_engine, delete, event, func, insert, inspect, select, text, update
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.pool import StaticPool

from .core.events import ENDED, Event
from .core.model import Lease, LeaseState

log = logging.getLogger(__name__)

LIVE_STATES = (LeaseState.QUEUED.value, LeaseState.ACTIVE.value)
TERMINAL_STATES = tuple(s.value for s in LeaseState if s.terminal)
MIGRATIONS = Path(__file__).resolve().parent / "migrations"
FIRST_REVISION = "0001"  # the schema of the first releases, which had no version table


class StoreError(Exception):
    """The database cannot be used as configured; the message says what to change."""


# --------------------------------------------------------------------------- tables
class Base(DeclarativeBase):
    pass


class LeaseRow(Base):
    __tablename__ = "leases"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    user: Mapped[str] = mapped_column(String(255), index=True)
    server: Mapped[str] = mapped_column(String(255), default="")
    tier: Mapped[str] = mapped_column(String(64))
    state: Mapped[str] = mapped_column(String(16), index=True)
    seq: Mapped[int] = mapped_column(Integer, default=0)
    created_at: Mapped[float] = mapped_column(Float)
    granted_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    expires_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    ended_at: Mapped[float | None] = mapped_column(Float, nullable=True, index=True)
    end_reason: Mapped[str] = mapped_column(Text, default="")
    request: Mapped[dict] = mapped_column(JSON)
    placement: Mapped[dict | None] = mapped_column(JSON, nullable=True)
    data: Mapped[dict] = mapped_column(JSON)  # the whole lease dict: the source of truth on load


class EventRow(Base):
    __tablename__ = "lease_events"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    lease_id: Mapped[str] = mapped_column(String(64), index=True)
    time: Mapped[float] = mapped_column(Float, index=True)
    kind: Mapped[str] = mapped_column(String(32))
    from_state: Mapped[str] = mapped_column(String(16), default="")
    to_state: Mapped[str] = mapped_column(String(16), default="")
    actor: Mapped[str] = mapped_column(String(255), default="")
    reason: Mapped[str] = mapped_column(Text, default="")
    data: Mapped[dict] = mapped_column(JSON, default=dict)
    # the client's idempotency key of the call that caused this event (a retried call finds it)
    request_key: Mapped[str | None] = mapped_column(String(80), nullable=True, index=True)


class MetricTotalRow(Base):
    """The running total of one counter series of the broker's metrics (name and label values),
    written in the same transaction as the events it counts: a broker that takes over (a
    restart, the standby) goes on from these totals instead of from zero."""

    __tablename__ = "metric_totals"

    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    labels: Mapped[str] = mapped_column(String(512), primary_key=True)  # JSON list of the label values
    value: Mapped[float] = mapped_column(Float, default=0.0)
    created: Mapped[float] = mapped_column(Float)  # when the series was first counted (Prometheus' _created)


class UsageLeaseRow(Base):
    """The accounting record of one granted lease (usage records, :mod:`jupyter_gpulease.broker.usage`):
    who, which slice, from when to when, how busy. Updated with every batch that changes it."""

    __tablename__ = "usage_leases"

    lease_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    user: Mapped[str] = mapped_column(String(255), index=True)
    team: Mapped[str] = mapped_column(String(255))  # the group the hours count to
    groups: Mapped[list] = mapped_column(JSON)
    tier: Mapped[str] = mapped_column(String(64))
    model: Mapped[str] = mapped_column(String(128))
    slice_kind: Mapped[str] = mapped_column(String(16))  # gpu | share | mig
    slice: Mapped[str] = mapped_column(String(64))  # "2", "0.25", "1g.10gb"
    gpus: Mapped[int] = mapped_column(Integer)  # devices (slices) held
    fraction: Mapped[float] = mapped_column(Float)  # GPU-equivalents held (a share or MIG slice: its fraction)
    mem_mib: Mapped[int] = mapped_column(Integer)  # memory the slices allow
    asked_s: Mapped[float] = mapped_column(Float)
    created_at: Mapped[float] = mapped_column(Float)
    granted_at: Mapped[float] = mapped_column(Float, index=True)
    ended_at: Mapped[float | None] = mapped_column(Float, nullable=True, index=True)
    end_state: Mapped[str] = mapped_column(String(16))
    queue_wait_s: Mapped[float] = mapped_column(Float)
    held_s: Mapped[float] = mapped_column(Float)
    held_gpu_s: Mapped[float] = mapped_column(Float)
    busy_gpu_s: Mapped[float] = mapped_column(Float)
    mem_peak_mib: Mapped[int] = mapped_column(Integer)
    reclaims: Mapped[int] = mapped_column(Integer)
    suspends: Mapped[int] = mapped_column(Integer)
    preemptions: Mapped[int] = mapped_column(Integer)
    devices: Mapped[dict] = mapped_column(JSON)  # per device: busy GPU-seconds, memory peak
    state: Mapped[dict] = mapped_column(JSON)  # the recorder's baselines (a restarted broker goes on from them)


class UsageSampleRow(Base):
    """A raw usage sample: one interval of one lease (kernel "") or one of its kernels; pruned
    after the admin's retention (the hourly roll-ups stay)."""

    __tablename__ = "usage_samples"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    lease_id: Mapped[str] = mapped_column(String(64), index=True)
    kernel: Mapped[str] = mapped_column(String(64))
    notebook: Mapped[str] = mapped_column(Text)
    t0: Mapped[float] = mapped_column(Float)
    t1: Mapped[float] = mapped_column(Float, index=True)
    held_gpu_s: Mapped[float] = mapped_column(Float)
    busy_gpu_s: Mapped[float] = mapped_column(Float)
    mem_mib: Mapped[int] = mapped_column(Integer)


class UsageHourRow(Base):
    """GPU-seconds held and busy of one lease (kernel "") or kernel in one hour, with the keys a
    report groups by (kept for good). SQLite keeps the rows in key order (hour first)."""

    __tablename__ = "usage_hourly"
    __table_args__ = {"sqlite_with_rowid": False}

    hour: Mapped[int] = mapped_column(Integer, primary_key=True)  # epoch seconds of the hour's start
    lease_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    kernel: Mapped[str] = mapped_column(String(64), primary_key=True)
    notebook: Mapped[str] = mapped_column(Text)
    user: Mapped[str] = mapped_column(String(255))
    team: Mapped[str] = mapped_column(String(255))
    model: Mapped[str] = mapped_column(String(128))
    tier: Mapped[str] = mapped_column(String(64))
    held_gpu_s: Mapped[float] = mapped_column(Float)
    busy_gpu_s: Mapped[float] = mapped_column(Float)
    mem_peak_mib: Mapped[int] = mapped_column(Integer)


class UsageDayRow(Base):
    """GPU-seconds held and busy per day (UTC), user, group, model and tier: what a report over
    whole days reads (kept for good)."""

    __tablename__ = "usage_daily"
    __table_args__ = {"sqlite_with_rowid": False}

    day: Mapped[int] = mapped_column(Integer, primary_key=True)  # epoch seconds of the day's start (UTC)
    user: Mapped[str] = mapped_column(String(255), primary_key=True)
    team: Mapped[str] = mapped_column(String(255), primary_key=True)
    model: Mapped[str] = mapped_column(String(128), primary_key=True)
    tier: Mapped[str] = mapped_column(String(64), primary_key=True)
    held_gpu_s: Mapped[float] = mapped_column(Float)
    busy_gpu_s: Mapped[float] = mapped_column(Float)

LEASES = LeaseRow.__table__
EVENTS = EventRow.__table__
TOTALS = MetricTotalRow.__table__
USAGE_LEASES = UsageLeaseRow.__table__
USAGE_SAMPLES = UsageSampleRow.__table__
USAGE_HOURLY = UsageHourRow.__table__
USAGE_DAILY = UsageDayRow.__table__
# increment the total, keep the first ``created`` (the same statement on SQLite and PostgreSQL)
_TOTALS_UPSERT = text(
    "INSERT INTO metric_totals (name, labels, value, created) VALUES (:name, :labels, :value, :created) "
    "ON CONFLICT (name, labels) DO UPDATE SET value = metric_totals.value + excluded.value"
)
_TOTALS_SQLITE = ("INSERT INTO metric_totals (name, labels, value, created) VALUES {values} "
                  "ON CONFLICT (name, labels) DO UPDATE SET value = metric_totals.value + excluded.value")
EVENT_COLUMNS = (EVENTS.c.id, EVENTS.c.lease_id, EVENTS.c.time, EVENTS.c.kind, EVENTS.c.from_state, EVENTS.c.to_state, EVENTS.c.actor, EVENTS.c.reason, EVENTS.c.data)


def event_dict(row) -> dict[str, Any]:
    return {
        "id": row.id,
        "lease_id": row.lease_id,
        "kind": row.kind,
        "time": row.time,
        "from_state": row.from_state,
        "to_state": row.to_state,
        "reason": row.reason,
        "actor": row.actor,
        "data": row.data or {},
    }


# --------------------------------------------------------------------------- batches
@dataclass
class Batch:
    """What one :meth:`LeaseStore.write` commits: plain dicts, safe to hand to another thread."""

    leases: dict[str, dict[str, Any]] = field(default_factory=dict)
    events: list[dict[str, Any]] = field(default_factory=list)
    # increments of counter totals, (name, label values) -> amount, counted at ``at``
    totals: dict[tuple[str, tuple[str, ...]], float] = field(default_factory=dict)
    at: float = 0.0
    usage: UsageBatch | None = None  # usage records written in the same transaction
    bookings: list[dict[str, Any]] = field(default_factory=list)  # booking rows (booking_store) written with them

    def __bool__(self) -> bool:
        return bool(self.leases or self.events or self.usage or self.bookings)


@dataclass
class UsageBatch:
    """Usage records to write (see :mod:`jupyter_gpulease.broker.usage`): accounting rows of
    leases (whole rows, upserted), raw samples (inserted) and increments of hourly roll-ups."""

    leases: dict[str, dict[str, Any]] = field(default_factory=dict)
    # (lease_id, kernel, notebook, t0, t1, held_gpu_s, busy_gpu_s, mem_mib)
    samples: list[tuple] = field(default_factory=list)
    # (hour, lease_id, kernel) -> [notebook, user, team, model, tier, held_gpu_s, busy_gpu_s, mem_peak_mib]
    hours: dict[tuple[int, str, str], list] = field(default_factory=dict)
    # (day, user, team, model, tier) -> [held_gpu_s, busy_gpu_s]
    days: dict[tuple[int, str, str, str, str], list] = field(default_factory=dict)
    # increments of the metrics' durable counters (the manager adds them to the batch's totals)
    totals: dict[tuple[str, tuple[str, ...]], float] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.leases or self.samples or self.hours)


def _row_values(d: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": d["id"],
        "user": d["user"],
        "server": d.get("server", ""),
        "tier": d["tier"],
        "state": d["state"],
        "seq": int(d.get("seq") or 0),
        "created_at": d["created_at"],
        "granted_at": d.get("granted_at"),
        "expires_at": d.get("expires_at"),
        "ended_at": d.get("ended_at"),
        "end_reason": d.get("end_reason") or "",
        "request": d["request"],
        "placement": d.get("placement"),
        "data": d,
    }


def _event_values(e: dict[str, Any]) -> dict[str, Any]:
    return {
        "lease_id": e["lease_id"],
        "time": e["time"],
        "kind": e["kind"],
        "from_state": e.get("from_state", ""),
        "to_state": e.get("to_state", ""),
        "actor": e.get("actor", ""),
        "reason": e.get("reason", ""),
        "data": e.get("data") or {},
        "request_key": e.get("request_key"),
    }


# SQLite: the columns written by the multi-row statements of LeaseStore._write_sqlite, in order;
# JSON columns are serialised as SQLAlchemy's JSON type does (json.dumps; None is 'null')
_LEASE_COLS = ("id", "user", "server", "tier", "state", "seq", "created_at", "granted_at", "expires_at", "ended_at", "end_reason", "request", "placement", "data")
_EVENT_COLS = ("id", "lease_id", "time", "kind", "from_state", "to_state", "actor", "reason", "data", "request_key")
_USAGE_LEASE_COLS = ("lease_id", "user", "team", "groups", "tier", "model", "slice_kind", "slice", "gpus", "fraction", "mem_mib", "asked_s",
                     "created_at", "granted_at", "ended_at", "end_state", "queue_wait_s", "held_s", "held_gpu_s", "busy_gpu_s", "mem_peak_mib",
                     "reclaims", "suspends", "preemptions", "devices", "state")
_USAGE_JSON = ("groups", "devices", "state")
_USAGE_SAMPLE_COLS = ("lease_id", "kernel", "notebook", "t0", "t1", "held_gpu_s", "busy_gpu_s", "mem_mib")
_USAGE_DAY_COLS = ("day", "user", "team", "model", "tier", "held_gpu_s", "busy_gpu_s")
_USAGE_HOUR_COLS = ("hour", "lease_id", "kernel", "notebook", "user", "team", "model", "tier", "held_gpu_s", "busy_gpu_s", "mem_peak_mib")
# parameters a statement may have: 32,766 since SQLite 3.32, 999 before
_SQLITE_MAX_PARAMS = 32766 if sqlite3.sqlite_version_info >= (3, 32) else 999
_SQLITE_ROWS_LEASES = _SQLITE_MAX_PARAMS // len(_LEASE_COLS)
_SQLITE_ROWS_EVENTS = _SQLITE_MAX_PARAMS // len(_EVENT_COLS)


def _lease_params(d: dict[str, Any]) -> tuple:
    v = _row_values(d)
    return tuple(json.dumps(v[c]) if c in ("request", "placement", "data") else v[c] for c in _LEASE_COLS)


def _event_params(e: dict[str, Any]) -> tuple:
    v = _event_values(e)
    return tuple(json.dumps(v[c]) if c == "data" else v[c] for c in _EVENT_COLS[1:])


def _chunks(rows: list, n: int):
    for i in range(0, len(rows), n):
        yield rows[i : i + n]


def _values_sql(ncols: int, nrows: int) -> str:
    one = "(" + ", ".join("?" * ncols) + ")"
    return ", ".join([one] * nrows)


def _sqlite_upsert_sql(nrows: int) -> str:
    cols = ", ".join(f'"{c}"' for c in _LEASE_COLS)
    updates = ", ".join(f'"{c}" = excluded."{c}"' for c in _LEASE_COLS if c != "id")
    return f"INSERT INTO leases ({cols}) VALUES {_values_sql(len(_LEASE_COLS), nrows)} ON CONFLICT (id) DO UPDATE SET {updates}"


def _sqlite_events_sql(nrows: int) -> str:
    cols = ", ".join(f'"{c}"' for c in _EVENT_COLS)
    return f"INSERT INTO lease_events ({cols}) VALUES {_values_sql(len(_EVENT_COLS), nrows)}"


def _is_in_memory_sqlite(db_url: str) -> bool:
    if not db_url.startswith("sqlite"):
        return False
    rest = db_url.split(":", 1)[1].lstrip("/") if ":" in db_url else ""
    return rest in ("", ":memory:") or ":memory:" in db_url or "mode=memory" in db_url


def _sqlite_path(db_url: str) -> Path | None:
    if not db_url.startswith("sqlite") or _is_in_memory_sqlite(db_url):
        return None
    from sqlalchemy.engine import make_url

    db = make_url(db_url).database
    return Path(db).resolve() if db else None


@functools.cache
def _head_revision() -> str:
    from alembic.config import Config
    from alembic.script import ScriptDirectory

    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    return ScriptDirectory.from_config(cfg).get_current_head()


# --------------------------------------------------------------------------- the store
class LeaseStore:
    """Leases and their event log in SQL. Synchronous; one writer (the broker that leads)."""

    def __init__(self, db_url: str = "sqlite:///gpulease.sqlite", *, sqlite_synchronous: str = "FULL", echo: bool = False, migrate: bool = True):
        self.db_url = db_url
        kwargs: dict[str, Any] = {"echo": echo}
        self.in_memory = _is_in_memory_sqlite(db_url)
        self.sqlite_path = _sqlite_path(db_url)
        if db_url.startswith("sqlite"):
            # the broker writes from one thread and reads from others
            kwargs["connect_args"] = {"check_same_thread": False}
            if self.in_memory:
                # one shared connection, or every thread would see its own empty database
                kwargs["poolclass"] = StaticPool
            if self.sqlite_path is not None and not self.sqlite_path.parent.is_dir():
                raise StoreError(f"db_url {db_url!r}: the folder {self.sqlite_path.parent} does not exist; create it or point db_url elsewhere")
        else:
            kwargs["pool_pre_ping"] = True
        try:
            self.engine: Engine = create_engine(db_url, **kwargs)
        except Exception as e:  # a missing driver, a malformed URL
            raise StoreError(f"db_url {db_url!r} cannot be used: {e}") from None
        self.dialect = self.engine.dialect.name
        if self.dialect == "sqlite":
            sync = sqlite_synchronous.upper()
            if sync not in ("OFF", "NORMAL", "FULL", "EXTRA"):
                raise ValueError(f"sqlite_synchronous must be OFF, NORMAL, FULL or EXTRA, got {sqlite_synchronous!r}")
            in_memory = self.in_memory

            @event.listens_for(self.engine, "connect")
            def _pragmas(dbapi_conn, _record):
                cur = dbapi_conn.cursor()
                if not in_memory:
                    cur.execute("PRAGMA journal_mode=WAL")
                cur.execute(f"PRAGMA synchronous={sync}")
                cur.execute("PRAGMA busy_timeout=10000")
                cur.close()

        self._wconn: Connection | None = None  # the writer's own connection (holds the PostgreSQL lock)
        self._next_event_id: int | None = None  # SQLite: the id of the next event written (the leader's own count)
        self._lock_fd: int | None = None
        self._wait_fd: int | None = None  # SQLite: the shared lock on <database>.lock.wait while waiting
        self._waiting = False  # this store says it waits for the lock
        self._leader = False
        self._lease_upsert = self._make_upsert()
        if migrate:
            self.upgrade()

    def close(self) -> None:
        self.release_leadership()
        if self._wconn is not None:
            try:
                self._wconn.close()
            except Exception:  # closing a broken connection
                pass
            self._wconn = None
        self.engine.dispose()

    # ------------------------------------------------------------------ schema
    def _alembic_config(self, conn: Connection):
        from alembic.config import Config

        cfg = Config()
        cfg.set_main_option("script_location", str(MIGRATIONS))
        cfg.attributes["connection"] = conn
        return cfg

    def schema_revision(self) -> str | None:
        """The database's schema revision; None for an empty database."""
        from alembic.runtime.migration import MigrationContext

        with self.engine.connect() as conn:
            rev = MigrationContext.configure(conn).get_current_revision()
            if rev is None and inspect(conn).has_table(LEASES.name):
                return FIRST_REVISION  # the first releases made tables without a version table
            return rev

    @staticmethod
    def head_revision() -> str:
        """The newest schema revision this package knows (read once per process: a standby
        reads it while it waits, so that taking over does not)."""
        return _head_revision()

    def upgrade(self) -> tuple[str | None, str]:
        """Bring the schema to the newest revision; returns (from, to). A SQLite file that had
        tables is copied to ``<file>.<from>.bak`` first."""
        from alembic import command

        before = self.schema_revision()
        head = self.head_revision()
        if before == head:
            return before, head
        if before is not None and self.sqlite_path is not None and self.sqlite_path.exists():
            backup = self.sqlite_path.with_name(f"{self.sqlite_path.name}.{before}.bak")
            with self.engine.connect() as conn:  # fold the WAL in so the copy is whole
                conn.exec_driver_sql("PRAGMA wal_checkpoint(TRUNCATE)")
            shutil.copy2(self.sqlite_path, backup)
            log.info("Upgrading the lease database from schema %s to %s (copy kept at %s)", before, head, backup)
        with self.engine.begin() as conn:
            cfg = self._alembic_config(conn)
            if before == FIRST_REVISION and self._unversioned(conn):
                command.stamp(cfg, FIRST_REVISION)
            command.upgrade(cfg, "head")
        return before, head

    @staticmethod
    def _unversioned(conn: Connection) -> bool:
        from alembic.runtime.migration import MigrationContext

        return MigrationContext.configure(conn).get_current_revision() is None

    # ------------------------------------------------------------------ leadership
    def _lock_key(self) -> int:
        # one advisory lock id per database name, stable across processes
        return zlib.crc32(f"jupyter-gpulease:{self.engine.url.database}".encode()) & 0x7FFFFFFF

    def _wait_key(self) -> int:
        return self._lock_key() ^ 0x5A5A5A5A  # the waiting brokers' shared lock

    def _mark_waiting(self, waiting: bool) -> None:
        """Hold (or let go of) the shared lock that tells the leader a broker waits to take over."""
        if waiting == self._waiting:
            return
        if self.dialect == "postgresql":
            conn = self._writer_conn()
            fn = "pg_try_advisory_lock_shared" if waiting else "pg_advisory_unlock_shared"
            with conn.begin():
                done = bool(conn.execute(text(f"SELECT {fn}(:k)"), {"k": self._wait_key()}).scalar())
            self._waiting = waiting if done else self._waiting
        elif self.sqlite_path is not None:
            import fcntl

            if waiting:
                if self._wait_fd is None:
                    self._wait_fd = os.open(f"{self.sqlite_path}.lock.wait", os.O_RDWR | os.O_CREAT, 0o600)
                try:  # fails only while the leader tests it (a moment): the next poll tries again
                    fcntl.flock(self._wait_fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                    self._waiting = True
                except BlockingIOError:
                    pass
            elif self._wait_fd is not None:
                os.close(self._wait_fd)  # closing it lets go of the lock
                self._wait_fd = None
                self._waiting = False

    def successor_waiting(self) -> bool:
        """Does another broker wait for this leader's lock? (Asked by a leader whose supervisor
        died: it hands over when one does.)"""
        if not self._leader:
            return False
        if self.dialect == "postgresql":
            conn = self._writer_conn()
            with conn.begin():
                free = bool(conn.execute(text("SELECT pg_try_advisory_lock(:k)"), {"k": self._wait_key()}).scalar())
                if free:
                    conn.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": self._wait_key()})
            return not free
        if self.sqlite_path is None:
            return False
        import fcntl

        fd = os.open(f"{self.sqlite_path}.lock.wait", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        finally:
            os.close(fd)  # and with it the test's lock
        return False

    def try_acquire_leadership(self) -> bool:
        """Take the writer's lock if nobody holds it; True when this store now leads."""
        if self._leader:
            return True
        if self.dialect == "postgresql":
            conn = self._writer_conn()
            with conn.begin():
                got = bool(conn.execute(text("SELECT pg_try_advisory_lock(:k)"), {"k": self._lock_key()}).scalar())
        elif self.sqlite_path is not None:
            import fcntl

            if self._lock_fd is None:
                self._lock_fd = os.open(f"{self.sqlite_path}.lock", os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                got = True
            except BlockingIOError:
                got = False
        else:
            got = True  # an in-memory database belongs to this process alone
        self._leader = got
        self._next_event_id = None  # another leader may have written since: read it again
        if self.dialect == "postgresql" or self.sqlite_path is not None:
            self._mark_waiting(not got)
        return got

    def acquire_leadership(self, stop: threading.Event | None = None, poll_s: float = 0.2, on_wait=None, idle=None) -> bool:
        """Wait until this store leads (True), or ``stop`` is set (False). ``on_wait()`` is called
        once when the lock is held by another broker; ``idle()`` after every try that found it
        held (a standby's reading ahead), on this thread."""
        waited = False
        while not (stop is not None and stop.is_set()):
            if self.try_acquire_leadership():
                return True
            if not waited and on_wait is not None:
                on_wait()
            waited = True
            if idle is not None:
                idle()
            if stop is not None:
                stop.wait(poll_s)
            else:
                time.sleep(poll_s)
        return False

    def check_leadership(self) -> None:
        """Raise when the lock may have been lost (PostgreSQL: the connection that holds it broke)."""
        if self.dialect == "postgresql" and self._leader:
            conn = self._writer_conn()
            with conn.begin():
                conn.execute(text("SELECT 1"))

    def release_leadership(self) -> None:
        if self._waiting:
            try:
                self._mark_waiting(False)
            except Exception:  # the connection is gone, and the lock with it
                self._waiting = False
        if not self._leader:
            return
        self._leader = False
        if self.dialect == "postgresql" and self._wconn is not None:
            try:
                with self._wconn.begin():
                    self._wconn.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": self._lock_key()})
            except Exception:  # the connection is gone, and the lock with it
                pass
        if self._lock_fd is not None:
            import fcntl

            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
            os.close(self._lock_fd)
            self._lock_fd = None

    @property
    def leader(self) -> bool:
        return self._leader

    def describe(self) -> str:
        """The database for log lines, without its password."""
        return self.engine.url.render_as_string(hide_password=True)

    # ------------------------------------------------------------------ writing
    def _writer_conn(self) -> Connection:
        if self._wconn is None:
            self._wconn = self.engine.connect()
            if self.dialect == "postgresql":
                with self._wconn.begin():
                    self._wconn.execute(text("SELECT set_config('application_name', :n, false)"), {"n": f"gpulease-broker pid={os.getpid()}"})
        return self._wconn

    def _make_upsert(self):
        """PostgreSQL's upsert of lease rows (SQLite has its own statements, another dialect none)."""
        if self.dialect != "postgresql":
            return None
        from sqlalchemy.dialects.postgresql import insert as dialect_insert

        cols = [c.name for c in LEASES.columns if c.name != "id"]
        ins = dialect_insert(LEASES)
        return ins.on_conflict_do_update(index_elements=[LEASES.c.id], set_={c: ins.excluded[c] for c in cols})

    @staticmethod
    def snapshot(events: Iterable[Event], leases: Iterable[Lease] = ()) -> Batch:
        """Serialise events and the leases they touched *now* (the caller's thread).

        ``leases`` adds leases that changed without an event (heartbeats). When a lease shows
        up several times, its latest state wins.
        """
        batch = Batch()
        for ev in events:
            batch.events.append(ev.to_dict())
            lease = getattr(ev, "lease", None)
            if lease is not None:
                batch.leases[lease.id] = lease.to_dict()
        for lease in leases:
            batch.leases[lease.id] = lease.to_dict()
        return batch

    def write(self, batch: Batch) -> list[dict[str, Any]]:
        """Upsert the batch's leases and insert its events in ONE transaction (one fsync).

        Returns the event dicts with their new ``id`` (the feed's cursor), in order.
        """
        if not batch:
            return []
        conn = self._writer_conn()
        try:
            with conn.begin():
                if self.dialect == "sqlite":
                    ids = self._write_sqlite(conn, batch)
                else:
                    ids = self._write_sql(conn, batch)
                if batch.totals:
                    self._add_totals(conn, batch)
                if batch.usage:
                    self._write_usage(conn, batch.usage)
                if batch.bookings:
                    from .booking_store import write_rows  # (it builds on this module's tables)

                    write_rows(conn, batch.bookings)
        except Exception:
            self._next_event_id = None  # read it again from the database
            if self.dialect != "postgresql" and self._wconn is not None:
                # a fresh connection next time (a PostgreSQL one holds the lock: keep it, the caller decides)
                self._wconn.close()
                self._wconn = None
            raise
        out = []
        for e, i in zip(batch.events, ids):
            d = {k: v for k, v in e.items() if k != "request_key"}
            d["id"] = i
            d.setdefault("data", {})
            out.append(d)
        return out

    def _write_sql(self, conn: Connection, batch: Batch) -> list[int]:
        """Any other database (PostgreSQL): SQLAlchemy's upsert and a multi-row INSERT … RETURNING."""
        if batch.leases:
            rows = [_row_values(d) for d in batch.leases.values()]
            if self._lease_upsert is not None:
                conn.execute(self._lease_upsert, rows)
            else:  # another dialect: update what exists, insert the rest
                have = set(conn.scalars(select(LEASES.c.id).where(LEASES.c.id.in_(list(batch.leases)))))
                for r in rows:
                    if r["id"] in have:
                        conn.execute(update(LEASES).where(LEASES.c.id == r["id"]).values(**{k: v for k, v in r.items() if k != "id"}))
                    else:
                        conn.execute(insert(LEASES).values(**r))
        if not batch.events:
            return []
        values = [_event_values(e) for e in batch.events]
        return list(conn.scalars(insert(EVENTS).returning(EVENTS.c.id, sort_by_parameter_order=True), values))

    def _write_sqlite(self, conn: Connection, batch: Batch) -> list[int]:
        """SQLite: the batch in a few multi-row statements, values serialised here.

        The sqlite3 module lets go of the GIL around every statement it steps; a statement per
        row (what ``executemany`` does) makes the writer thread wait for the GIL once per row
        while the event loop is busy, which made a commit of a hundred leases last ~70 ms under
        load for ~20 ms of work. Event ids are given here, not by the database: only the
        leader writes, so the next id is the highest one + 1, as SQLite itself would choose.
        """
        for rows in _chunks([_lease_params(d) for d in batch.leases.values()], _SQLITE_ROWS_LEASES):
            conn.exec_driver_sql(_sqlite_upsert_sql(len(rows)), tuple(v for r in rows for v in r))
        if not batch.events:
            return []
        if self._next_event_id is None:
            self._next_event_id = int(conn.exec_driver_sql("SELECT max(id) FROM lease_events").scalar() or 0) + 1
        first = self._next_event_id
        ids = list(range(first, first + len(batch.events)))
        params = [(i, *_event_params(e)) for i, e in zip(ids, batch.events)]
        for rows in _chunks(params, _SQLITE_ROWS_EVENTS):
            conn.exec_driver_sql(_sqlite_events_sql(len(rows)), tuple(v for r in rows for v in r))
        self._next_event_id = first + len(ids)
        return ids

    def _add_totals(self, conn: Connection, batch: Batch) -> None:
        rows = [{"name": name, "labels": json.dumps(list(labels)), "value": float(v), "created": batch.at} for (name, labels), v in batch.totals.items()]
        if self.dialect == "sqlite":  # one multi-row statement (see _write_sqlite)
            for chunk in _chunks(rows, _SQLITE_MAX_PARAMS // 4):
                conn.exec_driver_sql(_TOTALS_SQLITE.format(values=_values_sql(4, len(chunk))),
                                     tuple(v for r in chunk for v in (r["name"], r["labels"], r["value"], r["created"])))
            return
        if self.dialect == "postgresql":
            conn.execute(_TOTALS_UPSERT, rows)
            return
        for r in rows:  # another dialect: update what exists, insert the rest
            key = (TOTALS.c.name == r["name"]) & (TOTALS.c.labels == r["labels"])
            if not conn.execute(update(TOTALS).where(key).values(value=TOTALS.c.value + r["value"])).rowcount:
                conn.execute(insert(TOTALS).values(**r))

    # ------------------------------------------------------------------ usage records
    def write_usage(self, usage: UsageBatch) -> None:
        """Write usage records in their own transaction (the simulator; the broker writes them
        with its event batches)."""
        if not usage:
            return
        conn = self._writer_conn()
        with conn.begin():
            self._write_usage(conn, usage)

    def _write_usage(self, conn: Connection, usage: UsageBatch) -> None:
        pg = self.dialect == "postgresql"
        if usage.leases:
            cols = _USAGE_LEASE_COLS
            rows = [tuple(json.dumps(r[c]) if c in _USAGE_JSON else r[c] for c in cols) for r in usage.leases.values()]
            self._multi_insert(conn, "usage_leases", cols, rows, conflict=("lease_id",), update={c: f'excluded."{c}"' for c in cols if c != "lease_id"})
        if usage.samples:
            self._multi_insert(conn, "usage_samples", _USAGE_SAMPLE_COLS, usage.samples)
        if usage.hours:
            rows = [(h, lid, k, *v) for (h, lid, k), v in usage.hours.items()]
            greatest = "GREATEST" if pg else "max"
            self._multi_insert(conn, "usage_hourly", _USAGE_HOUR_COLS, rows, conflict=("hour", "lease_id", "kernel"), update={
                "notebook": "excluded.notebook",
                "held_gpu_s": "usage_hourly.held_gpu_s + excluded.held_gpu_s",
                "busy_gpu_s": "usage_hourly.busy_gpu_s + excluded.busy_gpu_s",
                "mem_peak_mib": f"{greatest}(usage_hourly.mem_peak_mib, excluded.mem_peak_mib)",
            })
        if usage.days:
            rows = [(*k, *v) for k, v in usage.days.items()]
            self._multi_insert(conn, "usage_daily", _USAGE_DAY_COLS, rows, conflict=("day", '"user"', "team", "model", "tier"), update={
                "held_gpu_s": "usage_daily.held_gpu_s + excluded.held_gpu_s",
                "busy_gpu_s": "usage_daily.busy_gpu_s + excluded.busy_gpu_s",
            })

    def _multi_insert(self, conn: Connection, table: str, cols: tuple[str, ...], rows: list[tuple], *, conflict: tuple[str, ...] = (),
                      update: dict[str, str] | None = None) -> None:
        """INSERT … ON CONFLICT … DO UPDATE of many rows: on SQLite a few multi-row statements per
        batch instead of one per row (see :meth:`_write_sqlite`); on PostgreSQL one statement
        executed for every row (psycopg sends them in one pipeline)."""
        names = ", ".join(f'"{c}"' for c in cols)
        tail = ""
        if conflict:
            sets = ", ".join(f'"{c}" = {v}' for c, v in (update or {}).items())
            tail = f" ON CONFLICT ({', '.join(conflict)}) DO UPDATE SET {sets}"
        if self.dialect != "sqlite":  # one statement, many rows: psycopg pipelines them (a statement of many rows is slow to prepare)
            conn.exec_driver_sql(f"INSERT INTO {table} ({names}) VALUES ({', '.join(['%s'] * len(cols))}){tail}", list(rows))
            return
        per = max(1, _SQLITE_MAX_PARAMS // len(cols))
        one = "(" + ", ".join(["?"] * len(cols)) + ")"
        for chunk in _chunks(rows, per):
            conn.exec_driver_sql(f"INSERT INTO {table} ({names}) VALUES {', '.join([one] * len(chunk))}{tail}", tuple(v for r in chunk for v in r))

    def load_live_usage(self) -> list[dict[str, Any]]:
        """The accounting rows of leases not ended yet (a restarted broker's recorder goes on from them)."""
        with self.engine.connect() as conn:
            rows = conn.execute(select(USAGE_LEASES).where(USAGE_LEASES.c.ended_at.is_(None))).mappings().all()
        return [dict(r) for r in rows]

    def prune_usage_samples(self, before: float, limit: int = 20000) -> int:
        """Delete at most ``limit`` raw usage samples that ended before ``before`` (the hourly
        roll-ups stay); the number deleted."""
        conn = self._writer_conn()
        with conn.begin():
            ids = list(conn.scalars(select(USAGE_SAMPLES.c.id).where(USAGE_SAMPLES.c.t1 < before).order_by(USAGE_SAMPLES.c.id).limit(limit)))
            if ids:
                conn.execute(delete(USAGE_SAMPLES).where(USAGE_SAMPLES.c.id.in_(ids)))
        return len(ids)

    def load_totals(self) -> dict[tuple[str, tuple[str, ...]], list[float]]:
        """Every counter total: (name, label values) -> [value, created]."""
        with self.engine.connect() as conn:
            rows = conn.execute(select(TOTALS.c.name, TOTALS.c.labels, TOTALS.c.value, TOTALS.c.created)).all()
        return {(r.name, tuple(json.loads(r.labels))): [float(r.value), float(r.created)] for r in rows}

    def apply(self, events: Iterable[Event], leases: Iterable[Lease] = ()) -> list[dict[str, Any]]:
        """:meth:`snapshot` then :meth:`write`, on this thread."""
        return self.write(self.snapshot(events, leases))

    def prune_events(self, before: float, limit: int = 5000) -> int:
        """Delete at most ``limit`` events older than ``before`` of leases that have ended; the
        number deleted. Lease rows stay (usage reports read them).

        The newest event always stays, however old: its id is the feed's high-water mark. The
        next event's id is the highest on disk + 1 (SQLite), and a feed client's cursor
        (``since``, ``Last-Event-ID``) must never see ids again that it has already passed."""
        live = select(LEASES.c.id).where(LEASES.c.state.in_(LIVE_STATES))
        newest = select(func.max(EVENTS.c.id)).scalar_subquery()
        conn = self._writer_conn()
        with conn.begin():
            ids = list(conn.scalars(select(EVENTS.c.id).where(EVENTS.c.time < before, EVENTS.c.lease_id.not_in(live), EVENTS.c.id < newest)
                                    .order_by(EVENTS.c.id).limit(limit)))
            if ids:
                conn.execute(delete(EVENTS).where(EVENTS.c.id.in_(ids)))
        return len(ids)

    # ------------------------------------------------------------------ reading
    def load_live(self) -> list[Lease]:
        """Every queued and active lease, in arrival order (for :meth:`Scheduler.restore`)."""
        with self.engine.connect() as conn:
            rows = conn.scalars(select(LEASES.c.data).where(LEASES.c.state.in_(LIVE_STATES)).order_by(LEASES.c.seq, LEASES.c.created_at))
            return [Lease.from_dict(d) for d in rows]

    def get_lease_dict(self, lease_id: str) -> dict[str, Any] | None:
        with self.engine.connect() as conn:
            return conn.scalar(select(LEASES.c.data).where(LEASES.c.id == lease_id))

    def get_lease(self, lease_id: str) -> Lease | None:
        """Any lease, ended ones included; None when unknown."""
        d = self.get_lease_dict(lease_id)
        return Lease.from_dict(d) if d is not None else None

    def list_lease_dicts(self, user: str | None = None, states: Iterable[str] | None = None, *, limit: int | None = None,
                         before: tuple[float, int, str] | None = None) -> list[dict[str, Any]]:
        """Lease dicts, newest first (by creation, arrival, id), filtered by user and states
        (values of :class:`LeaseState`); ``before``: only those after this (created_at, seq, id)
        in that order (the next page of a list)."""
        q = select(LEASES.c.data)
        if user is not None:
            q = q.where(LEASES.c.user == user)
        if states is not None:
            q = q.where(LEASES.c.state.in_([getattr(st, "value", st) for st in states]))
        if before is not None:
            c, s, i = LEASES.c.created_at, LEASES.c.seq, LEASES.c.id
            at, seq, lid = before
            q = q.where((c < at) | ((c == at) & ((s < seq) | ((s == seq) & (i < lid)))))
        q = q.order_by(LEASES.c.created_at.desc(), LEASES.c.seq.desc(), LEASES.c.id.desc())
        if limit:
            q = q.limit(limit)
        with self.engine.connect() as conn:
            return list(conn.scalars(q))

    def list_leases(self, user: str | None = None, states: Iterable[str] | None = None, *, limit: int | None = None) -> list[Lease]:
        return [Lease.from_dict(d) for d in self.list_lease_dicts(user, states, limit=limit)]

    def history(self, since: float, until: float | None = None) -> list[Lease]:
        """Ended leases that held GPUs at some time after ``since`` (usage reconstruction)."""
        q = select(LEASES.c.data).where(LEASES.c.ended_at.is_not(None), LEASES.c.granted_at.is_not(None), LEASES.c.ended_at >= since)
        if until is not None:
            q = q.where(LEASES.c.granted_at <= until)
        with self.engine.connect() as conn:
            return [Lease.from_dict(d) for d in conn.scalars(q.order_by(LEASES.c.granted_at))]

    # what a broker that takes over needs of a lease that ended (broker/past.py): columns, and two
    # values read out of the lease's JSON, instead of the whole JSON decoded (five times faster)
    _PAST = (LEASES.c.id, LEASES.c.user, LEASES.c.server, LEASES.c.state, LEASES.c.created_at, LEASES.c.granted_at, LEASES.c.ended_at,
             LEASES.c.request, LEASES.c.placement, LEASES.c.data["groups"].label("groups"), LEASES.c.data["meta"]["health"].label("health"))

    def past_rows(self, since: float) -> list[dict[str, Any]]:
        """What :meth:`history` reads, as plain rows (id, user, server, state, created_at,
        granted_at, ended_at, request, placement, groups, and the lease's ``meta.health``)."""
        q = select(*self._PAST).where(LEASES.c.ended_at.is_not(None), LEASES.c.granted_at.is_not(None), LEASES.c.ended_at >= since)
        with self.engine.connect() as conn:
            return [dict(r) for r in conn.execute(q).mappings()]

    def ended_after(self, event_id: int) -> tuple[int, list[dict[str, Any]]]:
        """The newest event id, and (as :meth:`past_rows`) the leases whose end is an event after
        ``event_id`` and up to it: a standby reading only what ended since its last read (event
        ids grow in commit order, one broker writing at a time)."""
        with self.engine.connect() as conn:
            top = int(conn.scalar(select(func.max(EVENTS.c.id))) or 0)
            if top <= event_id:
                return top, []
            ended = select(EVENTS.c.lease_id).where(EVENTS.c.id > event_id, EVENTS.c.id <= top, EVENTS.c.kind == ENDED)
            q = select(*self._PAST).where(LEASES.c.id.in_(ended), LEASES.c.granted_at.is_not(None), LEASES.c.ended_at.is_not(None))
            return top, [dict(r) for r in conn.execute(q).mappings()]

    def events_since(self, since: int = 0, lease_id: str | None = None, limit: int = 1000, *, user: str | None = None) -> list[dict[str, Any]]:
        """Events with id > ``since``, oldest first, at most ``limit``; of one lease, or of one user's leases."""
        q = select(*EVENT_COLUMNS).where(EVENTS.c.id > since)
        if lease_id is not None:
            q = q.where(EVENTS.c.lease_id == lease_id)
        if user is not None:
            q = q.join(LEASES, LEASES.c.id == EVENTS.c.lease_id).where(LEASES.c.user == user)
        with self.engine.connect() as conn:
            return [event_dict(r) for r in conn.execute(q.order_by(EVENTS.c.id).limit(limit))]

    def find_request_key(self, key: str) -> str | None:
        """The lease an earlier call with this idempotency key changed; None if none did."""
        with self.engine.connect() as conn:
            return conn.scalar(select(EVENTS.c.lease_id).where(EVENTS.c.request_key == key).limit(1))

    def last_event_id(self) -> int:
        with self.engine.connect() as conn:
            return int(conn.scalar(select(func.max(EVENTS.c.id))) or 0)

    def count_leases(self) -> int:
        with self.engine.connect() as conn:
            return int(conn.scalar(select(func.count()).select_from(LEASES)) or 0)

    def count_events(self) -> int:
        with self.engine.connect() as conn:
            return int(conn.scalar(select(func.count()).select_from(EVENTS)) or 0)
