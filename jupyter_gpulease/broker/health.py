"""The broker acts on GPU health: cordons, drains, the settling time, maintenance windows.

What the device monitor senses (the broker's own sample of the pool, :mod:`.telemetry`) is
judged by the one rule in :mod:`jupyter_gpulease.core.health`:

* *drain now* (XID 79, 48, a lost GPU, an uncorrectable ECC error…): the GPU is cordoned at once
  (no new grants; the spawn form shows it unavailable with the reason) and every lease on it is
  moved: it ends after ``health_drain_grace_s`` (its server suspends the kernels meanwhile, as
  for a preemption) or at once (``health_drain_action = 'restart'``), and its server's next
  request goes first in its tier, onto a healthy GPU; the lease's record says what happened
  (``meta.health``, the end reason);
* *drain when idle* (XID 63, a row remap pending…): cordoned, the leases on it run to their end;
* *application* errors (XID 13, 31…) and *watch* findings (hot, throttled) change nothing here
  (the alerts report them).

A GPU cordoned by its health comes back by itself once a reset was seen and it stayed healthy
for ``health_settle_s``; an admin may hold it out (``hold``), or cordon, drain and uncordon any
GPU or node with a reason users read. Maintenance windows (devices or nodes, from–to, reason) go
to the scheduler (:mod:`jupyter_gpulease.core.maintenance`); holders of leases that would run into
one are warned ahead in their heartbeat answers (kind ``maintenance``), holders of a GPU that is
cordoned under them too (kind ``gpu_unhealthy``).

Every change is written to the store (schema 0005) before it is acknowledged or applied.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import secrets
from collections.abc import Iterable
from typing import Any

from .. import health_store
from ..core.health import HEALTH_META, Action, Finding, assess, is_hot, new_xids, strongest
from ..core.maintenance import MaintenanceWindow
from ..core.model import GPU, BadRequest, Conflict, LeaseState, NotFound
from ..core.text import format_duration
from . import bookings

log = logging.getLogger(__name__)

DRAIN_ACTIONS = ("suspend", "restart")
MODES = ("cordon", "drain", "drain_when_idle")  # cordon: no new grants; drain: and move the holders; drain_when_idle: they run to their end
JUDGE_SLICE = 1000  # GPUs judged between two turns of the event loop


def target_key(kind: str, name: str) -> str:
    return f"{kind}:{name}"


class HealthKeeper:
    """See the module doc. One per broker: ``manager`` (the :class:`LeaseManager`) is handed it
    by the app (``LeaseManager.wire``), to mark cordoned GPUs, note them in the pool and warn
    their holders. ``past``: the leases that ended lately, read ahead while the broker stood by
    (:class:`.past.PastLeases`, kept for at least :attr:`MOVED_MEMORY_S`); None: read from the
    store at start."""

    def __init__(self, manager, *, settle_s: float = 300.0, drain_action: str = "suspend", drain_grace_s: float = 60.0,
                 logger: logging.Logger | None = None, past=None):
        if drain_action not in DRAIN_ACTIONS:
            raise ValueError(f"drain_action must be one of {', '.join(DRAIN_ACTIONS)}, got {drain_action!r}")
        self.manager = manager
        self.settle_s = float(settle_s)
        self.drain_action = drain_action
        self.drain_grace_s = float(drain_grace_s)
        self.log = logger or log
        self.past = past
        self.cordons: dict[str, dict[str, Any]] = {}  # target -> row (see health_store.CORDONS)
        self.windows: dict[str, dict[str, Any]] = {}  # id -> row
        self.raw: list[GPU] = list(manager.inventory())  # the pool as the device backend reports it
        self._by_uuid: dict[str, GPU] = {g.uuid: g for g in self.raw}
        self._windows: list[MaintenanceWindow] | None = None  # self.windows as the scheduler's (cached)
        self.findings: dict[str, list[Finding]] = {}  # GPU uuid -> what its last sample showed (watch findings too), if anything
        self._xids_seen: dict[str, dict[int, int]] = {}
        self._looks: dict[str, Any] = {}  # GPU uuid -> its health report at the last look
        self._busy = False
        self._lock = asyncio.Lock()
        self._tasks: set[asyncio.Task] = set()

    # ------------------------------------------------------------------ start
    async def start(self) -> None:
        """Load the cordons, windows and bookings and apply them to the scheduler."""
        cordons, windows = await self.manager.in_writer(health_store.load, self.manager.store)
        self.cordons = {r["target"]: r for r in cordons}
        self.windows = {r["id"]: r for r in windows}
        self._windows = None
        await bookings.restore(self.manager)  # the bookings, kept like the windows (a booking is its owner's window)
        await self._remember_moved()
        await self._apply()

    MOVED_MEMORY_S = 3600.0  # how long a server whose lease was moved off a sick GPU keeps its place ahead

    async def _remember_moved(self) -> None:
        """After a restart: servers whose last lease was moved off a sick GPU (and that asked for
        none since) still go first in their tier with their next request."""
        m = self.manager
        since = m.now() - self.MOVED_MEMORY_S
        past = self.past.since(since) if self.past is not None and self.past.loaded else await m.in_writer(m.store.history, since)
        latest: dict[tuple[str, str], Any] = {}
        for lease in sorted([*past, *m.scheduler.leases.values()], key=lambda x: x.created_at):
            latest[(lease.user, lease.server)] = lease
        for key, lease in latest.items():
            info = lease.meta.get(HEALTH_META)
            if lease.state is LeaseState.REVOKED and isinstance(info, dict) and info.get("action") == "drain_now":
                m.scheduler.moved.setdefault(key, info)

    # ------------------------------------------------------------------ the pool as the scheduler sees it
    def cordon_of(self, gpu: GPU) -> dict[str, Any] | None:
        """The cordon that keeps a GPU out (its own, else its node's); None: none."""
        return self.cordons.get(target_key("device", gpu.uuid)) or self.cordons.get(target_key("node", gpu.node))

    def apply(self, gpus: Iterable[GPU]) -> list[GPU]:
        """The backend's GPUs with the cordoned ones marked unhealthy (no new grants there)."""
        self.raw = list(gpus)
        self._by_uuid = {g.uuid: g for g in self.raw}
        if not self.cordons:
            return list(self.raw)
        return [dataclasses.replace(g, healthy=False) if g.healthy and self.cordon_of(g) else g for g in self.raw]

    async def _apply(self) -> None:
        sched = self.manager.scheduler
        sched.set_maintenance(self.maintenance_windows())
        await self.manager.set_inventory(self.raw)  # the manager passes it through apply()
        await self.manager.tick()

    def maintenance_windows(self) -> list[MaintenanceWindow]:
        """The windows, soonest first (rebuilt when they change)."""
        if self._windows is None or len(self._windows) != len(self.windows):
            self._windows = sorted((MaintenanceWindow(r["id"], r["start"], r["end"], r["reason"], frozenset(r["devices"]), frozenset(r["nodes"]))
                                    for r in self.windows.values()), key=lambda w: w.start)
        return self._windows

    # ------------------------------------------------------------------ the monitor's samples
    def on_samples(self, telemetry) -> None:
        """A listener of the broker's device samples (on the loop): judge them, act off the listener."""
        samples = telemetry.current()
        if not samples or self._busy:
            return
        self._busy = True
        task = asyncio.ensure_future(self._judge(samples))
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        self._busy = False
        if not task.cancelled() and task.exception() is not None:
            self.log.error("GPU health: acting on a sample failed", exc_info=task.exception())

    async def judge(self, samples: dict[str, Any]) -> None:
        """Judge one sample of the pool's devices and act (what :meth:`on_samples` runs)."""
        await self._judge(samples)

    async def _judge(self, samples: dict[str, Any]) -> None:
        now = self.manager.now()
        async with self._lock:
            changed = False
            for i, g in enumerate(list(self.raw)):
                if i and not i % JUDGE_SLICE:
                    await asyncio.sleep(0)  # a pool of thousands of GPUs: calls are answered in between
                s = samples.get(g.uuid)
                if s is None:
                    continue
                h = s.health
                seen = self._looks.get(g.uuid)
                if ((seen is h or seen == h) and g.uuid not in self.findings and target_key("device", g.uuid) not in self.cordons
                        and not is_hot(s.temperature_c, getattr(s, "temperature_slowdown_c", None))):
                    continue  # healthy, not hot, and as at the last look (so no new XID): nothing to judge
                self._looks[g.uuid] = h
                counts = h.xid_counts()
                before = self._xids_seen.get(g.uuid)
                self._xids_seen[g.uuid] = counts
                xids = new_xids(before, counts) if before is not None else {}  # the first look is the baseline
                hd = h.to_dict()
                found = assess(hd, temperature_c=s.temperature_c, slowdown_c=getattr(s, "temperature_slowdown_c", None),
                               xids=xids, ecc_new=int(h.ecc_uncorrected or 0))
                if found:
                    self.findings[g.uuid] = found
                else:
                    self.findings.pop(g.uuid, None)  # (the healthy majority of a large pool holds nothing here)
                act = strongest(found)
                key = target_key("device", g.uuid)
                row = self.cordons.get(key)
                if act.cordons:
                    changed |= await self._sick(g, act, found, h, row, now)
                elif row is not None and row["source"] == "health" and not row["hold"]:
                    changed |= await self._maybe_back(g, h, row, now)
            if changed:
                await self._apply()

    async def _sick(self, g: GPU, act: Action, found: list[Finding], h, row: dict[str, Any] | None, now: float) -> bool:
        top = next(f for f in found if f.action is act)
        mode = "drain" if act is Action.DRAIN_NOW else "drain_when_idle"
        key = target_key("device", g.uuid)
        if row is not None:
            data = dict(row["data"])
            stronger = mode == "drain" and row["mode"] != "drain" and row["source"] == "health"
            if data.get("healthy_since") is None and not stronger:
                return False
            data["healthy_since"] = None
            new = {**row, "data": data}
            if stronger:
                new.update(mode=mode, reason=top.reason, since=now)
                data["findings"] = [f.to_dict() for f in found]
        else:
            new = {"target": key, "mode": mode, "source": "health", "reason": top.reason, "actor": "broker:health", "since": now,
                   "hold": False, "data": {"findings": [f.to_dict() for f in found], "resets": h.resets, "healthy_since": None,
                                           "device": g.uuid, "node": g.node, "index": g.index}}
        await self.manager.in_writer(health_store.save_cordon, self.manager.store, new)
        self.cordons[key] = new
        if row is None or new["mode"] != row["mode"]:
            self.log.warning("GPU %s (node %s, #%d) cordoned (%s): %s", g.uuid, g.node, g.index, mode.replace("_", " "), top.reason)
        if new["mode"] == "drain" and (row is None or row["mode"] != "drain"):
            await self._move_holders(g, top.reason)
        return True

    async def _maybe_back(self, g: GPU, h, row: dict[str, Any], now: float) -> bool:
        """A GPU cordoned by its health: back once a reset was seen and it stayed healthy for the settling time."""
        data = dict(row["data"])
        sick_now = h.lost or h.ecc_uncorrected or h.row_remap_pending or h.row_remap_failed or h.retired_pages_pending
        if h.resets <= int(data.get("resets") or 0) or sick_now:
            if data.get("healthy_since") is not None:
                data["healthy_since"] = None
                await self._save({**row, "data": data})
            return False
        since = data.get("healthy_since")
        if since is None:
            data["healthy_since"] = now
            await self._save({**row, "data": data})
            self.log.info("GPU %s was reset and answers healthy: back in the pool after %s unless it fails again", g.uuid, format_duration(self.settle_s))
            return False
        if now - since < self.settle_s:
            return False
        await self.manager.in_writer(health_store.delete_cordon, self.manager.store, row["target"])
        self.cordons.pop(row["target"], None)
        self.log.warning("GPU %s (node %s, #%d) is back in the pool: healthy for %s after a reset", g.uuid, g.node, g.index, format_duration(now - since))
        if self.cordon_of(g) is None:
            await self._keep_holders(g, f"the GPU is healthy again after a reset (for {format_duration(now - since)})")
        return True

    async def _save(self, row: dict[str, Any]) -> None:
        await self.manager.in_writer(health_store.save_cordon, self.manager.store, row)
        self.cordons[row["target"]] = row

    def _holders_of(self, g: GPU, *, moving: bool) -> list[Any]:
        """The active leases with a slice on ``g`` whose move off a sick GPU is pending
        (``moving``) or not."""
        return [lease for lease in self.manager.scheduler.leases.values()
                if lease.state is LeaseState.ACTIVE and lease.placement is not None and (HEALTH_META in lease.meta) is moving
                and any(sl.gpu_uuid == g.uuid for sl in lease.placement.slices)]

    async def _keep_holders(self, g: GPU, why: str, actor: str = "broker:health") -> None:
        """``g`` is back in the pool: the leases on it whose move is still pending stay."""
        for lease in self._holders_of(g, moving=True):
            try:
                await self.manager.cancel_drain(lease.id, why=why, actor=actor)
                self.log.warning("Lease %s stays on %s: %s", lease.id, g.uuid, why)
            except (NotFound, Conflict) as e:  # it ended meanwhile
                self.log.info("Lease %s: its move off %s was not called off: %s", lease.id, g.uuid, e)

    async def _move_holders(self, g: GPU, reason: str, actor: str = "broker:health") -> None:
        """Drain now: every active lease with a slice on ``g`` moves to a healthy GPU."""
        grace = 0.0 if self.drain_action == "restart" else self.drain_grace_s
        where = f"GPU {g.index} on {g.node}"
        for lease in self._holders_of(g, moving=False):
            try:
                await self.manager.drain(lease.id, grace_s=grace, reason=f"{where}: {reason}", device=g.uuid, actor=actor)
            except (NotFound, Conflict) as e:  # it ended meanwhile
                self.log.info("Lease %s not moved off %s: %s", lease.id, g.uuid, e)

    # ------------------------------------------------------------------ admin actions
    def _resolve(self, kind: str, name: str) -> list[GPU]:
        if kind not in ("device", "node"):
            raise BadRequest("'kind' must be 'device' or 'node'", field="kind")
        if not isinstance(name, str) or not name:
            raise BadRequest(f"name the {kind} ('{'uuid' if kind == 'device' else 'node'}')", field="name")
        if kind == "device":
            gpus = [g for g in self.raw if g.uuid == name or any(m.uuid == name for m in g.mig)]
        else:
            gpus = [g for g in self.raw if g.node == name]
        if not gpus:
            raise NotFound(f"no {'GPU' if kind == 'device' else 'node'} {name!r} in the pool", field="name")
        return gpus

    async def cordon(self, kind: str, name: str, *, reason: str, actor: str, drain: bool = False) -> dict[str, Any]:
        """An admin keeps a GPU or a node out of new grants (``drain``: and moves its holders), with
        ``reason`` that users read; it stays out until an admin uncordons it."""
        gpus = self._resolve(kind, name)
        if kind == "device":
            name = gpus[0].uuid
        if not isinstance(reason, str) or not reason.strip():
            raise BadRequest("give a 'reason': users read it on the spawn form and in their notebooks", field="reason")
        now = self.manager.now()
        key = target_key(kind, name)
        async with self._lock:
            old = self.cordons.get(key)
            row = {"target": key, "mode": "drain" if drain else "cordon", "source": "admin", "reason": reason.strip(), "actor": actor,
                   "since": old["since"] if old else now, "hold": True,
                   "data": {**(old["data"] if old else {}), "kind": kind, "name": name, "held_from": old["source"] if old else ""}}
            await self._save(row)
            self.log.warning("%s %s %s by %s: %s", "Drained" if drain else "Cordoned", kind, name, actor, reason)
            await self._apply()
            if drain:
                for g in gpus:
                    await self._move_holders(g, f"an admin drains it: {reason.strip()}", actor)
        return self.cordon_json(row)

    async def uncordon(self, kind: str, name: str, *, actor: str) -> dict[str, Any]:
        gpus = self._resolve(kind, name)
        if kind == "device":
            name = gpus[0].uuid
        key = target_key(kind, name)
        async with self._lock:
            row = self.cordons.get(key)
            if row is None:
                raise NotFound(f"{kind} {name!r} is not cordoned", field="name")
            await self.manager.in_writer(health_store.delete_cordon, self.manager.store, key)
            self.cordons.pop(key, None)
            self.log.warning("Uncordoned %s %s (%s) by %s", kind, name, row["reason"], actor)
            await self._apply()
            for g in gpus:
                if self.cordon_of(g) is None:  # a node's uncordon leaves a GPU's own cordon in force
                    await self._keep_holders(g, f"an admin put {kind} {name} back into the pool", actor)
        return {**self.cordon_json(row), "uncordoned_by": actor}

    async def add_window(self, *, start: float, end: float, reason: str, devices: Iterable[str] = (), nodes: Iterable[str] = (), actor: str) -> dict[str, Any]:
        devices, nodes = sorted(set(devices)), sorted(set(nodes))
        if not devices and not nodes:
            raise BadRequest("name the 'devices' (GPU UUIDs) or 'nodes' the window is for", field="devices")
        for d in devices:
            self._resolve("device", d)
        for n in nodes:
            self._resolve("node", n)
        for fld, v in (("start", start), ("end", end)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise BadRequest(f"'{fld}' must be a time (epoch seconds)", field=fld)
        now = self.manager.now()
        if end <= start:
            raise BadRequest("'end' must be after 'start'", field="end")
        if end <= now:
            raise BadRequest("the window is already over", field="end")
        if not isinstance(reason, str) or not reason.strip():
            raise BadRequest("give a 'reason': users read it on the spawn form and in the queue", field="reason")
        row = {"id": secrets.token_hex(6), "start": float(start), "end": float(end), "reason": reason.strip(), "devices": devices,
               "nodes": nodes, "actor": actor, "created_at": now}
        async with self._lock:
            await self.manager.in_writer(health_store.save_window, self.manager.store, row)
            self.windows[row["id"]] = row
            self._windows = None
            self.log.warning("Maintenance window %s set by %s: %s to %s on %s: %s", row["id"], actor, start, end,
                             ", ".join(devices + [f"node {n}" for n in nodes]), reason)
            await self._apply()
        return self.window_json(row)

    async def delete_window(self, window_id: str, *, actor: str) -> dict[str, Any]:
        async with self._lock:
            row = self.windows.get(window_id)
            if row is None:
                raise NotFound(f"no maintenance window {window_id!r}", field="id")
            await self.manager.in_writer(health_store.delete_window, self.manager.store, window_id)
            self.windows.pop(window_id, None)
            self._windows = None
            self.log.warning("Maintenance window %s removed by %s", window_id, actor)
            await self._apply()
        return self.window_json(row)

    # ------------------------------------------------------------------ what people read
    def cordon_json(self, row: dict[str, Any]) -> dict[str, Any]:
        kind, _, name = row["target"].partition(":")
        return {"kind": kind, "name": name, "mode": row["mode"], "source": row["source"], "reason": row["reason"], "actor": row["actor"],
                "since": row["since"], "hold": row["hold"], "healthy_since": row["data"].get("healthy_since"),
                "findings": row["data"].get("findings", [])}

    def window_json(self, row: dict[str, Any]) -> dict[str, Any]:
        now = self.manager.now()
        return {**{k: row[k] for k in ("id", "start", "end", "reason", "devices", "nodes", "actor", "created_at")},
                "under_way": row["start"] <= now < row["end"]}

    def state_json(self) -> dict[str, Any]:
        now = self.manager.now()
        return {
            "cordons": [self.cordon_json(r) for r in sorted(self.cordons.values(), key=lambda r: r["since"])],
            "maintenance": [self.window_json(r) for r in sorted(self.windows.values(), key=lambda r: r["start"]) if r["end"] > now],
            "settle_s": self.settle_s,
            "drain_action": self.drain_action,
        }

    def device_note(self, gpu: GPU) -> dict[str, Any] | None:
        """Why a GPU is unavailable (a cordon) or soon will be (a window), for the pool's device list and the form."""
        row = self.cordon_of(gpu)
        now = self.manager.now()
        out: dict[str, Any] = {}
        if row is not None:
            out["cordon"] = {"mode": row["mode"], "reason": row["reason"], "since": row["since"], "source": row["source"],
                             "node": row["target"].startswith("node:")}
        ws = [w for w in self.maintenance_windows() if w.end > now and w.covers(gpu)]
        if ws:
            w = min(ws, key=lambda w: w.start)
            out["maintenance"] = {"id": w.id, "start": w.start, "end": w.end, "reason": w.reason, "under_way": w.start <= now}
        return out or None

    def warnings(self, d: dict[str, Any]) -> list[dict[str, Any]]:
        """The holder's warnings about its GPUs: cordoned under it, or a maintenance window ahead."""
        if (not self.cordons and not self.windows) or d.get("state") != LeaseState.ACTIVE.value or not d.get("placement"):
            return []
        now = self.manager.now()
        out = []
        by_uuid = self._by_uuid
        seen_cordon = False
        for sl in d["placement"]["slices"]:
            g = by_uuid.get(sl["gpu_uuid"])
            if g is None:
                continue
            row = self.cordon_of(g)
            if row is not None and not seen_cordon:
                seen_cordon = True
                moved = (d.get("meta") or {}).get(HEALTH_META)
                if moved:
                    msg = f"your GPU is failing ({moved.get('reason')}): this lease moves to a healthy GPU"
                    if d.get("preempt_at"):
                        msg += f" in {format_duration(max(0.0, d['preempt_at'] - now))}; your kernels are suspended first and resume there"
                elif row["mode"] == "drain":
                    msg = f"your GPU ({g.index} on {g.node}) is being drained: {row['reason']}"
                else:
                    msg = f"your GPU ({g.index} on {g.node}) takes no new leases: {row['reason']}; this lease runs to its end"
                out.append({"kind": "gpu_unhealthy", "at": row["since"], "message": msg, "device": g.uuid})
        ends = d.get("preempt_at") or d.get("expires_at") or math.inf
        for w in self.maintenance_windows():
            if w.end <= now or w.start >= ends:
                continue
            if any((g := by_uuid.get(sl["gpu_uuid"])) is not None and w.covers(g) for sl in d["placement"]["slices"]):
                because = f" ({w.reason})" if w.reason else ""
                when = "is under way" if w.start <= now else f"begins in {format_duration(w.start - now)}"
                out.append({"kind": "maintenance", "at": w.start, "message": f"a maintenance window on your GPU {when}{because}, before this lease ends: "
                            "save your work; the lease cannot be extended past it", "window": w.id})
                break
        return out


__all__ = ["DRAIN_ACTIONS", "HealthKeeper"]
