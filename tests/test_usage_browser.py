"""Headless Chromium against the demo hub: where the GPU-hours went, as the people who look see it.

Before the demo starts, its store gets three weeks of usage records written by a broker's own
recorder (tests/usage_seed.py): alice asked for a whole A100 80 GB twenty times and never used
more than 9 GB of it, bob used the L4s he asked for. Then:

* alice's spawn form shows the right-sizing hint on the card it suggests (a smaller slice) and
  her shorter-duration hint by the duration field; the card that starts chosen and the
  duration are still the ones they would be without the hints;
* her "my leases" page shows her own GPU-hours and the same hint;
* the admin's broker page shows the suggestion for alice, the cost table for the period (prices
  per GPU-hour of each model from the broker's config) and the plots, drawn without the network.

Screenshots go to test-artifacts/usage/ (the README shows them).
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from browserutil import ROOT, card, chromium_browser, demo_config, login
from test_demo import Demo
from usage_seed import seed

pytestmark = pytest.mark.timeout(400)

ARTIFACTS = ROOT / "test-artifacts" / "usage"
A100 = "A100-SXM4-80GB"
PRICES = {A100: 2.5, "L4": 0.8}


def usage_config(tmp_path: Path) -> Path:
    """The example configs, with prices per GPU-hour in the broker's."""
    return demo_config(tmp_path, news=True, broker=f"c.GPULeaseUsage.prices = {PRICES!r}\nc.GPULeaseUsage.currency = 'EUR'\n")


def suggestion_for(user: str, db_url: str) -> dict:
    """What the broker's usage report suggests for ``user`` on the demo's pool, from the store itself."""
    from jupyter_gpulease.broker.usage import UsageAPI, offers_of
    from jupyter_gpulease.devices.simulated import DEFAULT_POOL, SimulatedBackend
    from jupyter_gpulease.store import LeaseStore

    store = LeaseStore(db_url, migrate=False)
    try:
        offers = offers_of(SimulatedBackend({"gpus": DEFAULT_POOL}).inventory())
        found = [s for s in UsageAPI(store, offers=offers).suggestions(user=user) if s.get("user") == user and s["kind"] == "memory"]
    finally:
        store.close()
    assert len(found) == 1, found
    return found[0]


def test_an_over_asking_user_sees_the_hint_on_the_card_it_suggests_and_the_admin_sees_it_with_the_cost(tmp_path, playwright_sync_api, chromium):
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    state = tmp_path / "state"
    state.mkdir()
    seed(state, time.time(), db_name="gpulease.sqlite")  # the demo's store
    # what the usage report suggests for alice, and which card of the form that is: a quarter of
    # the A100 that is not in MIG mode (9000 MiB with headroom fits in its 20 GB; the MIG slices are 40 GB)
    hint = suggestion_for("alice", f"sqlite:///{state / 'gpulease.sqlite'}")
    assert hint["suggested"] | {} == {"kind": "share", "model": A100, "share": 0.25, "memory_mib": 20480}, hint
    assert hint["text"].startswith("asks 1 × A100-SXM4-80GB (80 GB), peak memory 8.8 GB in 95% of leases: a 0.25 share"), hint
    value = f"share:0.25:{A100}"
    demo = Demo(state, config_dir=usage_config(tmp_path)).start()
    try:
        with chromium_browser(playwright_sync_api, chromium) as browser:
            page = browser.page(1280, 1000)
            requests = []
            page.on("request", lambda r: requests.append(r.url))
            login(page, demo, "alice")
            suggested = card(page, value)
            suggested.scroll_into_view_if_needed()
            shown = suggested.locator(".gpulease-hint").inner_text()
            assert shown == f"Suggested from your past leases: {hint['text']}"
            # only that card carries it, and the choice the form starts with is not changed by it
            assert page.locator("label.gpulease-card .gpulease-hint", has_text=hint["text"]).count() == 1
            first = page.locator("input[name=choice]:checked").get_attribute("value")
            assert first != value
            # her other hint, a shorter duration, is by the duration field, which keeps the tier's default
            assert page.locator(".gpulease-duration-hint").inner_text().startswith(
                "Suggested from your past leases: asks 8 h, uses 2 h at the median: ")
            assert page.locator("#gpulease-duration").input_value() == ""
            assert page.locator("label.gpulease-card .gpulease-hint").count() == 1
            page.locator(".gpulease-choices").screenshot(path=str(ARTIFACTS / "01-spawn-form-hint-on-the-suggested-card.png"))
            page.screenshot(path=str(ARTIFACTS / "02-spawn-form.png"), full_page=True)

            # alice's own page: her figures and the hint
            page.goto(f"{demo.url}/services/gpulease/")
            summary = page.locator("#usage-summary").inner_text()
            assert re.search(r"Last 30 days: you held GPUs for [\d.,]+ GPU-hours and used them for", summary), summary
            assert hint["text"] in page.locator("#usage-hints").inner_text()
            page.locator("#usage-mine").screenshot(path=str(ARTIFACTS / "03-my-leases-usage.png"))

            # the admin's page: the suggestion for alice, the cost table, the plots
            admin = browser.page(1280, 1000)
            admin.on("request", lambda r: requests.append(r.url))
            login(admin, demo, "admin")
            admin.goto(f"{demo.url}/services/gpulease/admin")
            rows = admin.locator("#usage-suggestions tr", has_text="alice")
            assert rows.count() >= 1 and hint["text"] in rows.first.inner_text()
            # the cost of the seeded hours: 40 A100-hours at 2.50, 12 L4-hours at 0.80, 2 hours of half an L4
            cost = admin.locator("#usage-cost")
            for group, eur in (("physics", "100.00 EUR"), ("chemistry", "9.60 EUR"), ("none", "0.80 EUR")):
                assert cost.locator("tr", has=admin.locator("td", has_text=re.compile(f"^{group}$"))).inner_text().endswith(eur)
            assert cost.locator("tr.total").inner_text().endswith("110.40 EUR")
            assert admin.locator("svg.usage-chart").count() == 2
            assert "alice" in admin.locator("#usage-idle").inner_text()
            admin.locator("#usage-admin").screenshot(path=str(ARTIFACTS / "04-admin-usage.png"))
            # nothing was fetched from outside the hub
            assert all(u.startswith((demo.url, "data:", "blob:")) for u in requests), \
                [u for u in requests if not u.startswith(demo.url)]
    finally:
        demo.stop()
