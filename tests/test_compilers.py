"""compiler="auto" (optimize's default): Inductor where this machine runs it, else eager and a warning.

Both branches run for real: the Inductor one here when the CPU probe finds a working C++ compiler,
the fallbacks in fresh processes (Inductor reads $CXX at import, and the probe is cached per
process) whose $CXX names a compiler that does not exist, or a real g++ behind a wrapper that
refuses the C++ files containing a given word: every kernel (the probe's kernel fails), or only
those computing tanh (the probe passes and the model's own graphs fail at plan time). Those
children use a fresh Inductor cache directory, so nothing compiled before is reused.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import autoremat
from autoremat.planning.compilers import choose_compiler, inductor_problem
from autoremat.torch_internals import inductor_cpp_compiler
from tests.tolerances import assert_grads_close

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
    assert_grads_close([(p.grad, r) for p, r in zip(model.parameters(), ref, strict=True)], depth=3)
    assert "Inductor's compilers" in om.plan.summary()


def test_the_backend_defaults_to_auto_and_chooses_at_its_first_graph() -> None:
    problem = inductor_problem("cpu")
    model, ex = _tiny()
    model.zero_grad(set_to_none=True)
    model(*ex).sum().backward()
    ref = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    be = autoremat.backend(budget="1GB")
    assert be.planner.compiler is None  # no graph yet: no device to choose for
    torch.compile(model, backend=be)(*ex).sum().backward()
    c = be.planner.compiler
    assert (c.requested, c.used) == ("auto", "eager" if problem else "inductor"), c
    assert_grads_close([(p.grad, r) for p, r in zip(model.parameters(), ref, strict=True)], depth=3)


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


# A C++ compiler that refuses every .cpp file containing $REFUSE, and passes the rest to the real one.
WRAPPER = """#!/bin/sh
for a in "$@"; do
  case "$a" in *.cpp) if grep -q "$REFUSE" "$a"; then echo "$a:1:1: error: refused by the test's compiler" >&2; exit 1; fi;; esac
done
exec {real} "$@"
"""


def _refusing_env(tmp_path: Path, refuse: str) -> dict:
    try:
        real = shutil.which(inductor_cpp_compiler())
    except Exception as e:  # torch's InvalidCxxCompiler
        pytest.skip(f"no C++ compiler for Inductor here to wrap: {e}")
    if real is None:
        pytest.skip("Inductor's C++ compiler is not on PATH here")
    bindir = tmp_path / "bin"
    bindir.mkdir()
    cxx = bindir / "g++"  # Inductor tells gcc from clang by the name
    cxx.write_text(WRAPPER.format(real=real))
    cxx.chmod(0o755)
    return {**ENV, "CXX": str(cxx), "REFUSE": refuse, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor-cache")}


def _child(tmp_path: Path, script: str, env: dict) -> subprocess.CompletedProcess:
    path = tmp_path / "child.py"
    path.write_text(script)
    proc = subprocess.run([sys.executable, str(path)], env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_auto_falls_back_when_inductors_own_kernel_does_not_build(tmp_path: Path) -> None:
    proc = _child(tmp_path, CHILD, _refusing_env(tmp_path, "kernel"))  # the one-line library builds; kernels do not
    c = json.loads(next(x for x in proc.stdout.splitlines() if x.startswith("COMPILER=")).removeprefix("COMPILER="))
    assert (c["requested"], c["used"]) == ("auto", "eager"), c
    assert "Inductor's generated C++" in c["reason"] and "error: refused by the test's compiler" in c["reason"], c
    said = [x for x in proc.stderr.splitlines() if "compiler='auto' uses the eager FX compiler" in x]
    assert len(said) == 1 and "refused by the test's compiler" in said[0], proc.stderr[-3000:]


def test_a_compile_failure_at_plan_time_falls_back_for_auto_and_is_an_error_for_inductor(tmp_path: Path) -> None:
    script = CHILD + """
from autoremat.planning.compilers import InductorFailed
try:
    autoremat.optimize(model, budget="1GB", example_inputs=(torch.randn(8, 16),), verify=False, progress=False,
                       compiler="inductor")
except InductorFailed as e:
    print("INDUCTOR_FAILED=" + str(e))
"""
    proc = _child(tmp_path, script, _refusing_env(tmp_path, "tanh"))  # the probe's kernel has no tanh: it passes
    c = json.loads(next(x for x in proc.stdout.splitlines() if x.startswith("COMPILER=")).removeprefix("COMPILER="))
    assert (c["requested"], c["used"]) == ("auto", "eager"), c
    assert c["reason"].startswith("Inductor failed to compile") and "refused by the test's compiler" in c["reason"], c
    said = [x for x in proc.stderr.splitlines() if "compiler='auto' uses the eager FX compiler" in x]
    assert len(said) == 1, proc.stderr[-3000:]
    failed = next(x for x in proc.stdout.splitlines() if x.startswith("INDUCTOR_FAILED="))
    assert "compiler='inductor': Inductor failed to compile" in failed and "compiler='eager'" in failed, failed


def _floor(model: nn.Module, ex: tuple, compiler: str) -> int:
    try:
        autoremat.optimize(model, budget=1, example_inputs=ex, optimizer=None, outputs="loss", compiler=compiler,
                           progress=False)
    except autoremat.BudgetError as e:
        return e.smallest_budget
    raise AssertionError(f"a budget of 1 B fitted under {compiler}")


def test_auto_plans_with_eager_where_only_eagers_plan_fits_and_inductor_still_refuses(caplog) -> None:
    """A plan cannot save a value Inductor fuses (fusion.py), so a conv-BN residual block's smallest budget is
    higher under Inductor than under eager. Between the two, "auto" plans with eager and says why, once;
    an explicit "inductor" raises BudgetError; below both, "auto" names the smaller (eager's) floor."""
    if inductor_problem("cpu") is not None:
        pytest.skip(f"this machine cannot run Inductor on CPU: {inductor_problem('cpu')}")
    from tests.test_fusion import _PooledLoss

    torch.manual_seed(0)
    model = _PooledLoss(16).train()
    ex = (torch.randn(4, 3, 16, 16), torch.randint(0, 10, (4,)))
    eager, inductor = _floor(model, ex, "eager"), _floor(model, ex, "inductor")
    assert eager < inductor, (eager, inductor)  # what this test is about: only eager fits in between
    with caplog.at_level("WARNING", logger="autoremat"):
        om = autoremat.optimize(model, budget=eager, example_inputs=ex, optimizer=None, outputs="loss",
                                compiler="auto", progress=False)
    assert om.plan.compiler["requested"] == "auto" and om.plan.compiler["used"] == "eager", om.plan.compiler
    assert "no plan fits the budget under Inductor" in om.plan.compiler["reason"], om.plan.compiler
    assert "compiler: eager (requested 'auto'; no plan fits the budget under Inductor" in om.plan.summary()
    said = [r.getMessage() for r in caplog.records if "under Inductor" in r.getMessage()]
    assert len(said) == 1, said
    om(*ex).backward()
    assert all(p.grad is not None for p in model.parameters())
    with pytest.raises(autoremat.BudgetError) as refused:
        autoremat.optimize(model, budget=eager, example_inputs=ex, optimizer=None, outputs="loss",
                           compiler="inductor", progress=False)
    assert refused.value.smallest_budget == inductor
    with pytest.raises(autoremat.BudgetError) as neither:
        autoremat.optimize(model, budget=1, example_inputs=ex, optimizer=None, outputs="loss", compiler="auto",
                           progress=False)
    assert neither.value.smallest_budget == eager
    assert str(neither.value).startswith("budget 1 B, 1 bytes fits under neither compiler compiler='auto' may use: "
                                         f"the smallest budget is {autoremat.format_bytes(inductor)}, {inductor} bytes "
                                         "under Inductor"), str(neither.value)


def test_a_new_input_shape_that_fits_only_under_eager_is_planned_with_eager_as_the_first_would_be() -> None:
    """RematModule plans a new input shape with the pipeline the first shape ran: under compiler="auto" it
    tries Inductor, then eager where only eager fits (before: the first shape's compiler only, and a
    BudgetError from the call)."""
    if inductor_problem("cpu") is not None:
        pytest.skip(f"this machine cannot run Inductor on CPU: {inductor_problem('cpu')}")
    from tests.test_fusion import _PooledLoss

    torch.manual_seed(0)
    model = _PooledLoss(16).train()
    small = (torch.randn(2, 3, 16, 16), torch.randint(0, 10, (2,)))
    large = (torch.randn(4, 3, 16, 16), torch.randint(0, 10, (4,)))
    eager, inductor = _floor(model, large, "eager"), _floor(model, large, "inductor")
    assert eager < inductor, (eager, inductor)
    om = autoremat.optimize(model, budget=eager, example_inputs=small, optimizer=None, outputs="loss",
                            compiler="auto", progress=False)
    assert om.plan.compiler["used"] == "inductor", om.plan.compiler  # the small batch fits under Inductor
    om(*large).backward()
    first, new = om.plans
    assert first is om.plan and new.compiler["requested"] == "auto" and new.compiler["used"] == "eager", new.compiler
    assert "no plan fits the budget under Inductor" in new.compiler["reason"]
    assert new.predicted_peak <= eager
