"""The pure domain: model, placement, scheduler and policy. No I/O, no clock of its own.

Where each part lives (the scheduling framework's phases in brackets):

- ``model``: GPUs, slices, placements, leases, errors; ``request``: the slice asked for and the
  whole :class:`~.request.Ask`, parsed and checked once; ``text``: durations and tables.
- ``policy``: tiers, quotas and the scheduling settings; ``admission``: what may be asked.
- ``scheduler``: the façade; ``passes``: one pass, phase by phase; ``queue`` [queue sort];
  ``quota`` [pre-filter]; ``pool`` and ``slices`` [filter, score, per slice kind];
  ``preemption`` [post-filter]; ``reservations`` [reserve]; ``ledger``: the live leases and what
  they hold; ``deadlines``: typed timers; ``views`` and ``estimate``: queries that change nothing.
- ``idle``: when a kernel's GPU counts as idle, for the server extension and the simulator.
"""
