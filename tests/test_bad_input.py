"""Bad input gets a clear message, not a traceback wall: budgets, example inputs that do not fit the
model, graph breaks, shape changes, no_grad / eval, and the meta device."""

import math

import pytest
import torch
import torch.nn as nn

import autoremat
from examples import models
from tests.tolerances import assert_grads_close, batch_depth


def _mlp():
    torch.manual_seed(0)
    return models.mlp(batch=8, width=32, depth=2)


@pytest.mark.parametrize("budget", [-1, 0, math.nan, math.inf, -2.5, "20 gb", "twenty", "", "20XB", True, None])
def test_malformed_budgets_name_the_accepted_forms(budget):
    model, ex = _mlp()
    with pytest.raises(ValueError, match="budget must be .*20GB"):
        autoremat.optimize(model, budget=budget, example_inputs=ex, compiler="eager")


@pytest.mark.parametrize("opts, match", [
    ({"time_limit": 0}, "time_limit must be a positive"),
    ({"time_limit": math.nan}, "time_limit must be a positive"),
    ({"gap": -0.1}, "gap must be"),
    ({"gap": 1.5}, "gap must be"),
    ({"solver": "gurobi"}, "solver must be"),
    ({"solver": "cbc"}, "no longer supported.*HiGHS.*solver='highs'"),
])
def test_malformed_solver_options(opts, match):
    model, ex = _mlp()
    with pytest.raises(ValueError, match=match):
        autoremat.optimize(model, budget="1GB", example_inputs=ex, **opts)


def test_wrong_shape_says_inputs_do_not_fit_and_shows_the_original_error(capfd):
    model, _ = _mlp()
    with pytest.raises(ValueError) as err:
        autoremat.optimize(model, budget="1GB", example_inputs=(torch.randn(8, 16),), verify=False, compiler="eager")
    msg = str(err.value)
    assert msg.startswith("example_inputs do not fit the model: MLP cannot run on (Tensor[8, 16])")
    assert "must have same reduction dim" in msg  # the original error, not dynamo's explanation
    assert "Dynamo" not in msg and len(msg.splitlines()) == 1
    assert "Traceback" not in capfd.readouterr().err  # fake-tensor's logged traceback is kept out


@pytest.mark.parametrize("args", [(torch.randn(8, 32), torch.randn(3)), ()])
def test_wrong_number_of_arguments(args):
    model, _ = _mlp()
    with pytest.raises(TypeError, match=r"example_inputs do not fit the model: MLP.forward\(x.*\) cannot take"):
        autoremat.optimize(model, budget="1GB", example_inputs=args, compiler="eager")


@torch.library.custom_op("autoremat_test::widened", mutates_args=())
def widened(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@widened.register_fake
def _(x):  # declares a last dimension of 8 where the op keeps x's: only the trace's shapes go wrong
    return x.new_empty(*x.shape[:-1], 8)


@torch.library.custom_op("autoremat_test::unfaked", mutates_args=())
def unfaked(x: torch.Tensor) -> torch.Tensor:
    return x * 2


for _op in (widened, unfaked):
    _op.register_autograd(lambda ctx, g: g * 2)


class FakeOnlyFailure(nn.Module):
    def __init__(self, op):
        super().__init__()
        self.lin, self.op = nn.Linear(16, 16), op

    def forward(self, x):
        h = self.lin(x)
        return (self.op(h) * h).sum()


@pytest.mark.parametrize("op, failed_on", [
    (widened, "failed on mul (at test_bad_input.py:"),  # the product of the op's wrongly shaped fake output and h
    (unfaked, "failed on autoremat_test.unfaked.default"),
])
def test_a_failure_of_the_capture_alone_is_ours_and_names_the_op(op, failed_on, capfd):
    model, x = FakeOnlyFailure(op), torch.randn(4, 16)
    model(x).backward()  # eager runs it
    with pytest.raises(autoremat.CaptureError) as err:
        autoremat.optimize(model, budget="1GB", example_inputs=(x,), verify=False, compiler="eager")
    msg = str(err.value)
    assert msg.startswith("autoremat could not capture FakeOnlyFailure on (Tensor[4, 16]), which eager PyTorch runs")
    assert failed_on in msg, msg
    assert "do not fit" not in msg and "not of the inputs" in msg and len(msg.splitlines()) == 1
    assert "Traceback" not in capfd.readouterr().err


def test_example_inputs_of_the_wrong_kind():
    model, _ = _mlp()
    with pytest.raises(TypeError, match="example_inputs must be a tensor"):
        autoremat.optimize(model, budget="1GB", example_inputs=3, compiler="eager")


def _grads(model, fn, x):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    fn(x).sum().backward()
    grads = [p.grad.clone() for p in model.parameters() if p.requires_grad]
    model.zero_grad(set_to_none=True)
    return grads


def _assert_same_grads(model, om, x):
    assert_grads_close([(g, r) for g, r in zip(_grads(model, om, x), _grads(model, model, x), strict=True)],
                       depth=batch_depth(x))


class DataDependent(nn.Module):
    """Python control flow on a tensor's value: dynamo splits the forward in two graphs."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        if h.sum() > 0:
            h = h * 2
        return torch.tanh(self.b(h)).sum()


def test_data_dependent_control_flow_is_planned_per_graph_and_jointly():
    torch.manual_seed(0)
    model, x = DataDependent(), torch.randn(8, 16)
    om = autoremat.optimize(model, budget="1GB", example_inputs=(x,), compiler="eager")
    assert om.num_graphs == 2
    assert any("2 graphs" in n and "planned jointly" in n for n in om.plan.notes), om.plan.notes
    _assert_same_grads(model, om, x)
    # A new input shape after planning: planned once more, jointly (used to raise PlanMismatch).
    _assert_same_grads(model, om, torch.randn(4, 16))


STEPS = 0


class MutatesGlobal(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x):
        global STEPS
        STEPS += 1  # dynamo guards on the global's value: every call recompiles
        return torch.tanh(self.b(torch.tanh(self.a(x)))).sum()


def test_a_model_that_mutates_a_global_is_reported_and_not_resolved_each_call():
    torch.manual_seed(0)
    model, x = MutatesGlobal(), torch.randn(8, 16)
    before = STEPS
    om = autoremat.optimize(model, budget="1GB", example_inputs=(x,), compiler="eager")
    assert STEPS > before  # the side effect happened (dynamo replays it)
    assert any("recompiled on its second call" in n for n in om.plan.notes), om.plan.notes
    _assert_same_grads(model, om, x)
    assert om._planner.plans == []  # every recompile reused the plan: nothing was solved after optimize


def test_new_input_shapes_are_planned_once_each():
    model, ex = _mlp()
    om = autoremat.optimize(model, budget="1GB", example_inputs=ex, verify=False, compiler="eager")
    planned = len(om.plans)
    for batch in (4, 12, 4, 12, 8):
        _assert_same_grads(model, om, torch.randn(batch, 32))
    assert len(om.plans) == planned + 2  # 4 and 12 once each; 8 was planned by optimize


def test_a_new_shape_that_does_not_fit_raises_budget_error_itself():
    model, ex = _mlp()
    lo = autoremat.planning.plan.Ledger.from_dict(autoremat.optimize(model, 10**9, ex, verify=False, compiler="eager").plan.ledger).fixed
    om = autoremat.optimize(model, budget=lo + 64 * 1024, example_inputs=ex, verify=False, compiler="eager")
    with pytest.raises(autoremat.BudgetError, match="smallest budget that fits"):
        om(torch.randn(4096, 32)).backward()


def test_no_grad_and_eval_with_grad():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.BatchNorm1d(16), nn.Dropout(0.5), nn.Linear(16, 1))
    x = torch.randn(8, 16)
    om = autoremat.optimize(model, budget="1GB", example_inputs=(x,), compiler="eager")
    n = len(om.plans)
    with torch.no_grad():  # no backward: runs the model eagerly, nothing traced or planned
        torch.manual_seed(2)
        got = om(x)
        torch.manual_seed(2)
        torch.testing.assert_close(got, model(x))
    assert len(om.plans) == n
    model.eval()  # grad enabled in eval mode: a different graph (running stats, no dropout), planned once
    _assert_same_grads(model, om, x)
    _assert_same_grads(model, om, x)
    assert len(om.plans) == n + 1
    model.train()


def test_meta_device_plans_without_verification():
    model = models.TransformerStack(n_layer=2, d=32, n_head=4).to("meta")
    x = torch.empty(2, 16, 32, device="meta")
    om = autoremat.optimize(model, budget="1GB", example_inputs=(x,), compiler="eager")
    assert om.plan.graphs and om.plan.activation_peak > 0
    assert any("meta device" in n for n in om.plan.notes)
    assert not any(n.startswith("verified") for n in om.plan.notes)
