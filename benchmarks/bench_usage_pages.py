"""The usage pages over a million usage records: how long the admin page's usage section and a
user's "my leases" figures take to read and draw.

    python benchmarks/bench_usage_pages.py [--records 1000000] [--out benchmarks/results/usage_pages.json]

A SQLite store (file, WAL) is filled with ``--records`` hourly usage records as
benchmarks/bench_usage.py fills it (leases of 8 hours of 400 users in 20 groups on 4 models over
90 days), through the store's own writer. Then, for the last 30 and 90 days:

* the admin page's usage section as the page reads it (:func:`usage_pages.admin_usage`: three
  reports, two series and the suggestions at once, off the event loop) and its HTML;
* side by side, in the same run: the same six queries one after the other (what the page would
  take without reading them at once), and the floor (one ``SELECT count(*), sum(held_gpu_s)``);
* one user's "my leases" figures (:func:`usage_pages.my_usage`).

Best of ``--repeat`` runs each; figures printed and saved as JSON; nothing is asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_usage import A100, fill, timed  # noqa: E402  (the same records as the report's benchmark)


def figures(url: str, records: int, repeat: int) -> dict:
    from jupyter_gpulease.broker import pages, usage_pages
    from jupyter_gpulease.broker.usage import Accounting, UsageAPI
    from jupyter_gpulease.store import LeaseStore

    now = time.time()
    store = LeaseStore(url)
    try:
        res = {"database": "SQLite (file, WAL)", **fill(store, records, now)}
        api = UsageAPI(store, Accounting(prices={A100: 2.9, "H100*": 4.5, "*": 1.0}, currency="EUR"), clock=lambda: now, min_leases=3)
        source = usage_pages.UsageSource(api)

        def floor():
            with store.engine.connect() as conn:
                return conn.exec_driver_sql("SELECT count(*), sum(held_gpu_s) FROM usage_hourly WHERE kernel = ''").one()

        s, _ = timed(floor, repeat)
        res["floor_count_sum_s"] = round(s, 3)
        for since in ("30d", "90d"):
            period = usage_pages.parse_period(since, None, None, now)
            span = {"start": period["start"], "end": period["end"]}
            step = "day" if usage_pages.bucket_width(period["start"], period["end"], 3600) >= 86400 else "hour"

            def one_after_another(span=span, step=step):
                for by in ("group", "model", "user"):
                    api.report(by=by, **span)
                api.series(by="group", step=step, **span)
                api.series(by="model", step=step, **span)
                return api.suggestions(**span)

            s, _ = timed(one_after_another, repeat)
            res[f"admin_{since}_queries_one_after_another_s"] = round(s, 3)
            s, section = timed(lambda period=period: asyncio.run(usage_pages.admin_usage(source, period)), repeat)
            res[f"admin_{since}_section_s"] = round(s, 3)
            ctx = dict(base_url="/services/gpulease/", hub_home="/hub/home", usage=section, active=[], queue=[], pool=[], now=now, now_text="",
                       draining=False, unleased=[], unleased_action=None, graces=pages.REVOKE_GRACES, xsrf="x")
            s, html = timed(lambda ctx=ctx: pages.render("admin.html", **ctx), repeat)
            res[f"admin_{since}_html_s"] = round(s, 4)
            res[f"admin_{since}_html_kib"] = round(len(html.encode()) / 1024)
            s, _ = timed(lambda period=period: asyncio.run(usage_pages.my_usage(source, "user007", period)), repeat)
            res[f"my_leases_{since}_s"] = round(s, 3)
    finally:
        store.close()
    return res


def line(r: dict) -> str:
    return (f"{r['records']:,} records on {r['database']}: floor {r['floor_count_sum_s']} s; admin page's usage section, last 30 days "
            f"{r['admin_30d_section_s']} s (the same queries one after another {r['admin_30d_queries_one_after_another_s']} s, "
            f"HTML {r['admin_30d_html_s']} s, {r['admin_30d_html_kib']} KiB), last 90 days {r['admin_90d_section_s']} s "
            f"(one after another {r['admin_90d_queries_one_after_another_s']} s); my leases {r['my_leases_30d_s']} s / {r['my_leases_90d_s']} s")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--records", type=int, default=1_000_000)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--out", default=str(HERE / "results" / "usage_pages.json"))
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-usage-pages-") as tmp:
        r = figures(f"sqlite:///{tmp}/usage.sqlite", args.records, args.repeat)
    print(line(r), flush=True)
    out = {"command": " ".join(["python benchmarks/bench_usage_pages.py", *(argv if argv is not None else sys.argv[1:])]),
           "python": sys.version.split()[0], "cpus": os.cpu_count(), **r}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
