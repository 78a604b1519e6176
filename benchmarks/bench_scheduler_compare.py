"""The scheduler benchmark, before and after a change, side by side in one run.

Run:  python benchmarks/bench_scheduler_compare.py BASE_REF [--rounds 3] [--quick] [--out benchmarks/results/scheduler_compare.json]

Checks out ``BASE_REF`` into a temporary git worktree and runs ``benchmarks/bench_scheduler.py``
of that tree and of this one alternately (base, this, base, this, …), each in a fresh process,
so that both see the same machine load. Prints, for every size, the median over the rounds of
each figure for both, and the ratio this/base (below 1: faster now).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIGURES = ("idle_pass_ms", "churn_pass_ms", "full_order_ms")


def run_bench(tree: str, quick: bool, out: str) -> dict:
    cmd = [sys.executable, "benchmarks/bench_scheduler.py", "--out", out] + (["--quick"] if quick else [])
    subprocess.run(cmd, cwd=tree, check=True, env={**os.environ, "PYTHONPATH": tree}, stdout=subprocess.DEVNULL)
    with open(out) as f:
        return json.load(f)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("base", help="git ref of the baseline (e.g. the commit before the change)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default="benchmarks/results/scheduler_compare.json")
    a = ap.parse_args(argv)
    base_sha = subprocess.run(["git", "rev-parse", "--short", a.base], cwd=ROOT, check=True, capture_output=True, text=True).stdout.strip()
    head_sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, check=True, capture_output=True, text=True).stdout.strip()
    with tempfile.TemporaryDirectory(prefix="bench-base-") as tmp:
        base_tree = os.path.join(tmp, "base")
        subprocess.run(["git", "worktree", "add", "--detach", "-q", base_tree, a.base], cwd=ROOT, check=True)
        try:
            runs: dict[str, list[dict]] = {"base": [], "this": []}
            for r in range(a.rounds):
                for name, tree in (("base", base_tree), ("this", ROOT)):
                    runs[name].append(run_bench(tree, a.quick, os.path.join(tmp, f"{name}{r}.json")))
                    print(f"round {r + 1}/{a.rounds}: {name} done", flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", base_tree], cwd=ROOT, check=False)
    rows = []
    for i, row in enumerate(runs["base"][0]["rows"]):
        key = {k: row[k] for k in ("gpus", "queued", "fair_share")}
        out = dict(key)
        for fig in FIGURES:
            b = statistics.median(run["rows"][i][fig] for run in runs["base"])
            t = statistics.median(run["rows"][i][fig] for run in runs["this"])
            out[fig] = {"base": b, "this": t, "ratio": round(t / b, 3) if b else None}
        rows.append(out)
        print(
            f"{key['gpus']:>6} GPUs {key['queued']:>7} queued fair_share={key['fair_share']!s:<5}  "
            + "   ".join(f"{fig[:-3]} {out[fig]['base']:8.2f} -> {out[fig]['this']:8.2f} ms (x{out[fig]['ratio']})" for fig in FIGURES),
            flush=True,
        )
    cmd = f"python benchmarks/bench_scheduler_compare.py {a.base} --rounds {a.rounds}" + (" --quick" if a.quick else "")
    doc = {"command": cmd, "base": base_sha, "this": head_sha, "rounds": a.rounds, "rows": rows}
    os.makedirs(os.path.dirname(os.path.join(ROOT, a.out)), exist_ok=True)
    with open(os.path.join(ROOT, a.out), "w") as f:
        json.dump(doc, f, indent=2)
    print(f"saved {a.out}  (command: {cmd}; base {base_sha}, this {head_sha}; medians of {a.rounds} alternating rounds)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
