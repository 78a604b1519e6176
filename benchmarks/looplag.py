"""A measuring probe for benchmarks: a jupyter_server extension that records the event loop's lag.

Every 10 ms it sleeps on the server's event loop and records how late it woke up; ``GET
{base_url}looplag`` answers the percentiles since the last ``DELETE {base_url}looplag`` and the
server process's CPU time. Load it with ``c.ServerApp.jpserver_extensions = {"looplag": True}``
and this folder on ``PYTHONPATH``. Benchmarks only.
"""

from __future__ import annotations

import asyncio
import json
import time

from jupyter_server.base.handlers import APIHandler
from jupyter_server.utils import url_path_join
from tornado import web

PERIOD = 0.010
_lags: list[float] = []


async def _probe() -> None:
    loop = asyncio.get_running_loop()
    while True:
        t0 = loop.time()
        await asyncio.sleep(PERIOD)
        _lags.append(max(0.0, loop.time() - t0 - PERIOD))


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q / 100 * len(xs)))]


class LagHandler(APIHandler):
    @web.authenticated
    def get(self):
        lags = list(_lags)
        t = time.process_time()
        self.finish(json.dumps({"n": len(lags), "p50_ms": _pct(lags, 50) * 1e3, "p99_ms": _pct(lags, 99) * 1e3,
                                "max_ms": max(lags, default=0.0) * 1e3, "cpu_s": t}))

    @web.authenticated
    def delete(self):
        _lags.clear()
        self.set_status(204)
        self.finish()


def _jupyter_server_extension_points():
    return [{"module": "looplag"}]


def _load_jupyter_server_extension(serverapp):
    serverapp.web_app.add_handlers(".*$", [(url_path_join(serverapp.base_url, "looplag"), LagHandler)])
    serverapp.io_loop.add_callback(lambda: asyncio.ensure_future(_probe()))
