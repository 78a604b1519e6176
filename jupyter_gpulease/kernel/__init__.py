"""The kernel side: `%gpu` magics and the live widget (IPython extension ``jupyter_gpulease``)."""

from __future__ import annotations


def load_ipython_extension(ipython) -> None:
    from .magics import GPUMagics

    ipython.register_magics(GPUMagics)


def unload_ipython_extension(ipython) -> None:
    from .feed import stop_shared_feed

    stop_shared_feed()
