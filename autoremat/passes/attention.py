"""Attention in 16 bits, as a GPU kernel computes it: scores and probabilities stored in 16 bits.

`F.scaled_dot_product_attention` on a 16-bit input has no single meaning: on a GPU, the flash and
memory-efficient kernels read and write 16 bits and accumulate the softmax in fp32 (the
probabilities are rounded to 16 bits before they multiply the values); PyTorch's math fallback,
the only one traced on CPU and on the meta device, upcasts q, k and v to fp32 and runs the whole
attention, both matmuls included, in fp32. Traced that way, an attention chosen to run in bf16
holds fp32 scores and probabilities (seq x seq per head, the largest activations of a transformer)
plus the casts: more memory than fp32, not less.

`attention_16bit` spells the kernels' semantics out in plain ops, so AOTAutograd derives its
backward and the planner sees every value at its real size: q @ k^T in the low dtype, the mask,
a softmax that takes and returns the low dtype (aten's softmax kernels accumulate in fp32 for 16-bit
inputs, forward and backward), dropout on the probabilities, then @ v. The gradients are exact for
this computation. passes/dtypes.py swaps it in for every attention call it runs in 16 bits.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def attention_16bit(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0, is_causal: bool = False,
                    scale: float | None = None, enable_gqa: bool = False) -> torch.Tensor:
    """`F.scaled_dot_product_attention` with its inputs' (16-bit) dtype for scores and probabilities."""
    if enable_gqa and key.size(-3) != query.size(-3):
        groups = query.size(-3) // key.size(-3)
        key, value = key.repeat_interleave(groups, -3), value.repeat_interleave(groups, -3)
    scale = 1.0 / math.sqrt(query.size(-1)) if scale is None else scale
    scores = (query @ key.transpose(-2, -1)) * scale
    if is_causal:
        keep = torch.ones(query.size(-2), key.size(-2), dtype=torch.bool, device=query.device).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attn_mask, float("-inf"))
        else:
            scores = scores + attn_mask.to(scores.dtype)
    probs = torch.ops.aten._safe_softmax(scores, -1)  # a fully masked row gives zeros, as the math path
    if dropout_p > 0.0:
        probs = F.dropout(probs, dropout_p, training=True)  # sdpa drops whenever dropout_p > 0
    return probs @ value
