"""The smallest budget is one number: whatever budget a refusal answers, it names the floor a query with
budget=1 names, and every budget from that floor up plans (the memory model's plan; verification aside)."""

from __future__ import annotations

import copy

import pytest
import torch

import autoremat
from autoremat.planning.compilers import inductor_problem
from examples import models

FRACTIONS_BELOW = (0.5, 0.9, 0.97, 0.995)  # of the floor: refused, each naming the same floor
FRACTIONS_ABOVE = (1.0, 1.01)  # planned


def _floor(model: torch.nn.Module, ex: tuple, budget: int, compiler: str) -> int | None:
    """The smallest budget a refusal at `budget` names; None where the budget plans."""
    try:
        autoremat.optimize(copy.deepcopy(model), budget=budget, example_inputs=ex, optimizer=None, compiler=compiler,
                           verify=False, progress=False)
    except autoremat.BudgetError as e:
        assert e.smallest_budget is not None, e
        return e.smallest_budget
    return None


def _check(model: torch.nn.Module, ex: tuple, compiler: str) -> None:
    floor = _floor(model, ex, 1, compiler)
    assert floor is not None
    named = {f: _floor(model, ex, int(f * floor), compiler) for f in FRACTIONS_BELOW}
    assert all(n == floor for n in named.values()), (floor, named)
    planned = {f: _floor(model, ex, int(f * floor) + 1, compiler) for f in FRACTIONS_ABOVE}
    assert all(n is None for n in planned.values()), (floor, planned)


@pytest.mark.parametrize("name", ["convnet", "transformer_stack"])
def test_every_refusal_names_the_floor_and_every_budget_above_it_plans(name):
    torch.manual_seed(0)
    model, ex = models.convnet(batch=4, size=16, channels=8, blocks=3) if name == "convnet" else \
        models.transformer_stack(batch=2, seq=32, n_layer=3, d=64, n_head=4, dropout=0.1)
    _check(model, ex, "eager")


@pytest.mark.slow
def test_under_inductor_every_refusal_names_the_floor():
    problem = inductor_problem("cpu")
    if problem is not None:
        pytest.skip(f"this machine cannot run Inductor on CPU: {problem}")
    torch.manual_seed(0)
    model, ex = models.convnet(batch=4, size=16, channels=8, blocks=3)
    _check(model, ex, "inductor")
