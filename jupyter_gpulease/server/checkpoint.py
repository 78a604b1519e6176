"""Suspending a kernel's GPU state with NVIDIA's ``cuda-checkpoint``.

``cuda-checkpoint`` (driver 550 and later) copies a process's GPU memory to host memory and
releases the GPU while the process keeps running; its CUDA calls block until it is restored.
One suspend is, for each process of the kernel that holds GPU memory::

    cuda-checkpoint --action lock --pid PID --timeout MS   # wait for work in flight, block new calls
    cuda-checkpoint --action checkpoint --pid PID           # GPU memory -> host memory, GPU released

and a restore::

    cuda-checkpoint --action restore --pid PID [--device-map OLD=NEW,...]   # driver 580: another GPU
    cuda-checkpoint --action unlock --pid PID

Limits (NVIDIA's): x86-64 only; no UVM or IPC memory, no MIG, no NCCL. When it cannot be
used, :func:`unavailable_reason` says why and the extension falls back to another action.
Every call runs as a subprocess of the event loop (nothing blocks) with a time limit.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import platform
import shutil
import sys
from dataclasses import dataclass

log = logging.getLogger(__name__)

RESTORE_TRIES = 3  # a restore of one process, at most, before the resume fails
RESTORE_RETRY_S = 0.5  # the first wait between tries; the next ones are longer


class CheckpointError(Exception):
    """A cuda-checkpoint call failed; ``str(err)`` says which, on which process, and its message."""

    def __init__(self, message: str, *, pid: int | None = None, action: str = ""):
        super().__init__(message)
        self.pid = pid
        self.action = action


def find_cuda_checkpoint(name: str) -> str | None:
    """The executable's path: ``name`` itself when it is a path, else looked up on PATH."""
    if not name:
        return None
    if os.sep in name:
        return name if os.access(name, os.X_OK) else None
    return shutil.which(name)


def unavailable_reason(executable: str | None, configured: str, *, mig: bool = False, machine: str | None = None) -> str:
    """Why suspending cannot be used here ("" when it can)."""
    machine = (machine or platform.machine()).lower()
    if executable is None:
        return f"NVIDIA's cuda-checkpoint was not found ({configured!r} is not an executable on this server's PATH)"
    if machine not in ("x86_64", "amd64"):
        return f"cuda-checkpoint works on x86-64 only (this machine is {machine})"
    if mig:
        return "cuda-checkpoint does not support MIG instances"
    return ""


@dataclass
class CudaCheckpoint:
    """Runs ``cuda-checkpoint`` (or a stand-in with the same command line).

    ``prefix``: arguments that come before the tool's own (``-m module`` when ``path`` is Python);
    ``env``: the tool's environment (None: the server's); ``note``: what the tool is, when it
    is not NVIDIA's (said in the status and the messages: "simulated: ...")."""

    path: str
    timeout_s: float = 300.0
    lock_timeout_ms: int = 10_000
    prefix: tuple[str, ...] = ()
    env: dict[str, str] | None = None
    note: str = ""
    _device_map: bool | None = None

    async def _run(self, *args: str, pid: int | None = None, action: str = "") -> str:
        try:
            proc = await asyncio.create_subprocess_exec(
                self.path, *self.prefix, *args, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE, env=self.env,
            )
        except OSError as e:
            raise CheckpointError(f"cannot run {self.path}: {e}", pid=pid, action=action) from None
        try:
            out, err = await asyncio.wait_for(proc.communicate(), self.timeout_s)
        except TimeoutError:
            proc.kill()
            await proc.wait()
            raise CheckpointError(f"cuda-checkpoint {' '.join(args)} did not finish within {self.timeout_s:g} s", pid=pid, action=action) from None
        if proc.returncode != 0:
            words = (err or out).decode(errors="replace").strip() or f"exit status {proc.returncode}"
            raise CheckpointError(f"cuda-checkpoint --action {action} on process {pid} failed: {words}", pid=pid, action=action)
        return out.decode(errors="replace").strip()

    @property
    def simulated(self) -> bool:
        return bool(self.note)

    async def state(self, pid: int) -> str:
        """'running', 'locked', 'checkpointed' or 'failed' (the tool's words)."""
        return (await self._run("--get-state", "--pid", str(pid), pid=pid, action="get-state")).lower()

    async def supports_device_map(self) -> bool:
        """Whether this cuda-checkpoint can restore onto another GPU (``--device-map``, driver 580)."""
        if self._device_map is None:
            try:
                text = await self._run("--help", action="help")
            except CheckpointError:
                text = ""
            self._device_map = "--device-map" in text
        return self._device_map

    async def suspend(self, pids: list[int]) -> None:
        """Lock and checkpoint every process; on a failure, undo what was done and raise."""
        done: list[tuple[int, str]] = []
        try:
            for pid in pids:
                await self._run("--action", "lock", "--pid", str(pid), "--timeout", str(self.lock_timeout_ms), pid=pid, action="lock")
                done.append((pid, "locked"))
                await self._run("--action", "checkpoint", "--pid", str(pid), pid=pid, action="checkpoint")
                done[-1] = (pid, "checkpointed")
        except CheckpointError:
            for pid, how in reversed(done):  # leave nothing half-suspended: the kernel keeps its GPU
                try:
                    if how == "checkpointed":
                        await self._run("--action", "restore", "--pid", str(pid), pid=pid, action="restore")
                    await self._run("--action", "unlock", "--pid", str(pid), pid=pid, action="unlock")
                except CheckpointError as undo:
                    log.warning("Undoing a failed suspend: %s", undo)
            raise

    async def restore(self, pids: list[int], device_map: dict[str, str] | None = None, *, tries: int = RESTORE_TRIES) -> None:
        """Restore and unlock every process, onto other devices where ``device_map`` says so.

        A process's restore is tried again, ``tries`` times in all, a moment apart: where the
        hub locks the GPUs to their leases (a device cgroup), the GPU of a lease granted a moment
        ago opens only once the hub has heard of the grant, a few milliseconds after this
        server did; a restore that came first fails to open it."""
        moved = {old: new for old, new in (device_map or {}).items() if old != new}
        for pid in pids:
            args = ["--action", "restore", "--pid", str(pid)]
            if moved:
                args += ["--device-map", ",".join(f"{o}={n}" for o, n in sorted(moved.items()))]
            for attempt in range(1, tries + 1):
                try:
                    await self._run(*args, pid=pid, action="restore")
                    break
                except CheckpointError as e:
                    if attempt >= tries:
                        raise
                    log.info("Restoring process %s failed (%s); trying again (%d of %d)", pid, e, attempt + 1, tries)
                    await asyncio.sleep(RESTORE_RETRY_S * attempt)
            await self._run("--action", "unlock", "--pid", str(pid), pid=pid, action="unlock")


def simulated_checkpoint(device_config: dict, *, timeout_s: float = 300.0) -> CudaCheckpoint:
    """The simulated cuda-checkpoint (:mod:`jupyter_gpulease.devices.simcheckpoint`) for the
    simulated backend configured by ``device_config`` (its ``state_file``): this Python runs it."""
    from ..devices.simcheckpoint import NOTE

    env = dict(os.environ, GPULEASE_DEVICE_BACKEND="simulated", GPULEASE_DEVICE_CONFIG=json.dumps(device_config))
    return CudaCheckpoint(sys.executable, timeout_s=timeout_s, prefix=("-m", "jupyter_gpulease.devices.simcheckpoint"), env=env, note=NOTE)
