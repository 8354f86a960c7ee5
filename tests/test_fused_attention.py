"""The fused attention of 16-bit regions: no seq x seq activation, eager's numbers on CPU."""

import pytest
import torch
import torch.nn.functional as F

import autoremat
from autoremat.passes import fused_attention as fa
from tests.models import bf16_attention_problem, tiny_llama
from tests.tolerances import assert_close_for

B, H, S, D = 2, 3, 300, 16  # S over one block of the blockwise kernels (256 rows)
BF16 = pytest.param(torch.bfloat16, marks=pytest.mark.skipif(bool(bf16_attention_problem()),
                                                             reason=bf16_attention_problem()))


def _inputs(dtype):
    torch.manual_seed(0)
    # laid out (B, S, H, D) and viewed (B, H, S, D), as a model's projections give them
    return [torch.randn(B, S, H, D, dtype=dtype).transpose(1, 2).requires_grad_() for _ in range(3)]


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_fused_attention_gives_eagers_values_and_gradients_on_cpu(dtype):
    x = _inputs(dtype)
    keep = torch.ones(S, S, dtype=torch.bool).tril()[None, None]
    ref = F.scaled_dot_product_attention(*x, attn_mask=keep)
    g = torch.randn_like(ref)
    ref_grads = torch.autograd.grad(ref, x, g)
    out = fa.fused_attention(*x, attn_mask=keep)
    grads = torch.autograd.grad(out, x, g)
    # The same PyTorch CPU flash kernels eager picks: only their blocking could differ (a softmax over S
    # keys and a sum over D features, in fp32 inside the kernel), and one rounding of each result.
    assert_close_for(out, ref, depth=2, dtype=dtype) if dtype != torch.float32 else \
        assert_close_for(out, ref, depth=S + D)
    for a, b in zip(grads, ref_grads):
        assert_close_for(a, b, depth=2, dtype=dtype) if dtype != torch.float32 else \
            assert_close_for(a, b, depth=2 * (S + D))


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_the_blockwise_kernel_of_other_devices_agrees_with_eager(dtype):
    q, k, v = (t.detach() for t in _inputs(dtype))
    keep = torch.ones(S, S, dtype=torch.bool).tril()[None, None]
    ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*ref_in, is_causal=True)
    g = torch.randn_like(ref)
    ref_grads = torch.autograd.grad(ref, ref_in, g)
    scale = D ** -0.5
    additive = torch.zeros(keep.shape, dtype=dtype).masked_fill(~keep, float("-inf"))
    for mask, causal in ((additive, False), (None, True)):
        out, lse = fa._blockwise_forward(q, k, v, mask, causal, scale)
        grads = fa._blockwise_backward(g, q, k, v, out, lse, mask, causal, scale)
        # bf16: the probabilities are rounded to bf16 before they meet v (as GPU flash kernels do), the
        # result once more, and the reference rounds its own way: a few bf16 roundings, fp32 sums inside.
        depth, tdtype = (4, dtype) if dtype != torch.float32 else (2 * (S + D), dtype)
        assert_close_for(out, ref, depth=depth, dtype=tdtype)
        for a, b in zip(grads, ref_grads):
            assert_close_for(a, b, depth=2 * depth, dtype=tdtype)


def test_a_bf16_llama_holds_no_seq_by_seq_value_and_costs_the_recomputation():
    # Planned on meta at 7B-like proportions in miniature: the bf16 rewrite used to spell attention out in
    # plain ops, storing 16-bit scores and probabilities (B x H x S x S) between them.
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128, use_cache=False)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
        ids = torch.randint(0, 256, (1, 128))
    om = autoremat.optimize(model, budget=10**10, example_inputs={"input_ids": ids, "labels": ids},
                            precision="bf16", device="h100", compiler="eager")
    nodes = [p for g in om._planner.profiles for p in g.nodes.values()]
    square = [p.name for p in nodes if p.kind in ("forward", "backward") and len(p.shape) == 4
              and p.shape[-2:] == (128, 128) and p.shape[1] > 1]
    assert not square
    fwd = [p for p in nodes if p.target == "autoremat.attention.default"]
    bwd = [p for p in nodes if p.target == "autoremat.attention_backward.default"]
    assert len(fwd) == len(bwd) == 2
    per_matmul = 2 * 1 * 4 * 128 * 128 * 16  # one (S x hd) @ (hd x S) per head
    assert all(p.flops == 2 * per_matmul and not p.recompute_ban for p in fwd)
    assert all(p.flops == 5 * per_matmul for p in bwd)  # the scores recomputed, then dV, dP, dQ, dK
    # the GPU kernel's scratch: an fp32 dq accumulator and one fp32 per row
    assert all(p.transient_bytes == 4 * (1 * 4 * 128 * 16 + 4 * 128) for p in bwd)


@pytest.mark.parametrize("reduction,smoothing", [("mean", 0.0), ("sum", 0.1)])
def test_fused_cross_entropy_gives_eagers_loss_and_logit_gradients(reduction, smoothing):
    from autoremat.passes.fused_loss import fused_cross_entropy

    torch.manual_seed(0)
    n, v = 600, 96  # rows over two blocks of 256
    logits = (3 * torch.randn(n, v)).to(torch.bfloat16).requires_grad_()
    y = torch.randint(0, v, (n,))
    y[::7] = -100  # ignored rows
    ref = F.cross_entropy(logits.float(), y, ignore_index=-100, reduction=reduction, label_smoothing=smoothing)
    (ref_grad,) = torch.autograd.grad(ref, logits)
    loss = fused_cross_entropy(logits, y, ignore_index=-100, reduction=reduction, label_smoothing=smoothing)
    (grad,) = torch.autograd.grad(loss, logits)
    # fp32 inside both: a logsumexp over v words, then a sum over n rows; the gradient is rounded to bf16
    # once by both (the cast's backward there, the op's output here), from fp32 values v roundings apart.
    assert_close_for(loss, ref, depth=n + v)
    assert grad.dtype == torch.bfloat16 and not grad[::7].any()
    assert_close_for(grad, ref_grad, depth=2, dtype=torch.bfloat16)


def test_mm_upcast_is_the_16_bit_product_cast_to_fp32():
    from autoremat.passes import grad_upcast

    torch.manual_seed(0)
    a, b = torch.randn(300, 40, dtype=torch.bfloat16), torch.randn(40, 70, dtype=torch.bfloat16)
    old = grad_upcast._BLOCK_ELEMENTS
    try:
        grad_upcast._BLOCK_ELEMENTS = 70 * 64  # blocks of 64 rows: five blocks, the last one partial
        out = grad_upcast.mm_upcast(a, b, torch.float32)
    finally:
        grad_upcast._BLOCK_ELEMENTS = old
    assert out.dtype == torch.float32 and out.is_contiguous()
    assert_close_for(out, (a @ b).float(), depth=2, dtype=torch.bfloat16)  # one bf16 rounding each


@pytest.mark.slow
def test_a_bf16_llama_step_runs_the_fused_ops_and_is_as_accurate_as_autocast():
    from tests.tolerances import as_accurate, tol

    model, ex = tiny_llama()

    def grads(fn, autocast=False):
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = fn(**ex).loss
        loss.backward()
        return loss.detach().double(), torch.cat([p.grad.double().flatten() for p in model.parameters()])

    def rel(a, b):
        return ((a - b).norm() / b.norm()).item()

    ref_loss, ref = grads(model)
    _, ac = grads(model, autocast=True)
    om = autoremat.optimize(model, budget=10**9, example_inputs=ex, precision="bf16", compiler="eager")
    targets = {p.target for g in om._planner.profiles for p in g.nodes.values()}
    assert {"autoremat.attention.default", "autoremat.attention_backward.default", "autoremat.cross_entropy.default",
            "autoremat.cross_entropy_backward.default", "autoremat.mm_upcast.default"} <= targets
    assert "aten._log_softmax.default" not in targets
    loss, got = grads(om)
    # bf16 roundings on the longest chain: each layer's seven matmuls and its attention round their inputs
    # in the forward and again in the backward, the LM head twice more (tests/tolerances.py).
    rtol, _ = tol(torch.bfloat16, 2 * 8 * 2 + 2)
    assert rel(got, ref) <= rtol and abs(loss - ref_loss) / ref_loss.abs() <= rtol
    assert as_accurate(rel(got, ref), 2 * rel(ac, ref))
    assert "one fused cross-entropy over its 16-bit logits" in om.plan.summary()
    # the saved plan re-applied: the same rewrites (the fused loss included), the same graphs, the same bits
    again = autoremat.optimize(model, budget=10**9, example_inputs=ex, plan=om.plan, compiler="eager")
    assert torch.equal(grads(again)[1], got)


def test_the_fused_loss_and_gradient_upcasts_lower_the_bf16_floor(monkeypatch):
    # A large vocabulary, so that the loss region holds the floor's peak (as a 7B Llama's does).
    from autoremat.capture import aot as capture
    from autoremat.passes import loss_chunks

    model, ex = tiny_llama(vocab=4096, seq=256, layers=1, device="meta")
    monkeypatch.setattr(loss_chunks, "CANDIDATES", (1,))  # the loss left whole (chunked, it is plain ops)

    def floor():
        with pytest.raises(autoremat.BudgetError) as err:
            autoremat.optimize(model, budget=1024, example_inputs=ex, precision="bf16", device="h100",
                               compiler="eager")
        return err.value.smallest_budget

    fused = floor()
    with monkeypatch.context() as m:
        m.setattr(capture, "fuse_gradient_upcasts", lambda joint: 0)
        m.setattr(loss_chunks, "_low_logits", lambda site: False)
        plain = floor()
    # at least the LM head's 16-bit weight gradient (4096 x 64 bf16) is no longer alive beside its fp32 one
    assert plain - fused >= 4096 * 64 * 2, (plain, fused)


def test_a_row_with_every_key_masked_gives_zeros_as_eager_does():
    torch.manual_seed(0)
    q = torch.randn(1, 2, 8, 4)
    keep = torch.ones(8, 8, dtype=torch.bool)
    keep[3] = False
    ref = F.scaled_dot_product_attention(q, q, q, attn_mask=keep)
    assert not ref[:, :, 3].any()
    out = fa.fused_attention(q, q, q, attn_mask=keep)
    additive = torch.zeros(8, 8).masked_fill(~keep, float("-inf"))
    block, lse = fa._blockwise_forward(q, q, q, additive, False, 0.5)
    grads = fa._blockwise_backward(torch.ones_like(block), q, q, q, block, lse, additive, False, 0.5)
    for got in (out, block):
        assert_close_for(got, ref, depth=8 + 4)
    assert not any(g.isnan().any() for g in grads)
