"""dcgm-exporter interop: with ``GPULeaseBroker.dcgm_hpc_job_mapping_dir`` the broker writes, per
GPU index, the ids of the leases holding the GPU (the files dcgm-exporter's
``--hpc-job-mapping-dir`` reads), replaces them atomically, and empties them when leases end."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from brokerutil import ManualClock, broker_url, make_broker, patch_auth
from jupyter_gpulease.broker.dcgm import job_files
from jupyter_gpulease.client import BrokerClient

pytestmark = pytest.mark.timeout(60)

POOL = [
    {"node": "n1", "model": "A100-SXM4-80GB", "count": 2, "memory_mib": 81920},
    {"node": "n2", "model": "L4", "count": 2, "memory_mib": 23034},
]


def read(folder) -> dict[str, list[str]]:
    """Every mapping file under ``folder`` (relative path -> its ids); temporary files would show too."""
    out = {}
    for root, _, files in os.walk(folder):
        for f in files:
            path = os.path.join(root, f)
            out[os.path.relpath(path, folder)] = Path(path).read_text().split()
    return out


def test_the_broker_writes_the_lease_ids_per_gpu_index_and_clears_them_when_leases_end(tmp_path, monkeypatch):
    patch_auth(monkeypatch)
    clock = ManualClock()
    folder = tmp_path / "dcgm-job-map"

    async def main():
        app = make_broker(tmp_path, clock, pool=POOL, dcgm_hpc_job_mapping_dir=str(folder / "{node}"))
        await app.start_async()
        try:
            await app.dcgm.idle()
            assert read(folder) == {"n1/0": [], "n1/1": [], "n2/0": [], "n2/1": []}  # every GPU has a file, empty while unheld
            alice, bob = BrokerClient(broker_url(app), "alice"), BrokerClient(broker_url(app), "bob")
            a = await alice.request_lease({"gpus": 2, "model": "A100*"})
            half1 = await alice.request_lease({"share": 0.5, "model": "L4"})
            half2 = await bob.request_lease({"share": 0.5, "model": "L4"})
            waiting = await bob.request_lease({"gpus": 1, "model": "A100*"})
            assert waiting["state"] == "queued"
            await app.dcgm.idle()
            got = read(folder)
            assert got["n1/0"] == got["n1/1"] == [a["id"]]
            l4 = half1["placement"]["slices"][0]["index"]
            assert half2["placement"]["slices"][0]["index"] == l4, "both halves share one L4"
            assert got[f"n2/{l4}"] == sorted([half1["id"], half2["id"]])  # two leases on one GPU: two lines
            assert got[f"n2/{1 - l4}"] == []
            mode = os.stat(folder / "n1" / "0").st_mode & 0o777
            assert mode == 0o644  # the exporter runs as another user

            await alice.release(a["id"])  # bob's queued lease gets one of the A100s
            await alice.release(half1["id"])
            await app.dcgm.idle()
            got = read(folder)
            assert sorted(got["n1/0"] + got["n1/1"]) == [waiting["id"]]
            assert got[f"n2/{l4}"] == [half2["id"]]
            writes = app.dcgm.writes
        finally:
            await app.stop_async()

        # a broker that takes over (a restart, the standby) writes the leases it found at its start
        for f in (folder / "n2").iterdir():
            f.write_text("stale\n")
        app2 = make_broker(tmp_path, clock, pool=POOL, dcgm_hpc_job_mapping_dir=str(folder / "{node}"))
        await app2.start_async()
        try:
            await app2.dcgm.idle()
            assert read(folder)[f"n2/{l4}"] == [half2["id"]]
            assert read(folder)[f"n2/{1 - l4}"] == []
        finally:
            await app2.stop_async()
        return writes

    writes = asyncio.run(main())
    # only files whose content changed were written: 4 at the start, then 2 (alice's A100s), 1 and 1
    # (the shared L4, twice), 2 (alice's end and bob's grant on the A100s) and 1 (alice's half);
    # rewriting every file at each grant and end would be 4 + 5 * 4
    assert writes <= 4 + 2 + 1 + 1 + 2 + 1


def test_job_files_per_node_folder_or_one_folder(tmp_path):
    from jupyter_gpulease.core.model import GPU

    gpus = [GPU("GPU-a", "n1", 0, "A100", 1), GPU("GPU-b", "n2", 0, "A100", 1)]
    leases = [
        {"id": "L1", "state": "active", "placement": {"slices": [{"gpu_uuid": "GPU-a"}, {"gpu_uuid": "GPU-b"}]}},
        {"id": "L2", "state": "queued", "placement": None},
    ]
    assert job_files(leases, gpus, "/m/{node}") == {"/m/n1/0": "L1\n", "/m/n2/0": "L1\n"}
    # one folder: the broker on the GPU node itself (a second node's index 0 would collide: use {node})
    assert job_files(leases, gpus[:1], "/m") == {"/m/0": "L1\n"}


def test_a_folder_it_cannot_write_is_logged_and_tried_again(tmp_path, monkeypatch):
    patch_auth(monkeypatch)
    blocked = tmp_path / "not-a-folder"
    blocked.write_text("a file where the folder should be")

    async def main():
        app = make_broker(tmp_path, ManualClock(), pool=POOL[:1], dcgm_hpc_job_mapping_dir=str(blocked / "map"))
        await app.start_async()
        try:
            await app.dcgm.idle()
            assert app.dcgm.last_error and app.dcgm.written == {}
            blocked.unlink()
            await BrokerClient(broker_url(app), "alice").request_lease({"gpus": 1, "model": "A100*"})
            await app.dcgm.idle()
            assert app.dcgm.last_error == "" and sorted(os.listdir(blocked / "map")) == ["0", "1"]
        finally:
            await app.stop_async()

    asyncio.run(main())
