"""autoremat.lightning.Budget with a real lightning.Trainer on CPU: the planned run trains the same
parameters as the plain run, its measured step stays within a budget the plain step exceeds, validation
runs the model itself, and bad input is refused in one line that says what would work.

The LightningModule computes its loss outside the planned submodule (`F.mse_loss(self.model(x), y)`), so
the plan's output gradient comes from code it does not see, as in most Lightning modules.
"""

from __future__ import annotations

import copy
from typing import Any

import lightning as L  # in the `test` extra (pyproject.toml)
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autoremat
from autoremat.lightning import Budget
from autoremat.measure import PeakMeter
from autoremat.model.ledger import Ledger
from examples.models import Block
from tests.tolerances import assert_close_for

torch.set_num_threads(1)
# Lit defines validation_step for the tests that validate; Lightning warns in the others, which fit without
# a val_dataloader on purpose (validation is not what they check).
pytestmark = pytest.mark.filterwarnings("ignore:You defined a `validation_step` but have no `val_dataloader`")
D, HEADS, SEQ, BATCH, LAYERS, STEPS, LR = 32, 4, 16, 4, 2, 3, 0.1
OPTIONS = {"compiler": "eager", "progress": False}  # eager: no Inductor compile on a 2-core CPU


class Lit(L.LightningModule):
    def __init__(self, optimizers: int = 1) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = nn.Sequential(*[Block(D, HEADS, dropout=0.1) for _ in range(LAYERS)])
        self.optimizer_count = optimizers
        self.automatic_optimization = optimizers == 1  # Lightning steps several optimizers only manually

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.mse_loss(self.model(x), y)
        if not self.automatic_optimization:
            self.manual_backward(loss)
            for opt in self.optimizers():
                opt.step()
                opt.zero_grad()
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", F.mse_loss(self.model(x), y))

    def configure_optimizers(self) -> Any:
        # SGD with momentum: its state (one buffer per parameter) is in the ledger, and the parameters stay
        # linear in the gradients, so rounding-level gradient differences stay rounding-level (AdamW's first
        # steps divide by |g| and turn a noise-level gradient into a +-lr update).
        make = lambda: torch.optim.SGD(self.parameters(), lr=LR, momentum=0.9)  # noqa: E731
        return make() if self.optimizer_count == 1 else [make() for _ in range(self.optimizer_count)]


def _loader() -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(4 * BATCH, SEQ, D, generator=g),
                                          torch.randn(4 * BATCH, SEQ, D, generator=g))
    return torch.utils.data.DataLoader(data, batch_size=BATCH)


def _trainer(callbacks: list, **kwargs: Any) -> Any:
    args = dict(max_steps=STEPS, accelerator="cpu", devices=1, enable_checkpointing=False, logger=False,
                enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                limit_val_batches=1, val_check_interval=2, deterministic=False)
    return L.Trainer(callbacks=callbacks, **{**args, **kwargs})


class Probe(L.Callback):
    """Measures the second training step (momentum buffers exist by then) and checks validation."""

    def __init__(self) -> None:
        self.meter: PeakMeter | None = None
        self.peak: int | None = None
        self.validated_planned = False
        self.keys: list[list[str]] = []

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx == 1:
            # Lightning frees the gradients inside the step; the profiler cannot see frees of blocks allocated
            # before it started (autoremat.measure), so they are freed here, as the step would, first.
            trainer.optimizers[0].zero_grad(set_to_none=True)
            self.meter = PeakMeter(baseline_objs=(pl_module, trainer.optimizers[0], batch)).__enter__()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.keys.append(list(pl_module.state_dict()))
        if self.meter is not None:
            self.meter.__exit__(None, None, None)
            self.peak, self.meter = self.meter.result.peak_bytes, None

    def on_validation_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int,
                                dataloader_idx: int = 0) -> None:
        module = pl_module.model
        if isinstance(module, autoremat.RematModule):  # no_grad: the planned module runs the model itself
            self.validated_planned = True
            assert torch.equal(module(batch[0]), module.model(batch[0]))


def _budget_that_recomputes(model: nn.Module, x: torch.Tensor, opt: torch.optim.Optimizer) -> int:
    """Halfway from the smallest budget that fits to the least that recomputes nothing (unverified)."""
    big = autoremat.optimize(model, 10**12, (x,), optimizer=opt, verify=False, **OPTIONS)
    with pytest.raises(autoremat.BudgetError) as low:
        autoremat.optimize(model, Ledger.from_dict(big.plan.ledger).fixed + 1, (x,), optimizer=opt, verify=False,
                           **OPTIONS)
    return (low.value.smallest_budget + big.plan.no_recompute_budget) // 2


@pytest.fixture(scope="module")
def runs() -> dict:
    plain, planned = Lit(), Lit()
    start = copy.deepcopy(planned.model.state_dict())
    x = next(iter(_loader()))[0]
    opt = torch.optim.SGD(planned.parameters(), lr=LR, momentum=0.9)
    budget = _budget_that_recomputes(planned.model, x, opt)
    callback = Budget(budget, **OPTIONS)
    out = {"budget": budget, "start": start, "plain": plain, "planned": planned, "callback": callback}
    for name, lit, callbacks in (("plain", plain, []), ("planned", planned, [callback])):
        probe = Probe()
        torch.manual_seed(2)  # the same dropout masks in both runs
        _trainer([*callbacks, probe]).fit(lit, _loader(), _loader())
        out[name + "_probe"] = probe
    return out


def _grad_depth() -> int:
    """Roundings behind one gradient element (tests/tolerances.py counts a sum of n terms as n): per block,
    two LayerNorms and the qkv, proj and fc reductions over D, out's over 4 * D, the scores over D / HEADS
    and softmax and att @ v over SEQ, forward and backward; the loss's mean over every element; and a
    weight gradient's sum over the batch's tokens."""
    block = 5 * D + 4 * D + D // HEADS + 2 * SEQ
    return 2 * LAYERS * block + BATCH * SEQ * D + BATCH * SEQ


def test_planned_training_equals_plain_training(runs: dict) -> None:
    cb = runs["callback"]
    assert cb.plan is not None and cb.plan.recompute_time_s > 0, "the budget should make the plan recompute"
    assert cb.plan.predicted_peak <= runs["budget"] - cb.reserved
    assert "autoremat plan" in cb.plan.summary()
    # the ledger counts the optimizer Lightning built: one momentum buffer per parameter
    params = sum(p.numel() * p.element_size() for p in runs["planned"].model.parameters())
    assert Ledger.from_dict(cb.plan.ledger).optimizer_state == params
    # Each step's update is lr times momentum sums of gradients: compare updates, at the depth of every
    # step's gradient plus each step's rounding of the parameter itself.
    plain = runs["plain"].model.state_dict()
    planned = runs["planned"].model.state_dict()
    assert list(plain) == list(planned)
    for key, before in runs["start"].items():
        if before.is_floating_point():
            assert_close_for(planned[key] - before, plain[key] - before, depth=STEPS * (_grad_depth() + 1), msg=key)
    assert type(runs["planned"].model) is nn.Sequential, "teardown puts the plain module back"


def test_validation_runs_the_model_and_checkpoint_keys_stay(runs: dict) -> None:
    probe = runs["planned_probe"]
    assert probe.validated_planned
    assert all(keys == probe.keys[0] for keys in probe.keys)
    assert probe.keys[0] == runs["plain_probe"].keys[0]


def test_measured_step_is_within_a_budget_the_plain_step_exceeds(runs: dict) -> None:
    budget, planned, plain = runs["budget"], runs["planned_probe"].peak, runs["plain_probe"].peak
    assert planned is not None and plain is not None
    assert planned <= budget, f"planned step measured {planned} B over the {budget} B budget"
    assert plain > budget, f"the plain step ({plain} B) fits the budget ({budget} B): nothing to show"


def _one_line(e: pytest.ExceptionInfo) -> str:
    text = str(e.value)
    assert "\n" not in text, text
    return text


def test_bad_input_is_refused_in_one_line() -> None:
    with pytest.raises(ValueError) as e:
        Budget("20 parsecs")
    assert "budget" in _one_line(e).lower()
    with pytest.raises(TypeError, match="compiler") as e:
        Budget("1GB", compilr="eager")
    _one_line(e)
    with pytest.raises(ValueError, match="fp32, bf16") as e:
        Budget("1GB", precision="fp16")
    _one_line(e)
    cases = [({"module": "net"}, {}, 1, r"no such submodule; its child modules are 'model'"),
             ({"module": lambda m: nn.Linear(2, 2)}, {}, 1, "not a submodule"),
             ({}, {"precision": "bf16-mixed"}, 1, r"precision='32-true'\) with Budget\(\.\.\., precision='bf16'\)"),
             ({}, {}, 2, "return one optimizer")]
    for options, trainer_kwargs, optimizers, match in cases:
        with pytest.raises(ValueError, match=match) as e:
            _trainer([Budget("1GB", **options, **OPTIONS)], **trainer_kwargs).fit(Lit(optimizers), _loader())
        _one_line(e)


def test_a_budget_too_small_names_the_one_that_fits() -> None:
    lit = Lit()
    with pytest.raises(autoremat.BudgetError) as e:
        _trainer([Budget("100KB", **OPTIONS)], max_steps=1).fit(lit, _loader())
    assert "smallest budget that fits" in str(e.value).splitlines()[0]
    assert e.value.smallest_budget is not None and e.value.smallest_budget > 100_000
    assert type(lit.model) is nn.Sequential  # the plain module is back after the failure


class Detour(Lit):
    """Calls the blocks one by one, never `self.model` itself: nothing can be planned for `model`."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        for block in self.model:
            x = block(x)
        return F.mse_loss(x, y)


def test_a_module_training_step_never_calls_is_refused() -> None:
    lit = Detour()
    with pytest.raises(ValueError, match=r"training_step did not call it .*children of Detour: 'model'") as e:
        _trainer([Budget("1GB", **OPTIONS)], max_steps=1).fit(lit, _loader())
    _one_line(e)
    assert "forward" not in vars(lit.model)  # the hook is gone


def test_a_call_mixing_positional_and_keyword_arguments_is_planned_by_keyword() -> None:
    from autoremat.lightning import _example_inputs

    class Scaled(nn.Linear):
        def forward(self, x: torch.Tensor, scale: float = 1.0, **extra: Any) -> torch.Tensor:
            return super().forward(x) * scale

    x = torch.ones(2, 3)
    example, sig = _example_inputs(Scaled(3, 3), (x,), {"scale": 2.0, "note": None})
    assert example == {"x": x, "scale": 2.0, "note": None} and sig is not None
    assert _example_inputs(Scaled(3, 3), (x,), {}) == ((x,), None)
