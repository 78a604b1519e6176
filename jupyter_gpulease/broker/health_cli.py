"""`jupyter gpulease cordon|drain|uncordon|maintenance`: GPU health and maintenance from a terminal.

    jupyter gpulease cordon --node gpu-07 --reason "fan replacement"
    jupyter gpulease drain --device GPU-1234… --reason "XID 48 seen by the vendor's tool"
    jupyter gpulease uncordon --node gpu-07
    jupyter gpulease maintenance                       # cordons and windows to come
    jupyter gpulease maintenance add --node gpu-07 --from "tomorrow 12:00" --to "tomorrow 14:00" --reason "BIOS update"
    jupyter gpulease maintenance rm WINDOW_ID

Cordon, drain, uncordon and windows need the admin scope; reasons are what users read (on the
spawn form, in the queue and in their notebooks).
"""

from __future__ import annotations

from .cli import command_parser, fmt_when, parse_until, run_command, table


def _target(p) -> None:
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--node", help="a node of the pool")
    g.add_argument("--device", help="a GPU's UUID (GPU-…)")


def _kind(args) -> tuple[str, str]:
    return ("node", args.node) if args.node else ("device", args.device)


def _cordon(name: str, drain: bool, argv) -> int:
    what = ("Drain: no new grants on a GPU or a node, and move the leases on it to healthy GPUs (their kernels are suspended first)"
            if drain else "Cordon: no new grants on a GPU or a node; the leases on it run to their end")
    p = command_parser(name, what + ". Needs the admin scope.")
    _target(p)
    p.add_argument("--reason", required=True, help="what users read on the spawn form and in their notebooks")
    args = p.parse_args(argv)

    async def go(client):
        kind, target = _kind(args)
        out = await client.cordon(kind, target, args.reason, drain=drain)
        if not args.json:
            print(f"{'Drained' if drain else 'Cordoned'} {kind} {out['name']}: {out['reason']}")
        return out

    return run_command(args, go)


def cordon_main(argv: list[str] | None = None) -> int:
    return _cordon("cordon", False, argv)


def drain_main(argv: list[str] | None = None) -> int:
    return _cordon("drain", True, argv)


def uncordon_main(argv: list[str] | None = None) -> int:
    p = command_parser("uncordon", "Put a cordoned GPU or node back into the pool (a cordon by its health too). Needs the admin scope.")
    _target(p)
    args = p.parse_args(argv)

    async def go(client):
        kind, target = _kind(args)
        out = await client.uncordon(kind, target)
        if not args.json:
            print(f"Uncordoned {kind} {out['name']} (it was: {out['reason']})")
        return out

    return run_command(args, go)


def maintenance_main(argv: list[str] | None = None) -> int:
    p = command_parser("maintenance", "Show cordoned GPUs and nodes and the maintenance windows to come; add or remove a window (admins).")
    sub = p.add_subparsers(dest="action")
    add = sub.add_parser("add", help="a window: no lease is granted that would run into it")
    _target(add)
    add.add_argument("--from", dest="start", required=True, type=parse_until, help="its start on the local clock (18:30, 'tomorrow 9:00', 2026-05-02 18:30)")
    add.add_argument("--to", dest="end", required=True, type=parse_until, help="its end")
    add.add_argument("--reason", required=True, help="what users read")
    rm = sub.add_parser("rm", help="remove a window")
    rm.add_argument("window", help="the window's id")
    args = p.parse_args(argv)

    async def go(client):
        if args.action == "add":
            kind, target = _kind(args)
            out = await client.add_maintenance(start=args.start, end=args.end, reason=args.reason,
                                               devices=[target] if kind == "device" else [], nodes=[target] if kind == "node" else [])
            if not args.json:
                print(f"Maintenance window {out['id']}: {fmt_when(out['start'])} to {fmt_when(out['end'])} on {kind} {target}: {out['reason']}")
            return out
        if args.action == "rm":
            out = await client.delete_maintenance(args.window)
            if not args.json:
                print(f"Removed maintenance window {out['id']} ({out['reason']})")
            return out
        state = await client.health()
        if args.json:
            return state
        rows = [[c["kind"], c["name"], c["mode"].replace("_", " "), c["source"] + (" (held)" if c["hold"] and c["source"] == "admin" else ""),
                 fmt_when(c["since"]), c["reason"]] for c in state.get("cordons", [])]
        print(table(["KIND", "NAME", "MODE", "BY", "SINCE", "REASON"], rows) if rows else "No GPU or node is cordoned.")
        print()
        rows = [[w["id"], fmt_when(w["start"]), fmt_when(w["end"]), ", ".join(w["devices"] + [f"node {n}" for n in w["nodes"]]), w["reason"]]
                for w in state.get("maintenance", [])]
        print(table(["WINDOW", "FROM", "TO", "ON", "REASON"], rows) if rows else "No maintenance window to come.")
        return state

    return run_command(args, go)
