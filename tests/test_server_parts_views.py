"""Usage accounting, the heartbeat's usage, the status JSON and the settings' old names."""

from __future__ import annotations

import json

from traitlets.config import Config
from traitlets.config.loader import DeferredConfigString

from jupyter_gpulease.server import views
from jupyter_gpulease.server.app import GPULeaseExtension
from jupyter_gpulease.server.controller import PARTS, GPUController
from jupyter_gpulease.server.usage import MAX_BYTES
from partsutil import child_process, lease_json, rig, run


@run
async def test_usage_counts_busy_and_idle_per_kernel_and_device_and_the_heartbeat_names_each_kernel(tmp_path):
    procs = [child_process() for _ in range(2)]
    try:
        r = rig(tmp_path)
        a, b = "aaaaaaaa-0000-4000-8000-000000000001", "bbbbbbbb-0000-4000-8000-000000000002"
        r.km.add(a, procs[0].pid, kernel_name="python3")
        r.km.add(b, procs[1].pid, kernel_name="julia-1.10")
        r.sessions.paths = {a: "projects/train.ipynb", b: "scratch.ipynb"}
        r.sim.add_process(r.uuid, procs[0].pid, 4000, sm_util_pct=70.0)
        r.sim.add_process(r.uuid, procs[1].pid, 1000, sm_util_pct=0.0)
        await r.tick(11)
        usage = r.keeper.usage()  # what the next heartbeat carries
        ka, kb = usage["kernels"][a], usage["kernels"][b]
        assert (ka["busy_s"], ka["idle_s"], ka["mem_peak_mib"], ka["name"], ka["path"], ka["state"]) == (10.0, 0.0, 4000, "python3", "projects/train.ipynb", "ok")
        assert (kb["busy_s"], kb["idle_s"], kb["name"], kb["path"]) == (0.0, 10.0, "julia-1.10", "scratch.ipynb")
        assert usage["devices"][r.uuid]["busy_s"] == 10.0 and usage["gpu_busy"] is True
        assert usage["lease_reclaim_at"] is None  # a computes: no reclaim planned
        r.sim.add_process(r.uuid, procs[0].pid, 4000, sm_util_pct=0.0)
        await r.tick(2)
        # both idle and suspended at their deadlines: the lease goes back after the later one
        at = r.keeper.usage()["lease_reclaim_at"]
        assert at == round(r.ctrl.tracker.kernel_deadline(a, 60.0), 1) and at > r.clock()
        assert usage["t"] == round(r.clock() - 2, 1)
    finally:
        for p in procs:
            p.kill()


@run
async def test_the_heartbeat_s_usage_stays_under_the_broker_s_cap_with_many_kernels(tmp_path):
    r = rig(tmp_path)
    r.ctrl.kernels.refresh()
    for i in range(40):
        r.km.add(f"{i:08d}-0000-4000-8000-000000000000", 10_000 + i, kernel_name="python3")
    r.ctrl.kernels.refresh()
    for i, rec in enumerate(r.ctrl.kernels):
        rec.busy_s, rec.memory_peak_mib, rec.path = 100.0 + i, 1000 + i, "a/very/long/notebook/path/" * 20 + f"{i}.ipynb"
    usage = r.ctrl.usage.usage()
    size = len(json.dumps(usage))
    assert size <= MAX_BYTES < 4096
    kept = list(usage["kernels"])
    assert 0 < len(kept) < 40 and kept[0] == "00000039-0000-4000-8000-000000000000"  # the highest memory peaks first
    assert all(v["path"].endswith(".ipynb") for v in usage["kernels"].values())


@run
async def test_the_status_carries_the_lease_s_sentences_and_the_actions_offered(tmp_path):
    r = rig(tmp_path)
    await r.tick()
    st = r.ctrl.status(history=False)
    assert st["lease"]["summary"] == "Lease L1 · tier standard" and st["lease"]["queue_words"] == ""
    assert st["lease"]["devices"] == [r.uuid] and 3500 < st["lease"]["time_left_s"] <= 3600
    assert [a["name"] for a in st["actions"]] == ["extend", "keep", "release"]
    assert st["reclaim"]["timeout_s"] == 60.0 and st["reclaim"]["action"] == "suspend" and st["reclaim"]["warn_before_s"] == 20.0
    assert st["message"] == "" and st["telemetry"]["backend"] == "simulated"
    queued = lease_json("L9", state="queued", queue={"position": 2, "length": 5, "eta": r.clock() + 840})
    assert views.lease_json(queued, r.clock())["summary"] == "Waiting: position 2 of 5"
    assert views.queue_words(queued, r.clock()) == "queued for a GPU: position 2 of 5, about 14 min"
    assert views.status_message(has_broker=True, lease=None, telemetry_ok=True, unavailable="", sample_error="") == \
        "This server holds no GPU lease: kernels run without a GPU."


def test_a_setting_under_its_part_s_name_and_under_the_extension_s_old_name(tmp_path):
    cfg = Config({
        "GPULeaseExtension": {"reclaim_action": DeferredConfigString("restart"), "warn_before": 7.0, "gpu_idle_timeout": 90.0,
                              "report_activity": False, "resume_max_wait": 30.0, "sample_interval": 0.5},
        "ReclaimActions": {"warn_before": 3.0},  # the part's own name wins
    })
    ext = GPULeaseExtension(config=cfg)  # its config is migrated as it is given (core.renames)
    assert ext.sample_interval == 0.5
    r = rig(tmp_path)
    ctrl = GPUController(parent=ext, kernel_manager=r.km, monitor=r.ctrl.monitor, keeper=r.keeper, feed=r.ctrl.feed, clock=r.clock,
                         environ=dict)
    assert ctrl.actions.reclaim_action == "restart" and ctrl.actions.warn_before == 3.0
    assert ctrl.idle.timeout("restart") == 90.0 and ctrl.usage.report_activity is False and ctrl.resumer.resume_max_wait == 30.0
    # every setting is declared once: no part's name is also the extension's
    ext_names = set(GPULeaseExtension.class_trait_names(config=True))
    for part in PARTS:
        assert not ext_names & set(part.class_trait_names(config=True)), part.__name__
