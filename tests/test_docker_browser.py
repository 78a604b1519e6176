"""Environments of GPULeaseDockerSpawner in the browser: a pull on the spawn page, and an image the
driver cannot run, not offered.

One real JupyterHub with the broker and GPULeaseDockerSpawner on the private Docker host (as
``test_docker_e2e.docker_hub`` builds it), whose pool's node declares its driver (550.54.15,
CUDA 12.4 at most), and two environments:

- ``notebook`` (CUDA 12.4): an image only the local registry holds. It is the test image with
  one more layer of a few MB of random bytes, built and pushed here, then removed from the
  Docker host, so that its first start must download that layer;
- ``cuda128`` (CUDA 12.8): the test image, which this driver cannot run.

alice logs in with headless Chromium. The spawn form offers ``notebook`` saying what its first
start downloads (the size its registry gives) and shows ``cuda128`` disabled with the reason.
She starts ``notebook`` on an L4: the spawn page's event log shows the image's download, then the
grant of the GPU lease (the pull comes first, so it costs no lease time), and the server becomes
ready with the image now on the host. A spawn of ``cuda128`` through the REST API is refused
with the reason, and no lease is asked for.

The screenshots docs/images/docker-*.png are taken here. Needs root, Docker and cgroup v1, and
Chromium (see test_docker_e2e and conftest).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import secrets
import time

import pytest

import dockerhost
from browserutil import ARTIFACTS, ROOT, card, chromium_browser
from hubharness import wait_for
from jupyter_gpulease.hub.environments import needs_newer_driver, parse_environments, registry_download_size, size_words
from test_docker_e2e import close, docker_hub

pytestmark = [pytest.mark.timeout(600), dockerhost.requires_docker()]

IMAGES = ROOT / "docs" / "images"
FAILED = ARTIFACTS / "docker-failed"
VIEWPORT = {"width": 1280, "height": 900}
DRIVER = {"cuda_version": "12.4", "driver_version": "550.54.15"}
LAYER_BYTES = 8 * 1024 * 1024  # random: the compressed layer is as large
CHOICE = "gpu:1:L4"
STATUS = ".gpulease-status:not(.gpulease-env-misfit)"  # an environment card's status (not its hidden note for a GPU it does not suit)


def build_image_to_pull(tmp) -> str:
    """The test image with a layer of random bytes, pushed to the local registry under a new name
    and removed from the Docker host (both tags: the new layer is gone from it); its reference."""
    base = dockerhost.ensure_test_image()
    ctx = tmp / "pull-context"
    ctx.mkdir()
    (ctx / "payload.bin").write_bytes(secrets.token_bytes(LAYER_BYTES))
    (ctx / "Dockerfile").write_text(f"FROM {base}\nCOPY payload.bin /opt/gpulease-test/payload.bin\n")
    local = f"gpulease-pull-test:{secrets.token_hex(4)}"
    dockerhost.docker("build", "--network", "host", "-q", "-t", local, str(ctx), timeout=300)
    ref = dockerhost.push_to_registry(local, f"lab/notebook-{secrets.token_hex(4)}")
    dockerhost.remove_image(ref)
    dockerhost.remove_image(local)
    assert not dockerhost.image_exists(ref)
    return ref


@pytest.fixture(scope="module")
def env_hub(tmp_path_factory):
    """(hub, the reference of the image to pull, the environments as the hub lists them)."""
    dockerhost.require()
    tmp = tmp_path_factory.mktemp("docker-browser")
    ref = build_image_to_pull(tmp)
    environments = [
        {"name": "notebook", "display_name": "Notebook (CUDA 12.4)", "image": ref, "cuda": "12.4",
         "description": "Pulled from the lab's registry on its first start"},
        {"name": "cuda128", "display_name": "Notebook (CUDA 12.8)", "image": dockerhost.ensure_test_image(), "cuda": "12.8"},
    ]
    hub, _sim, _nodes, _standin = docker_hub(
        tmp, users=("alice",), pool_keys=DRIVER,
        hub_config=[f"c.GPULeaseDockerSpawner.environments = {environments!r}",
                    # the spawn pulls the image, not the hub at its start
                    "c.GPULeaseDockerSpawner.warm_images = False"],
    )
    try:
        yield hub, ref, environments
    finally:
        try:
            close(hub)
        finally:
            dockerhost.remove_image(ref)


def progress_log(page) -> list[str]:
    return [t.strip() for t in page.locator("#progress-log .progress-log-event").all_inner_texts()]


def first(log: list[str], says) -> int:
    """Where the first line of the spawn page's log that ``says`` is."""
    found = [i for i, m in enumerate(log) if says(m)]
    assert found, f"no such line in the spawn page's log: {log}"
    return found[0]


def test_a_missing_image_is_pulled_before_the_lease_with_its_progress_on_the_spawn_page(env_hub, playwright_sync_api, chromium):
    hub, ref, _ = env_hub
    IMAGES.mkdir(parents=True, exist_ok=True)
    name = ref.split("/", 1)[1]  # lab/notebook-…, as the pull's messages name it
    registry_size = asyncio.run(registry_download_size(ref))
    assert registry_size and registry_size > LAYER_BYTES, registry_size
    try:
        with chromium_browser(playwright_sync_api, chromium, failed=FAILED / "pull") as browser:
            page = browser.login(hub, "alice", **VIEWPORT)
            notebook = page.locator("label.gpulease-env:has(input[value=notebook])")
            assert "CUDA 12.4" in notebook.inner_text()
            assert notebook.locator(STATUS).inner_text() == f"first start downloads up to ~{size_words(registry_size)}"
            assert page.locator("input[name=environment][value=notebook]").is_enabled()
            not_offered = page.locator("label.gpulease-env:has(input[value=cuda128])")
            assert "not offered here: needs CUDA 12.8" in not_offered.inner_text()
            page.screenshot(path=str(IMAGES / "docker-01-environments-on-the-spawn-form.png"), full_page=True)

            # she chooses the environment and an L4, and starts
            page.check("input[name=environment][value=notebook]")
            page.check(f'input[name=choice][value="{CHOICE}"]')
            assert "1 × L4" in card(page, CHOICE).inner_text()
            page.click("#spawn_form [type=submit]")
            page.wait_for_url("**/hub/spawn-pending/alice**")
            page.locator("#progress-details summary").click()  # "Event log"

            # the log, read as it grows (the page goes to the server once it is ready)
            seen: list[str] = []

            def granted() -> bool:
                if "/spawn-pending/" not in page.url:
                    raise AssertionError(f"the page left the spawn page before showing the grant; its log: {seen}")
                now = progress_log(page)
                seen[:] = now if len(now) >= len(seen) else seen
                return any(" granted: " in m for m in seen)

            wait_for(granted, 180, "the spawn page never said the GPU lease was granted", interval=0.1)
            shot = IMAGES / "docker-02-spawn-page-shows-the-pull.png"
            page.screenshot(path=str(shot), full_page=True)
            shown = progress_log(page)  # what the screenshot shows

            start = first(seen, lambda m: m == f"Downloading the image {ref}: starting")
            downloaded = first(seen, lambda m: re.fullmatch(rf"Downloaded the image {re.escape(ref)} in \d+ s", m))
            grant = first(seen, lambda m: " granted: " in m)
            assert start < downloaded < grant, seen
            # Docker's own steps in between: the new layer's download, then the image done
            steps = seen[start + 1:downloaded]
            # (a layer this small may be down between two of Docker's progress events: its download
            # or its extraction, whichever the page was shown)
            assert any(m.startswith((f"Downloading image {name}", f"Extracting image {name}")) for m in steps), steps
            assert any(re.fullmatch(rf"Downloaded image {re.escape(name)}( \(\d+ MB\))?", m) for m in steps), steps
            # the lease was asked for only after the download
            asking = first(seen, lambda m: m.startswith("Asking for "))
            assert downloaded < asking < grant, seen
            assert any(m.startswith("Downloaded the image") for m in shown) and any(" granted: " in m for m in shown), shown

            hub.wait_ready("alice", timeout=180)
            page.wait_for_url("**/user/alice/**", timeout=120_000)
        assert dockerhost.image_exists(ref)
        [lease] = hub.leases("alice", "active")
        assert lease["request"]["gpus"] == 1
    finally:
        # the next test spawns for her again (a failure here must not hide the test's own)
        with contextlib.suppress(Exception):
            if hub.server_model("alice") is not None:
                hub.stop_server("alice", timeout=120)


def test_an_image_that_needs_a_newer_cuda_than_the_driver_is_not_offered_and_its_spawn_is_refused(env_hub, playwright_sync_api, chromium):
    hub, _, environments = env_hub
    cuda128 = next(e for e in parse_environments(environments) if e.name == "cuda128")
    reason = needs_newer_driver(cuda128, DRIVER["cuda_version"], driver_version=DRIVER["driver_version"])
    assert "CUDA 12.8" in reason and "CUDA 12.4" in reason and "550.54.15" in reason, reason
    before = {le["id"] for le in hub.leases("alice")}

    with chromium_browser(playwright_sync_api, chromium, failed=FAILED / "not-offered") as browser:
        page = browser.login(hub, "alice", **VIEWPORT)
        label = page.locator("label.gpulease-env:has(input[value=cuda128])")
        assert page.locator("input[name=environment][value=cuda128]").is_disabled()
        assert "gpulease-disabled" in (label.get_attribute("class") or "")
        assert label.locator(STATUS).inner_text() == f"not offered here: {reason}"

    t0 = time.monotonic()
    status, body = hub.spawn("alice", {"gpus": 1, "environment": "cuda128"})
    assert status == 400, (status, body)
    assert time.monotonic() - t0 < 10  # refused at once, not after a wait
    assert body["message"] == f"Invalid environment: environment 'cuda128' cannot be used: {reason}; choose another: notebook", body
    # the hub keeps no server for her, and the broker has no new lease of hers
    wait_for(lambda: hub.server_model("alice") is None, 30, "the failed spawn left a server")
    after = hub.leases("alice")
    assert {le["id"] for le in after} == before, after
    assert not hub.leases("alice", "active") and not hub.leases("alice", "queued")
