"""The 16-bit LM head and its loss as one fused op under outputs="loss": no logits, no 16-bit weight copy."""

import pytest
import torch
import torch.nn.functional as F

import autoremat
from autoremat.measure import measure_peak
from autoremat.passes import fused_linear_loss as fll
from autoremat.passes import loss_chunks
from autoremat.solve.decision import evaluate
from tests.models import bf16_attention_problem, tiny_llama
from tests.test_twice_and_reuse import SEED_BYTES
from tests.tolerances import assert_close_for, tol


@pytest.mark.parametrize("reduction,smoothing", [("mean", 0.0), ("sum", 0.1)])
def test_the_fused_projection_and_loss_give_the_16_bit_steps_loss_and_gradients(monkeypatch, reduction, smoothing):
    torch.manual_seed(0)
    n, d, v = 40, 24, 150
    monkeypatch.setattr(fll, "_TOKENS", 16)  # chunks of 16 token rows: three, the last partial
    monkeypatch.setattr(fll, "_WEIGHT_ELEMENTS", d * 32)  # blocks of 32 vocabulary rows: five, the last partial
    h = torch.randn(n, d).to(torch.bfloat16).requires_grad_()
    w = torch.randn(v, d, requires_grad=True)  # the fp32 master weight
    y = torch.randint(0, v, (n,))
    y[::7] = -100  # ignored rows
    # the unrewritten 16-bit step: the weight's bf16 copy, bf16 logits, the loss over their fp32 cast
    ref = F.cross_entropy(F.linear(h, w.to(torch.bfloat16)).float(), y, ignore_index=-100, reduction=reduction,
                          label_smoothing=smoothing)
    ref_h, ref_w = torch.autograd.grad(ref, (h, w))
    loss = fll.fused_linear_cross_entropy(h, w, y, ignore_index=-100, reduction=reduction, label_smoothing=smoothing)
    got_h, got_w = torch.autograd.grad(loss, (h, w))
    assert got_h.dtype == torch.bfloat16 and got_w.dtype == torch.float32
    # The same bf16 logits in both; the loss differs by fp32 summation order over v words and n rows. The
    # gradients: the logits' gradient rounded to bf16 once in both, then a product over v (dh) or n (dW)
    # terms, rounded to bf16 once by the reference's matmul (and dh once more by both).
    assert_close_for(loss, ref, depth=n + v)
    assert_close_for(got_h, ref_h, depth=3, dtype=torch.bfloat16)
    assert_close_for(got_w, ref_w, depth=2, dtype=torch.bfloat16)
    assert not got_w.isnan().any()


def test_a_bf16_llama_under_outputs_loss_runs_the_fused_head_and_keeps_the_gradients():
    model, ex = tiny_llama(vocab=96, d=32, seq=32, layers=1, intermediate=64, heads=2)

    def grads(om):
        model.zero_grad(set_to_none=True)
        seen = []
        hook = model.lm_head.weight.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad.dtype))
        try:
            out = om(**ex)
            out.loss.backward()
        finally:
            hook.remove()
        assert seen == [torch.float32]  # AccumulateGrad saw the LM head's gradient, in fp32
        return out, out.loss.detach().double(), torch.cat([p.grad.double().flatten() for p in model.parameters()])

    plain = autoremat.optimize(model, budget=10**9, example_inputs=ex, precision="bf16", compiler="eager")
    fused = autoremat.optimize(model, budget=10**9, example_inputs=ex, precision="bf16", compiler="eager",
                               outputs="loss")
    targets = {p.target for g in fused._planner.profiles for p in g.nodes.values()}
    assert {"autoremat.linear_cross_entropy.default", "autoremat.linear_cross_entropy_backward.default"} <= targets
    shapes = {p.shape for g in fused._planner.profiles for p in g.nodes.values() if p.nbytes}
    assert not any(s[-1] == 96 for s in shapes if s), "a tokens x vocabulary value is still allocated"
    assert "fused projection + cross-entropy" in fused.plan.summary()
    _, ref_loss, ref = grads(plain)
    out, loss, got = grads(fused)
    assert out.logits is None
    # the same 16-bit step up to summation order in the head: its loss over 96 words and 32 rows, its
    # gradients rounded once more there, carried through the layer's seven matmuls forward and back
    rtol, _ = tol(torch.bfloat16, 2 * 8 + 3)
    assert abs(loss - ref_loss) / ref_loss.abs() <= tol(torch.float32, 96 + 32)[0]
    assert ((got - ref).norm() / ref.norm()).item() <= rtol


def test_the_fused_head_lowers_a_bf16_llamas_floor_under_outputs_loss(monkeypatch):
    # A large vocabulary on meta, so that the LM head holds the floor's peak (as a 7B Llama's does).
    model, ex = tiny_llama(vocab=8192, d=64, seq=512, layers=1, intermediate=128, heads=2, device="meta")
    monkeypatch.setattr(loss_chunks, "CANDIDATES", (1,))

    def floor():
        with pytest.raises(autoremat.BudgetError) as err:
            autoremat.optimize(model, budget=1024, example_inputs=ex, precision="bf16", device="h100",
                               compiler="eager", outputs="loss")
        return err.value.smallest_budget - err.value.ledger.fixed

    fused = floor()
    with monkeypatch.context() as m:
        m.setattr(loss_chunks, "_low_logits", lambda site: False)  # the plain (one-piece) rewrite
        plain = floor()
    # no bf16 logits (512 x 8192) nor their gradient, nor the weight's bf16 copy (8192 x 64) beside the
    # fp32 gradient; the op books its blocks (meta_scratch)
    assert plain - fused >= 512 * 8192 * 2, (plain, fused)


@pytest.mark.skipif(bool(bf16_attention_problem()), reason=bf16_attention_problem())  # a bf16 Llama's attention
def test_the_heads_backward_writes_hs_gradient_over_h_where_h_dies(monkeypatch):
    """At a bf16 Llama's floor the LM head's backward holds h (the 16-bit hidden states) beside the dh it
    writes; h is read by nothing after it, so the plan writes dh over h
    (recomputed_writes.write_over_dying_input, linear_cross_entropy_backward_into_h)."""
    model, ex = tiny_llama(vocab=512, d=64, seq=128, layers=2, intermediate=128, heads=2)
    monkeypatch.setattr(loss_chunks, "CANDIDATES", (1,))
    kw = dict(example_inputs=ex, precision="bf16", compiler="eager", outputs="loss", optimizer=None)

    def floor() -> int:
        with pytest.raises(autoremat.BudgetError) as err:
            autoremat.optimize(model, budget=1024, verify=False, **kw)
        return err.value.smallest_budget

    def step(om):
        model.zero_grad(set_to_none=True)
        om(**ex).loss.backward()

    def grads_and_peak(om):
        step(om)
        step(om)  # steady state: every .grad exists
        grads = [p.grad.clone() for p in model.parameters()]
        _, m = measure_peak(lambda: om(**ex).loss.backward(), baseline_objs=(model, ex))
        return grads, m.peak_bytes

    low = floor()
    om = autoremat.optimize(model, budget=low, verify=False, **kw)
    schedules = evaluate(om._planner.profiles, [set(g.saved) | set(g.again) for g in om.plan.graphs])[0]
    written = {e: u for s in schedules for e, u in s.written.items()}
    head = next(g for g in om._planner.profiles if any(p.overwrites for p in g.nodes.values()))
    (out, h), = [p.overwrites for p in head.nodes.values() if p.overwrites]
    assert written.get(out) is not None and head.nodes[h].dtype == "bfloat16", (written, out, h)
    got, peak = grads_and_peak(om)
    # measured at the predicted peak: the op ran as its overwriting variant (its own dh would be 16 KiB more)
    assert abs(om.plan.predicted_peak - peak) <= SEED_BYTES, (om.plan.predicted_peak, peak)

    monkeypatch.setattr(fll, "overwritable", lambda gm: {})
    torch._dynamo.reset()
    high = floor()
    torch._dynamo.reset()
    want, _ = grads_and_peak(autoremat.optimize(model, budget=high, verify=False, **kw))
    # the same values, bit for bit: the same arithmetic, each chunk of h read before its rows are written
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    # the floor is the head's backward: without the write it holds dh (128 x 64 bf16) beside h
    assert high - low == 128 * 64 * 2, (high, low)
