"""The usage part of the broker's pages: where the GPU-hours went, drawn on the server.

* the admin page's usage section (``admin?since=30d``): held vs busy GPU-hours over time by group
  and by model (inline SVG drawn here: nothing is fetched from anywhere), the top idle holders,
  the cost table for the period (with a period picker), the right-sizing suggestions and a CSV
  download (``admin/usage.csv``);
* "my leases": the user's own figures for the period, per model and per notebook, and their hints.

The figures come from the broker's usage report (:mod:`.usage`), in the same shape as
``GET api/usage``, ``api/usage/series`` and ``api/usage/suggestions`` answer.
"""

from __future__ import annotations

import asyncio
import calendar
import functools
import html
import math
import re
import time
from typing import Any

from ..core.model import BadRequest

PERIODS = (("1d", "last 24 hours"), ("7d", "last 7 days"), ("30d", "last 30 days"), ("90d", "last 90 days"))
DEFAULT_PERIOD = "30d"
TOP_IDLE = 10
REPORT_BY = ("user", "group", "model", "tier", "notebook")
_SINCE = re.compile(r"^\s*(\d{1,5}(?:\.\d+)?)\s*([smhdw])\s*$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_DATE = re.compile(r"^\d{4}-\d{2}-\d{2}$")
PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22")


# --------------------------------------------------------------------------- the period
def parse_period(since: str | None, start: str | None, end: str | None, now: float) -> dict[str, Any]:
    """The period a page shows: ``since`` ('30d', '12h', '2w') or a ``from``/``to`` pair of dates
    (YYYY-MM-DD, UTC; ``to`` is the whole day). Bad input is a BadRequest naming the field."""
    start, end = (start or "").strip(), (end or "").strip()
    if start or end:
        if not start:
            raise BadRequest("give the first day of the period as well (from=YYYY-MM-DD)", field="from")
        t0 = _day(start, "from")
        t1 = _day(end, "to") + 86400 if end else now
        if t1 <= t0:
            raise BadRequest("the period's last day is before its first", field="to")
        words = f"{start} to {end}" if end else f"since {start}"
        return {"since": "", "from": start, "to": end, "start": t0, "end": min(t1, max(now, t0 + 1)), "words": words,
                "query": f"from={start}" + (f"&to={end}" if end else "")}
    since = (since or DEFAULT_PERIOD).strip()
    m = _SINCE.match(since)
    if not m:
        raise BadRequest(f"the period is a number and a unit, like 30d, 12h or 2w, not {since!r}", field="since")
    seconds = float(m.group(1)) * _UNIT_S[m.group(2)]
    if seconds <= 0 or seconds > 3 * 366 * 86400:
        raise BadRequest("the period must be more than nothing and at most 3 years", field="since")
    words = dict(PERIODS).get(since) or f"last {since}"
    return {"since": since, "from": "", "to": "", "start": now - seconds, "end": now, "words": words, "query": f"since={since}"}


def _day(text: str, field: str) -> float:
    if not _DATE.match(text):
        raise BadRequest(f"{field} is a date like 2026-11-01, not {text!r}", field=field)
    try:
        return float(calendar.timegm(time.strptime(text, "%Y-%m-%d")))
    except ValueError:
        raise BadRequest(f"{field} is not a date: {text!r}", field=field) from None


# --------------------------------------------------------------------------- numbers in words
def hours(x: Any) -> str:
    """GPU-hours for a table: '1,234', '12.5', '0.42', '0'."""
    x = float(x or 0)
    if x == 0:
        return "0"
    if abs(x) >= 1000:
        return f"{x:,.0f}"
    if abs(x) >= 10:
        return f"{x:.1f}"
    return f"{x:.2f}"


def percent(x: Any) -> str:
    return "–" if x is None else f"{float(x):.0%}"


def wait_words(seconds: Any) -> str:
    if seconds is None:
        return "–"
    s = float(seconds)
    if s < 60:
        return f"{s:.0f} s"
    if s < 3600:
        return f"{s / 60:.0f} min"
    return f"{s / 3600:.1f} h"


def money(x: Any, currency: str = "") -> str:
    if x is None:
        return "–"
    return f"{float(x):,.2f}" + (f" {currency}" if currency else "")


def report_rows(report: dict | None) -> list[dict[str, Any]]:
    """The report's rows with their figures as the tables write them."""
    cur = (report or {}).get("currency") or ""
    out = []
    for r in (report or {}).get("rows") or []:
        out.append({
            "key": r.get("key") if r.get("key") not in (None, "") else "(none)",
            "held": hours(r.get("held_gpu_h")), "busy": hours(r.get("busy_gpu_h")), "idle": hours(r.get("idle_gpu_h")),
            "ratio": percent(r.get("busy_ratio")), "p50": wait_words(r.get("queue_wait_p50_s")), "p95": wait_words(r.get("queue_wait_p95_s")),
            "reclaims": int(r.get("reclaims") or 0), "suspends": int(r.get("suspends") or 0), "preemptions": int(r.get("preemptions") or 0),
            "cost": money(r.get("cost"), cur), "leases": int(r.get("leases") or 0),
            "idle_gpu_h": float(r.get("idle_gpu_h") or 0), "held_gpu_h": float(r.get("held_gpu_h") or 0),
        })
    return out


def totals_row(report: dict | None) -> dict[str, Any] | None:
    t = (report or {}).get("totals")
    if not t:
        return None
    return report_rows({"rows": [dict(t, key="All")], "currency": (report or {}).get("currency")})[0]


def top_idle(report: dict | None, n: int = TOP_IDLE) -> list[dict[str, Any]]:
    """The users who held the most GPU-hours without using them, most first (none with no idle time)."""
    rows = [r for r in report_rows(report) if r["idle_gpu_h"] > 0]
    rows.sort(key=lambda r: (-r["idle_gpu_h"], r["key"]))
    return rows[:n]


# --------------------------------------------------------------------------- the plots
def series_by_key(series: dict | None) -> tuple[float, dict[str, list[tuple[float, float, float]]]]:
    """``api/usage/series`` → (step seconds, {key: [(t, held GPU-h, busy GPU-h), ...] in time order})."""
    series = series or {}
    raw_step = series.get("step_s", series.get("step"))
    step = float(raw_step) if isinstance(raw_step, (int, float)) and raw_step > 0 else {"day": 86400.0}.get(raw_step, 3600.0)
    out: dict[str, list[tuple[float, float, float]]] = {}
    raw = series.get("series")
    if isinstance(raw, dict):
        items = [(k, v) for k, v in raw.items()]
    elif isinstance(raw, list):
        items = [(s.get("key"), s.get("points") or []) for s in raw]
    else:
        items = []
        for p in series.get("points") or series.get("rows") or []:
            items.append((p.get("key"), [p]))
    for key, points in items:
        for p in points:
            t = p.get("t", p.get("start", p.get("hour")))
            if t is None:
                continue
            out.setdefault(str(key if key not in (None, "") else "(none)"), []).append(
                (float(t), float(p.get("held_gpu_h") or 0), float(p.get("busy_gpu_h") or 0)))
    for v in out.values():
        v.sort()
    return step, out


def _bucket(points: list[tuple[float, float, float]], start: float, end: float, width: float) -> list[tuple[float, float, float]]:
    """Sum the points into buckets of ``width`` seconds from ``start``; empty buckets are zero."""
    n = max(1, math.ceil((end - start) / width))
    held, busy = [0.0] * n, [0.0] * n
    for t, h, b in points:
        i = int((t - start) // width)
        if 0 <= i < n:
            held[i] += h
            busy[i] += b
    return [(start + i * width, held[i], busy[i]) for i in range(n)]


def bucket_width(start: float, end: float, step: float) -> float:
    """The width of one plotted bucket: the series' step, or days/weeks when that would draw too many."""
    for width in (step, 3 * 3600, 6 * 3600, 86400, 7 * 86400):
        if width >= step and (end - start) / width <= 200:
            return width
    return 30 * 86400


def svg_chart(series: dict | None, *, start: float, end: float, title: str, chart_id: str, width: int = 760, height: int = 220) -> dict[str, Any]:
    """Held vs busy GPU-hours over the period, one colour per key (held dashed, busy solid), as an
    inline SVG string, plus its legend with each key's totals (what the page also writes in words)."""
    step, by_key = series_by_key(series)
    bw = bucket_width(start, end, step)
    left, right, top, bottom = 56, 12, 18, 28
    pw, ph = width - left - right, height - top - bottom
    buckets = {k: _bucket(v, start, end, bw) for k, v in by_key.items()}
    peak = max((h for b in buckets.values() for _, h, _ in b), default=0.0)
    ymax = _nice(peak) if peak > 0 else 1.0
    span = max(end - start, 1.0)

    def x(t: float) -> float:
        return left + pw * (t - start) / span

    def y(v: float) -> float:
        return top + ph * (1 - v / ymax)

    e = html.escape
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" class="usage-chart" id="{e(chart_id)}" viewBox="0 0 {width} {height}" '
             f'width="{width}" height="{height}" role="img" aria-label="{e(title)}"><title>{e(title)}</title>',
             f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" fill="#fafafa" stroke="#ccc"/>']
    for i in range(5):  # the y axis: GPU-hours per bucket
        v = ymax * i / 4
        parts.append(f'<line x1="{left}" x2="{left + pw}" y1="{y(v):.1f}" y2="{y(v):.1f}" stroke="#e3e3e3"/>'
                     f'<text x="{left - 4}" y="{y(v) + 4:.1f}" text-anchor="end" font-size="10">{e(_axis(v))}</text>')
    for i in range(5):  # the x axis: dates
        t = start + span * i / 4
        fmt = "%m-%d %H:%M" if span <= 3 * 86400 else "%Y-%m-%d"
        parts.append(f'<text x="{x(t):.1f}" y="{height - 8}" text-anchor="{"start" if i == 0 else "end" if i == 4 else "middle"}" '
                     f'font-size="10">{e(time.strftime(fmt, time.gmtime(t)))}</text>')
    parts.append(f'<text x="{left}" y="{top - 5}" font-size="10">GPU-hours per {e(_width_words(bw))}</text>')
    legend = []
    for n, key in enumerate(sorted(buckets, key=lambda k: -sum(h for _, h, _ in buckets[k]))):
        color = PALETTE[n % len(PALETTE)]
        b = buckets[key]
        for idx, dash in ((1, ' stroke-dasharray="5 3"'), (2, "")):
            pts = " ".join(f"{x(t + bw / 2):.1f},{y(v[idx - 1]):.1f}" for t, *v in b)
            parts.append(f'<polyline fill="none" stroke="{color}" stroke-width="{1.5 if idx == 1 else 2}"{dash} points="{pts}">'
                         f'<title>{e(key)}: {"held" if idx == 1 else "busy"}</title></polyline>')
        held, busy = sum(h for _, h, _ in b), sum(x_ for _, _, x_ in b)
        legend.append({"key": key, "color": color, "held": hours(held), "busy": hours(busy), "ratio": percent(busy / held if held else None)})
    if not buckets:
        parts.append(f'<text x="{left + pw / 2}" y="{top + ph / 2}" text-anchor="middle" font-size="12" fill="#777">no GPU time in this period</text>')
    parts.append("</svg>")
    return {"svg": "".join(parts), "legend": legend, "title": title, "id": chart_id, "bucket": _width_words(bw)}


def _nice(v: float) -> float:
    exp = 10 ** math.floor(math.log10(v))
    for m in (1, 2, 4, 6, 8, 10):  # a quarter of each is a round tick
        if v <= m * exp:
            return m * exp
    return 10 * exp


def _axis(v: float) -> str:
    return f"{v:g}" if v >= 1 or v == 0 else f"{v:.2g}"


def _width_words(seconds: float) -> str:
    if seconds >= 7 * 86400 and seconds % (7 * 86400) == 0:
        return "week"
    if seconds >= 86400:
        return "day" if seconds == 86400 else f"{seconds / 86400:g} days"
    return "hour" if seconds == 3600 else f"{seconds / 3600:g} hours"


# --------------------------------------------------------------------------- suggestions
def suggestion_rows(suggestions: list[dict] | None) -> list[dict[str, Any]]:
    """The right-sizing suggestions as the pages list them: who, what, why."""
    out = []
    for s in suggestions or []:
        who = f"group {s['group']}" if s.get("group") and not s.get("user") else (s.get("user") or "")
        out.append({"who": who, "user": s.get("user") or "", "group": s.get("group") or "", "kind": s.get("kind") or "",
                    "text": s.get("text") or "", "suggested": s.get("suggested") or None})
    return out


# --------------------------------------------------------------------------- what the pages show
def _cost_note(report: dict | None) -> str:
    r = report or {}
    cur = r.get("currency") or ""
    if not r.get("priced", cur != "" or any(x.get("cost") for x in r.get("rows") or [])):
        return "No prices are set (c.GPULeaseUsage.prices), so nothing is costed."
    idle = r.get("charge_idle")
    said = {True: "idle held time is charged", False: "only busy time is charged"}.get(idle, "")
    return f"Prices per GPU-hour of each model{f' in {cur}' if cur else ''}; a share or a MIG slice costs its fraction" + (f"; {said}." if said else ".")


async def admin_usage(source, period: dict[str, Any]) -> dict[str, Any]:
    """The admin page's usage section for ``period`` (see :func:`parse_period`), from ``source``
    (a :class:`UsageSource`)."""
    span = dict(start=period["start"], end=period["end"])
    step = "day" if bucket_width(period["start"], period["end"], 3600) >= 86400 else "hour"  # fewer rows for a long period
    by_group, by_model, by_user, group_series, model_series, suggestions = await asyncio.gather(
        source.report(by="group", **span), source.report(by="model", **span), source.report(by="user", **span),
        source.series(by="group", step=step, **span), source.series(by="model", step=step, **span), source.suggestions())
    charts = []
    for by, data, title in (("group", group_series, "Held vs busy GPU-hours by group"), ("model", model_series, "Held vs busy GPU-hours by GPU model")):
        c = svg_chart(data, start=period["start"], end=period["end"], title=title, chart_id=f"usage-chart-{by}")
        c["by"] = by.capitalize() if by != "model" else "Model"
        charts.append(c)
    return {
        "period": period, "periods": PERIODS, "currency": by_group.get("currency") or "",
        "by_group": report_rows(by_group), "by_model": report_rows(by_model), "total": totals_row(by_group),
        "idle": top_idle(by_user), "charts": charts, "suggestions": suggestion_rows(suggestions),
        "cost_note": _cost_note(by_group),
    }


async def my_usage(source, user: str, period: dict[str, Any]) -> dict[str, Any]:
    """"my leases": ``user``'s own figures per model and per notebook, and their right-sizing hints."""
    span = dict(start=period["start"], end=period["end"], user=user)
    by_model, by_notebook, suggestions = await asyncio.gather(
        source.report(by="model", **span), source.report(by="notebook", **span), source.suggestions(user=user))
    return {
        "period": period, "periods": PERIODS, "currency": by_model.get("currency") or "",
        "by_model": report_rows(by_model), "by_notebook": [r for r in report_rows(by_notebook) if r["key"] != "(none)"],
        "total": totals_row(by_model), "hints": [s for s in suggestion_rows(suggestions) if s["user"] == user],
    }


class UsageSource:
    """The broker's usage report as the pages read it: ``report``, ``series``, ``suggestions`` and
    ``csv`` in the shapes of the REST API, each query run off the event loop."""

    def __init__(self, api):
        self.api = api

    @classmethod
    def of(cls, broker) -> UsageSource | None:
        """The source of a running broker, or None when it keeps no usage records."""
        api = getattr(broker, "usage", None)
        return cls(api) if api is not None else None

    async def _off_loop(self, fn, /, *args, **kw):
        return await asyncio.get_running_loop().run_in_executor(None, functools.partial(fn, *args, **kw))

    async def report(self, *, by: str, start: float, end: float, user: str | None = None) -> dict:
        return await self._off_loop(self.api.report, by=by, start=start, end=end, user=user)

    async def series(self, *, by: str, start: float, end: float, step: str = "hour", user: str | None = None) -> dict:
        return await self._off_loop(self.api.series, by=by, start=start, end=end, step=step, user=user)

    async def suggestions(self, *, user: str | None = None) -> list[dict]:
        return await self._off_loop(self.api.suggestions, user=user)

    async def csv(self, *, by: str, start: float, end: float, user: str | None = None) -> str:
        return await self._off_loop(self.api.csv, by=by, start=start, end=end, user=user)
