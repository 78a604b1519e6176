"""`jupyter gpulease …`: one entry point, one module per subcommand.

Subcommands are imported lazily so that `jupyter gpulease simulate` does not need the hub
or the broker's dependencies loaded, and vice versa.
"""

from __future__ import annotations

import importlib
import sys

# subcommand -> (module, function, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str, str]] = {}


def register(name: str, module: str, func: str, help: str) -> None:
    SUBCOMMANDS[name] = (module, func, help)


def _usage() -> str:
    lines = ["usage: jupyter gpulease <command> [options]", "", "commands:"]
    width = max(map(len, SUBCOMMANDS))
    for name, (_, _, help) in SUBCOMMANDS.items():
        lines.append(f"  {name:<{width}} {help}")
    lines.append("")
    lines.append("Run 'jupyter gpulease <command> --help' for a command's options.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        print(f"jupyter gpulease: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module, func, _ = SUBCOMMANDS[name]
    rc = getattr(importlib.import_module(module), func)(rest)
    return int(rc or 0)


register("demo", "jupyter_gpulease.hub.demo", "main", "run a local JupyterHub with the broker on a simulated GPU pool")
register("broker", "jupyter_gpulease.broker.app", "main", "run the lease broker (normally started by JupyterHub as a service)")
register("pool", "jupyter_gpulease.broker.cli", "pool_main", "show the GPU pool and what is free")
register("leases", "jupyter_gpulease.broker.cli", "leases_main", "list leases (yours; all with the admin scope)")
register("queue", "jupyter_gpulease.broker.cli", "queue_main", "show the queue with positions and ETAs")
register("extend", "jupyter_gpulease.broker.cli", "extend_main", "extend a lease")
register("release", "jupyter_gpulease.broker.cli", "release_main", "release (or withdraw) a lease")
register("cordon", "jupyter_gpulease.broker.health_cli", "cordon_main", "admins: no new grants on a GPU or a node, with a reason")
register("drain", "jupyter_gpulease.broker.health_cli", "drain_main", "admins: cordon a GPU or a node and move its leases to healthy GPUs")
register("uncordon", "jupyter_gpulease.broker.health_cli", "uncordon_main", "admins: put a cordoned GPU or node back into the pool")
register("maintenance", "jupyter_gpulease.broker.health_cli", "maintenance_main", "cordons and maintenance windows; admins add or remove windows")
register("book", "jupyter_gpulease.broker.booking_cli", "book_main", "book GPUs ahead (admins: for other users or a group)")
register("bookings", "jupyter_gpulease.broker.booking_cli", "bookings_main", "list bookings (yours; all with the admin scope)")
register("unbook", "jupyter_gpulease.broker.booking_cli", "unbook_main", "end a booking now")
register("report", "jupyter_gpulease.broker.usage_cli", "main", "GPU-hours held and busy, cost and right-sizing, by user, group, model, tier or notebook")
register("simulate", "jupyter_gpulease.sim.cli", "main", "replay a GPU-cluster trace through the scheduler, policy against policy")

if __name__ == "__main__":
    sys.exit(main())
