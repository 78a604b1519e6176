"""One interface for what `%gpu` and the widget ask, whoever answers it.

* :class:`ServerLease` — the gpulease server extension of this kernel's Jupyter server (the
  normal case: it holds the lease, sees the GPUs and the kernels);
* :class:`BrokerLease` — no such server (plain IPython, a terminal) but a broker to talk to
  (``GPULEASE_BROKER_URL`` and a token): the lease itself, the queue and the pool, without
  device figures, idle keeping or resuming.

:func:`connect` picks one, or raises :class:`NoServer` with a message saying what is missing.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import time
from typing import Any

from ..core.lease import LeaseState
from .endpoint import NoServer, ServerAPI, ServerError, find_server

NO_SERVER = (
    "no gpulease server or broker to talk to: this kernel does not run in a Jupyter server with the "
    "gpulease extension, and GPULEASE_BROKER_URL is not set (e.g. export GPULEASE_BROKER_URL="
    "http://127.0.0.1:8000/services/gpulease/ and GPULEASE_TOKEN=<a JupyterHub API token>)"
)


class ServerLease:
    """The lease of this kernel's server, through the server extension's REST API."""

    kind = "server"

    def __init__(self, api: ServerAPI):
        self.api = api

    @property
    def where(self) -> str:
        return self.api.server.url

    def status(self, *, history_s: float | None = 300) -> dict[str, Any]:
        return self.api.get("status" + ("?history=0" if not history_s else f"?seconds={history_s:g}"))

    def request(self, body: dict[str, Any]) -> dict[str, Any]:
        return self.api.post("lease", body)

    def extend(self, by_s: float) -> dict[str, Any]:
        return self.api.post("lease/extend", {"by_s": by_s})

    def keep(self, for_s: float) -> dict[str, Any]:
        return self.api.post("keep", {"for_s": for_s})

    def resume(self, kernel_id: str | None = None) -> dict[str, Any]:
        return self.api.post("resume", {"kernel_id": kernel_id} if kernel_id else {})

    def release(self, reason: str = "released from the notebook", *, force: bool = False) -> dict[str, Any]:
        return self.api.post("lease/release", {"reason": reason, "force": force})

    def kernel_sees(self, kernel_id: str, devices: str) -> dict[str, Any]:
        """Tell the server which devices this kernel uses now (its CUDA_VISIBLE_DEVICES, "" for none)."""
        return self.api.post(f"kernels/{kernel_id}/devices", {"cuda_visible_devices": devices})

    def queue(self) -> list[dict[str, Any]]:
        d = self.api.get("queue")
        return d.get("queue", d) if isinstance(d, dict) else d

    def pool(self) -> dict[str, Any]:
        return self.api.get("pool")


_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="gpulease-broker")


def _run(coro) -> Any:
    # the kernel's main thread may have a running event loop: run the async client on a thread of its own
    return _pool.submit(asyncio.run, coro).result()


class BrokerLease:
    """The caller's lease straight from the broker (no server extension here)."""

    kind = "broker"

    def __init__(self, client):
        self.client = client

    @property
    def where(self) -> str:
        return self.client.url

    def _call(self, name: str, *args, **kw) -> Any:
        from ..client import BrokerError

        async def go():
            return await getattr(self.client, name)(*args, **kw)

        try:
            return _run(go())
        except BrokerError as e:
            raise ServerError(e.status, e.message, e.field) from None

    def _live(self) -> dict[str, Any] | None:
        leases = self._call("list_leases", state="live")
        active = [x for x in leases if x["state"] == LeaseState.ACTIVE]
        return (active or leases or [None])[0]

    def status(self, *, history_s: float | None = None) -> dict[str, Any]:
        return {"now": time.time(), "lease": self._live(), "devices": [], "kernels": [], "warnings": [], "source": "broker"}

    def request(self, body: dict[str, Any]) -> dict[str, Any]:
        return self._call("request_lease", body)

    def _lease_id(self) -> str:
        lease = self._live()
        if lease is None:
            raise ServerError(404, "you hold no lease and wait for none")
        return lease["id"]

    def extend(self, by_s: float) -> dict[str, Any]:
        return self._call("extend", self._lease_id(), by_s=by_s)

    def keep(self, for_s: float) -> dict[str, Any]:
        raise ServerError(400, "keeping an idle GPU needs the gpulease server extension (idle reclaim runs there)")

    def resume(self, kernel_id: str | None = None) -> dict[str, Any]:
        raise ServerError(400, "resuming needs the gpulease server extension (it suspends and resumes kernels)")

    def release(self, reason: str = "released from IPython", *, force: bool = False) -> dict[str, Any]:
        return self._call("release", self._lease_id(), reason)

    def kernel_sees(self, kernel_id: str, devices: str) -> dict[str, Any]:
        return {}  # no server follows this kernel's devices

    def queue(self) -> list[dict[str, Any]]:
        return self._call("queue")

    def pool(self) -> dict[str, Any]:
        return self._call("pool")


def connect(env: dict[str, str] | None = None) -> ServerLease | BrokerLease:
    """The server extension of this kernel's server; else the broker; else :class:`NoServer`."""
    env = os.environ if env is None else env
    server = find_server(env)
    if server is not None:
        return ServerLease(ServerAPI(server))
    if env.get("GPULEASE_BROKER_URL"):
        from ..client import BrokerClient

        token = env.get("GPULEASE_TOKEN") or env.get("JUPYTERHUB_API_TOKEN", "")
        return BrokerLease(BrokerClient(env["GPULEASE_BROKER_URL"], token))
    raise NoServer(NO_SERVER)
