"""The JupyterHub side: the GPU-lease spawner mixin, its engine classes, the spawn form and the demo.

Only this package imports jupyterhub; it reaches the broker through :mod:`jupyter_gpulease.client`.
"""

from __future__ import annotations

__all__ = ["GPULeaseLocalProcessSpawner", "GPULeaseSimpleLocalProcessSpawner", "GPULeaseSpawner"]


def __getattr__(name):  # lazy: `jupyter gpulease demo --help` should not import jupyterhub's spawner machinery
    if name in __all__:
        from . import spawner

        return getattr(spawner, name)
    raise AttributeError(name)
