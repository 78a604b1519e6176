"""The `%gpu` line magic and the `%%gpu` cell magic.

Every answer is text (a notebook, IPython in a terminal and a log read the same words); only
`%gpu watch` shows a widget, where the frontend can draw one. Mistakes in the line get one
line saying what is wrong and the usage; a missing server or broker, or a refusal, gets one
line saying so; neither raises a traceback.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable
from typing import Any

from IPython.core.magic import Magics, line_cell_magic, magics_class

from ..core.lease import LeaseState, LeaseView, cpu_only_environment, lease_environment
from ..core.text import format_duration
from . import args as gpu_args
from . import text
from .api import connect
from .endpoint import NoServer, ServerError
from .resume import status_lines as resume_status_lines

log = logging.getLogger(__name__)

# modules that, once imported, may have created a CUDA context with the old device list
_CUDA_USERS = ("tensorflow", "jax", "cupy", "numba.cuda", "pycuda")


def cuda_initialised() -> bool:
    """Whether this process may already have started CUDA (then new devices need a kernel restart)."""
    torch = sys.modules.get("torch")
    if torch is not None:
        try:
            if torch.cuda.is_initialized():
                return True
        except Exception as e:
            log.debug("torch.cuda.is_initialized() failed: %s", e)
    return any(name in sys.modules for name in _CUDA_USERS)


def this_kernel_id() -> str | None:
    """The kernel id from the connection file's name (kernel-<id>.json), when this is a Jupyter kernel."""
    try:
        from ipykernel.connect import get_connection_file

        name = os.path.basename(get_connection_file())
    except Exception:
        return None
    if name.startswith("kernel-") and name.endswith(".json"):
        return name[len("kernel-"):-len(".json")]
    return None


def in_kernel(shell) -> bool:
    """Whether a frontend that draws widgets may be listening (an ipykernel shell)."""
    return shell is not None and getattr(shell, "kernel", None) is not None


def _lease_of(answer: Any) -> dict[str, Any] | None:
    if isinstance(answer, dict) and isinstance(answer.get("lease"), dict):
        return answer["lease"]
    if isinstance(answer, dict) and "state" in answer and "id" in answer:
        return answer
    return None


@magics_class
class GPUMagics(Magics):
    """`%gpu …` and `%%gpu …` (see `%gpu help`)."""

    def __init__(self, shell=None, *, connect: Callable = connect, clock: Callable[[], float] = time.time,
                 sleep: Callable[[float], None] = time.sleep, poll_s: float = 1.0):
        super().__init__(shell)
        self._connect = connect
        self._clock = clock
        self._sleep = sleep
        self.poll_s = poll_s

    # ------------------------------------------------------------------ entry points
    @line_cell_magic
    def gpu(self, line: str, cell: str | None = None):
        """GPU lease from the notebook: `%gpu help` lists the subcommands."""
        try:
            if cell is not None:
                return self._cell(gpu_args.parse_cell(line), cell)
            return self._line(gpu_args.parse(line))
        except gpu_args.UsageError as e:
            self._err(str(e))
        except NoServer as e:
            self._err(str(e))
        except ServerError as e:
            # the message says what is wrong in words; e.field names the API's field, for programs
            hint = ""
            if e.status == 409 and cell is None and line.split()[:1] == ["release"] and "kernel" in e.message.lower():
                hint = "\n(%gpu release --force gives it back anyway: those kernels lose the GPU under them)"
            self._err(f"gpulease: {e.message}{hint}")
        return None

    def _out(self, msg: str) -> None:
        print(msg, flush=True)

    def _err(self, msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    def _now(self, status: dict | None = None) -> float:
        return self._clock()

    # ------------------------------------------------------------------ line magic
    def _line(self, cmd: gpu_args.Command):
        if cmd.name == "help":
            self._out(gpu_args.help_text())
            return None
        api = self._connect()
        if cmd.name == "status":
            st = api.status(history_s=None)
            self._out("\n".join([text.status_text(st, self._now(), kernel_id=this_kernel_id()),
                                 *resume_status_lines(st, self._now(), this_kernel_id())]))
        elif cmd.name == "watch":
            return self._watch(api)
        elif cmd.name == "request":
            self._request(api, cmd.request, wait=cmd.wait)
        elif cmd.name == "extend":
            lease = _lease_of(api.extend(cmd.duration_s))
            self._out(f"extended by {format_duration(cmd.duration_s)}: " + text.lease_line(lease, self._now()) if lease else "extended")
        elif cmd.name == "keep" and not cmd.duration_s:
            api.keep(0)
            self._out("keep ended: idle reclaim watches this server's GPU again, from each kernel's own idle deadline")
        elif cmd.name == "keep":
            if self._nothing_to_keep(api):
                return None
            ans = api.keep(cmd.duration_s) or {}
            until = ans.get("keep_until")
            when = f" (until {time.strftime('%H:%M', time.localtime(float(until)))})" if until else ""
            self._out(f"kept: idle reclaim leaves this server's GPU alone for {format_duration(cmd.duration_s)}{when}")
        elif cmd.name == "resume":
            status = api.status(history_s=None)
            mine = this_kernel_id()
            suspended = text.suspended_kernels(status)
            ans = api.resume(mine if any(k.get("id") == mine for k in suspended) else None) or {}
            n = len(ans.get("resuming") or [])
            if n:
                self._out(f"resuming {n} kernel{'s' if n != 1 else ''}: a GPU is being found and their memory restored "
                          "(%gpu status shows progress)")
            elif _lease_of(ans):  # the unused lease had been reclaimed: a new one like it was asked for
                self._out("asked for a GPU again (the last one was reclaimed while unused): " + text.lease_line(_lease_of(ans), self._now()))
            else:
                self._out("nothing to resume: no kernel of this server is suspended and its GPU lease was not reclaimed")
        elif cmd.name == "release":
            ans = api.release(force=cmd.force)
            lease = _lease_of(ans)
            if lease and lease.get("state") == LeaseState.WITHDRAWN:
                self._out(f"withdrawn: lease {text.short_id(lease['id'])} no longer waits")
            else:
                self._out((f"released lease {text.short_id(lease['id'])}: " if lease else "released: ") + "the GPU went back to the pool.\n"
                          + self._drop_devices(api))
        elif cmd.name == "queue":
            self._out(text.queue_text(api.queue(), self._now()))
        elif cmd.name == "pool":
            self._out(text.pool_text(api.pool()))
        return None

    def _sees(self, api, devices: str) -> None:
        """Tell the server which devices this kernel uses now: its environment at start no longer says."""
        kid = this_kernel_id()
        if kid and api is not None:
            try:
                api.kernel_sees(kid, devices)
            except ServerError as e:
                log.debug("gpulease: telling the server this kernel's devices failed: %s", e.message)

    def _drop_devices(self, api) -> str:
        """After a release: this kernel stops seeing the GPU where it never started CUDA on it."""
        if os.environ.get("CUDA_VISIBLE_DEVICES") and not cuda_initialised():
            os.environ.update(cpu_only_environment(broker_url=os.environ.get("GPULEASE_BROKER_URL", "")))
            self._sees(api, "")
            return "This kernel runs without a GPU from now on; other running kernels keep the GPU in sight until restarted."
        return "Running kernels keep their memory of the GPU until restarted; new kernels start without one."

    def _nothing_to_keep(self, api) -> bool:
        """Say so when there is no granted GPU to keep (idle reclaim only watches a granted one)."""
        lease = (api.status(history_s=None) or {}).get("lease")
        if lease and lease.get("state") == LeaseState.QUEUED:
            self._out(f"nothing to keep yet: your request for {text.describe_request(lease.get('request') or {})} waits "
                      f"({text.queue_words(lease, self._now())}); idle reclaim only watches a GPU once it is granted")
            return True
        if not lease or lease.get("state") != LeaseState.ACTIVE:
            self._out("nothing to keep: this server holds no GPU lease (ask for one with %gpu request)")
            return True
        return False

    # ------------------------------------------------------------------ request and wait
    def _request(self, api, body: dict[str, Any], *, wait: bool) -> dict[str, Any] | None:
        try:
            answer = api.request(body)
        except ServerError as e:
            if e.status == 409 and e.field == "lease":
                raise ServerError(e.status, self._already(api) or e.message, e.field) from None
            raise
        lease = _lease_of(answer)
        if lease is None:
            self._out("requested")
            return None
        if lease["state"] == LeaseState.QUEUED:
            self._out(text.lease_line(lease, self._now()))
            if not wait:
                self._out("Not granted yet: %gpu status (or the status bar) shows when it is; %gpu release withdraws it.")
                return lease
            lease = self._wait(api, lease)
            if lease is None:
                return None
        if lease["state"] == LeaseState.ACTIVE:
            self._granted(lease, api)
        else:
            self._out(text.lease_line(lease, self._now()))
        return lease

    def _already(self, api) -> str | None:
        """What this server already holds or waits for, when a second request is refused."""
        lease = (api.status(history_s=None) or {}).get("lease")
        if not lease:
            return None
        asks = text.describe_request(lease.get("request") or {})
        if lease.get("state") == LeaseState.QUEUED:
            return (f"a request of this server already waits: lease {text.short_id(lease['id'])} for {asks}, "
                    f"{text.queue_words(lease, self._now())}; %gpu release withdraws it, then ask again")
        return (f"this server already holds {text.lease_line(lease, self._now())}; "
                "%gpu release gives it back, then ask again")

    def _wait(self, api, lease: dict[str, Any]) -> dict[str, Any] | None:
        """Follow a queued lease until it is granted or ends; an interrupt withdraws it."""
        lid = lease["id"]
        last = text.queue_words(lease, self._now())
        try:
            while True:
                self._sleep(self.poll_s)
                current = (api.status(history_s=None) or {}).get("lease")
                if not current or current.get("id") != lid:
                    self._out(f"lease {text.short_id(lid)} is no longer waiting" + (f"; now: {text.lease_line(current, self._now())}" if current else ""))
                    return current
                if current["state"] != LeaseState.QUEUED:
                    return current
                words = text.queue_words(current, self._now())
                if words.split(",")[0] != last.split(",")[0]:  # the position moved: say so
                    self._out(f"waiting: {words}")
                last = words
        except KeyboardInterrupt:
            try:
                api.release("withdrawn: interrupted while waiting")
                self._err(f"interrupted: lease {text.short_id(lid)} withdrawn from the queue")
            except ServerError as e:
                self._err(f"interrupted, but withdrawing lease {text.short_id(lid)} failed: {e.message}; run %gpu release")
            return None

    def _granted(self, lease: dict[str, Any], api=None) -> None:
        self._out("granted: " + text.lease_line(lease, self._now()))
        view = LeaseView.from_json(lease)
        if not view.slices:
            return
        # the whole lease environment (one copy: the spawner gives a server the same), with this kernel's broker URL
        env = lease_environment(view, broker_url=os.environ.get("GPULEASE_BROKER_URL", ""))
        if cuda_initialised():
            self._out("This kernel started CUDA before the grant: restart it to use the GPU (new kernels get it by themselves).")
        else:
            os.environ.update(env)
            self._sees(api, env["CUDA_VISIBLE_DEVICES"])
            self._out(f"This kernel uses it from now on (CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']}).")

    # ------------------------------------------------------------------ watch
    def _watch(self, api):
        if in_kernel(self.shell):
            from .widget import LeaseWidget

            w = LeaseWidget.for_api(api)
            from IPython.display import display

            display(w)
            return
        # a terminal: one status line every 2 s until Ctrl-C
        try:
            while True:
                st = api.status(history_s=None)
                self._out(time.strftime("%H:%M:%S ") + text.lease_line(st.get("lease"), self._now()) + _devices_brief(st))
                self._sleep(2)
        except KeyboardInterrupt:
            return

    # ------------------------------------------------------------------ %%gpu
    def _cell(self, cmd: gpu_args.Command, cell: str):
        api = self._connect()
        current = (api.status(history_s=None) or {}).get("lease")
        took = None
        if current and current.get("state") == LeaseState.ACTIVE:
            self._out("running on " + text.lease_line(current, self._now()))
        else:
            if current and current.get("state") == LeaseState.QUEUED:
                self._out("already waiting: " + text.lease_line(current, self._now()))
                lease = self._wait(api, current)
            else:
                lease = self._request(api, cmd.request, wait=True)
            if not lease or lease.get("state") != LeaseState.ACTIVE:
                self._err("the cell did not run: no GPU lease")
                return
            took = lease
        try:
            self.shell.run_cell(cell, store_history=False)
        finally:
            if took is not None and not cmd.keep:
                try:
                    api.release("the %%gpu cell finished", force=True)
                    self._out(f"released lease {text.short_id(took['id'])} after the cell")
                except ServerError as e:
                    self._err(f"releasing lease {text.short_id(took['id'])} failed: {e.message}; run %gpu release")
        return


def _devices_brief(status: dict[str, Any]) -> str:
    parts = []
    for d in status.get("devices") or []:
        u = d.get("utilization_pct")
        used, total = d.get("memory_used_mib"), d.get("memory_total_mib")
        mem = f" {used / 1024:.1f}/{total / 1024:.0f} GiB" if used is not None and total else ""
        parts.append(f"#{d.get('index', '?')} {'-' if u is None else f'{u:.0f}%'}{mem}")
    return (" | " + "; ".join(parts)) if parts else ""
