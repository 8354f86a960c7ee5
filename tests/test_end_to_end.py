"""End to end: for real models at generous, middle and near-minimal budgets, autoremat's gradients
equal eager's, the measured peak stays under the budget, the prediction is within 10% of the
measurement, and a smaller budget never measures a larger peak."""

import pytest
import torch

import autoremat
from autoremat.measure import measure_peak
from examples import models
from tests.budgets import budget_range
from tests.tolerances import assert_close_for, assert_grads_close, batch_depth

MODELS = ["mlp", "transformer_stack", "convnet", "dict_output", "gpt2", "llama"]
SIZES = {"mlp": {"batch": 1024}}  # at batch 64 the MLP's peak is its gradients: nothing to recompute


def _call(model, ex):
    return models.loss_of(model(*ex) if isinstance(ex, tuple) else model(**ex))


def _grads(model, ex, fn, seed=1):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    loss = _call(fn, ex)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]


# The HF models take 5-7 minutes each on 2 cores: they run in the slow pass (CI runs it too).
@pytest.mark.parametrize("name", [pytest.param(m, marks=pytest.mark.slow) if m in ("gpt2", "llama") else m
                                  for m in MODELS])
def test_budgets_hold_and_gradients_are_exact(name):
    torch.manual_seed(0)
    model, ex = getattr(models, name)(**SIZES.get(name, {}))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    ref_loss, ref = _grads(model, ex, model)
    lo, hi = budget_range(model, ex)
    assert lo <= hi + 1024  # equal when recomputation cannot lower the peak (reported with 1 KiB slack)
    hi = max(lo, hi)
    peaks = []
    for frac in (1.0, 0.5, 0.1):
        budget = int(lo + frac * (hi - lo))
        model.load_state_dict(state)
        om = autoremat.optimize(model, budget=budget, example_inputs=ex, compiler="eager")
        model.load_state_dict(state)  # planning must not have moved buffers; reset anyway for the reference
        loss, grads = _grads(model, ex, om)
        assert_close_for(loss, ref_loss, depth=batch_depth(ex))
        assert_grads_close([(g, r) for g, r in zip(grads, ref, strict=True)], depth=batch_depth(ex))

        def step(om=om):
            torch.manual_seed(1)
            out = om(*ex) if isinstance(ex, tuple) else om(**ex)  # held through backward, as in a real loop
            models.loss_of(out).backward()

        _, m = measure_peak(step, baseline_objs=(model, ex))  # grads exist: the accumulation steady state
        ledger = autoremat.planning.plan.Ledger.from_dict(om.plan.ledger)
        measured_total = ledger.fixed + m.delta_peak_bytes
        assert measured_total <= budget, (frac, measured_total, budget)
        assert abs(m.delta_peak_bytes - om.plan.activation_peak) <= 0.10 * m.delta_peak_bytes, (
            frac, m.delta_peak_bytes, om.plan.activation_peak)
        peaks.append(m.delta_peak_bytes)
    assert peaks == sorted(peaks, reverse=True), peaks  # smaller budget, never a larger peak


def test_dropout_is_never_recomputed_with_fresh_randomness():
    torch.manual_seed(0)
    model, ex = models.transformer_stack(n_layer=2, d=64, seq=32, dropout=0.5)
    _, ref = _grads(model, ex, model)
    lo, hi = budget_range(model, ex)
    om = autoremat.optimize(model, budget=lo + (hi - lo) // 20, example_inputs=ex, compiler="eager")
    assert om.plan.graphs[0].recomputed, "a tight budget should recompute something"
    _, grads = _grads(model, ex, om)
    assert_grads_close([(g, r) for g, r in zip(grads, ref, strict=True)], depth=batch_depth(ex))


def test_pytorch_memory_budget_gets_dropout_wrong():
    """The trap autoremat avoids: PyTorch's activation_memory_budget < 1 recomputes dropout afresh."""
    torch.manual_seed(0)
    model, ex = models.mlp(batch=32, width=64, depth=3)
    model.layers.insert(1, torch.nn.Dropout(0.5))  # MLP iterates its layers; dropout in between

    _, ref = _grads(model, ex, model)
    torch._dynamo.reset()
    with torch._functorch.config.patch(activation_memory_budget=0.0):
        cm = torch.compile(model, backend="aot_eager")
        _, grads = _grads(model, ex, cm)
    torch._dynamo.reset()
    err = max(((g - r).abs().max() / r.abs().max()).item() for g, r in zip(grads, ref))
    assert err > 1e-2  # if PyTorch fixes this, the test tells us


def test_batchnorm_running_stats_update_once_per_step():
    torch.manual_seed(0)
    model, ex = models.convnet()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    lo, hi = budget_range(model, ex)
    om = autoremat.optimize(model, budget=(lo + hi) // 2, example_inputs=ex, compiler="eager")
    for k, v in model.state_dict().items():  # planning left no trace
        torch.testing.assert_close(v, before[k])
    _call(om, ex).backward()
    eager = models.convnet()[0]
    eager.load_state_dict(before)
    _call(eager, ex).backward()
    for (k, v), (_, e) in zip(model.state_dict().items(), eager.state_dict().items()):
        torch.testing.assert_close(v, e, msg=k)


def test_batchnorm_outputs_are_recomputed_exactly_and_stats_update_once():
    """At its smallest budget a BatchNorm net recomputes batch norm in the backward (from the batch, without
    the running stats): gradients and running stats equal eager's, so the stats were updated once, by the
    forward (a second update would move them by a momentum step, far outside rounding)."""
    torch.manual_seed(0)
    model, ex = models.convnet()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    eager = models.convnet()[0]
    eager.load_state_dict(before)
    lo, _ = budget_range(model, ex)
    model.load_state_dict(before)
    om = autoremat.optimize(model, budget=lo, example_inputs=ex, compiler="eager")
    recomputed = {n for g in om.plan.graphs for n in g.recomputed}
    assert any(n.startswith("_native_batch_norm_legit_functional") for n in recomputed), sorted(recomputed)[:20]
    model.load_state_dict(before)
    _, grads = _grads(model, ex, om)
    _, ref = _grads(eager, ex, eager)
    assert_grads_close([(g, r) for g, r in zip(grads, ref, strict=True)], depth=batch_depth(ex))
    for (k, v), (_, e) in zip(model.state_dict().items(), eager.state_dict().items()):
        if v.is_floating_point():
            assert_close_for(v, e, depth=batch_depth(ex), msg=k)
        else:
            assert torch.equal(v, e), k  # num_batches_tracked: one step


def test_frozen_parameters_get_no_gradient():
    torch.manual_seed(0)
    model, ex = models.transformer_stack(n_layer=2, d=64, seq=16)
    for p in model.blocks[0].parameters():
        p.requires_grad_(False)
    _, ref = _grads(model, ex, model)
    om = autoremat.optimize(model, budget=10**12, example_inputs=ex, compiler="eager")
    _, grads = _grads(model, ex, om)
    assert all(p.grad is None for p in model.blocks[0].parameters())
    assert_grads_close([(g, r) for g, r in zip(grads, ref, strict=True)], depth=batch_depth(ex))


def test_graph_breaks_are_planned_jointly():
    class Broken(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(32, 32), torch.nn.Linear(32, 32)

        def forward(self, x):
            h = torch.tanh(self.a(x))
            print("", end="")  # a graph break
            return torch.tanh(self.b(h)).sum()

    torch.manual_seed(0)
    model = Broken()
    ex = (torch.randn(8, 32),)
    _, ref = _grads(model, ex, model)
    om = autoremat.optimize(model, budget=10**9, example_inputs=ex, compiler="eager")
    assert om.num_graphs == 2
    assert any("jointly" in n for n in om.plan.notes)
    _, grads = _grads(model, ex, om)
    assert_grads_close([(g, r) for g, r in zip(grads, ref, strict=True)], depth=batch_depth(ex))


def test_budget_errors_name_the_smallest_budget():
    model, ex = models.mlp(batch=8, width=32, depth=2)
    with pytest.raises(autoremat.BudgetError) as err:
        autoremat.optimize(model, budget="1KB", example_inputs=ex, compiler="eager")
    assert err.value.smallest_budget > 1000
    assert "smallest budget that fits" in str(err.value) and "parameters" in str(err.value)
    om = autoremat.optimize(model, budget=err.value.smallest_budget, example_inputs=ex, compiler="eager")
    assert om.plan.predicted_peak <= err.value.smallest_budget
    with pytest.raises(ValueError, match="20GB"):
        autoremat.optimize(model, budget="20 gb", example_inputs=ex, compiler="eager")


def test_budget_errors_name_what_is_live_at_the_floor_plans_peak():
    """Where the floor is above the budget, the refusal names the largest tensors the memory model holds at
    the most memory-frugal plan's peak, with the op that allocated each, its module and its bytes."""
    model, ex = models.mlp(batch=8, width=32, depth=2)
    with pytest.raises(autoremat.BudgetError) as err:
        autoremat.optimize(model, budget="1KB", example_inputs=ex, compiler="eager")
    e = err.value
    live = e.at_peak
    assert 0 < len(live) <= 5
    assert [t.nbytes for t in live] == sorted((t.nbytes for t in live), reverse=True)
    assert sum(t.nbytes for t in live) <= e.frugal.peak
    # the largest is a (32-wide, batch 8) fp32 activation or gradient of one of the mlp's Linear layers
    top = live[0]
    assert top.op.startswith("aten.") and top.module.startswith("layers.") and top.nbytes >= 8 * 32 * 4, top
    assert "Largest tensors live at that plan's peak" in str(e)
    assert f"{top.op} in {top.module}" in str(e) and f"({top.nbytes} bytes)" in str(e)


def test_plan_round_trips_and_reapplies(tmp_path):
    torch.manual_seed(0)
    model, ex = models.transformer_stack(n_layer=2, d=64, seq=16)
    lo, hi = budget_range(model, ex)
    om = autoremat.optimize(model, budget=(lo + hi) // 2, example_inputs=ex, compiler="eager")
    path = tmp_path / "plan.json"
    om.plan.save(path)
    loaded = autoremat.Plan.load(path)
    assert loaded == om.plan
    again = autoremat.optimize(model, budget=(lo + hi) // 2, example_inputs=ex, plan=loaded, compiler="eager")
    assert again.plan.graphs[0].saved == om.plan.graphs[0].saved
    other, other_ex = models.transformer_stack(n_layer=3, d=64, seq=16)
    with pytest.raises(autoremat.PlanMismatch, match="traced to graph"):
        autoremat.optimize(other, budget=10**12, example_inputs=other_ex, plan=loaded, compiler="eager")


def test_backend_face():
    torch._dynamo.reset()  # earlier tests compiled this model class with other backends
    torch.manual_seed(0)
    model, ex = models.mlp(batch=16, width=64, depth=3)
    _, ref = _grads(model, ex, model)
    be = autoremat.backend(budget="1GB", compiler="eager")  # the default ("auto") is tests/test_compilers.py's
    cm = torch.compile(model, backend=be)
    _, grads = _grads(model, ex, cm)
    assert_grads_close([(g, r) for g, r in zip(grads, ref, strict=True)], depth=batch_depth(ex))
    assert be.planner.combined_plan.graphs


def test_no_grad_runs_eagerly_without_planning_again():
    model, ex = models.mlp(batch=8, width=32, depth=2)
    om = autoremat.optimize(model, budget=10**9, example_inputs=ex, compiler="eager")
    n = len(om._planner.profiles)
    with torch.no_grad():
        torch.testing.assert_close(om(*ex), model(*ex))
    assert len(om._planner.profiles) == n


@pytest.mark.slow
def test_inductor_on_request():
    """compiler="inductor": the plan still holds and gradients agree with eager to Inductor's own accuracy."""
    torch.manual_seed(0)
    model, ex = models.transformer_stack(n_layer=2, d=64, seq=32, dropout=0.0)
    _, ref = _grads(model, ex, model)
    with pytest.raises(autoremat.BudgetError) as err:
        autoremat.optimize(model, budget=1, example_inputs=ex, verify=False, compiler="inductor")
    budget = int(err.value.smallest_budget * 1.1)
    om = autoremat.optimize(model, budget=budget, example_inputs=ex, compiler="inductor")
    _, grads = _grads(model, ex, om)
    # Inductor reorders reductions; plain torch.compile(backend="inductor") differs from eager by ~1e-2 here.
    err = max(((g - r).abs().max() / r.abs().max()).item() for g, r in zip(grads, ref, strict=True))
    assert err < 5e-2, err

    def step():
        torch.manual_seed(1)
        _call(om, ex).backward()

    _, m = measure_peak(step, baseline_objs=(model, ex))
    assert autoremat.planning.plan.Ledger.from_dict(om.plan.ledger).fixed + m.delta_peak_bytes <= budget
