"""The holder's server on a GPU that is failing: the broker's gpu_unhealthy warning reaches the
notebook (the feed and the status) with its own kind, and the kernels holding the GPU are
suspended before the drain ends the lease (as for a preemption)."""

from __future__ import annotations

from partsutil import rig, run
from test_server_parts_reclaim import idle_kernel, proc  # noqa: F401 - the fixture


@run
async def test_a_drain_warns_in_the_notebook_and_suspends_the_kernels_before_the_lease_moves(tmp_path, proc):  # noqa: F811
    r = rig(tmp_path, {"ReclaimActions": {"reclaim_action": "restart"}})
    rec = await idle_kernel(r, proc.pid)
    r.sim.add_process(r.uuid, proc.pid, 2000, sm_util_pct=90.0)  # computing
    ends = r.clock() + 60
    warning = {"kind": "gpu_unhealthy", "at": r.clock(), "device": r.uuid,
               "message": "your GPU is failing (GPU 0 on n1: XID 79: GPU has fallen off the bus): this lease moves to a healthy GPU in 1 min"}
    maintenance = {"kind": "maintenance", "at": r.clock() + 3600, "window": "w1",
                   "message": "a maintenance window on your GPU begins in 1 h (BIOS update), before this lease ends: save your work"}
    for _ in range(2):
        await r.keeper.on_warnings([warning, maintenance], dict(r.keeper.lease, preempt_at=ends))
    said = [w for w in r.events("warning") if w["kind"] in ("gpu_unhealthy", "maintenance")]
    assert [w["kind"] for w in said] == ["gpu_unhealthy", "maintenance"]  # each once, with its own kind
    assert "XID 79" in said[0]["message"] and "BIOS update" in said[1]["message"]
    r.keeper.warnings = [warning, maintenance]
    assert {w["kind"] for w in r.ctrl.status(history=False)["warnings"]} >= {"gpu_unhealthy", "maintenance"}
    await r.tick(45)
    assert rec.state == "ok"
    await r.tick(6)  # 10 s before the lease ends
    assert rec.state == "suspended" and r.checkpoint.calls[0][0] == "suspend"


@run
async def test_a_drain_called_off_before_its_end_leaves_the_kernels_on_their_gpu(tmp_path, proc):  # noqa: F811
    r = rig(tmp_path, {"ReclaimActions": {"reclaim_action": "restart"}})
    rec = await idle_kernel(r, proc.pid)
    r.sim.add_process(r.uuid, proc.pid, 2000, sm_util_pct=90.0)
    warning = {"kind": "gpu_unhealthy", "at": r.clock(), "device": r.uuid,
               "message": "its GPU is failing (fan noise): this lease moves to a healthy GPU in 1 min"}
    await r.keeper.on_warnings([warning], dict(r.keeper.lease, preempt_at=r.clock() + 60))
    await r.tick(30)
    await r.keeper.on_warnings([], dict(r.keeper.lease, preempt_at=None))  # an admin put the GPU back into the pool
    await r.tick(40)  # past the drain's old end
    assert rec.state == "ok" and not r.checkpoint.calls


@run
async def test_a_preemption_called_off_is_no_longer_a_standing_warning(tmp_path, proc):  # noqa: F811
    r = rig(tmp_path, {"ReclaimActions": {"reclaim_action": "restart"}})
    await idle_kernel(r, proc.pid)
    ends = r.clock() + 60
    r.keeper.lease = dict(r.keeper.lease, preempt_at=ends)
    await r.keeper.on_warnings([], r.keeper.lease)
    assert [w["deadline"] for w in r.ctrl.status(history=False)["warnings"] if w["kind"] == "preemption"] == [ends]
    r.keeper.lease = dict(r.keeper.lease, preempt_at=None)  # the waiter started elsewhere
    await r.keeper.on_warnings([], r.keeper.lease)
    assert not [w for w in r.ctrl.status(history=False)["warnings"] if w["kind"] == "preemption"]
