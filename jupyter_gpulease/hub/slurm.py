"""GPULeaseSlurmSpawner: on Slurm, the lease becomes a batch job on the leased node and GPUs.

batchspawner's SlurmSpawner submits the job; :func:`slurm_job_spec` turns the granted lease into
what the job asks for: ``--nodelist=<node>``, ``--gres=gpu:<model>:<n>`` (the pool's model is
the GRES type, see :mod:`jupyter_gpulease.devices.slurm`; a MIG instance is the type
``<model>_<profile>``) and ``--time`` = the lease's time left plus ``slurm_time_margin`` (so the
hub's orderly stop comes first and Slurm's limit is the backstop when the hub is gone). Shares
are Slurm shards (``--gres=shard:<model>:<n>``) where the admin turns them on.

While the server runs the job follows its lease: an extension moves the job's ``TimeLimit``
(``scontrol update``); a lease that ends (expired, preempted after its warning, revoked) stops
the server, which cancels the job; a job that ends (finished, cancelled, killed at its time
limit, its node down) ends the lease. Slurm, not the broker, picks which GPUs of the node the
job gets (it sets ``CUDA_VISIBLE_DEVICES``); the spawner reads them back from the job and
warns when they differ from the lease's (other jobs on the node use GPUs outside the pool).
"""

from __future__ import annotations

import asyncio
import math
import re
import shlex
import time
from dataclasses import dataclass
from datetime import datetime

from batchspawner import SlurmSpawner
from traitlets import Float, Int, Unicode

from .spawner import GPULeaseSpawner, spawn_error
from .spawner_settings import stop_at_lease_end

_IDX_RE = re.compile(r"GRES=(?P<gres>\S+)")
_IDX_LIST_RE = re.compile(r"IDX:(?P<idx>[0-9,\-]+)")


class SlurmPlacementError(ValueError):
    """A lease this Slurm setup cannot express as a job (a share without shards…)."""


@dataclass(frozen=True)
class SlurmJobSpec:
    """What one lease adds to the job: where, which GPUs, how long."""

    nodelist: str
    gres: str  # "gpu:l4:1", "gpu:a100_3g.40gb:1", "shard:l4:2"
    time_limit_min: int
    gpu_indices: tuple[int, ...] = ()  # the lease's GPU indices on the node (to compare with Slurm's choice)


def slurm_time(minutes: int) -> str:
    """Minutes as Slurm's ``days-hours:minutes:00`` (``--time`` and ``TimeLimit``)."""
    days, rest = divmod(max(int(minutes), 1), 24 * 60)
    hours, mins = divmod(rest, 60)
    return f"{days}-{hours:02d}:{mins:02d}:00"


def minutes_until(expires_at: float | None, now: float, margin_s: float, *, default_s: float = 3600) -> int:
    """Whole minutes from ``now`` until ``expires_at`` plus ``margin_s``, rounded up (at least 1)."""
    left = (float(expires_at) - now) if expires_at else default_s
    return max(1, math.ceil((left + margin_s) / 60))


def slurm_job_spec(lease: dict, *, now: float, margin_s: float = 120, shard_gres: str = "", shards_per_gpu: int = 0) -> SlurmJobSpec:
    """What the job of a server holding the active ``lease`` (broker lease JSON) asks Slurm for."""
    placement = lease.get("placement") or {}
    slices = list(placement.get("slices") or [])
    if not slices:
        raise SlurmPlacementError(f"lease {lease.get('id')} has no placement (state {lease.get('state')!r})")
    node = placement.get("node") or slices[0]["node"]
    model = slices[0]["model"]
    minutes = minutes_until(lease.get("expires_at"), now, margin_s)
    mig = [s for s in slices if s.get("mig_uuid")]
    shares = [s for s in slices if not s.get("mig_uuid") and float(s.get("share", 1)) < 1]
    if mig:
        gres = f"gpu:{model}_{mig[0].get('mig_profile')}:{len(mig)}"
    elif shares:
        if not shard_gres or shards_per_gpu < 1:
            raise SlurmPlacementError(
                f"This hub does not offer shares of a GPU on Slurm (lease {lease.get('id')} is a {float(shares[0]['share']):g} "
                "share); ask for a whole GPU or a MIG profile, or ask the administrator to set "
                "GPULeaseSlurmSpawner.share_gres and shards_per_gpu.")
        n = max(1, min(shards_per_gpu, math.ceil(float(shares[0]["share"]) * shards_per_gpu - 1e-9)))
        gres = f"{shard_gres}:{model}:{n}"
    else:
        gres = f"gpu:{model}:{len(slices)}"
    return SlurmJobSpec(nodelist=node, gres=gres, time_limit_min=minutes,
                        gpu_indices=tuple(int(s["index"]) for s in slices if not s.get("mig_uuid")))


def parse_job_gpu_indices(show_job: str) -> tuple[int, ...]:
    """The GPU indices Slurm gave a job, from ``scontrol -d show job`` (``GRES=gpu:l4:2(IDX:1-2)``)."""
    out: list[int] = []
    for m in _IDX_RE.finditer(show_job):
        for idx in _IDX_LIST_RE.finditer(m.group("gres")):
            for part in idx.group("idx").split(","):
                if "-" in part:
                    a, b = part.split("-", 1)
                    out.extend(range(int(a), int(b) + 1))
                elif part:
                    out.append(int(part))
    return tuple(out)


def job_field(show_job: str, key: str) -> str:
    """One field of ``scontrol show job`` output (``StartTime``, ``TimeLimit``…); "" if absent."""
    m = re.search(rf"(?:^|\s){re.escape(key)}=(\S+)", show_job)
    return m.group(1) if m else ""


class GPULeaseSlurmSpawner(GPULeaseSpawner, SlurmSpawner):
    """batchspawner's SlurmSpawner with GPU leases (entry point ``gpulease-slurm``)."""

    server_changes_gpus = False  # a job keeps its GRES until it ends

    slurm_time_margin = Float(
        120,
        help="""Seconds the job's time limit runs past the lease's expiry. The hub stops the server
        when the lease ends; Slurm's limit ends the job if the hub cannot (it is down). Example: 300.""",
    ).tag(config=True)

    share_gres = Unicode(
        "",
        help="""GRES that shares a GPU between jobs, for share leases: ``"shard"`` (Slurm 22.05+,
        ``GresTypes=gpu,shard`` with ``Name=shard Count=<n>`` per GPU in gres.conf). Empty: the
        hub offers no shares on Slurm and a share request fails at once with a message.""",
    ).tag(config=True)

    shards_per_gpu = Int(
        0,
        min=0,
        help="""Shards configured per GPU (gres.conf), for ``share_gres="shard"``: a share asks for
        that fraction of them, rounded up (a 0.5 share of a GPU with 8 shards asks for 4).""",
    ).tag(config=True)

    scontrol_cmd = Unicode(
        "scontrol",
        help="""Command that updates jobs (time limits after an extension) and reads their GPUs.
        The hub's account must be a Slurm operator or admin to raise a job's time limit
        (``sacctmgr modify user <hub user> set adminlevel=operator``). Example:
        ``"/opt/slurm/bin/scontrol"``.""",
    ).tag(config=True)

    _check_on_lease_end = stop_at_lease_end("Slurm", "a job keeps its GPUs until it ends")

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._job_spec: SlurmJobSpec | None = None

    # ------------------------------------------------------------------ the lease becomes the job
    def lease_choice(self, user_options, pool=None):
        choice = super().lease_choice(user_options, pool)
        if choice.request and choice.request.get("kind") == "share" and not (self.share_gres and self.shards_per_gpu):
            raise spawn_error("This hub does not offer shares of a GPU on Slurm; ask for a whole GPU or a MIG profile.",
                              reason="gpulease_options")
        return choice

    def apply_placement(self, lease: dict) -> None:
        super().apply_placement(lease)
        try:
            self._job_spec = slurm_job_spec(lease, now=time.time(), margin_s=self.slurm_time_margin,
                                            shard_gres=self.share_gres, shards_per_gpu=self.shards_per_gpu)
        except SlurmPlacementError as e:
            raise spawn_error(str(e), reason="gpulease_placement") from None
        # Slurm chooses the GPUs inside the node and sets CUDA_VISIBLE_DEVICES for the job
        self._lease_env.pop("CUDA_VISIBLE_DEVICES", None)
        self._lease_env["GPULEASE_DEVICE_CHOICE"] = "engine"
        self._lease_env["GPULEASE_ENGINE"] = "slurm"  # the job keeps its GPUs: a lease that ends stops the server

    async def start(self):
        self._job_spec = None  # a CPU-only spawn after a GPU one asks for nothing
        url = await super().start()
        if self._job_spec is not None and self.job_id:
            self._gpu_check = asyncio.ensure_future(self._check_job_gpus(self._job_spec))
        return url

    def get_req_subvars(self):
        subvars = super().get_req_subvars()
        # batchspawner fixes the exported variable names at the first spawn of this server; a
        # later spawn (a lease after a CPU-only start) has more GPULEASE_* variables to pass on
        names = [n for n in (subvars.get("keepvars") or "").split(",") if n]
        subvars["keepvars"] = ",".join(dict.fromkeys([*names, *self.get_env()]))
        if self._lease_env.get("CUDA_VISIBLE_DEVICES") == "":
            # a server without a lease sees no GPU, also where Slurm does not fence devices with
            # cgroups (sbatch drops an empty variable from --export, so set it in the script)
            subvars["prologue"] = "\n".join(p for p in ("export CUDA_VISIBLE_DEVICES=", subvars.get("prologue")) if p)
        spec = self._job_spec
        if spec is not None:
            subvars["gres"] = ",".join(g for g in (subvars.get("gres"), spec.gres) if g)
            subvars["runtime"] = slurm_time(spec.time_limit_min)
            subvars["options"] = " ".join(o for o in (f"--nodelist={spec.nodelist}", subvars.get("options")) if o)
        return subvars

    # ------------------------------------------------------------------ following the lease
    async def on_lease_event(self, event: dict) -> None:
        if event.get("kind") == "extended" and self.job_id:
            to = (event.get("data") or {}).get("to")
            if to:
                await self.set_job_end(float(to))

    async def set_job_end(self, expires_at: float) -> None:
        """Move the job's TimeLimit so that it ends ``slurm_time_margin`` after ``expires_at``."""
        show = await self.scontrol("show", "job", "-o", self.job_id)
        start = _slurm_timestamp(job_field(show, "StartTime"))
        if start is None:
            start = time.time()  # not started yet: the limit counts from now on
        minutes = max(1, math.ceil((expires_at + self.slurm_time_margin - start) / 60))
        await self.scontrol("update", f"JobId={self.job_id}", f"TimeLimit={slurm_time(minutes)}")
        self.log.info("Job %s of %s: time limit %s after the lease was extended", self.job_id, self._log_name, slurm_time(minutes))

    async def scontrol(self, *args: str) -> str:
        cmd = " ".join([self.scontrol_cmd, *(shlex.quote(a) for a in args)])
        return await self.run_command(cmd, env=self.get_env())

    async def _check_job_gpus(self, spec: SlurmJobSpec) -> None:
        try:
            show = await self.scontrol("-d", "show", "job", self.job_id)
        except Exception as e:
            self.log.debug("Could not read the GPUs of job %s: %s", self.job_id, e)
            return
        got = parse_job_gpu_indices(show)
        if spec.gpu_indices and got and tuple(sorted(got)) != tuple(sorted(spec.gpu_indices)):
            self.log.warning("Job %s of %s runs on GPU(s) %s of %s; the lease names GPU(s) %s (other jobs use GPUs of this "
                             "node outside the lease pool?)", self.job_id, self._log_name, list(got), spec.nodelist, list(spec.gpu_indices))


def _slurm_timestamp(value: str) -> float | None:
    """Slurm's local ``2026-11-30T09:50:00`` (or ``Unknown``/``None``) as POSIX seconds."""
    try:
        return datetime.fromisoformat(value).timestamp()
    except ValueError:
        return None
