"""The `%gpu watch` widget in a real kernel of a real gpulease server: its state follows the
feed (a grant, an expiry warning, an expiry, an idle reclaim that suspends the kernel, a resume),
its buttons call the server's actions, it keeps updating while a cell sleeps for 10 s, several
widgets share one feed, and closing them stops it.

The kernel is asked what its widget shows (``LeaseWidget.state``); the updates that reach the
browser are the comm messages the kernel sends on IOPub, which the tests read as JupyterLab does.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path

import pytest

from brokerutil import ManualClock, broker_in_thread, broker_url, patch_auth
from hubharness import wait_for
from jupyter_gpulease.client import BrokerClient
from kernelstack import JupyterServer

pytestmark = pytest.mark.timeout(300)

TESTS = Path(__file__).resolve().parent


IDLE_TIMEOUT_S = 6  # the reclaim test waits this long for an idle kernel to be suspended


@pytest.fixture
def stack(tmp_path, monkeypatch):
    """The broker (a clock the test moves), alice's server (idle reclaim after 6 s, suspending with a
    stand-in for cuda-checkpoint that moves the simulated GPU memory aside)."""
    import standin_cuda_checkpoint as standin

    patch_auth(monkeypatch)
    clock = ManualClock(time.time())
    standin_dir = tmp_path / "standin"
    standin_dir.mkdir()
    checkpoint = standin.install(str(standin_dir))
    with broker_in_thread(tmp_path, clock=clock, tick_interval=0.2) as broker:
        state_file = tmp_path / "server-alice" / "sim-gpus.json"
        server = JupyterServer(
            tmp_path, broker_url(broker),
            extra_args=[f"--GPULeaseExtension.cuda_checkpoint={checkpoint}", f"--GPUIdleRule.gpu_idle_timeout={IDLE_TIMEOUT_S}",
                        "--GPUIdleRule.gpu_idle_timeout_learn=False", "--ReclaimActions.warn_before=2", "--GPUIdleRule.gaps_file="],
            extra_env={"STANDIN_CUDA_CHECKPOINT_DIR": str(standin_dir), "STANDIN_CUDA_CHECKPOINT_SIM_STATE": str(state_file),
                       "STANDIN_CUDA_CHECKPOINT_REMAP": "1"},
        )
        try:
            yield broker, server, clock
        finally:
            server.stop()


def busy_kernel(server, k, sm_util_pct: float) -> int:
    """Put the kernel's process on both L4s (whichever is leased), holding 2 GiB at ``sm_util_pct``."""
    pid = int(k.execute("import os; print(os.getpid())")["stdout"].strip())
    for gpu in server.devices.inventory():
        if gpu.model == "L4":
            server.devices.add_process(gpu.uuid, pid, 2048, sm_util_pct=sm_util_pct)
    return pid


def inspect(k, code: str) -> dict:
    """Run ``code`` as a silent execution (as a frontend's own requests are): a cell in a suspended
    kernel would first wait for its resume; this looks at the kernel as it is."""
    return k.collect(k.client.execute(code, silent=True, store_history=False))


def widget_state(k, index: int = -1) -> dict:
    r = inspect(k, f"import json\nfrom jupyter_gpulease.kernel.widget import LeaseWidget\nprint(json.dumps(LeaseWidget.instances[{index}].state))")
    assert r["stdout"].strip(), r
    return json.loads(r["stdout"].strip().splitlines()[-1])


def wait_widget(k, predicate, message: str, timeout: float = 60) -> dict:
    """Ask the kernel what its widget shows until ``predicate`` holds (or fail, saying what it showed)."""
    deadline = time.monotonic() + timeout
    while True:
        s = widget_state(k)
        if s and predicate(s):  # {} until the feed's first read reached the widget
            return s
        if time.monotonic() > deadline:
            st = k.server.status()
            raise AssertionError(f"{message}: not seen within {timeout} s; the widget shows {s}; "
                                 f"the server: lease={st.get('lease')}, warnings={st.get('warnings')}, message={st.get('message')!r}")
        time.sleep(0.5)


def broker_lease(broker, lease_id: str) -> dict:
    return asyncio.run(BrokerClient(broker_url(broker), "alice").get_lease(lease_id))


def test_the_widget_follows_a_grant_a_warning_a_reclaim_a_resume_and_an_expiry(stack):
    broker, server, clock = stack
    k = server.start_kernel()
    try:
        busy_kernel(server, k, 50.0)  # the kernel computes on the GPU: no idle reclaim yet
        r = k.execute("%gpu watch")
        assert any(m["msg_type"] == "display_data" and "application/vnd.jupyter.widget-view+json" in m["content"]["data"]
                   for m in r["messages"]), "no widget was displayed"
        wait_widget(k, lambda s: s["lease_state"] == "none", "no lease at first")

        # a grant (asked for from JupyterLab's panel, say): the widget counts down
        status, lease = server.api("POST", "gpulease/api/lease", {"gpus": 1, "model": "L4", "duration_s": 3600})
        assert status == 201, lease
        s = wait_widget(k, lambda s: s["lease_state"] == "active" and s["countdown"], "the grant")
        assert s["countdown"].endswith(" left")
        assert set(s["buttons"]) == {"extend", "keep", "release"}

        # 50 minutes on, the broker warns of the expiry; the widget shows it, and its Extend button extends
        clock.advance(3000)
        wait_widget(k, lambda s: any("expir" in w.lower() for w in s["warnings"]), "the expiry warning")
        before = broker_lease(broker, lease["id"])["expires_at"]
        k.execute("from jupyter_gpulease.kernel.widget import LeaseWidget\nLeaseWidget.instances[-1].buttons['extend'].click()")
        assert broker_lease(broker, lease["id"])["expires_at"] == pytest.approx(before + 1800)

        # the kernel stops computing but keeps its GPU memory: warned, then suspended, and the lease goes back
        busy_kernel(server, k, 0.0)
        wait_widget(k, lambda s: any("reclaim" in w.lower() or "idle" in w.lower() for w in s["warnings"]), "the idle warning")
        s = wait_widget(k, lambda s: s["suspended"] and "resume" in s["buttons"], "the reclaim (suspend)")
        assert any("suspend" in w for w in s["warnings"])
        wait_for(lambda: broker_lease(broker, lease["id"])["state"] == "reclaimed", 60, "the idle lease did not go back")

        # its Resume button: a new lease, the kernel's GPU memory restored
        inspect(k, "from jupyter_gpulease.kernel.widget import LeaseWidget\nLeaseWidget.instances[-1].buttons['resume'].click()")
        s = wait_widget(k, lambda s: not s["suspended"] and s["lease_state"] == "active", "the resume")
        resumed = s["lease_id"]
        assert resumed != lease["id"]
        busy_kernel(server, k, 50.0)

        # the new lease runs out: the widget says so
        clock.advance(4 * 3600)
        s = wait_widget(k, lambda s: s["lease_state"] == "none" and "Expired: its time limit" in s["header"], "the expiry")
        assert broker_lease(broker, resumed)["state"] == "expired"
    finally:
        k.stop()


def comm_updates(messages: list[dict]) -> list[dict]:
    return [m["content"]["data"]["state"] for m in messages
            if m["msg_type"] == "comm_msg" and m["content"]["data"].get("method") == "update"]


def test_the_widget_keeps_updating_while_a_cell_sleeps_for_10_s(stack):
    _broker, server, _clock = stack
    k = server.start_kernel()
    try:
        busy_kernel(server, k, 50.0)  # no idle reclaim during the test
        k.execute("%gpu request --gpus 1 --model L4 --for 1h")
        uuid = server.status()["lease"]["placement"]["slices"][0]["gpu_uuid"]
        server.devices.set_utilization(uuid, 10)
        k.execute("%gpu watch")
        wait_widget(k, lambda s: list(s["utilization"].values()) == [10.0], "10% at first")

        # while the cell sleeps, the GPU gets busy
        busy = threading.Timer(3.0, server.devices.set_utilization, (uuid, 90))
        busy.start()
        r = k.execute("import time\ntime.sleep(10)\nprint('slept')")
        busy.join()
        assert "slept" in r["stdout"]
        updates = comm_updates(r["messages"])
        # the countdown alone changes every second: many updates reached the browser during the cell
        assert len(updates) >= 5, updates
        assert any(u.get("value") == 90.0 for u in updates), "the 90% never reached the browser while the cell ran"
        assert widget_state(k)["utilization"] == {uuid: 90.0}
    finally:
        k.stop()


def test_widgets_share_one_feed_and_closing_them_stops_it(stack):
    _broker, server, _clock = stack
    k = server.start_kernel()
    try:
        k.execute("%gpu watch")
        k.execute("%gpu watch")
        code = ("import threading\nfrom jupyter_gpulease.kernel.widget import LeaseWidget\n"
                "ws = LeaseWidget.instances\n"
                "print(len(ws), len({id(w.feed) for w in ws}), ws[0].feed.subscribers, "
                "sum(t.name == 'gpulease-feed' for t in threading.enumerate()))")
        assert k.execute(code)["stdout"].split() == ["2", "1", "2", "1"]
        k.execute("LeaseWidget.instances[-1].close()")
        assert k.execute(code)["stdout"].split() == ["1", "1", "1", "1"]
        k.execute("LeaseWidget.instances[-1].close()")
        wait_for(lambda: k.execute("import threading\nprint(sum(t.name == 'gpulease-feed' for t in threading.enumerate()))")["stdout"].strip() == "0",
                 30, "the feed thread did not stop after the last widget closed")
        # no more widget traffic once closed: a cell's run carries no comm updates
        r = k.execute("import time\ntime.sleep(3)")
        assert comm_updates(r["messages"]) == []
    finally:
        k.stop()
