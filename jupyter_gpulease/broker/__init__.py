"""The lease broker: a JupyterHub service that owns the GPU pool, the queue and every lease."""
