"""Dropout masks replayed from the generator state instead of saved (autoremat.rng_replay).

Checked on real steps of a plan near the floor with every mask replayed rather than saved: the forward
draws once (the random stream after a step is eager's), the backward's replay gives eager's masks
(gradients equal eager's with dropout on), and the floor is below what saving every mask costs."""

import pytest
import torch

import autoremat
from autoremat.capture.aot import capture
from autoremat.model.schedule import make_schedule
from autoremat.passes import decompositions, rng_replay
from examples import models
from tests.budgets import budget_range
from tests.tolerances import assert_grads_close


def _stack(dropout: float = 0.1):
    torch.manual_seed(0)
    return models.transformer_stack(n_layer=3, d=64, n_head=4, seq=32, batch=2, dropout=dropout)


def _step(fn, ex, seed: int = 1) -> torch.Tensor:
    torch.manual_seed(seed)
    models.loss_of(fn(*ex)).backward()
    return torch.get_rng_state()


@pytest.fixture(params=["bernoulli", "fused kernel"])
def mask_path(request, monkeypatch):
    """The CPU's bernoulli mask, or the path a fused-dropout device (CUDA) takes, forced here on CPU: the
    mask drawn by the device's own native_dropout kernel (`autoremat::dropout_mask`), the scale computed
    by the graph. Everything after the draw (replay, planning, the split) is the same code on both."""
    if request.param == "fused kernel":
        monkeypatch.setattr(decompositions, "BERNOULLI_DEVICES", ())
    return request.param


def _replaying_every_mask(om) -> tuple[autoremat.Plan, list[str]]:
    """om's plan with every saved mask replaced by the generator state its draw is replayed from (a plan is
    the user's to edit), and what the edited plan recomputes (its schedules, as the graph passes build them)."""
    plan, recomputed = om.plan, []
    profiles = {g.index: g for g in om._planner.profiles}
    for g in plan.graphs:
        nodes = profiles[g.index].nodes
        masks = [n for n in g.saved if n.startswith("replay_draw")]
        states = [nodes[m].inputs[0] for m in masks]  # replay_draw(state, op, *args)
        g.saved = [n for n in g.saved if n not in masks] + [s for s in states if s not in g.saved]
        recomputed += make_schedule(profiles[g.index], set(g.saved) | set(g.again)).recomputed
    return plan, recomputed


def test_masks_are_replayed_and_match_eagers_draws(mask_path):
    model, ex = _stack()
    lo, _ = budget_range(model, ex)
    # Near the floor; whether a plan there saves a mask or replays its draw is the planner's choice (under
    # the fused kernel the replay holds the kernel's output while it draws), so every draw is made a replay.
    plan, recomputed = _replaying_every_mask(autoremat.optimize(model, budget=lo, example_inputs=ex, compiler="eager"))
    assert sum(n.startswith("replay_draw") for n in recomputed) == 9, recomputed  # 3 dropouts in each of 3 blocks
    om = autoremat.optimize(model, budget=10**12, example_inputs=ex, plan=plan, compiler="eager")
    model.zero_grad(set_to_none=True)
    after_planned = _step(om, ex)
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    after_eager = _step(model, ex)
    # one draw per dropout in the forward, none in the backward: the stream ends where eager's does
    assert torch.equal(after_planned, after_eager)
    assert_grads_close([(g, p.grad) for g, p in zip(grads, model.parameters(), strict=True)],
                       depth=ex[0][..., 0].numel())
    model.zero_grad(set_to_none=True)


@pytest.mark.slow
def test_replay_lowers_the_floor(monkeypatch):
    """Replay adds a choice: a mask may still be saved (a byte per element), or its generator state
    (5,056 B on CPU) saved and the draw replayed. So the floor can only drop; at this size, where each
    block's masks (98,304 B) outweigh its three states, it does."""
    torch.manual_seed(0)
    model, ex = models.transformer_stack(n_layer=3, d=64, n_head=4, seq=64, batch=4, dropout=0.1)
    with_replay, _ = budget_range(model, ex)
    monkeypatch.setattr(rng_replay, "REPLAYED", ())  # no replay: every mask is saved, as before this pass
    without, _ = budget_range(model, ex)
    assert with_replay < without, (with_replay, without)


def test_a_fused_dropout_kernel_becomes_its_mask_and_a_masked_scale(monkeypatch):
    """Where the bernoulli draw is not eager's (CUDA), the joint graph has no native_dropout either: the
    mask is the fused kernel's own draw, saved-state and replayable like bernoulli's, and the output a
    pure where(mask, x * scale) of it, so a dropout costs a 1-byte mask and its multiply is recomputable.
    The draw's scratch (the kernel's output, dropped) is in the profile."""
    monkeypatch.setattr(decompositions, "BERNOULLI_DEVICES", ())
    model, ex = models.transformer_stack(n_layer=1, d=32, seq=8, dropout=0.2)
    (g,) = capture(model, ex)
    calls = [n for n in g.joint.graph.nodes if n.op == "call_function"]
    assert not any(n.target in (torch.ops.aten.native_dropout.default, torch.ops.aten.bernoulli.p) for n in calls)
    draws = [n for n in calls if rng_replay.is_draw(n.target)]
    replays = [n for n in calls if rng_replay.is_replay(n.target)]
    assert len(draws) == len(replays) == 3
    assert all(n.args[0] is torch.ops.autoremat.dropout_mask.default for n in draws)
    assert all(n.args[1] is torch.ops.autoremat.dropout_mask.default for n in replays)
    for r in replays:
        x = r.args[2].meta["val"]
        assert rng_replay.draw_scratch(r) == x.numel() * x.element_size()
        assert {u.target for u in r.users} >= {torch.ops.aten.where.self}


def test_dropout_mask_is_native_dropouts_draw():
    x = torch.randn(6, 40).t()  # a transposed input: the mask keeps its layout
    torch.manual_seed(5)
    out, mask = torch.ops.aten.native_dropout.default(x, 0.3, True)
    torch.manual_seed(5)
    drawn = torch.ops.autoremat.dropout_mask(x, 0.3)
    assert drawn.dtype == torch.bool and drawn.stride() == torch.empty_like(x).stride()
    assert torch.equal(drawn, mask)


def test_on_cuda_fake_tensors_dropout_is_the_fused_kernels_draw_not_bernoulli():
    """Traced with fake CUDA tensors (no GPU needed): eager's CUDA dropout is native_dropout's fused
    Philox kernel, so the decomposition must draw the mask with that kernel (`autoremat::dropout_mask`, which
    calls it) and never with bernoulli or rand, whose CUDA streams are other draws than eager's. The graph
    then scales with the fused kernel's float scale, 1 / (1 - p) rounded to fp32 (Dropout.cu)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from autoremat.torch_internals import FakeTensorMode, OpOverload

    with FakeTensorMode(allow_non_fake_inputs=True):
        x = torch.empty(4, 16, 8, device="cuda")
    gm = make_fx(lambda t: torch.nn.functional.dropout(t, 0.1, True), decomposition_table=decompositions.DECOMPOSITIONS,
                 tracing_mode="fake")(x)
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert torch.ops.autoremat.dropout_mask.default in targets, targets
    random = [t for t in targets if isinstance(t, OpOverload) and torch.Tag.nondeterministic_seeded in t.tags]
    assert random == [torch.ops.autoremat.dropout_mask.default], random
    (scale,) = [n.args[1] for n in gm.graph.nodes if n.target is torch.ops.aten.mul.Tensor]
    assert torch.tensor(scale, dtype=torch.float32) == torch.tensor(1.0, dtype=torch.float32) / torch.tensor(0.9)


class _Noisy(torch.nn.Module):
    """Random draws of every kind in its forward: randn_like, rand, randint, and dropout."""

    def __init__(self, d: int = 32, n: int = 3) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(d, d) for _ in range(n))
        self.head = torch.nn.Linear(d, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            h = torch.tanh(layer(x))
            noise = 0.1 * torch.randn_like(h) + 0.05 * torch.rand(h.shape) * h
            keep = torch.randint(0, 4, h.shape) > 0
            x = torch.nn.functional.dropout(x + torch.where(keep, h, 0) + noise, 0.1)
        return self.head(x).square().mean()


@pytest.mark.parametrize("compiler", ["eager", "inductor"])
def test_random_draws_in_the_forward_are_eagers_under_both_compilers(compiler):
    """A forward that draws with torch.randn_like, rand, randint and dropout, planned at its floor: the planned
    step draws what eager draws (the gradients are eager's) and leaves the generator where eager leaves it."""
    torch.manual_seed(0)
    model, x = _Noisy(), torch.randn(16, 32)
    with pytest.raises(autoremat.BudgetError) as e:
        autoremat.optimize(model, budget=1, example_inputs=(x,), compiler=compiler, progress=False)
    om = autoremat.optimize(model, budget=e.value.smallest_budget, example_inputs=(x,), compiler=compiler,
                            progress=False)
    assert om.plan.compiler["used"] == compiler
    model.zero_grad(set_to_none=True)
    after_planned = _step(om, (x,))
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    after_eager = _step(model, (x,))
    assert torch.equal(after_planned, after_eager)
    assert_grads_close([(g, p.grad) for g, p in zip(grads, model.parameters(), strict=True)], depth=16 * 32)
