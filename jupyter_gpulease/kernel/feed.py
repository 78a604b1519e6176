"""One live feed per kernel: a background thread that reads the server's status every second
and hands it to every subscriber (each `%gpu watch` widget).

Why a thread: the kernel runs asyncio tasks only between cells, and the point of the widget is
to move while a long cell runs. The thread never prints (ipykernel routes a thread's output to
whichever cell happens to be running); errors go to the log and to subscribers as a status
with ``error`` set. It is a daemon thread: a kernel restart ends it with the process, and it
stops by itself when the last subscriber leaves.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from .endpoint import ServerError

log = logging.getLogger(__name__)

Subscriber = Callable[[dict[str, Any]], None]


class StatusFeed:
    """Polls ``api.status()`` every ``interval`` seconds while anyone subscribes."""

    def __init__(self, api, *, interval: float = 1.0, clock: Callable[[], float] = time.time):
        self.api = api
        self.interval = interval
        self._clock = clock
        self._subs: list[Subscriber] = []
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self.last: dict[str, Any] | None = None
        self.updates = 0  # statuses delivered (tests and the widget's footer read it)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def subscribers(self) -> int:
        with self._lock:
            return len(self._subs)

    def subscribe(self, fn: Subscriber) -> None:
        with self._lock:
            self._subs.append(fn)
            if not self.running:
                self._thread = threading.Thread(target=self._run, name="gpulease-feed", daemon=True)
                self._thread.start()
        if self.last is not None:
            self._deliver(fn, self.last)

    def unsubscribe(self, fn: Subscriber) -> None:
        with self._lock:
            if fn in self._subs:
                self._subs.remove(fn)
        self._wake.set()

    def refresh(self) -> None:
        """Read the status now rather than at the next tick (after a button's action)."""
        self._wake.set()

    def stop(self) -> None:
        with self._lock:
            self._subs.clear()
        self._wake.set()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(5)

    def _deliver(self, fn: Subscriber, status: dict[str, Any]) -> None:
        try:
            fn(status)
        except Exception:  # one broken widget must not stop the others' updates
            log.exception("gpulease: a feed subscriber failed")

    def poll_once(self) -> dict[str, Any]:
        try:
            status = self.api.status() or {}
            status.setdefault("now", self._clock())
        except ServerError as e:
            status = dict(self.last or {}, error=e.message)
        except Exception as e:
            log.warning("gpulease: status read failed: %s", e)
            status = dict(self.last or {}, error=str(e))
        status["received_at"] = self._clock()
        return status

    def _run(self) -> None:
        while True:
            with self._lock:
                subs = list(self._subs)
                if not subs:
                    self._thread = None
                    return
            status = self.poll_once()
            self.last = status
            self.updates += 1
            for fn in subs:
                self._deliver(fn, status)
            self._wake.wait(self.interval)
            self._wake.clear()


_shared: dict[str, StatusFeed] = {}
_shared_lock = threading.Lock()


def shared_feed(api, *, interval: float = 1.0) -> StatusFeed:
    """The kernel's one feed for ``api``'s server: every widget of the notebook shares it."""
    key = getattr(api, "where", repr(api))
    with _shared_lock:
        feed = _shared.get(key)
        if feed is None:
            feed = _shared[key] = StatusFeed(api, interval=interval)
        return feed


def stop_shared_feed() -> None:
    with _shared_lock:
        feeds = list(_shared.values())
        _shared.clear()
    for f in feeds:
        f.stop()
