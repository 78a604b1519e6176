"""`jupyter gpulease pool|leases|queue|extend|release` against an in-process broker."""

import json
import time

import pytest

from brokerutil import broker_in_thread, broker_url, patch_auth
from jupyter_gpulease.broker import cli
from jupyter_gpulease.broker.manager import ManualClock
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
    assert "A100-SXM4-80GB" in text and "L4" in text and "queue: 0 waiting" in text

    import asyncio

    from jupyter_gpulease.client import BrokerClient

    lease = asyncio.run(BrokerClient(broker_url(broker), "alice").request_lease({"gpus": 1, "model": "L4", "duration_s": 3600}))
    assert jupyter_gpulease(["leases"]) == 0
    text = out_of(capsys)
    assert lease["id"][:12] in text and "active" in text and "n2/0" in text

    assert jupyter_gpulease(["extend", lease["id"][:8], "--by", "30m"]) == 0
    text = out_of(capsys)
    assert "now expires in 1h29m" in text or "now expires in 1h30m" in text, text

    assert cli.leases_main(["--json"]) == 0
    data = json.loads(out_of(capsys))
    assert data[0]["expires_at"] == lease["expires_at"] + 1800

    assert jupyter_gpulease(["release", lease["id"], "--reason", "done"]) == 0
    assert "released" in out_of(capsys)
    assert jupyter_gpulease(["leases", "--state", "ended"]) == 0
    assert "released" in out_of(capsys)


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
    assert queued["id"][:12] in text and "1 GPU A100*" in text
    assert cli.extend_main(["--token", "bob", queued["id"], "--by", "1h"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "queued" in err
    assert cli.release_main(["--token", "alice", queued["id"]]) == 1
    assert "another user" in capsys.readouterr().err
    assert cli.pool_main([]) == 1
    assert "no token" in capsys.readouterr().err


@pytest.mark.parametrize("text,seconds", [("90", 90), ("30m", 1800), ("2h", 7200), ("1h30m", 5400), ("1d", 86400)])
def test_durations_read_like_people_write_them(text, seconds):
    assert cli.parse_duration(text) == seconds
