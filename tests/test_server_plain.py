"""A Jupyter server with the extension but no lease, no broker and no GPU: it stays out of the way."""

from __future__ import annotations

import asyncio
import json
import logging

import pytest
from tornado.httpclient import HTTPClientError

from serverutil import start_kernel, status


@pytest.fixture
def jp_server_config(monkeypatch):
    for var in ("GPULEASE_BROKER_URL", "GPULEASE_LEASE_ID", "JUPYTERHUB_API_URL", "JUPYTERHUB_PUBLIC_HUB_URL", "GPULEASE_DEVICE_BACKEND"):
        monkeypatch.delenv(var, raising=False)
    return {"ServerApp": {"jpserver_extensions": {"jupyter_gpulease.server": True}},
            "GPULeaseExtension": {"device_backend": "nvml", "sample_interval": 0.1, "heartbeat_interval": 0.1}}


async def test_a_server_without_lease_broker_or_gpu_logs_one_line_and_says_so(capfd, caplog, jp_serverapp, jp_fetch):
    with caplog.at_level(logging.DEBUG):
        await jp_serverapp.extension_manager.start_all_extensions()
        k = await start_kernel(jp_serverapp, jp_fetch)
        await asyncio.sleep(1.5)  # ~15 samples, ~15 heartbeat turns
        st = await status(jp_fetch)
    assert st["lease"] is None and "GPULEASE_BROKER_URL" in st["message"]
    assert [x["id"] for x in st["kernels"]] == [k.id] and st["devices"] == []
    assert st["kernels"][0]["gpu"]["memory_mib"] == 0
    # the log, wherever this server's loggers write it (its own handlers at start, then propagated)
    records = caplog.get_records("setup") + caplog.get_records("call")
    lines = {r.getMessage() for r in records if r.levelno >= logging.INFO}
    lines |= {line.split("] ", 1)[-1] for line in capfd.readouterr().err.splitlines() if line[:2] in ("[I", "[W", "[E", "[C") and "] " in line}
    ours = [line for line in lines if "GPU" in line]
    assert len(ours) == 1 and "holds no GPU lease" in ours[0], ours
    with pytest.raises(HTTPClientError) as err:
        await jp_fetch("gpulease", "api", "lease", method="POST", body=json.dumps({"gpus": 1}))
    assert err.value.code == 409 and "GPULEASE_BROKER_URL" in json.loads(err.value.response.body)["message"]
    with pytest.raises(HTTPClientError) as err:
        await jp_fetch("gpulease", "api", "pool")
    assert err.value.code == 409


async def test_the_extension_is_enabled_by_the_file_the_package_installs():
    import sys
    from pathlib import Path

    enabled = Path(sys.prefix, "etc", "jupyter", "jupyter_server_config.d", "jupyter_gpulease.json")
    assert json.loads(enabled.read_text())["ServerApp"]["jpserver_extensions"] == {"jupyter_gpulease.server": True}
