"""The fused attention of 16-bit regions (issue 14): no seq x seq activation, eager's numbers on CPU."""

import pytest
import torch
import torch.nn.functional as F

import autoremat
from autoremat.passes import fused_attention as fa
from tests.tolerances import assert_close_for

B, H, S, D = 2, 3, 300, 16  # S over one block of the blockwise kernels (256 rows)


def _inputs(dtype):
    torch.manual_seed(0)
    # laid out (B, S, H, D) and viewed (B, H, S, D), as a model's projections give them
    return [torch.randn(B, S, H, D, dtype=dtype).transpose(1, 2).requires_grad_() for _ in range(3)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
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
