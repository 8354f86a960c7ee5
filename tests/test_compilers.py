"""compiler="auto" (optimize's default): Inductor where this machine runs it, else eager and a warning.

Both branches run for real: the Inductor one here when the CPU probe finds a working C++ compiler,
the fallback in a fresh process whose $CXX names a compiler that does not exist (Inductor reads $CXX
at import, and the probe is cached per process).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import autoremat
from autoremat.compilers import choose_compiler, inductor_problem
from tests.tolerances import assert_close_for

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}

# A tiny model, planned with the default compiler in a child process; prints plan.compiler as JSON.
CHILD = """
import json, torch, torch.nn as nn, autoremat
torch.set_num_threads(1)
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))
om = autoremat.optimize(model, budget="1GB", example_inputs=(torch.randn(8, 16),), verify=False, progress=False)
om(torch.randn(8, 16)).sum().backward()
print("COMPILER=" + json.dumps(om.plan.compiler))
"""


def _tiny() -> tuple[nn.Module, tuple[torch.Tensor]]:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 1)), (torch.randn(8, 16),)


def test_unknown_compiler_is_refused_with_the_choices() -> None:
    model, ex = _tiny()
    with pytest.raises(ValueError, match="compiler must be 'auto'.*got 'tvm'"):
        autoremat.optimize(model, budget="1GB", example_inputs=ex, compiler="tvm")


def test_explicit_choices_are_kept_and_meta_plans_with_eager() -> None:
    assert choose_compiler("eager", "cpu").used == "eager"
    assert choose_compiler("inductor", "meta").used == "inductor"  # asked for: the user's call
    meta = choose_compiler("auto", "meta")
    assert (meta.used, meta.reason) == ("eager", "meta tensors are planned, not run")


def test_eager_plan_records_the_choice_and_round_trips() -> None:
    model, ex = _tiny()
    om = autoremat.optimize(model, budget="1GB", example_inputs=ex, verify=False, compiler="eager", progress=False)
    c = om.plan.compiler
    assert (c["requested"], c["used"], c["inductor_compile_s"]) == ("eager", "eager", 0.0)
    assert c["planning_s"] > 0
    assert autoremat.Plan.from_json(om.plan.to_json()).compiler == c
    assert "compiler: eager (requested 'eager')" in om.plan.summary()


def test_auto_uses_inductor_where_the_cpu_probe_passes() -> None:
    problem = inductor_problem("cpu")
    if problem is not None:
        pytest.skip(f"this machine cannot run Inductor on CPU: {problem}")
    model, ex = _tiny()
    model.zero_grad(set_to_none=True)
    model(*ex).sum().backward()
    ref = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    om = autoremat.optimize(model, budget="1GB", example_inputs=ex, verify=False, progress=False)
    c = om.plan.compiler
    assert (c["requested"], c["used"]) == ("auto", "inductor"), c
    assert 0 < c["inductor_compile_s"] <= c["planning_s"], c
    om(*ex).sum().backward()
    for p, r in zip(model.parameters(), ref, strict=True):
        assert_close_for(p.grad, r, depth=3)
    assert "Inductor's compilers" in om.plan.summary()


def test_auto_falls_back_to_eager_once_when_no_cpp_compiler_works(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-g++"
    script = tmp_path / "child.py"
    script.write_text(CHILD + "om2 = autoremat.optimize(model, budget='1GB', example_inputs=(torch.randn(4, 16),),"
                              " verify=False, progress=False)\n")
    proc = subprocess.run([sys.executable, str(script)], env={**ENV, "CXX": str(missing)}, capture_output=True,
                          text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("COMPILER="))
    c = json.loads(line.removeprefix("COMPILER="))
    assert (c["requested"], c["used"], c["inductor_compile_s"]) == ("auto", "eager", 0.0), c
    assert str(missing) in c["reason"] and "C++ compiler" in c["reason"], c
    said = [x for x in proc.stderr.splitlines() if "compiler='auto' uses the eager FX compiler" in x]
    assert len(said) == 1 and str(missing) in said[0], proc.stderr[-3000:]  # two optimize calls, one warning
