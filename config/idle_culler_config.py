# jupyterhub-idle-culler's config (its --config): the GPU lease hook.
#
# Servers whose leases' heartbeats say their GPUs work are kept, however long the hub has seen
# no activity; a server whose GPU lease sits idle is culled after gpu_idle_limit seconds without
# activity (the culler's --timeout for servers without a lease). A culled server's lease ends
# with a reason that says so. README, "The idle culler".

from jupyter_gpulease.culler import GPUCullArbiter

c = get_config()  # noqa: F821 - provided by the culler

c.IdleCuller.cull_arbiter_hook = GPUCullArbiter(gpu_idle_limit=1800)  # seconds
