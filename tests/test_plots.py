"""The timeline plot: both curves on one op axis (a real plan that recomputes, small stack)."""

from collections import Counter
from pathlib import Path

import pytest
import torch

import autoremat
from autoremat.model.ledger import Ledger
from autoremat.plots import plot_timeline, shared_x
from examples import models

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def plan() -> autoremat.Plan:
    torch.manual_seed(0)
    model, inputs = models.transformer_stack(batch=2, seq=32, n_layer=2, d=64)
    big = autoremat.optimize(model, budget=10**12, example_inputs=inputs, verify=False, compiler="eager")
    hi = Ledger.from_dict(big.plan.ledger).fixed + big.plan.baseline_peak
    with pytest.raises(autoremat.BudgetError) as err:
        autoremat.optimize(model, budget=1, example_inputs=inputs, verify=False, compiler="eager")
    p = autoremat.optimize(model, budget=(err.value.smallest_budget + hi) // 2, example_inputs=inputs,
                           verify=False, compiler="eager").plan
    assert any(g.recomputed for g in p.graphs)  # the case where the two curves run different ops
    return p


def test_an_op_both_curves_run_sits_at_the_same_x(plan: autoremat.Plan) -> None:
    plan_x, base_x = shared_x(plan)
    assert plan_x == [float(i) for i in range(len(plan.timeline))]
    assert len(base_x) == len(plan.baseline_timeline)
    assert base_x == sorted(base_x) and base_x[0] == 0 and base_x[-1] == plan_x[-1]
    keys = [tuple(r[:3]) for r in plan.timeline]
    base_keys = [tuple(r[:3]) for r in plan.baseline_timeline]
    once = {k for k, n in Counter(keys).items() if n == 1} & {k for k, n in Counter(base_keys).items() if n == 1}
    # the backward's own ops (gradients) run in one order in both steps: each is drawn where the plan runs it
    backward = [(i, k) for i, k in enumerate(base_keys) if k in once and k[1] == "backward"
                and not any(k[2] in g.recomputed for g in plan.graphs if g.index == k[0])]
    assert len(backward) > 50
    assert all(base_x[i] == keys.index(k) for i, k in backward)
    # and that is not what row numbers give: the plan's recomputed ops shift its backward
    assert any(i != keys.index(k) for i, k in backward)


def test_plot_timeline_writes_the_file(plan: autoremat.Plan, tmp_path: Path) -> None:
    out = tmp_path / "timeline.png"
    plot_timeline(plan, out)
    assert out.stat().st_size > 10_000
