"""The broker application: config files, --generate-config, signals."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from hubharness import free_port, wait_for
from jupyter_gpulease.broker.app import GPULeaseBroker
from jupyter_gpulease.broker.checks import ConfigError

pytestmark = pytest.mark.timeout(60)

EXAMPLE = Path(__file__).parent.parent / "config" / "gpulease_config.py"


def test_the_example_config_loads_and_the_command_line_wins(tmp_path):
    app = GPULeaseBroker()
    app.initialize(["--config", str(EXAMPLE), "--db-url", f"sqlite:///{tmp_path / 'x.sqlite'}"])
    try:
        assert app.db_url.endswith("x.sqlite")
        pol = app.policy
        assert set(pol.tiers) == {"production", "experiment", "learning"}
        assert pol.tiers["production"].groups == ("staff",)
        assert pol.tiers["learning"].preemptible
        assert pol.user_quotas["alice"].max_gpus == 4
        assert pol.group_quotas["students"].max_gpus == 2
        assert pol.confirm_timeout_s == 900 and pol.heartbeat_timeout_s == 300
        assert len(app.scheduler.inventory) == 4 + 1 + 2
    finally:
        app.store.close()
        GPULeaseBroker.clear_instance()


def test_a_bad_tier_setting_is_reported_by_name(tmp_path):
    cfg = tmp_path / "bad.py"
    cfg.write_text("c.GPULeaseBroker.tiers = {'fast': {'priority': 1, 'max_hours': 3}}\nc.GPULeaseBroker.default_tier = 'fast'\n")
    app = GPULeaseBroker()
    with pytest.raises(ConfigError, match=r"bad.py: GPULeaseBroker.tiers\['fast'\]: .*max_hours") as info:
        app.initialize(["--config", str(cfg), "--db-url", "sqlite://"])
    assert "\n" not in str(info.value)


def test_generate_config_writes_every_option_with_its_help(tmp_path):
    out = tmp_path / "gpulease_config.py"
    r = subprocess.run([sys.executable, "-m", "jupyter_gpulease.broker", "--generate-config", f"--config={out}"], capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 0, r.stderr
    text = out.read_text()
    for option in ("db_url", "device_backend", "devices", "tiers", "default_tier", "user_quotas", "group_quotas", "default_user_quota",
                   "fair_share_half_life_s", "warn_before_s", "reservation_depth", "extend_when_contended", "confirm_timeout_s",
                   "heartbeat_timeout_s", "min_duration_s", "resume_priority", "tick_interval", "stop_servers_on_end", "admin_scope", "bind_url"):
        assert f"c.GPULeaseBroker.{option} =" in text, option
    # one section for the broker: the policy options with their whole help, not "See also" a
    # mixin; the tiers' default is the tiers the broker runs with, not an empty dict
    assert "PolicyOptions" not in text and "c.PolicyConfig." not in text and "See also: _" not in text
    tiers = text.split("\n# c.GPULeaseBroker.tiers =", 1)[1].splitlines()[0]
    assert all(f"'{name}'" in tiers for name in ("production", "experiment", "learning"))
    quotas_help = text.split("# c.GPULeaseBroker.group_quotas =", 1)[0].rsplit("##", 1)[1]
    assert "gpu_hours" in quotas_help and "period_s" in quotas_help and "together" in quotas_help
    # the generated file loads back as it is
    r = subprocess.run([sys.executable, "-m", "jupyter_gpulease.broker", f"--config={out}", "--check-config", "--db-url=sqlite://"],
                       capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_the_broker_stops_cleanly_on_a_signal(tmp_path, sig):
    port = free_port()
    env = {
        **os.environ,
        "JUPYTERHUB_SERVICE_URL": f"http://127.0.0.1:{port}",
        "JUPYTERHUB_SERVICE_PREFIX": "/services/gpulease/",
        "JUPYTERHUB_SERVICE_NAME": "gpulease",
        "JUPYTERHUB_API_TOKEN": "unused",
        "JUPYTERHUB_API_URL": f"http://127.0.0.1:{free_port()}/hub/api",
    }
    log = tmp_path / "broker.log"
    with open(log, "wb") as f:
        proc = subprocess.Popen(
            [sys.executable, "-m", "jupyter_gpulease.broker", "--config=", "--device-backend", "simulated",
             "--db-url", f"sqlite:///{tmp_path / 'b.sqlite'}"],
            env=env, stdout=f, stderr=subprocess.STDOUT, cwd=tmp_path,
            # a background process inherits SIGINT ignored: the broker must install its own handler
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),  # noqa: PLW1509 (a test, no threads yet)
        )
    try:
        import urllib.request

        def up():
            assert proc.poll() is None, f"the broker exited:\n{log.read_text()}"
            return urllib.request.urlopen(f"http://127.0.0.1:{port}/services/gpulease/api/openapi.json", timeout=2).status == 200

        wait_for(up, 120, "the broker did not start")
        proc.send_signal(sig)
        rc = proc.wait(20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert rc == 0, log.read_text()
    assert "GPU lease broker stopped" in log.read_text()


BAD_CONFIGS = [
    ("c.GPULeaseBroker.default_tier = 'cource'\n", "GPULeaseBroker.default_tier: 'cource' is not one of the tiers"),
    ("c.GPULeaseBroker.tiers = {'fast': {'priority': 1, 'maximum': 3}}\nc.GPULeaseBroker.default_tier = 'fast'\n", "GPULeaseBroker.tiers['fast']"),
    ("c.GPULeaseBroker.device_backend = 'static'\nc.GPULeaseBroker.devices = {'gpus': [{'node': 'n', 'model': 'A100', 'count': 2}]}\n", "memory_mib"),
    ("c.GPULeaseBroker.group_quotas = {'students': {'max_gpu': 2}}\n", "GPULeaseBroker.group_quotas['students']"),
    ("c.GPULeaseBroker.tiers = {'a': \n", "line 2"),
    ("c.GPULeaseBroker.tick_interval = 'often'\n", "tick_interval"),
]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("text,words", BAD_CONFIGS, ids=["default_tier", "tier key", "gpu without memory", "quota key", "syntax", "type"])
def test_a_config_mistake_ends_the_broker_with_one_line_naming_the_option_the_file_and_the_fix(tmp_path, text, words):
    cfg = tmp_path / "gpulease_config.py"
    cfg.write_text("c.GPULeaseBroker.device_backend = 'simulated'\n" + text)
    for extra in ([], ["--check-config"]):
        r = subprocess.run([sys.executable, "-m", "jupyter_gpulease.broker", "--config", str(cfg), "--db-url", f"sqlite:///{tmp_path / 'x.sqlite'}", *extra],
                           capture_output=True, text=True, timeout=60, cwd=tmp_path, check=False)
        assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
        errors = [line for line in r.stderr.splitlines() if line.strip() and not line.startswith("[")]
        assert "Traceback" not in r.stderr, r.stderr
        first = errors[0]
        assert words in first and str(cfg) in first, first
        assert "fix" in first.lower() or "(fix" in first or "one of" in first, first


@pytest.mark.timeout(300)
def test_check_config_says_ok_and_warns_about_names_that_match_no_tier(tmp_path):
    cfg = tmp_path / "gpulease_config.py"
    cfg.write_text(
        "c.GPULeaseBroker.device_backend = 'simulated'\n"
        "c.GPULeaseBroker.tiers = {'experiment': {'priority': 20}, 'learning': {'priority': 10, 'preemptible': True, 'preempted_by': ['staf']}}\n"
        "c.GPULeaseBroker.group_quotas = {'students': {'max_gpus': 2}}\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("JUPYTERHUB_")}
    r = subprocess.run([sys.executable, "-m", "jupyter_gpulease.broker", "--config", str(cfg), "--db-url", f"sqlite:///{tmp_path / 'x.sqlite'}", "--check-config"],
                       capture_output=True, text=True, timeout=60, cwd=tmp_path, env=env, check=False)
    assert r.returncode == 0, r.stderr
    assert "OK (1 warning(s))" in r.stdout and "pool: 4 GPU(s)" in r.stdout
    assert "preempted_by names 'staf', which is not a tier" in r.stderr
    assert "groups named: students (not checked against the hub" in r.stdout


def test_the_token_cache_age_reaches_the_hub_auth_of_the_api_and_the_pages(tmp_path, monkeypatch):
    from brokerutil import make_broker

    monkeypatch.setenv("JUPYTERHUB_API_TOKEN", "t" * 32)
    monkeypatch.setenv("JUPYTERHUB_API_URL", "http://127.0.0.1:1/hub/api")
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    default = make_broker(tmp_path / "a").make_web_app()
    assert default.settings["hub_auth"].cache_max_age == 10 and default.settings["hub_oauth"].cache_max_age == 10
    GPULeaseBroker.clear_instance()
    short = make_broker(tmp_path / "b", token_cache_max_age=3).make_web_app()
    assert short.settings["hub_auth"].cache_max_age == 3 and short.settings["hub_oauth"].cache_max_age == 3
