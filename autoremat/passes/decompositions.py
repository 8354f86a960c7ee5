"""Decompositions applied while AOTAutograd traces the joint graph: dropout and the layout fixes.

- `DECOMPOSITIONS` (every compiler): dropout as a bool mask and a masked scale, so that its output
  can be recomputed from its input and the saved mask (`_native_dropout`).
- `LAYOUT_DECOMPOSITIONS` (the eager compiler): BatchNorm forward/backward and LayerNorm backward
  traced on inputs in their kernel's layout, and dropout's backward traced as the CPU kernel computes
  it, so that traced strides are the real ones (`_in_kernel_layout`, `_batch_norm_format`).

capture.aot_backend hands these tables to AOTAutograd.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from autoremat.torch_internals import OpOverload

# Devices where a bool bernoulli draw in the input's memory order is eager's dropout draw, bit for bit.
BERNOULLI_DEVICES = ("cpu", "meta")


@torch.library.custom_op("autoremat::dropout_mask", mutates_args=(), tags=(torch.Tag.nondeterministic_seeded,))
def dropout_mask(x: torch.Tensor, p: float) -> torch.Tensor:
    """The bool keep-mask of `native_dropout(x, p, True)`: the draw of the device's own fused kernel
    (CUDA's Philox), so masks are eager's wherever bernoulli would draw otherwise. The kernel's output
    is made and dropped here (scratch the size of `x`: `rng_replay.draw_scratch`)."""
    mask = torch.ops.aten.native_dropout.default(x, p, True)[1]
    laid_out = torch.empty_like(x, dtype=torch.bool)
    if mask.stride() == laid_out.stride():
        return mask
    return laid_out.copy_(mask)


@dropout_mask.register_fake
def _(x: torch.Tensor, p: float) -> torch.Tensor:
    return torch.empty_like(x, dtype=torch.bool)


@torch.library.custom_op("autoremat::bool_bernoulli", mutates_args=(), tags=(torch.Tag.nondeterministic_seeded,))
def bool_bernoulli(size: list[int], p: float, device: torch.device) -> torch.Tensor:
    """A contiguous bool tensor of `size`, each element True with probability p, drawn in memory order by
    `bernoulli_`: the draw `aten.bernoulli.p` makes, into the tensor it returns (no input to copy).

    An op of its own, opaque to compilers, because Inductor lowers `aten.bernoulli.p` on CPU as a clone
    filled in place by `bernoulli_`, and its scheduler can fuse a reader of the filled mask into the
    kernel that writes the clone, so that the reader sees the unfilled clone (a PEFT LoRA
    adapter whose dropout reads a LayerNorm output would get an all-false mask, hence zero `lora_B` gradients;
    tests/test_lora.py). It takes no tensor: an input to draw like would be one more buffer, which
    Inductor allocates and the memory model does not see (benchmarks/lora.py plans a LoRA step at its floor)."""
    return torch.empty(size, dtype=torch.bool, device=device).bernoulli_(p)


@bool_bernoulli.register_fake
def _(size: list[int], p: float, device: torch.device) -> torch.Tensor:
    return torch.empty(size, dtype=torch.bool, device=device)


def _native_dropout(x: torch.Tensor, p: float, train: bool | None) -> Any:
    """Dropout as a random bool mask and a masked scale, so that the output can be recomputed.

    The mask is the only random value (1 byte per element if saved; `rng_replay` lets the plan replay
    its draw instead); the output becomes a pure function of the input and the mask, on every device.
    On CPU this reproduces eager's dropout draw for draw: eager fills a noise tensor laid out like the
    input (`bernoulli_`, in memory order), divides it by 1 - p and multiplies; we draw the mask in the
    input's memory order, then compute the same products (checked bit for bit, transposed inputs too;
    where eager's x * 0 gives -0.0 or NaN for a dropped element, this gives +0.0). A fused kernel
    (CUDA's) draws otherwise: there the mask is the kernel's own (`dropout_mask`), and only the
    masked scale is computed here.
    """
    if train is False or p == 0 or x.numel() == 0:
        return NotImplemented
    if p >= 1:
        return torch.zeros_like(x), torch.zeros_like(x, dtype=torch.bool)
    # Eager multiplies by a noise tensor of 0 and 1 / (1 - p), the latter computed by the same div
    # kernel as `scale` here: x * scale where kept is the same product, bit for bit. Selecting with
    # the mask, rather than multiplying by a float copy of it, leaves the backward needing only the
    # bool mask (where's gradient), never a float noise tensor (a saved or recomputed float
    # noise would be one more full-size tensor at the attention backward's peak).
    if x.device.type not in BERNOULLI_DEVICES:
        # A fused kernel scales in its compute type (fp32 for 16-bit inputs): so does a Python-float scale.
        mask = torch.ops.autoremat.dropout_mask(x, p)
        return torch.where(mask, torch.mul(x, 1 / (1 - p)), 0), mask
    scale = torch.div(torch.ones((), dtype=x.dtype, device=x.device), 1 - p)
    order = sorted(range(x.dim()), key=lambda d: (-x.stride(d), d))  # outermost in memory first
    if not x.permute(order).is_contiguous():
        return NotImplemented  # overlapping or gapped layout: keep the fused op (saved, not recomputed)
    drawn = torch.ops.autoremat.bool_bernoulli([x.shape[d] for d in order], 1 - p, x.device)
    mask = drawn.permute([order.index(d) for d in range(x.dim())])
    return torch.where(mask, torch.mul(x, scale), 0), mask


def _batch_norm_format(t: torch.Tensor) -> torch.memory_format:
    """The layout batch norm's kernels give their output: `input.suggest_memory_format()` (dense
    channels-last stays channels-last, anything else becomes contiguous)."""
    if t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last):
        return torch.channels_last
    if t.dim() == 5 and t.is_contiguous(memory_format=torch.channels_last_3d):
        return torch.channels_last_3d
    return torch.contiguous_format


def _contiguous_format(t: torch.Tensor) -> torch.memory_format:
    return torch.contiguous_format


def _in_kernel_layout(op: OpOverload, inputs: list[int],
                      kernel_format: Callable[[torch.Tensor], torch.memory_format]) -> Callable:
    """`op` traced on inputs laid out as its kernel lays out its output, so that traced strides are real.

    Some kernels choose their output's layout otherwise than their fake-tensor rule (on CPU, checked
    in tests/test_capture.py): batch norm returns `empty_like(input, input.suggest_memory_format())`,
    contiguous for a transposed (N, C, L) input, where the fake tensor keeps the transposed strides
    (and in the backward grad_out's); layer norm's backward returns a contiguous grad_input where
    the fake tensor follows a transposed grad_out. A view the graph takes of such an output fails at
    run time, or, turned into a reshape, copies bytes the memory model never saw, so the real peak passes the
    prediction. Copying `inputs` (positions; the first decides the layout) into that layout
    first makes fake and real strides agree; the copy is an ordinary graph node that the memory
    model counts, and the kernel would otherwise have made it or worked around it internally.
    """
    def decomposition(*args: Any, **kwargs: Any) -> Any:
        fmt = kernel_format(args[inputs[0]])
        if all(args[i].is_contiguous(memory_format=fmt) for i in inputs):
            return NotImplemented  # already in the kernel's layout: trace the op itself
        args = list(args)
        for i in inputs:
            args[i] = args[i].contiguous(memory_format=fmt)
        return op(*args, **kwargs)

    return decomposition


def _dropout_backward_as_on_cpu(grad: torch.Tensor, mask: torch.Tensor, scale: float) -> Any:
    """native_dropout_backward as the CPU kernel computes it, `grad * mask * scale`
    (aten/src/ATen/native/Dropout.cpp): its output keeps grad's layout, where the fake-tensor rule
    returns a contiguous tensor. Traced as those two multiplications, the fake strides are the
    real ones, and the kernel's grad-sized intermediate becomes a node the memory model sees."""
    if grad.device.type not in ("cpu", "meta"):
        return NotImplemented  # CUDA runs a fused kernel of its own
    return torch.mul(torch.mul(grad, mask), scale)


_aten = torch.ops.aten
# The eager compiler runs these ops as traced; inductor lowers them itself and picks its own strides.
LAYOUT_DECOMPOSITIONS = {
    **{op: _in_kernel_layout(op, [0], _batch_norm_format)
       for op in (_aten._native_batch_norm_legit_functional.default, _aten._native_batch_norm_legit_no_training.default,
                  _aten._native_batch_norm_legit.no_stats)},
    _aten.native_batch_norm_backward.default: _in_kernel_layout(_aten.native_batch_norm_backward.default, [1, 0],
                                                                _batch_norm_format),
    _aten.native_layer_norm_backward.default: _in_kernel_layout(_aten.native_layer_norm_backward.default, [1, 0],
                                                                _contiguous_format),
    _aten.native_dropout_backward.default: _dropout_backward_as_on_cpu,
}
DECOMPOSITIONS = {torch.ops.aten.native_dropout.default: _native_dropout}
