"""`jupyter gpulease report`: where the GPU-hours went, as a table, CSV or JSON.

Two sources, the same report:

* the broker (default): ``GET api/usage`` with ``--url``/``--token`` as the other commands;
  an admin's token sees everyone, any other token only its own user;
* a store directly (``--db URL``: ``sqlite:///…``, ``postgresql+psycopg://…``), e.g. the
  broker's database or a replay's (``jupyter gpulease simulate --usage-db FILE``). Prices, the
  group mapping and whether idle time is charged come from ``--config`` (the broker's config
  file: ``c.GPULeaseUsage``) and ``--price``/``--currency``/``--no-charge-idle``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time

from ..client import BrokerError
from ..core.text import format_table
from .usage import BY, COLUMNS, Accounting, PeriodError, UsageAPI, period

HEADERS = {"held_gpu_h": "HELD GPU-h", "busy_gpu_h": "BUSY GPU-h", "idle_gpu_h": "IDLE GPU-h", "busy_ratio": "BUSY/HELD", "queue_wait_p50_s": "WAIT p50",
           "queue_wait_p95_s": "WAIT p95", "reclaims": "RECLAIMS", "suspends": "SUSPENDS", "preemptions": "PREEMPTED", "cost": "COST", "leases": "LEASES"}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="jupyter gpulease report",
        description="GPU-hours held and busy, queue waits, reclaims, suspends, preemptions and cost over a period, grouped by user, "
                    "group, model, tier or notebook.",
        epilog="examples:\n  jupyter gpulease report --since 30d --by group\n"
               "  jupyter gpulease report --from 2026-11-01 --to 2026-12-01 --by model --format csv > november.csv\n"
               "  jupyter gpulease report --db sqlite:///replay.sqlite --by user --price 'A100*=2.9'",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--since", default=None, help="the last N hours, days or weeks: 12h, 30d, 2w (default: 30d)")
    p.add_argument("--from", dest="start", default=None, help="start: a date (2026-11-01), a time (2026-11-01T08:00; UTC unless an offset is given) or Unix seconds")
    p.add_argument("--to", dest="end", default=None, help="end (not included), as --from (default: now)")
    p.add_argument("--by", default="user", choices=BY, help="group rows by (default: user)")
    p.add_argument("--user", default=None, help="only this user's leases (another user's needs the admin scope)")
    p.add_argument("--format", default="table", choices=("table", "csv", "json"), help="table (default), csv or json")
    p.add_argument("--suggestions", action="store_true", help="also print right-sizing suggestions")
    p.add_argument("--db", default=None, help="read this store instead of asking the broker: sqlite:///FILE or postgresql+psycopg://…")
    p.add_argument("--config", default=None, help="with --db: the broker's config file, for c.GPULeaseUsage (prices, currency, charge_idle, groups)")
    p.add_argument("--price", action="append", default=[], metavar="MODEL=PRICE", help="with --db: price of one GPU-hour of a model (a shell pattern); repeatable")
    p.add_argument("--currency", default=None, help="with --db: the prices' currency")
    p.add_argument("--no-charge-idle", dest="charge_idle", action="store_false", default=None, help="with --db: charge busy GPU-hours only")
    p.add_argument("--url", default=None, help="the broker's URL (default: $GPULEASE_BROKER_URL)")
    p.add_argument("--token", default=None, help="a JupyterHub API token (default: $GPULEASE_TOKEN or $JUPYTERHUB_API_TOKEN)")
    return p


def accounting_of(args) -> Accounting:
    """Prices and the group mapping from ``--config`` and the command line."""
    from traitlets.config import Config

    from .usage import GPULeaseUsage

    cfg = Config()
    if args.config:
        import os

        from traitlets.config.loader import PyFileConfigLoader

        cfg = PyFileConfigLoader(os.path.basename(args.config), path=os.path.dirname(os.path.abspath(args.config))).load_config()
    acc = GPULeaseUsage(config=cfg).accounting()
    prices = dict(acc.prices)
    for item in args.price:
        model, sep, value = item.rpartition("=")
        try:
            if not sep or not model:
                raise ValueError
            prices[model] = float(value)
        except ValueError:
            raise PeriodError(f"--price {item!r}: give MODEL=PRICE, e.g. 'A100*=2.9'", "price") from None
    return Accounting(prices=prices, currency=args.currency if args.currency is not None else acc.currency,
                      charge_idle=acc.charge_idle if args.charge_idle is None else args.charge_idle, group_order=acc.group_order, teams=acc.teams)


def _fmt(v, col: str) -> str:
    if v is None:
        return "-"
    if col == "busy_ratio":
        return f"{100 * v:.0f}%"
    if col in ("queue_wait_p50_s", "queue_wait_p95_s"):
        from ..core.text import format_duration

        return format_duration(v) if v else "0 s"
    if col == "cost":
        return f"{v:,.2f}"
    if isinstance(v, float):
        return f"{v:,.1f}"
    return str(v)


def render_table(rep: dict) -> str:
    cols = list(COLUMNS[1:])
    notebook = rep["by"] == "notebook"
    head = [rep["by"].upper(), *(["USER"] if notebook else []), *(HEADERS[c] + (f" ({rep['currency']})" if c == "cost" and rep.get("currency") else "") for c in cols)]
    rows = [[str(r["key"]), *([r.get("user", "")] if notebook else []), *(_fmt(r[c], c) for c in cols)] for r in [*rep["rows"], rep["totals"]]]
    frm = time.strftime("%Y-%m-%d %H:%M", time.gmtime(rep["period"]["from"]))
    to = time.strftime("%Y-%m-%d %H:%M", time.gmtime(rep["period"]["to"]))
    note = "" if rep.get("charge_idle", True) else " (idle GPU-hours not charged)"
    align = "<" * (2 if notebook else 1) + ">" * len(cols)
    return f"GPU usage {frm} to {to} UTC, by {rep['by']}{note}\n" + format_table(rows, head, align=align)


def render_suggestions(sugs: list[dict]) -> str:
    if not sugs:
        return "No right-sizing suggestions (not enough leases, or every ask fits its use)."
    lines = ["Right-sizing suggestions:"]
    for s in sugs:
        who = f"user {s['user']}" if "user" in s else f"group {s['group']}"
        lines.append(f"  {who}: {s['text']}")
    return "\n".join(lines)


async def _from_broker(args) -> tuple[dict | str, list | None]:
    from .cli import client_from_args

    client = client_from_args(args)
    query = {k: v for k, v in (("since", args.since), ("from", args.start), ("to", args.end), ("by", args.by), ("user", args.user)) if v}
    rep = await client.usage_report(**query)
    sugs = await client.usage_suggestions(args.user or None) if args.suggestions else None
    return rep, sugs


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.db:
            from ..store import LeaseStore, StoreError

            try:
                store = LeaseStore(args.db, migrate=False)
            except StoreError as e:
                print(f"error: {e}", file=sys.stderr)
                return 1
            try:
                if store.schema_revision() is None or "usage_hourly" not in _tables(store):
                    print(f"error: {store.describe()} holds no usage records (no usage tables: a store of an older broker, or not a lease store)",
                          file=sys.stderr)
                    return 1
                api = UsageAPI(store, accounting_of(args))
                if not (args.since or args.start or args.end):
                    args.since = "30d"
                t0, t1 = period(since=args.since, start=args.start, end=args.end)
                rep = api.report(by=args.by, start=t0, end=t1, user=args.user)
                sugs = api.suggestions(user=args.user) if args.suggestions else None
            finally:
                store.close()
        else:
            rep, sugs = asyncio.run(_from_broker(args))
    except PeriodError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except BrokerError as e:
        print(f"error: {e.message}", file=sys.stderr)
        return 1
    if args.format == "json":
        print(json.dumps(rep if sugs is None else {**rep, "suggestions": sugs}, indent=2))
        return 0
    if args.format == "csv":
        from .usage import report_csv

        sys.stdout.write(report_csv(rep))
        return 0
    print(render_table(rep))
    if sugs is not None:
        print()
        print(render_suggestions(sugs))
    return 0


def _tables(store) -> set[str]:
    from sqlalchemy import inspect

    with store.engine.connect() as conn:
        return set(inspect(conn).get_table_names())
