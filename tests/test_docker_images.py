"""Keeping the environments' images warm: the hub pulls them at its start and on a schedule.

Against the private Docker daemon and the local registry of tests/dockerhost.py: an image pushed
to the registry and removed from the host is on the host again after the hub's start step
(:meth:`GPULeaseDockerSpawner.engine_at_hub_start`, with the hub's config), and a pull that fails
is logged and tried again at the next round.
"""

from __future__ import annotations

import asyncio
import logging
import secrets

import pytest
from traitlets.config import Config

import dockerhost
from jupyter_gpulease.hub.docker import GPULeaseDockerSpawner, ImagePuller, split_reference

pytestmark = [pytest.mark.timeout(600), dockerhost.requires_docker()]


def test_split_reference_follows_dockers_rules():
    assert split_reference("lab/torch") == ("lab/torch", "latest")
    assert split_reference("127.0.0.1:5000/lab/torch:2.5") == ("127.0.0.1:5000/lab/torch", "2.5")
    assert split_reference("127.0.0.1:5000/lab/torch") == ("127.0.0.1:5000/lab/torch", "latest")
    assert split_reference("lab/torch@sha256:abc") == ("lab/torch", "sha256:abc")


class Hub:
    """What the start step reads of the hub: its config and its log."""

    def __init__(self, config: Config):
        self.config = config
        self.log = logging.getLogger("test-hub")


def test_the_hub_start_pulls_every_environments_image_and_a_failed_pull_is_logged(caplog):
    dockerhost.require()
    sock = dockerhost.ensure_dockerd()
    ref = dockerhost.push_to_registry(dockerhost.ensure_test_image(), f"warm/notebook-{secrets.token_hex(3)}")
    dockerhost.remove_image(ref)
    assert not dockerhost.image_exists(ref)
    missing = f"{dockerhost.ensure_registry()}/warm/not-there:1"

    c = Config()
    c.JupyterHub.spawner_class = "gpulease-docker"
    c.DockerSpawner.client_kwargs = {"base_url": sock}
    c.GPULeaseDockerSpawner.environments = [
        {"name": "nb", "display_name": "Notebook", "image": ref},
        {"name": "gone", "display_name": "Not in the registry", "image": missing},
    ]
    c.GPULeaseDockerSpawner.image_refresh_interval = 0  # one round: at the start
    hub = Hub(c)

    async def start() -> ImagePuller:
        GPULeaseDockerSpawner.engine_at_hub_start(hub)
        puller = hub.gpulease_image_puller
        await asyncio.wait_for(puller.task, 300)
        return puller

    with caplog.at_level(logging.INFO, logger="test-hub"):
        puller = asyncio.run(start())
    assert dockerhost.image_exists(ref)
    assert ref in puller.pulled and missing not in puller.pulled
    assert any(f"Could not pull the image {missing}" in r.getMessage() for r in caplog.records)
    assert any(f"Image {ref} is on this host" in r.getMessage() for r in caplog.records)
    dockerhost.remove_image(ref)


def test_no_puller_without_environments_or_when_turned_off():
    c = Config()
    c.GPULeaseDockerSpawner.environments = [{"name": "nb", "display_name": "Notebook", "image": "lab/nb:1"}]
    c.GPULeaseDockerSpawner.warm_images = False
    hub = Hub(c)
    GPULeaseDockerSpawner.engine_at_hub_start(hub)
    assert not hasattr(hub, "gpulease_image_puller")
    hub = Hub(Config())
    GPULeaseDockerSpawner.engine_at_hub_start(hub)
    assert not hasattr(hub, "gpulease_image_puller")
