"""Lease ends the broker has not confirmed yet, kept on disk by the hub until it has them.

A server's stop never waits for the broker: the engine stops the processes first, and the
lease's end goes to the broker when it answers. Until then the end must survive the hub
itself (a hub stopped, or killed, while its broker is down), or the lease would stay active,
its GPU granted to nobody else until the broker's own check with the hub finds it, and, worse,
with nothing left to stop a server the hub no longer knows. So every end that did not reach
the broker at the first try is written here, in one small JSON file next to the hub's own
files, and taken out once the broker has it. A hub that starts again sends what it finds here
as soon as its broker answers.

Two kinds of entry:

* ``leases``: a lease id to release (``reason``, ``state``, who asked);
* ``servers``: "every live lease of *user*'s server *name* made before *before* ends": what a
  stop leaves for leases the hub never saw, the ones the server took itself (``%gpu request``,
  a resumed kernel), when the broker could not list them at the stop.

Writes are atomic (a temporary file, fsync, rename): a crash leaves the old file or the new
one, never half of one. The file is a few hundred bytes per pending end, written only when
something is pending, so it stays on the event loop.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from ..files import write_atomically

log = logging.getLogger("jupyter_gpulease.hub")

VERSION = 1


class ReleaseOutbox:
    """The hub's durable list of lease ends still to send (see the module doc)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.leases: dict[str, dict[str, Any]] = {}
        self.servers: dict[str, dict[str, Any]] = {}
        self._load()

    # ------------------------------------------------------------------ reading
    def _load(self) -> None:
        try:
            raw = self.path.read_text()
        except FileNotFoundError:
            return
        except OSError as e:
            log.error("Cannot read the pending GPU lease ends in %s: %s", self.path, e)
            return
        try:
            data = json.loads(raw)
            leases, servers = data.get("leases") or {}, data.get("servers") or {}
            if not isinstance(leases, dict) or not isinstance(servers, dict):
                raise ValueError("'leases' and 'servers' must be objects")
        except (ValueError, AttributeError) as e:
            # keep the damaged file for the admin; start afresh beside it
            keep = self.path.with_name(self.path.name + f".bad-{int(time.time())}")
            log.error("The pending GPU lease ends in %s cannot be read (%s); kept as %s", self.path, e, keep)
            try:
                self.path.replace(keep)
            except OSError:
                pass
            return
        self.leases = {str(k): dict(v) for k, v in leases.items() if isinstance(v, dict)}
        self.servers = {str(k): dict(v) for k, v in servers.items() if isinstance(v, dict)}

    def __bool__(self) -> bool:
        return bool(self.leases or self.servers)

    def __len__(self) -> int:
        return len(self.leases) + len(self.servers)

    # ------------------------------------------------------------------ changing
    def add_lease(self, lease_id: str, *, reason: str, state: str = "released", who: str = "") -> None:
        """``lease_id`` must end; kept until :meth:`done_lease`."""
        entry = {"reason": reason, "state": state, "who": who, "since": time.time()}
        if self.leases.get(lease_id, {}).get("reason") == reason:
            return
        self.leases[lease_id] = entry
        self._save()

    def done_lease(self, lease_id: str) -> None:
        if self.leases.pop(lease_id, None) is not None:
            self._save()

    def add_server(self, user: str, server: str, *, reason: str, before: float | None = None,
                   keep: tuple[str, ...] = ()) -> str:
        """Every live lease of ``user``'s ``server`` made before ``before`` (now) must end, except
        ``keep``. Returns the entry's key for :meth:`done_server`."""
        before = time.time() if before is None else before
        key = f"{user}/{server}@{before:.3f}"
        self.servers[key] = {"user": user, "server": server, "before": before, "reason": reason, "keep": list(keep)}
        self._save()
        return key

    def done_server(self, key: str) -> None:
        if self.servers.pop(key, None) is not None:
            self._save()

    def _save(self) -> None:
        data = {"version": VERSION, "leases": self.leases, "servers": self.servers}
        try:
            if not self:
                self.path.unlink(missing_ok=True)
                return
            write_atomically(self.path, json.dumps(data, indent=1, sort_keys=True), mode=0o600, fsync=True)
        except OSError as e:
            log.error("Cannot write the pending GPU lease ends to %s: %s (they are kept in memory only)", self.path, e)
