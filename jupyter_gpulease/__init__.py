"""jupyter-gpulease: GPU leases for JupyterHub."""

__version__ = "0.1.0"


def load_ipython_extension(ipython):
    """`%load_ext jupyter_gpulease`: the `%gpu` magics (loaded by themselves in a gpulease server's kernels)."""
    from .kernel import load_ipython_extension as load

    load(ipython)


def unload_ipython_extension(ipython):
    from .kernel import unload_ipython_extension as unload

    unload(ipython)


def _jupyter_labextension_paths():
    """Where JupyterLab finds the prebuilt extension (status bar, panel, notifications)."""
    return [{"src": "labextension", "dest": "jupyter-gpulease"}]
