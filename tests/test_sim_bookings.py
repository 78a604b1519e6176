"""`jupyter gpulease simulate --bookings` / `--book-fraction`: bookings in a replay, placed by the
core scheduler at their creation time, honoured for their owners; the static policies untouched."""

import json

import pytest

from jupyter_gpulease.core.model import SliceKind
from jupyter_gpulease.sim import cli
from jupyter_gpulease.sim import policies as P
from jupyter_gpulease.sim.bookings import BookingsError, draw_bookings, parse_booking_request, parse_bookings_csv
from jupyter_gpulease.sim.workload import Job, Workload, WorkloadAssumptions

KEYS = ("n", "honoured", "started_on_time_fraction", "start_delay_max_s", "unused_gpu_hours")


# ------------------------------------------------------------------------- the CSV
def test_a_request_reads_as_gpu_request_takes_it():
    r = parse_booking_request("2 A100")
    assert r.kind is SliceKind.GPU and r.gpus == 2 and r.models == ("A100",)
    s = parse_booking_request("0.25 A100")
    assert s.kind is SliceKind.SHARE and s.share_milli == 250 and s.models == ("A100",)
    assert parse_booking_request("--gpus 3").gpus == 3
    assert parse_booking_request("--mig 3g.40gb").kind is SliceKind.MIG
    assert parse_booking_request("1").gpus == 1


@pytest.mark.parametrize("text", ["", "two A100", "1.5 A100", "2 A100 extra", "--share 2", "--gpus 1 --for 2h", "--colour red"])
def test_a_bad_request_is_refused(text):
    with pytest.raises(ValueError):
        parse_booking_request(text)


def test_csv_rows_and_errors_name_the_line():
    rows = parse_bookings_csv("owner,start_s,end_s,request\nalice,0,3600,2 A100\n\nbob,100,200,0.5\n")
    assert [(b.owner, b.start, b.end, b.line) for b in rows] == [("alice", 0.0, 3600.0, 2), ("bob", 100.0, 200.0, 4)]
    assert rows[0].request.gpus == 2 and rows[1].request.share_milli == 500
    with pytest.raises(BookingsError, match=r"line 1: the header must be owner,start_s,end_s,request"):
        parse_bookings_csv("user,start,end,request\nalice,0,1,1\n", "b.csv")
    with pytest.raises(BookingsError, match=r"b.csv, line 3: request 'three GPUs'"):
        parse_bookings_csv("owner,start_s,end_s,request\nalice,0,10,1\nbob,0,10,three GPUs\n", "b.csv")
    with pytest.raises(BookingsError, match=r"line 2: end_s \(5\) must be after start_s \(10\)"):
        parse_bookings_csv("owner,start_s,end_s,request\nalice,10,5,1\n", "b.csv")
    with pytest.raises(BookingsError, match=r"line 2: start_s and end_s must be seconds"):
        parse_bookings_csv("owner,start_s,end_s,request\nalice,soon,5,1\n", "b.csv")
    with pytest.raises(BookingsError, match=r"line 2: expected 4 fields"):
        parse_bookings_csv("owner,start_s,end_s,request\nalice,0,5\n", "b.csv")


def test_the_draw_is_seeded_and_books_each_first_request_ahead():
    jobs = [Job(f"p{i}", 100.0 * i, 1000, work_s=50.0) for i in range(40)]
    wl = Workload(jobs, WorkloadAssumptions("t"))
    a = draw_bookings(wl, 0.25, 600, 1, linger_s=3600)
    assert len(a) == 10 and a == draw_bookings(wl, 0.25, 600, 1, linger_s=3600) != draw_bookings(wl, 0.25, 600, 2, linger_s=3600)
    for b in a:
        j = next(j for j in jobs if j.id == b.owner)
        assert b.start == j.arrival and b.end == j.arrival + 50.0 and b.created == j.arrival - 600 and b.request is None
    with pytest.raises(ValueError, match="book-fraction"):
        draw_bookings(wl, 0, 600, 1, linger_s=3600)


def test_only_the_gpulease_policies_take_bookings():
    assert [n for n in P.BUILTIN if P.BUILTIN[n]().takes_bookings] == ["gpulease", "gpulease+suspend", "gpulease+restart", "gpulease+release"]
    assert P.for_trace("gpulease", batch=True).takes_bookings


# ------------------------------------------------------------------------- replays
def _run(tmp_path, capsys, *extra):
    out = tmp_path / f"r{len(list(tmp_path.iterdir()))}.json"
    rc = cli.main(["--trace", "notebook", "--limit", "40", "--pool-nodes", "2", "--no-progress", "--json", str(out), *extra])
    text = capsys.readouterr().out
    assert rc == 0
    return json.loads(out.read_text()), text


def _figures(s):
    s = dict(s)
    s.pop("replay")  # wall time
    s.pop("bookings", None)
    return s


def test_drawn_bookings_start_on_time_and_leave_the_static_rows_alone(tmp_path, capsys):
    doc, text = _run(tmp_path, capsys, "--book-fraction", "0.2", "--book-ahead", "600", "--seed", "1")
    plain, _ = _run(tmp_path, capsys)
    gl = next(r for r in doc["results"] if r["policy"] == "gpulease")["bookings"]
    assert gl["applied"] and all(k in gl for k in KEYS)
    assert gl["n"] == 8 and gl["placed"] > 0 and gl["shape_mismatch"] == 0
    assert gl["started_on_time"] == gl["placed"] == gl["honoured"] and gl["started_on_time_fraction"] == 1.0
    assert gl["start_delay_max_s"] <= 60 and 0 <= gl["unused_gpu_hours"] <= gl["booked_gpu_hours"]
    for item in gl["items"]:
        assert item["placed"] or "booked by others" in item["reason"]  # a refusal keeps its reason
    assert "gpulease: 8 bookings" in text and "started within 60 s" in text
    for with_, without in zip(doc["results"], plain["results"]):
        if with_["policy"] != "gpulease":
            assert not with_["bookings"]["applied"] and "not applied" in with_["bookings"]["why"]
            assert _figures(with_) == _figures(without)
    assert "bookings" not in plain and all("bookings" not in r for r in plain["results"])


def test_a_bookings_file_on_a_tiny_workload(tmp_path, capsys):
    csv = tmp_path / "bookings.csv"
    # session-15990 asks for 4 GPUs at 2400 s; session-20445 for one whole GPU at 7080 s (booked as a share: not its shape)
    csv.write_text("owner,start_s,end_s,request\nsession-15990,2400,9600,4\nsession-20445,7080,10000,0.5\n")
    out = tmp_path / "r.json"
    rc = cli.main(["--trace", "notebook", "--limit", "6", "--pool-nodes", "2", "--policies", "static,gpulease", "--no-progress",
                   "--bookings", str(csv), "--json", str(out)])
    assert rc == 0
    assert "bookings (" in capsys.readouterr().out
    doc = json.loads(out.read_text())
    static, gl = doc["results"]
    assert not static["bookings"]["applied"]
    b = gl["bookings"]
    assert b["n"] == 2 and b["placed"] == 2 and b["shape_mismatch"] == 1
    first = b["items"][0]
    assert first["owner"] == "session-15990" and first["line"] == 2 and first["granted_at"] == 2400.0 and first["start_delay_s"] == 0.0
    assert first["request"] == "4 × GPU" and first["gpus"] == 4


def test_bad_booking_options_are_one_line_errors(tmp_path, capsys):
    bad = tmp_path / "b.csv"
    bad.write_text("owner,start_s,end_s,request\nx,10,5,1\n")
    assert cli.main(["--trace", "notebook", "--limit", "5", "--no-progress", "--bookings", str(bad)]) == 2
    assert "line 2" in capsys.readouterr().err
    assert cli.main(["--trace", "notebook", "--limit", "5", "--no-progress", "--book-fraction", "0.5"]) == 2
    assert "go together" in capsys.readouterr().err
