"""The planned step compiled by swapping the plan into the code of the trace it was planned on
(planning/planned_in_place.py) must be the step that tracing it again with the plan gives: the same plan,
the same gradients bit for bit (dropout's masks included), the same measured peak, with no AOTAutograd
trace of its own.

The model: a 3-block stack with dropout at half of eager's activation peak. Its two identical blocks run
one compiled function (planning/same_regions.py) and the plan saves other values in each, so the swap puts
two partitions behind that one function (capture/graph_code.py's last-slot marker).
"""

import pytest
import torch
from torch._dynamo.utils import counters

import autoremat
from autoremat import switches
from autoremat.measure import measure_peak
from examples import models


def _budget(model, inputs) -> int:
    """Parameters + their gradients + inputs + half of eager's activation peak in the steady state."""
    step = lambda: models.loss_of(model(*inputs)).backward()  # noqa: E731
    step()  # .grad buffers exist, as in every micro-step after the first
    _, eager = measure_peak(step, baseline_bytes=0)
    model.zero_grad(set_to_none=True)
    fixed = 2 * sum(p.numel() * p.element_size() for p in model.parameters())
    return fixed + sum(t.numel() * t.element_size() for t in inputs) + eager.delta_peak_bytes // 2


@pytest.fixture(scope="module")
def both_ways():
    """(swapped, traced again): each the RematModule, its AOTAutograd traces, its gradients, its measured peak."""
    torch.manual_seed(0)
    model, inputs = models.transformer_stack(batch=2, seq=32, n_layer=3, d=64, n_head=4, dropout=0.1)
    budget = _budget(model, inputs)
    runs = []
    for swap in (True, False):
        with switches.using(swap=swap):
            before = counters["aot_autograd"]["total"]
            om = autoremat.optimize(model, budget, inputs, optimizer=None, compiler="eager", progress=False)
            traces = counters["aot_autograd"]["total"] - before
        model.zero_grad(set_to_none=True)
        torch.manual_seed(1)
        models.loss_of(om(*inputs)).backward()
        grads = [p.grad.clone() for p in model.parameters()]
        _, measured = measure_peak(lambda om=om: models.loss_of(om(*inputs)).backward(), baseline_bytes=0)  # steady state
        runs.append((om, traces, grads, measured.delta_peak_bytes))
    return runs


def test_the_swap_puts_two_partitions_behind_the_identical_blocks_function(both_ways):
    (swapped, *_), _ = both_ways
    plans = {id(code): len(code.runners) for _, _, code in swapped._planner.codes}
    assert len(swapped._planner.codes) == 4  # the first block, the two identical ones, the tail
    assert sorted(plans.values()) == [1, 1, 2], "the identical blocks save different values at this budget"


def test_a_plan_swapped_in_is_the_plan_traced_again(both_ways):
    (swapped, swapped_traces, swapped_grads, swapped_peak), (traced, traced_traces, traced_grads, traced_peak) = both_ways
    assert swapped.plan.to_dict()["graphs"] == traced.plan.to_dict()["graphs"]
    assert swapped.plan.predicted_peak == traced.plan.predicted_peak
    # The same ops in the same order, the same dropout masks: the same bits, and the same bytes.
    assert all(torch.equal(a, b) for a, b in zip(swapped_grads, traced_grads, strict=True))
    assert swapped_peak == traced_peak
    # The capture traces 3 graphs (the first block, one of the identical blocks, the tail). Swapped, that is
    # all; traced again, the compile traces all 4 graphs (the identical blocks save different values).
    assert swapped_traces == 3
    assert traced_traces == swapped_traces + 4
