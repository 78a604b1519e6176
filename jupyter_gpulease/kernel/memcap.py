"""A GPU share's memory cap inside the kernel.

For a share of a GPU the spawner sets ``GPULEASE_MEMORY_FRACTION`` (the slice's memory over the
GPU's, e.g. ``0.5``). PyTorch caps its caching allocator with
``torch.cuda.set_per_process_memory_fraction``; calling it starts CUDA, so it is queued with
``torch.cuda._lazy_call`` to run when the kernel's code first uses CUDA. torch is never imported
here: when the kernel imports it, the cap is armed. Other frameworks are left alone (the server
extension watches every process's memory against the share and warns, then acts).
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import logging
import os
import sys

log = logging.getLogger(__name__)


def memory_fraction(env: dict[str, str] | None = None) -> float | None:
    """The cap from ``GPULEASE_MEMORY_FRACTION``: a number in (0, 1), else None (no cap, or a whole GPU)."""
    raw = (os.environ if env is None else env).get("GPULEASE_MEMORY_FRACTION", "").strip()
    if not raw:
        return None
    try:
        value = float(raw.split(",")[0])
    except ValueError:
        log.warning("gpulease: GPULEASE_MEMORY_FRACTION=%r is not a number; no memory cap", raw)
        return None
    return value if 0 < value < 1 else None


def arm(torch, fraction: float) -> None:
    """Cap every visible device at ``fraction`` when CUDA starts (now, if it already has)."""
    cuda = torch.cuda

    def apply():
        for i in range(cuda.device_count()):
            cuda.set_per_process_memory_fraction(fraction, i)
        log.info("gpulease: PyTorch may use %.0f%% of each GPU's memory (this server's share)", fraction * 100)

    if cuda.is_initialized():
        apply()
    else:
        cuda._lazy_call(apply)


class _ArmWhenImported(importlib.abc.MetaPathFinder):
    """Arms the cap right after ``import torch`` finishes, whoever imports it."""

    def __init__(self, fraction: float):
        self.fraction = fraction

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "torch":
            return None
        sys.meta_path.remove(self)  # once; and so that the real finders answer below
        spec = importlib.util.find_spec("torch")
        if spec is None or spec.loader is None:
            return spec
        loader, fraction = spec.loader, self.fraction
        exec_module = loader.exec_module

        def exec_and_arm(module):
            exec_module(module)
            try:
                arm(module, fraction)
            except Exception as e:  # an unusual torch build must not break the user's import
                log.warning("gpulease: could not cap PyTorch's GPU memory: %s", e)

        loader.exec_module = exec_and_arm
        return spec


def install(env: dict[str, str] | None = None) -> bool:
    """Cap PyTorch's GPU memory at this server's share, when there is one. Returns whether armed."""
    fraction = memory_fraction(env)
    if fraction is None:
        return False
    if "torch" in sys.modules:
        arm(sys.modules["torch"], fraction)
    elif not any(isinstance(f, _ArmWhenImported) for f in sys.meta_path):
        sys.meta_path.insert(0, _ArmWhenImported(fraction))
    return True
