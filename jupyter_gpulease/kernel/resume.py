"""A cell of any length in a suspended kernel waits for the resume.

When idle reclaim suspends a kernel, the server extension writes a small file beside the
kernel's connection file (:func:`marker_path`) and removes it when the kernel has its GPU back
(or was restarted). The `%gpu` extension of the kernel registers a ``pre_run_cell`` hook that
looks for that file: one ``stat`` per cell, nothing else while the kernel is not suspended.
When it is there, the hook asks the server to resume this kernel and blocks the cell until the
GPU is back, showing where it waits (one line, updated in place); then the cell runs, with its
variables as they were.

A kernel whose server's lease went back unused is *parked* the same way (the file says
``"parked": true``): nothing of it was put aside, so once the server holds a GPU again the hook
gives this process the new lease's environment (``CUDA_VISIBLE_DEVICES`` and the rest, as
``%gpu request`` does, unless CUDA started here already) and tells the server; then the cell runs.

Cells that only talk to the server (`%gpu status`, `%gpu resume`, …) do not wait. An interrupt
(Ctrl-C, the stop button) stops the waiting: the cell then runs and its CUDA calls wait for the
restore, which goes on in the server.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

SUFFIX = ".gpulease-suspended"


def marker_path(connection_file: str) -> str:
    """``…/kernel-<id>.json`` → ``…/kernel-<id>.gpulease-suspended``."""
    base = connection_file[:-len(".json")] if connection_file.endswith(".json") else connection_file
    return base + SUFFIX


def talks_to_server_only(cell: str) -> bool:
    """A cell of `%gpu` lines only (not `%%gpu`, whose body computes): it needs no GPU."""
    lines = [ln.strip() for ln in (cell or "").splitlines() if ln.strip() and not ln.strip().startswith("#")]
    return bool(lines) and all(ln == "%gpu" or ln.startswith("%gpu ") for ln in lines)


def waiting_words(kernel: dict[str, Any], now: float, *, parked: bool = False) -> str:
    """What the waiting cell shows: the queue position and ETA (and a sooner start), or the restore."""
    from ..core.text import format_duration
    from ..core.words import sooner_words

    head = "GPU given back while unused" if parked else "GPU suspended"
    r = kernel.get("resume") or {}
    if r.get("stage") == "restoring":
        return f"{head}: restoring this kernel's GPU memory…"
    pos = r.get("position")
    if pos is not None:
        eta = r.get("eta")
        when = f", expected in about {format_duration(max(0.0, float(eta) - now))}" if eta else ""
        when += sooner_words(r, now, long=False)
        return f"{head}: waiting for a GPU, number {pos} in the queue{when}…"
    return f"{head}: asking for a GPU for this kernel…"


def marker_says_parked(marker: str) -> bool:
    """Whether the suspended marker says the kernel is parked (nothing of it was put aside)."""
    try:
        with open(marker, encoding="utf-8") as f:
            return bool(json.load(f).get("parked"))
    except (OSError, ValueError, AttributeError):
        return False


def adopt_lease(api, status: dict[str, Any], kernel_id: str) -> str:
    """A parked kernel's process takes the active lease's environment (as `%gpu request` does) and
    tells the server; what the cell shows about it ("" when there is nothing to take)."""
    from ..core.lease import LeaseView, lease_environment
    from .endpoint import ServerError
    from .magics import cuda_initialised

    lease = LeaseView.maybe(status.get("lease"))
    if lease is None or not lease.active or not lease.slices:
        return ""
    env = lease_environment(lease, broker_url=os.environ.get("GPULEASE_BROKER_URL", ""))
    if os.environ.get("CUDA_VISIBLE_DEVICES") == env["CUDA_VISIBLE_DEVICES"]:
        return ""
    if cuda_initialised():
        return "this kernel started CUDA before: restart it to use the GPU"
    os.environ.update(env)
    try:
        api.kernel_sees(kernel_id, env["CUDA_VISIBLE_DEVICES"])
    except ServerError:
        pass  # the server says this kernel's devices are stale until it hears; the kernel uses them all the same
    return f"this kernel uses {env['CUDA_VISIBLE_DEVICES']} from now on"


class ResumeHook:
    """The ``pre_run_cell`` hook (see the module). ``connect`` gives the server API; the clock and
    sleep are there for tests."""

    def __init__(self, kernel_id: str, marker: str, *, connect: Callable | None = None, poll_s: float = 0.5,
                 sleep: Callable[[float], None] = time.sleep, clock: Callable[[], float] = time.time, out=None):
        self.kernel_id = kernel_id
        self.marker = marker
        self._connect = connect
        self.poll_s = poll_s
        self._sleep = sleep
        self._clock = clock
        self._out = out

    def __call__(self, info: Any = None) -> None:
        if not os.path.exists(self.marker):  # the whole cost for a kernel that is not suspended
            return
        if talks_to_server_only(getattr(info, "raw_cell", "") or ""):
            return
        self.wait()

    def _write(self, s: str) -> None:
        out = self._out or sys.stdout
        out.write(s)
        out.flush()

    def wait(self) -> str:
        """Ask for the resume and wait for it; returns the kernel's state at the end ("ok" when restored)."""
        from .api import ServerLease, connect
        from .endpoint import NoServer, ServerError

        parked = marker_says_parked(self.marker)
        try:
            api = (self._connect or connect)()
        except NoServer:
            return "unknown"
        if not isinstance(api, ServerLease) and self._connect is None:
            return "unknown"
        try:
            api.resume(self.kernel_id)
        except ServerError as e:
            if e.status not in (409,):  # 409: it is resuming already
                self._write(f"GPU suspended: asking for the resume failed ({e.message}); the cell runs and waits for its GPU.\n")
                return "unknown"
        last = ""
        state = "resuming"
        t0 = self._clock()
        try:
            while True:
                try:
                    st = api.status(history_s=None) or {}
                except ServerError as e:
                    self._write(f"\nGPU suspended: the server cannot be asked ({e.message}); the cell runs and waits for its GPU.\n")
                    return "unknown"
                k = next((x for x in st.get("kernels") or [] if x.get("id") == self.kernel_id), None)
                state = (k or {}).get("state") or "gone"
                if state not in ("suspended", "resuming"):
                    break
                words = waiting_words(k, self._clock(), parked=parked)
                if words != last:
                    # one line, rewritten in place (the notebook and a terminal both honour \r)
                    self._write("\r" + words.ljust(len(last)))
                    last = words
                self._sleep(self.poll_s)
        except KeyboardInterrupt:
            self._write("\nInterrupted: the resume goes on in the server; the cell runs now and its GPU calls wait for it.\n")
            return "interrupted"
        from ..core.text import format_duration

        if state == "ok" and parked and not (k or {}).get("message"):
            took = adopt_lease(api, st, self.kernel_id) or "this kernel has a GPU again"
            self._write(("\r" if last else "") + f"GPU back after {format_duration(self._clock() - t0)}: "
                        f"{took}; the cell runs now.".ljust(len(last)) + "\n")
        elif state == "ok" and not (k or {}).get("message"):
            self._write(("\r" if last else "") + f"GPU back after {format_duration(self._clock() - t0)}: "
                        "this kernel was restored with its variables; the cell runs now.".ljust(len(last)) + "\n")
        else:
            msg = (k or {}).get("message") or f"the kernel is {state}"
            self._write(("\n" if last else "") + f"GPU resume: {msg}\n")
        return state


def install(ipython) -> ResumeHook | None:
    """Register the hook in a Jupyter kernel (one with a connection file); None elsewhere."""
    from .magics import this_kernel_id

    kid = this_kernel_id()
    if not kid:
        return None
    try:
        from ipykernel.connect import get_connection_file

        cf = get_connection_file()
    except Exception:
        return None
    hook = ResumeHook(kid, marker_path(os.path.abspath(cf)))
    for old in [f for f in ipython.events.callbacks.get("pre_run_cell", []) if isinstance(f, ResumeHook)]:
        ipython.events.unregister("pre_run_cell", old)
    ipython.events.register("pre_run_cell", hook)
    return hook


def uninstall(ipython) -> None:
    for old in [f for f in ipython.events.callbacks.get("pre_run_cell", []) if isinstance(f, ResumeHook)]:
        ipython.events.unregister("pre_run_cell", old)


def _clock(t: float) -> str:
    return time.strftime("%H:%M", time.localtime(float(t)))


def status_lines(status: dict[str, Any], now: float, kernel_id: str | None = None) -> list[str]:
    """What `%gpu status` adds about resumes and idle reclaim: a resume in progress and where it
    waits, when the idle reclaim comes (per kernel and for the lease), and a keep in force."""
    from ..core.text import format_duration

    out = []
    for k in status.get("kernels") or []:
        if k.get("state") == "resuming":
            me = " (this kernel)" if kernel_id and k.get("id") == kernel_id else ""
            out.append(f"resuming: kernel {str(k.get('id'))[:8]}{me}: " + waiting_words(k, now).split(": ", 1)[1].rstrip("…"))
    r = status.get("reclaim") or {}
    lease = status.get("lease") or {}
    if lease.get("state") != "active" or not r:
        return out
    keep = r.get("keep_until")
    kept = bool(keep and float(keep) > now)
    if kept:
        out.append(f"kept: idle reclaim leaves this server's GPU alone until {_clock(keep)} (in {format_duration(float(keep) - now)}); "
                   "%gpu keep off ends the keep")
    if not r.get("enabled"):
        out.append("idle reclaim: off on this server")
        return out
    action = r.get("action") or "suspend"
    if action == "suspend" and not r.get("suspend_available", True):
        action = r.get("fallback_action") or "restart"
    verb = {"suspend": "suspended (nothing is lost)", "restart": "restarted (its variables are lost)", "interrupt": "interrupted",
            "shutdown": "shut down", "notify": "asked to free the GPU"}.get(action, action)
    for k in status.get("kernels") or []:
        at = (k.get("idle") or {}).get("reclaim_at")
        if at and k.get("state") == "ok":
            me = " (this kernel)" if kernel_id and k.get("id") == kernel_id else ""
            out.append(f"idle reclaim: kernel {str(k.get('id'))[:8]}{me} is {verb} at {_clock(at)} "
                       f"(in {format_duration(max(0.0, float(at) - now))}) unless it uses the GPU again")
    at = r.get("lease_reclaim_at")
    if at:
        out.append(f"idle reclaim: the GPU lease goes back at {_clock(at)} (in {format_duration(max(0.0, float(at) - now))}) "
                   "if no kernel uses it by then" + ("" if kept else "; %gpu keep 1h postpones it"))
    elif r.get("timeout_s"):
        out.append(f"idle reclaim: after {format_duration(float(r['timeout_s']))} without GPU use")
    return out
