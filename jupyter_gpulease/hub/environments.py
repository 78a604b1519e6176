"""Environments: the images users choose from, checked against the GPUs' driver.

An admin lists environments as Zero to JupyterHub lists images in ``profile_list``: each is an
image with the CUDA version it needs and the GPU models it suits. This module holds the rules
around them, pure, and one small async HTTP helper:

* :func:`parse_environments`: the admin's list checked into :class:`Environment` s;
* :func:`needs_newer_driver`: whether the pool's driver runs an image's CUDA (the rule is there);
* :func:`offers` and :func:`check_choice`: what the spawn form offers, and the check of a
  spawn's choice before its lease is asked for (a bad choice is refused at once);
* :class:`PullProgress`: Docker's pull stream as messages for the spawn page;
* :func:`image_parts` and :func:`registry_download_size`: an image reference read by Docker's
  rules, and the download size of an image its host does not hold yet, asked of its registry.

Nothing here talks to Docker; the engine does and hands the answers in.
"""

from __future__ import annotations

import asyncio
import fnmatch
import json
import logging
import platform
import re
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlencode

from ..core.model import cuda_version_text, model_matches
from .options import OptionsError

log = logging.getLogger(__name__)

ENVIRONMENT_KEYS = ("name", "display_name", "image", "cuda", "models", "description", "size_bytes", "default", "cpu_only_ok")
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
_CUDA_RE = re.compile(r"^(\d+)\.(\d+)(?:\.(\d+))?$")  # "12.4", or with a patch level "12.4.1" (not compared)


# --------------------------------------------------------------------------- the admin's list
@dataclass(frozen=True)
class Environment:
    """One image users may choose for their server."""

    name: str  # a slug, unique: the value of the form's field and of user_options["environment"]
    display_name: str
    image: str  # a Docker reference: "127.0.0.1:5000/lab/torch:2.5-cuda12.4"
    cuda: str = ""  # the CUDA version the image needs, "12.4"; "": none
    models: tuple[str, ...] = ()  # glob patterns of the GPU models it suits (as core.model.model_matches); (): any
    description: str = ""
    size_bytes: int | None = None  # its compressed download size, for when its registry cannot be asked
    default: bool = False
    cpu_only_ok: bool = True  # a CPU-only server may use it

    def suits(self, model: str | Sequence[str] | None) -> bool:
        """Whether a lease asked for ``model`` (a model, a glob of models, a list of either; None:
        any) lands on GPUs this image suits."""
        return _suits(self.models, model)


def parse_environments(raw: Any) -> list[Environment]:
    """Check the admin's list of environments (dicts); ``ValueError`` names the entry and the field."""
    if raw is None:
        return []
    if not isinstance(raw, (list, tuple)):
        raise ValueError(f"environments must be a list of dicts such as {{'name': 'torch', 'image': 'lab/torch:2.5', "
                         f"'cuda': '12.4'}}, got {type(raw).__name__}")
    out: list[Environment] = []
    seen: set[str] = set()
    for i, e in enumerate(raw):
        where = f"environments[{i}]"
        if not isinstance(e, dict):
            raise ValueError(f"{where} must be a dict, got {type(e).__name__}")
        if isinstance(e.get("name"), str):
            where += f" ({e['name']!r})"
        unknown = sorted(set(e) - set(ENVIRONMENT_KEYS))
        if unknown:
            raise ValueError(f"{where}: unknown key(s) {', '.join(map(repr, unknown))}; known: {', '.join(ENVIRONMENT_KEYS)}")
        name = e.get("name")
        if not isinstance(name, str) or not _NAME_RE.match(name):
            raise ValueError(f"{where}: 'name' must be a short name of letters, digits, '.', '_' and '-' (no spaces), "
                             f"like 'torch-2.5', got {name!r}")
        if name in seen:
            raise ValueError(f"{where}: 'name' {name!r} is used twice")
        seen.add(name)
        image = e.get("image")
        if not isinstance(image, str) or not image.strip():
            raise ValueError(f"{where}: 'image' must name a Docker image, like 'lab/torch:2.5-cuda12.4', got {image!r}")
        try:
            image_parts(image.strip())
        except ValueError as err:
            raise ValueError(f"{where}: 'image': {err}") from None
        cuda = e.get("cuda", "")
        if cuda is None:
            cuda = ""
        if cuda != "":
            try:
                parse_cuda(cuda)
            except ValueError as err:
                raise ValueError(f"{where}: 'cuda': {err}") from None
        models = e.get("models", ())
        if models is None:
            models = ()
        if not isinstance(models, (list, tuple)) or not all(isinstance(m, str) and m.strip() for m in models):
            raise ValueError(f"{where}: 'models' must be a list of GPU model patterns such as ['A100*', 'H100*'], got {models!r}")
        size = e.get("size_bytes")
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size <= 0):
            raise ValueError(f"{where}: 'size_bytes' must be the image's download size as a positive whole number of bytes, got {size!r}")
        for k in ("default", "cpu_only_ok"):
            if k in e and not isinstance(e[k], bool):
                raise ValueError(f"{where}: {k!r} must be true or false, got {e[k]!r}")
        for k in ("display_name", "description"):
            if e.get(k) is not None and not isinstance(e[k], str):
                raise ValueError(f"{where}: {k!r} must be a string, got {e[k]!r}")
        out.append(Environment(
            name=name,
            display_name=(e.get("display_name") or "").strip() or name,
            image=image.strip(),
            cuda=cuda.strip(),
            models=tuple(m.strip() for m in models),
            description=(e.get("description") or "").strip(),
            size_bytes=size,
            default=bool(e.get("default", False)),
            cpu_only_ok=bool(e.get("cpu_only_ok", True)),
        ))
    defaults = [x.name for x in out if x.default]
    if len(defaults) > 1:
        raise ValueError(f"environments: more than one has 'default': True ({', '.join(map(repr, defaults))})")
    return out


def default_environment(envs: Sequence[Environment]) -> Environment | None:
    """The environment marked ``default``, else the first."""
    return next((e for e in envs if e.default), envs[0] if envs else None)


# --------------------------------------------------------------------------- CUDA and the driver
def parse_cuda(s: Any) -> tuple[int, int]:
    """A CUDA version, "12.4" (a patch level, "12.4.1", is allowed and not compared) → (12, 4).

    ``ValueError`` for anything else, a number included: 12.10 written as a number reads as 12.1.
    """
    if not isinstance(s, str):
        hint = " (write it as a string: a number loses digits, 12.10 reads as 12.1)" if isinstance(s, (int, float)) else ""
        raise ValueError(f"a CUDA version is major.minor such as '12.4'{hint}, got {s!r}")
    m = _CUDA_RE.match(s.strip())
    if not m:
        raise ValueError(f"a CUDA version is major.minor such as '12.4', got {s!r}")
    return int(m.group(1)), int(m.group(2))


def driver_cuda_words(v: int) -> str:
    """NVML's ``nvmlSystemGetCudaDriverVersion`` integer (1000 × major + 10 × minor) as nvidia-smi
    shows it: 12040 → "12.4"."""
    return cuda_version_text(v)


def needs_newer_driver(env: Environment, driver_cuda: str | None, *, driver_version: str = "") -> str:
    """Why ``env``'s image cannot run on GPUs whose driver supports CUDA ``driver_cuda`` at most
    (nvidia-smi's "CUDA Version", the pool's ``cuda_version``), or "" when it can.

    The rule: the image's CUDA major.minor must be at most the driver's. "" too for an image
    without CUDA, and where the driver is unknown (``driver_cuda`` None or ""): an unknown driver
    offers everything, and the first CUDA call in the server says the rest.

    NVIDIA's note on minor-version compatibility: since CUDA 11 an application built with a newer
    toolkit of the same major version may run on an older driver of that major version, as long
    as it uses no feature of the newer driver (then ``cudaErrorCallRequiresNewerDriver``) and
    needs no JIT compilation of PTX made by the newer toolkit; the forward-compatibility package
    (``cuda-compat``) lifts the limit on data-center GPUs. We stay strict on purpose: frameworks
    ship PTX and call new driver functions, and a CUDA 12.8 image on a 12.4 driver fails in
    PyTorch's first CUDA call. An admin whose image carries the compatibility package declares
    the CUDA version it needs from the driver.

    ``driver_version`` ("550.54.15"), where known, goes into the words.
    """
    if not env.cuda or not driver_cuda:
        return ""
    try:
        have = parse_cuda(driver_cuda)
    except ValueError:
        return ""  # a driver we cannot read is an unknown one
    need = parse_cuda(env.cuda)
    if need <= have:
        return ""
    which = f"the GPUs' driver ({driver_version})" if driver_version else "the GPUs' driver"
    return f"needs CUDA {need[0]}.{need[1]}; {which} supports CUDA {have[0]}.{have[1]} at most"


def _patterns(model: str | Sequence[str] | None) -> list[str]:
    if not model:
        return []
    return [model] if isinstance(model, str) else [m for m in model if m]


def _suits(patterns: tuple[str, ...], model: str | Sequence[str] | None) -> bool:
    """Every model asked for (a model or a glob) is one ``patterns`` allow, or a glob that covers one
    of them (a request for 'A100*' may land on what an image made for 'A100-SXM4-80GB' suits)."""
    if not patterns:
        return True
    for asked in _patterns(model):
        if not (model_matches(asked, patterns) or any(fnmatch.fnmatchcase(p.lower(), asked.lower()) for p in patterns)):
            return False
    return True


def _model_reason(env: Environment, model: str | Sequence[str] | None) -> str:
    if env.suits(model):
        return ""
    asked = ", ".join(_patterns(model))
    return f"made for {', '.join(env.models)} GPUs, not {asked}"


# --------------------------------------------------------------------------- what the form offers
def size_words(n: int) -> str:
    """A download size as Docker says it (decimal units): '850 kB', '310 MB', '1.2 GB'."""
    n = int(n)
    if n >= 1_000_000_000:
        return f"{n / 1e9:.1f} GB"
    if n >= 1_000_000:
        return f"{n / 1e6:.0f} MB"
    return f"{max(1, round(n / 1e3))} kB"


@dataclass
class EnvironmentOffer:
    """One environment as the spawn form shows it."""

    env: Environment
    offered: bool
    reason: str = ""  # why it is not offered, in words
    present: bool | None = None  # its image is on the Docker host already; None: unknown
    download_bytes: int | None = None  # what its first start downloads (0 when present); None: unknown

    @property
    def ready_words(self) -> str:
        """'ready', or what the first start downloads: the whole image's size, an upper bound (the
        layers the host holds already, shared with its other images, are not downloaded again)."""
        if self.present:
            return "ready"
        size = f"up to ~{size_words(self.download_bytes)}" if self.download_bytes else "the image"
        if self.present is None:
            return f"the first start may download {size}"
        return f"first start downloads {size}"

    @property
    def cuda_words(self) -> str:
        return f"CUDA {self.env.cuda}" if self.env.cuda else "no CUDA"

    @property
    def models_words(self) -> str:
        return f"for {', '.join(self.env.models)} GPUs" if self.env.models else "any GPU"


def offers(envs: Sequence[Environment], *, driver_cuda: str | None, driver_version: str = "", present: set[str] | None,
           sizes: dict[str, int], model: str | Sequence[str] | None = None) -> list[EnvironmentOffer]:
    """Each environment, offered or not (and why): not where it needs a newer driver than
    ``driver_cuda`` (unknown: offered), nor where it does not suit ``model`` (None: any GPU).

    ``present``: the images the Docker host holds (None: unknown); ``sizes``: download sizes by
    image, from its registry (:func:`registry_download_size`), else the environment's ``size_bytes``.
    """
    out = []
    for e in envs:
        reasons = [r for r in (needs_newer_driver(e, driver_cuda, driver_version=driver_version), _model_reason(e, model)) if r]
        here = None if present is None else e.image in present
        size = 0 if here else (sizes.get(e.image) or e.size_bytes)
        out.append(EnvironmentOffer(env=e, offered=not reasons, reason="; ".join(reasons), present=here, download_bytes=size))
    return out


def check_choice(envs: Sequence[Environment], name: str, *, model: str | Sequence[str] | None, driver_cuda: str | None,
                 driver_version: str = "", cpu_only: bool) -> Environment:
    """The environment a spawn asked for (``user_options["environment"]``), checked before its
    lease is asked for; "" takes the default (the first that can be used where the default
    cannot). Raises :class:`OptionsError` (field ``environment``) saying what to change."""
    envs = list(envs)
    if not envs:
        raise OptionsError("this hub offers no choice of environment: drop 'environment'", "environment")

    def why_not(e: Environment) -> str:
        if cpu_only:
            return "" if e.cpu_only_ok else "needs a GPU, and this server has none"
        return "; ".join(r for r in (needs_newer_driver(e, driver_cuda, driver_version=driver_version), _model_reason(e, model)) if r)

    usable = [e.name for e in envs if not why_not(e)]
    if name is not None and not isinstance(name, str):
        raise OptionsError(f"'environment' must be the name of an environment, one of: {', '.join(e.name for e in envs)}",
                           "environment")
    name = (name or "").strip()
    if not name:
        first = default_environment(envs)
        if first is not None and not why_not(first):
            return first
        for e in envs:
            if not why_not(e):
                return e
        reasons = "; ".join(f"{e.name}: {why_not(e)}" for e in envs)
        raise OptionsError(f"no environment can be used with this choice ({reasons})", "environment")
    by_name = {e.name: e for e in envs}
    if name not in by_name:
        raise OptionsError(f"unknown environment {name!r}; choose one of: {', '.join(by_name)}", "environment")
    env = by_name[name]
    why = why_not(env)
    if why:
        others = [u for u in usable if u != name]
        then = f"; choose another: {', '.join(others)}" if others else ""
        raise OptionsError(f"environment {name!r} cannot be used: {why}{then}", "environment")
    return env


# --------------------------------------------------------------------------- pulling
_DOWNLOAD = {"Pulling fs layer", "Waiting", "Downloading", "Verifying Checksum", "Retrying"}
_DOWNLOADED = {"Download complete", "Extracting"}
_DONE = {"Pull complete", "Already exists"}


@dataclass
class _Layer:
    status: str = ""
    current: int = 0
    total: int | None = None
    existed: bool = False


class PullProgress:
    """Docker's pull stream (docker-py ``api.pull(..., stream=True, decode=True)``) → messages for
    the spawn page.

    Feed it each event: ``{"status": "Downloading", "id": <layer>, "progressDetail": {"current",
    "total"}}``, the layer's other steps ("Pulling fs layer", "Waiting", "Verifying Checksum",
    "Download complete", "Extracting", "Pull complete", "Already exists"), the image's own lines
    ("Pulling from …", "Digest: …", "Status: …") and, on failure, ``{"error", "errorDetail"}``.
    :meth:`feed` answers a message when there is something new to show: at a change of phase
    (downloading, extracting, done, failed) at once, otherwise at most every ``interval`` seconds.
    """

    def __init__(self, name: str = "", *, interval: float = 0.5, clock: Callable[[], float] = time.monotonic):
        self.name = name.removeprefix("library/") if name else "the image"
        self.interval = interval
        self._clock = clock
        self._layers: dict[str, _Layer] = {}
        self._phase = ""
        self._last_at: float | None = None
        self._last_message = ""
        self.error = ""
        self.finished = False

    # ------------------------------------------------------------------ figures
    @property
    def total_bytes(self) -> int | None:
        """The bytes to download of the layers whose size Docker has said (None before any)."""
        sizes = [x.total for x in self._layers.values() if not x.existed and x.total]
        return sum(sizes) if sizes else None

    @property
    def done_bytes(self) -> int:
        return sum(min(x.current, x.total) if x.total else x.current for x in self._layers.values() if not x.existed)

    @property
    def percent(self) -> float | None:
        """How much of the download is done, 0–100 (None while no size is known; 100 once done)."""
        if self.finished and not self.error:
            return 100.0
        total = self.total_bytes
        if not total:
            return None
        waiting = any(x.total is None and not x.existed and x.status in _DOWNLOAD for x in self._layers.values())
        pct = 100.0 * self.done_bytes / total
        return min(pct, 99.0) if waiting else min(pct, 100.0)

    @property
    def layers(self) -> int:
        return len(self._layers)

    @property
    def layers_done(self) -> int:
        return sum(1 for x in self._layers.values() if x.status in _DONE)

    @property
    def phase(self) -> str:
        """'', 'downloading', 'extracting', 'done' or 'failed'."""
        return self._phase

    # ------------------------------------------------------------------ events
    def feed(self, event: Any) -> str | None:
        """Take one event of the stream; a message for the spawn page, or None when nothing worth showing changed."""
        if not isinstance(event, dict):
            return None
        if event.get("error") or event.get("errorDetail"):
            detail = event.get("errorDetail") or {}
            self.error = str((detail.get("message") if isinstance(detail, dict) else None) or event.get("error") or "the pull failed")
            return self._show("failed", f"Downloading image {self.name} failed: {self.error}", force=True)
        status = str(event.get("status") or "")
        layer_id = event.get("id")
        if status.startswith("Status:"):
            self.finished = True
            if "up to date" in status:
                return self._show("done", f"Image {self.name} is up to date", force=True)
            total = self.total_bytes
            size = f" ({size_words(total)})" if total else ""
            return self._show("done", f"Downloaded image {self.name}{size}", force=True)
        if status.startswith(("Digest:", "Pulling from", "Pulling repository")) or not layer_id:
            return None
        layer = self._layers.setdefault(str(layer_id), _Layer())
        layer.status = status.split(" in ")[0] if status.startswith("Retrying") else status
        detail = event.get("progressDetail") or {}
        if status == "Already exists":
            layer.existed = True
        elif status == "Downloading" and isinstance(detail, dict):
            if isinstance(detail.get("total"), int) and detail["total"] > 0:
                layer.total = detail["total"]
            if isinstance(detail.get("current"), int):
                layer.current = detail["current"]
        elif status in _DOWNLOADED or status == "Pull complete":
            if layer.total:
                layer.current = layer.total
        elif status.startswith("Retrying"):
            layer.current = 0
        phase = self._phase_now()
        return self._show(phase, self._message()) if phase else None

    def _phase_now(self) -> str:
        states = [x.status for x in self._layers.values()]
        if any(s in _DOWNLOAD for s in states):
            return "downloading"
        if any(s in _DOWNLOADED for s in states):
            return "extracting"
        return self._phase  # between steps (or only layers the host has): no change

    def _message(self) -> str:
        layers = f"{self.layers_done} of {self.layers} layers"
        if self._phase_now() == "downloading":
            total = self.total_bytes
            if total:
                pct = self.percent
                return (f"Downloading image {self.name}: {size_words(self.done_bytes)} of {size_words(total)}"
                        f"{f' ({pct:.0f}%)' if pct is not None else ''}, {layers}")
            return f"Downloading image {self.name}: {layers}"
        return f"Extracting image {self.name}: {layers}"

    def _show(self, phase: str, message: str, *, force: bool = False) -> str | None:
        now = self._clock()
        changed = phase != self._phase
        self._phase = phase
        if message == self._last_message:
            return None
        if not (force or changed) and self._last_at is not None and now - self._last_at < self.interval:
            return None
        self._last_at, self._last_message = now, message
        return message


# --------------------------------------------------------------------------- image references and registries
DOCKER_HUB = "docker.io"
_DOCKER_HUB_API = "registry-1.docker.io"
_COMPONENT_RE = re.compile(r"^[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*$")
_TAG_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")
_DIGEST_RE = re.compile(r"^[a-z0-9]+(?:[+._-][a-z0-9]+)*:[0-9a-fA-F]{32,}$")
_HOST_RE = re.compile(r"^(?:[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?)*|\[[0-9A-Fa-f:.]+\])(?::\d+)?$")


def image_parts(ref: str) -> tuple[str, str, str]:
    """A Docker image reference → (registry, repository name, tag or digest), by Docker's rules:
    the first part is a registry only when it has a '.' or a ':' or is 'localhost'; else the
    registry is docker.io, where a one-part name is under 'library/'; no tag means 'latest'; a
    digest wins over a tag. ``ValueError`` for what Docker would refuse.

    'ubuntu' → ('docker.io', 'library/ubuntu', 'latest');
    '127.0.0.1:5000/lab/torch:2.5' → ('127.0.0.1:5000', 'lab/torch', '2.5').
    """
    if not isinstance(ref, str) or not ref.strip():
        raise ValueError(f"an image reference such as 'lab/torch:2.5' is needed, got {ref!r}")
    rest = ref.strip()
    digest = ""
    if "@" in rest:
        rest, digest = rest.split("@", 1)
        if not _DIGEST_RE.match(digest):
            raise ValueError(f"{ref!r}: {digest!r} is not a digest such as 'sha256:…'")
    registry = DOCKER_HUB
    first, sep, remainder = rest.partition("/")
    if sep and ("." in first or ":" in first or first == "localhost"):
        if not _HOST_RE.match(first):
            raise ValueError(f"{ref!r}: {first!r} is not a registry host")
        registry, rest = first, remainder
    if registry in ("index.docker.io", "registry-1.docker.io"):
        registry = DOCKER_HUB
    tag = ""
    last = rest.rsplit("/", 1)[-1]
    if ":" in last:
        rest, tag = rest.rsplit(":", 1)
        if not _TAG_RE.match(tag):
            raise ValueError(f"{ref!r}: {tag!r} is not a tag")
    parts = rest.split("/")
    if not rest or not all(_COMPONENT_RE.match(p) for p in parts):
        raise ValueError(f"{ref!r}: the repository name must be lower-case parts such as 'lab/torch'")
    name = rest
    if registry == DOCKER_HUB and len(parts) == 1:
        name = f"library/{rest}"
    return registry, name, digest or tag or "latest"


MANIFEST_LIST_TYPES = ("application/vnd.oci.image.index.v1+json", "application/vnd.docker.distribution.manifest.list.v2+json")
MANIFEST_TYPES = ("application/vnd.oci.image.manifest.v1+json", "application/vnd.docker.distribution.manifest.v2+json")
_ARCHES = {"x86_64": "amd64", "amd64": "amd64", "aarch64": "arm64", "arm64": "arm64", "ppc64le": "ppc64le", "s390x": "s390x"}
_CHALLENGE_RE = re.compile(r'(\w+)\s*=\s*(?:"([^"]*)"|([^,\s]*))')


def _local(host: str) -> bool:
    name = host.rsplit(":", 1)[0] if not host.endswith("]") else host
    return name.strip("[]") in ("localhost", "127.0.0.1", "::1")


def manifests_url(registry: str, name: str, *, insecure: Iterable[str] = ()) -> str:
    """Where a registry (as :func:`image_parts` names it) keeps ``name``'s manifests: https, or
    plain http for one on this machine or named in ``insecure``; Docker Hub's API host for docker.io."""
    host = _DOCKER_HUB_API if registry == DOCKER_HUB else registry
    scheme = "http" if _local(registry) or registry in set(insecure) else "https"
    return f"{scheme}://{host}/v2/{name}/manifests/"


async def registry_download_size(image_ref: str, *, timeout: float = 5.0, insecure: Iterable[str] = (),
                                 arch: str | None = None) -> int | None:
    """The compressed download size of ``image_ref`` (the sum of its layers' sizes) from its
    registry's v2 API, or None where it cannot be told (logged at debug level).

    A manifest list or OCI index leads to the manifest for linux and ``arch`` (default: this
    machine's); a registry that answers 401 with a ``Bearer`` challenge gets an anonymous token
    first. Registries on localhost/127.0.0.1 and those named in ``insecure`` (host[:port]) are
    asked over plain http. ``timeout``: seconds for the whole look-up.
    """
    try:
        registry, name, ref = image_parts(image_ref)
    except ValueError as e:
        log.debug("Download size of %s: %s", image_ref, e)
        return None
    want_arch = arch or _ARCHES.get(platform.machine().lower(), platform.machine().lower())
    try:
        async with asyncio.timeout(timeout):
            return await _RegistryLookup(manifests_url(registry, name, insecure=insecure), name, timeout).size(ref, want_arch)
    except Exception as e:  # any failure: the size is unknown, the form says so
        log.debug("Download size of %s unknown: %s: %s", image_ref, type(e).__name__, e)
        return None


class _RegistryLookup:
    """One image's manifests from one registry, with the anonymous token once it is asked for."""

    def __init__(self, base: str, name: str, timeout: float):
        self.base = base
        self.name = name
        self.timeout = timeout
        self.token = ""

    async def size(self, ref: str, arch: str) -> int | None:
        from tornado.httpclient import AsyncHTTPClient

        client = AsyncHTTPClient(force_instance=True, max_body_size=8 * 1024 * 1024)
        try:
            doc, media = await self._get(client, ref, MANIFEST_LIST_TYPES + MANIFEST_TYPES)
            if media in MANIFEST_LIST_TYPES or "manifests" in doc:
                digest = _platform_manifest(doc, arch)
                if digest is None:
                    log.debug("Download size of %s: no manifest for linux/%s", self.name, arch)
                    return None
                doc, media = await self._get(client, digest, MANIFEST_TYPES)
            layers = doc.get("layers")
            if not isinstance(layers, list) or not layers:
                return None
            return sum(int(x["size"]) for x in layers)
        finally:
            client.close()

    async def _get(self, client, ref: str, accept: tuple[str, ...]) -> tuple[dict, str]:
        from tornado.httpclient import HTTPRequest

        for attempt in range(2):
            headers = {"Accept": ", ".join(accept)}
            if self.token:
                headers["Authorization"] = f"Bearer {self.token}"
            req = HTTPRequest(self.base + ref, headers=headers, connect_timeout=self.timeout, request_timeout=self.timeout)
            resp = await client.fetch(req, raise_error=False)
            if resp.code == 401 and attempt == 0 and not self.token:
                self.token = await self._anonymous_token(client, resp.headers.get("WWW-Authenticate", ""))
                continue
            if resp.code != 200:
                raise OSError(f"GET {req.url}: HTTP {resp.code}")
            media = (resp.headers.get("Content-Type") or "").split(";")[0].strip()
            doc = json.loads(resp.body)
            if not isinstance(doc, dict):
                raise ValueError("the manifest is not a JSON object")
            return doc, str(doc.get("mediaType") or media)
        raise OSError(f"{self.base}{ref}: the registry refused the anonymous token")

    async def _anonymous_token(self, client, challenge: str) -> str:
        from tornado.httpclient import HTTPRequest

        scheme, _, params = challenge.strip().partition(" ")
        if scheme.lower() != "bearer":
            raise OSError(f"the registry asks for {scheme or 'credentials'} authentication, not an anonymous token")
        fields = {m.group(1).lower(): m.group(2) if m.group(2) is not None else m.group(3) for m in _CHALLENGE_RE.finditer(params)}
        realm = fields.get("realm")
        if not realm:
            raise OSError("the registry's Bearer challenge names no realm")
        query = {"service": fields.get("service"), "scope": fields.get("scope") or f"repository:{self.name}:pull"}
        url = realm + ("&" if "?" in realm else "?") + urlencode({k: v for k, v in query.items() if v})
        resp = await client.fetch(HTTPRequest(url, connect_timeout=self.timeout, request_timeout=self.timeout), raise_error=False)
        if resp.code != 200:
            raise OSError(f"GET {url}: HTTP {resp.code}")
        body = json.loads(resp.body)
        token = (body.get("token") or body.get("access_token")) if isinstance(body, dict) else None
        if not token:
            raise OSError("the registry's token service gave no token")
        return str(token)


def _platform_manifest(index: dict, arch: str) -> str | None:
    """The digest of the index's manifest for linux/``arch`` (attestations and others skipped)."""
    for m in index.get("manifests") or []:
        p = m.get("platform") or {}
        if p.get("os") == "linux" and p.get("architecture") == arch and m.get("digest"):
            return str(m["digest"])
    return None
