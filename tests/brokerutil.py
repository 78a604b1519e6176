"""An in-process broker for tests, with a movable clock.

Unit-level only: ``fake_hub_auth`` replaces the broker's hub lookup so a test can name the
caller in the token (``token alice`` is user alice; names starting with ``admin`` carry
the admin scope). The end-to-end tests in test_broker_hub.py use a real JupyterHub instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading

from traitlets.config import Config

from hubharness import free_port
from jupyter_gpulease.broker import handlers
from jupyter_gpulease.broker.app import GPULeaseBroker

SMALL_POOL = [
    {"node": "n1", "model": "A100-SXM4-80GB", "count": 2, "memory_mib": 81920},
    {"node": "n2", "model": "L4", "count": 2, "memory_mib": 23034},
]

GROUPS = {"alice": ["physics"], "bob": ["chemistry"]}


async def _fake_authenticate(self):
    header = self.request.headers.get("Authorization", "")
    if not header.lower().startswith("token "):
        return None
    name = header.split(None, 1)[1].strip()
    if name in ("", "invalid"):
        return None
    scopes = ["access:services!service=gpulease"]
    if name.startswith("admin"):
        scopes.append("custom:gpulease:admin")
    if name.startswith("prometheus"):  # the hub service whose token Prometheus sends
        scopes.append("custom:gpulease:metrics")
    return {"kind": "user", "name": name, "groups": GROUPS.get(name, []), "scopes": scopes, "admin": False}


class ManualClock:
    """A clock a test moves by hand (the broker's ``clock=``: anything with ``now()``)."""

    def __init__(self, t: float = 1_700_000_000.0):
        self.t = float(t)

    def now(self) -> float:
        return self.t

    def advance(self, seconds: float) -> float:
        self.t += seconds
        return self.t


def make_broker(tmp_path, clock=None, *, pool=None, db_name="broker.sqlite", **traits) -> GPULeaseBroker:
    c = Config()
    c.GPULeaseBroker.db_url = f"sqlite:///{tmp_path / db_name}"
    c.GPULeaseBroker.device_backend = "simulated"
    c.GPULeaseBroker.devices = {"gpus": pool or SMALL_POOL}
    c.GPULeaseBroker.bind_url = f"http://127.0.0.1:{free_port()}"
    c.GPULeaseBroker.base_url = "/services/gpulease/"
    c.GPULeaseBroker.config_file = ""
    c.GPULeaseBroker.tick_interval = 3600  # tests tick by hand
    for k, v in traits.items():
        setattr(c.GPULeaseBroker, k, v)
    app = GPULeaseBroker(config=c, clock=clock or ManualClock())
    app.initialize([])
    return app


def broker_url(app) -> str:
    return app.bind_url.rstrip("/") + app.base_url


@contextlib.contextmanager
def broker_in_thread(tmp_path, **kw):
    """A broker serving from its own thread and event loop (for code that runs its own loop)."""
    app = make_broker(tmp_path, **kw)
    loop = asyncio.new_event_loop()
    started = threading.Event()

    def run():
        asyncio.set_event_loop(loop)
        loop.run_until_complete(app.start_async())
        started.set()
        loop.run_forever()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    assert started.wait(30), "the broker did not start within 30 s"
    try:
        yield app
    finally:
        asyncio.run_coroutine_threadsafe(app.stop_async(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        t.join(30)


def patch_auth(monkeypatch) -> None:
    monkeypatch.setattr(handlers.APIHandler, "authenticate", _fake_authenticate)
