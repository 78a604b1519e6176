"""The jupyter_server extension: GPU monitor per kernel, idle reclaim that keeps work, resume,
heartbeats, and the REST API and live feed under ``{base_url}gpulease/api/``.

Enabled on install; configure ``c.GPULeaseExtension`` (see :mod:`.app`). Nothing here imports
jupyterhub: single-user images may not have it.
"""


def _jupyter_server_extension_points():
    from .app import GPULeaseExtension

    return [{"module": "jupyter_gpulease.server.app", "app": GPULeaseExtension}]
