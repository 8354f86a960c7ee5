"""The quick zoo's check, shared by the test files that split the zoo between CI's two workers: a family is
captured and planned at one budget, the step's measured peak holds it, and the gradients are eager's."""

from __future__ import annotations

import copy

import torch

import autoremat
from autoremat.measure import measure_peak
from examples import zoo
from tests.tolerances import assert_grads_close, batch_depth

LOOSENESS = 0.95  # the budget, as a share of eager's own steady peak: below it, something must be recomputed


def _step(fn, batch):
    def step():
        out = fn(**batch)
        out.loss.backward()
    return step


def _grads(model, step):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(0)
    step()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def check_family(family: str, lora: bool = False) -> autoremat.Plan:
    model, batch = zoo.build(family, zoo.TINY)
    if lora:
        model = zoo.lora(model)
    eager = copy.deepcopy(model)
    eager_step = _step(eager, batch)
    eager_step()
    _, m = measure_peak(eager_step, baseline_objs=(eager, batch))
    ref = _grads(eager, eager_step)
    budget = int(LOOSENESS * m.peak_bytes)
    om = autoremat.optimize(model, budget=budget, example_inputs=batch, optimizer=None, compiler="eager")
    step = _step(om, batch)
    step()
    _, ours = measure_peak(step, baseline_objs=(model, batch))
    assert ours.peak_bytes <= budget, (family, ours.peak_bytes, budget)
    got = _grads(model, step)
    assert got.keys() == ref.keys()
    # each gradient sums over every element of the batch, each through a hidden-wide dot product, in another
    # order than eager's (other graphs, other kernels)
    assert_grads_close([(got[n], r, f"{family}: {n}") for n, r in ref.items()],
                       depth=batch_depth(batch) * zoo.TINY.hidden)
    return om.plan
