"""Attention as one fused kernel: the forward keeps its output and a logsumexp, never seq x seq.

`autoremat::attention(q, k, v, mask, is_causal, scale) -> (out, logsumexp)` and its backward
`autoremat::attention_backward` are custom ops, so AOTAutograd's joint graph holds them as two
nodes: the forward saves q, k, v, the output and the fp32 logsumexp (O(seq) per head), and the
backward recomputes the scores and probabilities inside itself, as GPU flash / memory-efficient
kernels do. The planner sees exactly that: no seq x seq value is stored or freed between ops.

Kernels: on CPU both ops call PyTorch's own flash kernels
(`aten._scaled_dot_product_flash_attention_for_cpu` and its backward), the kernels eager
`F.scaled_dot_product_attention` runs on CPU for these inputs, so the numbers are eager's. On
other devices they run `_blockwise_forward` / `_blockwise_backward` below: plain torch over blocks
of query rows (fp32 scores and softmax, probabilities rounded to the input dtype before they meet
v, as GPU flash kernels do), O(block x seq) scratch; on CUDA that is not the flash kernel eager
would pick (same mathematics, other rounding and speed). On the meta device `meta_scratch` is the
scratch a GPU flash backward allocates (an fp32 accumulator for dq and the per-row dot(dO, O)),
which `scratch.calibrate_scratch` books because meta graphs cannot be measured.

Costs: the forward counts the two matmuls of attention, the backward five (the scores recomputed,
then dV, dP, dQ, dK), torch.utils.flop_counter's own formulas for SDPA; a causal mask is counted
in full (a kernel given an explicit mask cannot skip blocks).
Limits: no dropout (`attention.attention_16bit` keeps plain ops for that), a key/value of fewer
heads is repeated first (enable_gqa); a row with every key masked gives zeros, as eager's kernels do.
"""

from __future__ import annotations

import math

import torch
import torch.fx as fx
from torch.utils.flop_counter import register_flop_formula, sdpa_backward_flop_count, sdpa_flop_count

_BLOCK = 256  # query rows per block of the non-CPU kernels


def _bshd(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An empty (B, H, S, *rest) tensor laid out as (B, S, H, *rest), as the CPU flash kernel writes."""
    b, h, s, *rest = shape
    return torch.empty((b, s, h, *rest), dtype=dtype, device=device).transpose(1, 2)


def _laid_out(t: torch.Tensor) -> torch.Tensor:
    """`t` in the (B, S, H, ...) layout the fake kernels promise (copied only when it is not)."""
    want = _bshd(tuple(t.shape), t.dtype, t.device)
    if all(a == b or n == 1 for a, b, n in zip(t.stride(), want.stride(), t.shape)):
        return t
    return want.copy_(t)


def _scores(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None, rows: slice, causal: bool,
            scale: float) -> torch.Tensor:
    s = (q[..., rows, :].float() @ k.float().transpose(-2, -1)) * scale
    if causal:
        i = torch.arange(rows.start, rows.stop, device=q.device)[:, None]
        s = s.masked_fill(torch.arange(k.size(-2), device=q.device)[None, :] > i, float("-inf"))
    if mask is not None:
        s = s + mask[..., rows, :].float() if mask.size(-2) > 1 else s + mask.float()
    return s


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """A fully masked row's logsumexp (-inf) as 0, so its probabilities are exp(-inf) = 0, not NaN."""
    return lse.masked_fill(lse == float("-inf"), 0.0)


def _blockwise_forward(q, k, v, mask, causal, scale):
    out = _bshd((*q.shape[:-1], v.size(-1)), q.dtype, q.device)
    lse = _bshd(tuple(q.shape[:-1]), torch.float32, q.device)
    for r in range(0, q.size(-2), _BLOCK):
        rows = slice(r, min(r + _BLOCK, q.size(-2)))
        s = _scores(q, k, mask, rows, causal, scale)
        m = s.logsumexp(-1)
        lse[..., rows] = m
        out[..., rows, :] = ((s - _finite(m)[..., None]).exp().to(v.dtype).float() @ v.float()).to(out.dtype)
    return out, lse


def _blockwise_backward(grad, q, k, v, out, lse, mask, causal, scale):
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dk = torch.zeros(k.shape, dtype=torch.float32, device=q.device)
    dv = torch.zeros(v.shape, dtype=torch.float32, device=q.device)
    delta = (grad.float() * out.float()).sum(-1)  # dot(dO, O) per row
    for r in range(0, q.size(-2), _BLOCK):
        rows = slice(r, min(r + _BLOCK, q.size(-2)))
        p = (_scores(q, k, mask, rows, causal, scale) - _finite(lse[..., rows])[..., None]).exp()
        g = grad[..., rows, :].float()
        dv += p.to(v.dtype).float().transpose(-2, -1) @ g
        ds = p * (g @ v.float().transpose(-2, -1) - delta[..., rows, None]) * scale
        dq[..., rows, :] = ds @ k.float()
        dk += ds.transpose(-2, -1) @ q[..., rows, :].float()
    return tuple(_laid_out(t.to(x.dtype)) for t, x in ((dq, q), (dk, k), (dv, v)))


@torch.library.custom_op("autoremat::attention", mutates_args=())
def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
              is_causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax(q k^T * scale + mask) v and the rows' fp32 logsumexp; `mask` is additive (or None)."""
    if query.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            query, key, value, 0.0, is_causal, attn_mask=mask, scale=scale)
        return _laid_out(out), _laid_out(lse)
    return _blockwise_forward(query, key, value, mask, is_causal, scale)


@attention.register_fake
def _attention_fake(query, key, value, mask, is_causal, scale):
    return (_bshd((*query.shape[:-1], value.size(-1)), query.dtype, query.device),
            _bshd(tuple(query.shape[:-1]), torch.float32, query.device))


@torch.library.custom_op("autoremat::attention_backward", mutates_args=())
def attention_backward(grad: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       out: torch.Tensor, lse: torch.Tensor, mask: torch.Tensor | None, is_causal: bool,
                       scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of `attention` for q, k and v, its scores recomputed inside."""
    if query.device.type == "cpu":
        grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad, query, key, value, out, lse, 0.0, is_causal, attn_mask=mask, scale=scale)
        return tuple(_laid_out(g) for g in grads)
    return _blockwise_backward(grad, query, key, value, out, lse, mask, is_causal, scale)


@attention_backward.register_fake
def _attention_backward_fake(grad, query, key, value, out, lse, mask, is_causal, scale):
    return tuple(_bshd(tuple(x.shape), x.dtype, x.device) for x in (query, key, value))


def _setup(ctx, inputs, output) -> None:
    query, key, value, mask, ctx.is_causal, ctx.scale = inputs
    out, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(query, key, value, out, lse, mask)


def _backward(ctx, grad, _grad_lse):
    query, key, value, out, lse, mask = ctx.saved_tensors
    dq, dk, dv = attention_backward(grad, query, key, value, out, lse, mask, ctx.is_causal, ctx.scale)
    return dq, dk, dv, None, None, None


attention.register_autograd(_backward, setup_context=_setup)


@register_flop_formula(torch.ops.autoremat.attention)
def _attention_flops(query_shape, key_shape, value_shape, *args, **kwargs) -> int:
    return sdpa_flop_count(query_shape, key_shape, value_shape)


@register_flop_formula(torch.ops.autoremat.attention_backward)
def _attention_backward_flops(grad_shape, query_shape, key_shape, value_shape, *args, **kwargs) -> int:
    return sdpa_backward_flop_count(grad_shape, query_shape, key_shape, value_shape)


def meta_scratch(node: fx.Node) -> int:
    """Bytes a GPU flash kernel allocates beyond its outputs for this graph node (0 unless it is
    `autoremat::attention_backward`): the fp32 dq accumulator and the fp32 dot(dO, O) per row."""
    if node.op != "call_function" or node.target is not torch.ops.autoremat.attention_backward.default:
        return 0
    query = node.args[1].meta["val"]
    rows = query.numel() // query.size(-1)
    return 4 * (query.numel() + rows)


def fused_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0, is_causal: bool = False,
                    scale: float | None = None, enable_gqa: bool = False) -> torch.Tensor:
    """`F.scaled_dot_product_attention` through `autoremat::attention` (no seq x seq activation);
    with dropout, `attention.attention_16bit`'s plain ops (scores and probabilities stored)."""
    if dropout_p > 0.0:
        from autoremat.passes.attention import attention_16bit

        return attention_16bit(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    if enable_gqa and key.size(-3) != query.size(-3):
        groups = query.size(-3) // key.size(-3)
        key, value = key.repeat_interleave(groups, -3), value.repeat_interleave(groups, -3)
    scale = 1.0 / math.sqrt(query.size(-1)) if scale is None else scale
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        # what sdpa does with a boolean mask before any kernel: 0 where kept, -inf where masked
        attn_mask = torch.zeros(attn_mask.shape, dtype=query.dtype, device=query.device).masked_fill(
            ~attn_mask, float("-inf"))
    elif attn_mask is not None:
        attn_mask = attn_mask.to(query.dtype)
    return attention(query, key, value, attn_mask, is_causal, scale)[0]
