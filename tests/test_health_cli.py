"""`jupyter gpulease cordon|drain|uncordon|maintenance` against an in-process broker."""

import time

import pytest

from brokerutil import ManualClock, broker_in_thread, broker_url, patch_auth
from jupyter_gpulease.cli import main as jupyter_gpulease

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def broker(tmp_path, monkeypatch):
    patch_auth(monkeypatch)
    monkeypatch.delenv("JUPYTERHUB_API_TOKEN", raising=False)
    with broker_in_thread(tmp_path, clock=ManualClock(time.time())) as app:
        monkeypatch.setenv("GPULEASE_BROKER_URL", broker_url(app))
        yield app


def test_an_admin_cordons_a_node_sets_a_window_and_users_read_why(broker, capsys, monkeypatch):
    monkeypatch.setenv("GPULEASE_TOKEN", "alice")
    assert jupyter_gpulease(["cordon", "--node", "n1", "--reason", "fan swap"]) == 1
    assert "admin" in capsys.readouterr().err
    monkeypatch.setenv("GPULEASE_TOKEN", "admin-dan")
    assert jupyter_gpulease(["cordon", "--node", "n1", "--reason", "fan swap"]) == 0
    assert "Cordoned node n1: fan swap" in capsys.readouterr().out
    assert jupyter_gpulease(["cordon", "--node", "n9", "--reason", "x"]) == 1
    assert "no node 'n9' in the pool" in capsys.readouterr().err
    assert jupyter_gpulease(["maintenance", "add", "--node", "n2", "--from", "tomorrow 12:00", "--to", "tomorrow 14:00", "--reason", "BIOS update"]) == 0
    added = capsys.readouterr().out
    assert "Maintenance window" in added and "BIOS update" in added
    monkeypatch.setenv("GPULEASE_TOKEN", "alice")
    assert jupyter_gpulease(["pool"]) == 0
    assert "no: fan swap" in capsys.readouterr().out  # the pool's devices say why
    assert jupyter_gpulease(["maintenance"]) == 0
    table = capsys.readouterr().out
    assert "fan swap" in table and "node n2" in table and "BIOS update" in table
    monkeypatch.setenv("GPULEASE_TOKEN", "admin-dan")
    assert jupyter_gpulease(["uncordon", "--node", "n1"]) == 0
    assert "Uncordoned node n1 (it was: fan swap)" in capsys.readouterr().out
    window = added.split("Maintenance window ", 1)[1].split(":", 1)[0]
    assert jupyter_gpulease(["maintenance", "rm", window]) == 0
    assert jupyter_gpulease(["maintenance"]) == 0
    out = capsys.readouterr().out
    assert "No GPU or node is cordoned." in out and "No maintenance window to come." in out
