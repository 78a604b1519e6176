"""Figures from replay results: per-policy metrics, the terminal table, JSON and PNG plots."""

from __future__ import annotations

import json
import os
from typing import Any

from ..core.text import format_figure, format_table
from .metrics import jain, mean, median, percentile, share_within, wait_summary
from .replay import ReplayResult

TEN_MIN = 600.0


def summarize(r: ReplayResult) -> dict[str, Any]:
    """Every metric of one policy's replay, JSON-ready (times in seconds)."""
    recs = r.records
    start, last_arrival = r.span
    window_end = max(last_arrival, start + 1.0)
    served = [x for x in recs if x.first_wait is not None]
    waits = [x.first_wait for x in served]
    never = [x for x in recs if x.first_wait is None]
    by_qos: dict[str, list[float]] = {}
    for x in served:
        by_qos.setdefault(x.job.qos or "-", []).append(x.first_wait)
    multi = [x.first_wait for x in served if x.job.multi_gpu]
    single = [x.first_wait for x in served if not x.job.multi_gpu]
    held = sum(x.held_s for x in recs)
    busy = sum(x.busy_s for x in recs)
    # Jain's index over each job's service ratio: busy time / (busy time + time spent waiting)
    ratios = []
    for x in served:
        w = sum(x.waits)
        b = x.job.busy_s if x.job.kind == "batch" else x.busy_s / max(x.job.gpus, 1e-9)
        ratios.append(b / (b + w) if b + w > 0 else 1.0)
    out: dict[str, Any] = {
        "policy": r.policy.name,
        "description": r.policy.description,
        "pool_gpus": r.pool_gpus,
        "jobs": len(recs),
        "served": len(served),
        "never_served": len(never),
        "refused": sum(1 for x in recs if x.refused),
        "gpus_allocated_mean": r.allocated.time_mean(start, window_end),
        "gpus_busy_mean": r.busy.time_mean(start, window_end),
        "queue_length_mean": r.queue.time_mean(start, window_end),
        "busy_held_ratio": busy / held if held > 0 else None,
        "wait": wait_summary(waits),
        "started_within_10min": share_within(waits + [float("inf")] * len(never), TEN_MIN),
        "wait_multi_gpu": wait_summary(multi),
        "wait_single_or_share": wait_summary(single),
        "wait_by_qos": {q: wait_summary(v) for q, v in sorted(by_qos.items())},
        "preemptions": sum(x.preempted for x in recs),
        "expired_before_done": sum(x.expired for x in recs),
        "extensions": sum(x.extensions for x in recs),
        "extensions_refused": sum(x.extensions_refused for x in recs),
        "gpu_hours_held": held / 3600,
        "gpu_hours_busy": busy / 3600,
        "jain_fairness": jain(ratios),
        "makespan_s": r.end_time - start,
        "replay": {
            "events": r.events,
            "scheduler_events": r.scheduler_events,
            "ticks": r.ticks,
            "wall_s": r.wall_s,
            "events_per_s": r.events_per_s,
        },
        "counters": dict(r.counters),
    }
    batch = [x for x in recs if x.job.kind == "batch"]
    if batch:
        lost = sum(max(0.0, x.job.work_s - x.work_done_s) * x.job.gpus for x in batch if x.expired)
        out["work_lost_gpu_hours"] = lost / 3600
        out["requeued_after_expiry"] = r.counters.get("requeued", 0)
        # completion time (arrival to last work done) counts every re-queue's wait
        rw = [w for x in batch for w in x.return_waits]
        out["resubmit_waits"] = len(rw)
        out["resubmit_wait_mean_s"] = mean(rw) if rw else 0.0
        # every wait of a pod added up (its first wait and each wait after a preemption or a
        # time-limit cut): what it lost in all to queueing, the honest counterpart of the first
        # wait when a policy cuts running work
        served_batch = [x for x in batch if x.first_wait is not None]
        total = [sum(x.waits) for x in served_batch]
        out["wait_total"] = wait_summary(total)
        out["total_wait_within_10min"] = share_within(total + [float("inf")] * (len(batch) - len(served_batch)), TEN_MIN)
        out["wait_total_multi_gpu"] = wait_summary([sum(x.waits) for x in served_batch if x.job.multi_gpu])
    sessions = [x for x in recs if x.job.kind == "session"]
    if sessions:
        per = [x.busy_s / x.held_s for x in sessions if x.held_s > 0]
        reclaims = sum(x.reclaims for x in sessions)
        regretted = sum(x.regretted for x in sessions)
        bursts = sum(len(x.job.bursts) for x in sessions)
        returning = [w for x in sessions for w in x.return_waits]
        all_waits = [w for x in sessions for w in x.waits]
        resumes = [d for x in sessions for d in x.resume_delays]
        out["notebook"] = {
            "sessions": len(sessions),
            "bursts": bursts,
            "busy_held_per_session_median": median(per),
            "busy_held_per_session_p25": percentile(per, 25),
            "reclaims": reclaims,
            "regretted_reclaims": regretted,
            "regretted_share": regretted / reclaims if reclaims else 0.0,
            "returning_waits": len(returning),
            "returning_wait_mean_s": mean(returning) if returning else 0.0,
            "returning_wait_p95_s": percentile(returning, 95) if returning else 0.0,
            "session_start_wait_mean_s": mean(waits),
            # every wait a user sat through before a cell could run, spread over all cells
            "wait_per_burst_mean_s": sum(all_waits) / bursts if bursts else 0.0,
            "expired_or_preempted_sessions": sum(1 for x in sessions if x.expired or x.preempted),
            # a cell that comes back after an idle reclaim: its wait for a GPU plus the time its
            # kernel takes to come back (restore after a suspend, setting up again after a restart)
            "reclaim_action": r.policy.reclaim_action,
            "resume_delays": len(resumes),
            "resume_delay_mean_s": mean(resumes) if resumes else 0.0,
            "resume_delay_p95_s": percentile(resumes, 95) if resumes else 0.0,
            "kernel_state_lost": sum(x.state_lost for x in sessions),
        }
    return out


def _fmt(v: Any, pct: bool = False) -> str:
    if v is None:
        return "-"
    if pct:
        return f"{100 * v:.1f}%"
    if isinstance(v, float):
        return f"{v:.2f}"
    return str(v)


def table(summaries: list[dict[str, Any]]) -> str:
    """The side-by-side terminal table."""
    rows: list[tuple[str, Any]] = [
        ("GPUs allocated (mean)", lambda s: _fmt(s["gpus_allocated_mean"])),
        ("GPUs busy (mean)", lambda s: _fmt(s["gpus_busy_mean"])),
        ("busy/held", lambda s: _fmt(s["busy_held_ratio"])),
        ("queue length (mean)", lambda s: _fmt(s["queue_length_mean"])),
        ("wait mean", lambda s: format_figure(s["wait"]["mean_s"])),
        ("wait p50", lambda s: format_figure(s["wait"]["p50_s"])),
        ("wait p95", lambda s: format_figure(s["wait"]["p95_s"])),
        ("wait p99", lambda s: format_figure(s["wait"]["p99_s"])),
        ("started within 10 min", lambda s: _fmt(s["started_within_10min"], pct=True)),
        ("multi-GPU wait mean", lambda s: format_figure(s["wait_multi_gpu"]["mean_s"])),
        ("multi-GPU wait p95", lambda s: format_figure(s["wait_multi_gpu"]["p95_s"])),
        ("never served", lambda s: _fmt(s["never_served"])),
        ("preemptions", lambda s: _fmt(s["preemptions"])),
        ("expired before done", lambda s: _fmt(s["expired_before_done"])),
        ("  of them re-queued", lambda s: _fmt(s.get("requeued_after_expiry", 0))),
    ]
    if any("wait_total" in s for s in summaries):
        tot = lambda k: (lambda s: format_figure(s.get("wait_total", {}).get(k)))  # noqa: E731
        rows += [
            ("waits after a cut (n)", lambda s: _fmt(s.get("resubmit_waits"))),
            ("  their mean", lambda s: format_figure(s.get("resubmit_wait_mean_s"))),
            ("all waits of a pod: mean", tot("mean_s")),
            ("all waits of a pod: p95", tot("p95_s")),
            ("all waits within 10 min", lambda s: _fmt(s.get("total_wait_within_10min"), pct=True)),
            ("multi-GPU all waits p95", lambda s: format_figure(s.get("wait_total_multi_gpu", {}).get("p95_s"))),
        ]
    rows += [
        ("work lost (GPU-h)", lambda s: _fmt(s.get("work_lost_gpu_hours"))),
        ("Jain fairness", lambda s: _fmt(s["jain_fairness"])),
    ]
    qos = sorted({q for s in summaries for q in s["wait_by_qos"]})
    for q in qos:
        rows.append((f"wait mean [{q}]", lambda s, q=q: format_figure(s["wait_by_qos"].get(q, {}).get("mean_s"))))
        rows.append((f"wait p95 [{q}]", lambda s, q=q: format_figure(s["wait_by_qos"].get(q, {}).get("p95_s"))))
    if any("notebook" in s for s in summaries):
        nb = lambda k, f=_fmt: (lambda s: f(s.get("notebook", {}).get(k)))  # noqa: E731
        rows += [
            ("busy/held per session (median)", nb("busy_held_per_session_median")),
            ("reclaims", nb("reclaims")),
            ("regretted reclaims", nb("regretted_share", lambda v: _fmt(v, pct=True))),
            ("returning wait mean", nb("returning_wait_mean_s", format_figure)),
            ("wait per cell (mean)", nb("wait_per_burst_mean_s", format_figure)),
        ]
        if any(s.get("notebook", {}).get("reclaim_action", "release") != "release" for s in summaries):
            rows += [
                ("back after reclaim: delay mean", nb("resume_delay_mean_s", format_figure)),
                ("back after reclaim: delay p95", nb("resume_delay_p95_s", format_figure)),
                ("kernel state lost", nb("kernel_state_lost")),
            ]
    rows.append(("replay events/s", lambda s: f"{s['replay']['events_per_s']:.0f}"))
    names = [s["policy"] for s in summaries]
    cells = [[label] + [f(s) for s in summaries] for label, f in rows]
    label_w = max(len(label) for label, _ in rows) + 2  # labels stand a little apart from the figures
    return format_table(cells, ["", *names], align="<>", min_width=[label_w] + [9] * len(names), rule=True)


def write_json(path: str, doc: dict[str, Any]) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(doc, f, indent=2, sort_keys=False, default=str)
        f.write("\n")


def plot(results: list[ReplayResult], path_prefix: str, title: str = "") -> list[str]:
    """PNG plots: queue length and GPUs allocated over time; wait CDF per policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(os.path.dirname(os.path.abspath(path_prefix)) or ".", exist_ok=True)
    files = []
    start = min(r.span[0] for r in results)
    end = max(r.span[1] for r in results)
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    for r in results:
        ts, q = r.queue.sample(start, end, 800)
        _, a = r.allocated.sample(start, end, 800)
        days = [(t - start) / 86400 for t in ts]
        ax1.plot(days, q, label=r.policy.name, lw=1)
        ax2.plot(days, a, label=r.policy.name, lw=1)
    ax1.set_ylabel("queue length (requests)")
    ax2.set_ylabel("GPUs allocated")
    ax2.axhline(results[0].pool_gpus, color="grey", ls=":", lw=1, label="pool size")
    ax2.set_xlabel("simulated days since first arrival")
    ax1.legend(fontsize=8)
    ax2.legend(fontsize=8)
    if title:
        ax1.set_title(title)
    files.append(_save(plt, fig, f"{path_prefix}_timeline.png"))

    fig, ax = plt.subplots(figsize=(8, 5))
    for r in results:
        ws = sorted(max(x.first_wait, 1.0) for x in r.records if x.first_wait is not None)
        n = len(r.records)
        if not ws:
            continue
        ax.step(ws, [(i + 1) / n for i in range(len(ws))], where="post", label=r.policy.name)
    ax.set_xscale("log")
    ax.axvline(600, color="grey", ls=":", lw=1)
    ax.set_xlabel("queue wait (s, log; waits under 1 s shown at 1 s)")
    ax.set_ylabel("share of requests started")
    ax.set_ylim(0, 1.01)
    ax.legend(fontsize=8)
    if title:
        ax.set_title(title)
    files.append(_save(plt, fig, f"{path_prefix}_wait_cdf.png"))
    return files


def _save(plt, fig, path: str) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_tradeoff(points: list[dict[str, Any]], path: str, title: str = "") -> str:
    """Idle-timeout price curves: busy/held against regretted reclaims and returning waits."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fixed = [p for p in points if p["kind"] == "fixed"]
    other = [p for p in points if p["kind"] != "fixed"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 5))
    for ax, key, label in ((ax1, "regretted_share", "regretted reclaims (share of reclaims)"), (ax2, "wait_per_burst_mean_s", "mean wait per cell (s)")):
        ax.plot([p[key] for p in fixed], [p["busy_held_per_session_median"] for p in fixed], "o-", label="fixed idle timeout")
        for p in fixed:
            ax.annotate(f"{p['timeout_s'] / 60:g}m", (p[key], p["busy_held_per_session_median"]), fontsize=7, xytext=(3, 3), textcoords="offset points")
        for p in other:
            ax.plot([p[key]], [p["busy_held_per_session_median"]], "*", ms=14, label=p["label"])
        ax.set_xlabel(label)
        ax.set_ylabel("busy/held per session (median)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    return _save(plt, fig, path)
