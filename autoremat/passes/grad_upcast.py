"""A 16-bit weight gradient written straight into fp32 rows, not upcast from a whole 16-bit copy.

Under precision="bf16"/"fp16" a linear layer reads its weight's 16-bit copy, so AOTAutograd's backward
computes that copy's gradient, `mm(dY^T, X)` in 16 bits, then casts it to the fp32 master gradient:
`_to_copy(mm(a, b), dtype=float32)`. Both are whole weight-sized tensors alive at once (a 7B Llama's
LM head: 250 MiB of bf16 beside its 500 MiB fp32 gradient), one more weight's worth than fp32 training.

`fuse_gradient_upcasts(joint)` replaces each such pair, where the 16-bit product has no other reader,
by `autoremat::mm_upcast(a, b, float32)`: the same product computed over blocks of output rows (each
block in 16 bits, as the mm did, then written into the fp32 result, as the cast did), so only a block
of 16-bit rows exists beside the fp32 gradient. Values: the mm's and the cast's, up to the blocking of
the 16-bit matmul kernel. FLOPs: the mm's (torch.utils.flop_counter's formula), at the 16-bit rate.
"""

from __future__ import annotations

import contextlib

import torch
import torch.fx as fx
from torch.utils.flop_counter import mm_flop, register_flop_formula

from autoremat.passes.joint import backward_side
from autoremat.torch_internals import detect_fake_mode

_MM = torch.ops.aten.mm.default
_CAST = torch.ops.aten._to_copy.default
_LOW = (torch.bfloat16, torch.float16)
_VIEWS = (torch.ops.aten.t.default, torch.ops.aten.view.default)
_BLOCK_ELEMENTS = 1 << 22  # 16-bit elements of one block of rows (8 MiB)


@torch.library.custom_op("autoremat::mm_upcast", mutates_args=())
def mm_upcast(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`(a @ b).to(dtype)`, computed over blocks of rows."""
    out = torch.empty((a.shape[0], b.shape[1]), dtype=dtype, device=a.device)
    rows = max(1, _BLOCK_ELEMENTS // max(1, b.shape[1]))
    for r in range(0, a.shape[0], rows):
        out[r:r + rows] = a[r:r + rows] @ b
    return out


@mm_upcast.register_fake
def _mm_upcast_fake(a, b, dtype):
    return a.new_empty((a.shape[0], b.shape[1]), dtype=dtype)


@register_flop_formula(torch.ops.autoremat.mm_upcast)
def _mm_upcast_flops(a_shape, b_shape, *args, **kwargs) -> int:
    return mm_flop(a_shape, b_shape)


def _fake(fn, *args):
    """`fn(*args)` on traced values, in their fake mode."""
    vals = [a.meta["val"] if isinstance(a, fx.Node) else a for a in args]
    mode = detect_fake_mode([v for v in vals if isinstance(v, torch.Tensor)])
    with mode if mode is not None else contextlib.nullcontext():
        return fn(*vals)


def _plain_upcast(cast: fx.Node) -> bool:
    """A `_to_copy` to float32 that changes nothing but the dtype."""
    kw = cast.kwargs
    val = cast.args[0].meta.get("val") if cast.args and isinstance(cast.args[0], fx.Node) else None
    return (cast.target is _CAST and val is not None and kw.get("dtype") == torch.float32
            and kw.get("layout", torch.strided) == torch.strided and kw.get("device", val.device) == val.device
            and kw.get("memory_format", torch.preserve_format) == torch.preserve_format
            and set(kw) <= {"dtype", "layout", "device", "memory_format"})


def fuse_gradient_upcasts(joint: fx.GraphModule) -> int:
    """Rewrite `joint`'s backward `_to_copy(views(mm(a, b)), dtype=float32)`, the mm in 16 bits and read
    by nothing else, into the same views of `autoremat::mm_upcast(a, b)` (module docstring). Returns how
    many were rewritten."""
    graph = joint.graph
    backward = backward_side(graph)
    done = 0
    for cast in list(graph.nodes):
        if cast not in backward or not _plain_upcast(cast):
            continue
        views, mm = [], cast.args[0]
        while mm.target in _VIEWS and len(mm.users) == 1:  # AOTAutograd's t(t(mm(...))), a view(mm(...))
            views.insert(0, mm)
            mm = mm.args[0]
        if not (mm.target is _MM and len(mm.users) == 1 and mm.meta["val"].dtype in _LOW):
            continue
        vals = [_fake(mm_upcast, *mm.args, torch.float32)]
        for v in views:
            vals.append(_fake(v.target, vals[-1], *v.args[1:]))
        if vals[-1].stride() != cast.meta["val"].stride():  # not the layout the cast wrote: left alone
            continue
        with graph.inserting_before(cast):
            new = graph.call_function(torch.ops.autoremat.mm_upcast.default, (*mm.args, torch.float32))
            new.meta = {**mm.meta, "val": vals[0]}
            for v, val in zip(views, vals[1:]):
                new = graph.call_function(v.target, (new, *v.args[1:]), dict(v.kwargs))
                new.meta = {**v.meta, "val": val}
        new.meta.update({k: x for k, x in cast.meta.items() if k != "val"})
        cast.replace_all_uses_with(new)
        graph.erase_node(cast)
        for v in reversed(views):
            graph.erase_node(v)
        graph.erase_node(mm)
        done += 1
    if done:
        graph.lint()
        joint.recompile()
    return done
