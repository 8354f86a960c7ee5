"""Planning progress in Python: `optimize` writes its stages to stderr once planning has run a while.

Run in a subprocess, as a user's script runs: pytest installs logging handlers of its own on the
root logger, which is exactly the "user configured logging" case where autoremat stays out.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from autoremat import progress

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = r"""
import logging, sys, torch
import autoremat, autoremat.progress
torch.set_num_threads(1)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 32))
x = torch.randn(8, 32)

def run(label, **kw):
    sys.stderr.write(f"=== {label}\n"); sys.stderr.flush()
    autoremat.optimize(model, budget="1GB", example_inputs=(x,), **kw)

autoremat.progress.AFTER_S = 0.0   # every plan "takes long": the stages show
run("default")
run("off", progress=False)
autoremat.progress.AFTER_S = 600.0  # a quick plan: nothing shows
run("quick")
autoremat.progress.AFTER_S = 0.0
logging.basicConfig(level=logging.INFO, format="USER %(name)s: %(message)s")  # the user's own logging
run("configured")
"""


@pytest.fixture(scope="module")
def sections() -> dict[str, list[str]]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out: dict[str, list[str]] = {}
    current = None
    for line in proc.stderr.splitlines():
        if line.startswith("=== "):
            current = line[4:]
            out[current] = []
        elif current is not None and "autoremat" in line:
            out[current].append(line)
    return out


def test_long_planning_shows_each_stage_on_stderr(sections) -> None:
    lines = sections["default"]
    stages = [line for line in lines if line.startswith("autoremat: ") and line.endswith(" s)")]
    assert any("capturing the training step ..." in line for line in stages), lines
    assert any("solving for" in line for line in stages), lines
    assert any("verifying the plan on a real step ..." in line for line in stages), lines
    assert stages[-1].startswith("autoremat: planned ("), lines


def test_progress_false_and_quick_plans_are_silent(sections) -> None:
    assert not [line for line in sections["off"] if line.startswith("autoremat: ")]
    assert not [line for line in sections["quick"] if line.startswith("autoremat: ")]


def test_a_user_logging_setup_is_left_to_decide(sections) -> None:
    lines = sections["configured"]
    assert not [line for line in lines if line.startswith("autoremat: ")], lines  # ours: none
    assert any(line.startswith("USER autoremat.progress: capturing the training step") for line in lines), lines


def test_progress_must_be_a_bool() -> None:
    import torch

    import autoremat

    with pytest.raises(TypeError, match="progress must be True"):
        autoremat.optimize(torch.nn.Linear(2, 2), budget="1GB", example_inputs=(torch.randn(1, 2),), progress="yes", compiler="eager")
    assert progress.AFTER_S == 2.0


def test_a_silent_stage_is_repeated_with_how_far_it_is(caplog) -> None:
    """No stage stays silent for long. While a stage runs past the pulse, it is repeated
    with its seconds so far and what it last said of its progress; a new stage starts afresh."""
    import logging
    import time

    from autoremat.planning import planner

    logger = logging.getLogger(progress.LOGGER)
    with caplog.at_level(logging.INFO, logger=progress.LOGGER), progress.pulse(every_s=0.2):
        logger.info("solving for 10 nodes")
        planner.along("3 of 4 candidates")
        time.sleep(0.9)
        logger.info("compiling the planned step")
        time.sleep(0.1)
    messages = [r.getMessage() for r in caplog.records if r.name == progress.LOGGER]
    pulses = [m for m in messages if "still running" in m]
    assert pulses and all(m.startswith("solving for 10 nodes: still running") for m in pulses), messages
    assert pulses[-1].endswith("s in this stage; 3 of 4 candidates"), messages
    assert messages[-1] == "compiling the planned step", messages
    assert planner.along_now() is None  # nothing carried into the next planning run
    assert not [f for f in logger.filters if isinstance(f, progress._Pulse)]


def test_no_pulse_when_nobody_listens() -> None:
    import logging

    logger = logging.getLogger(progress.LOGGER)
    assert not logger.isEnabledFor(logging.INFO)
    with progress.pulse(every_s=0.01):
        assert not logger.filters
