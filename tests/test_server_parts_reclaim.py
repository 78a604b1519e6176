"""Reclaim actions, share caps and the suspend before a preemption, on a moved clock: fake kernel
manager and lease keeper, simulated GPUs, a stand-in cuda-checkpoint."""

from __future__ import annotations

import pytest

from partsutil import child_process, lease_json, rig, run


@pytest.fixture
def proc():
    p = child_process()
    yield p
    p.kill()
    p.wait()


async def idle_kernel(r, pid: int, kid: str = "k-idle-0001", mib: int = 2000):
    r.km.add(kid, pid)
    r.sim.add_process(r.uuid, pid, mib, sm_util_pct=0.0)
    await r.tick()
    return r.ctrl.kernels[kid]


@pytest.mark.parametrize("action", ["restart", "shutdown", "interrupt", "notify"])
@run
async def test_an_idle_kernel_is_warned_then_acted_on_and_an_unused_lease_goes_back(tmp_path, proc, action):
    r = rig(tmp_path, {"ReclaimActions": {"reclaim_action": action}})
    rec = await idle_kernel(r, proc.pid)
    await r.tick(35)  # 36 s idle: the warning (20 s ahead of the 60 s timeout) is not due yet
    assert not r.events("warning")
    await r.tick(5)
    warned = [w for w in r.events("warning") if w["kind"] == "reclaim"]
    assert len(warned) == 1 and warned[0]["kernel_id"] == rec.id and "unless it computes again" in warned[0]["message"]
    assert r.ctrl.status(history=False)["warnings"][0]["kind"] == "reclaim"  # it stands in the status
    await r.tick(20)
    done = [e for e in r.events("reclaim") if e["outcome"] == "done"]
    assert [e["action"] for e in done] == [action]
    if action in ("restart", "shutdown"):
        assert r.km.calls == [(action, rec.id)]
        # no other kernel holds GPU memory: the lease goes back at once, as reclaimed
        assert r.keeper.released and r.keeper.released[0]["state"] == "reclaimed" and r.keeper.released[0]["keep_server"]
        assert r.ctrl.kernel_env.devices == ""
    else:
        assert r.km.calls == ([("interrupt", rec.id)] if action == "interrupt" else [])
        assert not r.keeper.released  # the kernel still holds the GPU


@run
async def test_suspend_keeps_the_memory_and_the_lease_goes_back(tmp_path, proc):
    r = rig(tmp_path)
    rec = await idle_kernel(r, proc.pid)
    await r.tick(62)
    assert r.checkpoint.calls[0][0] == "suspend" and proc.pid in r.checkpoint.calls[0][1]
    assert rec.state == "suspended" and rec.suspended["memory_mib"] == 2000 and rec.suspended["devices"] == [r.uuid]
    assert "nothing is lost" in rec.message and "Its next cell waits for a GPU" in rec.message
    assert r.keeper.released[0]["state"] == "reclaimed"
    lease_events = [e for e in r.events("lease") if e["event"] == "reclaimed"]
    assert lease_events and "keeps running without a GPU" in lease_events[0]["message"]


@run
async def test_without_cuda_checkpoint_suspend_falls_back_and_says_why(tmp_path, proc):
    r = rig(tmp_path, {"ReclaimActions": {"fallback_action": "restart"}}, checkpoint=False)
    rec = await idle_kernel(r, proc.pid)
    await r.tick(45)
    warned = [w for w in r.events("warning") if w["kind"] == "reclaim"]
    assert "it will be restarted" in warned[0]["message"]  # the action that will really happen
    await r.tick(20)
    fallback = [e for e in r.events("reclaim") if e["outcome"] == "fallback"]
    assert fallback and "no cuda-checkpoint here" in fallback[0]["message"]
    assert r.km.calls == [("restart", rec.id)]


@run
async def test_a_failed_action_is_said_and_the_lease_is_kept(tmp_path, proc):
    r = rig(tmp_path, {"ReclaimActions": {"reclaim_action": "restart"}})
    r.km.fail.add("restart")
    await idle_kernel(r, proc.pid)
    await r.tick(62)
    failed = [e for e in r.events("reclaim") if e["outcome"] == "failed"]
    assert failed and "restart failed on purpose" in failed[0]["message"]
    assert not r.keeper.released and not r.ctrl.actions.returning
    assert r.ctrl.kernel_env.get("GPULEASE_LEASE_ID") == "L1"


@run
async def test_a_kernel_that_computes_is_not_reclaimed_and_keep_postpones(tmp_path, proc):
    r = rig(tmp_path, {"ReclaimActions": {"reclaim_action": "restart", "max_keep": 120.0}})
    rec = await idle_kernel(r, proc.pid)
    r.sim.add_process(r.uuid, proc.pid, 2000, sm_util_pct=90.0)
    await r.tick(100)
    assert not r.km.calls and r.ctrl.usage.gpu_busy() and r.web_settings["gpulease_last_activity"]
    assert rec.busy_s >= 99 and rec.idle_s <= 2
    r.sim.add_process(r.uuid, proc.pid, 2000, sm_util_pct=0.0)
    await r.tick(10)
    with pytest.raises(Exception, match="at most 2 min"):
        r.ctrl.keep(3600)
    until = r.ctrl.keep(100)
    assert until > r.clock() and [n for n in r.events("notice") if n["kind"] == "keep"]
    await r.tick(60)
    assert not r.km.calls  # postponed
    await r.tick(100)
    assert r.km.calls == [("restart", rec.id)]  # but not beyond max_keep


@run
async def test_a_keep_is_said_as_such_in_the_status_and_in_gpu_status_and_ends_with_keep_off(tmp_path, proc):
    from jupyter_gpulease.kernel.resume import status_lines
    from jupyter_gpulease.kernel.text import status_text

    r = rig(tmp_path)
    rec = await idle_kernel(r, proc.pid)
    await r.tick(45)  # warned: the reclaim is 15 s ahead
    st = r.ctrl.status(history=False)
    text = status_text(st, r.clock()) + "\n".join(status_lines(st, r.clock()))
    assert "(reclaim at " in text and "kept" not in text
    until = r.ctrl.keep(3600)
    st = r.ctrl.status(history=False)
    [k] = st["kernels"]
    assert k["idle"]["kept_until"] == until and not k["idle"]["warned"] and st["warnings"] == []
    text = status_text(st, r.clock()) + "\n".join(status_lines(st, r.clock()))
    assert "(kept until " in text and "(reclaim" not in text and "%gpu keep off ends the keep" in text and "postpones it" not in text
    # keep off: the kernel's own deadline again (60 s after it fell idle): warned again, then reclaimed
    assert r.ctrl.keep(0) is None and r.ctrl.tracker.keep_until is None
    assert [n for n in r.events("notice") if n["kind"] == "keep"][-1]["message"] == "Idle reclaim is no longer postponed."
    st = r.ctrl.status(history=False)
    assert st["reclaim"]["keep_until"] is None and st["kernels"][0]["idle"]["kept_until"] is None
    warned = len([w for w in r.events("warning") if w["kind"] == "reclaim"])
    await r.tick()
    assert len([w for w in r.events("warning") if w["kind"] == "reclaim"]) == warned + 1 and rec.state == "ok"
    await r.tick(15)
    assert rec.state == "suspended"


@run
async def test_what_a_kernel_sees_is_what_it_says_it_took_or_dropped(tmp_path, proc):
    from jupyter_gpulease.kernel.text import status_text

    r = rig(tmp_path, environ={"GPULEASE_LEASE_ID": "", "CUDA_VISIBLE_DEVICES": "", "GPULEASE_BROKER_URL": "http://broker/"}, lease={})
    r.km.add("k-sees-0001", proc.pid)
    await r.tick()
    rec = r.ctrl.kernels["k-sees-0001"]
    rec.env_devices = ""  # started without a GPU (what /proc says of a kernel started on a server without a lease)
    r.keeper.grant = lease_json("L2", r.uuid, now=r.clock())
    await r.ctrl.request({"gpus": 1})
    [k] = r.ctrl.status(history=False)["kernels"]
    assert k["env_stale"] and k["sight"] == "started without a GPU: restart it to see the new GPU"
    r.ctrl.kernel_sees(rec.id, r.uuid)  # %gpu request in that kernel took the lease's environment itself
    st = r.ctrl.status(history=False)
    assert not st["kernels"][0]["env_stale"] and "restart" not in status_text(st, r.clock())
    assert not [n for n in st["notices"] if n["kind"] == "env_stale"]
    await r.ctrl.release(force=True)
    st = r.ctrl.status(history=False)
    assert st["kernels"][0]["sight"] == "still sees a GPU this server no longer leases: restart it to drop it"
    assert "restart it to drop it" in status_text(st, r.clock()) and "new GPU" not in status_text(st, r.clock())
    r.ctrl.kernel_sees(rec.id, "")  # %gpu release in that kernel dropped it
    assert not r.ctrl.status(history=False)["kernels"][0]["env_stale"]


@run
async def test_a_share_s_memory_overrun_is_warned_then_acted_on_without_returning_the_lease(tmp_path, proc):
    r = rig(tmp_path, {"ReclaimActions": {"reclaim_action": "restart", "share_grace": 10.0}})
    lease = lease_json("L1", r.uuid, share=0.5, memory_mib=1000, now=r.clock())
    r.keeper.lease = lease
    r.km.add("k-share", proc.pid)
    r.sim.add_process(r.uuid, proc.pid, 1500, sm_util_pct=80.0)
    await r.tick()
    warned = [w for w in r.events("warning") if w["kind"] == "share_memory"]
    assert warned and "over this server's share of 1000 MiB" in warned[0]["message"] and "or it will be restarted" in warned[0]["message"]
    await r.tick(5)
    assert not r.km.calls
    await r.tick(6)
    assert r.km.calls == [("restart", "k-share")]
    assert not r.keeper.released  # the GPU is in use: the lease stays


@run
async def test_before_a_preemption_ends_the_lease_the_kernels_holding_the_gpu_are_suspended(tmp_path, proc):
    r = rig(tmp_path, {"ReclaimActions": {"reclaim_action": "restart"}})
    rec = await idle_kernel(r, proc.pid)
    r.sim.add_process(r.uuid, proc.pid, 2000, sm_util_pct=90.0)  # computing: idle reclaim would not touch it
    preempt_at = r.clock() + 30
    await r.keeper.on_warnings([{"kind": "preemption", "at": preempt_at, "message": "the lease is preempted for bob's request."}],
                               dict(r.keeper.lease, preempt_at=preempt_at))
    w = [w for w in r.events("warning") if w["kind"] == "preemption"]
    assert len(w) == 1 and w[0]["message"].startswith("The lease is preempted") and "suspended before then" in w[0]["message"]
    await r.tick(15)
    assert rec.state == "ok"
    await r.tick(6)  # 10 s before the end
    assert rec.state == "suspended" and r.checkpoint.calls[0][0] == "suspend"
    assert not r.keeper.released  # the broker ends the lease; the server only saved the work


@run
async def test_a_deadline_without_the_broker_s_words_says_why_the_lease_ends_early(tmp_path):
    r = rig(tmp_path)
    at = r.clock() + 60
    # a move off a sick GPU whose warning went with an earlier heartbeat: the reason, not a preemption
    drained = dict(r.keeper.lease, preempt_at=at, meta={"revoke": {"reason": "moved off its GPU: GPU 0: XID 79", "drain": True}})
    await r.keeper.on_warnings([], drained)
    said = [w["message"] for w in r.events("warning") if w["kind"] == "preemption"]
    assert said and said[-1].startswith("The GPU lease is being moved off its GPU: GPU 0: XID 79: it ends in")
    assert not any("higher-priority" in m for m in said)
    # the broker's own health warning in the same answer: nothing added
    n = len(said)
    await r.keeper.on_warnings([{"kind": "gpu_unhealthy", "at": at + 1, "message": "GPU 0 fails"}], dict(drained, preempt_at=at + 1))
    assert len([w for w in r.events("warning") if w["kind"] == "preemption"]) == n
    # an admin's revoke: their reason
    await r.keeper.on_warnings([], dict(r.keeper.lease, preempt_at=at + 2, meta={"revoke": {"reason": "node maintenance"}}))
    assert [w["message"] for w in r.events("warning") if w["kind"] == "preemption"][-1].startswith(
        "The GPU lease is being revoked (node maintenance): it ends in")


@run
async def test_the_broker_s_unleased_use_warnings_are_said_once_and_their_end_too(tmp_path):
    r = rig(tmp_path)
    w = {"kind": "unleased_use", "at": 5.0, "pid": 77, "device_uuid": "GPU-x", "message": "Process 77 uses GPU-x.", "deadline": r.clock() + 60}
    for _ in range(2):
        await r.keeper.on_warnings([w], r.keeper.lease)
    assert len([e for e in r.events("warning") if e["kind"] == "unleased_use"]) == 1
    assert r.ctrl.status(history=False)["warnings"] == [w]
    await r.keeper.on_warnings([], r.keeper.lease)
    assert next(n for n in r.events("notice") if n["kind"] == "unleased_use")["message"] == "Process 77 no longer uses a GPU you do not lease."
