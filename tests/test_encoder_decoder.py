"""An HF encoder-decoder (T5, from config) plans and trains exactly.

T5's traced step holds lifted tensor constants (`_tensor_constant0`, get_attr nodes in the joint
graph); unhandled, they make the forward graph disagree with the simulated schedule. At a
generous, a middle and a near-minimal budget the gradients equal eager's, the measured peak stays
under the budget and the prediction is within 10% of the measurement.
"""

import pytest
import torch
from transformers import T5Config, T5ForConditionalGeneration

import autoremat
from autoremat.measure import measure_peak
from autoremat.planning.plan import Ledger
from tests.budgets import budget_range

D_FF, ENCODER_TOKENS = 64, 2 * 12
# Recomputation only reorders fp32 rounding. The longest chain behind a gradient element is about a
# d_ff contraction then a sum over the encoder's tokens: that many roundings of eps each, relative
# to the size of the summed terms (stood for by the expected tensor's largest magnitude).
RTOL = (D_FF + ENCODER_TOKENS) * torch.finfo(torch.float32).eps


def _assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, rtol=RTOL, atol=RTOL * expected.abs().max().item())


def _t5() -> tuple[torch.nn.Module, dict]:
    config = T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=D_FF, num_layers=1, num_decoder_layers=1, num_heads=4,
                      relative_attention_num_buckets=8, relative_attention_max_distance=16, dropout_rate=0.1,
                      decoder_start_token_id=0, pad_token_id=0, use_cache=False)
    torch.manual_seed(0)
    model = T5ForConditionalGeneration(config)  # training mode: dropout is on
    inputs = {"input_ids": torch.randint(1, 64, (2, ENCODER_TOKENS // 2)), "labels": torch.randint(1, 64, (2, 8))}
    return model, inputs


def _grads(model: torch.nn.Module, fn, inputs: dict) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)  # the same dropout draws in every run
    loss = fn(**inputs).loss
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]


def _check_budget(model: torch.nn.Module, inputs: dict, state: dict, ref_loss, ref,
                  budget: int) -> tuple[autoremat.Plan, int]:
    """Plan under `budget`, then: gradients equal eager's, the measured peak fits, the prediction is close."""
    model.load_state_dict(state)
    om = autoremat.optimize(model, budget=budget, example_inputs=inputs, compiler="eager")
    model.load_state_dict(state)
    loss, grads = _grads(model, om, inputs)
    _assert_close(loss, ref_loss)
    for g, r in zip(grads, ref, strict=True):
        _assert_close(g, r)

    def step() -> None:
        torch.manual_seed(1)
        out = om(**inputs)  # held through the backward, as a training loop holds it
        out.loss.backward()

    _, m = measure_peak(step, baseline_objs=(model, inputs))  # grads exist: the accumulation steady state
    fixed = Ledger.from_dict(om.plan.ledger).fixed
    assert fixed + m.delta_peak_bytes <= budget, (fixed + m.delta_peak_bytes, budget, om.plan.summary())
    assert abs(m.delta_peak_bytes - om.plan.activation_peak) <= 0.10 * m.delta_peak_bytes, (
        m.delta_peak_bytes, om.plan.activation_peak, om.plan.summary())
    return om.plan, m.delta_peak_bytes


@pytest.mark.slow
def test_t5_middle_budget():
    """The fast case: a budget halfway between the unverified floor and the unoptimized peak."""
    model, inputs = _t5()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    ref_loss, ref = _grads(model, model, inputs)
    big = autoremat.optimize(model, budget=10**12, example_inputs=inputs, verify=False, compiler="eager")
    kinds = {p.kind for graph in big._planner.profiles for p in graph.nodes.values()}
    assert "constant" in kinds, "no lifted tensor constant reached the planner"
    fixed = Ledger.from_dict(big.plan.ledger).fixed
    with pytest.raises(autoremat.BudgetError) as err:
        autoremat.optimize(model, budget=fixed + 1, example_inputs=inputs, verify=False, compiler="eager")
    lo, hi = err.value.smallest_budget, fixed + big.plan.baseline_peak
    assert lo < hi, (lo, hi)  # else the middle budget would not make the plan recompute anything
    plan, _ = _check_budget(model, inputs, state, ref_loss, ref, (lo + hi) // 2)
    assert plan.graphs[0].recomputed, plan.summary()


@pytest.mark.slow
def test_t5_three_budgets():
    model, inputs = _t5()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    ref_loss, ref = _grads(model, model, inputs)
    lo, hi = budget_range(model, inputs)
    hi = max(lo, hi)
    peaks = [_check_budget(model, inputs, state, ref_loss, ref, int(lo + frac * (hi - lo)))[1]
             for frac in (1.0, 0.5, 0.0)]
    assert peaks == sorted(peaks, reverse=True), peaks  # smaller budget, never a larger peak
