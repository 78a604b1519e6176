"""The server's idle rule (server/idletimeout.py): options derived from the one declaration, old names, learnt gaps."""

import json
import logging

import pytest
from traitlets import TraitError
from traitlets.config import Config

from jupyter_gpulease.core.idle import IDLE_SETTINGS, IdleSettings
from jupyter_gpulease.core.renames import EXTENSION_SECTION, migrate_config
from jupyter_gpulease.server.idletimeout import GPUIdleRule


def test_one_option_per_declared_setting_with_its_default_and_help():
    traits = GPUIdleRule.class_traits(config=True)
    # the class's options are exactly the declared settings, plus where the learnt gaps are kept
    assert set(traits) == {s.name for s in IDLE_SETTINGS} | {"gaps_file"}
    for s in IDLE_SETTINGS:
        t = traits[s.name]
        default = t.default()
        assert (tuple(default) if isinstance(default, list) else default) == s.config_default()
        assert t.help == s.help
    assert GPUIdleRule(gaps_file="").settings == IdleSettings()


def test_new_names_and_the_older_extension_names_both_take_effect_the_new_one_wins():
    c = Config()
    c.GPULeaseExtension.gpu_idle_timeout = 600
    c.GPULeaseExtension.gpu_idle_timeout_learn = False
    c.GPULeaseExtension.gpu_idle_threshold = 9.0
    c.GPUIdleRule.gpu_idle_threshold = 7.0
    # the extension migrates the config it loads (core.renames) before it builds its parts
    r = GPUIdleRule(config=migrate_config(c, [EXTENSION_SECTION]), gaps_file="")
    assert r.timeout("suspend") == 600 and r.threshold_pct == 7.0
    assert r.describe("suspend") == "fixed 10 min"


def test_a_value_the_declaration_refuses_is_refused_with_the_option_name():
    with pytest.raises(TraitError, match=r"GPUIdleRule\.gpu_idle_threshold must be at most 100"):
        GPUIdleRule(gpu_idle_threshold=150.0, gaps_file="")
    c = Config()
    c.GPUIdleRule.gpu_idle_timeout_min = 900.0
    c.GPUIdleRule.gpu_idle_timeout_max = 600.0
    with pytest.raises(ValueError, match=r"gpu_idle_timeout_min .* is above gpu_idle_timeout_max"):
        GPUIdleRule(config=c, gaps_file="")


def test_the_timeout_follows_the_action_that_really_happens(tmp_path):
    r = GPUIdleRule(gaps_file=str(tmp_path / "gaps.json"))
    assert r.timeout("suspend") == r.timeout("restart") == 120  # no gap seen yet: gpu_idle_timeout
    for g in (250, 260, 240, 270, 255, 3 * 3600, 3 * 3600):
        r.learn(g)
    # a user back after ~4 minutes: a regretted suspend costs a restore, a regretted restart a reload
    assert r.timeout("suspend") < r.timeout("restart") == 300
    assert r.rule("restart").regret_cost_s == 1800 and r.rule("suspend").regret_cost_s == 120
    assert "30 GPU-min per regretted reclaim (restart)" in r.describe("restart")
    assert "2 GPU-min per regretted reclaim (suspend)" in r.describe("suspend")


def test_learnt_gaps_are_kept_for_the_next_server_and_a_bad_file_is_ignored(tmp_path, caplog):
    path = tmp_path / "gpulease" / "idle-gaps.json"
    r = GPUIdleRule(gaps_file=str(path), user="alice")
    for _ in range(5):
        r.learn(4 * 3600)
    r.learn(0)  # not a gap
    assert json.loads(path.read_text()) == {"user": "alice", "gaps": [14400.0] * 5}
    again = GPUIdleRule(gaps_file=str(path))
    assert again.gaps == [14400.0] * 5 and again.timeout("suspend") == 60
    path.write_text("{not json")
    with caplog.at_level(logging.WARNING):
        assert GPUIdleRule(gaps_file=str(path)).gaps == []
    assert "ignoring" in caplog.text


def test_a_fixed_timeout_keeps_no_gaps_file(tmp_path):
    path = tmp_path / "gaps.json"
    r = GPUIdleRule(gaps_file=str(path), gpu_idle_timeout_learn=False)
    r.learn(300)
    assert not path.exists() and r.timeout("suspend") == 120
    assert GPUIdleRule(gaps_file="", gpu_idle_timeout=0).timeout("suspend") is None
