"""The cell of a kernel whose lease went back unused (a parked kernel) waits for a GPU as a
suspended kernel's cell does, then the kernel takes the new lease's environment and tells the
server: the hook alone, with a stand-in for the server's API."""

from __future__ import annotations

import io
import json
import os
import time

from jupyter_gpulease.kernel.resume import ResumeHook, waiting_words

NOW = 1_800_000_000.0
LEASE = {"id": "L2", "state": "active", "tier": "standard", "request": {"gpus": 1},
         "placement": {"slices": [{"gpu_uuid": "GPU-sim-2", "model": "L4", "index": 1, "memory_mib": 23034, "share": 1.0}]}}


class ServerStandIn:
    """The server extension's API as the hook calls it: the statuses it answers in turn."""

    def __init__(self, statuses: list[dict]):
        self.statuses = statuses
        self.resumed: list[str] = []
        self.sees: list[tuple[str, str]] = []

    def resume(self, kernel_id=None):
        self.resumed.append(kernel_id)
        return {"resuming": [kernel_id]}

    def status(self, *, history_s=None):
        return self.statuses.pop(0) if len(self.statuses) > 1 else self.statuses[0]

    def kernel_sees(self, kernel_id, devices):
        self.sees.append((kernel_id, devices))
        return {}


def test_a_parked_kernels_cell_waits_in_the_queue_then_takes_the_new_leases_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setenv("GPULEASE_LEASE_ID", "")
    marker = tmp_path / "kernel-k1.gpulease-suspended"
    marker.write_text(json.dumps({"kernel_id": "k1", "at": NOW, "parked": True}))
    waiting = {"id": "k1", "state": "resuming", "resume": {"stage": "waiting", "position": 1, "eta": NOW + 600,
                                                            "may_start_sooner_at": NOW + 100}}
    api = ServerStandIn([{"lease": None, "kernels": [waiting]}, {"lease": LEASE, "kernels": [{"id": "k1", "state": "ok", "message": ""}]}])
    out = io.StringIO()
    hook = ResumeHook("k1", str(marker), connect=lambda: api, sleep=lambda s: None, clock=lambda: NOW, out=out)
    assert hook.wait() == "ok"
    said = out.getvalue()
    sooner = time.strftime("%H:%M", time.localtime(NOW + 120))  # 'by' rounds up to the minute
    assert f"GPU given back while unused: waiting for a GPU, number 1 in the queue, expected in about 10 min, or sooner: by {sooner}…" in said
    assert said.rstrip().endswith("this kernel uses GPU-sim-2 from now on; the cell runs now.")
    assert api.resumed == ["k1"] and api.sees == [("k1", "GPU-sim-2")]
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "GPU-sim-2" and os.environ["GPULEASE_LEASE_ID"] == "L2"


def test_a_suspended_kernels_cell_keeps_its_words_and_its_restored_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-sim-1")
    marker = tmp_path / "kernel-k1.gpulease-suspended"
    marker.write_text(json.dumps({"kernel_id": "k1", "at": NOW}))
    api = ServerStandIn([{"lease": None, "kernels": [{"id": "k1", "state": "resuming", "resume": {"stage": "restoring"}}]},
                         {"lease": LEASE, "kernels": [{"id": "k1", "state": "ok", "message": ""}]}])
    out = io.StringIO()
    assert ResumeHook("k1", str(marker), connect=lambda: api, sleep=lambda s: None, clock=lambda: NOW, out=out).wait() == "ok"
    assert "GPU suspended: restoring this kernel's GPU memory…" in out.getvalue()
    assert "restored with its variables" in out.getvalue() and api.sees == []
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "GPU-sim-1"  # cuda-checkpoint moved its memory; its environment is its own


def test_the_waiting_words_name_the_place_the_eta_and_a_sooner_start():
    k = {"resume": {"stage": "waiting", "position": 2, "eta": NOW + 7140}}
    assert waiting_words(k, NOW) == "GPU suspended: waiting for a GPU, number 2 in the queue, expected in about 1 h 59 min…"
    assert waiting_words({}, NOW, parked=True) == "GPU given back while unused: asking for a GPU for this kernel…"
