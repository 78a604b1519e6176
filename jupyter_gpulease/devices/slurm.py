"""The GPUs of a Slurm cluster, read from ``scontrol show node`` (the GRES of each node).

Each ``gpu`` GRES of a node (``Gres=gpu:a100:4(S:0-1),gpu:l4:2``) becomes that many GPUs of the
pool, numbered in Slurm's order (the order of gres.conf, which is the IDX Slurm reports). The
GRES *type* is the model name (``a100``, ``l4``): the spawner asks Slurm for
``--gres=gpu:<model>:<n>``, so nothing is declared twice; spawn-form globs match it without
regard to case (``A100*`` matches ``a100``). A type with a MIG profile, as Slurm's NVML
autodetection names MIG devices (``a100_3g.40gb``), becomes MIG instances of model ``a100``.

Slurm does not know a GPU's memory: ``memory_mib`` maps types to MiB; a type whose name says it
(``a100_80gb``) needs no entry. Types with neither are left out of the pool, with a warning.

Node states: ``DRAIN``/``DRAINING``/``NOT_RESPONDING``/``FAIL``/``POWERED_DOWN`` keep the GPUs in
the pool as unhealthy (running leases go on, nothing new is granted there); ``DOWN`` (Slurm
requeues or ends the jobs on it) and nodes that left slurm.conf take them out of the pool, and
the broker ends their leases.

Config::

    {"memory_mib": {"a100": 81920, "l4": 23034},
     "partitions": ["gpu"],         # only nodes of these partitions (default: all)
     "scontrol": "scontrol",        # the command, e.g. "/opt/slurm/bin/scontrol"
     "slurm_conf": "",              # SLURM_CONF for the command (default: Slurm's own)
     "refresh_s": 15,               # how often the broker re-reads the pool
     "timeout_s": 20}

Or ``"nodes_file"``: a saved ``scontrol -d show node -o`` output to read instead.
"""

from __future__ import annotations

import logging
import os
import re
import shlex
import subprocess
import time
from dataclasses import dataclass, field
from typing import Any

from ..core.model import GPU
from .base import Clock, DeviceBackend, DeviceSample, DeviceUnavailable, check_config_keys
from .declared import MAX_MIG_SLICES, distribute_mig, parse_mig_profile, simulated_gpu_uuid

log = logging.getLogger(__name__)

UUID_PREFIX = "slurm"
_KEY_RE = re.compile(r"^([A-Za-z][A-Za-z0-9_/]*)=(.*)$")
_GRES_RE = re.compile(r"^(?P<name>[A-Za-z0-9_]+)(?::(?P<type>[^:(]+))?:(?P<count>\d+)(?:\((?P<extra>[^)]*)\))?$")
_MIG_TYPE_RE = re.compile(r"^(?P<model>.+?)[_-](?P<profile>(?:\d+c\.)?\d+g\.\d+gb)$", re.IGNORECASE)
_GB_RE = re.compile(r"(\d+)gb", re.IGNORECASE)
LOST_STATES = {"DOWN"}
UNHEALTHY_FLAGS = {"DRAIN", "DRAINING", "DRAINED", "NOT_RESPONDING", "FAIL", "FAILING", "POWERED_DOWN", "POWERING_DOWN",
                   "POWER_DOWN", "MAINTENANCE", "REBOOT_REQUESTED", "REBOOT_ISSUED", "UNKNOWN", "FUTURE", "INVAL"}
_CONFIG_KEYS = {"memory_mib", "partitions", "scontrol", "slurm_conf", "refresh_s", "timeout_s", "nodes_file"}


def parse_scontrol_nodes(text: str) -> list[dict[str, str]]:
    """``scontrol -d show node -o`` (one node per line) as dicts of its fields.

    Values may hold spaces (``OS=Linux 6.8.0 #1 SMP``, ``Reason=maint window [root@…]``): a word
    without ``=`` belongs to the value before it.
    """
    nodes = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line.startswith("NodeName="):
            continue
        fields: dict[str, str] = {}
        key = None
        for word in line.split(" "):
            m = _KEY_RE.match(word)
            if m and (key is None or m.group(1)[0].isupper()):
                key = m.group(1)
                fields[key] = m.group(2)
            elif key is not None and word:
                fields[key] += " " + word
        nodes.append(fields)
    return nodes


@dataclass(frozen=True)
class GresEntry:
    name: str  # "gpu"
    type: str  # "a100" ("" when untyped)
    count: int
    extra: str = ""  # "S:0-1" or "IDX:0-2"


def parse_gres(value: str) -> list[GresEntry]:
    """``gpu:a100:4(S:0-1),gpu:l4:2,shard:8`` → entries; ``(null)`` and empty → none."""
    out = []
    value = (value or "").strip()
    if not value or value in ("(null)", "N/A"):
        return out
    # split on commas outside parentheses ("(S:0,2)" holds one)
    depth, part, parts = 0, "", []
    for ch in value:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(part)
            part = ""
        else:
            part += ch
    parts.append(part)
    for p in parts:
        m = _GRES_RE.match(p.strip())
        if m:
            out.append(GresEntry(m.group("name"), m.group("type") or "", int(m.group("count")), m.group("extra") or ""))
    return out


def node_health(state: str) -> str:
    """``"ok"``, ``"unhealthy"`` (drained, not responding…) or ``"lost"`` (down) from Slurm's State field."""
    parts = {p.strip("*~#%$@!^-").upper() for p in re.split(r"[+]", state or "") if p}
    if parts & LOST_STATES:
        return "lost"
    if not parts or parts & UNHEALTHY_FLAGS:
        return "unhealthy"
    return "ok"


@dataclass
class SlurmNodeGPUs:
    node: str
    gpus: list[GPU] = field(default_factory=list)
    health: str = "ok"
    problems: list[str] = field(default_factory=list)


def _type_memory(gres_type: str, memory_mib: dict[str, int]) -> int | None:
    for key in (gres_type, gres_type.lower()):
        if key in memory_mib:
            return int(memory_mib[key])
    m = _GB_RE.search(gres_type)
    return int(m.group(1)) * 1024 if m else None


def node_gpus(fields: dict[str, str], memory_mib: dict[str, int] | None = None) -> SlurmNodeGPUs | None:
    """One node's GPUs from its ``scontrol`` fields; None for a node without a gpu GRES."""
    memory_mib = memory_mib or {}
    name = fields.get("NodeName", "")
    entries = [e for e in parse_gres(fields.get("Gres", "")) if e.name == "gpu"]
    if not entries:
        return None
    out = SlurmNodeGPUs(name, health=node_health(fields.get("State", "")))
    index = 0
    mig_groups: dict[str, dict[str, tuple[int, int]]] = {}
    for e in entries:
        mig = _MIG_TYPE_RE.match(e.type) if e.type else None
        if mig:
            profile = mig.group("profile").lower()
            mig_groups.setdefault(mig.group("model"), {})[profile] = (e.count, parse_mig_profile(profile)[1])
            continue
        model = e.type or "gpu"
        mem = _type_memory(model, memory_mib)
        if mem is None:
            out.problems.append(f"GPU memory of GRES type {model!r} unknown: add it to the device config's 'memory_mib' "
                                f"(e.g. {{{model!r}: 81920}}); its {e.count} GPU(s) are left out")
            index += e.count
            continue
        for _ in range(e.count):
            out.gpus.append(GPU(simulated_gpu_uuid(name, index, UUID_PREFIX), name, index, model, mem))
            index += 1
    for model, profiles in mig_groups.items():
        # Slurm lists the instances, not the GPUs that hold them: as few GPUs as the slices need
        slices = sum(parse_mig_profile(p)[0] * n for p, (n, _) in profiles.items())
        gpus = max(1, -(-slices // MAX_MIG_SLICES))
        mem = _type_memory(model, memory_mib) or 0  # 0: the sum of each GPU's instances
        out.gpus.extend(distribute_mig(name, index, gpus, profiles, model, mem, prefix=UUID_PREFIX))
        index += gpus
    return out


def inventory_from_scontrol(text: str, *, memory_mib: dict[str, int] | None = None, partitions: tuple[str, ...] = (),
                            problems: list[str] | None = None) -> list[GPU]:
    """The pool from ``scontrol -d show node -o`` output."""
    out: list[GPU] = []
    for fields in parse_scontrol_nodes(text):
        if partitions and not set(fields.get("Partitions", "").split(",")) & set(partitions):
            continue
        found = node_gpus(fields, memory_mib)
        if found is None:
            continue
        if problems is not None:
            problems.extend(f"node {found.node}: {p}" for p in found.problems)
        if found.health == "lost":
            if problems is not None and found.gpus:
                problems.append(f"node {found.node}: state {fields.get('State')}; its {len(found.gpus)} GPU(s) left the pool")
            continue
        if found.health == "unhealthy":
            found.gpus = [GPU(g.uuid, g.node, g.index, g.model, g.memory_mib, g.mig, healthy=False) for g in found.gpus]
        out.extend(found.gpus)
    return out


class SlurmBackend(DeviceBackend):
    """A Slurm cluster's GPU nodes as the pool; no telemetry (servers report their own usage)."""

    name = "slurm"

    def __init__(self, config: dict[str, Any] | None = None, *, clock: Clock | None = None):
        config = dict(config or {})
        check_config_keys("slurm", config, sorted(_CONFIG_KEYS))
        mem = config.get("memory_mib") or {}
        if not isinstance(mem, dict) or not all(isinstance(v, int) and v > 0 for v in mem.values()):
            raise ValueError("slurm device backend: 'memory_mib' maps GRES types to MiB, e.g. {'a100': 81920, 'l4': 23034}")
        self.memory_mib = dict(mem)
        parts = config.get("partitions") or ()
        self.partitions = (parts,) if isinstance(parts, str) else tuple(parts)
        self.scontrol = shlex.split(str(config.get("scontrol") or "scontrol"))
        self.slurm_conf = str(config.get("slurm_conf") or "")
        self.inventory_refresh_s = float(config.get("refresh_s", 15))
        self.timeout_s = float(config.get("timeout_s", 20))
        self.nodes_file = config.get("nodes_file") or None
        self._clock = clock or time.time
        self._warned: set[str] = set()
        self._last: list[GPU] = []

    def read_nodes(self) -> str:
        """``scontrol -d show node -o`` output (or the saved file's)."""
        if self.nodes_file:
            try:
                with open(self.nodes_file) as f:
                    return f.read()
            except OSError as e:
                raise DeviceUnavailable(f"slurm device backend: cannot read {self.nodes_file}: {e.strerror}") from None
        env = dict(os.environ)
        if self.slurm_conf:
            env["SLURM_CONF"] = self.slurm_conf
        cmd = [*self.scontrol, "-d", "show", "node", "-o"]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=self.timeout_s, env=env, check=False)
        except FileNotFoundError:
            raise DeviceUnavailable(f"slurm device backend: {self.scontrol[0]!r} not found; install Slurm's client "
                                    "commands or set the device config's 'scontrol' to its path") from None
        except subprocess.TimeoutExpired:
            raise DeviceUnavailable(f"slurm device backend: `{' '.join(cmd)}` did not answer within {self.timeout_s:g} s") from None
        if done.returncode != 0:
            raise DeviceUnavailable(f"slurm device backend: `{' '.join(cmd)}` failed: {done.stderr.strip() or done.returncode}")
        return done.stdout

    def inventory(self) -> list[GPU]:
        problems: list[str] = []
        gpus = inventory_from_scontrol(self.read_nodes(), memory_mib=self.memory_mib, partitions=self.partitions, problems=problems)
        for p in problems:
            if p not in self._warned:
                self._warned.add(p)
                log.warning("Slurm GPU pool: %s", p)
        self._last = gpus
        return gpus

    def sample(self) -> dict[str, DeviceSample]:
        now = self._clock()
        out: dict[str, DeviceSample] = {}
        for g in self._last:
            out[g.uuid] = DeviceSample(uuid=g.uuid, timestamp=now, memory_total_mib=g.memory_mib)
            for m in g.mig:
                out[m.uuid] = DeviceSample(uuid=m.uuid, timestamp=now, memory_total_mib=m.memory_mib, parent_uuid=g.uuid)
        return out
