"""What the resume hook costs a kernel that is not suspended.

Every IPython kernel of a gpulease server runs a ``pre_run_cell`` hook (kernel/resume.py) that
looks for the file the server writes beside the kernel's connection file while the kernel is
suspended. Reported: the hook's own time per cell (one ``stat`` of a file that is not there),
and the time of an IPython cell (``x = 1``) with and without the hook registered, in this
process. Needs no server and no GPU.

    .venv/bin/python benchmarks/bench_resume_hook.py [--cells 20000]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

from IPython.core.interactiveshell import InteractiveShell

from jupyter_gpulease.kernel.resume import ResumeHook, marker_path


class _Info:
    raw_cell = "x = 1"


def per_call(fn, n: int) -> float:
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t0) / n)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cells", type=int, default=20000)
    args = ap.parse_args()
    folder = tempfile.mkdtemp()
    hook = ResumeHook("bench", marker_path(os.path.join(folder, "kernel-bench.json")))
    info = _Info()
    hook_s = per_call(lambda: hook(info), args.cells * 10)
    shell = InteractiveShell.instance()
    cells = max(1, args.cells // 10)
    plain_s = per_call(lambda: shell.run_cell("x = 1", store_history=False, silent=False), cells)
    shell.events.register("pre_run_cell", hook)
    with_s = per_call(lambda: shell.run_cell("x = 1", store_history=False, silent=False), cells)
    print(f"hook alone, kernel not suspended: {hook_s * 1e6:.2f} µs per cell")
    print(f"IPython cell 'x = 1': {plain_s * 1e6:.0f} µs without the hook, {with_s * 1e6:.0f} µs with it")


if __name__ == "__main__":
    main()
