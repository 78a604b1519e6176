"""Read and validate workload trace CSVs.

Three formats, recognised by their header (extra columns are allowed and ignored):

- ``alibaba-pods``: Alibaba ``cluster-trace-gpu-v2023`` pod lists (``openb_pod_list_*.csv``)
- ``alibaba-nodes``: its node inventory (``openb_node_list_*.csv``)
- ``notebook``: notebook GPU-burst events (Tiresias-style job lists: job_id, num_gpu,
  submit_time, duration)

Every problem in a file is reported as a :class:`TraceError` naming the file, the line and
the column, e.g. ``alibaba_v2023_pods_shared.csv, line 17, column 'gpu_milli': expected an
integer, got 'x'`` -- never a traceback.
"""

from __future__ import annotations

import csv
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass

ALIBABA_PODS = "alibaba-pods"
ALIBABA_NODES = "alibaba-nodes"
NOTEBOOK = "notebook"

FORMAT_COLUMNS: dict[str, tuple[str, ...]] = {
    ALIBABA_PODS: (
        "name",
        "cpu_milli",
        "memory_mib",
        "num_gpu",
        "gpu_milli",
        "gpu_spec",
        "qos",
        "pod_phase",
        "creation_time",
        "deletion_time",
        "scheduled_time",
    ),
    ALIBABA_NODES: ("sn", "cpu_milli", "memory_mib", "gpu", "model"),
    NOTEBOOK: ("job_id", "num_gpu", "submit_time", "duration"),
}

QOS_CLASSES = ("LS", "Guaranteed", "Burstable", "BE")
POD_PHASES = ("Running", "Succeeded", "Failed", "Pending")


class TraceError(ValueError):
    """A trace file cannot be read: the message names the file, line and column."""

    def __init__(self, path: str, message: str, *, line: int | None = None, column: str | None = None):
        self.path = path
        self.line = line
        self.column = column
        self.detail = message
        where = os.path.basename(path)
        if line is not None:
            where += f", line {line}"
        if column is not None:
            where += f", column {column!r}"
        super().__init__(f"{where}: {message}")


# --------------------------------------------------------------------------- records
@dataclass(frozen=True)
class AlibabaPod:
    """One pod of the Alibaba 2023 trace (times in trace seconds)."""

    name: str
    num_gpu: int
    gpu_milli: int
    qos: str
    phase: str
    creation: float
    deletion: float
    scheduled: float | None  # None: never scheduled (Pending)
    gpu_spec: str = ""
    line: int = 0

    @property
    def gpu_request_milli(self) -> int:
        """Requested GPUs in milli-GPUs: gpu_milli for a one-GPU pod, num_gpu whole GPUs otherwise."""
        if self.num_gpu == 1:
            return self.gpu_milli
        return self.num_gpu * 1000


@dataclass(frozen=True)
class Node:
    """One node of the Alibaba inventory (``model`` empty: CPU-only)."""

    sn: str
    gpus: int
    model: str
    line: int = 0


@dataclass(frozen=True)
class NotebookEvent:
    """One GPU burst (a cell that ran training); times in minutes of the trace clock."""

    job_id: int
    num_gpu: int
    submit_min: float
    duration_min: float
    line: int = 0


# --------------------------------------------------------------------------- reading
def _open_rows(path: str) -> tuple[list[str], Iterator[tuple[int, dict[str, str]]]]:
    """Header and (line number, row) pairs of a CSV file, with structural errors as TraceError."""
    try:
        f = open(path, newline="", encoding="utf-8")  # noqa: SIM115 (closed by the row iterator)
    except OSError as e:
        raise TraceError(path, f"cannot open: {e.strerror or e}") from None
    try:
        reader = csv.reader(f)
        try:
            header = next(reader)
        except StopIteration:
            f.close()
            raise TraceError(path, "the file is empty (no header line)", line=1) from None
    except UnicodeDecodeError as e:
        f.close()
        raise TraceError(path, f"not a UTF-8 text file ({e.reason})", line=1) from None
    except csv.Error as e:
        f.close()
        raise TraceError(path, f"not a CSV file ({e})", line=1) from None
    header = [h.strip().lstrip("\ufeff") for h in header]

    def rows() -> Iterator[tuple[int, dict[str, str]]]:
        with f:
            try:
                for values in reader:
                    line = reader.line_num
                    if not values or all(not v.strip() for v in values):
                        continue  # blank line
                    if len(values) != len(header):
                        raise TraceError(path, f"expected {len(header)} fields as in the header, got {len(values)}", line=line)
                    yield line, dict(zip(header, values))
            except csv.Error as e:
                raise TraceError(path, f"malformed CSV ({e})", line=reader.line_num) from None
            except UnicodeDecodeError as e:
                raise TraceError(path, f"not a UTF-8 text file ({e.reason})", line=reader.line_num + 1) from None

    return header, rows()


def detect_format(path: str, header: list[str] | None = None) -> str:
    """Which trace format a file is in, from its header. A foreign file gets a TraceError
    that names the closest format and the columns it lacks."""
    if header is None:
        header, rows = _open_rows(path)
        rows.close()
    have = set(header)
    best, best_missing = None, None
    for fmt, cols in FORMAT_COLUMNS.items():
        missing = [c for c in cols if c not in have]
        if not missing:
            return fmt
        if best_missing is None or len(missing) < len(best_missing):
            best, best_missing = fmt, missing
    assert best is not None and best_missing is not None
    raise TraceError(
        path,
        f"not a known trace format; closest is {best!r}, which lacks column(s) {', '.join(repr(c) for c in best_missing)} "
        f"(header has {', '.join(repr(h) for h in header) or 'nothing'}). Known formats: "
        + "; ".join(f"{fmt}: {','.join(cols)}" for fmt, cols in FORMAT_COLUMNS.items()),
        line=1,
    )


def _int(path: str, line: int, row: dict[str, str], col: str, *, minimum: int | None = None, maximum: int | None = None) -> int:
    raw = row[col].strip()
    try:
        v = int(raw)
    except ValueError:
        raise TraceError(path, f"expected an integer, got {raw!r}", line=line, column=col) from None
    if minimum is not None and v < minimum:
        raise TraceError(path, f"expected at least {minimum}, got {v}", line=line, column=col)
    if maximum is not None and v > maximum:
        raise TraceError(path, f"expected at most {maximum}, got {v}", line=line, column=col)
    return v


def _num(path: str, line: int, row: dict[str, str], col: str, *, minimum: float | None = None, optional: bool = False) -> float | None:
    raw = row[col].strip()
    if raw == "" and optional:
        return None
    try:
        v = float(raw)
    except ValueError:
        raise TraceError(path, f"expected a number, got {raw!r}", line=line, column=col) from None
    if v != v or v in (float("inf"), float("-inf")):
        raise TraceError(path, f"expected a finite number, got {raw!r}", line=line, column=col)
    if minimum is not None and v < minimum:
        raise TraceError(path, f"expected at least {minimum:g}, got {raw}", line=line, column=col)
    return v


def _choice(path: str, line: int, row: dict[str, str], col: str, allowed: tuple[str, ...]) -> str:
    raw = row[col].strip()
    if raw not in allowed:
        raise TraceError(path, f"expected one of {', '.join(allowed)}, got {raw!r}", line=line, column=col)
    return raw


def _load(path: str, expected: str, parse: Callable[[str, int, dict[str, str]], object]) -> list:
    header, rows = _open_rows(path)
    fmt = detect_format(path, header)
    if fmt != expected:
        rows.close()
        raise TraceError(path, f"this is a {fmt!r} file, expected a {expected!r} file", line=1)
    return [parse(path, line, row) for line, row in rows]


def _parse_pod(path: str, line: int, row: dict[str, str]) -> AlibabaPod:
    name = row["name"].strip()
    if not name:
        raise TraceError(path, "expected a pod name, got ''", line=line, column="name")
    for col in ("cpu_milli", "memory_mib"):
        _int(path, line, row, col, minimum=0)
    num_gpu = _int(path, line, row, "num_gpu", minimum=0)
    gpu_milli = _int(path, line, row, "gpu_milli", minimum=0, maximum=1000)
    if num_gpu > 0 and gpu_milli == 0:
        raise TraceError(path, f"a pod with num_gpu={num_gpu} needs gpu_milli > 0, got 0", line=line, column="gpu_milli")
    if num_gpu > 1 and gpu_milli != 1000:
        raise TraceError(path, f"a multi-GPU pod (num_gpu={num_gpu}) must have gpu_milli 1000, got {gpu_milli}", line=line, column="gpu_milli")
    qos = _choice(path, line, row, "qos", QOS_CLASSES)
    phase = _choice(path, line, row, "pod_phase", POD_PHASES)
    creation = _num(path, line, row, "creation_time", minimum=0)
    deletion = _num(path, line, row, "deletion_time", minimum=0)
    scheduled = _num(path, line, row, "scheduled_time", minimum=0, optional=True)
    assert creation is not None and deletion is not None
    if deletion < creation:
        raise TraceError(path, f"deletion_time {deletion:g} is before creation_time {creation:g}", line=line, column="deletion_time")
    if scheduled is not None and not creation <= scheduled <= deletion:
        raise TraceError(path, f"scheduled_time {scheduled:g} is outside [creation_time, deletion_time]", line=line, column="scheduled_time")
    if scheduled is None and phase != "Pending":
        raise TraceError(path, f"scheduled_time is empty but pod_phase is {phase!r} (only Pending pods were never scheduled)", line=line, column="scheduled_time")
    return AlibabaPod(name, num_gpu, gpu_milli, qos, phase, creation, deletion, scheduled, row["gpu_spec"].strip(), line)


def _parse_node(path: str, line: int, row: dict[str, str]) -> Node:
    sn = row["sn"].strip()
    if not sn:
        raise TraceError(path, "expected a node id, got ''", line=line, column="sn")
    for col in ("cpu_milli", "memory_mib"):
        _int(path, line, row, col, minimum=0)
    gpus = _int(path, line, row, "gpu", minimum=0)
    model = row["model"].strip()
    if gpus > 0 and not model:
        raise TraceError(path, f"a node with {gpus} GPU(s) needs a model, got ''", line=line, column="model")
    return Node(sn, gpus, model, line)


def _parse_event(path: str, line: int, row: dict[str, str]) -> NotebookEvent:
    job_id = _int(path, line, row, "job_id", minimum=0)
    num_gpu = _int(path, line, row, "num_gpu", minimum=1)
    submit = _num(path, line, row, "submit_time", minimum=0)
    duration = _num(path, line, row, "duration", minimum=0)
    assert submit is not None and duration is not None
    if duration <= 0:
        raise TraceError(path, f"expected a positive duration (minutes), got {row['duration'].strip()!r}", line=line, column="duration")
    return NotebookEvent(job_id, num_gpu, submit, duration, line)


def load_alibaba_pods(path: str) -> list[AlibabaPod]:
    """Pods of an Alibaba v2023 pod list, validated, in file order."""
    return _load(path, ALIBABA_PODS, _parse_pod)


def load_alibaba_nodes(path: str) -> list[Node]:
    """Nodes of an Alibaba v2023 node list, validated, in file order."""
    return _load(path, ALIBABA_NODES, _parse_node)


def load_notebook_events(path: str) -> list[NotebookEvent]:
    """Events of a notebook GPU-burst list, validated, in file order (the order carries the sessions)."""
    return _load(path, NOTEBOOK, _parse_event)


# --------------------------------------------------------------------------- the samples shipped
SAMPLE_FILES = {
    "alibaba": "alibaba_v2023_pods_shared.csv",
    "alibaba-nodes": "alibaba_v2023_nodes.csv",
    "notebook": "adobe_notebook_gpu_events_june2021_shared.csv",
}


def default_traces_dir() -> str:
    """Where the trace samples are read from: $GPULEASE_TRACES if set (another copy, e.g. newer
    downloads), else the samples shipped with the package (``jupyter_gpulease/sim/samples``, with
    their README: sources, licences, how they were sampled)."""
    return os.environ.get("GPULEASE_TRACES") or os.path.join(os.path.dirname(os.path.abspath(__file__)), "samples")
