"""Environments: the admin's images checked, the driver's CUDA rule, what the form offers, the
check of a spawn's choice, Docker's pull stream in words, and an image's size from its registry."""

from __future__ import annotations

import asyncio
import itertools
import json
import re

import pytest
import tornado.httpserver
import tornado.netutil
import tornado.web

from jupyter_gpulease.hub.environments import (
    MANIFEST_LIST_TYPES,
    MANIFEST_TYPES,
    Environment,
    EnvironmentOffer,
    PullProgress,
    check_choice,
    driver_cuda_words,
    image_parts,
    manifests_url,
    needs_newer_driver,
    offers,
    parse_cuda,
    parse_environments,
    registry_download_size,
)
from jupyter_gpulease.hub.options import OptionsError

RAW = [
    {"name": "torch", "display_name": "PyTorch 2.5", "image": "127.0.0.1:5000/lab/torch:2.5-cuda12.4", "cuda": "12.4",
     "default": True, "description": "PyTorch with CUDA 12.4"},
    {"name": "jax", "display_name": "JAX", "image": "lab/jax:0.4-cuda12.8", "cuda": "12.8", "models": ["H100*", "H200*"]},
    {"name": "big", "display_name": "Big models", "image": "lab/big:1", "cuda": "12.2", "models": ["A100*"], "cpu_only_ok": False,
     "size_bytes": 9_400_000_000},
    {"name": "plain", "display_name": "Python only", "image": "python:3.12-slim"},
]


def envs():
    return parse_environments(RAW)


# --------------------------------------------------------------------------- the admin's list
def test_the_admins_list_is_read_with_defaults():
    torch, jax, big, plain = envs()
    assert torch == Environment(name="torch", display_name="PyTorch 2.5", image="127.0.0.1:5000/lab/torch:2.5-cuda12.4", cuda="12.4",
                                description="PyTorch with CUDA 12.4", default=True)
    assert jax.models == ("H100*", "H200*") and jax.cpu_only_ok and jax.size_bytes is None
    assert big.size_bytes == 9_400_000_000 and not big.cpu_only_ok
    assert plain.cuda == "" and plain.display_name == "Python only" and not plain.default
    assert parse_environments([{"name": "x", "image": "x"}])[0].display_name == "x"
    assert parse_environments(None) == []


@pytest.mark.parametrize("entries, words", [
    ([{"name": "torch", "image": "lab/torch", "cude": "12.4"}], re.escape("environments[0] ('torch'): unknown key(s) 'cude'")),
    ([{"name": "torch", "image": "lab/torch", "cuda": "twelve"}],
     re.escape("environments[0] ('torch'): 'cuda': a CUDA version is major.minor such as '12.4', got 'twelve'")),
    ([{"name": "torch", "image": "lab/torch", "cuda": 12.1}], "'cuda': .*write it as a string"),
    ([{"name": "torch", "image": "lab/torch", "cuda": "12"}], "'cuda': a CUDA version is major.minor"),
    ([{"name": "a", "image": "x"}, {"name": "a", "image": "y"}], r"environments\[1\] \('a'\): 'name' 'a' is used twice"),
    ([{"name": "a", "image": "x", "default": True}, {"name": "b", "image": "y", "default": True}], "more than one has 'default': True"),
    ([{"name": "a", "image": ""}], r"environments\[0\] \('a'\): 'image' must name a Docker image"),
    ([{"name": "a"}], r"environments\[0\] \('a'\): 'image' must name a Docker image"),
    ([{"name": "a", "image": "Lab/Torch:2"}], r"'image': .*lower-case"),
    ([{"name": "has space", "image": "x"}], r"environments\[0\] \('has space'\): 'name' must be a short name"),
    ([{"name": "a", "image": "x", "models": "A100*"}], "'models' must be a list of GPU model patterns"),
    ([{"name": "a", "image": "x", "size_bytes": -1}], "'size_bytes' must be"),
    ([{"name": "a", "image": "x", "default": "yes"}], "'default' must be true or false"),
    (["torch"], r"environments\[0\] must be a dict"),
    ({"name": "a"}, "environments must be a list"),
])
def test_a_wrong_entry_is_named_with_its_field(entries, words):
    with pytest.raises(ValueError, match=words):
        parse_environments(entries)


# --------------------------------------------------------------------------- CUDA and the driver
def test_cuda_versions_and_nvmls_integer():
    assert parse_cuda("12.4") == (12, 4)
    assert parse_cuda(" 11.8.0 ") == (11, 8)
    assert parse_cuda("12.10") > parse_cuda("12.9")
    assert driver_cuda_words(12040) == "12.4"
    assert driver_cuda_words(12080) == "12.8"
    assert driver_cuda_words(11020) == "11.2"
    assert driver_cuda_words(12100) == "12.10"


def test_an_image_needing_a_newer_cuda_than_the_driver_says_why():
    torch, jax, _, plain = envs()
    assert needs_newer_driver(torch, "12.4") == ""
    assert needs_newer_driver(torch, "12.6") == ""
    assert needs_newer_driver(jax, "12.4", driver_version="550.54.15") == (
        "needs CUDA 12.8; the GPUs' driver (550.54.15) supports CUDA 12.4 at most")
    assert needs_newer_driver(jax, "12.4") == "needs CUDA 12.8; the GPUs' driver supports CUDA 12.4 at most"
    assert needs_newer_driver(torch, "11.8") != ""  # an older major version
    assert needs_newer_driver(plain, "11.0") == ""  # no CUDA in the image
    # an unknown driver offers everything
    assert needs_newer_driver(jax, None) == "" and needs_newer_driver(jax, "") == "" and needs_newer_driver(jax, "garbled") == ""


# --------------------------------------------------------------------------- offers
def test_offers_say_what_is_ready_what_downloads_and_what_cannot_run_here():
    got = {o.env.name: o for o in offers(envs(), driver_cuda="12.4", driver_version="550.54.15",
                                         present={"127.0.0.1:5000/lab/torch:2.5-cuda12.4"}, sizes={"python:3.12-slim": 1_234_000_000})}
    assert got["torch"].offered and got["torch"].present and got["torch"].ready_words == "ready"
    assert got["torch"].download_bytes == 0
    assert not got["jax"].offered and "needs CUDA 12.8" in got["jax"].reason and "550.54.15" in got["jax"].reason
    assert got["jax"].ready_words == "first start downloads the image"
    assert got["big"].offered and got["big"].download_bytes == 9_400_000_000  # the declared size: the registry gave none
    assert got["big"].ready_words == "first start downloads up to ~9.4 GB"
    assert got["plain"].ready_words == "first start downloads up to ~1.2 GB"
    assert got["jax"].cuda_words == "CUDA 12.8" and got["jax"].models_words == "for H100*, H200* GPUs"
    assert got["plain"].cuda_words == "no CUDA"


def test_offers_for_a_model_leave_out_images_made_for_others_and_an_unknown_driver_offers_all():
    got = {o.env.name: o for o in offers(envs(), driver_cuda=None, present=None, sizes={}, model="L4")}
    assert got["torch"].offered and got["plain"].offered
    assert not got["jax"].offered and got["jax"].reason == "made for H100*, H200* GPUs, not L4"
    assert not got["big"].offered
    assert got["torch"].present is None and got["torch"].ready_words == "the first start may download the image"
    # a glob asked for covers the model an image is made for
    got = {o.env.name: o for o in offers(envs(), driver_cuda="12.8", present=set(), sizes={}, model="H100*")}
    assert got["jax"].offered and not got["big"].offered
    got = {o.env.name: o for o in offers(envs(), driver_cuda="12.8", present=set(), sizes={}, model="H100-SXM5-80GB")}
    assert got["jax"].offered


def test_ready_words():
    e = Environment("x", "X", "x")
    assert EnvironmentOffer(e, True, present=True).ready_words == "ready"
    assert EnvironmentOffer(e, True, present=False, download_bytes=310_000_000).ready_words == "first start downloads up to ~310 MB"
    assert EnvironmentOffer(e, True, present=False, download_bytes=None).ready_words == "first start downloads the image"


# --------------------------------------------------------------------------- a spawn's choice
def test_a_spawns_choice_is_checked_before_its_lease():
    ok = dict(driver_cuda="12.4", driver_version="550.54.15")
    assert check_choice(envs(), "torch", model="A100-SXM4-80GB", cpu_only=False, **ok).name == "torch"
    assert check_choice(envs(), "", model=None, cpu_only=False, **ok).name == "torch"  # the default
    with pytest.raises(OptionsError) as e:
        check_choice(envs(), "tensorflow", model=None, cpu_only=False, **ok)
    assert e.value.field == "environment"
    assert e.value.message == "unknown environment 'tensorflow'; choose one of: torch, jax, big, plain"
    with pytest.raises(OptionsError) as e:
        check_choice(envs(), "jax", model="H100-SXM5-80GB", cpu_only=False, **ok)
    assert e.value.message == ("environment 'jax' cannot be used: needs CUDA 12.8; the GPUs' driver (550.54.15) supports "
                               "CUDA 12.4 at most; choose another: torch, plain")
    with pytest.raises(OptionsError) as e:
        check_choice(envs(), "big", model="L4", cpu_only=False, **ok)
    assert e.value.message == "environment 'big' cannot be used: made for A100* GPUs, not L4; choose another: torch, plain"
    # a CPU-only server: no driver or model check, but an image that needs a GPU is refused
    assert check_choice(envs(), "jax", model=None, cpu_only=True, **ok).name == "jax"
    with pytest.raises(OptionsError, match="'big' cannot be used: needs a GPU, and this server has none"):
        check_choice(envs(), "big", model=None, cpu_only=True, **ok)


def test_no_choice_takes_the_default_or_the_first_that_can_run():
    raw = [{"name": "new", "image": "lab/new", "cuda": "12.8", "default": True}, {"name": "old", "image": "lab/old", "cuda": "11.8"}]
    assert check_choice(parse_environments(raw), "", model=None, driver_cuda="12.4", cpu_only=False).name == "old"
    with pytest.raises(OptionsError, match="no environment can be used with this choice"):
        check_choice(parse_environments(raw[:1]), "", model=None, driver_cuda="12.4", cpu_only=False)


# --------------------------------------------------------------------------- image references
@pytest.mark.parametrize("ref, parts", [
    ("ubuntu", ("docker.io", "library/ubuntu", "latest")),
    ("ubuntu:22.04", ("docker.io", "library/ubuntu", "22.04")),
    ("lab/torch:2.5-cuda12.4", ("docker.io", "lab/torch", "2.5-cuda12.4")),
    ("docker.io/ubuntu", ("docker.io", "library/ubuntu", "latest")),
    ("index.docker.io/lab/torch", ("docker.io", "lab/torch", "latest")),
    ("127.0.0.1:5000/lab/torch:2.5-cuda12.4", ("127.0.0.1:5000", "lab/torch", "2.5-cuda12.4")),
    ("localhost/lab/torch", ("localhost", "lab/torch", "latest")),
    ("ghcr.io/org/team/img:v1", ("ghcr.io", "org/team/img", "v1")),
    ("nvcr.io/nvidia/pytorch:24.05-py3", ("nvcr.io", "nvidia/pytorch", "24.05-py3")),
    ("registry:5000/x", ("registry:5000", "x", "latest")),
    ("ubuntu@sha256:" + "a" * 64, ("docker.io", "library/ubuntu", "sha256:" + "a" * 64)),
    ("ubuntu:22.04@sha256:" + "b" * 64, ("docker.io", "library/ubuntu", "sha256:" + "b" * 64)),
])
def test_image_parts_follow_dockers_rules(ref, parts):
    assert image_parts(ref) == parts


@pytest.mark.parametrize("ref", ["", "Ubuntu", "lab/torch:", "lab//torch", "ubuntu@sha256:short", "lab/torch:bad tag"])
def test_image_parts_refuse_what_docker_refuses(ref):
    with pytest.raises(ValueError):
        image_parts(ref)


def test_manifests_urls():
    assert manifests_url("docker.io", "library/ubuntu") == "https://registry-1.docker.io/v2/library/ubuntu/manifests/"
    assert manifests_url("127.0.0.1:5000", "lab/torch") == "http://127.0.0.1:5000/v2/lab/torch/manifests/"
    assert manifests_url("localhost:5000", "x") == "http://localhost:5000/v2/x/manifests/"
    assert manifests_url("reg.lab:5000", "x") == "https://reg.lab:5000/v2/x/manifests/"
    assert manifests_url("reg.lab:5000", "x", insecure=["reg.lab:5000"]) == "http://reg.lab:5000/v2/x/manifests/"


# --------------------------------------------------------------------------- the pull stream
L1, L2, L3 = "3e731ddb7fc9", "47cafa6a79d0", "79fcf5a213c7"


def _dl(layer, current, total):
    return {"status": "Downloading", "progressDetail": {"current": current, "total": total},
            "progress": f"[=>   ] {current / 1e6:.3g}MB/{total / 1e6:.4g}MB", "id": layer}


# what the Docker daemon sends for `docker pull lab/torch:2.5` (one layer already on the host)
PULL = [
    {"status": "Pulling from lab/torch", "id": "2.5"},
    {"status": "Already exists", "progressDetail": {}, "id": L1},
    {"status": "Pulling fs layer", "progressDetail": {}, "id": L2},
    {"status": "Pulling fs layer", "progressDetail": {}, "id": L3},
    {"status": "Waiting", "progressDetail": {}, "id": L3},
    _dl(L2, 20_000_000, 200_000_000),
    _dl(L3, 10_000_000, 110_000_000),
    _dl(L2, 100_000_000, 200_000_000),
    _dl(L3, 20_000_000, 110_000_000),
    {"status": "Verifying Checksum", "progressDetail": {}, "id": L3},
    {"status": "Download complete", "progressDetail": {}, "id": L3},
    _dl(L2, 200_000_000, 200_000_000),
    {"status": "Verifying Checksum", "progressDetail": {}, "id": L2},
    {"status": "Download complete", "progressDetail": {}, "id": L2},
    {"status": "Extracting", "progressDetail": {"current": 32768, "total": 200_000_000}, "id": L2},
    {"status": "Pull complete", "progressDetail": {}, "id": L2},
    {"status": "Extracting", "progressDetail": {"current": 32768, "total": 110_000_000}, "id": L3},
    {"status": "Pull complete", "progressDetail": {}, "id": L3},
    {"status": "Digest: sha256:" + "c" * 64},
    {"status": "Status: Downloaded newer image for lab/torch:2.5"},
]


def test_the_pull_stream_in_words_at_most_twice_a_second_and_at_each_phase():
    t = [0.0]
    p = PullProgress("lab/torch", clock=lambda: t[0])
    shown = []
    for event in PULL:
        t[0] += 0.2
        shown.append((round(t[0], 1), p.feed(event)))
    messages = [m for _, m in shown if m]
    assert messages[0] == "Downloading image lab/torch: 1 of 2 layers"  # the first layer to download: a new phase
    # bytes: never more often than every 0.5 s
    times = [at for at, m in shown if m and m.startswith("Downloading")]
    assert all(b - a >= 0.5 - 1e-9 for a, b in itertools.pairwise(times))
    assert "Downloading image lab/torch: 120 MB of 310 MB (39%), 1 of 3 layers" in messages
    assert any(m.startswith("Extracting image lab/torch:") for m in messages)  # the phase change shows at once
    assert messages[-1] == "Downloaded image lab/torch (310 MB)"
    assert p.percent == 100.0 and p.done_bytes == 310_000_000 and p.total_bytes == 310_000_000
    assert p.layers == 3 and p.layers_done == 3 and p.error == "" and p.phase == "done"


def test_the_figures_during_a_pull():
    p = PullProgress("lab/torch", clock=lambda: 0.0)
    for event in PULL[:8]:
        p.feed(event)
    assert p.total_bytes == 310_000_000 and p.done_bytes == 110_000_000
    assert round(p.percent) == 35
    assert p.phase == "downloading"
    # a layer without a size yet keeps the percentage under 100
    q = PullProgress("x", clock=lambda: 0.0)
    q.feed({"status": "Pulling fs layer", "progressDetail": {}, "id": L1})
    q.feed({"status": "Pulling fs layer", "progressDetail": {}, "id": L2})
    q.feed(_dl(L1, 5, 5))
    assert q.percent == 99.0 and q.total_bytes == 5


def test_an_up_to_date_image_and_a_failed_pull():
    p = PullProgress("library/ubuntu")
    assert p.feed({"status": "Pulling from library/ubuntu", "id": "22.04"}) is None
    assert p.feed({"status": "Digest: sha256:" + "d" * 64}) is None
    assert p.feed({"status": "Status: Image is up to date for ubuntu:22.04"}) == "Image ubuntu is up to date"
    assert p.percent == 100.0
    p = PullProgress("lab/torch")
    p.feed({"status": "Pulling fs layer", "progressDetail": {}, "id": L2})
    msg = p.feed({"errorDetail": {"message": "manifest for lab/torch:9 not found: manifest unknown"},
                  "error": "manifest for lab/torch:9 not found: manifest unknown"})
    assert msg == "Downloading image lab/torch failed: manifest for lab/torch:9 not found: manifest unknown"
    assert p.error == "manifest for lab/torch:9 not found: manifest unknown" and p.phase == "failed"
    p = PullProgress("lab/torch")
    assert p.feed({"error": "pull access denied"}) == "Downloading image lab/torch failed: pull access denied"
    assert p.feed("not an event") is None


# --------------------------------------------------------------------------- the registry
DIGEST_AMD = "sha256:" + "1" * 64
DIGEST_ARM = "sha256:" + "2" * 64
INDEX = {
    "schemaVersion": 2, "mediaType": MANIFEST_LIST_TYPES[0],
    "manifests": [
        {"mediaType": MANIFEST_TYPES[0], "digest": DIGEST_ARM, "size": 1000, "platform": {"architecture": "arm64", "os": "linux", "variant": "v8"}},
        {"mediaType": MANIFEST_TYPES[0], "digest": DIGEST_AMD, "size": 1000, "platform": {"architecture": "amd64", "os": "linux"}},
        {"mediaType": MANIFEST_TYPES[0], "digest": "sha256:" + "3" * 64, "size": 800, "platform": {"architecture": "unknown", "os": "unknown"},
         "annotations": {"vnd.docker.reference.type": "attestation-manifest"}},
    ],
}


def _manifest(*sizes):
    return {"schemaVersion": 2, "mediaType": MANIFEST_TYPES[1],
            "config": {"mediaType": "application/vnd.docker.container.image.v1+json", "size": 7000, "digest": "sha256:" + "9" * 64},
            "layers": [{"mediaType": "application/vnd.docker.image.rootfs.diff.tar.gzip", "size": s, "digest": f"sha256:{i:064d}"}
                       for i, s in enumerate(sizes)]}


class Registry:
    """A registry's v2 API in a test: 'lab/torch' behind an anonymous token, with a manifest list;
    'lab/plain' open, one manifest; 'lab/private' asks for a password."""

    def __init__(self):
        self.asked: list[tuple[str, str, str]] = []
        self.port = 0

    def app(self):
        registry = self

        class Token(tornado.web.RequestHandler):
            def get(self):
                registry.asked.append(("token", self.get_query_argument("service", ""), self.get_query_argument("scope", "")))
                self.write({"token": "anon-token", "expires_in": 300})

        class Manifests(tornado.web.RequestHandler):
            def get(self, name, ref):
                registry.asked.append((name, ref, self.request.headers.get("Accept", "")))
                if name == "lab/private":
                    self.set_status(401)
                    self.set_header("WWW-Authenticate", 'Basic realm="registry"')
                    return
                if name == "lab/torch" and self.request.headers.get("Authorization") != "Bearer anon-token":
                    self.set_status(401)
                    self.set_header("WWW-Authenticate", f'Bearer realm="http://127.0.0.1:{registry.port}/token",'
                                                        f'service="test-registry",scope="repository:lab/torch:pull"')
                    self.write({"errors": [{"code": "UNAUTHORIZED"}]})
                    return
                docs = {("lab/torch", "2.5"): (INDEX, MANIFEST_LIST_TYPES[0]),
                        ("lab/torch", DIGEST_AMD): (_manifest(100_000_000, 200_000_000, 10_000_000), MANIFEST_TYPES[1]),
                        ("lab/torch", DIGEST_ARM): (_manifest(1, 2), MANIFEST_TYPES[1]),
                        ("lab/plain", "latest"): (_manifest(5_000_000, 25_000_000), MANIFEST_TYPES[1])}
                if (name, ref) not in docs:
                    self.set_status(404)
                    self.write({"errors": [{"code": "MANIFEST_UNKNOWN"}]})
                    return
                doc, media = docs[(name, ref)]
                self.set_header("Content-Type", media)
                self.write(json.dumps(doc))

        return tornado.web.Application([(r"/token", Token), (r"/v2/(.+)/manifests/([^/]+)", Manifests)])


def _with_registry(fn):
    async def main():
        reg = Registry()
        sockets = tornado.netutil.bind_sockets(0, "127.0.0.1")
        reg.port = sockets[0].getsockname()[1]
        server = tornado.httpserver.HTTPServer(reg.app())
        server.add_sockets(sockets)
        try:
            return await fn(reg), reg
        finally:
            server.stop()

    return asyncio.run(main())


def test_the_download_size_comes_from_the_registry_through_its_token_and_manifest_list():
    async def ask(reg):
        ref = f"127.0.0.1:{reg.port}/lab/torch:2.5"
        return (await registry_download_size(ref, arch="amd64"), await registry_download_size(ref, arch="arm64"),
                await registry_download_size(ref, arch="riscv64"))

    (amd, arm, none), reg = _with_registry(ask)
    assert amd == 310_000_000  # the layers, compressed; not the config
    assert arm == 3
    assert none is None  # no manifest for this machine's kind
    assert ("token", "test-registry", "repository:lab/torch:pull") in reg.asked
    first = next(a for a in reg.asked if a[0] == "lab/torch")
    assert all(t in first[2] for t in MANIFEST_LIST_TYPES + MANIFEST_TYPES)


def test_a_plain_manifest_and_every_failure():
    async def ask(reg):
        base = f"127.0.0.1:{reg.port}"
        return (await registry_download_size(f"{base}/lab/plain"),
                await registry_download_size(f"{base}/lab/missing:1"),
                await registry_download_size(f"{base}/lab/private:1"),
                await registry_download_size("127.0.0.1:1/lab/nothing-listens:1", timeout=2),
                await registry_download_size("Not A Reference"))

    (plain, missing, private, closed, bad), _ = _with_registry(ask)
    assert plain == 30_000_000
    assert missing is None and private is None and closed is None and bad is None
