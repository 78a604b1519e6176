"""`jupyter gpulease pool|leases|queue|extend|release`: the broker's API from a terminal.

Tables as ``kubectl get`` and ``squeue`` print them; times as the local clock and durations
("14:05 (in 1 h 12 min)"); ``--json`` prints the broker's JSON unchanged. Errors are one line
a person can act on.

The broker's URL comes from ``--url`` or ``GPULEASE_BROKER_URL`` (e.g.
``http://127.0.0.1:8000/services/gpulease/``; inside a single-user server it is found from the
hub's variables); the token from ``--token``, ``GPULEASE_TOKEN`` or ``JUPYTERHUB_API_TOKEN``
(inside a single-user server it is already set).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import re
import sys
import time

from ..client import BrokerClient, BrokerError, default_broker_url
from ..core.text import format_duration, format_gpus, format_table, usage_words
from ..core.text import parse_duration as core_parse_duration
from .present import describe_placement, describe_request, local_time

# the options a broker error's field corresponds to, to name them in its message
FIELD_OPTIONS = {"by_s": "--by", "until": "--until", "reason": "--reason", "state": "--state", "user": "--user", "id": "LEASE", "limit": "--limit"}
ENDED_SHOWN = 1000  # ended leases listed (and searched for an id prefix) unless --limit says otherwise


def command_parser(prog: str, description: str, epilog: str = "") -> argparse.ArgumentParser:
    """The parser of ``jupyter gpulease <prog>``, with the options every broker command has (--url, --token, --json)."""
    p = argparse.ArgumentParser(prog=f"jupyter gpulease {prog}", description=description, epilog=epilog,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default=None, help="the broker's URL, ending in /services/gpulease/ (default: $GPULEASE_BROKER_URL, or found from the hub's variables inside a server)")
    p.add_argument("--token", default=None, help="a JupyterHub API token (default: $GPULEASE_TOKEN or $JUPYTERHUB_API_TOKEN)")
    p.add_argument("--json", action="store_true", help="print the broker's JSON instead of a table")
    return p


def client_from_args(args) -> BrokerClient:
    """The broker's client for a command's ``--url`` and ``--token`` (or their environment variables)."""
    url = args.url or default_broker_url()
    token = args.token or os.environ.get("GPULEASE_TOKEN") or os.environ.get("JUPYTERHUB_API_TOKEN", "")
    if not token:
        raise BrokerError(0, "no token: pass --token or set GPULEASE_TOKEN (a JupyterHub API token, from the hub's Token page)")
    return BrokerClient(url, token, retry_for=20)


def run_command(args, coro_fn) -> int:
    """Run ``coro_fn(client)`` for a command: its result printed as JSON with ``--json``, a broker
    error as one line; the exit status (0, or 1 on an error)."""
    try:
        client = client_from_args(args)
        result = asyncio.run(coro_fn(client))
    except BrokerError as e:
        print(f"error: {e.message}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(result, indent=2))
    return 0


# --------------------------------------------------------------------------- formatting
def fmt_when(t: float | None, now: float | None = None) -> str:
    """'14:05 (in 1 h 12 min)', '2024-05-03 09:00 (in 2 d 3 h)', '13:20 (45 min ago)'."""
    if t is None:
        return "-"
    now = time.time() if now is None else now
    d = t - now
    rel = f"in {format_duration(d)}" if d >= 0 else f"{format_duration(-d)} ago"
    return f"{local_time(t, now)} ({rel})"


fmt_gpus = format_gpus  # the CLI's name for it


def table(headers: list[str], rows: list[list[str]]) -> str:
    return format_table(rows, headers)


def lease_rows(leases: list[dict], now: float) -> str:
    rows = []
    for lease in leases:
        q = lease.get("queue") or {}
        if lease["state"] == "queued":
            when = f"#{q.get('position', '?')} of {q.get('length', '?')}, " + (f"starts {fmt_when(q['eta'], now)}" if q.get("eta") else "no estimate yet")
        elif lease["state"] == "active":
            when = f"until {fmt_when(lease.get('expires_at'), now)}"
        else:
            when = lease.get("end_message") or f"ended {fmt_when(lease.get('ended_at'), now)}"
            when = f"{local_time(lease.get('ended_at'), now)}: {when}" if lease.get("ended_at") else when
        rows.append([lease["id"][:12], lease["state"], lease["user"], lease.get("server") or "(default)", lease["tier"], describe_request(lease["request"]),
                     describe_placement(lease.get("placement")), when])
    return table(["ID", "STATE", "USER", "SERVER", "TIER", "ASKS FOR", "GPUS", "WHEN"], rows)


def parse_duration(text: str) -> float:
    """'90', '90s', '30m', '2h', '1h30m', '1d' -> seconds (an argparse type); '-1h' reads as
    negative, for the caller to refuse with a message that says why."""
    try:
        return core_parse_duration(text, negative=True)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def parse_until(text: str, now: float | None = None) -> float:
    """A time on the local clock: '18:30' (today, or tomorrow when that has passed),
    '2024-05-02 18:30', '2024-05-02T18:30', 'tomorrow 9:00', or POSIX seconds."""
    now = time.time() if now is None else now
    s = text.strip().lower()
    if re.fullmatch(r"\d{9,}(\.\d+)?", s):
        return float(s)
    base = dt.datetime.fromtimestamp(now)
    day = base.date()
    if s.startswith("tomorrow"):
        day, s = day + dt.timedelta(days=1), s[len("tomorrow"):].strip()
    elif s.startswith("today"):
        s = s[len("today"):].strip()
    m = re.fullmatch(r"(\d{1,2}):(\d{2})", s)
    if m:
        h, mi = int(m.group(1)), int(m.group(2))
        if h > 23 or mi > 59:
            raise argparse.ArgumentTypeError(f"not a time of day: {text!r}")
        when = dt.datetime.combine(day, dt.time(h, mi))
        if when.timestamp() <= now and not text.strip().lower().startswith(("today", "tomorrow")):
            when += dt.timedelta(days=1)
        return when.timestamp()
    try:
        return dt.datetime.fromisoformat(text.strip()).timestamp()
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a time: {text!r} (examples: 18:30, tomorrow 9:00, 2024-05-02 18:30)") from None


def _join_negative(argv: list[str], options: tuple[str, ...]) -> list[str]:
    """`--by -1h` as `--by=-1h`: argparse would take '-1h' for an option."""
    out, i = [], 0
    while i < len(argv):
        a = argv[i]
        if a in options and i + 1 < len(argv) and argv[i + 1].startswith("-") and argv[i + 1][1:2].isdigit():
            out.append(f"{a}={argv[i + 1]}")
            i += 2
            continue
        out.append(a)
        i += 1
    return out


async def resolve_id(client: BrokerClient, lease_id: str) -> str:
    """Accept a unique prefix of one of the caller's lease ids (the tables show 12 characters)."""
    if len(lease_id) >= 32:
        return lease_id
    leases = await client.list_leases(state="live") + await client.list_leases(state="ended", limit=ENDED_SHOWN)
    matches = list(dict.fromkeys(x["id"] for x in leases if x["id"].startswith(lease_id)))
    if len(matches) == 1:
        return matches[0]
    if len(matches) > 1:
        raise BrokerError(400, f"{lease_id!r} matches {len(matches)} of your leases; give more of the id", "id")
    return lease_id  # let the broker say 404


# --------------------------------------------------------------------------- commands
def pool_main(argv: list[str] | None = None) -> int:
    p = command_parser("pool", "Show the GPU pool: what is free by model, the devices, your quota, the tiers you may use and the queue.")
    p.add_argument("--all-tiers", action="store_true", help="admins: list every tier, not only those your own requests may use")
    args = p.parse_args(argv)

    async def go(client):
        pool = await client.pool(every_tier=args.all_tiers)
        if args.json:
            return pool
        cap = pool.get("capacity", {})
        rows = []
        for m, c in sorted(cap.items()):
            mig = ", ".join(f"{v['free']}/{v['total']} {k}" for k, v in sorted((c.get("mig") or {}).items())) or "-"
            rows.append([m, str(c.get("gpus", "")), str(c.get("idle_gpus", "")), fmt_gpus(c.get("free_share")), f"{c.get('memory_mib', 0) // 1024} GiB", mig])
        print(table(["MODEL", "GPUS", "FREE", "FREE COMPUTE", "MEMORY/GPU", "MIG FREE/TOTAL"], rows))
        print()
        devs = [[d["node"], str(d["index"]), d["model"], f"{d['memory_mib']} MiB", ", ".join(m["profile"] for m in d.get("mig", [])) or "-",
                 "yes" if d.get("healthy", True) else ("no: " + d["cordon"]["reason"] if d.get("cordon") else "NO")] for d in pool.get("devices", [])]
        print(table(["NODE", "INDEX", "MODEL", "MEMORY", "MIG", "HEALTHY"], devs))
        print()
        u = pool.get("usage") or {}
        held = usage_words(u)
        print(held[:1].upper() + held[1:] + ".")
        print(f"Queue: {pool.get('queue_length', 0)} waiting." + (" The broker is not granting leases right now (drain)." if pool.get("draining") else ""))
        tiers = [[t["name"], str(t.get("priority", "")), format_duration(t.get("default_duration_s", 0)), format_duration(t["max_duration_s"]),
                  ("yes, " + format_duration(t.get("grace_s", 0)) + " warning") if t.get("preemptible") else "no", t.get("description", "")] for t in pool.get("tiers", [])]
        if tiers:
            print()
            print(table(["TIER", "PRIORITY", "DEFAULT", "MAX", "PREEMPTIBLE", "FOR"], tiers))
        return pool

    return run_command(args, go)


def leases_main(argv: list[str] | None = None) -> int:
    p = command_parser("leases", "List leases: yours, or everyone's with the admin scope.")
    p.add_argument("--state", default="live", help="live (default: queued and active), queued, active, ended, all, or a final state such as expired")
    p.add_argument("--user", default=None, help="only this user's leases (admins)")
    p.add_argument("--limit", type=int, default=None,
                   help=f"at most this many (default: every live one; with --state ended, all or a final state: the {ENDED_SHOWN} newest ended)")
    args = p.parse_args(argv)
    if args.limit is not None and args.limit < 1:
        print("error: --limit must be at least 1", file=sys.stderr)
        return 2
    limit = args.limit if args.limit is not None or args.state in ("live", "queued", "active") else ENDED_SHOWN

    async def go(client):
        # the broker answers a page at a time: the client follows them up to the limit
        leases = await client.list_leases(state=args.state, user=args.user, limit=limit)
        if not args.json:
            print(lease_rows(leases, time.time()) if leases else "No leases.")
            if limit is not None and len(leases) >= limit:
                print(f"(the first {limit}; --limit for more)")
        return leases

    return run_command(args, go)


def queue_main(argv: list[str] | None = None) -> int:
    p = command_parser("queue", "Show the queue in scheduling order, with when each request is expected to start.")
    args = p.parse_args(argv)

    async def go(client):
        queue = await client.queue()
        if not args.json:
            now = time.time()
            rows = []
            for i, x in enumerate(queue, 1):
                q = x.get("queue") or {}
                rows.append([str(q.get("position", i)), (x.get("id") or "-")[:12], x["user"], x["tier"], describe_request(x["request"]),
                             fmt_when(q.get("eta"), now) if q.get("eta") else "no estimate yet", q.get("waiting_for", "")])
            print(table(["#", "ID", "USER", "TIER", "ASKS FOR", "EXPECTED START", "WAITING FOR"], rows) if rows else "The queue is empty.")
        return queue

    return run_command(args, go)


def extend_main(argv: list[str] | None = None) -> int:
    p = command_parser("extend", "Give an active lease more time, within its tier's limits.",
                epilog="examples:\n  jupyter gpulease extend 3f2a9c --by 1h\n  jupyter gpulease extend 3f2a9c --until 18:30\n  jupyter gpulease extend 3f2a9c --until 'tomorrow 9:00'")
    p.add_argument("lease", help="lease id (or a unique prefix of one of yours)")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--by", type=parse_duration, help="how much longer: 3600, 30m, 2h, 1h30m")
    g.add_argument("--until", type=parse_until, help="the new end, on your clock: 18:30, tomorrow 9:00, 2024-05-02 18:30 (or POSIX seconds)")
    args = p.parse_args(_join_negative(list(sys.argv[1:] if argv is None else argv), ("--by",)))
    if args.by is not None and args.by <= 0:
        print("error: --by must be a positive duration such as 30m; to give the GPUs back earlier, release the lease", file=sys.stderr)
        return 2

    async def go(client):
        lease = await client.extend(await resolve_id(client, args.lease), by_s=args.by, until=args.until)
        if not args.json:
            print(f"Lease {lease['id'][:12]} now runs until {fmt_when(lease.get('expires_at'))}.")
        return lease

    return run_command(args, go)


RELEASE_EPILOG = """what happens to the server that uses the lease:
  --keep-server   the GPUs go back to the pool and the server keeps running without them:
                  kernels that held a GPU lose it; notebooks, files and CPU work go on.
                  The default when you run this inside the server that holds the lease.
  --stop-server   the GPUs go back and the server that used them is stopped, as the hub
                  does by default when a server's lease ends (save your work first). The
                  default when you run this anywhere else.
A queued request is simply withdrawn."""


def release_main(argv: list[str] | None = None) -> int:
    p = command_parser("release", "Give an active lease back, or withdraw a queued request.", epilog=RELEASE_EPILOG)
    p.add_argument("lease", help="lease id (or a unique prefix of one of yours)")
    p.add_argument("--reason", default="", help="why (kept in the lease's history)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--keep-server", dest="keep", action="store_true", default=None, help="keep the server running without GPUs (see below)")
    g.add_argument("--stop-server", dest="keep", action="store_false", help="let the hub stop the server (see below)")
    args = p.parse_args(argv)

    async def go(client):
        lease_id = await resolve_id(client, args.lease)
        keep = args.keep
        if keep is None:  # inside the lease's own server, keep it by default
            lease = await client.get_lease(lease_id)
            here = os.environ.get("JUPYTERHUB_USER") == lease["user"] and os.environ.get("JUPYTERHUB_SERVER_NAME", "") == (lease.get("server") or "")
            keep = bool(here and os.environ.get("JUPYTERHUB_API_TOKEN"))
        lease = await client.release(lease_id, args.reason, keep_server=keep)
        if not args.json:
            short = lease["id"][:12]
            if lease["state"] == "withdrawn":
                print(f"Request {short} withdrawn.")
            elif keep:
                print(f"Lease {short} released; the server keeps running without GPUs (kernels that used a GPU lost it).")
            else:
                print(f"Lease {short} released; the server that used it will be stopped.")
        return lease

    return run_command(args, go)
