"""The container GPULeaseDockerSpawner makes, through DockerSpawner's own create_object(), on a real daemon.

The container is created (not started) on the private Docker daemon of tests/dockerhost.py and read
back with ``docker inspect``: every GPU node of the start with permission ``m`` only, the admin's
own ``extra_host_config`` kept (and given back after the call), and on NVIDIA hosts the lease's
GPUs as a ``DeviceRequest`` with their UUIDs, which is what NVIDIA's container toolkit reads.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import stat
import types

import pytest

import dockerhost
from jupyter_gpulease.hub.cgroups import DeviceStart
from jupyter_gpulease.hub.docker import GPULeaseDockerSpawner

pytestmark = [pytest.mark.timeout(300), dockerhost.requires_docker()]

LEASE = {"id": "L1", "state": "active", "placement": {"node": "n1", "slices": [
    {"gpu_uuid": "GPU-11111111-2222-3333-4444-555555555555", "node": "n1", "model": "H100", "share": 1.0, "memory_mib": 81559}]}}


def test_the_container_gets_every_node_with_mknod_only_and_the_leases_uuids_as_a_device_request(tmp_path):
    dockerhost.require()
    sock = dockerhost.ensure_dockerd()
    image = dockerhost.ensure_test_image()
    nodes = []
    for i in range(2):
        p = tmp_path / f"nvidia{i}"
        os.mknod(p, stat.S_IFCHR | 0o666, os.makedev(195, 250 + i))
        nodes.append(str(p))
    name = f"gpulease-create-{secrets.token_hex(3)}"
    admin = {"shm_size": "64m", "devices": ["/dev/null:/dev/admin-null:rwm"]}
    hub = types.SimpleNamespace(public_host="", api_url="http://127.0.0.1:8081/hub/api", base_url="/hub/", url="http://127.0.0.1:8081/hub/")
    s = GPULeaseDockerSpawner(user=types.SimpleNamespace(name="alice", groups=[], url="/user/alice/"), hub=hub,
                              client_kwargs={"base_url": sock}, image=image, gpu_device_requests="always",
                              extra_host_config=admin, name_template=name)
    s.apply_placement(LEASE)
    s.device_start = DeviceStart(devices=tuple(f"{n}:{n}:m" for n in nodes))
    client = dockerhost.docker_client()
    try:
        created = asyncio.run(s.create_object())
        info = client.api.inspect_container(created["Id"])
        host = info["HostConfig"]
        got = {(d["PathOnHost"], d["PathInContainer"], d["CgroupPermissions"]) for d in host["Devices"]}
        assert got == {(n, n, "m") for n in nodes} | {("/dev/null", "/dev/admin-null", "rwm")}, got
        assert host["DeviceRequests"] == [{"Driver": "nvidia", "Count": 0, "DeviceIDs": [LEASE["placement"]["slices"][0]["gpu_uuid"]],
                                           "Capabilities": [["gpu"]], "Options": {}}], host["DeviceRequests"]
        assert host["ShmSize"] == 64 * 1024 * 1024
        assert s.extra_host_config == admin  # the admin's setting is back after the call
        env = dict(e.split("=", 1) for e in info["Config"]["Env"])
        assert env["GPULEASE_ENGINE"] == "docker" and env["CUDA_VISIBLE_DEVICES"] == LEASE["placement"]["slices"][0]["gpu_uuid"]
    finally:
        for c in client.containers.list(all=True, filters={"name": name}):
            c.remove(force=True)
