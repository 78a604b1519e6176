"""`jupyter gpulease simulate` end to end: the real trace samples shipped in the package (a slice), JSON, plots, errors."""

import json
import os

import pytest

from jupyter_gpulease.sim import cli
from jupyter_gpulease.sim.traces import SAMPLE_FILES, default_traces_dir


def test_the_trace_samples_ship_with_the_package_and_their_sources():
    d = default_traces_dir()
    for name in SAMPLE_FILES.values():
        assert os.path.getsize(os.path.join(d, name)) > 10_000, name
    with open(os.path.join(d, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    assert "alibaba/clusterdata" in readme and "NotebookOS" in readme and "License" in readme


def test_alibaba_slice_compares_all_policies_and_writes_json_and_plots(tmp_path, capsys):
    out = tmp_path / "ali.json"
    rc = cli.main(["--trace", "alibaba", "--window-days", "115:", "--limit", "300", "--compress", "4", "--pool-nodes", "2", "--json", str(out), "--plots", str(tmp_path / "ali"), "--no-progress"])
    assert rc == 0
    text = capsys.readouterr().out
    for name in ("static", "static+backfill", "static+culler", "gpulease", "wait p95", "ASSUMPTION", "replay events/s"):
        assert name in text
    doc = json.loads(out.read_text())
    assert [r["policy"] for r in doc["results"]] == ["static", "static+backfill", "static+culler", "gpulease"]
    assert doc["pool"]["gpus"] == 16 and doc["assumptions"]["compress"] == 4
    # batch pods: gpulease's preemption grace is Kubernetes-like, and says so
    assert doc["policies"][-1]["tiers"]["learning"]["grace_s"] == 30
    assert "terminationGracePeriodSeconds" in text
    # ... its non-preemptible tiers renew hourly and large pods age sooner: both printed as choices
    gl = doc["policies"][-1]
    assert gl["tiers"]["production"]["max_duration_s"] == 3600 and gl["multi_gpu_aging"] == 0.5 and gl["short_grants"] is True
    assert "CHOICE" in text and "1-hour steps" in text
    assert "all waits within 10 min" in text
    for r in doc["results"]:
        assert r["jobs"] == 300 and r["replay"]["events_per_s"] > 0
    for p in doc["plots"]:
        assert os.path.getsize(p) > 1000


def test_notebook_slice_with_idle_sweep(tmp_path, capsys):
    out = tmp_path / "nb.json"
    rc = cli.main(["--trace", "notebook", "--limit", "80", "--pool-nodes", "2", "--idle-sweep", "5,30", "--json", str(out), "--plots", str(tmp_path / "nb"), "--no-progress"])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert "busy_held_per_session_median" in doc["results"][0]["notebook"]
    assert doc["policies"][-1]["tiers"]["learning"]["grace_s"] == 600  # people keep 10 min to save work
    kinds = [p["kind"] for p in doc["idle_sweep"]["points"]]
    assert kinds.count("fixed") == 2 and "learnt" in kinds
    assert any(p.endswith("_idle_tradeoff.png") for p in doc["plots"])
    assert "idle-timeout sweep" in capsys.readouterr().out


def test_malformed_csv_gives_file_line_column_not_a_traceback(tmp_path, capsys):
    bad = tmp_path / "pods.csv"
    bad.write_text(
        "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,creation_time,deletion_time,scheduled_time\n"
        "p0,1000,100,1,x,,LS,Running,0,5,0\n"
    )
    assert cli.main(["--trace", str(bad), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "pods.csv, line 2, column 'gpu_milli': expected an integer, got 'x'" in err
    assert "Traceback" not in err
    foreign = tmp_path / "other.csv"
    foreign.write_text("a,b\n1,2\n")
    assert cli.main(["--trace", str(foreign), "--no-progress"]) == 2
    assert "lacks column(s)" in capsys.readouterr().err


def test_missing_trace_samples_are_a_clear_error(tmp_path, capsys):
    assert cli.main(["--trace", "notebook", "--traces-dir", str(tmp_path), "--no-progress"]) == 2
    assert "pass --traces-dir or set GPULEASE_TRACES" in capsys.readouterr().err


def test_notebook_csv_by_path_with_its_own_pool(tmp_path, capsys):
    p = tmp_path / "nb.csv"
    p.write_text("job_id,num_gpu,submit_time,duration\n1,1,0,5\n2,1,7,5\n3,2,100,3\n")
    assert cli.main(["--trace", str(p), "--pool-nodes", "1", "--gpus-per-node", "2", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "busy/held per session (median)" in out and "2 GPUs on 1 nodes" in out


# ---------------------------------------------------------------------- the server extension's idle rule, replayed

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_gpulease_row_is_the_server_extensions_default_configuration():
    from jupyter_gpulease.core.idle import IdleSettings
    from jupyter_gpulease.server.idletimeout import GPUIdleRule
    from jupyter_gpulease.sim import policies as P

    sp = P.gpulease()
    assert sp.idle_settings == GPUIdleRule(gaps_file="").settings == IdleSettings()
    assert sp.reclaim_action == P.SERVER_RECLAIM_ACTION and not sp.idle_prior  # a server knows only its own user's gaps
    assert sp.policy.resume_priority is False  # the broker's default


def test_the_servers_default_reclaim_action_is_what_the_replay_assumes():
    from jupyter_gpulease.server.actions import ReclaimActions
    from jupyter_gpulease.sim import policies as P

    assert ReclaimActions.class_traits()["reclaim_action"].default_value == P.SERVER_RECLAIM_ACTION


def test_server_config_replays_an_admins_choices_old_names_too(tmp_path, capsys):
    conf = tmp_path / "jupyter_server_config.py"
    conf.write_text("c = get_config()\nc.GPULeaseExtension.gpu_idle_timeout = 1800\nc.GPULeaseExtension.gpu_idle_timeout_learn = False\n"
                    "c.ReclaimActions.reclaim_action = 'restart'\n")
    out = tmp_path / "nb.json"
    rc = cli.main(["--trace", "notebook", "--limit", "120", "--pool-nodes", "2", "--policies", "gpulease", "--server-config", str(conf),
                   "--json", str(out), "--no-progress"])
    assert rc == 0
    doc = json.loads(out.read_text())
    mine = doc["policies"][1]
    assert mine["name"] == "server-config" and mine["idle_settings"]["gpu_idle_timeout"] == 1800
    assert mine["idle"] == "fixed 30 min (reclaim)" and mine["reclaim_action"] == "restart"
    default, admin = (r["notebook"] for r in doc["results"])
    assert admin["kernel_state_lost"] > 0 == default["kernel_state_lost"]  # a restart throws the state away
    assert admin["reclaims"] < default["reclaims"]


def test_the_example_server_config_replays_as_the_default_row(tmp_path):
    out = tmp_path / "nb.json"
    example = os.path.join(REPO, "config", "jupyter_server_config.py")
    rc = cli.main(["--trace", "notebook", "--limit", "150", "--pool-nodes", "2", "--policies", "gpulease", "--server-config", example,
                   "--json", str(out), "--no-progress"])
    assert rc == 0
    doc = json.loads(out.read_text())
    default, example_row = doc["results"]
    assert example_row["notebook"] == default["notebook"] and example_row["notebook"]["reclaims"] > 0
    assert doc["policies"][0]["idle_settings"] == doc["policies"][1]["idle_settings"]


def test_a_server_config_the_server_would_refuse_is_refused_with_the_option(tmp_path, capsys):
    conf = tmp_path / "bad_config.py"
    conf.write_text("c = get_config()\nc.GPUIdleRule.gpu_idle_timeout = -5\n")
    assert cli.main(["--trace", "notebook", "--limit", "20", "--server-config", str(conf), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "bad_config.py" in err and "gpu_idle_timeout must be at least 0" in err
    assert cli.main(["--trace", "notebook", "--limit", "20", "--server-config", str(tmp_path / "missing.py"), "--no-progress"]) == 2
    assert "no such file" in capsys.readouterr().err


def test_policy_files_take_the_servers_idle_setting_names(tmp_path):
    from jupyter_gpulease.sim import policies as P

    p = tmp_path / "pol.toml"
    p.write_text('[[policy]]\nname = "fixed-5"\ngpu_idle_timeout = 300\ngpu_idle_timeout_learn = false\nreclaim_action = "restart"\n')
    (sp,) = P.load_policy_file(str(p))
    assert sp.idle_rule().timeout([60] * 5) == 300 and sp.reclaim_action == "restart" and sp.reload_s == P.RELOAD_S
    p.write_text('[[policy]]\nname = "x"\ngpu_idle_timeout = 300\nidle_timeout_s = 60\n')
    with pytest.raises(ValueError, match="not both"):
        P.load_policy_file(str(p))


def test_the_saved_notebook_results_replay_to_the_same_figures():
    """benchmarks/sim/notebook_24x8.json's gpulease row (README's notebook figures) is what a replay gives now."""
    from jupyter_gpulease.sim import policies as P
    from jupyter_gpulease.sim.replay import replay
    from jupyter_gpulease.sim.report import summarize
    from jupyter_gpulease.sim.traces import load_notebook_events
    from jupyter_gpulease.sim.workload import notebook_sessions, uniform_pool

    with open(os.path.join(REPO, "benchmarks", "sim", "notebook_24x8.json"), encoding="utf-8") as f:
        saved = json.load(f)
    (row,) = [r for r in saved["results"] if r["policy"] == "gpulease"]
    events = load_notebook_events(os.path.join(default_traces_dir(), SAMPLE_FILES["notebook"]))
    now = summarize(replay(notebook_sessions(events, session_gap_s=3600), uniform_pool(24, 8), P.gpulease(), linger_s=3600))["notebook"]
    for k in ("busy_held_per_session_median", "resume_delay_mean_s", "reclaims", "regretted_reclaims", "kernel_state_lost"):
        assert now[k] == row["notebook"][k], k
    assert now["busy_held_per_session_median"] >= 0.75 and now["resume_delay_mean_s"] <= 30
