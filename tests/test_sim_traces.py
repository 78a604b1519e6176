"""Trace loaders: good files load; malformed and foreign files get errors naming file, line and column."""

import pytest

from jupyter_gpulease.sim.traces import (
    ALIBABA_NODES,
    ALIBABA_PODS,
    NOTEBOOK,
    TraceError,
    detect_format,
    load_alibaba_nodes,
    load_alibaba_pods,
    load_notebook_events,
)
from jupyter_gpulease.sim.workload import alibaba_workload, notebook_sessions, pool_from_inventory

POD_HEADER = "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,creation_time,deletion_time,scheduled_time\n"


def write(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def test_alibaba_pods_load_with_fractional_multi_and_pending_rows(tmp_path):
    path = write(
        tmp_path,
        "pods.csv",
        POD_HEADER
        + "p0,1000,100,1,460,,LS,Running,0,500,10\n"
        + "p1,1000,100,4,1000,,BE,Succeeded,5,900,100\n"
        + "p2,1000,100,1,1000,,Burstable,Pending,7,50,\n"
        + "p3,1000,100,0,0,,BE,Failed,8,60,9\n",
    )
    pods = load_alibaba_pods(path)
    assert [p.gpu_request_milli for p in pods] == [460, 4000, 1000, 0]
    assert pods[2].scheduled is None
    wl = alibaba_workload(pods, compress=2)
    assert [j.id for j in wl.jobs] == ["p0", "p1"]
    assert wl.excluded == {"cpu_only": 1, "pending_never_scheduled": 1, "outside_window": 0}
    assert wl.jobs[1].arrival == 2.5  # (5 - 0) / 2: arrivals compressed
    assert wl.jobs[1].work_s == 800  # held time is not
    assert any("ASSUMPTION" in n for n in wl.assumptions.notes)


@pytest.mark.parametrize(
    "row, line_col, detail",
    [
        ("p1,1000,100,1,x,,LS,Running,0,5,0", "line 3, column 'gpu_milli'", "expected an integer, got 'x'"),
        ("p1,1000,100,1,1500,,LS,Running,0,5,0", "line 3, column 'gpu_milli'", "at most 1000"),
        ("p1,1000,100,1,500,,HIGH,Running,0,5,0", "line 3, column 'qos'", "got 'HIGH'"),
        ("p1,1000,100,1,500,,LS,Running,9,5,9", "line 3, column 'deletion_time'", "before creation_time"),
        ("p1,1000,100,1,500,,LS,Running,0,5,", "line 3, column 'scheduled_time'", "Pending"),
        ("p1,1000,100,1,500,,LS,Running,abc,5,0", "line 3, column 'creation_time'", "expected a number"),
        ("p1,1000,100,1,500,,LS,Running,0,5", "line 3", "expected 11 fields"),
    ],
)
def test_malformed_pod_rows_name_file_line_and_column(tmp_path, row, line_col, detail):
    path = write(tmp_path, "alibaba_v2023_pods_shared.csv", POD_HEADER + "p0,1000,100,1,460,,LS,Running,0,500,10\n" + row + "\n")
    with pytest.raises(TraceError) as e:
        load_alibaba_pods(path)
    msg = str(e.value)
    assert msg.startswith("alibaba_v2023_pods_shared.csv, " + line_col), msg
    assert detail in msg


def test_foreign_csv_says_which_columns_are_missing(tmp_path):
    path = write(tmp_path, "foreign.csv", "job_id,num_gpu,submit\n1,1,3\n")
    with pytest.raises(TraceError) as e:
        load_notebook_events(path)
    msg = str(e.value)
    assert msg.startswith("foreign.csv, line 1")
    assert "'notebook'" in msg and "'submit_time'" in msg and "'duration'" in msg


def test_empty_and_wrong_kind_files_are_errors_not_tracebacks(tmp_path):
    empty = write(tmp_path, "empty.csv", "")
    with pytest.raises(TraceError, match=r"empty\.csv, line 1: the file is empty"):
        load_alibaba_pods(empty)
    nodes = write(tmp_path, "nodes.csv", "sn,cpu_milli,memory_mib,gpu,model\nn0,1,1,8,G2\n")
    assert detect_format(nodes) == ALIBABA_NODES
    with pytest.raises(TraceError, match="expected a 'alibaba-pods' file"):
        load_alibaba_pods(nodes)
    with pytest.raises(TraceError, match="cannot open"):
        load_alibaba_pods(str(tmp_path / "missing.csv"))


def test_nodes_validate_and_pool_draw_is_deterministic(tmp_path):
    rows = "".join(f"n{i},1,1,8,{'G2' if i % 2 else 'V100M32'}\n" for i in range(20)) + "c0,1,1,0,\n"
    path = write(tmp_path, "nodes.csv", "sn,cpu_milli,memory_mib,gpu,model\n" + rows)
    nodes = load_alibaba_nodes(path)
    a = pool_from_inventory(nodes, n_nodes=4, seed=3)
    b = pool_from_inventory(nodes, n_nodes=4, seed=3)
    assert [g.uuid for g in a] == [g.uuid for g in b] and len(a) == 32
    assert len({g.node for g in a}) == 4
    only = pool_from_inventory(nodes, n_nodes=2, models=["G2"], seed=1)
    assert {g.model for g in only} == {"G2"}
    with pytest.raises(ValueError, match="only 10 node"):
        pool_from_inventory(nodes, n_nodes=11, models=["G2"])
    bad = write(tmp_path, "nodes_bad.csv", "sn,cpu_milli,memory_mib,gpu,model\nn0,1,1,8,\n")
    with pytest.raises(TraceError, match=r"nodes_bad\.csv, line 2, column 'model'"):
        load_alibaba_nodes(bad)


def test_notebook_sessions_group_consecutive_ids_by_documented_gap(tmp_path):
    path = write(
        tmp_path,
        "nb.csv",
        "job_id,num_gpu,submit_time,duration\n"
        "1,1,0,5\n"  # session A: 0-5
        "2,4,10,5\n"  # A: gap 5 min, 4 GPUs
        "3,1,200,5\n"  # gap 185 min > 60: new session B
        "7,1,210,5\n"  # id jump: new session C
        "8,1,100,5\n",  # goes back in time: new session D
    )
    events = load_notebook_events(path)
    assert detect_format(path) == NOTEBOOK
    wl = notebook_sessions(events, session_gap_s=3600)
    assert [j.id for j in wl.jobs] == ["session-1", "session-8", "session-3", "session-7"]
    a = wl.jobs[0]
    assert a.gpu_milli == 4000  # the largest burst
    assert a.bursts == [(0.0, 300.0), (600.0, 300.0)]
    assert notebook_sessions(events, session_gap_s=4 * 3600).jobs[0].bursts[-1] == (12000.0, 300.0)
    bad = write(tmp_path, "nb_bad.csv", "job_id,num_gpu,submit_time,duration\n1,1,0,0\n")
    with pytest.raises(TraceError, match=r"nb_bad\.csv, line 2, column 'duration'"):
        load_notebook_events(bad)


def test_detect_format_accepts_extra_columns(tmp_path):
    path = write(tmp_path, "up.csv", "job_id,num_gpu,submit_time,duration,model_name,iterations,interval\n1,1,0,3,resnet,0,0\n")
    assert detect_format(path) == NOTEBOOK
    assert load_notebook_events(path)[0].duration_min == 3
    assert detect_format(write(tmp_path, "p.csv", POD_HEADER)) == ALIBABA_PODS
