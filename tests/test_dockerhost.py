"""The private Docker host the Docker engine's tests run on (dockerhost.py), checked for real.

dockerd answers on its own socket (overlay2, cgroupfs); the test image runs the single-user
server's commands on the host's network; a device given to a container with Docker's ``m``
permission only (``--device NODE:/dev/nvidia0:m``) cannot be opened until a ``c 195:N rw``
rule is written into the container's own devices cgroup (cgroup v1, ``/docker/<id>``), and
cannot again once the rule is denied, with no restart: the mechanism the engine grants and
revokes GPUs with. An image pushed to the private registry and removed here is pulled back.

Skipped with the reason where the machine cannot run them (not root, no docker.io,
docker-registry or debootstrap, no cgroup v1 devices controller); failed instead in CI.
"""

from __future__ import annotations

import os
import secrets
import stat
import time
from pathlib import Path

import pytest

import dockerhost

pytestmark = [dockerhost.requires_docker(), pytest.mark.timeout(900)]

MINOR = 247  # a high minor of NVIDIA's major 195: no real GPU of a host is ever in the way
OPEN = """
import errno, os
try:
    os.close(os.open("/dev/nvidia0", os.O_RDWR))
    print("opened")
except OSError as e:
    print(errno.errorcode[e.errno])
"""


@pytest.fixture(scope="module")
def client():
    dockerhost.require()
    c = dockerhost.docker_client()
    yield c
    c.close()


@pytest.fixture(scope="module")
def image(client) -> str:
    return dockerhost.ensure_test_image()


def run(client, image: str, command: list[str], **kw) -> str:
    out = client.containers.run(image, command, network_mode="host", remove=True, stdout=True, stderr=True, **kw)
    return out.decode().strip()


def test_daemon_answers(client):
    assert client.ping()
    info = client.info()
    assert info["Driver"] == "overlay2"
    assert info["CgroupDriver"] == "cgroupfs"
    assert dockerhost.socket_url().startswith("unix://") and dockerhost.socket_url().endswith("/docker.sock")
    assert client.version()["ApiVersion"]


def test_image_runs_the_single_user_server(client, image):
    assert run(client, image, ["jupyterhub-singleuser", "--version"])[0].isdigit()
    assert run(client, image, ["python", "-c", "import jupyter_gpulease, ipykernel, jupyter_server; print('ok')"]) == "ok"
    assert "usage: cuda-checkpoint --action" in run(client, image, ["cuda-checkpoint", "--help"])
    assert run(client, image, ["sh", "-c", "command -v cuda-checkpoint; id -u; id -un"]).split() == [
        "/usr/local/bin/cuda-checkpoint", "1000", "jovyan"]
    assert client.images.get(image).labels[dockerhost.LABEL] == image.rsplit(":", 1)[1]


def _open(container) -> str:
    code, out = container.exec_run(["python", "-c", OPEN])
    assert code == 0, out
    return out.decode().strip()


def test_device_cgroup_grants_and_revokes_without_restart(client, image, tmp_path: Path):
    node = tmp_path / "nvidia-test"
    os.mknod(node, stat.S_IFCHR | 0o666, os.makedev(195, MINOR))
    os.chmod(node, 0o666)  # past the umask: only the devices cgroup may refuse the server's user
    # "m" alone (mknod, no read or write) is a permission string Docker accepts for --device
    container = client.containers.run(image, ["sleep", "infinity"], detach=True, network_mode="host",
                                      devices=[f"{node}:/dev/nvidia0:m"])
    try:
        container.reload()
        assert container.attrs["HostConfig"]["Devices"] == [
            {"PathOnHost": str(node), "PathInContainer": "/dev/nvidia0", "CgroupPermissions": "m"}]
        pid = container.attrs["State"]["Pid"]
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
        (path,) = [line.split(":", 2)[2] for line in lines if line.split(":", 2)[1] == "devices"]
        assert path == f"/docker/{container.id}"  # cgroupfs driver, default parent
        cgroup = Path("/sys/fs/cgroup/devices") / path.lstrip("/")
        assert f"c 195:{MINOR} m" in cgroup.joinpath("devices.list").read_text().splitlines()

        assert _open(container) == "EPERM"  # the node is there; the cgroup refuses the open
        cgroup.joinpath("devices.allow").write_text(f"c 195:{MINOR} rw")
        assert _open(container) == "ENXIO"  # allowed: the open reaches the (absent) driver
        cgroup.joinpath("devices.deny").write_text(f"c 195:{MINOR} rw")
        assert _open(container) == "EPERM"  # revoked again, the same container
        container.reload()
        assert container.status == "running" and container.attrs["State"]["Pid"] == pid
    finally:
        container.remove(force=True)


def test_pull_from_the_private_registry(client, image):
    """An image of a layer of its own (on the test image's) pushed, removed here, and pulled back:
    its own layer comes over the wire, the shared ones are found here."""
    registry = dockerhost.ensure_registry()
    assert registry.startswith("127.0.0.1:")
    token = secrets.token_hex(4)
    maker = client.containers.run(image, ["sh", "-c", f"echo {token} > /home/jovyan/pull-test"], detach=True, network_mode="host")
    try:
        assert maker.wait(timeout=60)["StatusCode"] == 0
        own = maker.commit()
    finally:
        maker.remove(force=True)
    name = f"gpulease-pulltest-{os.environ.get('PYTEST_XDIST_WORKER', 'main')}:{token}"
    ref = dockerhost.push_to_registry(own.id, name)
    assert ref == f"{registry}/{name}"
    dockerhost.remove_image(ref)  # its only tag: the image and its own layer are gone
    assert not dockerhost.image_exists(ref) and not dockerhost.image_exists(own.id)
    t0 = time.monotonic()
    progress = list(client.api.pull(ref, stream=True, decode=True))
    took = time.monotonic() - t0
    try:
        statuses = [p.get("status", "") for p in progress]
        assert "Pull complete" in statuses, progress  # a layer came from the registry
        pulled = client.images.get(ref)
        assert pulled.id == own.id
        print(f"pulled {ref} ({pulled.attrs['Size'] / 1e6:.0f} MB, {statuses.count('Pull complete')} layer(s) "
              f"transferred, {statuses.count('Already exists')} found here) in {took:.1f} s")
        assert run(client, ref, ["cat", "/home/jovyan/pull-test"]) == token
    finally:
        dockerhost.remove_image(ref)
