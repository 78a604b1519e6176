"""`jupyter gpulease book|bookings|unbook`: GPUs booked ahead, from a terminal.

    jupyter gpulease book --start "tomorrow 9:00" --end "tomorrow 12:00" --gpus 2 --model "A100*"
    jupyter gpulease book --start 18:00 --end 20:00 --share 0.5 --model L4 --title "course lab 3" --group ml-101   # admins
    jupyter gpulease bookings [--user alice]
    jupyter gpulease unbook BOOKING_ID

A user books for themselves; admins for anyone (``--for-user``, repeated) or a group
(``--group``, repeated).
"""

from __future__ import annotations

from .cli import command_parser, fmt_when, parse_until, run_command, table


def _request(args) -> dict:
    req: dict = {"share": args.share} if args.share is not None else {"gpus": args.gpus}
    if args.model:
        req["model"] = args.model
    return req


def book_main(argv: list[str] | None = None) -> int:
    p = command_parser("book", "Book GPUs ahead: they are held for you (or, admins, for the users or groups named) from --start to --end; "
                               "your lease requests in that time take them first.")
    p.add_argument("--start", required=True, type=parse_until, help="its start on the local clock (18:30, 'tomorrow 9:00', 2026-05-02 18:30)")
    p.add_argument("--end", required=True, type=parse_until, help="its end")
    p.add_argument("--gpus", type=int, default=1, help="whole GPUs (default 1)")
    p.add_argument("--model", default=None, help="the GPU model (a glob: 'A100*')")
    p.add_argument("--share", type=float, default=None, help="a share of one GPU instead of whole GPUs (0.25)")
    p.add_argument("--for-user", dest="users", action="append", default=[], help="admins: book for this user (repeat for several)")
    p.add_argument("--group", dest="groups", action="append", default=[], help="admins: book for this group (repeat for several)")
    p.add_argument("--title", default="", help="what it is for ('course ML-101, lab 3')")
    args = p.parse_args(argv)

    async def go(client):
        out = await client.book(start=args.start, end=args.end, request=_request(args), users=args.users, groups=args.groups, title=args.title)
        if not args.json:
            print(f"Booking {out['id']}: {out['summary']}, {fmt_when(out['start'])} to {fmt_when(out['end'])} "
                  f"on {', '.join(sorted({s['gpu_uuid'] for s in out['slices']}))}")
        return out

    return run_command(args, go)


def bookings_main(argv: list[str] | None = None) -> int:
    p = command_parser("bookings", "List bookings: yours (by name or group); everyone's with the admin scope.")
    p.add_argument("--user", default=None, help="admins: only this user's")
    args = p.parse_args(argv)

    async def go(client):
        found = await client.bookings(args.user)
        if args.json:
            return found
        rows = [[b["id"], b["summary"], fmt_when(b["start"]), fmt_when(b["end"]), b["state"] + (f" ({b['reason']})" if b.get("reason") else ""),
                 b.get("title", "")] for b in found]
        print(table(["BOOKING", "WHAT", "FROM", "TO", "STATE", "TITLE"], rows) if rows else "No bookings.")
        return found

    return run_command(args, go)


def unbook_main(argv: list[str] | None = None) -> int:
    p = command_parser("unbook", "End a booking now: its GPUs go back to everyone (a lease running in it keeps its end).")
    p.add_argument("booking", help="the booking's id")
    args = p.parse_args(argv)

    async def go(client):
        out = await client.unbook(args.booking)
        if not args.json:
            print(f"Booking {out['id']} ended ({out['summary']})")
        return out

    return run_command(args, go)
