"""`%gpu` in a real kernel of a real Jupyter server with the gpulease extension, against a real
broker on a simulated pool: every subcommand, the waiting request and its interrupt, the
`%%gpu` cell, and refusals in the user's words."""

from __future__ import annotations

import asyncio
import re
import time

import pytest

from brokerutil import ManualClock, broker_in_thread, broker_url, patch_auth
from hubharness import wait_for
from jupyter_gpulease.client import BrokerClient
from kernelstack import JupyterServer

pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def stack(tmp_path, monkeypatch):
    patch_auth(monkeypatch)
    clock = ManualClock(time.time())
    with broker_in_thread(tmp_path, clock=clock, tick_interval=0.2) as broker:
        server = JupyterServer(tmp_path, broker_url(broker))
        try:
            yield broker, server, clock
        finally:
            server.stop()


def as_user(broker, user: str) -> BrokerClient:
    return BrokerClient(broker_url(broker), user)


def lease_states(broker, user: str) -> list[str]:
    return [x["state"] for x in asyncio.run(as_user(broker, user).list_leases(state="all"))]


def test_every_subcommand_against_a_real_broker_and_server(stack):
    broker, server, _clock = stack
    k = server.start_kernel()
    try:
        r = k.execute("%gpu status")
        assert "no GPU lease (ask for one with %gpu request)" in r["stdout"], r
        r = k.execute("%gpu pool")
        assert re.search(r"A100-SXM4-80GB\s+2\s+2", r["stdout"]) and "L4" in r["stdout"], r
        r = k.execute("%gpu help")
        assert "%gpu extend DURATION" in r["stdout"]

        r = k.execute("%gpu request --gpus 1 --model L4 --for 1h")
        assert "granted: lease" in r["stdout"] and "L4 #0" in r["stdout"], r
        assert "This kernel uses it from now on (CUDA_VISIBLE_DEVICES=GPU-sim" in r["stdout"], r
        assert lease_states(broker, "alice") == ["active"]
        lease = server.status()["lease"]
        uuid = lease["placement"]["slices"][0]["gpu_uuid"]
        r = k.execute("import os; print(os.environ['CUDA_VISIBLE_DEVICES'])")
        assert r["stdout"].strip() == uuid

        server.devices.set_utilization(uuid, 63)
        wait_for(lambda: (server.status()["devices"] or [{}])[0].get("utilization_pct") == 63, 30, "the server never saw 63%")
        r = k.execute("%gpu status")
        assert re.search(r"L4 #0\s+63%\s+", r["stdout"]), r
        assert "(tier " in r["stdout"] and " left" in r["stdout"]

        before = server.status()["lease"]["expires_at"]
        r = k.execute("%gpu extend 30m")
        assert "extended by 30 min" in r["stdout"], r
        assert server.status()["lease"]["expires_at"] == pytest.approx(before + 1800)

        r = k.execute("%gpu keep 1h")
        assert "kept: idle reclaim leaves this server's GPU alone for 1 h" in r["stdout"], r
        assert server.status()["reclaim"]["keep_until"] is not None
        r = k.execute("%gpu resume")
        assert "nothing to resume" in r["stdout"], r

        # bob waits for the other L4 as well as one more: the queue shows him
        bob = as_user(broker, "bob")
        asyncio.run(bob.request_lease({"gpus": 2, "model": ["L4"]}))
        r = k.execute("%gpu queue")
        assert "2 × L4" in r["stdout"], r

        r = k.execute("%gpu release --force")
        assert r["stdout"].startswith(f"released lease {lease['id'][:8]}: the GPU went back to the pool.\n"), r
        r = k.execute("%gpu status")
        assert f"last: lease {lease['id'][:8]}: Released from the notebook." in r["stdout"], r  # said once
        assert lease_states(broker, "alice") == ["released"]
        r = k.execute("%gpu release")
        assert r["stderr"].startswith("gpulease: ") and "\n" not in r["stderr"].strip(), r
    finally:
        k.stop()


def test_status_says_what_this_kernel_sees_after_it_took_the_gpu_kept_it_and_gave_it_back(stack):
    """One truth per kernel: the server follows what the kernel itself took or dropped, and a keep
    in force is said as such, with the way to end it."""
    _broker, server, _clock = stack
    k = server.start_kernel()
    try:
        r = k.execute("%gpu request --gpus 1 --model L4 --for 1h")
        assert "This kernel uses it from now on" in r["stdout"], r
        r = k.execute("%gpu status")
        assert "restart" not in r["stdout"] and "%gpu keep 1h postpones it" in r["stdout"], r
        r = k.execute("%gpu keep 1h")
        assert "kept: idle reclaim leaves this server's GPU alone for 1 h" in r["stdout"], r
        r = k.execute("%gpu status")
        assert "%gpu keep off ends the keep" in r["stdout"] and "postpones it" not in r["stdout"], r
        assert "reclaim coming" not in r["stdout"]
        r = k.execute("%gpu keep off")
        assert r["stdout"].startswith("keep ended: idle reclaim watches this server's GPU again"), r
        assert server.status()["reclaim"]["keep_until"] is None
        r = k.execute("%gpu status")
        assert "kept:" not in r["stdout"] and "%gpu keep 1h postpones it" in r["stdout"], r
        r = k.execute("%gpu release --force")
        assert "This kernel runs without a GPU from now on" in r["stdout"], r
        r = k.execute("import os; print(repr(os.environ['CUDA_VISIBLE_DEVICES']))")
        assert r["stdout"].strip() == "''", r
        r = k.execute("%gpu status")
        assert "restart" not in r["stdout"] and "sees" not in r["stdout"], r
        assert not any(x["env_stale"] for x in server.status()["kernels"])
    finally:
        k.stop()


def test_a_waiting_request_shows_its_place_and_an_interrupt_withdraws_it(stack):
    broker, server, _clock = stack
    asyncio.run(as_user(broker, "bob").request_lease({"gpus": 2, "model": ["A100*"]}))
    k = server.start_kernel()
    try:
        msg_id = k.client.execute("%gpu request --gpus 1 --model A100* --wait")
        wait_for(lambda: (server.status()["lease"] or {}).get("state") == "queued", 30, "the request never queued")
        k.interrupt()
        r = k.collect(msg_id)
        assert re.search(r"waits for 1 × A100\*: position 1 of 1", r["stdout"]), r
        assert "interrupted: lease" in r["stderr"] and "withdrawn from the queue" in r["stderr"], r
        wait_for(lambda: lease_states(broker, "alice") == ["withdrawn"], 30, "the interrupted request was not withdrawn")
    finally:
        k.stop()


def test_a_waiting_request_is_named_in_words_when_kept_or_asked_again(stack):
    broker, server, _clock = stack
    asyncio.run(as_user(broker, "bob").request_lease({"gpus": 2, "model": ["A100*"]}))
    k = server.start_kernel()
    try:
        r = k.execute("%gpu request --gpus 1 --model A100*")
        assert "Not granted yet" in r["stdout"], r
        lease_id = server.status()["lease"]["id"]
        # nothing granted: nothing to keep, and no GPU is said to be kept
        r = k.execute("%gpu keep 1h")
        assert r["stdout"].startswith("nothing to keep yet: your request for 1 × A100* waits (position 1 of 1"), r
        assert "kept" not in r["stdout"] and server.status()["reclaim"]["keep_until"] is None
        # asking again says what waits, with a short id, and no field of the API
        r = k.execute("%gpu request --gpus 99")
        assert re.fullmatch(rf"gpulease: a request of this server already waits: lease {lease_id[:8]} for 1 × A100\*, "
                            r"position 1 of 1, [^;]+; %gpu release withdraws it, then ask again\n", r["stderr"]), r
        assert lease_id not in r["stderr"]
        r = k.execute("%gpu release")
        assert r["stdout"].strip() == f"withdrawn: lease {lease_id[:8]} no longer waits", r
    finally:
        k.stop()


def test_the_cell_magic_holds_a_lease_only_while_the_cell_runs(stack):
    broker, server, _clock = stack
    k = server.start_kernel()
    try:
        r = k.execute("%%gpu --model L4 --for 1h\nimport os\nprint('sees', os.environ['CUDA_VISIBLE_DEVICES'])")
        assert "granted: lease" in r["stdout"], r
        assert re.search(r"sees GPU-sim", r["stdout"]), r
        assert "released lease" in r["stdout"] and "after the cell" in r["stdout"], r
        assert lease_states(broker, "alice") == ["released"]
    finally:
        k.stop()


def test_bad_lines_and_refusals_get_one_line_in_the_kernel(stack):
    _broker, server, _clock = stack
    k = server.start_kernel()
    try:
        r = k.execute("%gpu extend soon")
        assert r["stderr"].splitlines() == ["not a duration: 'soon' (examples: 90, 90s, 30m, 2h, 1h30m, 1.5h, 1d)",
                                            "usage: %gpu extend DURATION"], r
        r = k.execute("%gpu request --gpus 9 --model L4")
        lines = r["stderr"].strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("gpulease: "), r
        # a duration over the tier's limit, in words: no API field named
        r = k.execute("%gpu request --model L4 --for 100d")
        assert re.fullmatch(r"gpulease: a duration of 100 d is over the \S+ h limit of tier '\w+'; ask for at most \S+ h\n", r["stderr"]), r
        assert "field" not in r["stderr"] and "duration_s" not in r["stderr"]
        r = k.execute("%gpu extend 1h")
        assert r["stderr"] == "gpulease: this server holds no active GPU lease\n", r
        assert "Traceback" not in r["stderr"]
    finally:
        k.stop()
