"""`%gpu watch`: an ipywidgets view of the lease that moves while cells run.

Per device a utilization bar, a memory bar and a sparkline of the last minutes; the lease's
countdown; queue position and ETA while waiting; warnings with Extend, Keep, Resume and
Release buttons. It follows the kernel's shared :class:`~.feed.StatusFeed` (a thread), so it
updates during a long blocking cell; ``close()`` (or a kernel restart) stops its updates.

Trait changes made from the feed thread go out as comm messages on IOPub, which ipykernel
sends from any thread; nothing here prints.
"""

from __future__ import annotations

import html
import logging
import threading
import time
from collections import deque
from typing import Any, ClassVar

import ipywidgets as W

from ..core.text import format_duration, format_time_left
from . import text
from .endpoint import ServerError
from .feed import StatusFeed, shared_feed

log = logging.getLogger(__name__)

HISTORY = 300  # samples kept per device for the sparkline (5 min at one a second)
EXTEND_S = 1800
KEEP_S = 3600

# what each button does, as the error line names it ("Extending the GPU lease failed: …")
ACTION_WORDS = {"extend": "Extending the GPU lease", "keep": "Keeping the GPU", "resume": "Resuming",
                "release": "Giving the GPU lease back"}


def sparkline(values: list[float | None], width: int = 120, height: int = 24) -> str:
    """An inline SVG polyline of 0–100 values (None = gap); '' for fewer than two points."""
    pts = [(i, v) for i, v in enumerate(values) if v is not None]
    if len(pts) < 2:
        return f'<svg class="gpulease-spark" width="{width}" height="{height}"></svg>'
    n = max(len(values) - 1, 1)
    coords = " ".join(f"{i * width / n:.1f},{height - 1 - max(0.0, min(100.0, v)) * (height - 2) / 100:.1f}" for i, v in pts)
    return (f'<svg class="gpulease-spark" width="{width}" height="{height}" viewBox="0 0 {width} {height}">'
            f'<polyline fill="none" stroke="var(--jp-brand-color1, #1976d2)" stroke-width="1.5" points="{coords}"/></svg>')




def _history(d: dict[str, Any]) -> list[float | None] | None:
    """The server's own utilization history of a device, when it sends one."""
    h = d.get("history")
    if isinstance(h, dict):
        h = h.get("utilization_pct")
    if isinstance(h, list) and h:
        return [x.get("utilization_pct") if isinstance(x, dict) else x for x in h][-HISTORY:]
    return None


class DeviceRow(W.HBox):
    """One device: name, utilization bar, memory bar, sparkline."""

    def __init__(self, uuid: str):
        self.uuid = uuid
        self.name = W.HTML(layout=W.Layout(width="150px"))
        self.util = W.FloatProgress(min=0, max=100, description="util", layout=W.Layout(width="210px"))
        self.util_text = W.Label(layout=W.Layout(width="44px"))
        self.mem = W.FloatProgress(min=0, max=1, description="mem", layout=W.Layout(width="210px"))
        self.mem_text = W.Label(layout=W.Layout(width="130px"))
        self.spark = W.HTML()
        self.samples: deque[float | None] = deque(maxlen=HISTORY)
        super().__init__([self.name, self.util, self.util_text, self.mem, self.mem_text, self.spark])
        self.add_class("gpulease-device")

    def update(self, d: dict[str, Any], lease: dict[str, Any] | None = None) -> None:
        u = d.get("utilization_pct")
        used, total = d.get("memory_used_mib"), d.get("memory_total_mib")
        extra = " · ".join(x for x in (
            "" if d.get("temperature_c") is None else f"{d['temperature_c']:.0f} °C",
            "" if d.get("power_w") is None else f"{d['power_w']:.0f} W") if x)
        name = f"<b>{html.escape(text.device_label(d, lease))}</b>" + (f"<br><small>{html.escape(extra)}</small>" if extra else "")
        _set(self.name, "value", name)
        _set(self.util, "value", float(u or 0))
        _set(self.util_text, "value", "-" if u is None else f"{u:.0f}%")
        if total:
            _set(self.mem, "max", float(total))
            _set(self.mem, "value", float(min(used or 0, total)))
        _set(self.mem_text, "value", f"{(used or 0) / 1024:.1f} / {total / 1024:.1f} GiB" if total else "-")
        history = _history(d)
        if history is None:
            self.samples.append(u)
            history = list(self.samples)
        _set(self.spark, "value", sparkline(history))


def _set(widget, name: str, value) -> None:
    """Set a trait only when it changes: every change is a message to the browser."""
    if getattr(widget, name) != value:
        setattr(widget, name, value)


class LeaseWidget(W.VBox):
    """The live lease view (see the module). ``state`` summarises what it shows, for tests and logs."""

    instances: ClassVar[list[LeaseWidget]] = []  # the live ones: tests and `%gpu watch` find them here

    def __init__(self, api, feed: StatusFeed | None = None):
        self.api = api
        self.feed = feed or shared_feed(api)
        self._lock = threading.Lock()
        self.header = W.HTML()
        self.countdown = W.HTML()
        self.queue = W.HTML()
        self.devices = W.VBox()
        self.warnings = W.HTML()
        self.message = W.HTML()
        self.buttons = {
            "extend": W.Button(description=f"Extend {format_duration(EXTEND_S)}", icon="clock", tooltip="ask the broker for more time"),
            "keep": W.Button(description=f"Keep {format_duration(KEEP_S)}", icon="lock", tooltip="no idle reclaim for a while"),
            "resume": W.Button(description="Resume", icon="play", tooltip="bring the kernel back onto a GPU"),
            "release": W.Button(description="Release", icon="times", button_style="warning", tooltip="give the GPU back now"),
        }
        for name, b in self.buttons.items():
            b.on_click(lambda _b, name=name: self.act(name))
        self._rows: dict[str, DeviceRow] = {}
        self.state: dict[str, Any] = {}
        self.updates = 0
        super().__init__([self.header, self.countdown, self.queue, self.devices, self.warnings,
                          W.HBox(list(self.buttons.values())), self.message])
        self.add_class("gpulease-widget")
        LeaseWidget.instances.append(self)
        self.feed.subscribe(self.update)

    @classmethod
    def for_api(cls, api) -> LeaseWidget:
        return cls(api)

    # ------------------------------------------------------------------ feed -> view
    def update(self, status: dict[str, Any]) -> None:
        with self._lock:
            if self.comm is None:  # closed between the feed's read and now
                return
            self._render(status)
            self.updates += 1

    def _render(self, status: dict[str, Any]) -> None:
        now = float(status.get("now") or status.get("received_at") or 0)
        lease = status.get("lease")
        state = (lease or {}).get("state") or "none"
        suspended = bool(text.suspended_kernels(status))
        head = text.lease_line(lease, now)
        if not lease and status.get("last_lease"):
            head += " — last: " + text.lease_line(status["last_lease"], now)
        _set(self.header, "value", f"<b>GPU</b> {html.escape(head)}")
        countdown = ""
        if lease and state == "active" and lease.get("expires_at") is not None:
            countdown = format_time_left(float(lease["expires_at"]) - now) + " left"
            ends = time.strftime("%H:%M", time.localtime(float(lease["expires_at"])))
            _set(self.countdown, "value", f'<span class="gpulease-countdown">Time left: <b>{countdown[:-5]}</b> (ends at {ends})</span>')
        else:
            _set(self.countdown, "value", "")
        queue = text.queue_words(lease, now) if state == "queued" else ""
        _set(self.queue, "value", f"queue: {html.escape(queue)}" if queue else "")
        devices = status.get("devices") or []
        for d in devices:
            uuid = d.get("uuid") or text.device_label(d, lease)
            row = self._rows.get(uuid)
            if row is None:
                row = self._rows[uuid] = DeviceRow(uuid)
            row.update(d, lease)
        wanted = tuple(self._rows[d.get("uuid") or text.device_label(d, lease)] for d in devices)
        if tuple(self.devices.children) != wanted:
            self.devices.children = wanted
        warnings = [w.get("message") or w.get("kind", "") for w in text.current_warnings(status, now)]
        if suspended and not any("suspend" in w for w in warnings):
            warnings.append("suspended: the GPU state of an idle kernel was put aside; its next cell resumes it")
        if status.get("message"):
            warnings.append(status["message"])
        if status.get("error"):
            warnings.append(f"cannot read the lease: {status['error']}")
        _set(self.warnings, "value", "".join(f'<div class="gpulease-warning">⚠ {html.escape(w)}</div>' for w in warnings))
        show = {
            "extend": state == "active",
            "keep": state == "active",
            "resume": suspended or (not lease and (status.get("last_lease") or {}).get("state") == "reclaimed"),
            "release": state in ("active", "queued"),
        }
        for name, b in self.buttons.items():
            _set(b.layout, "display", None if show[name] else "none")
        _set(self.buttons["release"], "description", "Withdraw" if state == "queued" else "Release")
        self.state = {
            "header": head, "lease_id": (lease or {}).get("id"), "lease_state": state, "countdown": countdown, "queue": queue,
            "warnings": warnings, "suspended": suspended, "buttons": [n for n, v in show.items() if v],
            "utilization": {r.uuid: r.util.value for r in wanted}, "memory_mib": {r.uuid: r.mem.value for r in wanted},
        }

    # ------------------------------------------------------------------ buttons -> actions
    def act(self, name: str) -> dict[str, Any] | None:
        """What a button does (also callable directly)."""
        try:
            if name == "extend":
                ans = self.api.extend(EXTEND_S)
                msg = f"extended by {format_duration(EXTEND_S)}"
            elif name == "keep":
                ans = self.api.keep(KEEP_S)
                msg = f"kept: no idle reclaim for {format_duration(KEEP_S)}"
            elif name == "resume":
                from .magics import this_kernel_id

                ans = self.api.resume(this_kernel_id() if any(k.get("id") == this_kernel_id() for k in text.suspended_kernels(self.feed.last or {})) else None)
                ans = ans or {}
                n = len(ans.get("resuming") or [])
                lease = ans.get("lease") if isinstance(ans.get("lease"), dict) else None
                if n:
                    msg = f"resuming {n} kernel{'s' if n != 1 else ''}: a GPU is being found and the memory restored"
                elif lease is not None:
                    msg = "asked for a GPU again: " + text.lease_line(lease, time.time())
                else:
                    msg = "nothing to resume: no kernel is suspended and the GPU lease was not reclaimed"
            elif name == "release":
                ans = self.api.release("released with the widget's button", force=True)
                msg = "released: the GPU went back to the pool"
            else:
                raise ValueError(f"unknown action {name!r}")
            _set(self.message, "value", html.escape(msg))
        except ServerError as e:
            _set(self.message, "value", f'<span class="gpulease-error">{html.escape(ACTION_WORDS.get(name, name))} failed: {html.escape(e.message)}</span>')
            ans = None
        self.feed.refresh()
        return ans

    def close(self) -> None:
        self.feed.unsubscribe(self.update)
        with self._lock:
            if self in LeaseWidget.instances:
                LeaseWidget.instances.remove(self)
            super().close()
