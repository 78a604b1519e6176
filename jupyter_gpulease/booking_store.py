"""Durable state of bookings (schema 0006): one row per booking, as the scheduler last changed it.

A booking's row is written in the same transaction as the lease changes and events of the
scheduling pass that changed it (:meth:`.store.LeaseStore.write`, ``Batch.bookings``); reads at
start come from the writer's connection (call :func:`load` in the store's writer thread).
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import JSON, Column, Connection, Float, Index, String, Table, Text, delete, insert, select

from .core.bookings import Booking
from .core.model import Slice
from .core.request import Request
from .store import Base, LeaseStore

BOOKINGS = Table(
    "bookings", Base.metadata,
    Column("id", String(32), primary_key=True),
    Column("users", JSON, nullable=False),
    Column("groups", JSON, nullable=False),
    Column("start", Float, nullable=False),
    Column("end", Float, nullable=False, index=True),
    Column("request", JSON, nullable=False),
    Column("slices", JSON, nullable=False),
    Column("state", String(16), nullable=False, index=True),
    Column("reason", Text, nullable=False),
    Column("problem", Text, nullable=False),
    Column("used_at", Float, nullable=True),
    Column("grace_s", Float, nullable=False),
    Column("created_by", String(255), nullable=False),
    Column("created_at", Float, nullable=False),
    Column("title", Text, nullable=False),
    Index("ix_bookings_start", "start"),
)  # fmt: skip

COLS = ("id", "users", "groups", "start", "end", "request", "slices", "state", "reason", "problem", "used_at", "grace_s",
        "created_by", "created_at", "title")


def row_of(b: Booking, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The row of ``b``; ``extra``: who booked it and when (``created_by``, ``created_at``)."""
    d = b.to_dict()
    extra = extra or {}
    return {**{k: d[k] for k in COLS if k in d}, "created_by": str(extra.get("created_by", "")), "created_at": float(extra.get("created_at", 0.0))}


def booking_of(row: dict[str, Any]) -> Booking:
    return Booking(row["id"], float(row["start"]), float(row["end"]), Request.from_dict(row["request"]), users=frozenset(row["users"]),
                   groups=frozenset(row["groups"]), slices=tuple(Slice.from_dict(s) for s in row["slices"]), state=row["state"],
                   reason=row["reason"], problem=row["problem"], used_at=row["used_at"], grace_s=float(row["grace_s"]), title=row["title"])


def write_rows(conn: Connection, rows: list[dict[str, Any]]) -> None:
    """Insert or replace ``rows`` (inside the caller's transaction)."""
    if not rows:
        return
    conn.execute(delete(BOOKINGS).where(BOOKINGS.c.id.in_([r["id"] for r in rows])))
    conn.execute(insert(BOOKINGS), [{k: r[k] for k in COLS} for r in rows])


def load(store: LeaseStore, *, ended_after: float) -> list[dict[str, Any]]:
    """The bookings that have not ended, and those that ended (their time over) after ``ended_after``, soonest first."""
    conn = store._writer_conn() if store.in_memory else store.engine.connect()
    try:
        rows = [dict(r._mapping) for r in conn.execute(select(BOOKINGS).where((BOOKINGS.c.state != "ended") | (BOOKINGS.c.end > ended_after))
                                                       .order_by(BOOKINGS.c.start))]
        if store.in_memory:
            conn.rollback()
    finally:
        if not store.in_memory:
            conn.close()
    return rows


def get(store: LeaseStore, booking_id: str) -> dict[str, Any] | None:
    """One booking's row, from any thread (an ended one no longer held in memory)."""
    conn = store._writer_conn() if store.in_memory else store.engine.connect()
    try:
        r = conn.execute(select(BOOKINGS).where(BOOKINGS.c.id == booking_id)).first()
        if store.in_memory:
            conn.rollback()
        return dict(r._mapping) if r is not None else None
    finally:
        if not store.in_memory:
            conn.close()
