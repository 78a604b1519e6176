"""The detector of unleased GPU use: every compute process on every device of the pool that the
broker's device backend reports, mapped to its owner and compared with the live leases.

One check (:meth:`UnleasedDetector.check`, every ``GPULeaseBroker.unleased_check_interval``
seconds):

1. off the event loop: the backend's sample, and for each compute process its owner from
   ``/proc`` (:mod:`.owners`);
2. on the loop: a process of no server whose Unix user the hub knows works for that user (asked
   once per name, remembered for ``HUB_USER_TTL_S``); the pure rule
   (:func:`~jupyter_gpulease.core.unleased.find_unleased`) against the committed leases; the
   tracker says what began, what ended and what is due;
3. the events (``unleased-use``, ``unleased-stop``, ``unleased-ended``) are committed like any
   other (the feed, the audit log, the counters); the standing findings are kept here
   (:attr:`UnleasedDetector.findings`) for the admin page, the API, the gauges and the alerts,
   which are given the detector; under ``warn`` and ``kill`` the owner's server is told (the
   heartbeat answers of the user's leases: the manager is handed :meth:`~UnleasedDetector.lease_warnings`,
   and ``GET api/unleased`` that a server without a lease polls);
4. under ``kill``, a finding still standing after ``unleased_grace_s`` is stopped: SIGTERM, then
   SIGKILL after ``STOP_WAIT_S`` — that process only, and only while its PID still names the same
   process (start time) of the same owner. The broker must run as root on the node of the
   process; a process it cannot see or signal is reported as not stopped, with the reason.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any

from ..core.model import Forbidden
from ..core.unleased import (
    REPORT,
    GPUProcess,
    Owner,
    Standing,
    UnleasedTracker,
    ended_event,
    find_unleased,
    found_event,
    stop_event,
    warning,
)
from .handlers import APIHandler
from .owners import ProcReader

log = logging.getLogger(__name__)

HUB_USER_TTL_S = 600.0  # how long the hub's answer "is there a user called X" is trusted
STOP_WAIT_S = 5.0  # between SIGTERM and SIGKILL
BACKENDS_WITH_PROCESSES = ("nvml", "simulated")  # the backends that see processes (on the broker's machine)

HubUserCheck = Callable[[str], Awaitable[bool | None]]  # True/False: the hub says; None: it did not answer


class UnleasedDetector:
    """See the module doc. ``manager``: the :class:`LeaseManager`; ``backend``: the device backend,
    or the :class:`.telemetry.SharedSample` of it (the broker's: its device samples and this check
    share a sample they ask for at the same moment)."""

    def __init__(self, manager, backend, *, action: str = "warn", grace_s: float = 300.0, procs: ProcReader | None = None,
                 hub_user_exists: HubUserCheck | None = None, logger: logging.Logger | None = None,
                 kill: Callable[[int, int], None] = os.kill, stop_wait_s: float = STOP_WAIT_S, show_holders: bool = False):
        self.manager = manager
        self.backend = backend
        self.action = action
        self.tracker = UnleasedTracker(action=action, grace_s=grace_s)
        self.procs = procs or ProcReader()
        self.hub_user_exists = hub_user_exists
        self.log = logger or log
        self.kill = kill
        self.stop_wait_s = stop_wait_s
        self.show_holders = show_holders  # users are told who leases the GPU they use (GPULeaseBroker.show_preemptor_names)
        # the simulated driver keeps listing a process that exited (a test or the demo removes it);
        # a real one frees its memory. A PID NVML lists that /proc lacks is a process the broker
        # cannot see (another PID namespace): reported as such.
        self.exited_hold_nothing = getattr(backend, "name", "") == "simulated"
        self.checks = 0
        self.last_error = ""
        self._hub_users: dict[str, tuple[bool, float]] = {}
        self._busy = False
        self._stopping: set[asyncio.Task] = set()
        self.findings: list[dict[str, Any]] = []  # the standing findings as JSON, oldest first

    # ------------------------------------------------------------------ sampling (a worker thread)
    def devices(self) -> dict[str, tuple[Any, str]]:
        """The pool's devices: uuid -> (its GPU, MIG profile or "")."""
        devices: dict[str, tuple[Any, str]] = {}
        for g in self.manager.inventory():
            devices[g.uuid] = (g, "")
            for m in g.mig:
                devices[m.uuid] = (g, m.profile)
        return devices

    def sample(self, devices: dict[str, tuple[Any, str]]) -> tuple[list[GPUProcess], set[tuple]]:
        """Every compute process on the pool's ``devices``, with its owner (blocking: NVML, /proc)."""
        samples = self.backend.sample()
        seen: dict[tuple[int, str], Any] = {}
        for s in samples.values():
            for p in s.processes:
                if p.kind != "compute" or p.device_uuid not in devices:
                    continue
                k = (p.pid, p.device_uuid)
                if k not in seen or (seen[k].used_memory_mib is None and p.used_memory_mib is not None):
                    seen[k] = p
        infos: dict[int, Any] = {}
        out = []
        for (pid, dev), p in sorted(seen.items()):
            if pid not in infos:
                infos[pid] = self.procs.info(pid)
            info = infos[pid]
            if info is None and self.exited_hold_nothing:
                continue
            g, profile = devices[dev]
            owner = info.owner if info is not None else Owner()
            out.append(GPUProcess(pid=pid, device_uuid=dev, gpu_uuid=g.uuid, node=g.node, model=g.model, index=g.index,
                                  used_memory_mib=p.used_memory_mib, owner=owner, mig_profile=profile,
                                  command=info.command if info else "", start=info.start if info else ""))
        return out, {p.key for p in out}

    # ------------------------------------------------------------------ one check (the event loop)
    async def check(self) -> list[Standing]:
        """One check (see the module doc); the findings that stand after it."""
        if self._busy:
            return list(self.tracker.standing.values())
        self._busy = True
        try:
            try:
                processes, seen = await asyncio.get_running_loop().run_in_executor(None, self.sample, self.devices())
            except Exception as e:  # a backend that fails keeps what was found before
                if str(e) != self.last_error:
                    self.log.warning("Unleased-use check: the device backend's sample failed: %s", e)
                self.last_error = str(e)
                return list(self.tracker.standing.values())
            self.last_error = ""
            processes = [await self._with_hub_user(p) for p in processes]
            now = self.manager.now()
            # no process on the pool's GPUs (the usual case): nothing to match against every live lease
            findings = find_unleased(processes, self.manager.live()) if processes else []
            changes = self.tracker.observe(now, findings, seen)
            events = [found_event(st, now, self.action) for st in changes.new]
            for e in events:
                self.log.warning("Unleased GPU use: %s", e.reason)
            events += [ended_event(st, now, why) for st, why in changes.ended]
            self._publish(now)
            if events:
                await self.manager.record(events)
            for st in changes.due:
                st.stop = {"outcome": "stopping", "at": now}
                task = asyncio.ensure_future(self._stop(st))
                self._stopping.add(task)
                task.add_done_callback(self._stop_done)
            self.checks += 1
            return list(self.tracker.standing.values())
        finally:
            self._busy = False

    async def _with_hub_user(self, p: GPUProcess) -> GPUProcess:
        """A process outside any server works for the hub user of its Unix user's name, when the hub has one."""
        o = p.owner
        if o.hub_user or not o.name or o.name.startswith("uid ") or o.uid == 0:
            return p
        if not await self._is_hub_user(o.name):
            return p
        return replace(p, owner=replace(o, hub_user=o.name))

    async def _is_hub_user(self, name: str) -> bool:
        if any(d["user"] == name for d in self.manager.live()):
            return True
        known = self._hub_users.get(name)
        mono = time.monotonic()
        if known is not None and mono - known[1] < HUB_USER_TTL_S:
            return known[0]
        if self.hub_user_exists is None:
            return False
        try:
            answer = await self.hub_user_exists(name)
        except Exception as e:
            self.log.warning("Unleased-use check: cannot ask the hub whether %r is a hub user: %s", name, e)
            answer = None
        if answer is None:
            return bool(known and known[0])
        self._hub_users[name] = (bool(answer), mono)
        return bool(answer)

    def _publish(self, now: float) -> None:
        self.findings = [st.to_dict(now) for st in sorted(self.tracker.standing.values(), key=lambda s: (s.since, s.finding.process.pid))]

    # ------------------------------------------------------------------ what users are told
    def warnings_for(self, user: str) -> list[dict[str, Any]]:
        """The warnings of ``user``'s findings (none under ``report``)."""
        if self.action == REPORT or not user:
            return []
        now = self.manager.now()
        return [warning(st, now, self.action, names=self.show_holders) for st in self.tracker.for_user(user) if st.stop.get("outcome") != "stopped"]

    def lease_warnings(self, d: dict[str, Any]) -> list[dict[str, Any]]:
        """The warnings of the findings of lease ``d``'s holder (for its heartbeat answers)."""
        return self.warnings_for(d["user"])

    def findings_for(self, user: str | None, *, admin: bool = True) -> list[dict[str, Any]]:
        """The standing findings as JSON: every one (``user`` None) or ``user``'s own; a caller
        who is no admin reads the holders' names only with ``show_holders``."""
        out = [d for d in self.findings if user is None or d["user"] == user]
        if not admin and not self.show_holders:
            out = [{**d, "holders": ["…"] * len(d["holders"])} for d in out]
        return out

    # ------------------------------------------------------------------ stopping (policy kill)
    async def _stop(self, st: Standing) -> None:
        loop = asyncio.get_running_loop()
        p = st.finding.process
        try:
            outcome, message = await loop.run_in_executor(None, self._signal, p, signal.SIGTERM)
            if outcome == "signalled":
                deadline = time.monotonic() + self.stop_wait_s
                while time.monotonic() < deadline and await loop.run_in_executor(None, self._same_process, p):
                    await asyncio.sleep(0.2)
                if await loop.run_in_executor(None, self._same_process, p):
                    outcome, message = await loop.run_in_executor(None, self._signal, p, signal.SIGKILL)
                    outcome = "stopped" if outcome == "signalled" else outcome
                    message = f"process {p.pid} did not end on SIGTERM within {self.stop_wait_s:g} s; sent SIGKILL" if outcome == "stopped" else message
                else:
                    outcome, message = "stopped", f"process {p.pid} ended on SIGTERM"
        except Exception as e:  # never leave a finding "stopping" for ever
            outcome, message = "not_stopped", f"stopping process {p.pid} failed: {e}"
        now = self.manager.now()
        st.stop = {"outcome": outcome, "message": message, "at": now}
        level = self.log.warning if outcome == "stopped" else self.log.error
        level("Unleased GPU use by %s: %s", p.owner.words(), message)
        self._publish(now)
        events = [stop_event(st, now)]
        if outcome == "stopped" and self.tracker.standing.get(st.finding.key) is st:
            del self.tracker.standing[st.finding.key]
            events.append(ended_event(st, now, "stopped"))
            self._publish(now)
        try:
            await self.manager.record(events)
        except Exception as e:  # the broker is stopping, or lost its database
            self.log.warning("Could not record the stop of process %d: %s", p.pid, e)

    def _stop_done(self, task: asyncio.Task) -> None:
        self._stopping.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self.log.error("Stopping a process of unleased GPU use failed", exc_info=task.exception())

    def _same_process(self, p: GPUProcess) -> bool:
        info = self.procs.info(p.pid)
        return info is not None and info.start == p.start and info.owner.uid == p.owner.uid

    def _signal(self, p: GPUProcess, sig: int) -> tuple[str, str]:
        """Send ``sig`` to ``p`` if its PID still names that process; (outcome, message)."""
        if not p.start:
            return "not_stopped", f"the broker cannot see process {p.pid} (it runs on another node or in another PID namespace): stop it there"
        info = self.procs.info(p.pid)
        if info is None:
            return "stopped", f"process {p.pid} had ended"
        if info.start != p.start or info.owner.uid != p.owner.uid:
            return "stopped", f"process {p.pid} had ended (its PID now names another process, left alone)"
        try:
            self.kill(p.pid, sig)
        except ProcessLookupError:
            return "stopped", f"process {p.pid} had ended"
        except PermissionError:
            return "not_stopped", f"the broker may not signal process {p.pid} of {p.owner.words()}: it must run as root to stop other users' processes"
        return "signalled", f"sent {signal.Signals(sig).name} to process {p.pid}"

    async def close(self) -> None:
        for t in list(self._stopping):
            t.cancel()


# --------------------------------------------------------------------------- the REST API
class UnleasedHandler(APIHandler):
    """``GET api/unleased[?user=NAME]``: the standing findings (admins: everyone's, or NAME's;
    others: their own) and the warnings the caller's server shows. A server without a lease
    polls it: no heartbeat carries the warnings there."""

    async def get(self):
        detector = self.unleased
        asked = self.get_argument("user", None)
        if asked is not None and asked != self.caller_name and not self.is_admin:
            raise Forbidden("only admins may read another user's unleased GPU use", field="user")
        who = asked if asked is not None else (None if self.is_admin else self.caller_name)
        if detector is None:
            self.write_json({"enabled": False, "action": None, "grace_s": None, "findings": [], "warnings": []})
            return
        self.write_json({"enabled": True, "action": detector.action, "grace_s": detector.tracker.grace_s,
                         "findings": detector.findings_for(who, admin=self.is_admin), "warnings": detector.warnings_for(self.caller_name)})


def api_handlers(prefix: str) -> list[tuple]:
    return [(prefix + r"api/unleased/?", UnleasedHandler)]
