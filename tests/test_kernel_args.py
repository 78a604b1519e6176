"""`%gpu` lines: durations as people write them, what each subcommand means, and the one-line
errors with the usage; plain IPython (a real one, in a subprocess) without any server."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from jupyter_gpulease.core.text import format_duration, parse_duration
from jupyter_gpulease.kernel import args


@pytest.mark.parametrize("written, seconds", [
    ("90m", 5400), ("2h", 7200), ("1h30m", 5400), ("1h 30m", 5400), ("45s", 45), ("1.5h", 5400),
    ("3600", 3600), ("1d", 86400), ("20min", 1200), ("2H", 7200),
])
def test_durations_are_read_as_people_write_them(written, seconds):
    assert parse_duration(written) == seconds


@pytest.mark.parametrize("written", ["soon", "1x", "", "h", "30m1", "1h-30m"])
def test_a_duration_that_is_not_one_is_refused_with_examples(written):
    with pytest.raises(ValueError, match=r"not a duration.*\(examples: .*30m, 2h, 1h30m"):
        parse_duration(written)


def test_a_negative_duration_is_refused():
    with pytest.raises(ValueError, match="cannot be negative"):
        parse_duration("-5m")


def test_durations_are_said_in_words():
    assert format_duration(4320) == "1 h 12 min"
    assert format_duration(840) == "14 min"
    assert format_duration(40) == "40 s"


def test_each_subcommand_reads_its_arguments():
    assert args.parse("") == args.Command("status")
    assert args.parse("extend 30m").duration_s == 1800
    assert args.parse("keep 1h").duration_s == 3600
    assert args.parse("keep off") == args.Command("keep", duration_s=0.0)  # ends the keep in force
    cmd = args.parse("request --gpus 2 --model A100* --tier experiment --for 1h30m --wait")
    assert cmd.name == "request" and cmd.wait
    assert cmd.request == {"kind": "gpu", "gpus": 2, "model": ["A100*"], "tier": "experiment", "duration_s": 5400}
    assert args.parse("request --share 0.25").request == {"kind": "share", "share": 0.25}
    assert args.parse("request --share 50%").request == {"kind": "share", "share": 0.5}
    assert args.parse("request --mig 3g.40gb").request == {"kind": "mig", "mig_profile": "3g.40gb"}
    assert args.parse("request").request == {"kind": "gpu", "gpus": 1}
    cell = args.parse_cell("--for 1h --share 0.5")
    assert cell.name == "cell" and cell.request == {"kind": "share", "share": 0.5, "duration_s": 3600} and not cell.keep
    for name in ("watch", "resume", "release", "queue", "pool", "help", "status"):
        assert args.parse(name).name == name


@pytest.mark.parametrize("line, says, usage", [
    ("extend", "say for how long, e.g. %gpu extend 30m", "%gpu extend DURATION"),
    ("extend soon", "not a duration: 'soon'", "%gpu extend DURATION"),
    ("extend 30m 1h", "one duration only", "%gpu extend DURATION"),
    ("keep 0m", "longer than 0, not '0m'; %gpu keep off ends a keep", "%gpu keep DURATION | off"),
    ("extend -30m", "cannot be negative", "%gpu extend DURATION"),
    ("request --gpus 2 --share 0.5", "not allowed with argument", "%gpu request [--gpus N | --share F"),
    ("request --gpus zero", "--gpus wants a whole number of GPUs, not 'zero'", "%gpu request"),
    ("request --gpus 0", "--gpus must be at least 1", "%gpu request"),
    ("request --share 2", "--share must be between 0 and 1", "%gpu request"),
    ("request --for soon", "not a duration: 'soon'", "%gpu request"),
    ("request --colour blue", "unrecognized arguments: --colour blue", "%gpu request"),
    ("release now", "%gpu release takes no arguments, got 'now'", "%gpu release"),
    ("frobnicate", "unknown subcommand 'frobnicate'", "%gpu [status|watch|request"),
    ("requets --gpus 1", "did you mean request?", "%gpu [status|"),
    ("request --model 'A100", "cannot read the line", "%gpu help"),
])
def test_a_bad_line_gets_one_line_saying_what_is_wrong_and_the_usage(line, says, usage):
    with pytest.raises(args.UsageError) as e:
        args.parse(line)
    first, second = str(e.value).split("\n")
    assert says in first
    assert second.startswith(f"usage: {usage}")


def test_help_names_every_subcommand_and_the_cell_magic():
    h = args.help_text()
    for name in args.SUBCOMMANDS:
        assert f"%gpu {name}" in h
    assert "%%gpu" in h and "1h30m" in h


def _plain_ipython(code: str, tmp_path, **extra_env) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JUPYTERHUB_", "GPULEASE_", "JPY_"))}
    env.update(JUPYTER_RUNTIME_DIR=str(tmp_path / "runtime"), IPYTHONDIR=str(tmp_path / "ipython"), **extra_env)
    return subprocess.run([sys.executable, "-m", "IPython", "--no-banner", "--colors=nocolor", "-c", code],
                          check=False, capture_output=True, text=True, env=env, timeout=120, cwd=tmp_path)


def test_plain_ipython_without_a_server_or_broker_says_so_plainly(tmp_path):
    r = _plain_ipython("%load_ext jupyter_gpulease\n%gpu status\n%gpu pool\n%gpu extend 30m\nprint('still here')", tmp_path)
    assert r.returncode == 0, r.stderr
    out = r.stdout + r.stderr
    assert out.count("no gpulease server or broker to talk to") == 3
    assert "Traceback" not in out
    assert "still here" in r.stdout


def test_plain_ipython_shows_help_and_bad_lines_without_any_server(tmp_path):
    r = _plain_ipython("%load_ext jupyter_gpulease\n%gpu help\n%gpu extend", tmp_path)
    out = r.stdout + r.stderr
    assert "%gpu request [--gpus N | --share F | --mig PROFILE]" in out
    assert "say for how long, e.g. %gpu extend 30m\nusage: %gpu extend DURATION" in out
    assert "Traceback" not in out


def test_plain_ipython_with_a_broker_that_is_not_there_says_it_cannot_reach_it(tmp_path):
    from hubharness import free_port

    r = _plain_ipython("%load_ext jupyter_gpulease\n%gpu queue", tmp_path,
                       GPULEASE_BROKER_URL=f"http://127.0.0.1:{free_port()}/services/gpulease/", GPULEASE_TOKEN="t")
    out = r.stdout + r.stderr
    assert "gpulease: cannot reach the lease broker at http://127.0.0.1:" in out
    assert "Traceback" not in out


STANDIN_TORCH = {
    "torch/__init__.py": "from . import cuda\n",
    "torch/cuda/__init__.py": (
        "# a stand-in for torch.cuda's lazy start: calls queued with _lazy_call run when CUDA starts\n"
        "_queued, _started, fractions = [], False, {}\n"
        "def _lazy_call(fn):\n    _queued.append(fn)\n"
        "def is_initialized():\n    return _started\n"
        "def device_count():\n    return 2\n"
        "def set_per_process_memory_fraction(fraction, device):\n    assert _started, 'would start CUDA'\n    fractions[device] = fraction\n"
        "def init():\n    global _started\n    _started = True\n    for fn in _queued: fn()\n"
    ),
}


def test_a_gpu_share_caps_pytorch_memory_when_cuda_starts_not_before(tmp_path):
    lib = tmp_path / "lib"
    for name, text in STANDIN_TORCH.items():
        (lib / name).parent.mkdir(parents=True, exist_ok=True)
        (lib / name).write_text(text)
    code = ("%load_ext jupyter_gpulease\nimport sys\nprint('imported', 'torch' in sys.modules)\n"
            "import torch\nprint('before', torch.cuda.fractions)\ntorch.cuda.init()\nprint('after', torch.cuda.fractions)")
    r = _plain_ipython(code, tmp_path, GPULEASE_MEMORY_FRACTION="0.5", PYTHONPATH=str(lib))
    assert "imported False" in r.stdout, r.stdout + r.stderr  # loading the magics does not import torch
    assert "before {}" in r.stdout and "after {0: 0.5, 1: 0.5}" in r.stdout, r.stdout + r.stderr
    r = _plain_ipython(code, tmp_path, PYTHONPATH=str(lib))  # a whole GPU: no cap
    assert "after {}" in r.stdout, r.stdout + r.stderr
