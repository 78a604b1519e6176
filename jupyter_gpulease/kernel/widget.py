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

from ..core.lease import ACTIONS, KernelState, LeaseView, offered_actions
from ..core.text import format_duration, format_time_left
from ..core.words import SUSPENDED_WORDS, hhmm, lease_line, queue_words
from . import text
from .endpoint import ServerError
from .feed import StatusFeed, shared_feed

log = logging.getLogger(__name__)

HISTORY = 300  # samples kept per device for the sparkline (5 min at one a second)
EXTEND_S = int(ACTIONS["extend"].body["by_s"])
KEEP_S = int(ACTIONS["keep"].body["for_s"])
ICONS = {"extend": "clock", "keep": "lock", "resume": "play", "release": "times"}


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
        # the one action table's buttons (label, tooltip); what each is offered for: offered_actions()
        self.buttons = {
            name: W.Button(description=a.label, icon=ICONS.get(name, ""), tooltip=a.tooltip,
                           button_style="warning" if name == "release" else "")
            for name, a in ACTIONS.items()
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
        lease = LeaseView.maybe(status.get("lease"))
        last = LeaseView.maybe(status.get("last_lease"))
        state = lease.state.value if lease else "none"
        suspended = bool(text.suspended_kernels(status))
        head = lease_line(lease, now)
        if lease is None and last is not None:
            head += " — last: " + lease_line(last, now)
        _set(self.header, "value", f"<b>GPU</b> {html.escape(head)}")
        countdown = ""
        if lease is not None and lease.active and lease.expires_at is not None:
            countdown = format_time_left(lease.expires_at - now) + " left"
            _set(self.countdown, "value", f'<span class="gpulease-countdown">Time left: <b>{countdown[:-5]}</b> (ends at {hhmm(lease.expires_at)})</span>')
        else:
            _set(self.countdown, "value", "")
        queue = queue_words(lease, now) if lease is not None and lease.queued else ""
        _set(self.queue, "value", f"queue: {html.escape(queue)}" if queue else "")
        lease_json = status.get("lease")
        devices = status.get("devices") or []
        for d in devices:
            uuid = d.get("uuid") or text.device_label(d, lease_json)
            row = self._rows.get(uuid)
            if row is None:
                row = self._rows[uuid] = DeviceRow(uuid)
            row.update(d, lease_json)
        wanted = tuple(self._rows[d.get("uuid") or text.device_label(d, lease_json)] for d in devices)
        if tuple(self.devices.children) != wanted:
            self.devices.children = wanted
        warnings = [w.get("message") or w.get("kind", "") for w in text.current_warnings(status, now)]
        if suspended and not any("suspend" in w for w in warnings):
            warnings.append(SUSPENDED_WORDS)
        if status.get("message"):
            warnings.append(status["message"])
        if status.get("error"):
            warnings.append(f"cannot read the lease: {status['error']}")
        _set(self.warnings, "value", "".join(f'<div class="gpulease-warning">⚠ {html.escape(w)}</div>' for w in warnings))
        offered = [a.name for a in offered_actions(lease, [str(k.get("state") or KernelState.OK) for k in status.get("kernels") or []], last)]
        for name, b in self.buttons.items():
            _set(b.layout, "display", None if name in offered else "none")
            _set(b, "description", ACTIONS[name].label_for(lease))
        self.state = {
            "header": head, "lease_id": lease.id if lease else None, "lease_state": state, "countdown": countdown, "queue": queue,
            "warnings": warnings, "suspended": suspended, "buttons": offered,
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
                    msg = "asked for a GPU again: " + lease_line(lease, time.time())
                else:
                    msg = "nothing to resume: no kernel is suspended and the GPU lease was not reclaimed"
            elif name == "release":
                ans = self.api.release("released with the widget's button", force=bool(ACTIONS["release"].body.get("force")))
                msg = "released: the GPU went back to the pool"
            else:
                raise ValueError(f"unknown action {name!r}")
            _set(self.message, "value", html.escape(msg))
        except ServerError as e:
            _set(self.message, "value", f'<span class="gpulease-error">{html.escape(ACTIONS[name].doing if name in ACTIONS else name)} failed: {html.escape(e.message)}</span>')
            ans = None
        self.feed.refresh()
        return ans

    def close(self) -> None:
        self.feed.unsubscribe(self.update)
        with self._lock:
            if self in LeaseWidget.instances:
                LeaseWidget.instances.remove(self)
            super().close()
