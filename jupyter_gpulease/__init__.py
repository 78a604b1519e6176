"""jupyter-gpulease: GPU leases for JupyterHub."""

__version__ = "0.1.0"
