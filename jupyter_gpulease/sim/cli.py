"""`jupyter gpulease simulate`: replay a trace through the core scheduler, policy against policy."""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace
from typing import Any

from . import policies as P
from .bookings import bookings_line, draw_bookings, load_bookings_csv, not_applied
from .replay import replay
from .report import plot, plot_tradeoff, summarize, table, write_json
from .traces import (
    ALIBABA_NODES,
    ALIBABA_PODS,
    NOTEBOOK,
    SAMPLE_FILES,
    TraceError,
    default_traces_dir,
    detect_format,
    load_alibaba_nodes,
    load_alibaba_pods,
    load_notebook_events,
)
from .workload import alibaba_workload, describe_pool, notebook_sessions, pool_from_inventory, uniform_pool


def _window(s: str | None) -> tuple[float | None, float | None]:
    if not s:
        return (None, None)
    try:
        a, b = s.split(":")
        return (float(a) if a else None, float(b) if b else None)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--window-days must look like START:END in trace days (either may be empty), got {s!r}") from None


def _floats(s: str) -> list[float]:
    try:
        return [float(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {s!r}") from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="jupyter gpulease simulate",
        description="Replay a GPU-cluster trace through the gpulease scheduler and compare policies side by side.",
    )
    p.add_argument("--trace", default="alibaba", help="'alibaba', 'notebook' (the samples shipped with the package) or the path of a CSV in one of those formats (default: alibaba)")
    p.add_argument("--traces-dir", default=None, help="folder of the trace samples (default: $GPULEASE_TRACES, else the samples shipped in jupyter_gpulease/sim/samples)")
    p.add_argument("--nodes", default=None, help="Alibaba node inventory CSV to draw the pool from (default: the one shipped with the samples)")
    p.add_argument("--pool-nodes", type=int, default=8, help="nodes in the simulated pool (default 8)")
    p.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node; inventory nodes with this many GPUs are drawn (default 8)")
    p.add_argument("--models", default="", help="comma-separated GPU models to draw from the inventory (default: any)")
    p.add_argument("--seed", type=int, default=0, help="seed of the node draw and of --book-fraction's draw (default 0)")
    p.add_argument("--compress", type=float, default=1.0, help="divide inter-arrival times by this (held times unchanged; default 1)")
    p.add_argument("--window-days", type=_window, default=(None, None), help="keep arrivals in START:END trace days")
    p.add_argument("--limit", type=int, default=None, help="keep only the first N jobs/sessions (quick runs)")
    p.add_argument("--policies", default=",".join(P.DEFAULT_POLICIES), help=f"built-in policies to compare (default: {','.join(P.DEFAULT_POLICIES)})")
    p.add_argument(
        "--share-placement",
        choices=("best_fit", "fragmentation"),
        default=None,
        help="gpulease: where shares go among the GPUs that fit (Policy.share_placement; default: the core default, best_fit)",
    )
    p.add_argument("--policy-file", action="append", default=[], help="TOML/JSON file of more policies ([[policy]] tables); repeatable")
    p.add_argument(
        "--server-config",
        action="append",
        default=[],
        metavar="FILE",
        help="a jupyter_server_config.py: also replay gpulease with the idle reclaim it configures (c.GPUIdleRule, c.ReclaimActions, "
        "or the older c.GPULeaseExtension names); repeatable",
    )
    p.add_argument("--linger-min", type=float, default=60.0, help="notebook: minutes a session keeps its GPU after its last burst (ASSUMPTION; default 60)")
    p.add_argument("--session-gap-min", type=float, default=None, help="notebook: a gap longer than this ends a session (ASSUMPTION; default: the linger)")
    p.add_argument("--culler-timeout-min", type=float, default=30.0, help="static+culler: idle minutes before a server is culled (default 30)")
    p.add_argument("--idle-sweep", type=_floats, default=None, help="notebook: also run gpulease with these fixed idle timeouts (minutes) and plot the price curves")
    p.add_argument("--horizon-days", type=float, default=None, help="stop this many simulated days after the last arrival (default: run until all work is done)")
    p.add_argument(
        "--no-requeue-expired",
        dest="requeue_expired",
        action="store_false",
        default=True,
        help="batch pods cut by a time limit lose the rest of their work (default: their user resubmits the rest, as after a preemption)",
    )
    p.add_argument("--bookings", default=None, metavar="FILE",
                   help="a CSV of bookings (header owner,start_s,end_s,request): owner as the replay names a job's user "
                        "(session-<job_id> on the notebook trace, the pod's name on Alibaba), times in seconds on the replay's clock, "
                        "request as %%gpu request takes it ('2 A100', '0.25 A100', '--gpus 1'); only the gpulease policies take them")
    p.add_argument("--book-fraction", type=float, default=None, metavar="F",
                   help="book the first request of this random fraction of the owners (seeded by --seed), for its shape and its held time "
                        "on the trace; needs --book-ahead")
    p.add_argument("--book-ahead", type=float, default=None, metavar="S", help="with --book-fraction: each booking is made S seconds before its request")
    p.add_argument("--usage-db", default=None, metavar="FILE",
                   help="write the usage records of the first policy's replay into a store at this SQLite path (read it with "
                        "'jupyter gpulease report --db sqlite:///FILE')")
    p.add_argument("--json", default=None, help="write all results as JSON here")
    p.add_argument("--plots", default=None, help="write PNG plots with this path prefix (PREFIX_timeline.png, PREFIX_wait_cdf.png, …)")
    p.add_argument("--progress", dest="progress", action="store_true", default=None, help="show a progress bar (default: when stderr is a terminal)")
    p.add_argument("--no-progress", dest="progress", action="store_false")
    return p


def _trace_path(args) -> tuple[str, str]:
    """(path, format) of the workload trace."""
    if args.trace in ("alibaba", "notebook"):
        d = args.traces_dir or default_traces_dir()
        path = os.path.join(d, SAMPLE_FILES[args.trace])
        if not os.path.exists(path):
            raise TraceError(path, f"the trace sample is not there; pass --traces-dir or set GPULEASE_TRACES to a folder that has it (looked in {d})")
        return path, ALIBABA_PODS if args.trace == "alibaba" else NOTEBOOK
    fmt = detect_format(args.trace)
    if fmt == ALIBABA_NODES:
        raise TraceError(args.trace, "this is a node inventory; give it with --nodes and a pod list with --trace", line=1)
    return args.trace, fmt


def _policies(args, batch: bool = False) -> list[P.SimPolicy]:
    out = []
    for name in [n.strip() for n in args.policies.split(",") if n.strip()]:
        if name not in P.BUILTIN:
            raise ValueError(f"--policies: unknown policy {name!r}; built-ins: {', '.join(P.BUILTIN)}")
        if name == "static+culler":
            out.append(P.static_culler(args.culler_timeout_min * 60))
        else:
            sp = P.for_trace(name, batch)
            if args.share_placement and not sp.whole_gpus:
                sp = replace(sp, policy=replace(sp.policy, share_placement=args.share_placement), description=sp.description + f"; share placement {args.share_placement}")
            out.append(sp)
    for f in args.policy_file:
        out.extend(P.load_policy_file(f))
    for f in args.server_config:
        label = os.path.splitext(os.path.basename(f))[0]
        out.append(P.from_server_config(f, name="server-config" if len(args.server_config) == 1 else f"server-config:{label}"))
    names = [sp.name for sp in out]
    dup = {n for n in names if names.count(n) > 1}
    if dup:
        raise ValueError(f"policy names must be unique; repeated: {', '.join(sorted(dup))}")
    return out


def _bookings(args, wl, linger_s: float):
    """The bookings to replay (None: none asked for)."""
    drawn = args.book_fraction is not None or args.book_ahead is not None
    if args.bookings and drawn:
        raise ValueError("give either --bookings FILE or --book-fraction/--book-ahead, not both")
    if args.bookings:
        return load_bookings_csv(args.bookings)
    if drawn:
        if args.book_fraction is None or args.book_ahead is None:
            raise ValueError("--book-fraction and --book-ahead go together")
        return draw_bookings(wl, args.book_fraction, args.book_ahead, args.seed, linger_s=linger_s)
    return None


def run(args) -> dict[str, Any]:
    path, fmt = _trace_path(args)
    linger_s = args.linger_min * 60
    if fmt == ALIBABA_PODS:
        pods = load_alibaba_pods(path)
        wl = alibaba_workload(pods, compress=args.compress, window_days=args.window_days, limit=args.limit)
        nodes_path = args.nodes or os.path.join(args.traces_dir or default_traces_dir(), SAMPLE_FILES["alibaba-nodes"])
        nodes = load_alibaba_nodes(nodes_path)
        models = [m for m in args.models.split(",") if m]
        pool = pool_from_inventory(nodes, n_nodes=args.pool_nodes, gpus_per_node=args.gpus_per_node, models=models or None, seed=args.seed)
        pool_note = f"{args.pool_nodes} nodes x {args.gpus_per_node} GPUs drawn (seed {args.seed}) from {os.path.basename(nodes_path)}"
    else:
        events = load_notebook_events(path)
        gap = (args.session_gap_min if args.session_gap_min is not None else args.linger_min) * 60
        wl = notebook_sessions(events, session_gap_s=gap, compress=args.compress, window_days=args.window_days, limit=args.limit)
        pool = uniform_pool(args.pool_nodes, args.gpus_per_node)
        pool_note = f"ASSUMPTION: {args.pool_nodes} identical nodes x {args.gpus_per_node} GPUs (the notebook trace has no inventory)"
        wl.assumptions.notes.append(f"ASSUMPTION: a session keeps its GPU {args.linger_min:g} min after its last burst unless an idle rule takes it earlier.")
        wl.assumptions.knobs["linger_s"] = linger_s
        wl.assumptions.notes.append(
            "ASSUMPTION: each session stands for a user with no earlier idle gaps (the trace names no users): a learnt idle timeout "
            "starts from gpu_idle_timeout in each session, as for a new user of the server extension (whose gaps file carries over "
            "from one session to the next). The trace's bursts are GPU use, its gaps GPU idleness: gpu_idle_threshold has no role."
        )
    if fmt == ALIBABA_PODS:
        wl.assumptions.notes.append(
            "ASSUMPTION: a pod cut by its time limit is resubmitted by its user for the rest of its work (a new request, it queues again)."
            if args.requeue_expired
            else "ASSUMPTION: a pod cut by its time limit loses the rest of its work."
        )
        wl.assumptions.notes.append("Idle culler: the Alibaba trace records no idleness, so the culler never fires there (same as static+backfill).")
        wl.assumptions.notes.append(
            f"ASSUMPTION: gpulease gives a preempted pod (learning tier, QoS BE) {P.BATCH_GRACE_S:g} s to stop, as Kubernetes does by default "
            "(terminationGracePeriodSeconds); the notebook trace keeps the core's 10 min, time for a person to save work."
        )
        wl.assumptions.notes.append(
            f"CHOICE: gpulease's production and experiment leases of batch pods run in {P.BATCH_STEP_S / 3600:g}-hour steps, renewed while nobody "
            "entitled to their GPUs waits (the core default is up to 24 h): without preempting non-preemptible work, a node drains for a "
            "multi-GPU pod only as fast as its leases' steps end. benchmarks/sim/step_sweep.py shows other steps."
        )
    if not wl.jobs:
        raise ValueError("no jobs left after filtering (check --window-days and --limit)")
    bookings = _bookings(args, wl, linger_s)
    horizon = args.horizon_days * 86400 if args.horizon_days is not None else None
    sps = _policies(args, batch=fmt == ALIBABA_PODS)
    results, summaries = [], []
    usage_db = None
    for sp in sps:
        if args.usage_db and usage_db is None:  # the first policy's records, through the broker's recorder
            from .replay import Replay
            from .usagedb import UsageDB

            usage_db = UsageDB(args.usage_db)
            rp = Replay(wl, pool, sp, linger_s=linger_s, horizon_s=horizon, progress=args.progress, requeue_expired=args.requeue_expired,
                        on_event=usage_db.on_event, on_busy=usage_db.on_busy, bookings=bookings)
            usage_db.replay = rp
            r = rp.run()
            usage_db.written = {"policy": sp.name, **usage_db.finish(r)}
        else:
            r = replay(wl, pool, sp, linger_s=linger_s, horizon_s=horizon, progress=args.progress, requeue_expired=args.requeue_expired,
                       bookings=bookings)
        results.append(r)
        s = summarize(r)
        if bookings is not None:
            s["bookings"] = r.bookings if r.bookings is not None else not_applied(sp.name)
        summaries.append(s)
    doc: dict[str, Any] = {
        "trace": os.path.basename(path),
        "format": fmt,
        "pool": {**describe_pool(pool), "how": pool_note},
        "workload": {"jobs": len(wl.jobs), "excluded": wl.excluded, "span_s": list(wl.span)},
        "assumptions": wl.assumptions.to_dict(),
        "policies": [sp.to_dict() for sp in sps],
        "results": summaries,
    }
    if bookings is not None:
        doc["bookings"] = {"source": args.bookings or f"--book-fraction {args.book_fraction:g} --book-ahead {args.book_ahead:g} --seed {args.seed}",
                           "n": len(bookings)}
    if usage_db is not None:
        doc["usage_db"] = usage_db.written
    sweep_results = []
    if args.idle_sweep and fmt == NOTEBOOK:
        points = []
        base = P.gpulease()
        for minutes in args.idle_sweep:
            fixed = base.idle_settings.changed(gpu_idle_timeout=minutes * 60, gpu_idle_timeout_learn=False)
            sp = replace(base, name=f"gpulease-idle{minutes:g}m", idle_settings=fixed)
            r = replay(wl, pool, sp, linger_s=linger_s, horizon_s=horizon, progress=args.progress, requeue_expired=args.requeue_expired)
            s = summarize(r)
            sweep_results.append(s)
            points.append({"kind": "fixed", "label": sp.name, "timeout_s": minutes * 60, **s["notebook"]})
        for s, sp in zip(summaries, sps):
            if "notebook" in s and sp.idle_learns:
                points.append({"kind": "learnt", "label": f"{sp.name} (learnt timeout)", "timeout_s": None, **s["notebook"]})
            elif "notebook" in s and not sp.idle_active:
                points.append({"kind": "none", "label": f"{sp.name} (no reclaim)", "timeout_s": None, **s["notebook"]})
        doc["idle_sweep"] = {"points": points, "results": sweep_results}
        if args.plots:
            doc.setdefault("plots", []).append(plot_tradeoff(points, f"{args.plots}_idle_tradeoff.png", "notebook trace: price of idle reclaim"))
    if args.plots:
        title = f"{os.path.basename(path)}: {len(pool)} GPUs, arrivals x{args.compress:g}"
        doc.setdefault("plots", []).extend(plot(results, args.plots, title))
    doc["_results"] = results
    return doc


def render(doc: dict[str, Any]) -> str:
    lines = [f"trace: {doc['trace']} ({doc['format']}), {doc['workload']['jobs']} jobs; left out: {doc['workload']['excluded']}"]
    pool = doc["pool"]
    lines.append(f"pool: {pool['gpus']} GPUs on {pool['nodes']} nodes {pool['models']} -- {pool['how']}")
    a = doc["assumptions"]
    lines.append(f"arrival compression: {a['compress']:g}x; knobs: {a['knobs']}")
    lines += [f"  - {n}" for n in a["notes"]]
    for sp in doc["policies"]:
        lines.append(f"policy {sp['name']}: {sp['description']}; idle: {sp['idle']}")
    lines.append("")
    lines.append(table(doc["results"]))
    if "bookings" in doc:
        lines.append("")
        lines.append(f"bookings ({doc['bookings']['source']}):")
        for s in doc["results"]:
            lines.append(f"  {s['policy']}: {bookings_line(s['bookings'])}")
    if "idle_sweep" in doc:
        lines.append("")
        lines.append("idle-timeout sweep (gpulease, notebook trace):")
        lines.append(f"  {'timeout':<28}{'busy/held med':>14}{'regretted':>11}{'return wait':>13}{'wait/cell':>11}")
        for p in doc["idle_sweep"]["points"]:
            lab = f"{p['timeout_s'] / 60:g} min" if p["timeout_s"] is not None else p["label"]
            lines.append(
                f"  {lab:<28}{(p['busy_held_per_session_median'] or 0):>14.3f}{100 * p['regretted_share']:>10.1f}%"
                f"{p['returning_wait_mean_s']:>12.0f}s{p['wait_per_burst_mean_s']:>10.1f}s"
            )
    if doc.get("plots"):
        lines.append("")
        lines += [f"plot: {f}" for f in doc["plots"]]
    if doc.get("usage_db"):
        u = doc["usage_db"]
        lines.append(f"usage records: {u['leases']} leases of {u['policy']} in {u['usage_db']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        doc = run(args)
    except TraceError as e:
        print(f"jupyter gpulease simulate: error: {e}", file=sys.stderr)
        return 2
    except (ValueError, OSError) as e:
        print(f"jupyter gpulease simulate: error: {e}", file=sys.stderr)
        return 2
    doc.pop("_results", None)
    print(render(doc))
    if args.json:
        write_json(args.json, doc)
        print(f"json: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
