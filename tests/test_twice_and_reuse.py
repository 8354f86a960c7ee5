"""Below checkpointing: backward buffers reused in place, and values recomputed twice.

Both are checked on real CPU steps: gradients are eager's (dropout on), the plan predicts the measured
steady-state peak, and the mechanism lowers what the step needs (against the same planner with it off).
"""

import pytest
import torch

import autoremat
import autoremat.model.profile as profile_mod
import autoremat.passes.remat as remat_pass
import autoremat.solve.solver as solver_mod
from autoremat.measure import measure_peak
from autoremat.model.cuts import cut_backward
from autoremat.passes.recompute_names import MARK, base
from examples import models
from tests.budgets import seeded_grads
from tests.tolerances import assert_grads_close

SEED_BYTES = 16  # `.backward()`'s scalar seed and the loss: allocated outside the plan's graphs


def _grads_and_peak(model, ex, om):
    grads = seeded_grads(model, (model, om), ex)

    def step() -> None:
        torch.manual_seed(1)
        models.loss_of(om(*ex)).backward()

    step()  # steady state: every .grad exists
    _, m = measure_peak(step, device=torch.device("cpu"), baseline_objs=(model, ex))
    model.zero_grad(set_to_none=True)
    return grads, m.peak_bytes


def _floor(model, ex) -> int:
    with pytest.raises(autoremat.BudgetError) as e:
        autoremat.optimize(model, budget=1, example_inputs=ex, optimizer=None, outputs="loss", verify=False,
                           compiler="eager")
    return e.value.smallest_budget


def test_a_backward_pointwise_op_writes_into_its_dying_input(monkeypatch):
    torch.manual_seed(0)
    model, ex = models.mlp(batch=512, width=64, depth=3)  # gelu between layers: gelu_backward reads a dying mm
    floor = _floor(model, ex)
    torch._dynamo.reset()
    om = autoremat.optimize(model, budget=floor, example_inputs=ex, optimizer=None, outputs="loss", verify=False,
                            compiler="eager")
    (got, want), peak = _grads_and_peak(model, ex, om)
    assert_grads_close([(g, r) for g, r in zip(got, want, strict=True)], depth=512)
    assert abs(om.plan.predicted_peak - peak) <= SEED_BYTES

    # with every backward op allocating its own output, the smallest budget is higher: by most of the
    # [512, 64] gradient that gelu_backward wrote into instead of allocating its own (128,772 of its
    # 131,072 B when written; the peak then falls elsewhere)
    monkeypatch.setattr(profile_mod, "dying_inputs", lambda gm: {})
    monkeypatch.setattr(remat_pass, "dying_inputs", lambda gm: {})
    torch._dynamo.reset()
    assert _floor(model, ex) - floor > 512 * 64 * 4 // 2


@pytest.mark.slow
def test_values_recomputed_twice_lower_the_stack_floor_with_eagers_gradients(monkeypatch, no_floors_remembered):
    torch.manual_seed(0)
    model, ex = models.transformer_stack(n_layer=4, d=128, n_head=4, seq=64, batch=2, dropout=0.1)
    floor = _floor(model, ex)
    torch._dynamo.reset()
    om = autoremat.optimize(model, budget=floor, example_inputs=ex, optimizer=None, outputs="loss", verify=False,
                            compiler="eager")
    cuts = [c for g in om.plan.graphs for c in g.again]
    assert cuts, "the floor's plan recomputes nothing twice"
    (got, want), peak = _grads_and_peak(model, ex, om)
    # the same ops and random draws (dropout replayed from its state)
    assert_grads_close([(g, r) for g, r in zip(got, want, strict=True)], depth=ex[0][..., 0].numel())
    assert abs(om.plan.predicted_peak - peak) <= SEED_BYTES

    # without the search for cuts the smallest budget is higher
    monkeypatch.setattr(solver_mod, "recompute_twice", lambda graphs, plan, granularity: plan)
    solver_mod.forget_floors()  # nor the plan found above
    torch._dynamo.reset()
    assert _floor(model, ex) > floor


def test_a_cut_recomputes_what_its_node_reads_and_later_readers_read_the_copy():
    from autoremat.model.graph_profile import NodeProfile

    def node(name, kind, *inputs):
        return NodeProfile(name=name, kind=kind, target="t", inputs=tuple(inputs), storage=name, nbytes=4)

    # a -> b, both recomputed; the backward: u reads b, c reads b, d reads a
    nodes = {n.name: n for n in (node("x", "input"), node("a", "forward", "x"), node("b", "forward", "a"),
                                 node("u", "backward", "b"), node("c", "backward", "b"), node("d", "backward", "a"))}
    order = {n: i for i, n in enumerate(nodes)}
    plain = ["a", "b", "u", "c", "d"]
    a2, b2 = f"a{MARK}2", f"b{MARK}2"
    assert cut_backward(nodes, plain, {"a", "b"}, set(), order) == (plain, {}, {})
    # a full cut at c: a and b are stale from c on; b's copy needs a's copy, and d reads it too
    out, reads, storage = cut_backward(nodes, plain, {"a", "b"}, {"c"}, order)
    assert out == ["a", "b", "u", a2, b2, "c", "d"]
    assert reads == {b2: (a2,), "c": (b2,), "d": (a2,)}
    assert storage == {a2: a2, b2: b2} and base(b2) == "b"
    # a narrow cut at c: only b runs again; a stays alive for d, and b's copy reads it
    out, reads, storage = cut_backward(nodes, plain, {"a", "b"}, set(), order, frozenset({"c"}))
    assert out == ["a", "b", "u", b2, "c", "d"]
    assert reads == {"c": (b2,)} and storage == {b2: b2}
