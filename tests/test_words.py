"""Messages in the user's words: each thing said once, readable figures, no Python values."""

from __future__ import annotations

from jupyter_gpulease.broker.manager import end_message
from jupyter_gpulease.kernel import text


def test_how_a_lease_ended_is_said_once():
    assert end_message({"state": "released", "end_reason": "released from the notebook"}, {"kind": "holder"}) == "Released from the notebook."
    assert (end_message({"state": "reclaimed", "end_reason": "idle: no kernel used the GPU for 30 min"}, {"kind": "idle"})
            == "Reclaimed because its GPUs sat idle: no kernel used the GPU for 30 min.")
    assert end_message({"state": "released", "end_reason": "done"}, {"kind": "holder"}) == "Released: done."
    assert end_message({"state": "released", "end_reason": "released"}, {"kind": "holder"}) == "Released."
    # the notebook's line quotes that sentence without saying the state again
    lease = {"id": "0123456789abcdef0123456789abcdef", "state": "released", "end_message": "Released from the notebook."}
    assert text.lease_line(lease, 0) == "lease 01234567: Released from the notebook."


def test_the_pool_names_free_mig_slices_in_words():
    pool = {"capacity": {"A100-SXM4-80GB": {"gpus": 2, "idle_gpus": 0, "free_share": 0,
                                            "mig": {"3g.40gb": {"total": 2, "free": 2}, "1g.10gb": {"total": 7, "free": 0}}}}}
    out = text.pool_text(pool)
    assert "1g.10gb: none of 7 free, 3g.40gb: 2 of 2 free" in out, out
    assert "{" not in out and "'" not in out
