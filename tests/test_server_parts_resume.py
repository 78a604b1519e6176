"""Resume: a suspended kernel that starts a cell gets a GPU back (a new lease of the same shape
when none is held) and is restored; one that cannot be is restarted and told why."""

from __future__ import annotations

import pytest

from partsutil import child_process, lease_json, rig, run


@pytest.fixture
def proc():
    p = child_process()
    yield p
    p.kill()
    p.wait()


async def suspended_kernel(r, pid: int, kid: str = "k-resume-01"):
    k = r.km.add(kid, pid, connection_file=f"/nonexistent/kernel-{kid}.json")
    r.sim.add_process(r.uuid, pid, 3000, sm_util_pct=0.0)
    await r.tick(62)
    rec = r.ctrl.kernels[kid]
    assert rec.state == "suspended" and r.keeper.active is None  # the lease went back
    return k, rec


@run
async def test_a_suspended_kernel_that_starts_a_cell_gets_a_lease_like_its_former_one_and_is_restored(tmp_path, proc):
    r = rig(tmp_path)
    k, rec = await suspended_kernel(r, proc.pid)
    other = r.sim.inventory()[1].uuid
    r.keeper.grant = lease_json("L2", other, now=r.clock())
    k.execution_state = "busy"
    await r.tick()  # busy for a moment only: not yet
    assert not r.keeper.requested
    await r.tick(2)
    body = r.keeper.requested[0]
    assert body["gpus"] == 1 and body["tier"] == "standard" and body["prefer_gpus"] == [r.uuid]
    assert body["meta"] == {"resume_of": "L1", "kernel": rec.id}
    assert rec.state == "ok" and rec.suspended is None
    restore = next(c for c in r.checkpoint.calls if c[0] == "restore")
    assert restore[2] == {r.uuid: other}  # onto the GPU granted
    assert rec.env_devices == other  # restored in place: it uses the new lease's device
    stages = [e["stage"] for e in r.events("resume")]
    assert stages == ["waiting", "restoring", "done"]
    assert "has its GPU back" in r.events("resume")[-1]["message"]


@run
async def test_without_restore_onto_another_gpu_the_former_one_is_required_and_another_fails_into_a_restart(tmp_path, proc):
    r = rig(tmp_path)
    r.checkpoint.device_map = False
    _k, rec = await suspended_kernel(r, proc.pid)
    r.keeper.grant = lease_json("L2", r.sim.inventory()[1].uuid, now=r.clock())
    assert await r.ctrl.resume_now(rec.id) == [rec.id]
    for _ in range(3):
        await r.tick()
    assert r.keeper.requested[0]["require_gpus"] == [r.uuid]
    failed = r.events("resume")[-1]
    assert failed["stage"] == "failed" and "cannot restore onto another GPU" in failed["message"] and "was restarted" in failed["message"]
    assert ("restart", rec.id) in r.km.calls and rec.state == "ok"


@run
async def test_resume_of_a_server_whose_unused_lease_was_reclaimed_asks_for_the_same_shape(tmp_path):
    r = rig(tmp_path)
    await r.tick(62)  # no kernel: the lease itself goes back after the timeout
    assert r.keeper.released and r.keeper.ended["state"] == "reclaimed"
    r.keeper.grant = lease_json("L3", r.uuid, now=r.clock())
    got = await r.ctrl.resume_lease()
    assert got["id"] == "L3" and r.keeper.requested[-1]["meta"] == {"resume_of": "L1"}
    assert await r.ctrl.resume_lease() is None  # a lease is held now: nothing to resume


@run
async def test_an_unused_lease_stays_for_its_own_timeout_longer_than_the_kernels(tmp_path):
    r = rig(tmp_path, {"ReclaimActions": {"unused_lease_timeout": 300.0}})
    granted = r.clock()
    await r.tick(62)  # a kernel idle this long would be reclaimed; an unused lease is not yet
    st = r.ctrl.status(history=False)
    assert not r.keeper.released and st["reclaim"]["unused_lease_timeout_s"] == 300.0 and st["reclaim"]["timeout_s"] == 60.0
    assert st["reclaim"]["lease_reclaim_at"] == round(granted + 300, 1)
    await r.tick(215)
    assert not [w for w in r.events("warning") if w["kind"] == "lease_reclaim"]
    await r.tick(5)  # 20 s before the end: warned
    assert [w for w in r.events("warning") if w["kind"] == "lease_reclaim"]
    await r.tick(20)
    assert r.keeper.released and r.keeper.ended["state"] == "reclaimed"


@run
async def test_kernels_of_a_server_whose_lease_went_back_unused_wait_for_a_gpu_at_their_next_cell(tmp_path, proc):
    """Parked: suspended with nothing to restore; a cell asks for a GPU of the same shape and goes on, no restore, no restart."""
    import json
    import os
    from pathlib import Path

    from jupyter_gpulease.kernel.resume import marker_path

    r = rig(tmp_path)
    cf = tmp_path / "kernel-k-parked-01.json"
    k = r.km.add("k-parked-01", proc.pid, connection_file=str(cf))
    await r.tick()
    rec = r.ctrl.kernels["k-parked-01"]
    rec.env_devices = r.uuid  # started with the lease's GPU (what /proc says of a kernel of a server with a lease)
    await r.tick(61)  # it never used the GPU: the lease goes back unused
    assert r.keeper.ended["state"] == "reclaimed" and rec.state == "suspended" and rec.suspended["parked"]
    assert json.loads(Path(marker_path(str(cf))).read_text())["parked"] is True
    st = r.ctrl.status(history=False)
    assert st["kernels"][0]["state"] == "suspended" and not st["kernels"][0]["env_stale"]
    # a notebook opened now starts without a GPU, as new kernels are told: it is not parked
    r.km.add("k-parked-02", proc.pid + 1)
    await r.tick()
    assert r.ctrl.kernels["k-parked-02"].state == "ok"
    other = r.sim.inventory()[1].uuid
    r.keeper.grant = lease_json("L2", other, now=r.clock())
    k.execution_state = "busy"
    await r.tick(3)
    body = r.keeper.requested[0]
    assert body["gpus"] == 1 and body["prefer_gpus"] == [r.uuid] and "require_gpus" not in body
    assert rec.state == "ok" and rec.suspended is None and not r.checkpoint.calls  # nothing to restore
    assert not os.path.exists(marker_path(str(cf)))
    done = r.events("resume")[-1]
    assert done["stage"] == "done" and "has a GPU again" in done["message"] and other in done["message"]
    assert r.km.calls == []  # no restart
    assert len(r.keeper.requested) == 1


@run
async def test_a_parked_kernel_that_cannot_get_a_gpu_runs_on_without_one_and_is_not_parked_again(tmp_path, proc):
    from jupyter_gpulease.client import BrokerError

    r = rig(tmp_path)
    r.km.add("k-parked-03", proc.pid)
    await r.tick()
    rec = r.ctrl.kernels["k-parked-03"]
    rec.env_devices = r.uuid
    await r.tick(61)
    assert rec.state == "suspended"

    async def refuse(body):
        raise BrokerError(400, "over your quota", "gpus")

    r.keeper.request = refuse
    assert await r.ctrl.resume_now(rec.id) == [rec.id]
    await r.tick(2)
    assert rec.state == "ok" and r.km.calls == [] and "could not get a GPU again (over your quota)" in rec.message
    assert r.events("resume")[-1]["stage"] == "failed"
    await r.tick(3)
    assert rec.state == "ok"  # not parked again for that lease
