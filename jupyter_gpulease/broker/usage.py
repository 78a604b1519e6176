"""Usage records: where the GPU-hours go, per lease and per kernel, and the report over them.

The recorder (:class:`UsageRecorder`) turns what the broker already knows into accounting
records: a grant opens one row per lease (who, which slice, the group the hours count to,
asked duration, queue wait), every heartbeat adds the interval since the last one (GPU-seconds
held; GPU-seconds busy as the server's idle rule counted them, per device and per kernel with
the notebook's path; memory peaks), an end closes the row (reclaims, suspends, preemptions).
It is pure bookkeeping in memory on the event loop; what it produces goes into the same
transaction as the batch of events that caused it (:class:`~jupyter_gpulease.store.UsageBatch`
in the manager's :class:`~jupyter_gpulease.store.Batch`), so a record is durable exactly when
the grant, end or heartbeat behind it is. The simulator feeds the same recorder
(``jupyter gpulease simulate --usage-db``).

GPU-seconds are GPU-equivalents: a whole GPU counts 1 per second, a share its fraction, a MIG
instance its fraction of its GPU (its memory's share, as quotas count it). A lease's busy time
is capped at its held time. Raw samples are pruned after ``sample_retention_days``; the hourly
roll-ups (``usage_hourly``) are kept, and the report reads only them and the lease rows,
aggregating in SQL.

The queries (:func:`report`, :func:`series`, :func:`suggestions`) read any store: the broker's
REST handlers (``broker/usage_handlers.py``), the pages and ``jupyter gpulease report --db``
call them.
"""

from __future__ import annotations

import csv
import fnmatch
import heapq
import io
import math
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import and_, case, func, select
from traitlets import Bool, Dict, Float, Integer, List, Unicode
from traitlets.config import Configurable

from ..core import rightsizing
from ..core.events import ENDED, GRANTED, Event
from ..core.model import MILLI, LeaseState, SliceKind
from ..store import USAGE_DAILY, USAGE_HOURLY, USAGE_LEASES, UsageBatch

HOUR = 3600
DAY = 86400
NO_TEAM = "none"  # the group of a user in no group (the metrics' name for it too)
BY = ("user", "group", "model", "tier", "notebook")
STEPS = {"hour": 3600, "day": 86400}


# --------------------------------------------------------------------------- settings
class GPULeaseUsage(Configurable):
    """Usage records and chargeback: prices, the group hours count to, retention."""

    record = Bool(True, help="""Keep usage records (per lease and kernel, from grants, ends and heartbeats).
        False: nothing is recorded (the report shows nothing new).""").tag(config=True)
    prices = Dict(
        value_trait=Float(min=0.0), key_trait=Unicode(),
        help="""Price of one GPU-hour per GPU model, for the report's cost column. Keys are models or
        shell patterns of them, tried in order (exact names first); a share costs its fraction,
        a MIG instance its fraction of its GPU. A model no key matches costs nothing.
        Example: {"A100-SXM4-80GB": 2.9, "H100*": 4.5, "*": 1.0}.""",
    ).tag(config=True)
    currency = Unicode("", help="Currency of ``prices`` as shown in reports. Example: \"EUR\".").tag(config=True)
    charge_idle = Bool(True, help="""Charge the GPU-hours a lease held while idle (True: cost is held
        GPU-hours × price; False: busy GPU-hours × price).""").tag(config=True)
    group_order = List(
        Unicode(), help="""Which group a user's hours count to when they are in several: the first of
        these groups the user is in. A user in none of them counts to their first group
        (alphabetically), a user in no group to "none". Example: ["physics", "chemistry"].""",
    ).tag(config=True)
    teams = Dict(
        value_trait=Unicode(), key_trait=Unicode(),
        help="""The team each user's hours count to, overriding ``group_order``. Example: {"alice": "physics"}.""",
    ).tag(config=True)
    sample_retention_days = Float(
        7.0, min=0.0, help="""Days raw usage samples are kept; older ones are deleted once an hour. The
        hourly and daily roll-ups (what reports read) are kept for good. 0: keep every sample. Example: 14.""",
    ).tag(config=True)
    sample_interval_s = Float(
        300.0, min=0.0, help="""Seconds of heartbeats one raw usage sample gathers (per lease and per kernel):
        10,000 servers beating every 30 s make some 3,000 samples a minute with 0, 300 with 300. A
        sample is written when the next one begins or the lease ends (a broker that stops meanwhile
        loses the raw sample, never the roll-ups). Example: 60.""",
    ).tag(config=True)
    write_interval_s = Float(
        300.0, min=0.0, help="""Seconds between two writes of what one lease's heartbeats added to its usage
        records (accounting row, roll-ups, counters); each lease on its own schedule, so the writes
        spread like the heartbeats and most heartbeat commits carry no usage rows. Grants and ends
        are written with their own commit. Heartbeats report cumulative figures, so a broker that
        stops in between loses nothing of a lease that goes on: its next heartbeat counts from the
        last written state. Reports see a live lease's figures at most this late. 0: with every
        heartbeat. Example: 60.""",
    ).tag(config=True)
    suggestion_min_leases = Integer(
        3, min=1, help="""Leases of a user or group a right-sizing suggestion needs as evidence. Example: 5.""",
    ).tag(config=True)
    suggestion_days = Float(30.0, min=1.0, help="Days of history right-sizing suggestions look at. Example: 60.").tag(config=True)

    def accounting(self) -> Accounting:
        return Accounting(prices=dict(self.prices), currency=self.currency, charge_idle=self.charge_idle,
                          group_order=tuple(self.group_order), teams=dict(self.teams))


@dataclass(frozen=True)
class Accounting:
    """Prices and the group mapping (plain values: the recorder and the queries use them)."""

    prices: dict[str, float] = field(default_factory=dict)
    currency: str = ""
    charge_idle: bool = True
    group_order: tuple[str, ...] = ()
    teams: dict[str, str] = field(default_factory=dict)

    def team(self, user: str, groups: Iterable[str]) -> str:
        """The group a user's hours count to."""
        if user in self.teams:
            return self.teams[user]
        gs = set(groups)
        for g in self.group_order:
            if g in gs:
                return g
        return min(gs) if gs else NO_TEAM

    def price(self, model: str) -> float:
        """Price of one GPU-hour of ``model`` (0 when none is set)."""
        if model in self.prices:
            return float(self.prices[model])
        for pat, p in self.prices.items():
            if fnmatch.fnmatchcase(model, pat):
                return float(p)
        return 0.0

    def cost(self, model: str, held_gpu_s: float, busy_gpu_s: float) -> float:
        return (held_gpu_s if self.charge_idle else busy_gpu_s) / HOUR * self.price(model)


# --------------------------------------------------------------------------- the recorder
def slice_facts(lease) -> dict[str, Any]:
    """Model, slice and GPU-equivalents of a granted lease (its placement)."""
    req = lease.request
    pl = lease.placement
    slices = pl.slices if pl is not None else ()
    model = slices[0].model if slices else (req.models[0] if req.models else "")
    kind = req.kind.value
    if req.kind is SliceKind.MIG:
        what = req.mig_profile
    elif req.kind is SliceKind.SHARE:
        what = f"{req.share_milli / MILLI:g}"
    else:
        what = str(req.gpus)
    fraction = (pl.gpu_milli if pl is not None else req.gpu_milli) / MILLI
    return {"model": model, "slice_kind": kind, "slice": what, "gpus": max(1, len(slices)), "fraction": fraction,
            "mem_mib": sum(s.memory_mib for s in slices), "weights": _weights(slices)}


def _weights(slices) -> dict[str, float]:
    """GPU-equivalents per device a heartbeat may name (a GPU's or a MIG instance's UUID)."""
    w: dict[str, float] = {}
    for s in slices:
        f = s.share_milli / MILLI
        w[s.gpu_uuid] = w.get(s.gpu_uuid, 0.0) + f
        if s.mig_uuid:
            w[s.mig_uuid] = f
    return w


@dataclass
class _Live:
    """One live lease's record. Held for every live lease (10,000 on a large hub) for hours: what
    it holds is tuples and dicts of plain values where it can, which the garbage collector stops
    tracking, so that its full collections (which stall the event loop) do not walk them all."""

    row: dict[str, Any]
    last_t: float
    weights: dict[str, float]
    dev: dict[str, tuple[float, float]] = field(default_factory=dict)  # cumulative (busy_s, idle_s) last seen
    ker: dict[str, tuple[float, float]] = field(default_factory=dict)
    nb: dict[str, str] = field(default_factory=dict)  # kernel -> notebook path
    suspended: set[str] | None = None  # kernels seen suspended (None: none)
    # raw samples being gathered, per kernel ("" the lease): (notebook, t0, t1, held, busy, mem)
    pending: dict[str, tuple] = field(default_factory=dict)
    # roll-up increments, raw samples and counters not handed over yet (as in a UsageBatch)
    hours: dict[tuple[int, str, str], tuple] = field(default_factory=dict)
    days: dict[tuple[int, str, str, str, str], tuple[float, float]] = field(default_factory=dict)
    totals: dict[tuple[str, tuple[str, ...]], float] = field(default_factory=dict)
    samples: tuple[tuple, ...] = ()
    taken_at: float | None = None  # when this record was last handed over (None: at the next take)

    def suspend(self, kernel: str) -> None:
        if self.suspended is None:
            self.suspended = set()
        self.suspended.add(kernel)


def _hours(t0: float, t1: float):
    """(hour start, seconds of [t0, t1] in that hour) for each hour the interval touches."""
    h = int(t0 // HOUR) * HOUR
    while h < t1:
        part = min(t1, h + HOUR) - max(t0, h)
        if part > 0:
            yield h, part
        h += HOUR


def _num(v: Any) -> float:
    t = type(v)
    if t is float:  # the usual cases first: a heartbeat carries dozens of figures
        return v if math.isfinite(v) else 0.0
    if t is int:
        return float(v)
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else 0.0


class UsageRecorder:
    """Accounting records from grants, heartbeats and ends; :meth:`take` hands over what to write.

    Pure bookkeeping (no I/O): the broker calls it on the event loop before a commit, the
    simulator from its replay loop."""

    def __init__(self, accounting: Accounting | None = None, *, keep_samples: bool = True, per_user_metrics: bool = False,
                 sample_s: float = 300.0, write_s: float = 0.0):
        self.accounting = accounting or Accounting()
        self.write_s = write_s  # a lease's heartbeats are handed over at most this often (grants and ends at once)
        self._dirty: dict[str, _Live] = {}  # live records changed since their last hand-over
        self._due: list[tuple[float, str]] = []  # heap of (when a dirty record is due, lease id)
        self.keep_samples = keep_samples
        self.sample_s = sample_s  # a raw sample gathers the heartbeats of up to this many seconds
        self.per_user_metrics = per_user_metrics
        self.live: dict[str, _Live] = {}
        self._out = UsageBatch()

    # ------------------------------------------------------------------ restart
    def restore(self, rows: Iterable[dict[str, Any]], live: Iterable[str] | None = None) -> list[str]:
        """Go on from the accounting rows of leases that had not ended (a restarted broker).
        Returns the ids of rows whose lease is not ``live`` any more (it ended while nothing was
        recorded): close each with :meth:`close_stale`."""
        rows = list(rows)
        for r in rows:
            st = dict(r.get("state") or {})
            row = {k: v for k, v in r.items()}
            row["groups"], row["state"] = tuple(row.get("groups") or ()), {}  # (the state lives in the record's fields)
            self.live[r["lease_id"]] = _Live(row, float(st.get("last_t", r["granted_at"])), dict(st.get("weights") or {}),
                                             {k: tuple(v) for k, v in (st.get("dev") or {}).items()},
                                             {k: tuple(v) for k, v in (st.get("ker") or {}).items()},
                                             dict(st.get("nb") or {}), set(st.get("susp") or ()) or None)
        if live is None:
            return []
        live = set(live)
        return [r["lease_id"] for r in rows if r["lease_id"] not in live]

    def close_stale(self, lease_id: str, lease=None) -> None:
        """Close the record of a lease that ended unrecorded: at its end when the store knows
        it, else at the record's last heartbeat."""
        lv = self.live.pop(lease_id, None)
        if lv is None:
            return
        end = float(lease.ended_at) if lease is not None and lease.ended_at is not None else lv.last_t
        self._advance(lv, lv.last_t, max(lv.last_t, end), 0.0)
        lv.row["ended_at"] = max(lv.last_t, end)
        lv.row["end_state"] = lease.state.value if lease is not None else "unknown"
        self._emit(lv, final=True)

    # ------------------------------------------------------------------ events
    def observe(self, events: Iterable[Event], touched: Iterable[Any], now: float) -> None:
        """The broker's hook: grants and ends from a batch's events, heartbeats from the leases it touched."""
        seen = set()
        for e in events:
            lease = getattr(e, "lease", None)
            if lease is None:
                continue
            if e.kind == GRANTED:
                self.granted(lease, e.time)
            elif e.kind == ENDED and e.from_state == LeaseState.ACTIVE.value:
                self.ended(lease, e.time)
                seen.add(lease.id)
        for lease in touched:
            if lease.id not in seen and lease.state is LeaseState.ACTIVE and lease.usage:
                self.heartbeat(lease, now)

    def granted(self, lease, now: float) -> None:
        if lease.id in self.live or lease.granted_at is None:
            return
        f = slice_facts(lease)
        granted = float(lease.granted_at)
        row = {
            "lease_id": lease.id, "user": lease.user, "team": self.accounting.team(lease.user, lease.groups), "groups": tuple(sorted(lease.groups)),
            "tier": lease.tier, "model": f["model"], "slice_kind": f["slice_kind"], "slice": f["slice"], "gpus": f["gpus"],
            "fraction": f["fraction"], "mem_mib": f["mem_mib"], "asked_s": float(lease.duration_s), "created_at": float(lease.created_at),
            "granted_at": granted, "ended_at": None, "end_state": LeaseState.ACTIVE.value, "queue_wait_s": max(0.0, granted - float(lease.created_at)),
            "held_s": 0.0, "held_gpu_s": 0.0, "busy_gpu_s": 0.0, "mem_peak_mib": 0, "reclaims": 0, "suspends": 0, "preemptions": 0,
            "devices": {}, "state": {},
        }
        self.live[lease.id] = _Live(row, granted, f["weights"])
        self._emit(self.live[lease.id], urgent=True)

    def heartbeat(self, lease, now: float) -> None:
        """A heartbeat's usage (``lease.usage``: cumulative busy/idle seconds per device and
        kernel since the grant, memory peaks, notebook paths): the interval since the last one."""
        lv = self.live.get(lease.id)
        if lv is None:
            if lease.granted_at is None:
                return
            self.granted(lease, lease.granted_at)
            lv = self.live[lease.id]
        usage = lease.usage if isinstance(lease.usage, dict) else {}
        t0, t1 = lv.last_t, max(lv.last_t, now)
        busy = 0.0
        row = lv.row
        # (on every heartbeat of every server: written for few calls per figure)
        devices = usage.get("devices")
        if isinstance(devices, dict) and devices:
            default_w = row["fraction"] / max(1, row["gpus"])
            seen, weights, row_devices = lv.dev, lv.weights, row["devices"]
            for uuid, d in devices.items():
                if not isinstance(d, dict):
                    continue
                b, i = _num(d.get("busy_s")), _num(d.get("idle_s"))
                base = seen.get(uuid)
                last = base[0] if base is not None else 0.0
                db = b - last if b >= last else b  # a counter that went back: the server started again
                added = (db if db > 0.0 else 0.0) * weights.get(uuid, default_w)
                busy += added
                seen[uuid] = (b, i)
                dv = row_devices.get(uuid)
                if dv is None:
                    dv = row_devices[uuid] = {"busy_gpu_s": 0.0, "mem_peak_mib": 0}
                dv["busy_gpu_s"] += added
                mem = int(_num(d.get("mem_peak_mib")))
                if mem > dv["mem_peak_mib"]:
                    dv["mem_peak_mib"] = mem
                if dv["mem_peak_mib"] > row["mem_peak_mib"]:
                    row["mem_peak_mib"] = dv["mem_peak_mib"]
        kernels = usage.get("kernels")
        kparts = []
        if isinstance(kernels, dict) and kernels:
            fraction, seen, notebooks = row["fraction"], lv.ker, lv.nb
            for raw_kid, k in kernels.items():
                if not isinstance(k, dict):
                    continue
                kid = raw_kid[:64] if type(raw_kid) is str else str(raw_kid)[:64]
                b, i = _num(k.get("busy_s")), _num(k.get("idle_s"))
                base = seen.get(kid)
                last_b, last_i = base if base is not None else (0.0, 0.0)
                db = b - last_b if b >= last_b else b
                di = i - last_i if i >= last_i else i
                seen[kid] = (b, i)
                path = k.get("path") or k.get("notebook")
                if isinstance(path, str) and path:
                    notebooks[kid] = path[:1000]
                if k.get("state") == "suspended":
                    lv.suspend(kid)
                mem = int(_num(k.get("mem_peak_mib")))
                if mem > row["mem_peak_mib"]:
                    row["mem_peak_mib"] = mem
                kparts.append((kid, max(0.0, db + di) * fraction, (db if db > 0.0 else 0.0) * fraction, mem))
        self._advance(lv, t0, t1, busy)
        for kid, held, kbusy, mem in kparts:
            self._add(lv, kid, lv.nb.get(kid, ""), t0, t1, held, kbusy, mem)
        self._emit(lv)

    def busy(self, lease_id: str, t0: float, t1: float, busy_gpu_s: float, *, kernel: str = "", notebook: str = "") -> None:
        """Busy GPU-seconds of a lease over [t0, t1], known directly (the simulator)."""
        lv = self.live.get(lease_id)
        if lv is None or t1 <= t0:
            return
        room = max(0.0, (max(lv.last_t, t1) - lv.row["granted_at"]) * lv.row["fraction"] - lv.row["busy_gpu_s"])
        b = min(busy_gpu_s, room)
        lv.row["busy_gpu_s"] += b
        self._add(lv, "", "", t0, t1, 0.0, b, 0)
        if kernel:
            self._add(lv, kernel, notebook, t0, t1, b, b, 0)
        self._emit(lv)

    def suspended(self, lease_id: str, kernel: str = "kernel") -> None:
        """A kernel of the lease was suspended (the simulator's reclaims that suspend)."""
        lv = self.live.get(lease_id)
        if lv is not None:
            lv.suspend(kernel)

    def ended(self, lease, now: float) -> None:
        lv = self.live.pop(lease.id, None)
        if lv is None:
            if lease.granted_at is None:
                return
            self.granted(lease, lease.granted_at)
            lv = self.live.pop(lease.id)
        end = float(lease.ended_at if lease.ended_at is not None else now)
        self._advance(lv, lv.last_t, max(lv.last_t, end), 0.0)
        row = lv.row
        row["ended_at"] = end
        row["end_state"] = lease.state.value
        row["reclaims"] = int(lease.state is LeaseState.RECLAIMED)
        row["preemptions"] = int(lease.state is LeaseState.PREEMPTED)
        row["suspends"] = len(lv.suspended or ()) or int(lease.state is LeaseState.RECLAIMED and "suspend" in (lease.end_reason or "").lower())
        self._emit(lv, final=True)

    def flush_open(self, now: float) -> None:
        """Count the held time of every lease not ended yet up to ``now`` (a replay's end)."""
        for lv in self.live.values():
            if now > lv.last_t:
                self._advance(lv, lv.last_t, now, 0.0)
            self._flush_samples(lv)
            self._emit(lv)

    def take(self, now: float | None = None) -> UsageBatch | None:
        """What was recorded since the last call (None: nothing). With ``now``, what a lease's
        heartbeats added waits until ``write_s`` passed since that lease's last hand-over (each
        lease on its own schedule, so the writes spread like the heartbeats); a grant or an end
        goes at once. Without ``now`` (the simulator), everything."""
        if now is None:
            due = list(self._dirty)
            self._due.clear()
        else:
            due = []
            while self._due and self._due[0][0] <= now:
                due.append(heapq.heappop(self._due)[1])
        for lid in due:
            lv = self._dirty.pop(lid, None)
            if lv is None:
                continue
            self._merge(lv)
            self._out.leases[lid] = _row_copy(lv)
            lv.taken_at = now
        if not self._out:
            return None
        out, self._out = self._out, UsageBatch()
        return out

    # ------------------------------------------------------------------ internals
    def _advance(self, lv: _Live, t0: float, t1: float, busy: float) -> None:
        row = lv.row
        held = (t1 - t0) * row["fraction"]
        row["held_s"] += t1 - t0
        row["held_gpu_s"] += held
        busy = min(busy, max(0.0, row["held_gpu_s"] - row["busy_gpu_s"]))
        row["busy_gpu_s"] += busy
        lv.last_t = t1
        if t1 > t0 or busy:
            self._add(lv, "", "", t0, t1, held, busy, row["mem_peak_mib"])

    def _add(self, lv: _Live, kernel: str, notebook: str, t0: float, t1: float, held: float, busy: float, mem: int) -> None:
        row = lv.row
        # (tuples replaced rather than lists changed in place: see _Live)
        if self.keep_samples:
            p = lv.pending.get(kernel)
            if p is not None and t1 - p[1] <= self.sample_s:
                lv.pending[kernel] = (notebook or p[0], p[1], max(p[2], t1), p[3] + held, p[4] + busy, max(p[5], mem))
            else:
                if p is not None:
                    lv.samples += ((row["lease_id"], kernel, *p),)
                lv.pending[kernel] = (notebook, t0, t1, held, busy, mem)
        span = t1 - t0
        if span > 0:
            h = int(t0 // HOUR) * HOUR
            parts = ((h, span),) if t1 <= h + HOUR else _hours(t0, t1)  # (most intervals lie in one hour)
        else:
            parts, span = ((int(t0 // HOUR) * HOUR, 1.0),), 1.0
        hours, days = lv.hours, lv.days
        for h, part in parts:
            key = (h, row["lease_id"], kernel)
            v = hours.get(key)
            if v is None:
                hours[key] = (notebook, row["user"], row["team"], row["model"], row["tier"], 0.0 + held * part / span, 0.0 + busy * part / span,
                              max(0, mem))
            else:
                hours[key] = (notebook or v[0], v[1], v[2], v[3], v[4], v[5] + held * part / span, v[6] + busy * part / span, max(v[7], mem))
            if not kernel:
                dkey = (h - h % DAY, row["user"], row["team"], row["model"], row["tier"])
                d = days.get(dkey) or (0.0, 0.0)
                days[dkey] = (d[0] + held * part / span, d[1] + busy * part / span)
        if not kernel and (held or busy):
            t = lv.totals
            labels = (row["team"], row["model"])
            t[("usage_held", labels)] = t.get(("usage_held", labels), 0.0) + held
            t[("usage_busy", labels)] = t.get(("usage_busy", labels), 0.0) + busy
            if self.per_user_metrics:
                ul = (row["team"], row["model"], row["user"])
                t[("usage_user_held", ul)] = t.get(("usage_user_held", ul), 0.0) + held
                t[("usage_user_busy", ul)] = t.get(("usage_user_busy", ul), 0.0) + busy

    def _flush_samples(self, lv: _Live) -> None:
        for kernel, p in lv.pending.items():
            lv.samples += ((lv.row["lease_id"], kernel, *p),)
        lv.pending.clear()

    def _merge(self, lv: _Live) -> None:
        """Hand a record's roll-up increments, samples and counters over to the next write."""
        out = self._out
        out.samples.extend(lv.samples)
        for key, v in lv.hours.items():
            o = out.hours.get(key)
            out.hours[key] = v if o is None else (v[0] or o[0], o[1], o[2], o[3], o[4], o[5] + v[5], o[6] + v[6], max(o[7], v[7]))
        for key, v in lv.days.items():
            o = out.days.get(key) or (0.0, 0.0)
            out.days[key] = (o[0] + v[0], o[1] + v[1])
        for key, v in lv.totals.items():
            out.totals[key] = out.totals.get(key, 0.0) + v
        lv.hours, lv.days, lv.totals, lv.samples = {}, {}, {}, ()

    def _emit(self, lv: _Live, final: bool = False, *, urgent: bool = False) -> None:
        lid = lv.row["lease_id"]
        if not final:
            if urgent:
                lv.taken_at = None
            if lid not in self._dirty or urgent:
                self._dirty[lid] = lv  # copied when taken
                heapq.heappush(self._due, (-math.inf if lv.taken_at is None else lv.taken_at + self.write_s, lid))
            return
        self._flush_samples(lv)
        self._dirty.pop(lid, None)
        self._merge(lv)
        self._out.leases[lid] = _row_copy(lv, final=True)


def _row_copy(lv: _Live, final: bool = False) -> dict[str, Any]:
    """The accounting row as it is now, with the state a restarted broker goes on from (none once
    it ended); a copy: the writer thread serialises it while the loop goes on changing the live row."""
    state = {} if final else {"last_t": lv.last_t, "weights": lv.weights, "dev": lv.dev, "ker": lv.ker, "nb": lv.nb,
                              "susp": sorted(lv.suspended or ())}
    return {**lv.row, "devices": {k: dict(v) for k, v in lv.row["devices"].items()}, "state": _copy_state(state)}


def _copy_state(st: dict[str, Any]) -> dict[str, Any]:
    if not st:
        return {}
    return {"last_t": st["last_t"], "weights": dict(st["weights"]), "dev": {k: list(v) for k, v in st["dev"].items()},
            "ker": {k: list(v) for k, v in st["ker"].items()}, "nb": dict(st["nb"]), "susp": list(st["susp"])}


# --------------------------------------------------------------------------- periods
MAX_TIME = 253402300799.0  # 9999-12-31 23:59:59 UTC
MAX_SPAN_S = 100 * 366 * 86400
_SINCE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(h|d|w)\s*$")


class PeriodError(ValueError):
    """A question the report cannot read; the message says what it wants, ``field`` which part."""

    def __init__(self, message: str, field: str = "since"):
        super().__init__(message)
        self.field = field


def parse_since(text: str) -> float:
    """'30d', '12h', '2w' -> seconds."""
    m = _SINCE.match(text or "")
    if not m:
        raise PeriodError(f"since={text!r}: give a number of hours, days or weeks, like 12h, 30d or 2w")
    seconds = float(m.group(1)) * {"h": 3600, "d": 86400, "w": 7 * 86400}[m.group(2)]
    if not 0 < seconds <= MAX_SPAN_S:
        raise PeriodError(f"since={text!r}: give more than nothing and at most 100 years")
    return seconds


def parse_time(text: str) -> float:
    """An ISO date or time ('2026-11-01', '2026-11-01T08:00', with or without an offset; UTC when
    none) or Unix seconds."""
    import datetime as dt

    t = (text or "").strip()
    try:
        v = float(t)
    except ValueError:
        pass
    else:
        if not (math.isfinite(v) and 0 <= v <= MAX_TIME):
            raise PeriodError(f"{text!r} is not a time between 1970 and 9999", "from")
        return v
    try:
        d = dt.datetime.fromisoformat(t.replace("Z", "+00:00"))
    except ValueError:
        raise PeriodError(f"{text!r} is not a date: give 2026-11-01, 2026-11-01T08:00 or Unix seconds", "from") from None
    if d.tzinfo is None:
        d = d.replace(tzinfo=dt.UTC)
    return min(max(d.timestamp(), 0.0), MAX_TIME)


def period(*, since: str | None = None, start: str | float | None = None, end: str | float | None = None, now: float | None = None) -> tuple[float, float]:
    """[start, end) from ``since`` (relative to now) or ``start``/``end`` (default: the last 30 days)."""
    now = time.time() if now is None else now
    if since and (start is not None or end is not None):
        raise PeriodError("give either since or from/to, not both")
    t1 = now if end in (None, "") else (end if isinstance(end, (int, float)) else _time_of(end, "to"))
    if since:
        t0 = t1 - parse_since(since)
    elif start not in (None, ""):
        t0 = start if isinstance(start, (int, float)) else _time_of(start, "from")
    else:
        t0 = t1 - 30 * 86400
    if t0 >= t1:
        raise PeriodError("the period's start ('from') must come before its end ('to')", "from")
    return float(t0), float(t1)


def _time_of(text: str, field: str) -> float:
    try:
        return parse_time(text)
    except PeriodError as e:
        raise PeriodError(str(e), field) from None


# --------------------------------------------------------------------------- queries
_KEY = {"user": "user", "group": "team", "model": "model", "tier": "tier", "notebook": "notebook"}


def _percentile(sorted_vals: list[float], q: float) -> float | None:
    if not sorted_vals:
        return None
    k = (len(sorted_vals) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return sorted_vals[lo] + (sorted_vals[hi] - sorted_vals[lo]) * (k - lo)


def _hour_floor(t: float) -> int:
    return int(t // HOUR) * HOUR


def _whole_days(lo: int, end: float) -> tuple[int, int]:
    """[d0, d1): the days all of whose hours start in [lo, end) (empty when d1 <= d0)."""
    last_h = math.ceil(end / HOUR) * HOUR - HOUR  # the last hour that starts before end
    d0 = -(-lo // DAY) * DAY
    d1 = (last_h + HOUR) // DAY * DAY
    return d0, max(d0, d1)


def _hours_outside(col, lo: int, end: float, d0: int, d1: int):
    """Hours of [lo, end) outside the whole days [d0, d1)."""
    from sqlalchemy import or_

    if d1 <= d0:
        return and_(col >= lo, col < end)
    return or_(and_(col >= lo, col < d0), and_(col >= d1, col < end))


def report(store, accounting: Accounting, *, start: float, end: float, by: str = "user", user: str | None = None) -> dict[str, Any]:
    """Held, busy and idle GPU-hours, queue waits, reclaims, suspends, preemptions and cost per
    ``by`` key over [start, end), from the hourly roll-ups (hours that start in the period) and
    the lease rows (leases granted in it). ``user``: only that user's leases."""
    if by not in BY:
        raise PeriodError(f"by={by!r}: one of {', '.join(BY)}", "by")
    lo = _hour_floor(start)
    rows: dict[Any, dict[str, Any]] = {}
    total_waits = (None, None)
    with store.engine.connect() as conn:
        for r in (r for q in _usage_queries(by, lo, end, user) for r in conn.execute(q)):
            _add_usage(rows, r, by, accounting)
        if by != "notebook":
            total_waits = _add_lease_figures(conn, store.dialect, rows, by, start, end, user)
    totals = _empty_row("total")
    for r in rows.values():
        totals["_held"] += r["_held"]
        totals["_busy"] += r["_busy"]
        totals["cost"] += r["cost"]
        for k in ("leases", "reclaims", "suspends", "preemptions"):
            totals[k] += r[k]
    out_rows = [_finish(r) for r in rows.values()]
    out_rows.sort(key=lambda r: (-r["held_gpu_h"], str(r["key"])))
    if by != "notebook":
        totals["queue_wait_p50_s"], totals["queue_wait_p95_s"] = total_waits
    return {"period": {"from": start, "to": end, "hours_from": lo}, "by": by, "rows": out_rows, "totals": _finish(totals),
            "currency": accounting.currency, "charge_idle": accounting.charge_idle}


def _usage_queries(by: str, lo: float, end: float, user: str | None) -> list:
    """The roll-up queries of a report: per notebook from the hourly kernel rows; otherwise whole
    days from the daily roll-up and the hours at the period's edges from the hourly one."""
    h = USAGE_HOURLY.c
    key = h.notebook if by == "notebook" else getattr(h, _KEY[by])
    if by == "notebook":
        cond = [h.hour >= lo, h.hour < end, h.kernel != ""] + ([h.user == user] if user is not None else [])
        return [select(key.label("key"), h.user, h.model, func.sum(h.held_gpu_s), func.sum(h.busy_gpu_s), func.count(func.distinct(h.lease_id)))
                .where(and_(*cond)).group_by(key, h.user, h.model)]
    queries = []
    d0, d1 = _whole_days(lo, end)
    d = USAGE_DAILY.c
    dkey = getattr(d, _KEY[by])
    if d1 > d0:
        cond = [d.day >= d0, d.day < d1] + ([d.user == user] if user is not None else [])
        queries.append(select(dkey, d.model, func.sum(d.held_gpu_s), func.sum(d.busy_gpu_s)).where(and_(*cond)).group_by(dkey, d.model))
    cond = [h.kernel == "", _hours_outside(h.hour, lo, end, d0, d1)] + ([h.user == user] if user is not None else [])
    queries.append(select(key, h.model, func.sum(h.held_gpu_s), func.sum(h.busy_gpu_s)).where(and_(*cond)).group_by(key, h.model))
    return queries


def _add_usage(rows: dict[Any, dict[str, Any]], r, by: str, accounting: Accounting) -> None:
    """One roll-up result row added to the report's rows (held, busy, cost; leases per notebook)."""
    if by == "notebook":
        k, u, model, held, busy, n = r
        rk = (u, k)
    else:
        k, model, held, busy = r
        rk = k
    row = rows.get(rk)
    if row is None:
        row = rows[rk] = _empty_row(k if by != "notebook" else (k or "(a kernel without a notebook)"))
        if by == "notebook":
            row["user"] = u
            row["leases"] = 0
    row["_held"] += held or 0.0
    row["_busy"] += busy or 0.0
    row["cost"] += accounting.cost(model, held or 0.0, busy or 0.0)
    if by == "notebook":
        row["leases"] += n


def _add_lease_figures(conn, dialect: str, rows: dict[Any, dict[str, Any]], by: str, start: float, end: float,
                       user: str | None) -> tuple:
    """Lease counts, reclaims, suspends, preemptions and queue-wait percentiles per key, from the
    lease rows granted in [start, end); returns the percentiles over every lease."""
    lcol = getattr(USAGE_LEASES.c, _KEY[by])
    u = USAGE_LEASES.c
    lcond = [u.granted_at >= start, u.granted_at < end] + ([u.user == user] if user is not None else [])
    q2 = select(lcol, func.count(), func.sum(u.reclaims), func.sum(u.suspends), func.sum(u.preemptions)).where(and_(*lcond)).group_by(lcol)
    for k, n, rec, sus, pre in conn.execute(q2):
        row = rows.setdefault(k, _empty_row(k))
        row.update(leases=int(n), reclaims=int(rec or 0), suspends=int(sus or 0), preemptions=int(pre or 0))
    if dialect == "postgresql":  # the percentiles in the database (the same linear interpolation)
        p50, p95 = (func.percentile_cont(q).within_group(u.queue_wait_s) for q in (0.5, 0.95))
        for k, a, b in conn.execute(select(lcol, p50, p95).where(and_(*lcond)).group_by(lcol)):
            rows[k]["queue_wait_p50_s"], rows[k]["queue_wait_p95_s"] = _round(a), _round(b)
        a, b = conn.execute(select(p50, p95).where(and_(*lcond))).one()
        return _round(a), _round(b)
    waits: dict[Any, list[float]] = {}
    everyone: list[float] = []
    for k, w in conn.execute(select(lcol, u.queue_wait_s).where(and_(*lcond)).order_by(lcol, u.queue_wait_s)):
        waits.setdefault(k, []).append(w)
        everyone.append(w)
    for k, ws in waits.items():
        rows[k]["queue_wait_p50_s"] = _round(_percentile(ws, 0.5))
        rows[k]["queue_wait_p95_s"] = _round(_percentile(ws, 0.95))
    everyone.sort()
    return _round(_percentile(everyone, 0.5)), _round(_percentile(everyone, 0.95))

def _empty_row(key) -> dict[str, Any]:
    return {"key": key, "_held": 0.0, "_busy": 0.0, "cost": 0.0, "leases": 0, "reclaims": 0, "suspends": 0, "preemptions": 0,
            "queue_wait_p50_s": None, "queue_wait_p95_s": None}


def _round(v: float | None, n: int = 1) -> float | None:
    return None if v is None else round(v, n)


def _finish(r: dict[str, Any]) -> dict[str, Any]:
    held, busy = r.pop("_held"), r.pop("_busy")
    out = {"key": r["key"]}
    if "user" in r and r["key"] != r.get("user"):
        out["user"] = r["user"]
    out.update({
        "held_gpu_h": round(held / HOUR, 6), "busy_gpu_h": round(busy / HOUR, 6), "idle_gpu_h": round(max(0.0, held - busy) / HOUR, 6),
        "busy_ratio": round(busy / held, 4) if held > 0 else None,
        "queue_wait_p50_s": r["queue_wait_p50_s"], "queue_wait_p95_s": r["queue_wait_p95_s"],
        "reclaims": r["reclaims"], "suspends": r["suspends"], "preemptions": r["preemptions"], "cost": round(r["cost"], 2), "leases": r["leases"],
    })
    return out


COLUMNS = ("key", "held_gpu_h", "busy_gpu_h", "idle_gpu_h", "busy_ratio", "queue_wait_p50_s", "queue_wait_p95_s", "reclaims", "suspends",
           "preemptions", "cost", "leases")


def report_csv(rep: dict[str, Any]) -> str:
    """The report's rows and its total as CSV (the by key's name as the first column)."""
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    notebook = rep["by"] == "notebook"
    head = [rep["by"], *(["user"] if notebook else []), *COLUMNS[1:]]
    w.writerow(head)
    for r in [*rep["rows"], rep["totals"]]:
        w.writerow([r["key"], *([r.get("user", "")] if notebook else []), *("" if r[c] is None else r[c] for c in COLUMNS[1:])])
    return buf.getvalue()


def series(store, *, start: float, end: float, by: str = "group", step: str = "hour", user: str | None = None) -> dict[str, Any]:
    """Held and busy GPU-hours per hour (or day) and per group or model: usage over time."""
    if by not in ("group", "model", "user", "tier"):
        raise PeriodError(f"by={by!r}: one of group, model, user, tier", "by")
    if step not in STEPS:
        raise PeriodError(f"step={step!r}: one of {', '.join(STEPS)}", "step")
    h = USAGE_HOURLY.c
    key = getattr(h, _KEY[by])
    lo = _hour_floor(start)
    size = STEPS[step]
    d0, d1 = _whole_days(lo, end) if size == DAY else (lo, lo)
    queries = []
    if d1 > d0:  # whole days from the daily roll-up
        d = USAGE_DAILY.c
        dkey = getattr(d, _KEY[by])
        cond = [d.day >= d0, d.day < d1] + ([d.user == user] if user is not None else [])
        queries.append(select(d.day, dkey, func.sum(d.held_gpu_s), func.sum(d.busy_gpu_s)).where(and_(*cond)).group_by(d.day, dkey))
    bucket = (h.hour - (h.hour % size)) if size != HOUR else h.hour
    cond = [h.kernel == "", _hours_outside(h.hour, lo, end, d0, d1)] + ([h.user == user] if user is not None else [])
    queries.append(select(bucket.label("t"), key, func.sum(h.held_gpu_s), func.sum(h.busy_gpu_s)).where(and_(*cond)).group_by(bucket, key))
    sums: dict[tuple[int, str], list[float]] = {}
    with store.engine.connect() as conn:
        for q in queries:
            for t, k, held, busy in conn.execute(q):
                v = sums.setdefault((int(t), k), [0.0, 0.0])
                v[0] += held or 0.0
                v[1] += busy or 0.0
    points = [{"t": t, "key": k, "held_gpu_h": round(v[0] / HOUR, 6), "busy_gpu_h": round(v[1] / HOUR, 6)} for (t, k), v in sorted(sums.items())]
    keys = {k for _, k in sums}
    return {"period": {"from": start, "to": end}, "by": by, "step": step, "keys": sorted(keys), "points": points}


def lease_history(store, *, start: float, end: float, user: str | None = None) -> list[dict[str, Any]]:
    """The ended accounting rows of leases granted in [start, end) (right-sizing's evidence)."""
    u = USAGE_LEASES.c
    cond = [u.granted_at >= start, u.granted_at < end, u.ended_at.is_not(None)]
    if user is not None:
        cond.append(u.user == user)
    cols = [u.lease_id, u.user, u.team, u.model, u.slice_kind, u.slice, u.gpus, u.fraction, u.mem_mib, u.asked_s, u.held_s, u.held_gpu_s,
            u.busy_gpu_s, u.mem_peak_mib]
    names = [c.name for c in cols] + ["devices"]
    # per-device figures matter only for leases of several GPUs (the rule on GPUs never busy)
    devices = case((u.gpus > 1, u.devices), else_=None)
    with store.engine.connect() as conn:
        return [dict(zip(names, r)) for r in conn.execute(select(*cols, devices).where(and_(*cond))).all()]


def suggestions(store, offers: list[dict[str, Any]], *, start: float, end: float, user: str | None = None, min_leases: int = 3,
                groups: bool = True) -> list[dict[str, Any]]:
    """Right-sizing suggestions per user (and per group unless ``user`` is given): what they
    asked for against what they used (see :mod:`jupyter_gpulease.core.rightsizing`)."""
    hist = lease_history(store, start=start, end=end, user=user)
    out: list[dict[str, Any]] = []
    by_user: dict[str, list[dict[str, Any]]] = {}
    by_team: dict[str, list[dict[str, Any]]] = {}
    for r in hist:
        by_user.setdefault(r["user"], []).append(r)
        by_team.setdefault(r["team"], []).append(r)
    for name, rows in sorted(by_user.items()):
        for s in rightsizing.suggest(rows, offers, min_leases=min_leases):
            out.append({"user": name, **s})
    if groups and user is None:
        for name, rows in sorted(by_team.items()):
            for s in rightsizing.suggest(rows, offers, min_leases=min_leases):
                out.append({"group": name, **s})
    return out


def offers_of(inventory) -> list[dict[str, Any]]:
    """The cards the pool offers, for suggestions: each MIG profile, and quarter and half
    shares of each model of GPU not in MIG mode."""
    seen: dict[tuple, dict[str, Any]] = {}
    for g in inventory:
        if g.mig:
            for m in g.mig:
                seen.setdefault(("mig", g.model, m.profile), {"kind": "mig", "model": g.model, "mig_profile": m.profile, "memory_mib": m.memory_mib,
                                                                  "fraction": round(m.memory_mib / g.memory_mib, 4)})
        else:
            for share in (0.25, 0.5):
                seen.setdefault(("share", g.model, share), {"kind": "share", "model": g.model, "share": share, "memory_mib": int(g.memory_mib * share),
                                                            "fraction": share})
            seen.setdefault(("gpu", g.model), {"kind": "whole", "model": g.model, "gpus": 1, "memory_mib": g.memory_mib, "fraction": 1.0})
    return list(seen.values())


# --------------------------------------------------------------------------- the Python API
class UsageAPI:
    """The usage report of one store, with the broker's prices and group mapping: what the REST
    handlers, the pages and the CLI call. Synchronous (database reads): call it off the event loop.

    ``start``/``end`` are Unix seconds; ``since`` ('30d') may stand for them."""

    def __init__(self, store, accounting: Accounting | None = None, *, offers=None, clock=time.time, min_leases: int = 3,
                 suggestion_days: float = 30.0):
        self.store = store
        self.accounting = accounting or Accounting()
        self._offers = offers if callable(offers) else (lambda: list(offers or []))
        self.clock = clock
        self.min_leases = min_leases
        self.suggestion_days = suggestion_days

    def _span(self, start, end, since) -> tuple[float, float]:
        if start is None and end is None and not since:
            since = "30d"
        return period(since=since, start=start, end=end, now=self.clock())

    def report(self, *, by: str = "user", start=None, end=None, since: str | None = None, user: str | None = None) -> dict[str, Any]:
        t0, t1 = self._span(start, end, since)
        return report(self.store, self.accounting, start=t0, end=t1, by=by, user=user)

    def csv(self, *, by: str = "user", start=None, end=None, since: str | None = None, user: str | None = None) -> str:
        return report_csv(self.report(by=by, start=start, end=end, since=since, user=user))

    def series(self, *, by: str = "group", start=None, end=None, since: str | None = None, step: str = "hour", user: str | None = None) -> dict[str, Any]:
        t0, t1 = self._span(start, end, since)
        return series(self.store, start=t0, end=t1, by=by, step=step, user=user)

    def suggestions(self, *, user: str | None = None, start=None, end=None, since: str | None = None) -> list[dict[str, Any]]:
        if start is None and end is None and not since:
            since = f"{self.suggestion_days:g}d"
        t0, t1 = self._span(start, end, since)
        return suggestions(self.store, self._offers(), start=t0, end=t1, user=user, min_leases=self.min_leases)
