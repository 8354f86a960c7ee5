"""autoremat.fit: micro-batch choice on the meta device, exact gradient accumulation, BatchNorm
warnings, one plan per input shape, and BudgetError when even one example does not fit."""

import copy
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autoremat
from autoremat.fit import fit
from examples import models
from tests.tolerances import assert_grads_close

GLOBAL = 8
SEQ = 16


class Net(nn.Module):
    """Residual MLP blocks over a short sequence: nothing in it depends on the batch."""

    def __init__(self, d: int = 32, depth: int = 3, classes: int = 5) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)) for _ in range(depth)
        )
        self.head = nn.Linear(d, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return self.head(x.mean(1))


def _data(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, SEQ, 32, generator=g), torch.randint(0, 5, (n,), generator=g)


def _grad_depth(model: Net, batch: int) -> int:
    """Roundings behind one gradient element (tests/tolerances.py counts a sum of n terms as n):
    every block's LayerNorm and two Linear reductions, forward and backward, then the head's mean
    over the sequence and its Linear, and a weight gradient's sum over the batch's tokens."""
    d = model.head.in_features
    return 2 * len(model.blocks) * (d + d + 4 * d) + SEQ + d + batch * SEQ


def _tight_budget(model: nn.Module, sample, optimizer) -> int:
    """A budget where the whole global batch cannot be one step but half of it can, with recompute."""
    roomy = fit(model, 10**12, GLOBAL, sample, optimizer=optimizer, verify=False, compiler="eager")
    assert roomy.micro_batch == GLOBAL  # with room to spare, one step is the fastest
    half = next(c for c in roomy.candidates if c.micro_batch == GLOBAL // 2)
    with pytest.raises(autoremat.BudgetError) as full:  # the least the whole batch needs, recomputing all it may
        autoremat.optimize(model, budget=1, example_inputs=_data(GLOBAL)[0], optimizer=optimizer, verify=False, compiler="eager")
    # Below both: half the batch must recompute a little, and the full batch cannot fit at all.
    return min(half.no_recompute_peak, full.value.smallest_budget) - 1


@pytest.fixture(scope="module")
def tight():
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    budget = _tight_budget(model, _data(1)[0][0], opt)
    return model, opt, budget


def test_accumulated_steps_equal_one_full_batch_step(tight):
    model, opt, budget = tight
    eager = copy.deepcopy(model)
    eager_opt = torch.optim.AdamW(eager.parameters(), lr=1e-2)
    x, y = _data(GLOBAL)
    cfg = fit(model, budget, GLOBAL, x[0], optimizer=opt, compiler="eager")

    assert cfg.accumulation_steps > 1 and cfg.micro_batch * cfg.accumulation_steps == GLOBAL
    assert cfg.plan.recompute_time_s > 0, "the tight budget should make the chosen plan recompute"
    assert cfg.plan.predicted_peak <= budget
    fitting = [c for c in cfg.candidates if c.fits]
    best = min(fitting, key=lambda c: c.time_per_global_batch_s)
    assert best.micro_batch == cfg.micro_batch
    assert not next(c for c in cfg.candidates if c.micro_batch == GLOBAL).fits

    # The user's accumulation loop, over one global batch, twice; compilations counted across micro-steps.
    # Micro-batches sum each gradient in another order than the full batch: equal to the rounding of
    # that depth. AdamW then divides by sqrt(v): an element whose gradient is at that rounding noise
    # gets a noisy sign and size, and its update can differ by up to ~2 * lr between two runs, which no
    # tolerance on the parameters could tell from a bug. So both optimizers step on the same checked
    # gradients and must then agree exactly; the second pass checks the gradients at the new weights.
    depth = _grad_depth(model, GLOBAL)
    profiles = len(cfg.model.plans)
    frames = torch._dynamo.utils.counters["frames"]["ok"]
    for _ in range(2):
        for step in range(cfg.accumulation_steps):
            sl = slice(step * cfg.micro_batch, (step + 1) * cfg.micro_batch)
            loss = F.cross_entropy(cfg.model(x[sl]), y[sl]) / cfg.accumulation_steps
            loss.backward()
        F.cross_entropy(eager(x), y).backward()
        assert_grads_close([(p.grad, r.grad) for p, r in zip(model.parameters(), eager.parameters(), strict=True)],
                           depth=depth)
        for p, r in zip(model.parameters(), eager.parameters(), strict=True):
            r.grad.copy_(p.grad)
        opt.step()
        opt.zero_grad(set_to_none=True)
        eager_opt.step()
        eager_opt.zero_grad(set_to_none=True)
        for p, r in zip(model.parameters(), eager.parameters(), strict=True):
            torch.testing.assert_close(p, r, rtol=0, atol=0)
    assert len(cfg.model.plans) == profiles, "a micro-step planned again"
    assert torch._dynamo.utils.counters["frames"]["ok"] == frames, "a micro-step compiled again"


def test_last_smaller_batch_is_planned_once_and_exact(tight):
    model, opt, budget = tight
    cfg = fit(model, budget, GLOBAL, _data(1)[0][0], optimizer=opt, compiler="eager")
    assert cfg.micro_batch > 1
    x, y = _data(3 * cfg.micro_batch + 1, seed=1)  # a dataset that does not divide: last batch of 1
    profiles = len(cfg.model.plans)
    for start in range(0, len(x), cfg.micro_batch):
        F.cross_entropy(cfg.model(x[start:start + cfg.micro_batch]), y[start:start + cfg.micro_batch]).backward()
    assert len(cfg.model.plans) == profiles + 1  # the new shape, planned (and verified) once
    last = cfg.model.plans[-1]
    assert last.predicted_peak <= budget

    model.zero_grad(set_to_none=True)
    F.cross_entropy(cfg.model(x[-1:]), y[-1:]).backward()
    got = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    F.cross_entropy(model(x[-1:]), y[-1:]).backward()
    # compiled vs eager kernels: reordered sums
    assert_grads_close([(g, p.grad) for g, p in zip(got, model.parameters(), strict=True)], depth=_grad_depth(model, 1))
    model.zero_grad(set_to_none=True)
    assert len(cfg.model.plans) == profiles + 1  # and not again for the second batch of 1


def test_report_lists_every_candidate(tight):
    model, opt, budget = tight
    cfg = fit(model, budget, GLOBAL, _data(1)[0][0], optimizer=opt, verify=False, compiler="eager")
    assert [c.micro_batch for c in cfg.candidates] == [1, 2, 4, 8]
    text = cfg.report()
    assert "<- chosen" in text and "time/global batch" in text and "predicted peak" in text
    for c in cfg.candidates:
        assert c.accumulation_steps * c.micro_batch == GLOBAL
        if c.fits:
            assert c.predicted_peak <= budget <= 10**12
            assert c.time_per_global_batch_s > 0


def test_meta_planning_counts_the_real_optimizer_and_leaves_the_model_alone():
    torch.manual_seed(0)
    model = Net()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    opt = torch.optim.AdamW(model.parameters())
    cfg = fit(model, 10**12, 4, _data(1)[0][0], optimizer=opt, verify=False, compiler="eager")
    n = sum(p.numel() for p in model.parameters())
    assert cfg.plan.ledger["optimizer_state"] == 2 * 4 * n  # two fp32 moments per parameter
    assert all(p.device.type == "cpu" for p in model.parameters())
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, before[k], rtol=0, atol=0)  # untouched, bit for bit


class NetWithLoss(Net):
    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return F.cross_entropy(super().forward(x), y)


def test_meta_plan_equals_the_real_plan_with_cross_entropy_inside():
    """On meta, nll_loss's Python kernel once dropped the whole backward from the traced graph."""
    torch.manual_seed(0)
    model = NetWithLoss()
    x, y = _data(4)
    cfg = fit(model, 10**12, 4, (x[0], y[0]), micro_batches=[4], verify=False, compiler="eager")
    meta = cfg.candidates[0]
    assert meta.predicted_peak == cfg.plan.predicted_peak
    assert meta.step_time_s == pytest.approx(cfg.plan.forward_time_s + cfg.plan.recompute_time_s)
    assert not cfg.notes  # a note would say the meta and real plans differ


def test_batchnorm_warns_when_accumulating():
    torch.manual_seed(0)
    model, (x, y) = models.convnet(batch=GLOBAL, size=8, channels=8, blocks=1)
    sample = (x[0], y[0])  # a tuple of positional arguments; y[0] is a 0-d label
    roomy = fit(model, 10**12, GLOBAL, sample, verify=False, compiler="eager")
    assert roomy.accumulation_steps == 1 and not roomy.warnings
    # CPU convolutions have kernel scratch that only the real trace measures: size the budget there.
    two = autoremat.optimize(model, 10**12, example_inputs=(x[:2], y[:2]), verify=False, compiler="eager")
    budget = two.plan.predicted_peak + 2048
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        cfg = fit(model, budget, GLOBAL, sample, verify=False, compiler="eager")
    assert 1 < cfg.accumulation_steps and cfg.plan.predicted_peak <= budget
    # Besides the BatchNorm warning, fit may say that a micro-batch that fitted on meta did not on the CPU
    # (its convolutions' kernel scratch is measured only on a real trace): that is the one other warning allowed.
    messages = [str(r.message) for r in record]
    assert all("BatchNorm" in m or "fitted when planned on meta but not on cpu" in m for m in messages), messages
    msg = next(m for m in messages if "BatchNorm" in m)
    assert "stem.1" in msg and "blocks.0.1" in msg and "GroupNorm" in msg and "SyncBatchNorm" in msg
    assert "BatchNorm" in cfg.report()


def test_budget_error_when_one_example_does_not_fit():
    model = Net()
    with pytest.raises(autoremat.BudgetError) as err:
        fit(model, "100KB", GLOBAL, _data(1)[0][0], compiler="eager")
    assert err.value.smallest_budget > 100_000
    assert err.value.ledger.parameters > 0
    assert "smallest budget that fits" in str(err.value)


def test_micro_batches_must_divide():
    with pytest.raises(ValueError, match="divide"):
        fit(Net(), 10**12, GLOBAL, _data(1)[0][0], micro_batches=[3], compiler="eager")
