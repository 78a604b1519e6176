"""A real single-node Slurm cluster (munged, slurmctld, slurmd) on 127.0.0.1, for tests and benchmarks.

Usage::

    with SlurmCluster(tmp_path, gpus=4, gpu_type="l4") as slurm:
        slurm.run("sbatch", "--wrap", "true")
        slurm.env            # {"SLURM_CONF": ...}: every Slurm command needs it

Everything lives in ``tmp_path`` (the munge key and socket in a short folder of their own under
/tmp, which the munge user can reach): slurm.conf and gres.conf,
state, spool, logs. The node is ``localhost`` with ``gpus`` GPU GRES of type ``gpu_type``;
each GPU's ``File=`` is a symlink to a distinct character device (Slurm drops file-less GPUs
and drains the node), so jobs get ``CUDA_VISIBLE_DEVICES`` like on a GPU node. Needs root and
Debian's ``slurm-wlm`` and ``munge`` packages (``.ci/run`` installs them): tests call
:func:`require_slurm` first, which skips them with the reason where Slurm cannot run (and fails
them in CI); :meth:`start` says what is missing.

Teardown follows the order that never hangs slurmd: cancel every job, wait until the queue is
empty, stop slurmd, then slurmctld, then munged, each by PID (SIGKILL after a timeout).
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Self

from hubharness import free_port, wait_for

CHAR_DEVICES = ["/dev/null", "/dev/zero", "/dev/full", "/dev/urandom", "/dev/random", "/dev/tty"]


def missing_slurm() -> str:
    """Why Slurm cannot run here ("" when it can)."""
    absent = [c for c in ("slurmctld", "slurmd", "munged", "sbatch", "scontrol", "squeue") if not shutil.which(c)]
    if absent:
        return (f"Slurm is not installed ({', '.join(absent)} missing): apt-get install slurm-wlm munge "
                "(bash .ci/run does it)")
    if os.geteuid() != 0:
        return "slurmd must run as root to start jobs; run the Slurm tests as root (as .ci/run does)"
    try:
        pwd.getpwnam("munge")
    except KeyError:
        return "the 'munge' system user is missing: apt-get install munge"
    return ""


def require_slurm() -> None:
    """In a test: skip with the reason when Slurm cannot run here; in CI (``CI`` set) fail instead."""
    import pytest

    import tooling

    why = missing_slurm()
    if why:
        if tooling.in_ci():
            pytest.fail(f"{why} (CI is set: the Slurm tests must run)", pytrace=False)
        pytest.skip(why)


class SlurmCluster:
    """One slurmctld + one slurmd (node ``localhost``) with a private munged; see the module doc."""

    def __init__(self, tmp_path: Path | str, *, gpus: int = 4, gpu_type: str = "l4", cpus: int = 16, memory_mb: int = 16000,
                 extra_conf: list[str] = ()):
        if gpus > len(CHAR_DEVICES):
            raise ValueError(f"at most {len(CHAR_DEVICES)} GPUs (one distinct character device each)")
        self.dir = Path(tmp_path)
        self.gpus, self.gpu_type, self.cpus, self.memory_mb = gpus, gpu_type, cpus, memory_mb
        self.extra_conf = list(extra_conf)
        self.conf = self.dir / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self.ctld: subprocess.Popen | None = None
        self.slurmd: subprocess.Popen | None = None
        self.munged: subprocess.Popen | None = None
        self.munge_dir: Path | None = None
        self._log = None

    # ------------------------------------------------------------------ setup
    def _write_config(self) -> None:
        d = self.dir
        for sub in ("state", "spool", "log", "dev"):
            (d / sub).mkdir(parents=True, exist_ok=True)
        for i in range(self.gpus):
            link = d / "dev" / f"gpu{i}"
            if not link.exists():
                link.symlink_to(CHAR_DEVICES[i])
        ctld_port, slurmd_port = free_port(), free_port()
        lines = [
            "ClusterName=gpulease",
            "SlurmctldHost=localhost(127.0.0.1)",
            f"SlurmctldPort={ctld_port}",
            f"SlurmdPort={slurmd_port}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            f"AuthInfo=socket={self.munge_dir / 'munge.socket.2'}",
            "CredType=cred/munge",
            f"StateSaveLocation={d / 'state'}",
            f"SlurmdSpoolDir={d / 'spool'}",
            f"SlurmctldPidFile={d / 'slurmctld.pid'}",
            f"SlurmdPidFile={d / 'slurmd.pid'}",
            f"SlurmctldLogFile={d / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={d / 'log' / 'slurmd.log'}",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "GresTypes=gpu",
            "SlurmdParameters=config_overrides",
            "SchedulerType=sched/backfill",
            "SchedulerParameters=bf_interval=5",
            "AccountingStorageType=accounting_storage/none",
            "JobAcctGatherType=jobacct_gather/none",
            "JobCompType=jobcomp/none",
            "ReturnToService=2",
            "MpiDefault=none",
            "SwitchType=switch/none",
            "MailProg=/bin/true",
            "KillWait=5",
            *self.extra_conf,
            (f"NodeName=localhost NodeAddr=127.0.0.1 CPUs={self.cpus} RealMemory={self.memory_mb} "
             f"Gres=gpu:{self.gpu_type}:{self.gpus} State=UNKNOWN"),
            "PartitionName=gpu Nodes=localhost Default=YES MaxTime=INFINITE State=UP",
        ]
        self.conf.write_text("\n".join(lines) + "\n")
        files = f"{d / 'dev' / 'gpu'}[0-{self.gpus - 1}]" if self.gpus > 1 else str(d / "dev" / "gpu0")
        (d / "gres.conf").write_text(f"AutoDetect=off\nName=gpu Type={self.gpu_type} File={files}\n")

    def _start_munged(self) -> None:
        # its own short folder under /tmp: munged runs as 'munge', which must reach the folder
        # (pytest's temporary folders are private to root) and a socket path has at most 107 bytes
        m = self.munge_dir = Path(tempfile.mkdtemp(prefix="gpulease-munge-"))
        key = m / "munge.key"
        key.write_bytes(os.urandom(1024))
        uid, gid = pwd.getpwnam("munge").pw_uid, pwd.getpwnam("munge").pw_gid
        for p in (m, key):
            os.chown(p, uid, gid)
        os.chmod(key, 0o600)
        os.chmod(m, 0o755)
        # in the foreground, as our child: stopped by PID and reaped, never left behind
        with open(self.dir / "log" / "munged.out", "ab") as out:
            self.munged = subprocess.Popen(
                ["munged", "--foreground", f"--socket={m / 'munge.socket.2'}", f"--pid-file={m / 'munged.pid'}",
                 f"--log-file={m / 'munged.log'}", f"--seed-file={m / 'munged.seed'}", f"--key-file={key}"],
                user=uid, group=gid, extra_groups=[], stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        sock = m / "munge.socket.2"
        wait_for(lambda: sock.exists() or self._died(self.munged, "munged"), 10, "munged did not create its socket")

    def start(self, timeout: float = 60) -> Self:
        why = missing_slurm()
        if why:
            raise AssertionError(why)
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / "log").mkdir(exist_ok=True)
        self._start_munged()
        self._write_config()
        self._log = log = open(self.dir / "log" / "daemons.out", "ab")  # noqa: SIM115 - closed in stop()
        self.ctld = subprocess.Popen(["slurmctld", "-D", "-f", str(self.conf)], env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        wait_for(lambda: self.run("scontrol", "ping", check=False).returncode == 0 or self._died(self.ctld, "slurmctld"), timeout,
                 f"slurmctld did not answer:\n{self.log_tail('slurmctld.log')}")
        self.slurmd = subprocess.Popen(["slurmd", "-D", "-N", "localhost", "-f", str(self.conf)], env=self.env, stdout=log,
                                       stderr=subprocess.STDOUT, start_new_session=True)
        wait_for(self._node_ready, timeout, f"node localhost did not become idle:\n{self.log_tail('slurmd.log')}")
        return self

    def _died(self, proc: subprocess.Popen, name: str) -> bool:
        if proc.poll() is not None:
            log = self.log_tail(name + ".log") if name != "munged" else self.log_tail("munged.out")
            raise AssertionError(f"{name} exited with {proc.returncode}:\n{log}")
        return False

    def _node_ready(self) -> bool:
        self._died(self.slurmd, "slurmd")
        out = self.run("sinfo", "-h", "-N", "-o", "%t", check=False).stdout.strip()
        return out in ("idle", "mix", "alloc")

    # ------------------------------------------------------------------ using it
    def run(self, *cmd: str, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess:
        return subprocess.run(list(cmd), env=self.env, capture_output=True, text=True, check=check, timeout=timeout)

    def jobs(self) -> list[str]:
        """Job ids in the queue (any state)."""
        return self.run("squeue", "-h", "-o", "%i").stdout.split()

    def show_job(self, job_id: str) -> str:
        return self.run("scontrol", "-d", "show", "job", job_id, check=False).stdout

    def log_tail(self, name: str, n: int = 30) -> str:
        try:
            return "\n".join((self.dir / "log" / name).read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return f"(no {name})"

    # ------------------------------------------------------------------ teardown
    def stop(self) -> None:
        if self.ctld is not None and self.ctld.poll() is None:
            self.run("scancel", "--user=root", check=False)
            try:
                wait_for(lambda: not self.jobs(), 30, "jobs still queued after scancel")
            except AssertionError:
                pass  # stop the daemons anyway
        for proc in (self.slurmd, self.ctld, self.munged):
            if proc is not None and proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(20)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(10)
        self.ctld = self.slurmd = self.munged = None
        if self.munge_dir is not None:
            shutil.rmtree(self.munge_dir, ignore_errors=True)
            self.munge_dir = None
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
