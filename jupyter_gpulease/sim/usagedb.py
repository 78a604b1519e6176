"""``jupyter gpulease simulate --usage-db FILE``: the replay's usage records, written by the
broker's own recorder (:class:`jupyter_gpulease.broker.usage.UsageRecorder`) into a store at
that SQLite path, so that ``jupyter gpulease report --db sqlite:///FILE`` reads a replay as it
reads a broker.

The replay's grants and ends reach the recorder as the broker's do (the scheduler's events);
its busy time comes from the replay's own busy intervals (a session's bursts, a pod's work).
The user of a record is the trace's job (the traces name no people), in no group ("none"); an
idle reclaim that suspends the session's kernel counts as a suspend.
"""

from __future__ import annotations

import os
from typing import Any

from ..core import events as ev
from ..core.model import MILLI

FLUSH_EVERY = 20000  # hourly rows and samples kept in memory before they are written


class UsageDB:
    """Feeds one replay to a recorder and writes its records to the store at ``path``."""

    def __init__(self, path: str, *, keep_samples: bool = False):
        from ..broker.usage import Accounting, UsageRecorder
        from ..store import LeaseStore

        path = os.path.abspath(path)
        self.store = LeaseStore(f"sqlite:///{path}", sqlite_synchronous="OFF")
        self.recorder = UsageRecorder(Accounting(), keep_samples=keep_samples)
        self.replay = None
        self.pending = 0

    # the replay's hooks
    def on_event(self, e: ev.Event) -> None:
        lease = e.lease
        if lease is None:
            return
        if e.kind == ev.GRANTED:
            self.recorder.granted(lease, e.time)
        elif e.kind == ev.ENDED and e.from_state == "active":
            rec = self.replay.by_lease.get(e.lease_id) if self.replay is not None else None
            if rec is not None and rec.lease_id == e.lease_id and rec.busy_since is not None:
                self._busy(e.lease_id, rec.busy_since, e.time, rec.busy_milli)  # the burst the end cuts short
            if rec is not None and e.to_state == "reclaimed" and rec.kernel_after_reclaim == "suspended":
                self.recorder.suspended(e.lease_id)
            self.recorder.ended(lease, e.time)
            self._maybe_flush()

    def on_busy(self, rec, t0: float, t1: float) -> None:
        """A busy interval of ``rec`` closed (the replay's ``_set_busy``)."""
        if rec.lease_id is not None and rec.active:
            self._busy(rec.lease_id, t0, t1, rec.busy_milli)

    def _busy(self, lease_id: str, t0: float, t1: float, milli: int) -> None:
        self.recorder.busy(lease_id, t0, t1, (t1 - t0) * milli / MILLI)

    def _maybe_flush(self) -> None:
        self.pending += 1
        if self.pending >= FLUSH_EVERY:
            self.flush()

    def flush(self) -> None:
        batch = self.recorder.take()
        if batch is not None:
            self.store.write_usage(batch)
        self.pending = 0

    def finish(self, result) -> dict[str, Any]:
        """Close the books at the replay's end as the replay does (leases still held count up to its end)."""
        for rec in result.records:
            if rec.active and rec.lease_id is not None and rec.busy_since is not None:
                self._busy(rec.lease_id, rec.busy_since, result.end_time, rec.busy_milli)
        self.recorder.flush_open(result.end_time)
        self.flush()
        n = self.store.engine.connect().exec_driver_sql("SELECT count(*) FROM usage_leases").scalar()
        self.store.close()
        return {"usage_db": self.store.sqlite_path and str(self.store.sqlite_path), "leases": int(n or 0)}
