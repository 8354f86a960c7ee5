"""Budgets for tests: the range from the smallest budget a verified plan accepts to no recomputation."""

import pytest
import torch

import autoremat
from autoremat.model.ledger import Ledger
from examples import models


def seeded_grads(model, fns, example_inputs, seed: int = 1) -> list[list]:
    """Each parameter's gradient after one backward of each of `fns` (the model and its optimized form),
    from no `.grad` and the same seed, so dropout draws the same masks in every run."""
    grads = []
    for fn in fns:
        model.zero_grad(set_to_none=True)
        torch.manual_seed(seed)
        models.loss_of(fn(*example_inputs)).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    return grads


def budget_range(model, example_inputs) -> tuple[int, int]:
    """(smallest budget that fits, the least budget that recomputes nothing). The first can exceed the second
    where verification reserves scratch the memory model missed."""
    big = autoremat.optimize(model, budget=10**12, example_inputs=example_inputs, verify=False, compiler="eager")
    fixed = Ledger.from_dict(big.plan.ledger).fixed
    hi = big.plan.no_recompute_budget
    with pytest.raises(autoremat.BudgetError) as err:
        autoremat.optimize(model, budget=fixed + 1, example_inputs=example_inputs, verify=False, compiler="eager")
    lo = err.value.smallest_budget
    try:  # the verified plan may reserve scratch the memory model missed: that raises the floor
        autoremat.optimize(model, budget=lo, example_inputs=example_inputs, compiler="eager")
    except autoremat.BudgetError as verified:
        lo = verified.smallest_budget
    return lo, hi
