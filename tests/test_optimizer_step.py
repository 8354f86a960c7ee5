"""The whole step fits: forward, backward and `optimizer.step()`, measured together near the floor.

optimizer.step() allocates temporaries after the backward has freed the activations (foreach Adam:
a parameter-sized set); with tiny activations they are the step's peak. The ledger models them per
implementation (`autoremat.model.optimizers`), and these tests hold real steps to it."""

import pytest
import torch

import autoremat
from autoremat.measure import measure_peak
from autoremat.model.ledger import ledger_for_model
from autoremat.model.optimizers import optimizer_step_bytes
from examples import models

NEAR = 1.02  # a budget within 2% of the floor


def _model():
    torch.manual_seed(0)  # two tokens: activations are next to nothing, parameters are the memory
    return models.transformer_stack(n_layer=2, d=64, n_head=4, seq=2, batch=1, dropout=0.0)


def _opt(model, kind: str) -> torch.optim.Optimizer:
    flags = {"foreach": {"foreach": True}, "for-loop": {"foreach": False}, "fused": {"fused": True}}[kind]
    return torch.optim.AdamW(model.parameters(), lr=1e-3, **flags)


def _step_transient(kind: str) -> int:
    """What one AdamW.step() allocates beyond its state, measured with state present."""
    model, _ = _model()
    opt = _opt(model, kind)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    _, m = measure_peak(opt.step, baseline_objs=(model, opt))
    return m.delta_peak_bytes


@pytest.mark.parametrize("kind", ["foreach", "for-loop", "fused"])
def test_the_ledger_predicts_what_adamw_step_allocates(kind):
    model, _ = _model()
    predicted = optimizer_step_bytes(_opt(model, kind), list(model.parameters()))
    measured = _step_transient(kind)
    # Beyond the modelled tensors, step() makes a few 0-d scalars (4 bytes each: bias corrections).
    assert predicted <= measured <= predicted + 64, (predicted, measured)


def test_a_name_stands_for_torchs_default_on_the_parameters_device():
    model, _ = _model()
    assert optimizer_step_bytes("adamw", model.parameters()) == optimizer_step_bytes(
        _opt(model, "for-loop"), list(model.parameters()))  # CPU: torch's default is the for-loop
    assert optimizer_step_bytes("sgd_momentum", model.parameters()) == 0


@pytest.mark.parametrize("kind", ["foreach", "for-loop", "fused"])
def test_the_whole_step_with_optimizer_step_fits_near_the_floor(kind):
    model, ex = _model()
    opt = _opt(model, kind)
    ledger = ledger_for_model(model, opt, inputs=(ex, {}))
    with pytest.raises(autoremat.BudgetError) as err:
        autoremat.optimize(model, budget=ledger.fixed + 1, example_inputs=ex, optimizer=opt, verify=False, compiler="eager")
    floor = err.value.smallest_budget
    if kind == "foreach":  # here the optimizer's temporaries, not the activations, set the floor
        assert floor - ledger.fixed > ledger.optimizer_step > 0
    budget = int(floor * NEAR)
    om = autoremat.optimize(model, budget=budget, example_inputs=ex, optimizer=opt, compiler="eager")
    assert om.plan.predicted_peak <= budget

    def step() -> None:
        models.loss_of(om(*ex)).backward()
        opt.step()
        opt.zero_grad(set_to_none=False)  # keep the .grad buffers: the accumulation steady state

    step()  # optimizer state and .grad buffers now exist
    _, m = measure_peak(step, baseline_objs=(model, opt, ex))
    assert m.peak_bytes <= budget, (kind, m.peak_bytes, budget, floor)
