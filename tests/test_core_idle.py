"""The idle rule shared by the server extension and the simulator (core/idle.py)."""

import math
import re

import pytest

from jupyter_gpulease.core.idle import GapHistogram, IdleRule, gpu_idle


def test_a_kernel_computing_on_the_gpu_is_never_idle():
    assert not gpu_idle(80.0, executing=True, threshold_pct=5)
    assert not gpu_idle(80.0, executing=False, threshold_pct=5)  # work queued on the GPU, cell finished


def test_a_kernel_executing_a_cell_is_busy_unless_reclaim_busy_says_otherwise():
    assert not gpu_idle(0.0, executing=True, threshold_pct=5)
    assert gpu_idle(0.0, executing=True, threshold_pct=5, reclaim_busy=True)
    # unknown utilization: an executing kernel may be using the GPU, whatever reclaim_busy says
    assert not gpu_idle(None, executing=True, threshold_pct=5, reclaim_busy=True)


def test_a_kernel_under_the_threshold_and_not_executing_is_idle():
    assert gpu_idle(4.9, executing=False, threshold_pct=5)
    assert gpu_idle(None, executing=False, threshold_pct=5)
    assert not gpu_idle(5.0, executing=False, threshold_pct=5)


def test_fixed_timeout_and_never():
    assert IdleRule(timeout_s=1800).timeout([10, 20]) == 1800
    assert IdleRule().timeout() is None and not IdleRule().active


def test_learnt_timeout_is_short_for_a_user_who_never_comes_back_soon_and_longer_for_one_who_does():
    rule = IdleRule(learn=True)
    assert rule.timeout([4 * 3600] * 5) == 60  # gaps of hours: holding longer only costs
    # a user who comes back after ~4 minutes: reclaiming before that would be regretted
    assert rule.timeout([250, 260, 240, 270, 255]) == 300


def test_learnt_timeout_stays_within_the_admin_bounds():
    rule = IdleRule(learn=True, min_s=300, max_s=1200)
    assert rule.timeout([4 * 3600] * 5) == 300
    assert rule.timeout([2500, 2600, 2700]) <= 1200
    assert IdleRule(learn=True, min_s=600).timeout([]) == 900  # no gaps yet: the default
    q = IdleRule(learn=True, method="quantile", min_s=120, max_s=3600, factor=1.5, quantile=50)
    assert q.timeout([10, 20]) == 900  # fewer than min_gaps
    assert q.timeout([100, 200, 300]) == 300.0
    assert q.timeout([10, 10, 10]) == 120


def test_a_population_prior_moves_a_new_users_timeout():
    prior = GapHistogram()
    for _ in range(50):
        prior.add(250)
    prior.add(math.inf)
    assert IdleRule(learn=True).timeout([], prior) == 300
    assert IdleRule(learn=True).timeout([]) == 900  # without one: the default


def test_bad_rules_are_refused():
    with pytest.raises(ValueError, match="method"):
        IdleRule(method="median")
    with pytest.raises(ValueError, match="above the maximum"):
        IdleRule(min_s=600, max_s=60)


# ---------------------------------------------------------------------- the settings, declared once

from jupyter_gpulease.core.idle import IDLE_NAMES, IDLE_SETTINGS, STATE_KEPT, IdleSettings  # noqa: E402


def test_every_idle_setting_is_declared_once_with_unit_help_and_default():
    assert [s.name for s in IDLE_SETTINGS] == list(IDLE_NAMES)
    d = IdleSettings()
    for s in IDLE_SETTINGS:
        assert s.help and getattr(d, s.name) == s.check(s.default)
    assert {s.name: s.unit for s in IDLE_SETTINGS if s.unit == "seconds"}.keys() >= {"gpu_idle_timeout", "gpu_idle_regret_suspend", "gpu_idle_timeout_min"}


def test_the_weight_of_a_regretted_reclaim_follows_what_the_reclaim_really_does():
    d = IdleSettings()
    assert {a: d.rule(a).regret_cost_s for a in ("suspend", "interrupt", "notify", "restart", "shutdown")} == {
        "suspend": 120, "interrupt": 120, "notify": 120, "restart": 1800, "shutdown": 1800,
    }
    assert {"suspend", "interrupt", "notify"} == STATE_KEPT
    # a user who comes back after ~4 minutes: a suspend is cheap to regret, a restart is not
    gaps = [250, 260, 240, 270, 255, 3 * 3600, 3 * 3600]
    assert d.rule("suspend").timeout(gaps) < d.rule("restart").timeout(gaps) == 300


def test_defaults_learn_from_a_two_minute_start_within_the_bounds():
    d = IdleSettings()
    r = d.rule("suspend")
    assert r.learn and r.timeout([]) == 120 and r.prior_weight == 0  # the server knows only its own user's gaps
    assert r.timeout([4 * 3600] * 5) == 60  # never back soon: the shortest candidate within the bounds
    bounded = d.changed(gpu_idle_timeout_min=300)
    assert bounded.rule().timeout([4 * 3600] * 5) == 300


def test_fixed_and_off():
    assert IdleSettings(gpu_idle_timeout_learn=False, gpu_idle_timeout=600).rule("restart").timeout([10, 20]) == 600
    off = IdleSettings(gpu_idle_timeout=0)
    assert off.gpu_idle_timeout is None and off.rule().timeout([10]) is None and not off.rule().active
    assert "fixed 10 min" in IdleSettings(gpu_idle_timeout_learn=False, gpu_idle_timeout=600).describe()


def test_candidates_are_a_sorted_list_of_positive_seconds():
    s = IdleSettings(gpu_idle_timeout_candidates=[600, 60, 60, 120])
    assert s.gpu_idle_timeout_candidates == (60.0, 120.0, 600.0)
    assert s.to_dict()["gpu_idle_timeout_candidates"] == [60.0, 120.0, 600.0]
    assert IdleSettings(gpu_idle_timeout_candidates=[600, 60, 120]).rule().timeout([4 * 3600] * 5) == 60


@pytest.mark.parametrize(
    ("kw", "words"),
    [
        ({"gpu_idle_threshold": 101}, "gpu_idle_threshold must be at most 100 (percent)"),
        ({"gpu_idle_timeout": -1}, "gpu_idle_timeout must be at least 0 (seconds)"),
        ({"gpu_idle_timeout_learn": "yes"}, "gpu_idle_timeout_learn must be True or False"),
        ({"gpu_idle_regret_suspend": "2 min"}, "gpu_idle_regret_suspend must be a number (seconds)"),
        ({"gpu_idle_timeout_candidates": []}, "gpu_idle_timeout_candidates must be a non-empty list"),
        ({"gpu_idle_timeout_candidates": [60, 0]}, "gpu_idle_timeout_candidates must be more than 0 (seconds)"),
        ({"gpu_idle_timeout_min": 600, "gpu_idle_timeout_max": 300}, "gpu_idle_timeout_min (600 s) is above gpu_idle_timeout_max"),
    ],
)
def test_bad_settings_are_refused_with_their_name(kw, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        IdleSettings(**kw)


def test_from_dict_names_unknown_settings():
    assert IdleSettings.from_dict({"gpu_idle_timeout": 300}).gpu_idle_timeout == 300
    with pytest.raises(ValueError, match=r"unknown idle setting.*gpu_idle_timeout_s"):
        IdleSettings.from_dict({"gpu_idle_timeout_s": 300})
