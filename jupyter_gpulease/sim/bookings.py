"""Bookings in a replay: GPUs reserved ahead for an owner of the trace's requests.

Two sources, both turned into :class:`BookingSpec` rows:

- a CSV file (``--bookings``) with the header ``owner,start_s,end_s,request``: ``owner`` is the
  user the replay gives its requests (a notebook session's ``session-<job_id>``, an Alibaba
  pod's name), ``start_s``/``end_s`` seconds on the replay's clock, ``request`` what
  ``%gpu request`` takes: its options (``--gpus 2 --model A100``, ``--share 0.25``,
  ``--mig 3g.40gb``) or the short form ``COUNT [MODEL]`` (``2 A100``; a count below 1 is a share
  of one GPU, ``0.25 A100``), read by the magic's own parser (:mod:`~jupyter_gpulease.kernel.args`)
  and checked by :func:`~jupyter_gpulease.core.request.parse_request`;
- a draw (``--book-fraction F --book-ahead S``): the first request of a seeded random fraction of
  the owners, booked ``S`` seconds before it arrives, for the shape it asks and the time it holds
  on the trace (a pod: its held time; a session: until its last burst ends plus the linger).

The replay places each booking with :meth:`Scheduler.place_booking` at its creation time on its
clock (a CSV booking: at the replay's first arrival, or at its start where that is earlier); the
scheduler then keeps others off the booked GPUs and grants its owner's requests there first.
"""

from __future__ import annotations

import csv
import io
import random
from dataclasses import dataclass
from typing import Any

from ..core.model import LeaseError
from ..core.request import Request, parse_request
from .workload import Job, Workload

HEADER = ("owner", "start_s", "end_s", "request")
# a booking "starts on time" when its owner's request is granted in it within this many seconds of
# the booking's start (or of the request, where the owner asks later than the start): the replay
# grants in the same tick where nothing is in the way, so 0 s is expected; 60 s leaves room for
# a tick that falls a little later and stays far below the 10-minute waits the reports count
ON_TIME_S = 60.0


class BookingsError(ValueError):
    """A bookings file that cannot be read: names the file and the line."""

    def __init__(self, path: str, message: str, line: int | None = None):
        self.path, self.line = path, line
        where = f"{path}, line {line}" if line is not None else path
        super().__init__(f"--bookings {where}: {message}")


@dataclass(frozen=True)
class BookingSpec:
    """One booking to make during a replay."""

    owner: str
    start: float
    end: float
    request: Request | None  # None: the shape of the owner's first request under the replayed policy
    created: float | None = None  # when it is made on the replay's clock (None: at the replay's start)
    text: str = ""  # the request as written (CSV) or described (draw)
    line: int = 0  # CSV line (0: drawn)

    def to_dict(self) -> dict[str, Any]:
        return {"owner": self.owner, "start_s": self.start, "end_s": self.end, "request": self.text,
                "created_s": self.created, "line": self.line}


def parse_booking_request(text: str) -> Request:
    """A request as ``%gpu request`` takes it (its options, or ``COUNT [MODEL]``); ValueError with the reason."""
    from ..kernel.args import UsageError, parse

    words = text.split()
    if not words:
        raise ValueError("the request is empty (e.g. '2 A100', '0.25 A100' or '--gpus 1')")
    if not words[0].startswith("-"):
        if len(words) > 2:
            raise ValueError(f"expected COUNT [MODEL] (e.g. '2 A100' or '0.25 A100') or %gpu request options, got {text!r}")
        try:
            n = float(words[0])
        except ValueError:
            raise ValueError(f"{words[0]!r} is not a number of GPUs (e.g. '2 A100', '0.25 A100')") from None
        flags = ["--gpus", f"{int(n)}"] if n >= 1 and n == int(n) else ["--share", words[0]]
        if n >= 1 and n != int(n):
            raise ValueError(f"{words[0]} GPUs: a count of whole GPUs, or a share below 1 of one GPU")
        words = flags + (["--model", words[1]] if len(words) == 2 else [])
    try:
        cmd = parse("request " + " ".join(words))
    except UsageError as e:
        raise ValueError(e.message) from None
    body = {k: v for k, v in cmd.request.items() if k not in ("tier", "duration_s")}
    if len(body) != len(cmd.request):
        raise ValueError("--tier and --for have no place in a booking (its window is start_s..end_s)")
    try:
        return parse_request(body)
    except LeaseError as e:
        raise ValueError(e.message) from None


def load_bookings_csv(path: str) -> list[BookingSpec]:
    """The bookings of a CSV file (``owner,start_s,end_s,request``); :class:`BookingsError` names the line at fault."""
    try:
        with open(path, encoding="utf-8", newline="") as f:
            text = f.read()
    except OSError as e:
        raise BookingsError(path, f"cannot read: {e.strerror or e}") from None
    return parse_bookings_csv(text, path)


def parse_bookings_csv(text: str, path: str = "<bookings>") -> list[BookingSpec]:
    rows = csv.reader(io.StringIO(text))
    header = next(rows, None)
    if header is None or tuple(h.strip() for h in header) != HEADER:
        raise BookingsError(path, f"the header must be {','.join(HEADER)}, got {','.join(header or []) or 'nothing'}", line=1)
    out: list[BookingSpec] = []
    for row in rows:
        line = rows.line_num
        if not row or all(not c.strip() for c in row):
            continue
        if len(row) != len(HEADER):
            raise BookingsError(path, f"expected {len(HEADER)} fields ({','.join(HEADER)}), got {len(row)}", line=line)
        owner, start_s, end_s, req = (c.strip() for c in row)
        if not owner:
            raise BookingsError(path, "owner is empty", line=line)
        try:
            start, end = float(start_s), float(end_s)
        except ValueError:
            raise BookingsError(path, f"start_s and end_s must be seconds, got {start_s!r} and {end_s!r}", line=line) from None
        if not end > start:
            raise BookingsError(path, f"end_s ({end_s}) must be after start_s ({start_s})", line=line)
        try:
            request = parse_booking_request(req)
        except ValueError as e:
            raise BookingsError(path, f"request {req!r}: {e}", line=line) from None
        out.append(BookingSpec(owner, start, end, request, text=req, line=line))
    return out


def held_on_trace(job: Job, linger_s: float) -> float:
    """How long ``job``'s first request holds its GPU on the trace: a pod its held time, a session
    until its last burst ends plus the linger (what it holds where nothing takes it back)."""
    if job.kind == "batch":
        return job.work_s
    last = max((s + d for s, d in job.bursts), default=0.0)
    return last + linger_s


def draw_bookings(workload: Workload, fraction: float, ahead_s: float, seed: int, *, linger_s: float) -> list[BookingSpec]:
    """Book the first request of a random ``fraction`` of the owners (seeded), made ``ahead_s`` before it arrives."""
    if not 0 < fraction <= 1:
        raise ValueError(f"--book-fraction must be in (0, 1], got {fraction:g}")
    if ahead_s < 0:
        raise ValueError(f"--book-ahead must be 0 or more seconds, got {ahead_s:g}")
    first: dict[str, Job] = {}
    for j in workload.jobs:  # in arrival order
        first.setdefault(j.id, j)
    owners = sorted(first)
    k = round(fraction * len(owners))
    picked = random.Random(f"bookings:{seed}").sample(owners, k) if k else []
    out = []
    for owner in sorted(picked, key=lambda o: (first[o].arrival, o)):
        j = first[owner]
        out.append(BookingSpec(owner, j.arrival, j.arrival + held_on_trace(j, linger_s), None, created=j.arrival - ahead_s,
                               text=f"its first request ({j.gpus:g} GPU)"))
    return out


def summarize_bookings(items: list[dict[str, Any]]) -> dict[str, Any]:
    """The figures of a replay's bookings (``items``: one dict per booking, see Replay)."""
    placed = [b for b in items if b["placed"]]
    honoured = [b for b in placed if b["granted_at"] is not None]
    delays = [b["start_delay_s"] for b in honoured]
    on_time = [d for d in delays if d <= ON_TIME_S]
    booked = sum(b["booked_gpu_hours"] for b in placed)
    used = sum(b["used_gpu_hours"] for b in placed)
    refused: dict[str, int] = {}
    for b in items:
        if not b["placed"]:
            refused[b["reason"]] = refused.get(b["reason"], 0) + 1
    not_used: dict[str, int] = {}
    for b in placed:
        if b["granted_at"] is None:
            not_used[b["reason"] or "not used"] = not_used.get(b["reason"] or "not used", 0) + 1
    return {
        "applied": True,
        "n": len(items),
        "placed": len(placed),
        "honoured": len(honoured),
        "started_on_time": len(on_time),
        # of the placed bookings (a placed booking its owner never got counts as late)
        "started_on_time_fraction": len(on_time) / len(placed) if placed else None,
        "on_time_tolerance_s": ON_TIME_S,
        "start_delay_max_s": max(delays) if delays else None,
        "booked_gpu_hours": booked,
        "unused_gpu_hours": booked - used,
        "shape_mismatch": sum(1 for b in items if b.get("shape_mismatch")),
        "refused_reasons": refused,
        "not_honoured_reasons": not_used,
        "items": items,
    }


def not_applied(policy_name: str) -> dict[str, Any]:
    return {"applied": False, "why": f"not applied: {policy_name} stands for a cluster without bookings (only the gpulease policies take them)"}


def bookings_line(b: dict[str, Any]) -> str:
    """One line of the text report for a policy that took bookings."""
    if not b.get("applied"):
        return b.get("why", "bookings not applied")
    frac = b["started_on_time_fraction"]
    delay = b["start_delay_max_s"]
    return (f"{b['n']} bookings, {b['placed']} placed, {b['honoured']} honoured, "
            f"{'-' if frac is None else f'{100 * frac:.1f}%'} started within {b['on_time_tolerance_s']:g} s, "
            f"max start delay {'-' if delay is None else f'{delay:.0f} s'}, "
            f"unused {b['unused_gpu_hours']:.1f} of {b['booked_gpu_hours']:.1f} booked GPU-h"
            + (f"; refused: {sum(b['refused_reasons'].values())}" if b["refused_reasons"] else "")
            + (f"; request shape unlike the owner's: {b['shape_mismatch']}" if b["shape_mismatch"] else ""))


__all__ = ["HEADER", "ON_TIME_S", "BookingSpec", "BookingsError", "bookings_line", "draw_bookings", "held_on_trace", "load_bookings_csv",
           "not_applied", "parse_booking_request", "parse_bookings_csv", "summarize_bookings"]
