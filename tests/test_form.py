"""The spawn form as a researcher reads it: a card per choice, what is free, the broker's estimate
for exactly that request, the tier's limits, and nothing the user's quota can never allow."""

from __future__ import annotations

import asyncio
import re
from html.parser import HTMLParser

import pytest

from jupyter_gpulease.hub import form as spawn_form
from jupyter_gpulease.hub.options import parse_presets, parse_user_options

A100 = "A100-SXM4-80GB"
NOW = 1_000_000.0


def pool(**over):
    p = {
        "devices": [
            {"uuid": "GPU-a0", "node": "n1", "index": 0, "model": A100, "memory_mib": 81920,
             "mig": [{"uuid": "MIG-a0-0", "profile": "3g.40gb", "memory_mib": 40960, "index": 0},
                     {"uuid": "MIG-a0-1", "profile": "3g.40gb", "memory_mib": 40960, "index": 1}], "healthy": True},
            *[{"uuid": f"GPU-a{i}", "node": "n2", "index": i, "model": A100, "memory_mib": 81920, "mig": [], "healthy": True}
              for i in range(1, 5)],
            {"uuid": "GPU-l0", "node": "n1", "index": 2, "model": "L4", "memory_mib": 23034, "mig": [], "healthy": True},
            {"uuid": "GPU-l1", "node": "n1", "index": 3, "model": "L4", "memory_mib": 23034, "mig": [], "healthy": True},
        ],
        "capacity": {
            A100: {"gpus": 5, "memory_mib": 81920, "idle_gpus": 3, "free_share": 3.0, "largest_free_share": 1.0,
                   "mig": {"3g.40gb": {"total": 2, "free": 1}}},
            "L4": {"gpus": 2, "memory_mib": 23034, "idle_gpus": 0, "free_share": 0.5, "largest_free_share": 0.5, "mig": {}},
        },
        "tiers": [
            {"name": "course", "priority": 10, "max_duration_s": 4 * 3600, "default_duration_s": 3600, "preemptible": True,
             "preempted_by": ["research"], "grace_s": 600, "description": "courses"},
            {"name": "research", "priority": 20, "max_duration_s": 8 * 3600, "default_duration_s": 7200, "preemptible": False},
        ],
        "default_tier": "course",
        "usage": {"gpus_held": 0, "max_gpus": 4, "gpus_left": 2,
                  "group_quotas": {"students": {"max_gpus": 2, "gpus_held": 0, "gpus_left": 2}}},
        "queue_length": 1,
        "min_duration_s": 600,
    }
    p.update(over)
    return p


class Cards(HTMLParser):
    """The radio cards of the form: value -> text of its card; and which one is checked."""

    def __init__(self, html: str):
        super().__init__()
        self.cards: dict[str, str] = {}
        self.disabled: set[str] = set()
        self.checked = ""
        self._value = None
        self._depth = 0
        self._hidden = 0
        self.feed(html)

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if self._value is not None and tag == "span" and "hidden" in a:
            self._hidden += 1
        if tag == "label" and "gpulease-card" in (a.get("class") or ""):
            self._depth = 1
            self._value = ""
        elif self._value == "" and tag == "input" and a.get("name") == "choice":
            self._value = a["value"]
            self.cards[self._value] = ""
            if "checked" in a:
                self.checked = self._value
            if "disabled" in a:
                self.disabled.add(self._value)

    def handle_endtag(self, tag):
        if tag == "span" and self._hidden:
            self._hidden -= 1
        if tag == "label" and self._value is not None:
            self._value = None

    def handle_data(self, data):
        if self._value and not self._hidden and data.strip():
            self.cards[self._value] += " " + " ".join(data.split())


def test_a_card_per_choice_with_memory_free_count_and_the_brokers_estimate_for_the_chosen_tier():
    estimates = {
        ("gpu:1:L4", "course"): {"start": "queued", "position": 2, "length": 1, "eta": NOW + 72 * 60},
        ("gpu:1:L4", "research"): {"start": "queued", "position": 1, "length": 1, "eta": NOW + 30 * 60},
        ("gpu:1:" + A100, "course"): {"start": "now"},
        ("gpu:1:" + A100, "research"): {"start": "now"},
    }
    html = spawn_form.render_form(pool(), estimates=estimates, now=NOW)
    cards = Cards(html).cards
    assert "80 GB of GPU memory, the whole GPU" in cards["gpu:1:" + A100]
    assert "3 of 4 idle" in cards["gpu:1:" + A100]
    assert "starts now" in cards["gpu:1:" + A100]
    # the estimate of the default tier is shown; the other tier's is in the page for the tier selector
    assert "you would be 2nd in the queue; starts in about 1 h 12 min" in cards["gpu:1:L4"]
    assert "1st in the queue" not in cards["gpu:1:L4"]
    assert 'data-tier="research" hidden>you would be 1st in the queue; starts in about 30 min' in html
    assert "11 GB of GPU memory and 50% of its compute" in cards["share:0.5:L4"]
    assert "40 GB of GPU memory in a MIG slice" in cards["mig:3g.40gb:" + A100]
    assert "1 of 2 free" in cards["mig:3g.40gb:" + A100]
    assert "a CPU-only server" in cards["cpu"]


def test_the_form_never_offers_more_gpus_than_the_users_or_groups_quota_allows():
    """Issue 14: a student whose group may hold 2 GPUs is not offered 3 or 4 A100s (refused only on submit before)."""
    cards = Cards(spawn_form.render_form(pool(), now=NOW)).cards
    whole = sorted(v for v in cards if v.startswith("gpu:") and v.endswith(A100))
    assert whole == ["gpu:1:" + A100, "gpu:2:" + A100]
    assert "at most 2 at a time" in spawn_form.render_form(pool(), now=NOW)
    # without a group quota, the user's own (4) is the limit, and n2 has four A100s
    usage = {"gpus_held": 0, "max_gpus": 4}
    cards = Cards(spawn_form.render_form(pool(usage=usage), now=NOW)).cards
    assert sorted(v for v in cards if v.startswith("gpu:") and v.endswith(A100))[-1] == "gpu:4:" + A100
    # a quota under one GPU leaves shares of that size only
    usage = {"gpus_held": 0, "max_gpus": 0.25}
    cards = Cards(spawn_form.render_form(pool(usage=usage), now=NOW)).cards
    assert not [v for v in cards if v.startswith("gpu:")]
    assert "share:0.25:L4" in cards and "share:0.5:L4" not in cards


def test_the_quota_line_names_the_group_limit_and_the_tier_limits_say_how_long():
    html = spawn_form.render_form(pool(min_duration_s=1200), now=NOW)
    assert "You hold 0 GPUs of at most 4 (group students: 0 of 2 held by its members)." in html
    assert "course — up to 4 h; 1 h unless you choose; research may preempt it after a 10 min warning (courses)" in html
    assert "research — up to 8 h; 2 h unless you choose" in html
    # the default duration says how long, and nothing under the hub's minimum lease is offered
    assert "the tier's default (1 h)" in html
    assert "(at least 20 min)" in html
    durations = re.findall(r'<option value="([\d.]+)" data-s=', html)
    assert "0.25" not in durations and "0.5" in durations and "8" in durations and "12" not in durations


def test_what_is_free_and_what_waits_is_shown_above_the_cards():
    queue = [{"id": "q1", "state": "queued", "request": {"kind": "gpu", "gpus": 1, "model": ["L4"]}}]
    html = spawn_form.render_form(pool(), queue=queue, now=NOW)
    rows = re.findall(r"<tr><td>(.*?)</td><td>(.*?)</td><td>(.*?)</td><td>(.*?)</td><td>(.*?)</td></tr>", html)
    assert (A100, "3 of 4 idle", "3 GPUs free in all; the largest share that fits is a whole GPU", "3g.40gb: 1 of 2 free", "0") in rows
    assert ("L4 (22 GB)", "0 of 2 idle", "half a GPU free", "–", "1") in rows
    # the share cards say what fits in words: no 'a 1 share', no '2 GPU'
    assert "room now for up to half a GPU" in html and "room now for up to a whole GPU" in html, html
    assert not re.search(r"a [\d.]+ share free|\b[02-9] GPU free", html)


def test_a_request_the_broker_would_refuse_says_why_and_a_preset_it_refuses_cannot_be_picked():
    estimates = {("preset:a100", ""): {"start": "never", "refused": {"field": "tier", "message": "tier 'research' is not one you may use"}},
                 ("preset:l4-half", ""): {"start": "now"}}
    presets = parse_presets([
        {"slug": "l4-half", "display_name": "Half an L4", "request": {"share": 0.5, "model": "L4"}, "tier": "course", "default": True},
        {"slug": "a100", "display_name": "One A100", "request": {"gpus": 1, "model": "A100*"}, "tier": "research"},
    ])
    parsed = Cards(spawn_form.render_form(pool(), presets=presets, allow_custom=False, estimates=estimates, now=NOW))
    assert "tier 'research' is not one you may use" in parsed.cards["preset:a100"]
    assert parsed.disabled == {"preset:a100"}
    assert parsed.checked == "preset:l4-half"
    assert "starts now" in parsed.cards["preset:l4-half"]


def test_the_previous_choice_is_checked_again_and_every_card_parses_as_valid_options():
    html = spawn_form.render_form(pool(), previous={"gpus": 2, "model": A100, "tier": "research", "duration_h": 4}, now=NOW)
    parsed = Cards(html)
    assert parsed.checked == "gpu:2:" + A100
    assert '<option value="research" data-max-s' in html and re.search(r'value="research"[^>]*selected', html)
    assert re.search(r'<option value="4" data-s="14400(\.0)?" selected>', html)
    for value in parsed.cards:
        opts = spawn_form.options_from_form({"choice": [value], "tier": ["research"], "duration_h": ["1"]})
        parse_user_options(opts, pool=pool())


def test_form_values_read_back_into_the_rest_apis_shape():
    assert spawn_form.options_from_form({"choice": ["gpu:1:L4"], "tier": ["course"], "duration_h": ["2"], "max_wait_min": [""]}) == {
        "gpus": 1, "model": "L4", "tier": "course", "duration_h": 2.0}
    assert spawn_form.options_from_form({"choice": ["cpu"], "duration_h": ["2"]}) == {"kind": "cpu"}
    assert spawn_form.options_from_form({"choice": ["share:0.5:L4"]}) == {"share": 0.5, "model": "L4"}
    assert spawn_form.options_from_form({"choice": ["mig:3g.40gb:" + A100]}) == {"mig_profile": "3g.40gb", "model": A100}
    # a preset fixes tier and duration: the free-choice fields posted with it are not used
    assert spawn_form.options_from_form({"choice": ["preset:a"], "tier": ["course"], "duration_h": ["2"]}) == {"preset": "a"}


def test_without_the_broker_the_form_still_offers_a_cpu_server_and_says_why():
    parsed = Cards(spawn_form.render_form(None, error="The GPU lease broker is not answering right now"))
    assert list(parsed.cards) == ["cpu"] and parsed.checked == "cpu"
    html = spawn_form.render_form(None, error="The GPU lease broker is not answering right now")
    assert "not answering right now" in html


@pytest.mark.parametrize("evil", ['<script>alert(1)</script>', '"><img src=x onerror=alert(1)>'])
def test_names_from_config_are_escaped(evil):
    p = pool(tiers=[{"name": evil, "priority": 1, "max_duration_s": 3600, "description": evil}])
    p["devices"][-1]["model"] = evil
    p["capacity"][evil] = p["capacity"].pop("L4")
    presets = parse_presets([{"slug": "x", "display_name": evil, "description": evil, "request": {"gpus": 1}}])
    html = spawn_form.render_form(p, presets=presets, now=NOW)
    assert evil not in html
    assert "&lt;" in html


def test_render_for_asks_the_broker_one_estimate_per_card_and_tier():
    class Broker:
        def __init__(self):
            self.asked = []

        async def pool(self, user, groups):
            return pool()

        async def queue(self):
            return []

        async def estimate(self, asks):
            assert len(asks) <= spawn_form.ESTIMATES_PER_CALL
            self.asked += asks
            return [{"start": "queued", "position": 3, "length": 2, "eta": None} for _ in asks]

    b = Broker()
    html = asyncio.run(spawn_form.render_for(b, user="alice", groups=["students"], presets=[], allow_custom=True, allow_cpu_only=True,
                                             now=NOW))
    cards = Cards(html).cards
    gpu_cards = [v for v in cards if v != "cpu"]
    assert len(b.asked) == 2 * len(gpu_cards)  # each card in each of the two tiers
    assert {a["tier"] for a in b.asked} == {"course", "research"}
    assert all(a["user"] == "alice" and a["groups"] == ["students"] for a in b.asked)
    assert "you would be 3rd in the queue; no estimate of the start yet" in cards["gpu:1:L4"]


# --------------------------------------------------------------------------- environments
class EnvCards(HTMLParser):
    """The environment section's cards: name -> text; which are disabled; which is checked."""

    def __init__(self, html: str):
        super().__init__()
        self.cards: dict[str, str] = {}
        self.disabled: set[str] = set()
        self.checked = ""
        self._value = None
        self._in_card = False
        self._hidden = 0
        self.feed(html)

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "label" and "gpulease-env" in (a.get("class") or "").split():
            self._in_card = True
        elif self._in_card and tag == "input" and a.get("name") == "environment":
            self._value = a["value"]
            self.cards[self._value] = ""
            if "checked" in a:
                self.checked = self._value
            if "disabled" in a:
                self.disabled.add(self._value)
        elif self._value is not None and tag == "span" and "hidden" in a:
            self._hidden += 1

    def handle_endtag(self, tag):
        if tag == "span" and self._hidden:
            self._hidden -= 1
        if tag == "label":
            self._in_card, self._value = False, None

    def handle_data(self, data):
        if self._value and not self._hidden and data.strip():
            self.cards[self._value] += " " + " ".join(data.split())


def _environment_offers():
    from jupyter_gpulease.hub.environments import offers, parse_environments

    envs = parse_environments([
        {"name": "torch", "display_name": "PyTorch 2.5", "image": "lab/torch:2.5-cuda12.4", "cuda": "12.4", "default": True,
         "description": "PyTorch, torchvision, JupyterLab"},
        {"name": "jax", "display_name": "JAX 0.4", "image": "lab/jax:0.4-cuda12.8", "cuda": "12.8", "models": ["H100*"]},
        {"name": "a100", "display_name": "Big models", "image": "lab/big:1", "cuda": "12.2", "models": ["A100*"], "size_bytes": 2_400_000_000},
    ])
    return offers(envs, driver_cuda="12.4", driver_version="550.54.15", present={"lab/torch:2.5-cuda12.4"}, sizes={})


def test_the_environment_section_comes_first_with_a_card_each_and_one_not_offered_says_why():
    html = spawn_form.render_form(pool(), environments=_environment_offers(), now=NOW)
    env = EnvCards(html)
    assert list(env.cards) == ["torch", "jax", "a100"]
    assert html.index("<legend>Environment</legend>") < html.index('name="choice"')  # before the GPU choice
    assert "PyTorch 2.5" in env.cards["torch"] and "CUDA 12.4" in env.cards["torch"] and "ready" in env.cards["torch"]
    assert "PyTorch, torchvision, JupyterLab" in env.cards["torch"]
    assert "CUDA 12.2 · for A100* GPUs" in env.cards["a100"] and "first start downloads up to ~2.4 GB" in env.cards["a100"]
    # the driver is too old for JAX's CUDA: shown, disabled, with the reason in words
    assert env.disabled == {"jax"}
    assert "not offered here: needs CUDA 12.8; the GPUs' driver (550.54.15) supports CUDA 12.4 at most" in env.cards["jax"]
    assert env.checked == "torch"  # the default
    # the GPU cards are as without environments, and say their model for the page's check
    assert Cards(html).cards.keys() == Cards(spawn_form.render_form(pool(), now=NOW)).cards.keys()
    assert 'value="gpu:1:L4" data-model="L4"' in html and 'value="cpu" data-model="" data-cpu="1"' in html


def test_the_previous_environment_is_checked_again_unless_it_is_not_offered():
    offers = _environment_offers()
    assert EnvCards(spawn_form.render_form(pool(), environments=offers, previous={"environment": "a100"}, now=NOW)).checked == "a100"
    assert EnvCards(spawn_form.render_form(pool(), environments=offers, previous={"environment": "jax"}, now=NOW)).checked == "torch"
    assert EnvCards(spawn_form.render_form(pool(), environments=offers, previous={"environment": "gone"}, now=NOW)).checked == "torch"


def test_without_environments_the_form_has_no_such_section():
    html = spawn_form.render_form(pool(), now=NOW)
    assert "Environment</legend>" not in html and 'type="radio" name="environment"' not in html and "data-model=" not in html
    assert "Environment</legend>" not in spawn_form.render_form(pool(), environments=[], now=NOW)


def test_the_chosen_environment_reads_back_into_user_options():
    assert spawn_form.options_from_form({"environment": ["torch"], "choice": ["gpu:1:L4"], "tier": ["course"]}) == {
        "environment": "torch", "gpus": 1, "model": "L4", "tier": "course"}
    assert spawn_form.options_from_form({"environment": [" jax "], "choice": ["cpu"]}) == {"environment": "jax", "kind": "cpu"}
    assert spawn_form.options_from_form({"environment": [""], "choice": ["cpu"]}) == {"kind": "cpu"}


def test_render_for_passes_the_environments_on():
    html = asyncio.run(spawn_form.render_for(None, user="alice", groups=[], presets=[], allow_custom=True, allow_cpu_only=True,
                                             environments=_environment_offers(), now=NOW))
    assert EnvCards(html).cards.keys() == {"torch", "jax", "a100"}


@pytest.mark.parametrize("evil", ['<script>alert(1)</script>', '"><img src=x onerror=alert(1)>'])
def test_environment_names_from_config_are_escaped(evil):
    from jupyter_gpulease.hub.environments import Environment, EnvironmentOffer

    e = Environment(name="x", display_name=evil, image="lab/x", description=evil, models=(evil,))
    html = spawn_form.render_form(pool(), environments=[EnvironmentOffer(e, False, reason=evil)], now=NOW)
    assert evil not in html and "&lt;" in html


def test_in_the_browser_an_environment_made_for_other_gpus_cannot_be_picked_with_them(playwright_sync_api, chromium):
    """The page's own check: with the L4 chosen, the A100 image is disabled (and the checked one
    moves to one that fits); with no GPU, an image that needs one is disabled."""
    from jupyter_gpulease.hub.environments import offers, parse_environments

    envs = parse_environments([
        {"name": "big", "display_name": "Big models", "image": "lab/big:1", "models": ["A100*"], "default": True},
        {"name": "torch", "display_name": "PyTorch", "image": "lab/torch:2.5", "cpu_only_ok": False},
        {"name": "plain", "display_name": "Python", "image": "python:3.12"},
    ])
    html = spawn_form.render_form(pool(), environments=offers(envs, driver_cuda=None, present=None, sizes={}), now=NOW,
                                  previous={"gpus": 1, "model": A100})
    with playwright_sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox", "--disable-gpu"], headless=True)
        try:
            page = browser.new_page()
            page.set_content(f"<form>{html}</form>")
            env = {n: page.locator(f"#gpulease-env-{n}") for n in ("big", "torch", "plain")}
            assert env["big"].is_checked() and env["big"].is_enabled()
            page.locator("#gpulease-choice-gpu-1-L4").check(force=True)
            assert env["big"].is_disabled() and env["torch"].is_checked()
            assert "with this choice: not made for L4" in page.locator("label[for=gpulease-env-big]").inner_text()
            page.locator("#gpulease-choice-cpu").check(force=True)
            assert env["big"].is_enabled() and env["torch"].is_disabled() and env["plain"].is_enabled()
            assert "needs a GPU" in page.locator("label[for=gpulease-env-torch]").inner_text()
            assert env["big"].is_checked()  # the first that fits
        finally:
            browser.close()
