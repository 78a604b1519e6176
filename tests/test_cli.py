"""`jupyter gpulease pool|leases|queue|extend|release` against an in-process broker."""

import json
import re
import time

import pytest

from brokerutil import ManualClock, broker_in_thread, broker_url, patch_auth
from jupyter_gpulease.broker import cli
from jupyter_gpulease.cli import main as jupyter_gpulease

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def broker(tmp_path, monkeypatch):
    patch_auth(monkeypatch)
    monkeypatch.delenv("GPULEASE_TOKEN", raising=False)
    monkeypatch.delenv("JUPYTERHUB_API_TOKEN", raising=False)
    # the CLI prints times relative to the real clock: start the broker's clock there
    with broker_in_thread(tmp_path, clock=ManualClock(time.time())) as app:
        monkeypatch.setenv("GPULEASE_BROKER_URL", broker_url(app))
        yield app


def out_of(capsys):
    return capsys.readouterr().out


def test_a_researcher_sees_the_pool_requests_extends_and_releases(broker, capsys, monkeypatch):
    monkeypatch.setenv("GPULEASE_TOKEN", "alice")
    assert jupyter_gpulease(["pool"]) == 0
    text = out_of(capsys)
    assert "A100-SXM4-80GB" in text and "L4" in text and "Queue: 0 waiting." in text
    assert "{" not in text and "'" not in text, "the pool is printed as tables, not Python values"

    import asyncio

    from jupyter_gpulease.client import BrokerClient

    lease = asyncio.run(BrokerClient(broker_url(broker), "alice").request_lease({"gpus": 1, "model": "L4", "duration_s": 3600}))
    assert jupyter_gpulease(["leases"]) == 0
    text = out_of(capsys)
    assert lease["id"][:12] in text and "active" in text and "L4 #0 on n2" in text
    assert re.search(r"\bactive\s+alice\s+\(default\)\s", text), "the server column names the default server as the admin page does"
    assert "until " in text and ("(in 59 min)" in text or "(in 1 h)" in text), text

    assert jupyter_gpulease(["extend", lease["id"][:8], "--by", "30m"]) == 0
    text = out_of(capsys)
    assert "now runs until" in text and ("(in 1 h 29 min)" in text or "(in 1 h 30 min)" in text), text

    assert cli.leases_main(["--json"]) == 0
    data = json.loads(out_of(capsys))
    assert data[0]["expires_at"] == lease["expires_at"] + 1800

    assert jupyter_gpulease(["release", lease["id"], "--reason", "done"]) == 0
    assert "released; the server that used it will be stopped" in out_of(capsys)
    assert jupyter_gpulease(["leases", "--state", "ended"]) == 0
    text = out_of(capsys)
    assert "released" in text and "Released: done." in text


def test_queue_shows_positions_and_errors_are_readable(broker, capsys):
    import asyncio

    from jupyter_gpulease.client import BrokerClient

    async def fill():
        c = BrokerClient(broker_url(broker), "bob")
        await c.request_lease({"gpus": 2, "model": "A100*"})
        return await c.request_lease({"gpus": 1, "model": "A100*"})

    queued = asyncio.run(fill())
    assert cli.queue_main(["--token", "bob"]) == 0
    text = out_of(capsys)
    assert queued["id"][:12] in text and "1 GPU (A100*)" in text
    assert cli.extend_main(["--token", "bob", queued["id"], "--by", "1h"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "queued" in err
    assert "field" not in err and "by_s" not in err, "errors speak of options, not of the API's fields"
    assert cli.release_main(["--token", "alice", queued["id"]]) == 1
    assert "another user" in capsys.readouterr().err
    assert cli.pool_main([]) == 1
    assert "no token" in capsys.readouterr().err


@pytest.mark.parametrize("text,seconds", [("90", 90), ("30m", 1800), ("2h", 7200), ("1h30m", 5400), ("1d", 86400)])
def test_durations_read_like_people_write_them(text, seconds):
    assert cli.parse_duration(text) == seconds


def test_extend_reads_times_of_day_and_refuses_a_negative_duration_in_words(broker, capsys, monkeypatch):
    import asyncio

    from jupyter_gpulease.client import BrokerClient

    monkeypatch.setenv("GPULEASE_TOKEN", "alice")
    lease = asyncio.run(BrokerClient(broker_url(broker), "alice").request_lease({"gpus": 1, "model": "L4", "duration_s": 3600}))
    assert cli.extend_main([lease["id"], "--by", "-1h"]) == 2
    err = capsys.readouterr().err
    assert "--by must be a positive duration" in err and "release" in err
    target = time.localtime(lease["expires_at"] + 1800)
    assert cli.extend_main([lease["id"], "--until", time.strftime("%Y-%m-%d %H:%M", target)]) == 0
    assert "now runs until" in out_of(capsys)
    with pytest.raises(SystemExit) as info:
        cli.extend_main([lease["id"], "--until", "25:99"])
    assert info.value.code == 2 and "not a time" in capsys.readouterr().err


def test_until_reads_the_local_clock():
    now = time.mktime((2024, 5, 2, 17, 0, 0, 0, 0, -1))
    assert cli.parse_until("18:30", now) == time.mktime((2024, 5, 2, 18, 30, 0, 0, 0, -1))
    assert cli.parse_until("16:30", now) == time.mktime((2024, 5, 3, 16, 30, 0, 0, 0, -1))  # passed today: tomorrow
    assert cli.parse_until("tomorrow 9:00", now) == time.mktime((2024, 5, 3, 9, 0, 0, 0, 0, -1))
    assert cli.parse_until("2024-05-04 10:15", now) == time.mktime((2024, 5, 4, 10, 15, 0, 0, 0, -1))
    assert cli.parse_until("1714665600", now) == 1714665600.0


def test_release_help_says_what_happens_to_the_server_and_inside_a_server_keeps_it(broker, capsys, monkeypatch):
    import asyncio

    from jupyter_gpulease.client import BrokerClient

    with pytest.raises(SystemExit):
        cli.release_main(["--help"])
    text = out_of(capsys)
    assert "--keep-server" in text and "keeps running without them" in text and "--stop-server" in text
    lease = asyncio.run(BrokerClient(broker_url(broker), "alice").request_lease({"gpus": 1, "model": "L4", "server": "gpu"}))
    # inside alice's server "gpu" (the hub's variables are set there)
    monkeypatch.setenv("JUPYTERHUB_USER", "alice")
    monkeypatch.setenv("JUPYTERHUB_SERVER_NAME", "gpu")
    monkeypatch.setenv("JUPYTERHUB_API_TOKEN", "alice")
    assert cli.release_main([lease["id"][:10]]) == 0
    assert "keeps running without GPUs" in out_of(capsys)
    ended = asyncio.run(BrokerClient(broker_url(broker), "alice").get_lease(lease["id"]))
    assert ended["keep_server"] is True and ended["state"] == "released"


def test_quota_figures_are_rounded_for_people():
    assert cli.fmt_gpus(299.936) == "299.9"
    assert cli.fmt_gpus(2.0) == "2" and cli.fmt_gpus(0.5) == "0.5" and cli.fmt_gpus(1250.0) == "1,250"
