"""LoRA fine-tuning (PEFT) under a budget: a GPT-2 from config whose base weights are frozen and whose LoRA
adapters (rank 8, on the attention and MLP projections) train with AdamW over the adapters only.

- the plan's ledger counts gradients and AdamW state for the adapter parameters alone, exactly the bytes
  their shapes give;
- after one step under a budget that makes the plan recompute, the adapters' gradients equal eager's
  (dropout on in the base model and in the adapters, the same seed: the masks are replayed, not re-drawn),
  and the frozen weights get no gradient;
- a whole training step (forward, backward, AdamW step) measured in the steady state stays within the budget.
"""

import math

import pytest
import torch

import autoremat
from autoremat.measure import measure_peak
from autoremat.model.ledger import Ledger
from examples.lora import TARGETS, lora_gpt2
from tests.tolerances import assert_close_for, batch_depth

# peft 0.21.2 asks transformers 5 for `is_gradient_checkpointing`, which warns that the property is deprecated:
# the warning is peft's, not autoremat's, and says nothing about what these tests check.
pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")

SIZES = dict(n_layer=2, d=64, n_head=4, vocab=512, seq=32, r=8)
BATCH = 2
FP32 = torch.float32.itemsize


def _model_and_batch(dropout: float = 0.1):
    model = lora_gpt2(**SIZES, dropout=dropout)
    ids = torch.randint(0, SIZES["vocab"], (BATCH, SIZES["seq"]), generator=torch.Generator().manual_seed(1))
    return model, {"input_ids": ids, "labels": ids.clone()}


def _adapters(model) -> dict[str, torch.nn.Parameter]:
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def _grads(model, fn, batch, seed: int = 1) -> dict[str, torch.Tensor]:
    """Each parameter's gradient after one backward of `fn`, from no `.grad` and the same seed (dropout masks)."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    fn(**batch).loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _adapter_numel() -> int:
    """By hand from the shapes: every targeted projection d_in -> d_out gets lora_A [r, d_in] and lora_B [d_out, r];
    GPT-2's c_attn is d -> 3d, attn.c_proj d -> d, c_fc d -> 4d, mlp.c_proj 4d -> d."""
    d, r = SIZES["d"], SIZES["r"]
    return SIZES["n_layer"] * sum(r * d_in + d_out * r for d_in, d_out in ((d, 3 * d), (d, d), (d, 4 * d), (4 * d, d)))


def _storage_bytes(tensors) -> int:
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


def _fixed_by_hand(model, batch) -> int:
    """The step's fixed bytes: every weight and buffer once (GPT-2's tied embedding and head: one storage), and
    for the adapters alone an fp32 gradient and AdamW's two fp32 moments; plus the batch."""
    weights = _storage_bytes([*model.parameters(), *model.buffers()])
    return weights + 3 * _adapter_numel() * FP32 + _storage_bytes(batch.values())


@pytest.fixture(scope="module")
def planned():
    """(model, batch, optimizer, eager gradients, budget, optimized module) under a budget of the fixed bytes +
    60% of the activation peak eager measures: the plan has to recompute."""
    model, batch = _model_and_batch()
    ref = _grads(model, model, batch)  # leaves the adapters' .grad: the eager step below is in the steady state
    _, eager = measure_peak(lambda: model(**batch).loss.backward(), baseline_objs=(model, batch))
    model.zero_grad(set_to_none=True)
    budget = _fixed_by_hand(model, batch) + int(0.6 * eager.delta_peak_bytes)
    opt = torch.optim.AdamW(list(_adapters(model).values()), lr=1e-3)
    om = autoremat.optimize(model, budget=budget, example_inputs=batch, optimizer=opt, compiler="eager",
                            progress=False)
    return model, batch, opt, ref, budget, om


def test_ledger_counts_gradients_and_adamw_state_of_the_adapters_only(planned):
    model, batch, _, _, _, om = planned
    adapters = _adapters(model)
    numel = _adapter_numel()
    assert numel == sum(p.numel() for p in adapters.values())
    assert len(adapters) == 2 * len(TARGETS) * SIZES["n_layer"] + 2 * SIZES["n_layer"]  # c_proj twice a block
    assert all("lora_" in n for n in adapters)
    ledger = Ledger.from_dict(om.plan.ledger)
    assert ledger.gradients == numel * FP32
    assert ledger.optimizer_state == 2 * numel * FP32  # AdamW: exp_avg and exp_avg_sq, in the adapters' dtype
    # the frozen base counts its weights once (GPT-2's tied embedding and head: one storage), nothing more
    assert ledger.parameters == _storage_bytes([*model.parameters(), *model.buffers()])
    assert ledger.fixed == _fixed_by_hand(model, batch)
    all_params = sum(p.numel() for p in model.parameters())
    assert 5 * ledger.gradients < all_params * FP32  # under a fifth of a full fine-tune's gradients (10.8% here)


def test_adapter_gradients_equal_eagers_under_recomputation(planned):
    model, batch, _, ref, _, om = planned
    assert any(g.recomputed for g in om.plan.graphs), "the budget should make the plan recompute"
    grads = _grads(model, om, batch)
    assert set(grads) == set(_adapters(model)) == set(ref)  # frozen weights: no gradient, in both
    depth = batch_depth(batch)
    for name, g in grads.items():
        assert_close_for(g, ref[name], depth=depth, msg=name)
    # lora_B starts at 0, so lora_A's gradient is 0 too; each lora_B's is not, and it is the one a wrong mask breaks
    assert all(g.abs().max().item() > 0 for n, g in grads.items() if "lora_B" in n)


def test_adapter_gradients_equal_eagers_under_inductor(planned):
    """The same step compiled by Inductor, dropout on: each adapter's dropout mask is the eager draw. Inductor
    once fused a reader of a mask into the kernel that allocated it, before the draw filled it, and the
    adapters fed by a LayerNorm (c_attn, c_fc) got all-false masks and zero lora_B gradients
    (decompositions.bool_bernoulli)."""
    model, batch, _, ref, budget, _ = planned
    om = autoremat.optimize(model, budget=budget + 2**20, example_inputs=batch, optimizer="adamw",
                            compiler="inductor", progress=False)
    grads = _grads(model, om, batch)
    assert set(grads) == set(ref)
    depth = batch_depth(batch)
    for name, g in grads.items():
        assert_close_for(g, ref[name], depth=depth, msg=name)
    assert all(g.abs().max().item() > 0 for n, g in grads.items() if "lora_B" in n)


def test_training_step_stays_within_the_budget(planned):
    model, batch, opt, _, budget, om = planned
    state = {n: p.detach().clone() for n, p in _adapters(model).items()}

    def step():
        out = om(**batch)  # held through the backward, as in a training loop (the plan keeps its logits)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    step()  # the AdamW state exists from here on: the steady state
    _, m = measure_peak(step, baseline_objs=(model, opt, batch))
    assert m.peak_bytes <= budget, (m.peak_bytes, budget)
    ledger = Ledger.from_dict(om.plan.ledger)
    # what is resident between steps (no .grad: set to None) is the ledger's, and AdamW's 0-d step counters
    # (4 bytes each, which the ledger leaves out)
    counters = sum(opt.state[p]["step"].nbytes for p in _adapters(model).values())
    assert m.baseline_bytes == ledger.parameters + ledger.optimizer_state + ledger.inputs + counters
    # the prediction is within 10% of the measurement, as tests/test_end_to_end.py holds it: the activation peak
    # of forward + backward with every .grad present (the accumulation steady state the ledger assumes)
    for p in _adapters(model).values():
        p.grad = torch.zeros_like(p)

    def forward_backward():
        out = om(**batch)
        out.loss.backward()

    _, fb = measure_peak(forward_backward, baseline_objs=(model, batch))
    assert abs(fb.delta_peak_bytes - om.plan.activation_peak) <= 0.10 * fb.delta_peak_bytes, (
        fb.delta_peak_bytes, om.plan.activation_peak)
    assert ledger.fixed + fb.delta_peak_bytes <= budget
    opt.zero_grad(set_to_none=True)
    moved = [n for n, p in _adapters(model).items() if not torch.equal(p, state[n])]
    assert moved and math.isfinite(om(**batch).loss.item())


def test_a_model_with_nothing_to_train_is_refused_in_one_line():
    """Every weight frozen (an adapter never attached, or requires_grad turned off): no backward, no step to plan."""
    model, batch = _model_and_batch()
    model.requires_grad_(False)
    with pytest.raises(ValueError, match=r"has no trainable parameter .*get_peft_model leaves the LoRA adapters "
                                         r"trainable") as err:
        autoremat.optimize(model, budget="1GB", example_inputs=batch, optimizer=None, compiler="eager", progress=False)
    assert "\n" not in str(err.value)


def test_a_budget_below_the_adapters_floor_names_the_smallest_that_fits(planned):
    """The fixed bytes alone (frozen weights, the adapters' gradients and AdamW state, the batch) leave the
    activations nothing: the first line of the error names the smallest budget that fits, and that one plans."""
    model, batch, opt, _, _, _ = planned
    fixed = _fixed_by_hand(model, batch)
    with pytest.raises(autoremat.BudgetError) as err:
        autoremat.optimize(model, budget=fixed, example_inputs=batch, optimizer=opt, compiler="eager", progress=False,
                           verify=False)
    first = str(err.value).splitlines()[0]
    smallest = err.value.smallest_budget
    assert f"the smallest budget that fits is {autoremat.format_bytes(smallest)} ({smallest} bytes)" in first
    assert smallest > fixed
    om = autoremat.optimize(model, budget=smallest, example_inputs=batch, optimizer=opt, compiler="eager",
                            progress=False, verify=False)
    assert om.plan.predicted_peak <= smallest
