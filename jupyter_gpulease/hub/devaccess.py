"""Which character devices a lease allows: the pure part of device enforcement.

A single-user server started by a local-process spawner runs in a device cgroup (v1's
``devices`` controller, or a systemd scope on cgroup v2) that allows the device nodes of its
lease and denies every other GPU of the pool. This module computes those nodes and the rules
that express them; it does no I/O at import and none at all unless the caller passes the
function that does it (``stat``, the path of ``/proc/devices``).

The broker's pool JSON (``GET api/pool``) names each GPU's node in ``device`` where the
backend knows it (a declared pool: ``"devices": ["/dev/nvidia0", ...]`` per entry; NVML: the
GPU's minor number); without it a GPU's node is ``/dev/nvidia{index}`` with minor ``index``.
A MIG instance's ``device`` names its GPU instance's access node and ``compute_device`` its
compute instance's (``/dev/nvidia-caps/nvidia-capN`` both: CUDA opens the two, NVIDIA's MIG
user guide); an instance without them has no node of its own (its GPU's node is allowed with
it). The compute instance's node is kept under the instance's UUID + ``COMPUTE_SUFFIX``. A named node's major and minor come from
``device_major``/``device_minor`` in the JSON when given, else from ``stat`` when the caller
passes one (the hub does, off its event loop), else they stay unresolved (``-1``) and the
node is left out of the rules: an unresolved node can be neither allowed nor denied.
"""

from __future__ import annotations

import os
import stat as statmod
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

NVIDIA_MAJOR = 195
NVIDIACTL_MINOR = 255
MODESET_MINOR = 254
PROC_DEVICES = "/proc/devices"
COMPUTE_SUFFIX = "/ci"  # pool_gpu_nodes' key of a MIG instance's compute instance node: its UUID + this


@dataclass(frozen=True)
class DeviceNode:
    """A character device: its path and its numbers (``-1``: not known)."""

    path: str
    major: int
    minor: int

    @property
    def resolved(self) -> bool:
        return self.major >= 0 and self.minor >= 0


def _node_of(entry: dict[str, Any], default: DeviceNode | None, stat: Callable[[str], Any] | None) -> DeviceNode | None:
    path = entry.get("device")
    if not isinstance(path, str) or not path:
        return default
    major, minor = entry.get("device_major"), entry.get("device_minor")
    if isinstance(major, int) and isinstance(minor, int) and not isinstance(major, bool):
        return DeviceNode(path, major, minor)
    if stat is not None:
        try:
            st = stat(path)
        except OSError:
            return DeviceNode(path, -1, -1)
        if statmod.S_ISCHR(st.st_mode):
            return DeviceNode(path, os.major(st.st_rdev), os.minor(st.st_rdev))
    return DeviceNode(path, -1, -1)


def pool_gpu_nodes(pool: dict[str, Any], *, stat: Callable[[str], Any] | None = None) -> dict[str, DeviceNode]:
    """The device node of each GPU (and MIG instance with a node) of the pool JSON, by UUID.

    ``pool`` is ``GET api/pool``'s answer (its ``devices``) or that list itself. ``stat``
    (e.g. ``os.stat``) resolves named nodes whose numbers the JSON does not give.
    """
    devices = pool.get("devices", []) if isinstance(pool, dict) else pool
    out: dict[str, DeviceNode] = {}
    for d in devices or ():
        if not isinstance(d, dict) or not d.get("uuid"):
            continue
        try:
            index = int(d.get("index", 0))
        except (TypeError, ValueError):
            index = -1
        default = DeviceNode(f"/dev/nvidia{index}", NVIDIA_MAJOR, index) if index >= 0 else None
        node = _node_of(d, default, stat)
        if node is not None:
            out[d["uuid"]] = node
        for m in d.get("mig") or ():
            if isinstance(m, dict) and m.get("uuid"):
                mnode = _node_of(m, None, stat)
                if mnode is not None:
                    out[m["uuid"]] = mnode
                cnode = _node_of({"device": m.get("compute_device")}, None, stat)
                if cnode is not None:
                    out[m["uuid"] + COMPUTE_SUFFIX] = cnode
    return out


def read_char_majors(path: str = PROC_DEVICES) -> dict[str, int]:
    """``{driver name: major}`` of the character devices listed in ``/proc/devices``."""
    out: dict[str, int] = {}
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            text = f.read()
    except OSError:
        return out
    section = ""
    for raw in text.splitlines():
        line = raw.strip()
        if line.endswith(":"):
            section = line
            continue
        if section.startswith("Character") and line:
            num, _, name = line.partition(" ")
            if num.isdigit() and name.strip():
                out.setdefault(name.strip(), int(num))
    return out


def uvm_major(path: str = PROC_DEVICES) -> int | None:
    """The major number of ``nvidia-uvm`` (dynamic, so read from ``/proc/devices``); None without the driver."""
    return read_char_majors(path).get("nvidia-uvm")


def control_nodes(uvm: int | None = None) -> list[DeviceNode]:
    """The nodes every CUDA process needs besides its GPU's: nvidiactl, nvidia-modeset and,
    where the driver is loaded (``uvm`` major known), nvidia-uvm and nvidia-uvm-tools."""
    nodes = [DeviceNode("/dev/nvidiactl", NVIDIA_MAJOR, NVIDIACTL_MINOR),
             DeviceNode("/dev/nvidia-modeset", NVIDIA_MAJOR, MODESET_MINOR)]
    if uvm is not None and uvm >= 0:
        nodes += [DeviceNode("/dev/nvidia-uvm", uvm, 0), DeviceNode("/dev/nvidia-uvm-tools", uvm, 1)]
    return nodes


def lease_holds(lease: dict[str, Any] | None) -> bool:
    """True when the lease (its JSON) holds GPUs now: active, with a placement."""
    return bool(lease) and lease.get("state") == "active" and bool((lease.get("placement") or {}).get("slices"))


def lease_nodes(lease: dict[str, Any] | None, pool_nodes: dict[str, DeviceNode], *,
                uvm: int | None = None) -> list[DeviceNode]:
    """The nodes a lease allows: each slice's GPU node (and its MIG instance's node), plus
    :func:`control_nodes` when the lease holds something; nothing for an ended or queued lease."""
    return leases_nodes([lease] if lease else [], pool_nodes, uvm=uvm)


def leases_nodes(leases: Iterable[dict[str, Any]], pool_nodes: dict[str, DeviceNode], *,
                 uvm: int | None = None) -> list[DeviceNode]:
    """:func:`lease_nodes` of several leases (a server's own and those it took itself), without repeats."""
    out: list[DeviceNode] = []
    holds = False
    for lease in leases:
        if not lease_holds(lease):
            continue
        holds = True
        for s in lease["placement"]["slices"]:
            mig = s.get("mig_uuid")
            for u in (s.get("gpu_uuid"), mig, mig and mig + COMPUTE_SUFFIX):
                node = pool_nodes.get(u) if u else None
                if node is not None and node not in out:
                    out.append(node)
    if holds:
        out += [n for n in control_nodes(uvm) if n not in out]
    return out


def denied_nodes(allowed: Iterable[DeviceNode], pool_nodes: dict[str, DeviceNode], *,
                 uvm: int | None = None) -> list[DeviceNode]:
    """Every GPU node of the pool that ``allowed`` leaves out; with nothing allowed, the control
    nodes too (a server without a lease gets no CUDA at all)."""
    allowed = list(allowed)
    out = [n for n in dict.fromkeys(pool_nodes.values()) if n not in allowed]
    if not allowed:
        out += [n for n in control_nodes(uvm) if n not in out]
    return out


def systemd_device_allow(nodes: Iterable[DeviceNode]) -> list[str]:
    """``DeviceAllow=`` values for the nodes: ``["/dev/nvidia0 rw", ...]``."""
    return [f"{n.path} rw" for n in dict.fromkeys(nodes)]


def _rule(n: DeviceNode) -> str:
    return f"c {n.major}:{n.minor} rwm"


def v1_rules(allowed: Iterable[DeviceNode], denied: Iterable[DeviceNode]) -> tuple[list[str], list[str]]:
    """``(devices.allow lines, devices.deny lines)`` in the v1 syntax, ``"c 195:0 rwm"``.

    Unresolved nodes are left out; a node both allowed and denied is allowed.
    """
    allow = list(dict.fromkeys(_rule(n) for n in allowed if n.resolved))
    deny = [r for r in dict.fromkeys(_rule(n) for n in denied if n.resolved) if r not in allow]
    return allow, deny
