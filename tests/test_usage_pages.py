"""The usage pages: what an admin and a user read about where the GPU-hours went.

The pure parts first (the period picker's input, the server-drawn plots, the spawn form's hint on
the card it suggests); then the pages themselves from a real broker behind a real JupyterHub,
with usage records written by the broker's own recorder, read as their text.
"""

from __future__ import annotations

import re
import time

import pytest

from jupyter_gpulease.broker import usage_pages as up
from jupyter_gpulease.core.model import BadRequest
from jupyter_gpulease.hub import form

NOW = 1_800_000_000.0
A100 = "A100-SXM4-80GB"


# --------------------------------------------------------------------------- the period
def test_a_period_is_a_span_back_from_now_or_a_range_of_whole_days():
    p = up.parse_period("7d", None, None, NOW)
    assert (p["start"], p["end"], p["words"], p["query"]) == (NOW - 7 * 86400, NOW, "last 7 days", "since=7d")
    assert up.parse_period(None, None, None, NOW)["since"] == "30d"
    assert up.parse_period("12h", None, None, NOW)["start"] == NOW - 12 * 3600
    p = up.parse_period("30d", "2026-11-01", "2026-11-30", time.time())
    assert p["start"] == 1793491200.0 and p["end"] == 1793491200.0 + 30 * 86400  # the last day counts whole
    assert p["words"] == "2026-11-01 to 2026-11-30" and p["query"] == "from=2026-11-01&to=2026-11-30"


@pytest.mark.parametrize(("since", "start", "end", "field", "words"), [
    ("soon", None, None, "since", "like 30d"),
    ("0d", None, None, "since", "more than nothing"),
    ("9999w", None, None, "since", "at most 3 years"),
    ("30d", "1.11.2026", None, "from", "a date like"),
    ("30d", "2026-02-30", None, "from", "not a date"),
    ("30d", None, "2026-11-30", "from", "first day"),
    ("30d", "2026-11-30", "2026-11-01", "to", "before its first"),
])
def test_a_bad_period_is_refused_naming_the_field(since, start, end, field, words):
    with pytest.raises(BadRequest) as info:
        up.parse_period(since, start, end, NOW)
    assert info.value.field == field and words in info.value.message


# --------------------------------------------------------------------------- the plots
def series(points: dict[str, list[tuple[float, float, float]]]) -> dict:
    return {"step_s": 3600, "series": [{"key": k, "points": [{"t": t, "held_gpu_h": h, "busy_gpu_h": b} for t, h, b in v]}
                                       for k, v in points.items()]}


def test_the_plot_is_an_inline_svg_whose_legend_adds_up_to_the_series():
    start = NOW - 86400
    s = series({"physics": [(start + i * 3600, 2.0, 0.5) for i in range(24)], "chemistry": [(start + 3600, 1.0, 1.0)]})
    chart = up.svg_chart(s, start=start, end=NOW, title="Held vs busy by group", chart_id="c1")
    svg = chart["svg"]
    assert svg.startswith("<svg ") and svg.endswith("</svg>")
    # nothing fetched from anywhere: no link, script or image in it
    assert not re.search(r"(href|src)=|<script|<image|url\(", svg)
    assert [x["key"] for x in chart["legend"]] == ["physics", "chemistry"]  # most held first
    assert chart["legend"][0] | {} == {"key": "physics", "color": up.PALETTE[0], "held": "48.0", "busy": "12.0", "ratio": "25%"}
    assert chart["legend"][1]["held"] == "1.00" and chart["legend"][1]["ratio"] == "100%"
    assert svg.count("<polyline") == 4  # held and busy per group
    assert chart["bucket"] == "hour"
    # 90 days are drawn by the day, points outside the period are left out
    long = up.svg_chart(series({"x": [(NOW - 100 * 86400, 5.0, 5.0), (NOW - 3600, 1.0, 0.0)]}), start=NOW - 90 * 86400, end=NOW, title="t", chart_id="c2")
    assert long["bucket"] == "day" and long["legend"][0]["held"] == "1.00"


def test_an_empty_period_draws_an_empty_plot_that_says_so():
    chart = up.svg_chart({"series": []}, start=NOW - 86400, end=NOW, title="t", chart_id="c")
    assert chart["legend"] == [] and "no GPU time in this period" in chart["svg"]


def test_the_top_idle_holders_are_those_with_the_most_idle_hours():
    report = {"rows": [{"key": "ann", "held_gpu_h": 10, "idle_gpu_h": 1}, {"key": "bob", "held_gpu_h": 50, "idle_gpu_h": 40},
                       {"key": "cy", "held_gpu_h": 5, "idle_gpu_h": 0}]}
    assert [r["key"] for r in up.top_idle(report)] == ["bob", "ann"]
    assert up.top_idle(report)[0]["idle"] == "40.0"


# --------------------------------------------------------------------------- the spawn form's hint
POOL = {
    "capacity": {A100: {"idle_gpus": 1, "largest_free_share": 1.0, "free_share": 1.0, "memory_mib": 81920,
                        "mig": {"1g.10gb": {"free": 7, "total": 7}}}},
    "devices": [{"model": A100, "node": "n1", "memory_mib": 81920, "mig": [{"profile": "1g.10gb"}] * 7},
                {"model": A100, "node": "n1", "memory_mib": 81920}],
}
OVER_ASKING = {"user": "alice", "kind": "memory",
               "text": "asks 1 × A100 80 GB, peak memory 9 GB in 95% of leases: a 1g.10gb slice or a 0.25 share would do",
               "suggested": {"kind": "mig", "profile": "1g.10gb", "model": A100}}


def cards(html: str) -> dict[str, str]:
    """The form's cards by their choice value, as text without tags."""
    out = {}
    for m in re.finditer(r'<label class="gpulease-card[^"]*"[^>]*>(.*?)</label>', html, re.S):
        value = re.search(r'value="([^"]+)"', m.group(1)).group(1)
        out[value] = re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", m.group(1))).strip()
    return out


def checked(html: str) -> list[str]:
    return re.findall(r'value="([^"]+)" checked', html)


def test_the_hint_shows_on_the_card_it_suggests_and_the_choice_stays_the_users():
    plain = form.render_form(POOL, previous={"gpus": 1, "model": A100})
    hinted = form.render_form(POOL, previous={"gpus": 1, "model": A100}, suggestions=[OVER_ASKING])
    assert checked(plain) == checked(hinted) == [f"gpu:1:{A100}"]
    c = cards(hinted)
    assert "Suggested from your past leases: asks 1 × A100 80 GB, peak memory 9 GB in 95% of leases" in c[f"mig:1g.10gb:{A100}"]
    assert [v for v, text in c.items() if "Suggested" in text] == [f"mig:1g.10gb:{A100}"]
    # a share suggested by its fraction finds the share card
    share = dict(OVER_ASKING, suggested={"kind": "share", "fraction": 0.25, "model": A100})
    assert "Suggested" in cards(form.render_form(POOL, suggestions=[share]))[f"share:0.25:{A100}"]


def test_a_hint_without_a_card_shows_above_the_cards_and_nothing_is_made_up():
    duration = {"user": "alice", "kind": "duration", "text": "asks 8 h, uses 2 h at the median", "suggested": None}
    elsewhere = dict(OVER_ASKING, suggested={"kind": "mig", "profile": "1g.10gb", "model": "H100-SXM5-80GB"})
    html = form.render_form(POOL, suggestions=[duration, elsewhere])
    hints = re.findall(r'<div class="gpulease-hint" role="note">([^<]*)</div>', html)
    assert hints == ["From your past leases: asks 8 h, uses 2 h at the median",
                     "From your past leases: " + OVER_ASKING["text"]]
    assert not any("Suggested" in t for t in cards(html).values())
    assert "gpulease-hint" not in form.render_form(POOL, suggestions=[]).split("</style>")[1]


def test_the_form_asks_the_broker_for_the_users_own_suggestions_only():
    import asyncio

    class Broker:
        asked = []

        async def pool(self, user, groups):
            return POOL

        async def queue(self):
            return []

        async def estimate(self, asks):
            return [{"start": "now"} for _ in asks]

        async def usage_suggestions(self, user):
            self.asked.append(user)
            return [OVER_ASKING, dict(OVER_ASKING, user="bob", text="bob's")]

    b = Broker()
    html = asyncio.run(form.render_for(b, user="alice", groups=[], presets=[], allow_custom=True, allow_cpu_only=True))
    assert b.asked == ["alice"]
    assert "bob's" not in html and OVER_ASKING["text"] in cards(html)[f"mig:1g.10gb:{A100}"]
