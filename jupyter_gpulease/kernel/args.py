"""What a `%gpu` line means: subcommands, their options, and one-line errors with the usage.

Pure functions: :func:`parse` turns the text after ``%gpu`` (or ``%%gpu``) into a
:class:`Command`, or raises :class:`UsageError` whose ``str`` is one line saying what is wrong
followed by the usage of the subcommand at fault.
"""

from __future__ import annotations

import argparse
import difflib
import shlex
from dataclasses import dataclass, field
from typing import Any

from ..core.text import parse_duration

# subcommand -> (arguments, one-line help); the order is the order of `%gpu help`
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "status": ("", "your lease, its devices (utilization, memory, temperature, power), time left, warnings, this kernel's GPU use"),
    "watch": ("", "a live widget (in a terminal: a status line every 2 s until Ctrl-C)"),
    "request": ("[--gpus N | --share F | --mig PROFILE] [--model M] [--tier T] [--for 2h] [--wait]",
                "ask for a lease for this server; --wait waits until it is granted (Ctrl-C/interrupt withdraws)"),
    "extend": ("DURATION", "ask for more time, e.g. %gpu extend 30m"),
    "keep": ("DURATION | off", "keep the GPU although it sits idle (no idle reclaim) for a while, e.g. %gpu keep 1h; off ends a keep"),
    "resume": ("", "bring a suspended or reclaimed kernel back onto a GPU now"),
    "release": ("[--force]", "give the GPU back now (a queued request is withdrawn); --force even while kernels hold GPU memory"),
    "queue": ("", "the queue: positions, ETAs, who waits for what"),
    "pool": ("", "the GPU pool: models, what is free, your quota, the tiers"),
    "help": ("", "this help"),
}
CELL_USAGE = "%%gpu [--gpus N | --share F | --mig PROFILE] [--model M] [--tier T] [--for 1h] [--keep]"
CELL_HELP = ("holds a lease only while the cell runs: asks for one (waiting in the queue), runs the cell, releases it; "
             "with a lease already held, the cell runs on it. --keep keeps a lease it asked for after the cell.")


class UsageError(ValueError):
    """A `%gpu` line that cannot be understood: ``message`` says what, ``usage`` how to write it."""

    def __init__(self, message: str, usage: str):
        super().__init__(message)
        self.message = message
        self.usage = usage

    def __str__(self) -> str:
        return f"{self.message}\nusage: {self.usage}"


@dataclass(frozen=True)
class Command:
    """One parsed `%gpu` line."""

    name: str
    duration_s: float | None = None  # extend / keep: how much
    request: dict[str, Any] = field(default_factory=dict)  # request / %%gpu: the lease request body
    wait: bool = False  # request --wait
    keep: bool = False  # %%gpu --keep
    force: bool = False  # release --force


def usage(name: str) -> str:
    args, _ = SUBCOMMANDS[name]
    return f"%gpu {name} {args}".rstrip()


def help_text() -> str:
    lines = ["%gpu: your GPU lease from inside the notebook", ""]
    width = max(len(usage(n)) for n in SUBCOMMANDS if len(usage(n)) < 40)
    for name, (_, text) in SUBCOMMANDS.items():
        u = usage(name)
        if len(u) > width:
            lines.append(f"  {u}")
            lines.append(f"  {'':<{width}}  {text}")
        else:
            lines.append(f"  {u:<{width}}  {text}")
    lines += ["", f"  {CELL_USAGE}", f"  {'':<{width}}  {CELL_HELP}", "",
              "Durations as you would write them: 90m, 2h, 1h30m, 45s (a bare number is seconds).",
              "`%gpu` alone is `%gpu status`."]
    return "\n".join(lines)


class _Parser(argparse.ArgumentParser):
    """argparse that raises UsageError instead of printing and exiting."""

    def __init__(self, name: str, usage_line: str):
        super().__init__(prog=name, add_help=False, allow_abbrev=False)
        self._usage_line = usage_line

    def error(self, message: str):
        raise UsageError(_plain(message), self._usage_line)


def _plain(message: str) -> str:
    # argparse words its errors for shells ("argument --gpus: invalid int value: 'x'"); keep them, minus noise
    return message.replace("the following arguments are required: ", "missing ").rstrip(".")


def _positive_int(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--gpus wants a whole number of GPUs, not {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"--gpus must be at least 1, not {n}")
    return n


def _share(text: str) -> float:
    try:
        f = float(text.rstrip("%")) / (100 if text.endswith("%") else 1)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--share wants a fraction of one GPU such as 0.5 or 25%, not {text!r}") from None
    if not 0 < f < 1:
        raise argparse.ArgumentTypeError(f"--share must be between 0 and 1 (a part of one GPU; ask for --gpus 1 for a whole one), not {text}")
    return f


def _duration(text: str) -> float:
    try:
        d = parse_duration(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if d <= 0:
        raise argparse.ArgumentTypeError(f"a duration must be longer than 0, not {text!r}")
    return d


def _request_parser(name: str, usage_line: str, *, cell: bool) -> _Parser:
    p = _Parser(name, usage_line)
    what = p.add_mutually_exclusive_group()
    what.add_argument("--gpus", type=_positive_int)
    what.add_argument("--share", type=_share)
    what.add_argument("--mig")
    p.add_argument("--model")
    p.add_argument("--tier")
    p.add_argument("--for", dest="duration", type=_duration)
    if cell:
        p.add_argument("--keep", action="store_true")
    else:
        p.add_argument("--wait", action="store_true")
    return p


def request_body(ns: argparse.Namespace) -> dict[str, Any]:
    """The lease request the options ask for, in the broker's words (``Request.from_dict``)."""
    body: dict[str, Any] = {}
    if ns.share is not None:
        body.update(kind="share", share=ns.share)
    elif ns.mig:
        body.update(kind="mig", mig_profile=ns.mig)
    else:
        body.update(kind="gpu", gpus=ns.gpus or 1)
    if ns.model:
        body["model"] = [m for m in ns.model.split(",") if m]
    if ns.tier:
        body["tier"] = ns.tier
    if ns.duration is not None:
        body["duration_s"] = ns.duration
    return body


def _split(line: str, usage_line: str) -> list[str]:
    try:
        return shlex.split(line)
    except ValueError as e:
        raise UsageError(f"cannot read the line: {e}", usage_line) from None


def parse(line: str) -> Command:
    """``%gpu`` line → :class:`Command`; :class:`UsageError` when it makes no sense."""
    words = _split(line, "%gpu help")
    if not words:
        return Command("status")
    name, rest = words[0], words[1:]
    if name in ("-h", "--help", "?"):
        return Command("help")
    if name not in SUBCOMMANDS:
        close = difflib.get_close_matches(name, list(SUBCOMMANDS), n=1, cutoff=0.6)
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise UsageError(f"unknown subcommand {name!r}{hint}", "%gpu [" + "|".join(SUBCOMMANDS) + "] ...  (%gpu help)")
    u = usage(name)
    if rest and rest[0] in ("-h", "--help"):
        return Command("help")
    if name == "request":
        ns = _request_parser("request", u, cell=False).parse_args(rest)
        return Command("request", request=request_body(ns), wait=ns.wait)
    if name in ("extend", "keep"):
        if not rest:
            raise UsageError(f"say for how long, e.g. %gpu {name} {'30m' if name == 'extend' else '1h'}", u)
        if len(rest) > 1:
            raise UsageError(f"one duration only, got {' '.join(rest)!r}", u)
        if name == "keep" and rest[0].lower() == "off":
            return Command("keep", duration_s=0.0)  # ends the keep in force
        try:
            return Command(name, duration_s=_duration(rest[0]))
        except argparse.ArgumentTypeError as e:
            raise UsageError(str(e) + ("; %gpu keep off ends a keep" if name == "keep" else ""), u) from None
    if name == "release" and rest == ["--force"]:
        return Command("release", force=True)
    if rest:
        raise UsageError(f"%gpu {name} takes no arguments, got {' '.join(rest)!r}", u)
    return Command(name)


def parse_cell(line: str) -> Command:
    """The ``%%gpu`` line → :class:`Command` named ``cell``."""
    ns = _request_parser("%%gpu", CELL_USAGE, cell=True).parse_args(_split(line, CELL_USAGE))
    return Command("cell", request=request_body(ns), keep=ns.keep)
