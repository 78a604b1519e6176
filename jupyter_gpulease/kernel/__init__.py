"""The kernel side: `%gpu` magics and the live widget (IPython extension ``jupyter_gpulease``)."""

from __future__ import annotations


def load_ipython_extension(ipython) -> None:
    from .magics import GPUMagics
    from .memcap import install

    ipython.register_magics(GPUMagics)
    install()  # a GPU share's memory cap for PyTorch (GPULEASE_MEMORY_FRACTION)
    from .resume import install as install_resume

    install_resume(ipython)  # a cell in a suspended kernel waits for the resume


def unload_ipython_extension(ipython) -> None:
    from .feed import stop_shared_feed
    from .resume import uninstall

    uninstall(ipython)
    stop_shared_feed()
