"""Cross-entropy over 16-bit logits as one fused kernel: no tokens x vocabulary fp32 value stored.

A 16-bit region's logits reach the loss through an fp32 cast (`logits.float()`, as HF's losses and
autocast's fp32 list both do). Traced as aten ops, that loss holds, all tokens x vocabulary: the fp32
cast, its log-softmax (saved for the backward), the one-hot gradient of nll_loss and the gradient of
the log-softmax, all fp32 (at 2048 tokens x 32000 words, 250 MiB each), beside the 16-bit logits.

`autoremat::cross_entropy(logits, target, ignore_index, label_smoothing) -> (loss sum, logsumexp)`
reads the 16-bit logits, computes in fp32 over blocks of rows, and keeps one fp32 logsumexp per
row; `autoremat::cross_entropy_backward` writes the logits' gradient, g * (softmax - (1 - s) onehot
- s / V) for each row not ignored, computed in fp32 and rounded once to the logits' dtype (what the
cast's backward does to the fp32 gradient eager computes). Both are plain torch inside, the same on
every device; their scratch is a block of rows (measured on a real device, none booked on meta, as a
fused GPU kernel keeps its block on chip). Costs: profiled as elementwise ops over the bytes they move.
`loss_chunks.rewrite` uses it for a 16-bit site left whole (chunks=1, outputs="all").
"""

from __future__ import annotations

import torch

_ROWS = 256  # rows per block


def _row_block(logits: torch.Tensor, target: torch.Tensor, rows: slice, ignore_index: int):
    """The rows' logits in fp32, their targets, and which are not ignored."""
    y = target[rows]
    return logits[rows].float(), y, y != ignore_index


@torch.library.custom_op("autoremat::cross_entropy", mutates_args=())
def cross_entropy(logits: torch.Tensor, target: torch.Tensor, ignore_index: int,
                  label_smoothing: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum over the rows not ignored of logsumexp(z) - (1 - s) z[y] - s mean(z), z = logits in fp32;
    and each row's fp32 logsumexp."""
    lse = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
    total = torch.zeros((), dtype=torch.float32, device=logits.device)
    for r in range(0, logits.shape[0], _ROWS):
        rows = slice(r, r + _ROWS)
        z, y, valid = _row_block(logits, target, rows, ignore_index)
        m = torch.logsumexp(z, dim=-1)
        lse[rows] = m
        picked = z.gather(1, torch.where(valid, y, 0).unsqueeze(1)).squeeze(1)
        term = m - picked if label_smoothing == 0 else (
            m - (1 - label_smoothing) * picked - label_smoothing * z.mean(dim=-1))
        total += torch.where(valid, term, 0).sum()
    return total, lse


@cross_entropy.register_fake
def _cross_entropy_fake(logits, target, ignore_index, label_smoothing):
    return (logits.new_empty((), dtype=torch.float32),
            logits.new_empty(logits.shape[0], dtype=torch.float32))


@torch.library.custom_op("autoremat::cross_entropy_backward", mutates_args=())
def cross_entropy_backward(grad: torch.Tensor, logits: torch.Tensor, target: torch.Tensor, lse: torch.Tensor,
                           ignore_index: int, label_smoothing: float) -> torch.Tensor:
    """The gradient of `cross_entropy`'s loss sum for the logits, in their dtype."""
    out = torch.empty_like(logits, memory_format=torch.contiguous_format)
    vocab = logits.shape[-1]
    for r in range(0, logits.shape[0], _ROWS):
        rows = slice(r, r + _ROWS)
        z, y, valid = _row_block(logits, target, rows, ignore_index)
        p = (z - lse[rows, None]).exp()
        if label_smoothing:
            p -= label_smoothing / vocab
        p.scatter_add_(1, torch.where(valid, y, 0).unsqueeze(1),
                       torch.full((p.shape[0], 1), label_smoothing - 1.0, device=p.device))
        out[rows] = (p * (grad.float() * valid.unsqueeze(1))).to(out.dtype)
    return out


@cross_entropy_backward.register_fake
def _cross_entropy_backward_fake(grad, logits, target, lse, ignore_index, label_smoothing):
    return torch.empty_like(logits, memory_format=torch.contiguous_format)


def _setup(ctx, inputs, output) -> None:
    logits, target, ctx.ignore_index, ctx.label_smoothing = inputs
    ctx.mark_non_differentiable(output[1])
    ctx.save_for_backward(logits, target, output[1])


def _backward(ctx, grad, _grad_lse):
    logits, target, lse = ctx.saved_tensors
    return cross_entropy_backward(grad, logits, target, lse, ctx.ignore_index, ctx.label_smoothing), None, None, None


cross_entropy.register_autograd(_backward, setup_context=_setup)


def fused_cross_entropy(logits: torch.Tensor, target: torch.Tensor, *, ignore_index: int, reduction: str,
                        label_smoothing: float) -> torch.Tensor:
    """F.cross_entropy(logits.float(), target, ...) for [N, V] logits, reduction "mean" or "sum"."""
    total = cross_entropy(logits, target, ignore_index, label_smoothing)[0]
    if reduction == "mean":
        total = total / (target != ignore_index).sum()
    return total
