"""Each policy setting declared once: config options, simulator keys and checks come from it."""

import pytest
from traitlets import TraitError
from traitlets.config import Config

from jupyter_gpulease.broker.app import GPULeaseBroker
from jupyter_gpulease.core.policy import SETTINGS, Policy
from jupyter_gpulease.core.policy_config import PolicyConfig, policy_from_config
from jupyter_gpulease.core.renames import POLICY_SECTION, old_names
from jupyter_gpulease.sim.policies import policy_from_dict


class App(GPULeaseBroker):
    """The broker's application (it inherits the policy options), under a short name."""


def app(**options):
    c = Config()
    for k, v in options.items():
        setattr(c.App, k, v)
    return App(config=c)


def test_the_options_are_exactly_the_declared_settings_their_old_names_and_the_tiers_and_quotas():
    traits = PolicyConfig.class_traits(config=True)
    structured = {"tiers", "default_user_quota", "user_quotas", "group_quotas"}
    assert set(traits) == {s.name for s in SETTINGS} | old_names(POLICY_SECTION) | structured
    for s in SETTINGS:
        assert (traits[s.name].default(), traits[s.name].help) == (s.config_default(), s.help), s.name
        for old in s.renamed_from:
            assert traits[old].default() is None and f"Renamed to {s.name} " in traits[old].help, old


def test_every_setting_is_a_config_option_with_its_default_and_help():
    a = app()
    for s in SETTINGS:
        assert getattr(a, s.name) == s.config_default(), s.name
        assert a.traits()[s.name].help == s.help and s.help, s.name
        if s.unit == "seconds":
            assert s.name.endswith("_s"), s.name  # one unit, said in the name
    assert policy_from_config(a) == Policy()


def test_options_build_the_policy_zero_turning_a_timeout_off():
    p = policy_from_config(app(aging_s=0, min_duration_s=60, confirm_timeout_s=0, heartbeat_timeout_s=300, share_placement="Fragmentation"))
    assert (p.aging_s, p.min_duration_s, p.confirm_timeout_s, p.heartbeat_timeout_s, p.share_placement) == (None, 60, None, 300, "fragmentation")


@pytest.mark.parametrize("option,value,words", [("multi_gpu_aging", 2.0, "at most 1"), ("reservation_depth", -1, "at least 0"),
                                                ("warn_before_s", -5.0, "at least 0"), ("share_placement", "worst", "best_fit")])
def test_an_invalid_option_fails_at_load_naming_it(option, value, words):
    with pytest.raises(TraitError, match=words) as e:
        app(**{option: value})
    assert option in str(e.value)


def test_a_renamed_option_still_works_and_says_its_new_name(capfd):
    a = app(aging=900, confirm_timeout=0)
    assert a.aging_s == 900 and policy_from_config(a).confirm_timeout_s is None
    assert "App.aging is renamed to aging_s" in capfd.readouterr().err
    assert old_names(POLICY_SECTION) == {"aging", "warn_before", "fair_share_half_life", "confirm_timeout", "heartbeat_timeout"}
    assert a.aging is None  # the old name itself holds nothing: its value went to the new name before loading


def test_a_config_error_in_tiers_or_quotas_names_the_option():
    with pytest.raises(ValueError, match="tiers: tier 'x': unknown setting"):
        policy_from_config(app(tiers={"x": {"prioriti": 1}}, default_tier="x"))
    with pytest.raises(ValueError, match=r"group_quotas\['students'\]: quota: unknown"):
        policy_from_config(app(group_quotas={"students": {"max_gpu": 2}}))


def test_the_simulators_policy_files_take_every_setting_by_the_same_name():
    sp = policy_from_dict({"name": "x", "min_duration_s": 300, "resume_priority": True, "aging_s": 0})
    assert (sp.policy.min_duration_s, sp.policy.resume_priority, sp.policy.aging_s) == (300, True, None)
    with pytest.raises(ValueError, match="multi_gpu_aging must be at most 1"):
        policy_from_dict({"name": "x", "multi_gpu_aging": 3})
