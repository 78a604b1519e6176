"""How a lease spawner's server stops, is polled, and ends with its lease; its saved state.

A server stops with its lease (released, or kept by policy), a lease that ends while the server
runs ends the server through the hub's own path (``poll()``), and the lease id lives in the
spawner state so a restarted hub follows the server again. A part of
:class:`.spawner.GPULeaseSpawner`.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from traitlets.config import LoggingConfigurable

from ..client import BrokerError
from .link import LeaseWatch, ended_by_holder

STATE_KEY = "gpulease"
STATE_VERSION = 1
ACTIVE_STATES = ("queued", "active")


class LeaseEnding(LoggingConfigurable):
    """Stop, poll and state of a lease spawner, and following its lease while the server runs."""

    async def stop(self, now=False):
        lease_id = self.lease_id
        self._unfollow()
        self._stopping = True
        early = None
        if lease_id:
            self._remember_end({"id": lease_id, "state": "released", "end_reason": "server stopped"})
            if self.release_when_stopping:
                # the hub took the server off the proxy before this: nobody reaches it any more
                early = self._end_lease(lease_id, "server stopped")
        try:
            # ask the engine itself: a spawn cancelled in the queue never started anything
            # (and LocalProcessSpawner would signal pid 0, the hub's own process group)
            if await super().poll() is None:
                await super().stop(now=now)
        finally:
            self._stopping = False
            self._close_progress()
            self._devices_stopped()
            ends = [early] if early is not None else []
            if early is None and lease_id:
                ends.append(self._end_lease(lease_id, "server stopped"))
            if self.broker_url and not self._lease_pending:
                # leases the server took itself (%gpu request, a kernel resumed after a reclaim) end
                # with it; a broker that cannot list them now gets the order from the outbox later
                ends.append(asyncio.ensure_future(self._withdraw_orphans("its server stopped", keep=lease_id)))
            ends = [t for t in ends if t is not None]
            if ends:
                # a moment for the broker's answer, never longer: the ends go on in the background
                await asyncio.wait(ends, timeout=min(5.0, self.broker_timeout))
            first = ends[0] if ends else None
            if lease_id and first is not None and first.done() and not first.cancelled() and first.exception() is None and first.result() is None:
                # the lease had already ended (the idle culler released it saying why, an admin
                # revoked it): the home page says how, not "server stopped"
                ended = await self._read_lease_briefly(lease_id)
                if ended and ended.get("state") not in ACTIVE_STATES and ended.get("state") != "unknown":
                    self._remember_end(ended)

    async def poll(self):
        if self._stopping:
            return await super().poll()
        if self._lease_pending:
            return None  # waiting in the queue counts as starting
        lease_id = self.lease_id
        status = await super().poll()
        if status is not None:
            self._unfollow()  # or it would outlive the lease, and keep a new spawn's lease unwatched
            if lease_id and not self._stopping:
                self._remember_end({"id": lease_id, "state": "released", "end_reason": "its server was gone"})
                self._end_lease(lease_id, "server is gone")
            return status
        self._devices_adopt()
        if not lease_id:
            return None
        if self.link.shutting_down:
            return None  # the hub is stopping its servers: the process answers, the broker is not asked
        fresh = self._watch is None or self._watch.lease_id != lease_id
        watch = self._follow(lease_id)  # a restarted hub: follow the lease again (the link retries until the broker answers)
        if (fresh or not self.link.connected) and await self._read_lease_briefly(lease_id) is None:
            return None  # broker unreachable: assume nothing changed; the link tells us once it answers
        lease = watch.lease
        if watch.live:
            self.lease = lease
            if (lease.get("state") == "active" and "confirmed_at" in lease and lease["confirmed_at"] is None
                    and self.ready and (self._confirm_task is None or self._confirm_task.done())):
                # the confirm after start did not reach the broker: the server is up, say so now,
                # or the broker revokes the lease after its confirm_timeout and the server stops
                self._confirm_task = self._background(self._confirm(lease_id))
            return None
        return await self._lease_ended(lease)

    async def _read_lease_briefly(self, lease_id: str) -> dict | None:
        """The lease from the broker, or None when it does not answer within a few seconds: a
        poll (the hub's start, a stop, the periodic check) never waits out the broker's retries."""
        try:
            return await asyncio.wait_for(self.link.get_lease(lease_id), timeout=min(5.0, self.broker_timeout))
        except TimeoutError:
            return None

    async def _lease_ended(self, lease: dict):
        """The lease of the running server ended: stop the server, or keep it running without it."""
        lease_id = lease.get("id") or self.lease_id
        if lease_id and not lease.get("end_message"):
            # the feed's event says that it ended; the lease JSON says how, in words, and who
            # ended it (what the user reads on the home page): a short wait for it
            try:
                full = await asyncio.wait_for(self.link.get_lease(lease_id), timeout=min(3.0, self.broker_timeout))
            except (BrokerError, TimeoutError):
                full = None
            if full and full.get("state") == lease.get("state"):
                lease = {**lease, **full}
        self._unfollow()
        self._remember_end(lease)
        by_user = ended_by_holder(lease)
        keep = self.on_release_by_user == "keep" if by_user else self.on_lease_end != "stop"
        if self._handled_end != lease_id:
            self._handled_end = lease_id
            self.log.warning("Lease %s of %s ended (%s: %s)%s", lease_id, self._log_name, lease.get("state"),
                             lease.get("end_reason") or "", "; the server keeps running without it" if keep else "; stopping the server")
        self.lease_id = ""
        if keep:
            self._lease_env = {}
            return None
        self._stopping = True
        try:
            await super().stop()
        finally:
            self._stopping = False
        status = await super().poll()
        return 0 if status is None else status

    def _remember_end(self, lease: dict) -> None:
        known = self.lease if isinstance(self.lease, dict) and self.lease.get("id") == lease.get("id") else {}
        self.last_lease_end = {
            "lease_id": lease.get("id") or self.lease_id,
            "state": lease.get("state") or "",
            "end_reason": lease.get("end_reason") or "",
            "end_message": lease.get("end_message") or "",
            "ended_at": lease.get("ended_at") or time.time(),
            "ended_by": lease.get("ended_by") or lease.get("ended_actor") or "",
            "tier": lease.get("tier") or known.get("tier") or "",
            "request": lease.get("request") or known.get("request") or {},
            "placement": lease.get("placement") or known.get("placement") or {},
        }

    def _end_lease(self, lease_id: str, reason: str) -> asyncio.Future | None:
        """Release an active lease or withdraw a queued one, in the background until the broker
        has it (a lease that already ended is fine)."""
        if not lease_id:
            return None
        if self.lease_id == lease_id:
            self.lease_id = ""
        return self.link.end_lease(lease_id, reason, state="released", who=self._log_name)

    async def _end_lease_briefly(self, lease_id: str, reason: str) -> None:
        """:meth:`_end_lease`, waiting a moment for the broker's answer (it goes on in the
        background when the broker is slow or away)."""
        task = self._end_lease(lease_id, reason)
        if task is not None:
            await asyncio.wait([task], timeout=min(5.0, self.broker_timeout))

    def get_state(self):
        state = super().get_state()
        mine: dict[str, Any] = {}
        if self.lease_id:
            mine["lease_id"] = self.lease_id
        if self.last_lease_end:
            mine["last_end"] = dict(self.last_lease_end)
        if mine:
            state[STATE_KEY] = {"version": STATE_VERSION, **mine}
        return state

    def load_state(self, state):
        super().load_state(state)
        mine = (state or {}).get(STATE_KEY) or {}
        if mine.get("lease_id"):
            self.lease_id = str(mine["lease_id"])
        if isinstance(mine.get("last_end"), dict):
            self.last_lease_end = dict(mine["last_end"])

    def clear_state(self):
        super().clear_state()
        if self._lease_pending:
            return  # never drop a lease that is still being waited for
        self.lease_id = ""
        self._lease_env = {}
        self._close_progress()

    # ------------------------------------------------------------------ the running lease
    def _follow(self, lease_id: str, lease: dict | None = None) -> LeaseWatch:
        """Follow ``lease_id`` through the hub's shared event feed."""
        w = self._watch
        if w is not None and w.lease_id == lease_id and not w.closed:
            if lease is not None:
                w.update(lease)
            return w
        self._unfollow()
        w = self._watch = self.link.watch(lease_id, lease)
        w.on_change.append(self._on_lease_change)
        w.on_event.append(self._on_lease_event)
        return w

    def _on_lease_event(self, event: dict) -> None:
        if type(self).on_lease_event is not LeaseEnding.on_lease_event:
            self._background(self._call_on_lease_event(event))

    async def _call_on_lease_event(self, event: dict) -> None:
        try:
            await self.on_lease_event(event)
        except Exception:
            self.log.exception("on_lease_event of %s failed for %s", self._log_name, event.get("kind"))

    async def on_lease_event(self, event: dict) -> None:
        """Called with every broker event of this server's lease (requested, granted, warned,
        preempt-warned, extended, confirmed, ended, ...), as the hub's event feed delivers it.
        Engines override it (the Slurm engine moves the job's time limit on ``extended``)."""

    def _unfollow(self) -> None:
        w, self._watch = self._watch, None
        if w is not None:
            w.close()

    def _on_lease_change(self, w: LeaseWatch) -> None:
        self._devices_follow(w)
        if w.warning is not None and w.warning is not self.last_warning:
            self.last_warning = w.warning
            self.log.warning("Lease %s of %s: %s %s", w.lease_id, self._log_name, w.warning.get("kind"), w.warning.get("reason", ""))
        if (w.live or w.state is None or self._lease_pending or self._stopping or self.lease_id != w.lease_id
                or self._handled_end == w.lease_id or (self._end_task is not None and not self._end_task.done())):
            return
        # ended while the server runs: the hub's own path (poll() decides, callbacks clean up)
        self._end_task = self._background(self.poll_and_notify())
