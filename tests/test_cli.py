"""The command line, run as users run it: `python -m autoremat ...` in a subprocess.

Every process pays seconds to import torch, so the independent commands are started together
once per module and the tests only read their results. Bad targets fail before any tracing, so
those cases call `cli.main` in this process, which runs the same code minus the interpreter.
"""

import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from autoremat import Plan, cli

torch.set_num_threads(1)

MODELS = Path(__file__).resolve().parent.parent / "examples" / "models.py"
SMALL = [f"{MODELS}:transformer_stack", "--batch", "2", "--seq", "32", "--opt", "n_layer=2", "--opt", "d=64"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


@dataclass
class Result:
    rc: int
    out: str
    err: str


def start(args: list[str], cwd: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "autoremat", *args], cwd=cwd, env=ENV, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def finish(proc: subprocess.Popen) -> Result:
    out, err = proc.communicate(timeout=300)
    return Result(proc.returncode, out, err)


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("cli")
    (d / "broken.py").write_text(
        "not_callable = 3\n\n"
        "def raises(batch: int = 2):\n"
        "    raise RuntimeError('out of llamas')\n"
    )
    return d


@pytest.fixture(scope="module")
def runs(work: Path) -> dict[str, Result]:
    commands = {
        "plan": ["plan", *SMALL, "--budget", "100MB", "--json", "plan.json", "--plot", "timeline.png",
                 "--pareto", "pareto.svg"],
        "ledger": ["ledger", "--params", "7B", "--param-dtype", "fp16", "--optimizer", "adamw"],
        "infeasible": ["plan", *SMALL, "--budget", "1KB"],
        "bad_budget_debug": ["plan", *SMALL, "--budget", "12XB", "--debug"],
        "bf16": ["plan", *SMALL, "--budget", "100MB", "--precision", "bf16", "--json", "plan_bf16.json"],
    }
    procs = {name: start(args, work) for name, args in commands.items()}
    return {name: finish(p) for name, p in procs.items()}


@pytest.mark.parametrize("name, code, words", [
    ("infeasible", 1, "smallest budget that fits"),
])
def test_errors_exit_codes_and_messages(runs, name, code, words):
    r = runs[name]
    assert r.rc == code, r.err
    assert "autoremat: error:" in r.err and words in r.err, r.err
    assert "Traceback" not in r.err


@pytest.mark.parametrize("target, extra, words", [
    ("no_such_file.py:build", [], "no such file"),
    (f"{MODELS}:no_such_factory", [], "no attribute 'no_such_factory'"),
    ("broken.py:not_callable", [], "not a callable"),
    ("broken.py:raises", [], "RuntimeError: out of llamas"),
    (f"{MODELS}:mlp", ["--seq", "64"], "does not accept --seq"),
    (f"{MODELS}:mlp", ["--opt", "depth"], "--opt takes key=value"),
    ("models_without_colon", [], "target must be"),
])
def test_bad_targets_in_process(work, monkeypatch, capsys, target, extra, words):
    monkeypatch.chdir(work)
    monkeypatch.setattr(sys, "path", list(sys.path))  # load_target prepends the target's directory
    assert cli.main(["plan", target, *extra, "--budget", "1GB"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("autoremat: error:") and words in err, err
    assert "Traceback" not in err


def test_bad_budget_in_process(capsys):
    assert cli.main(["plan", "x.py:f", "--budget", "12XB"]) == 2
    assert "budget must be" in capsys.readouterr().err


def test_parse_count():
    assert [cli.parse_count(s) for s in ("7B", "1.3B", "125M", "350k", "42")] == [
        7 * 10**9, 1_300_000_000, 125 * 10**6, 350_000, 42]
    with pytest.raises(cli.UsageError):
        cli.parse_count("7 GB")


def test_debug_shows_the_traceback(runs):
    r = runs["bad_budget_debug"]
    assert r.rc == 2 and "Traceback" in r.err and "autoremat: error:" in r.err


def test_infeasible_prints_the_ledger(runs):
    err = runs["infeasible"].err
    assert "optimizer state" in err and "headroom" in err


def test_plan_writes_json_png_svg_and_show_round_trips(runs, work):
    r = runs["plan"]
    assert r.rc == 0, r.err
    assert "predicted peak" in r.out and "predicted recompute overhead" in r.out
    assert "(chosen)" in r.out  # the pareto table
    assert (work / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert ET.parse(work / "pareto.svg").getroot().tag.endswith("svg")

    plan = Plan.load(work / "plan.json")
    assert r.out.startswith(plan.summary() + "\n")
    show = finish(start(["show", "plan.json", "--plot", "timeline.svg"], work))
    assert show.rc == 0, show.err
    assert show.out == plan.summary() + "\n"
    assert ET.parse(work / "timeline.svg").getroot().tag.endswith("svg")


def test_ledger_7b_fp16_adamw(runs):
    r = runs["ledger"]
    assert r.rc == 0, r.err
    rows = dict(re.findall(r"^(parameters|gradients|optimizer state|master weights)\s+([\d.]+) GB", r.out, re.M))
    assert {k: float(v) for k, v in rows.items()} == {
        "parameters": 14.0, "gradients": 14.0, "optimizer state": 56.0, "master weights": 28.0}


def test_plan_in_bf16_on_meta(runs, work):
    r = runs["bf16"]
    assert r.rc == 0, r.err
    assert re.search(r"precision bf16: (\d+) call\(s\) bf16, 0 fp16, 0 fp32 of \1 castable", r.out), r.out
    plan = Plan.load(work / "plan_bf16.json")
    assert plan.precision["dtypes"] and set(plan.precision["dtypes"][0].values()) == {"bf16"}
    assert not plan.needs_grad_scaler


def test_precision_auto_is_not_offered_on_meta(capsys):
    with pytest.raises(SystemExit):
        cli.main(["plan", "x.py:f", "--budget", "1GB", "--precision", "auto"])
    assert "invalid choice" in capsys.readouterr().err
