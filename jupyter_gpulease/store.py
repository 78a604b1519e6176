"""The durable lease store: SQLAlchemy tables for leases and their events.

The broker is the only writer. Every batch of scheduler events is written in ONE
transaction together with the leases they changed (:meth:`LeaseStore.apply`), so after a
crash the store holds either all of a decision or none of it; the event rows are the audit
log and the feed (`GET api/events`), their autoincrement id is the feed's cursor.

SQLite by default (a file, WAL journal, ``synchronous=FULL``: an answered request is on
disk even after a power cut, at the cost of one fsync per commit, a few per second at
most); any SQLAlchemy URL (``postgresql+psycopg://…``) for larger sites.

The store is synchronous. The broker calls it through a single-thread executor so that
commits happen in the order the scheduler made its decisions and never block the event
loop; lease objects are serialised on the caller's thread first (:meth:`snapshot`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import JSON, Float, Integer, String, Text, create_engine, event, func, select
from sqlalchemy.engine import Engine
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, sessionmaker
from sqlalchemy.pool import StaticPool

from .core.events import Event
from .core.model import Lease, LeaseState

log = logging.getLogger(__name__)

LIVE_STATES = (LeaseState.QUEUED.value, LeaseState.ACTIVE.value)


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
    time: Mapped[float] = mapped_column(Float)
    kind: Mapped[str] = mapped_column(String(32))
    from_state: Mapped[str] = mapped_column(String(16), default="")
    to_state: Mapped[str] = mapped_column(String(16), default="")
    actor: Mapped[str] = mapped_column(String(255), default="")
    reason: Mapped[str] = mapped_column(Text, default="")
    data: Mapped[dict] = mapped_column(JSON, default=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "lease_id": self.lease_id,
            "kind": self.kind,
            "time": self.time,
            "from_state": self.from_state,
            "to_state": self.to_state,
            "reason": self.reason,
            "actor": self.actor,
            "data": self.data or {},
        }


# --------------------------------------------------------------------------- the store
@dataclass
class Batch:
    """What one :meth:`LeaseStore.write` commits: plain dicts, safe to hand to another thread."""

    leases: dict[str, dict[str, Any]] = field(default_factory=dict)
    events: list[dict[str, Any]] = field(default_factory=list)


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


class LeaseStore:
    """Leases and their event log in SQL. Synchronous; one writer (the broker)."""

    def __init__(self, db_url: str = "sqlite:///gpulease.sqlite", *, sqlite_synchronous: str = "FULL", echo: bool = False):
        self.db_url = db_url
        kwargs: dict[str, Any] = {"echo": echo, "future": True}
        in_memory = db_url.startswith("sqlite") and (":memory:" in db_url or db_url.rstrip("/") in ("sqlite:", "sqlite:"))
        if db_url.startswith("sqlite"):
            # the broker writes from one executor thread, reads may come from another
            kwargs["connect_args"] = {"check_same_thread": False}
            if in_memory:
                # one shared connection, or every thread would see its own empty database
                kwargs["poolclass"] = StaticPool
        self.engine: Engine = create_engine(db_url, **kwargs)
        if self.engine.dialect.name == "sqlite":
            sync = sqlite_synchronous.upper()
            if sync not in ("OFF", "NORMAL", "FULL", "EXTRA"):
                raise ValueError(f"sqlite_synchronous must be OFF, NORMAL, FULL or EXTRA, got {sqlite_synchronous!r}")

            @event.listens_for(self.engine, "connect")
            def _pragmas(dbapi_conn, _record):
                cur = dbapi_conn.cursor()
                if not in_memory:
                    cur.execute("PRAGMA journal_mode=WAL")
                cur.execute(f"PRAGMA synchronous={sync}")
                cur.execute("PRAGMA busy_timeout=10000")
                cur.close()

        Base.metadata.create_all(self.engine)
        self._session = sessionmaker(self.engine, expire_on_commit=False)

    def close(self) -> None:
        self.engine.dispose()

    # ------------------------------------------------------------------ writing
    @staticmethod
    def snapshot(events: Iterable[Event], leases: Iterable[Lease] = ()) -> Batch:
        """Serialise events and the leases they touched *now* (the caller's thread).

        ``leases`` adds leases that changed without an event (heartbeats). When a lease shows
        up several times, its latest state wins.
        """
        batch = Batch()
        for ev in events:
            d = ev.to_dict()
            batch.events.append(d)
            lease = getattr(ev, "lease", None)
            if lease is not None:
                batch.leases[lease.id] = lease.to_dict()
        for lease in leases:
            batch.leases[lease.id] = lease.to_dict()
        return batch

    def write(self, batch: Batch) -> list[dict[str, Any]]:
        """Upsert the batch's leases and insert its events, in one transaction.

        Returns the event dicts with their new ``id`` (the feed's cursor), in order.
        """
        if not batch.leases and not batch.events:
            return []
        with self._session.begin() as s:
            if batch.leases:
                existing = set(s.scalars(select(LeaseRow.id).where(LeaseRow.id.in_(list(batch.leases)))))
                for lid, d in batch.leases.items():
                    values = _row_values(d)
                    if lid in existing:
                        row = s.get(LeaseRow, lid)
                        for k, v in values.items():
                            setattr(row, k, v)
                    else:
                        s.add(LeaseRow(**values))
            rows = [
                EventRow(
                    lease_id=e["lease_id"],
                    time=e["time"],
                    kind=e["kind"],
                    from_state=e.get("from_state", ""),
                    to_state=e.get("to_state", ""),
                    actor=e.get("actor", ""),
                    reason=e.get("reason", ""),
                    data=e.get("data") or {},
                )
                for e in batch.events
            ]
            s.add_all(rows)
            s.flush()
            return [r.to_dict() for r in rows]

    def apply(self, events: Iterable[Event], leases: Iterable[Lease] = ()) -> list[dict[str, Any]]:
        """:meth:`snapshot` then :meth:`write`, on this thread."""
        return self.write(self.snapshot(events, leases))

    # ------------------------------------------------------------------ reading
    @staticmethod
    def _leases(rows) -> list[Lease]:
        return [Lease.from_dict(r.data) for r in rows]

    def load_live(self) -> list[Lease]:
        """Every queued and active lease, in arrival order (for :meth:`Scheduler.restore`)."""
        with self._session() as s:
            rows = s.scalars(select(LeaseRow).where(LeaseRow.state.in_(LIVE_STATES)).order_by(LeaseRow.seq, LeaseRow.created_at))
            return self._leases(rows)

    def get_lease(self, lease_id: str) -> Lease | None:
        """Any lease, ended ones included; None when unknown."""
        with self._session() as s:
            row = s.get(LeaseRow, lease_id)
            return Lease.from_dict(row.data) if row is not None else None

    def list_leases(self, user: str | None = None, states: Iterable[str] | None = None, *, limit: int | None = None) -> list[Lease]:
        """Leases, newest first, filtered by user and states (values of :class:`LeaseState`)."""
        q = select(LeaseRow)
        if user is not None:
            q = q.where(LeaseRow.user == user)
        if states is not None:
            q = q.where(LeaseRow.state.in_([getattr(st, "value", st) for st in states]))
        q = q.order_by(LeaseRow.created_at.desc(), LeaseRow.seq.desc())
        if limit:
            q = q.limit(limit)
        with self._session() as s:
            return self._leases(s.scalars(q))

    def history(self, since: float, until: float | None = None) -> list[Lease]:
        """Ended leases that held GPUs at some time after ``since`` (usage reconstruction)."""
        q = select(LeaseRow).where(LeaseRow.ended_at.is_not(None), LeaseRow.granted_at.is_not(None), LeaseRow.ended_at >= since)
        if until is not None:
            q = q.where(LeaseRow.granted_at <= until)
        with self._session() as s:
            return self._leases(s.scalars(q.order_by(LeaseRow.granted_at)))

    def events_since(self, since: int = 0, lease_id: str | None = None, limit: int = 1000, *, user: str | None = None) -> list[dict[str, Any]]:
        """Events with id > ``since``, oldest first, at most ``limit``; of one lease, or of one user's leases."""
        q = select(EventRow).where(EventRow.id > since)
        if lease_id is not None:
            q = q.where(EventRow.lease_id == lease_id)
        if user is not None:
            q = q.join(LeaseRow, LeaseRow.id == EventRow.lease_id).where(LeaseRow.user == user)
        with self._session() as s:
            return [r.to_dict() for r in s.scalars(q.order_by(EventRow.id).limit(limit))]

    def last_event_id(self) -> int:
        with self._session() as s:
            return int(s.scalar(select(func.max(EventRow.id))) or 0)

    def count_leases(self) -> int:
        with self._session() as s:
            return int(s.scalar(select(func.count()).select_from(LeaseRow)) or 0)
