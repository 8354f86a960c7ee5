"""The command line, run as users run it: `python -m autoremat ...` in a subprocess.

Every process pays seconds to import torch, so the independent commands are started together
once per module and the tests only read their results. Bad targets fail before any tracing, so
those cases call `cli.main` in this process, which runs the same code minus the interpreter.
"""

import io
import logging
import os
import re
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from autoremat import Plan, cli, cli_support

torch.set_num_threads(1)

MODELS = Path(__file__).resolve().parent.parent / "examples" / "models.py"
SMALL = [f"{MODELS}:transformer_stack", "--batch", "2", "--seq", "32", "--opt", "n_layer=2", "--opt", "d=64"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


@dataclass
class Result:
    rc: int
    out: str
    err: str


def start(args: list[str], cwd: Path, python_args: bool = False) -> subprocess.Popen:
    """`python -m autoremat ARGS`; with python_args, `python ARGS` (ARGS then carries -m autoremat itself)."""
    command = [sys.executable, *args] if python_args else [sys.executable, "-m", "autoremat", *args]
    return subprocess.Popen(command, cwd=cwd, env=ENV, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


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
                 "--pareto", "pareto.svg", "--compiler", "eager"],
        "ledger": ["ledger", "--params", "7B", "--param-dtype", "fp16", "--optimizer", "adamw"],
        "infeasible": ["plan", *SMALL, "--budget", "1KB", "--compiler", "eager"],
        "bad_budget_debug": ["plan", *SMALL, "--budget", "12XB", "--debug"],
        "bf16": ["plan", *SMALL, "--budget", "100MB", "--precision", "bf16", "--json", "plan_bf16.json",
                 "--compiler", "eager"],
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


@pytest.mark.slow
def test_precision_auto_between_the_floors_says_what_it_chose(tmp_path, capsys):
    """Between bf16's floor and fp32's (found by the CLI itself), fp32 does not fit: auto picks a 16-bit
    candidate and prints it, each candidate's predicted time and why fp32 was not taken, as in the plan."""
    base = ["plan", *SMALL, "--device", "h100", "--compiler", "eager"]
    floors = {}
    for precision in ("fp32", "bf16"):
        assert cli.main([*base, "--budget", "1KB", "--precision", precision]) == 1
        floors[precision] = int(re.search(r"smallest budget that fits is [^(]+\((\d+) bytes\)",
                                          capsys.readouterr().err).group(1))
    assert floors["bf16"] < floors["fp32"], floors
    budget = (floors["bf16"] + floors["fp32"]) // 2
    assert cli.main([*base, "--budget", str(budget), "--precision", "auto", "--json", str(tmp_path / "a.json")]) == 0
    out = capsys.readouterr().out
    auto = Plan.load(tmp_path / "a.json").precision["auto"]
    assert auto["chosen"] in ("ilp", "bf16") and "fp32" not in auto["predicted_step_s"], auto
    assert f"precision auto chose {auto['chosen']} (" in out, out
    for name, t in auto["predicted_step_s"].items():
        assert re.search(rf"^ +{name} +{t * 1e3:.2f} ms", out, re.M), out
    assert "not taken: fp32: does not fit the budget" in out, out


def test_precision_fp16_is_not_offered_on_the_command_line(capsys):
    assert cli.main(["plan", "x.py:f", "--budget", "1GB", "--precision", "fp16"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("autoremat: error:") and "invalid choice" in err and err.count("\n") == 1, err


@pytest.mark.parametrize("args, words", [
    (["plan", f"{MODELS}:transformer_stack", "--budget", "1GB", "--batch", "0"], "argument --batch: must be a whole"),
    (["plan", f"{MODELS}:transformer_stack", "--budget", "1GB", "--batch", "-3"], "got '-3'"),
    (["plan", f"{MODELS}:transformer_stack", "--budget", "1GB", "--seq", "0"], "argument --seq: must be a whole"),
    (["plan", f"{MODELS}:transformer_stack", "--budget", "1GB", "--batch", "eight"], "got 'eight'"),
    (["plan", f"{MODELS}:transformer_stack", "--budget", "1GB", "--world-size", "0"], "argument --world-size"),
    (["plan", f"{MODELS}:transformer_stack", "--budget", "1GB", "--time-limit", "0"], "positive number of seconds"),
    (["plan", f"{MODELS}:transformer_stack", "--budget", "0"], "budget must be a positive number of bytes"),
    (["plan", f"{MODELS}:transformer_stack", "--batch", "8"], "required: --budget"),
    (["ledger", "--params", "7B", "--world-size", "-1"], "argument --world-size"),
    (["ledger", "--params", "0"], "--params must be a positive count"),
    (["ledger", "--params", "7B", "--budget=-1GB"], "budget must be a positive number of bytes"),
])
def test_bad_numbers_are_one_line_usage_errors(work, args, words):
    r = finish(start(args, work))
    assert r.rc == 2, r.err
    assert r.out == "" and r.err.startswith("autoremat: error:") and r.err.count("\n") == 1, r.err
    assert words in r.err, r.err


def test_empty_example_inputs_are_refused(monkeypatch, capsys):
    # --batch refuses 0, but --opt reaches the factory as it is: the inputs it builds are checked.
    monkeypatch.setattr(sys, "path", list(sys.path))
    assert cli.main(["plan", f"{MODELS}:transformer_stack", "--opt", "batch=0", "--budget", "1GB"]) == 2
    err = capsys.readouterr().err
    assert "example input with no elements (shape (0, 64, 128))" in err and err.count("\n") == 1, err


@pytest.mark.parametrize("args", [["--help"], ["plan", "--help"], ["ledger", "--help"], ["show", "--help"]])
def test_help_does_not_import_torch(work, args):
    r = finish(start(["-X", "importtime", "-m", "autoremat", *args], work, python_args=True))
    assert r.rc == 0 and r.out.startswith("usage: autoremat"), r.err
    imported = [line.rpartition("|")[2].strip() for line in r.err.splitlines() if line.startswith("import time:")]
    assert "autoremat.cli" in imported  # the -X importtime report is there to be read
    assert not [m for m in imported if m == "torch" or m.startswith("torch.")]


def test_package_exports_are_lazy_and_the_functions_win():
    # `backend` and `fit` name both a submodule and the exported function; importing the
    # submodule first must not leave autoremat.backend bound to the module.
    code = (
        "import sys, autoremat\n"
        "assert 'torch' not in sys.modules\n"
        "from autoremat.backend import backend\n"
        "from autoremat.fit import fit\n"
        "assert autoremat.backend is backend and autoremat.fit is fit\n"
        "assert all(callable(getattr(autoremat, name)) for name in autoremat.__all__)\n"
        "assert set(autoremat.__all__) <= set(dir(autoremat))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], env=ENV, text=True, capture_output=True, timeout=300)
    assert r.returncode == 0, r.stderr


def test_parser_names_match_the_library():
    from autoremat.model import devices, ledger

    assert cli.OPTIMIZER_NAMES == ledger.OPTIMIZER_NAMES
    assert cli.SHARDINGS == ledger.SHARDINGS
    assert list(cli.DEVICE_NAMES) == devices.known_devices()
    assert set(cli.DTYPES) == set(ledger._DTYPES)


def test_progress_shows_the_library_stages(caplog):
    stream = io.StringIO()  # not a terminal: one line per stage
    stages = logging.getLogger(cli_support.PROGRESS_LOGGER)
    level = stages.level

    def written(text: str) -> bool:
        deadline = time.monotonic() + 60  # the spinner thread polls every 0.1 s; a loaded machine may lag
        while text not in stream.getvalue() and time.monotonic() < deadline:
            time.sleep(0.05)
        return text in stream.getvalue()

    with caplog.at_level(logging.WARNING, logger=cli_support.PROGRESS_LOGGER), cli.Progress("planning", stream, quiet_s=0):
        assert written("planning")
        stages.info("solving the ILP")
        stages.warning("a warning still reaches the handlers")
        assert written("solving the ILP")
    assert stream.getvalue().splitlines() == ["autoremat: planning ...", "autoremat: solving the ILP ..."]
    assert [r.getMessage() for r in caplog.records] == ["a warning still reaches the handlers"]
    assert stages.level == level and stages.filters == []


def module_table(summary: str) -> list[str]:
    """The header and rows of the module table: the third paragraph, before the notes."""
    return [line for line in summary.split("\n\n")[2].splitlines() if not line.startswith("note: ")]


def test_summary_module_table(runs, work):
    assert runs["plan"].rc == 0, runs["plan"].err
    plan = Plan.load(work / "plan.json")
    modules = [g.modules for g in plan.graphs]
    saved = sum(c["saved_bytes"] for m in modules for c in m.values())
    # What the forwards hand to the backwards is all alive at their boundary, so within the activation peak.
    assert 0 < saved <= plan.activation_peak
    table = module_table(plan.summary())
    assert table[0].split() == ["module", "saved", "nodes", "recomputed", "nodes"]
    assert len(table) == 1 + len({name for m in modules for name in m})

    for g, m in zip(plan.graphs, modules):
        g.modules = {name.replace("blocks.0", "blocks.10"): c for name, c in m.items()}
    order = [line.split()[0] for line in module_table(plan.summary())[1:]]
    assert order.index("blocks.1") < order.index("blocks.10")

    plan.solver["solver"] = ""  # heuristic paths name no solver
    solver_line = next(line for line in plan.summary().splitlines() if line.startswith("solver:"))
    assert ", ," not in solver_line and "(, " not in solver_line, solver_line

    # A plan saved before bytes were kept still prints, with counts only.
    for g, m in zip(plan.graphs, modules):
        g.modules = {name: {"saved": c["saved"], "recomputed": c["recomputed"]} for name, c in m.items()}
    assert module_table(plan.summary())[0].split() == ["module", "saved", "recomputed"]
