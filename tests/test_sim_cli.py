"""`jupyter gpulease simulate` end to end: the real trace samples shipped in the package (a slice), JSON, plots, errors."""

import json
import os

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
