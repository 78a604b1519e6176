"""The lease ids for dcgm-exporter's HPC job mapping, so DCGM's metrics carry the lease.

dcgm-exporter started with ``--hpc-job-mapping-dir DIR`` reads, at each collection, one file
per GPU named by the GPU's index on its node (``DIR/0``, ``DIR/1``…), each holding the ids of
the jobs on that GPU, one per line, and labels that GPU's series ``hpc_job="<id>"``. The broker
(``GPULeaseBroker.dcgm_hpc_job_mapping_dir``) writes there the ids of the active leases holding
each GPU of the pool (a MIG instance's or a share's lease counts for its GPU), and empties a
GPU's file when its last lease ends. Each file is replaced atomically (a temporary file in the
same folder, then a rename), so the exporter never reads half a file.

A pool of several nodes: ``{node}`` in the path is the node's name (e.g.
``/shared/dcgm-jobs/{node}``, a folder each node's exporter reads); without it every GPU of
the pool is written to the one folder, which suits a broker on the GPU node itself.

The files are written after the grant or the end is committed, off the event loop, one write
pass at a time; a pass writes only the files whose content changed.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

from ..core.events import ENDED, GRANTED
from ..core.model import LeaseState
from ..files import write_atomically

log = logging.getLogger(__name__)


def job_files(leases: list[dict[str, Any]], gpus: list[Any], folder: str) -> dict[str, str]:
    """Path -> content of every GPU's file: the active leases on it, one id a line (pure).

    Every GPU of the pool has a file (an empty one when nobody holds it), so a lease that ended
    leaves no stale id behind."""
    holders: dict[str, set[str]] = {g.uuid: set() for g in gpus}
    for d in leases:
        if d.get("state") != LeaseState.ACTIVE.value or not d.get("placement"):
            continue
        for s in d["placement"].get("slices", ()):
            if s.get("gpu_uuid") in holders:
                holders[s["gpu_uuid"]].add(d["id"])
    out: dict[str, str] = {}
    for g in gpus:
        where = folder.replace("{node}", g.node)
        ids = sorted(holders[g.uuid])
        out[os.path.join(where, str(g.index))] = "".join(f"{i}\n" for i in ids)
    return out


class DcgmJobMap:
    """Keeps the mapping folder in step with the committed leases (see the module doc): reads
    the ``manager``'s committed leases and pool, hears of grants and ends through
    :meth:`on_events` (a listener of the manager's commits) once started."""

    def __init__(self, manager, folder: str, *, logger: logging.Logger | None = None):
        self.manager = manager
        self.folder = folder
        self.log = logger or log
        self.written: dict[str, str] = {}  # path -> content last written
        self.writes = 0
        self._dirty = False
        self._task: asyncio.Task | None = None
        self.last_error = ""
        self.started = False

    def start(self) -> None:
        """Write every file once (the leases a fail-over took over), then follow the events."""
        self.started = True
        self.update()

    def on_events(self, written, events) -> None:
        """A listener of the manager's commits: a grant or an end rewrites the files (once started)."""
        if self.started and any(e.kind in (GRANTED, ENDED) for e in events):
            self.update()

    def update(self) -> None:
        """Ask for a write pass (coalesced: one runs at a time, the next one after it)."""
        self._dirty = True
        if self._task is None or self._task.done():
            self._task = asyncio.ensure_future(self._run())

    async def idle(self) -> None:
        """Wait until every asked-for pass is written (tests, stop)."""
        while self._task is not None and not self._task.done():
            await asyncio.shield(self._task)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while self._dirty:
            self._dirty = False
            wanted = job_files(list(self.manager.committed.values()), self.manager.inventory(), self.folder)
            changed = {p: c for p, c in wanted.items() if self.written.get(p) != c}
            if not changed:
                continue
            try:
                await loop.run_in_executor(None, self._write, changed)
            except OSError as e:
                if str(e) != self.last_error:
                    self.log.warning("dcgm-exporter job mapping: cannot write %s: %s (tried again at the next grant or end)", self.folder, e)
                self.last_error = str(e)
                continue
            self.last_error = ""
            self.written.update(changed)

    def _write(self, files: dict[str, str]) -> None:
        for path, content in sorted(files.items()):
            write_atomically(path, content, mode=0o644)  # the exporter runs as another user
            self.writes += 1
