"""`jupyter gpulease pool|leases|queue|extend|release`: the broker's API from a terminal.

The broker's URL comes from ``--url`` or ``GPULEASE_BROKER_URL`` (e.g.
``http://127.0.0.1:8000/services/gpulease/``); the token from ``--token``, ``GPULEASE_TOKEN``
or ``JUPYTERHUB_API_TOKEN`` (inside a single-user server it is already set).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from typing import Any

from ..client import BrokerClient, BrokerError, default_broker_url
from ..core.text import format_duration, format_table
from ..core.text import parse_duration as core_parse_duration


def _parser(prog: str, description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"jupyter gpulease {prog}", description=description)
    p.add_argument("--url", default=None, help="broker base URL (default: $GPULEASE_BROKER_URL)")
    p.add_argument("--token", default=None, help="JupyterHub API token (default: $GPULEASE_TOKEN or $JUPYTERHUB_API_TOKEN)")
    p.add_argument("--json", action="store_true", help="print the broker's JSON instead of a table")
    return p


def _client(args) -> BrokerClient:
    url = args.url or default_broker_url()
    token = args.token or os.environ.get("GPULEASE_TOKEN") or os.environ.get("JUPYTERHUB_API_TOKEN", "")
    if not token:
        raise BrokerError(0, "no token: pass --token or set GPULEASE_TOKEN (a JupyterHub API token)")
    return BrokerClient(url, token)


def _run(args, coro_fn) -> int:
    try:
        client = _client(args)
        result = asyncio.run(coro_fn(client))
    except BrokerError as e:
        where = f" (field '{e.field}')" if e.field else ""
        print(f"error: {e.message}{where}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(result, indent=2))
    return 0


# --------------------------------------------------------------------------- formatting
def fmt_duration(s: float) -> str:
    return format_duration(s, compact=True)


def fmt_when(t: float | None, now: float | None = None) -> str:
    if t is None:
        return "-"
    now = time.time() if now is None else now
    d = t - now
    return f"in {fmt_duration(d)}" if d >= 0 else f"{fmt_duration(-d)} ago"


def describe_request(r: dict[str, Any]) -> str:
    models = "|".join(r.get("model") or [])
    where = f" {models}" if models else ""
    if r.get("kind") == "share":
        mem = f" {r['memory_mib']}MiB" if r.get("memory_mib") else ""
        return f"{r.get('share', 0):g} share{mem}{where}"
    if r.get("kind") == "mig":
        return f"MIG {r.get('mig_profile')}{where}"
    return f"{r.get('gpus', 1)} GPU{'s' if r.get('gpus', 1) != 1 else ''}{where}"


def describe_placement(p: dict[str, Any] | None) -> str:
    if not p:
        return "-"
    parts = []
    for s in p.get("slices", []):
        part = f"{s['node']}/{s['index']}"
        if s.get("mig_profile"):
            part += f":{s['mig_profile']}"
        elif s.get("share", 1) != 1:
            part += f"x{s['share']:g}"
        parts.append(part)
    return ",".join(parts)


def table(headers: list[str], rows: list[list[str]]) -> str:
    return format_table(rows, headers)


def lease_rows(leases: list[dict], now: float) -> str:
    rows = []
    for lease in leases:
        q = lease.get("queue") or {}
        if lease["state"] == "queued":
            when = f"#{q.get('position', '?')}/{q.get('length', '?')} eta {fmt_when(q.get('eta'), now)}"
        elif lease["state"] == "active":
            when = f"expires {fmt_when(lease.get('expires_at'), now)}"
        else:
            when = f"ended {fmt_when(lease.get('ended_at'), now)}"
        rows.append([lease["id"][:12], lease["state"], lease["user"], lease.get("server") or "-", lease["tier"], describe_request(lease["request"]), describe_placement(lease.get("placement")), when])
    return table(["ID", "STATE", "USER", "SERVER", "TIER", "ASKS FOR", "PLACEMENT", "WHEN"], rows)


def parse_duration(text: str) -> float:
    """'90', '90s', '30m', '2h', '1h30m', '1d' -> seconds (an argparse type)."""
    try:
        return core_parse_duration(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


async def resolve_id(client: BrokerClient, lease_id: str) -> str:
    """Accept a unique prefix of one of the caller's lease ids (the tables show 12 characters)."""
    if len(lease_id) >= 32:
        return lease_id
    matches = [x["id"] for x in await client.list_leases(state="all") if x["id"].startswith(lease_id)]
    if len(matches) == 1:
        return matches[0]
    if len(matches) > 1:
        raise BrokerError(400, f"{lease_id!r} matches {len(matches)} leases; give more of the id", "id")
    return lease_id  # let the broker say 404


# --------------------------------------------------------------------------- commands
def pool_main(argv: list[str] | None = None) -> int:
    p = _parser("pool", "Show the GPU pool: devices, what is free, your quota and the queue length.")
    args = p.parse_args(argv)

    async def go(client):
        pool = await client.pool()
        if not args.json:
            cap = pool.get("capacity", {})
            rows = [[m, str(c.get("gpus", "")), str(c.get("idle_gpus", "")), f"{c.get('free_share', 0):g}", ",".join(f"{k}:{v}" for k, v in (c.get("mig") or {}).items()) or "-"] for m, c in sorted(cap.items())]
            print(table(["MODEL", "GPUS", "IDLE", "FREE SHARE", "MIG FREE"], rows))
            print()
            devs = [[d["node"], str(d["index"]), d["model"], str(d["memory_mib"]), ",".join(m["profile"] for m in d.get("mig", [])) or "-", "yes" if d.get("healthy", True) else "NO"] for d in pool.get("devices", [])]
            print(table(["NODE", "IDX", "MODEL", "MEMORY MIB", "MIG", "HEALTHY"], devs))
            u = pool.get("usage") or {}
            print()
            print(f"queue: {pool.get('queue_length', 0)} waiting; you hold {u.get('gpus_held', 0):g} GPU(s)"
                  + (f" of {u['max_gpus']:g}" if u.get("max_gpus") is not None else "")
                  + (f"; {u['gpu_hours_left']:g} GPU-hours left" if u.get("gpu_hours_left") is not None else ""))
            print("tiers: " + ", ".join(f"{t['name']} (max {fmt_duration(t['max_duration_s'])})" for t in pool.get("tiers", [])))
        return pool

    return _run(args, go)


def leases_main(argv: list[str] | None = None) -> int:
    p = _parser("leases", "List leases: yours, or everyone's with the admin scope.")
    p.add_argument("--state", default="live", help="live (default), queued, active, ended, all, or a final state such as expired")
    p.add_argument("--user", default=None, help="only this user's leases (admins)")
    args = p.parse_args(argv)

    async def go(client):
        leases = await client.list_leases(state=args.state, user=args.user)
        if not args.json:
            print(lease_rows(leases, time.time()) if leases else "no leases")
        return leases

    return _run(args, go)


def queue_main(argv: list[str] | None = None) -> int:
    p = _parser("queue", "Show the queue in scheduling order, with ETAs.")
    args = p.parse_args(argv)

    async def go(client):
        queue = await client.queue()
        if not args.json:
            now = time.time()
            rows = [[str((x.get("queue") or {}).get("position", i)), x["id"][:12], x["user"], x["tier"], describe_request(x["request"]), fmt_when((x.get("queue") or {}).get("eta"), now), (x.get("queue") or {}).get("waiting_for", "")] for i, x in enumerate(queue, 1)]
            print(table(["#", "ID", "USER", "TIER", "ASKS FOR", "ETA", "WAITING FOR"], rows) if rows else "the queue is empty")
        return queue

    return _run(args, go)


def extend_main(argv: list[str] | None = None) -> int:
    p = _parser("extend", "Extend an active lease.")
    p.add_argument("lease", help="lease id (or a unique prefix of one of yours)")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--by", type=parse_duration, help="how much longer: 3600, 30m, 2h, 1h30m")
    g.add_argument("--until", type=float, help="new end time, POSIX seconds")
    args = p.parse_args(argv)

    async def go(client):
        lease = await client.extend(await resolve_id(client, args.lease), by_s=args.by, until=args.until)
        if not args.json:
            print(f"lease {lease['id'][:12]} now expires {fmt_when(lease.get('expires_at'))}")
        return lease

    return _run(args, go)


def release_main(argv: list[str] | None = None) -> int:
    p = _parser("release", "Release an active lease, or withdraw a queued one.")
    p.add_argument("lease", help="lease id (or a unique prefix of one of yours)")
    p.add_argument("--reason", default="", help="why (kept in the lease's history)")
    args = p.parse_args(argv)

    async def go(client):
        lease = await client.release(await resolve_id(client, args.lease), args.reason)
        if not args.json:
            print(f"lease {lease['id'][:12]} {lease['state']}")
        return lease

    return _run(args, go)
