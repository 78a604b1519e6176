"""Old option names: one table (core/renames.py), one function that moves them to the new names,
used by the broker's policy options, the server extension and the simulator."""

import logging

import pytest
from traitlets.config import Config

from jupyter_gpulease.broker.app import GPULeaseBroker
from jupyter_gpulease.core.policy_config import PolicyConfig
from jupyter_gpulease.core.renames import EXTENSION_MOVED, EXTENSION_SECTION, POLICY_SECTION, RENAMES, migrate_config


def test_an_old_name_moves_to_the_new_one_with_one_warning_naming_both():
    c = Config()
    c.GPULeaseExtension.warn_before = 7.0
    c.GPULeaseExtension.sample_interval = 0.5  # the extension's own: stays
    said = []
    out = migrate_config(c, [EXTENSION_SECTION], warn=said.append)
    assert out.ReclaimActions.warn_before == 7.0 and "warn_before" not in out.GPULeaseExtension
    assert out.GPULeaseExtension.sample_interval == 0.5
    assert said == ["GPULeaseExtension.warn_before is renamed to ReclaimActions.warn_before (same meaning and unit); please use the new name"]
    assert c.GPULeaseExtension.warn_before == 7.0  # the given config is left as it was


def test_the_new_name_wins_when_both_are_set():
    c = Config()
    c.App.aging = 900
    c.App.aging_s = 600
    said = []
    out = migrate_config(c, ["Configurable", POLICY_SECTION, "App"], warn=said.append)
    assert out.App.aging_s == 600 and "aging" not in out.App
    assert said == ["App.aging is renamed to aging_s (same meaning and unit); please use the new name (App.aging_s is set too, and wins)"]


def test_a_class_that_reads_no_old_names_is_left_alone():
    c = Config()
    c.GPULeaseExtension.warn_before = 7.0
    said = []
    assert migrate_config(c, ["GPUIdleRule"], warn=said.append) == c and not said


class App(GPULeaseBroker):
    """The broker's application, its options under a short name."""


@pytest.mark.parametrize("argv,aging_s", [(["--App.aging=900"], 900), (["--App.aging=900", "--App.aging_s=600"], 600),
                                          (["--App.aging_s=600", "--App.aging=900"], 600)])
def test_on_the_command_line_too(argv, aging_s, capfd):
    app = App()
    app.parse_command_line(argv)
    assert app.aging_s == aging_s and app.aging is None
    assert "App.aging is renamed to aging_s" in capfd.readouterr().err


def test_an_application_warns_once_however_often_its_command_line_arrives(capfd):
    app = App()
    app.parse_command_line(["--App.aging=900"])
    app.update_config(app.cli_config)  # as loading a config file does: the command line merged in again, to win
    assert app.aging_s == 900 and capfd.readouterr().err.count("App.aging is renamed to aging_s") == 1


def test_the_command_line_wins_over_a_file_whichever_name_each_uses():
    app = App()
    file = Config()
    file.App.aging_s = 300
    app.update_config(file)  # what loading a config file does
    app.parse_command_line(["--App.aging=900"])
    assert app.aging_s == 900


def test_the_server_extension_reads_a_moved_setting_from_its_command_line_as_its_part_s(capfd):
    from jupyter_gpulease.server.app import GPULeaseExtension
    from jupyter_gpulease.server.idletimeout import GPUIdleRule

    ext = GPULeaseExtension()
    ext.parse_command_line(["--GPULeaseExtension.gpu_idle_timeout=600", "--GPULeaseExtension.sample_interval=0.5"])
    assert ext.sample_interval == 0.5 and GPUIdleRule(parent=ext, gaps_file="").gpu_idle_timeout == 600
    err = capfd.readouterr().err  # the application's own log
    assert "not recognized" not in err and "GPULeaseExtension.gpu_idle_timeout is renamed to GPUIdleRule.gpu_idle_timeout" in err
    both = GPULeaseExtension()
    both.parse_command_line(["--GPULeaseExtension.gpu_idle_timeout=600", "--GPUIdleRule.gpu_idle_timeout=300"])
    assert GPUIdleRule(parent=both, gaps_file="").gpu_idle_timeout == 300


def test_the_table_names_options_that_exist():
    from jupyter_gpulease.server.app import GPULeaseExtension
    from jupyter_gpulease.server.controller import PARTS

    parts = {p.__name__: p for p in PARTS}
    # every setting a part took from the extension is read under its old name; the others were
    # born in the part (named here so that a new one is a choice, not an oversight)
    born_in_the_part = {"ReclaimActions": {"unused_lease_timeout"}}
    settings = {n: set(p.class_trait_names(config=True)) for n, p in parts.items()}
    moved = {name: set(names) for name, names in EXTENSION_MOVED.items()}
    assert {n: s - moved.get(n, set()) for n, s in settings.items() if s - moved.get(n, set())} == born_in_the_part
    assert all(names <= settings[n] for n, names in moved.items())
    assert not born_in_the_part["ReclaimActions"] & set(GPULeaseExtension.class_trait_names(config=True))
    ext = set(GPULeaseExtension.class_trait_names(config=True))
    policy = set(PolicyConfig.class_trait_names(config=True))
    for r in RENAMES:
        if r.section == POLICY_SECTION:
            assert not r.new_section and {r.old, r.new} <= policy, r
        else:
            assert r.section == EXTENSION_SECTION and r.old not in ext and r.new in parts[r.new_section].class_trait_names(config=True), r


def test_a_simulator_policy_file_reads_an_old_name_as_the_broker_does(caplog):
    from jupyter_gpulease.sim.policies import policy_from_dict

    with caplog.at_level(logging.WARNING):
        sp = policy_from_dict({"name": "x", "aging": 0, "heartbeat_timeout": 90, "heartbeat_timeout_s": 120}, source="p.toml")
    assert sp.policy.aging_s is None and sp.policy.heartbeat_timeout_s == 120
    assert "p.toml: policy 'x': PolicyConfig.aging is renamed to aging_s" in caplog.text
