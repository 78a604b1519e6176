"""Durable state of GPU health and maintenance (schema 0005): cordons and maintenance windows.

Small tables written rarely (an admin's action, a device that turned sick or came back), each
change in its own transaction on the store's writer connection (the leader's): call these from
the store's writer thread (``LeaseManager.in_writer``); reads may come from any thread.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import JSON, Boolean, Column, Float, String, Table, Text, delete, insert, select

from .store import Base, LeaseStore

CORDONS = Table(
    "device_cordons", Base.metadata,
    Column("target", String(300), primary_key=True),
    Column("mode", String(32), nullable=False),
    Column("source", String(16), nullable=False),
    Column("reason", Text, nullable=False),
    Column("actor", String(255), nullable=False),
    Column("since", Float, nullable=False),
    Column("hold", Boolean, nullable=False),
    Column("data", JSON, nullable=False),
)  # fmt: skip

WINDOWS = Table(
    "maintenance_windows", Base.metadata,
    Column("id", String(32), primary_key=True),
    Column("start", Float, nullable=False, index=True),
    Column("end", Float, nullable=False),
    Column("reason", Text, nullable=False),
    Column("devices", JSON, nullable=False),
    Column("nodes", JSON, nullable=False),
    Column("actor", String(255), nullable=False),
    Column("created_at", Float, nullable=False),
)  # fmt: skip

_CORDON_COLS = ("target", "mode", "source", "reason", "actor", "since", "hold", "data")
_WINDOW_COLS = ("id", "start", "end", "reason", "devices", "nodes", "actor", "created_at")


def _write(store: LeaseStore, *statements) -> None:
    conn = store._writer_conn()
    with conn.begin():
        for stmt in statements:
            conn.execute(stmt)


def save_cordon(store: LeaseStore, row: dict[str, Any]) -> None:
    """Insert or replace the cordon of ``row['target']``."""
    values = {k: row[k] for k in _CORDON_COLS}
    _write(store, delete(CORDONS).where(CORDONS.c.target == values["target"]), insert(CORDONS).values(**values))


def delete_cordon(store: LeaseStore, target: str) -> None:
    _write(store, delete(CORDONS).where(CORDONS.c.target == target))


def save_window(store: LeaseStore, row: dict[str, Any]) -> None:
    values = {k: row[k] for k in _WINDOW_COLS}
    _write(store, delete(WINDOWS).where(WINDOWS.c.id == values["id"]), insert(WINDOWS).values(**values))


def delete_window(store: LeaseStore, window_id: str) -> None:
    _write(store, delete(WINDOWS).where(WINDOWS.c.id == window_id))


def prune_windows(store: LeaseStore, ended_before: float) -> None:
    _write(store, delete(WINDOWS).where(WINDOWS.c.end < ended_before))


def load(store: LeaseStore) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(cordons, maintenance windows) as stored."""
    conn = store._writer_conn() if store.in_memory else store.engine.connect()
    try:
        cordons = [dict(r._mapping) for r in conn.execute(select(CORDONS))]
        windows = [dict(r._mapping) for r in conn.execute(select(WINDOWS).order_by(WINDOWS.c.start))]
        if store.in_memory:
            conn.rollback()
    finally:
        if not store.in_memory:
            conn.close()
    return cordons, windows
