"""Dropout masks replayed from the generator state instead of saved (autoremat.rng_replay).

Checked on real steps near the floor: the plan recomputes masks rather than saving them, the forward
draws once (the random stream after a step is eager's), the backward's replay gives eager's masks
(gradients equal eager's with dropout on), and the floor is below what saving every mask costs."""

import torch

import autoremat
from autoremat.passes import rng_replay
from examples import models
from tests.budgets import budget_range
from tests.tolerances import assert_close_for


def _stack(dropout: float = 0.1):
    torch.manual_seed(0)
    return models.transformer_stack(n_layer=3, d=64, n_head=4, seq=32, batch=2, dropout=dropout)


def _step(fn, ex, seed: int = 1) -> torch.Tensor:
    torch.manual_seed(seed)
    models.loss_of(fn(*ex)).backward()
    return torch.get_rng_state()


def test_masks_are_replayed_and_match_eagers_draws():
    model, ex = _stack()
    lo, _ = budget_range(model, ex)
    om = autoremat.optimize(model, budget=lo, example_inputs=ex, compiler="eager")
    recomputed = [n for g in om.plan.graphs for n in g.recomputed]
    assert any(n.startswith("replay_draw") for n in recomputed), recomputed
    model.zero_grad(set_to_none=True)
    after_planned = _step(om, ex)
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    after_eager = _step(model, ex)
    # one draw per dropout in the forward, none in the backward: the stream ends where eager's does
    assert torch.equal(after_planned, after_eager)
    for g, p in zip(grads, model.parameters(), strict=True):
        assert_close_for(g, p.grad, depth=ex[0][..., 0].numel())
    model.zero_grad(set_to_none=True)


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
