"""Trace replay: real GPU-cluster workloads through the core scheduler, policy against policy.

``traces`` reads and validates the CSV files, ``workload`` turns them into jobs and a pool
(every modelling assumption lives there, labelled), ``policies`` says how each compared policy
maps onto :class:`jupyter_gpulease.core.policy.Policy`, ``replay`` drives the very
:class:`jupyter_gpulease.core.scheduler.Scheduler` the broker runs with a simulated clock,
``metrics`` and ``report`` turn the outcome into figures, tables, JSON and plots, and ``cli``
wires it into ``jupyter gpulease simulate``.
"""
