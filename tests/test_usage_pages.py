"""The usage pages: what an admin and a user read about where the GPU-hours went.

The pure parts first (the period picker's input, the server-drawn plots, the spawn form's hint on
the card it suggests); then the pages themselves from a real broker behind a real JupyterHub,
with usage records written by the broker's own recorder, read as their text.
"""

from __future__ import annotations

import csv
import io
import re
import time
import urllib.error

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


def test_a_shorter_duration_is_suggested_by_the_duration_field_without_choosing_it():
    duration = {"user": "alice", "kind": "duration", "text": "asks 8 h, uses 2 h at the median: 2 h would do for 90% of leases",
                "suggested": {"kind": "whole", "model": A100, "gpus": 1, "memory_mib": 81920, "duration_s": 7200}}
    html = form.render_form(POOL, previous={"gpus": 1, "model": A100, "duration_h": 8}, suggestions=[duration])
    assert re.findall(r'<div class="gpulease-hint gpulease-duration-hint" role="note">([^<]*)</div>', html) == [
        "Suggested from your past leases: asks 8 h, uses 2 h at the median: 2 h would do for 90% of leases"]
    assert '<option value="2" data-s="7200">2 h (suggested from your past leases)</option>' in html
    assert re.findall(r'<option value="([^"]+)"[^>]* selected>', html.split('id="gpulease-duration"')[1].split("</select>")[0]) == ["8"]
    assert not any("Suggested" in t for t in cards(html).values())


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


def test_the_form_renders_without_hints_when_the_broker_has_none_to_give():
    import asyncio

    from jupyter_gpulease.client import BrokerError

    class Broker:
        async def pool(self, user, groups):
            return POOL

        async def queue(self):
            return []

        async def estimate(self, asks):
            return [{"start": "now"} for _ in asks]

        async def usage_suggestions(self, user):
            raise BrokerError(404, "no such API: an older broker")

    html = asyncio.run(form.render_for(Broker(), user="alice", groups=[], presets=[], allow_custom=True, allow_cpu_only=True))
    assert f"gpu:1:{A100}" in cards(html) and "gpulease-hint" not in html.split("</style>")[1]


# --------------------------------------------------------------------------- the pages, from a real broker
PRICES = {A100: 2.5, "L4": 0.8}


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """A real hub whose broker reads a store with a month of usage (tests/usage_seed.py), with prices."""
    from brokerhub import hub_for_broker, wait_for_broker
    from usage_seed import POOL as SEED_POOL
    from usage_seed import seed

    tmp = tmp_path_factory.mktemp("usage-pages")
    expected = seed(tmp, time.time())
    h = hub_for_broker(tmp, db_url=f"sqlite:///{tmp / 'gpulease.sqlite'}", pool=SEED_POOL, extra_config=(
        f"c.GPULeaseUsage.prices = {PRICES!r}\n"
        "c.GPULeaseUsage.currency = 'EUR'\n"))
    h.start()
    try:
        wait_for_broker(h, h.create_token("carol"))
        h.expected = expected
        yield h
    finally:
        h.stop()


def text_of(html: str, element_id: str) -> str:
    """The text of the element with ``id`` (a table, a paragraph or a div), tags dropped, spaces squeezed."""
    m = re.search(rf'<(\w+)[^>]*\bid="{re.escape(element_id)}"[^>]*>(.*?)</\1>', html, re.S)
    assert m, f"no element #{element_id} on the page"
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", m.group(2))).replace(" ,", ",").strip()


def row_of(html: str, table_id: str, first_cell: str) -> str:
    m = re.search(rf'<table[^>]*\bid="{re.escape(table_id)}"[^>]*>(.*?)</table>', html, re.S)
    assert m, f"no table #{table_id}"
    for tr in re.findall(r"<tr[^>]*>(.*?)</tr>", m.group(1), re.S):
        cells = [re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", c)).strip() for c in re.findall(r"<t[dh][^>]*>(.*?)</t[dh]>", tr, re.S)]
        while cells and not cells[0]:  # a colour swatch
            cells.pop(0)
        if cells and cells[0] == first_cell:
            return " | ".join(cells)
    raise AssertionError(f"no row {first_cell!r} in #{table_id}")


def get(opener, url: str) -> str:
    return opener.open(url, timeout=60).read().decode()


def test_the_admin_page_says_where_the_gpu_hours_went_and_what_they_cost(hub):
    e = hub.expected
    held = sum(v["held"] for v in e.values()) / 3600
    busy = sum(v["busy"] for v in e.values()) / 3600
    assert (held, busy) == (53.0, 19.25)  # 20 × 2 h of an A100, 6 × 2 h of an L4, 2 × 1 h of half an L4
    page = get(hub.login("carol"), hub.service_url("gpulease") + "admin")
    summary = text_of(page, "usage-summary")
    assert summary.startswith(f"Last 30 days: {up.hours(held)} GPU-hours held, {up.hours(busy)} busy (36%), {up.hours(held - busy)} idle; "
                              "cost 110.40 EUR."), summary
    # cost per group: a whole A100-hour costs 2.50, an L4-hour 0.80, half an L4 for an hour 0.40
    assert row_of(page, "usage-cost", "physics") == "physics | 20 | 40.0 | 10.0 | 30.0 | 25% | 0 s / 0 s | 0 | 0 | 0 | 100.00 EUR"
    assert row_of(page, "usage-cost", "chemistry").endswith("| 12.0 | 9.00 | 3.00 | 75% | 0 s / 0 s | 0 | 0 | 0 | 9.60 EUR")
    assert row_of(page, "usage-cost", "none").endswith("| 1.00 | 0.25 | 0.75 | 25% | 0 s / 0 s | 0 | 0 | 0 | 0.80 EUR")
    assert row_of(page, "usage-cost", "All").startswith("All | 28 | 53.0 | 19.2")
    assert row_of(page, "usage-models", A100).endswith("| 100.00 EUR")
    # the top idle holders, most idle first
    idle = text_of(page, "usage-idle")
    assert idle.index("alice") < idle.index("bob") < idle.index("carol")
    assert row_of(page, "usage-idle", "alice").startswith("alice | 30.0 | 40.0 | 25%")
    # right-sizing: alice's whole A100 for 9 GB
    suggestion = row_of(page, "usage-suggestions", "alice")
    assert "asks 1 × A100" in suggestion and "peak memory" in suggestion and "would do" in suggestion
    # the plots: both drawn, their legends add up to the report
    assert page.count('<svg xmlns="http://www.w3.org/2000/svg" class="usage-chart"') == 2
    assert row_of(page, "usage-chart-group-legend", "physics").endswith("| 40.0 | 10.0 | 25%")
    assert row_of(page, "usage-chart-model-legend", "L4").endswith("| 13.0 | 9.25 | 71%")
    assert not re.search(r'<(script|link|img)[^>]+(src|href)="https?://', page), "the page must not load anything from elsewhere"


def test_the_admin_page_picks_its_period_and_refuses_a_bad_one(hub):
    carol = hub.login("carol")
    base = hub.service_url("gpulease")
    week = get(carol, base + "admin?since=7d")
    assert text_of(week, "usage-summary").startswith("Last 7 days: ")
    assert re.search(r'<option value="7d" selected>last 7 days</option>', week)
    # a long period is drawn by the day, and its plots still add up to the same hours
    quarter = get(carol, base + "admin?since=90d")
    assert text_of(quarter, "usage-summary").startswith("Last 90 days: 53.0 GPU-hours held, 19.2 busy")
    assert row_of(quarter, "usage-chart-group-legend", "physics").endswith("| 40.0 | 10.0 | 25%")
    assert "GPU-hours per day" in quarter
    assert get(carol, base + "admin?from=2000-01-01&to=2000-01-31").count("no leases in this period") == 2
    with pytest.raises(urllib.error.HTTPError) as info:
        carol.open(base + "admin?since=soon", timeout=60)
    assert info.value.code == 400
    assert "the period is a number and a unit, like 30d, 12h or 2w, not &#39;soon&#39;" in info.value.read().decode()


def test_the_csv_download_has_every_row_for_admins_and_only_their_own_for_users(hub):
    base = hub.service_url("gpulease")
    with hub.login("carol").open(base + "admin/usage.csv?since=30d&by=user", timeout=60) as r:
        assert r.headers["Content-Type"].startswith("text/csv") and "attachment" in r.headers["Content-Disposition"]
        rows = list(csv.reader(io.StringIO(r.read().decode())))
    assert rows[0][:4] == ["user", "held_gpu_h", "busy_gpu_h", "idle_gpu_h"]
    assert {r[0] for r in rows[1:]} == {"alice", "bob", "carol", "total"}
    alice = hub.login("alice")
    with alice.open(base + "usage.csv?since=30d&by=notebook", timeout=60) as r:
        mine = list(csv.reader(io.StringIO(r.read().decode())))
    assert [r[0] for r in mine[1:]] == ["thesis/train.ipynb", "total"]
    with pytest.raises(urllib.error.HTTPError) as info:
        alice.open(base + "admin/usage.csv?since=30d", timeout=60)
    assert info.value.code == 403
    with pytest.raises(urllib.error.HTTPError) as info:
        alice.open(base + "usage.csv?by=colour", timeout=60)
    assert info.value.code == 400


def test_my_leases_shows_my_own_figures_per_notebook_and_my_hint(hub):
    page = get(hub.login("alice"), hub.service_url("gpulease"))
    assert text_of(page, "usage-summary") == ("Last 30 days: you held GPUs for 40.0 GPU-hours and used them for 10.0 (25% busy); "
                                              "30.0 GPU-hours were idle; cost 100.00 EUR. 20 leases, 0 reclaimed while idle.")
    assert row_of(page, "usage-mine-notebooks", "thesis/train.ipynb") == "thesis/train.ipynb | 40.0 | 10.0 | 30.0 | 25%"
    hint = text_of(page, "usage-hints")
    assert hint.startswith("Hint: asks 1 × A100") and "would do" in hint
    # nobody else's figures
    assert "md/run.ipynb" not in page and "chemistry" not in page
    bob = get(hub.login("bob"), hub.service_url("gpulease"))
    assert row_of(bob, "usage-mine-notebooks", "md/run.ipynb").startswith("md/run.ipynb | 12.0 | 9.00")
    assert "usage-hints" not in bob  # he uses what he asks for
