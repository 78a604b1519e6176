"""A queued lease's ETA says when it may come sooner: the holders of the GPUs reserved for it
said in their heartbeats when idle reclaim gives their lease back (``usage.lease_reclaim_at``).
A real broker; the holders' heartbeats are sent as a server extension sends them."""

from __future__ import annotations

import math
import time

from brokerutil import broker_in_thread, broker_url, patch_auth
from jupyter_gpulease.broker.manager import SystemClock
from jupyter_gpulease.hub.placement import queue_message
from serverutil import broker_call

POOL = [{"node": "n1", "model": "L4", "count": 2, "memory_mib": 23034}]


def by_minute(t: float) -> str:
    """The clock time a "by" says for ``t``: the minute after it (never earlier than it comes)."""
    return time.strftime("%H:%M", time.localtime(math.ceil(t / 60) * 60))


def test_the_eta_says_it_may_come_sooner_when_every_holder_it_waits_for_is_idle(tmp_path, monkeypatch):
    patch_auth(monkeypatch)
    with broker_in_thread(tmp_path, pool=POOL, clock=SystemClock()) as app:
        url = broker_url(app)
        _, alice = broker_call(url, "POST", "api/leases", {"gpus": 1, "duration_s": 3 * 3600}, token="alice")
        _, carol = broker_call(url, "POST", "api/leases", {"gpus": 1, "duration_s": 2 * 3600}, token="carol")
        _, bob = broker_call(url, "POST", "api/leases", {"gpus": 1, "duration_s": 3600}, token="bob")
        assert alice["state"] == carol["state"] == "active" and bob["state"] == "queued", bob
        # bob waits for carol's GPU (it ends first): no holder said anything yet
        _, got = broker_call(url, "GET", f"api/leases/{bob['id']}", token="bob")
        assert got["queue"]["eta"] is not None and got["queue"]["may_start_sooner_at"] is None
        soon = round(time.time() + 600, 1)
        # alice is idle, but bob does not wait for her GPU: nothing changes for him
        broker_call(url, "POST", f"api/leases/{alice['id']}/heartbeat", {"usage": {"gpu_busy": False, "lease_reclaim_at": soon}},
                    token="alice")
        _, got = broker_call(url, "GET", f"api/leases/{bob['id']}", token="bob")
        assert got["queue"]["may_start_sooner_at"] is None
        # carol is idle: her GPU goes back by `soon` if she stays idle
        broker_call(url, "POST", f"api/leases/{carol['id']}/heartbeat", {"usage": {"gpu_busy": False, "lease_reclaim_at": soon}},
                    token="carol")
        _, got = broker_call(url, "GET", f"api/leases/{bob['id']}", token="bob")
        q = got["queue"]
        assert q["may_start_sooner_at"] == soon and q["eta"] > soon
        _, listed = broker_call(url, "GET", "api/queue", token="bob")
        assert listed["queue"][0]["queue"]["may_start_sooner_at"] == soon
        words = queue_message(got, now=time.time())
        assert f", or sooner: the GPU it waits for is idle and goes back by {by_minute(soon)} if it stays idle" in words
        # carol computes again: no deadline in her heartbeat, no "sooner"
        broker_call(url, "POST", f"api/leases/{carol['id']}/heartbeat", {"usage": {"gpu_busy": True, "lease_reclaim_at": None}},
                    token="carol")
        _, got = broker_call(url, "GET", f"api/leases/{bob['id']}", token="bob")
        assert got["queue"]["may_start_sooner_at"] is None
        assert "sooner" not in queue_message(got, now=time.time())


def test_gpu_queue_and_status_say_the_sooner_start():
    from jupyter_gpulease.kernel.text import queue_text, queue_words

    now = time.time()
    soon = now + 600
    entry = {"user": "bob", "tier": "default", "request": {"kind": "gpu", "gpus": 1}, "state": "queued",
             "queue": {"position": 1, "length": 1, "eta": now + 5760, "may_start_sooner_at": soon}}
    hhmm = by_minute(soon)
    assert f"~1 h 36 min, or sooner: by {hhmm}" in queue_text([entry], now)
    assert queue_words(entry, now).endswith(f"about 1 h 36 min, or sooner: the GPU it waits for is idle and goes back by {hhmm} "
                                            "if it stays idle")
    entry["queue"]["may_start_sooner_at"] = None
    assert "sooner" not in queue_text([entry], now) + queue_words(entry, now)


def test_a_sooner_start_by_a_time_is_rounded_up_to_the_minute_never_earlier_than_it_comes():
    from jupyter_gpulease.core.words import sooner_words

    at = 60 * round(time.time() / 60) + 3600 + 56  # hh:mm:56
    now = at - 600
    assert sooner_words({"may_start_sooner_at": at}, now, long=False) == f", or sooner: by {time.strftime('%H:%M', time.localtime(at + 4))}"
    assert sooner_words({"may_start_sooner_at": at - 56}, now, long=False) == f", or sooner: by {time.strftime('%H:%M', time.localtime(at - 56))}"
