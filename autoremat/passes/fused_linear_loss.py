"""The 16-bit output projection and its cross-entropy as one fused op: no tokens x vocabulary tensor at all.

Under precision="bf16"/"fp16" with outputs="loss" (only the loss is used), the LM head is

    loss = cross_entropy(linear(h.to(bf16), W.to(bf16)).float(), y)

and, traced as aten ops, its backward holds the bf16 logits' gradient (tokens x vocabulary) beside the
bf16 weight copy (vocabulary x d) while the fp32 master gradient (vocabulary x d, fp32) is written: at
a 7B Llama's 2048 tokens, 125 + 250 + 500 MiB. Chunking the tokens (passes/loss_chunks.py) does not
help in 16 bits: each chunk's weight gradient is a whole vocabulary x d tensor.

`autoremat::linear_cross_entropy(h, weight, target, ignore_index, label_smoothing) -> (loss sum, lse)`
reads the 16-bit hidden states h [N, d] and the fp32 master weight [V, d]; for each chunk of token rows
it walks the vocabulary in blocks of rows of W: each block is cast to h's dtype, its logits h_c @ W_b^T
are rounded to that dtype (as the 16-bit matmul wrote them), and an online logsumexp per row is kept in
fp32.
`autoremat::linear_cross_entropy_backward` walks the same blocks: the block's logits again, their
gradient g = grad * (softmax - (1 - s) onehot - s / V) rounded once to h's dtype (what the cast's
backward does), the fp32 weight gradient's rows g^T @ h written straight into the one fp32 buffer it
returns (the master weight's gradient, so AccumulateGrad and its hooks see it as before; summed over
the token chunks in fp32), and g @ W_b summed in fp32 into the chunk's hidden-state gradient, rounded
once. The products are of 16-bit
values with fp32 accumulation, as a 16-bit GPU matmul computes them.

On the eager path, where h is read by nothing after the backward (it is recomputed for it, or saved and
read there last), `linear_cross_entropy_backward_into_h` writes h's gradient over h instead: the plan
decides per schedule (recomputed_writes.write_over_dying_input), `write_gradient_into_h` rewrites the
backward to match. Where this op's backward sets the floor, that lowers it by h's size
(tests/test_fused_linear_loss.py::test_the_heads_backward_writes_hs_gradient_over_h_where_h_dies).

Scratch: a chunk x block of logits (and their 16-bit copy), the block of W cast, and the chunk's fp32
accumulator of the hidden-state gradient (at 7B widths: 256 x 256 logits, 256 x 4096 weights, 4 MiB); on meta `meta_scratch` books those bytes (scratch.calibrate_scratch), on a
real device they are measured. FLOPs: the projection once forward, three times backward (logits
recomputed, g @ W, g^T @ h), at the 16-bit rate.
Used by `loss_chunks.rewrite` for a 16-bit, bias-free `linear` site under outputs="loss".
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch.utils.flop_counter import register_flop_formula

_TOKENS = 256  # token rows per chunk
_WEIGHT_ELEMENTS = 1 << 20  # elements of one block of W's rows (2 MiB in bf16)


def _blocks(tokens: int, vocab: int, d: int) -> tuple[int, int]:
    """(token rows per chunk, vocabulary rows per block)."""
    return max(1, min(tokens, _TOKENS)), max(1, min(vocab, _WEIGHT_ELEMENTS // max(1, d)))


def _chunks(n: int, step: int):
    for r in range(0, n, step):
        yield slice(r, min(r + step, n))


def _block_logits(h32: torch.Tensor, weight: torch.Tensor, cols: slice, dtype: torch.dtype):
    """The block's weight rows cast to `dtype` (as fp32 values) and its logits, rounded to `dtype`, in fp32."""
    w = weight[cols].to(dtype).float()
    return w, (h32 @ w.t()).to(dtype).float()


@torch.library.custom_op("autoremat::linear_cross_entropy", mutates_args=())
def linear_cross_entropy(h: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, ignore_index: int,
                         label_smoothing: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum over the rows not ignored of logsumexp(z) - (1 - s) z[y] - s mean(z), z = (h @ W^T in h's dtype)
    in fp32; and each row's fp32 logsumexp."""
    (n, d), vocab = h.shape, weight.shape[0]
    lse = torch.empty(n, dtype=torch.float32, device=h.device)
    total = torch.zeros((), dtype=torch.float32, device=h.device)
    chunk, block = _blocks(n, vocab, d)
    for rows in _chunks(n, chunk):
        h32, t = h[rows].float(), target[rows]
        valid = t != ignore_index
        y = torch.where(valid, t, 0)
        m = torch.full((h32.shape[0],), float("-inf"), device=h.device)
        s, picked, sum_z = torch.zeros_like(m), torch.zeros_like(m), torch.zeros_like(m)
        for cols in _chunks(vocab, block):  # an online logsumexp over blocks of the vocabulary
            _, z = _block_logits(h32, weight, cols, h.dtype)
            new_m = torch.maximum(m, z.max(dim=1).values)
            s = s * (m - new_m).exp() + (z - new_m[:, None]).exp().sum(dim=1)
            m = new_m
            inside = (y >= cols.start) & (y < cols.stop)
            picked += torch.where(inside, z.gather(1, (y - cols.start).clamp(0, z.shape[1] - 1)[:, None])[:, 0], 0)
            if label_smoothing:
                sum_z += z.sum(dim=1)
        lse[rows] = m + s.log()
        term = lse[rows] - picked if label_smoothing == 0 else (
            lse[rows] - (1 - label_smoothing) * picked - label_smoothing * sum_z / vocab)
        total += torch.where(valid, term, 0).sum()
    return total, lse


@linear_cross_entropy.register_fake
def _linear_cross_entropy_fake(h, weight, target, ignore_index, label_smoothing):
    return h.new_empty((), dtype=torch.float32), h.new_empty(h.shape[0], dtype=torch.float32)


def _backward_rows(h: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, lse: torch.Tensor,
                   grad: torch.Tensor, ignore_index: int, label_smoothing: float,
                   grad_h: torch.Tensor) -> torch.Tensor:
    """Write h's gradient into `grad_h` a chunk of rows at a time and return the weight's.

    `grad_h` may be h itself: each chunk's rows of h are read (copied to fp32) before that chunk's
    gradient is written over them, and no other chunk reads them, so the values are the same."""
    (n, d), vocab = h.shape, weight.shape[0]
    grad_w = torch.zeros(weight.shape, dtype=weight.dtype, device=weight.device)
    chunk, block = _blocks(n, vocab, d)
    for rows in _chunks(n, chunk):
        h32, t = h[rows].float(), target[rows]
        valid = t != ignore_index
        y = torch.where(valid, t, 0)
        scale = (grad.float() * valid)[:, None]
        acc = torch.zeros(h32.shape, dtype=torch.float32, device=h.device)  # the chunk's dh, summed in fp32
        for cols in _chunks(vocab, block):
            w, z = _block_logits(h32, weight, cols, h.dtype)
            p = (z - lse[rows, None]).exp()
            if label_smoothing:
                p -= label_smoothing / vocab
            inside = (y >= cols.start) & (y < cols.stop)
            p.scatter_add_(1, (y - cols.start).clamp(0, p.shape[1] - 1)[:, None],
                           torch.where(inside, label_smoothing - 1.0, 0.0)[:, None])
            g = (p * scale).to(h.dtype).float()
            grad_w[cols] += g.t() @ h32
            acc += g @ w
        grad_h[rows] = acc.to(h.dtype)
    return grad_w


@torch.library.custom_op("autoremat::linear_cross_entropy_backward", mutates_args=())
def linear_cross_entropy_backward(h: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, lse: torch.Tensor,
                                  grad: torch.Tensor, ignore_index: int,
                                  label_smoothing: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients of `linear_cross_entropy`'s loss sum for h (in h's dtype) and the weight (in its dtype)."""
    grad_h = torch.empty_like(h, memory_format=torch.contiguous_format)
    return grad_h, _backward_rows(h, weight, target, lse, grad, ignore_index, label_smoothing, grad_h)


@linear_cross_entropy_backward.register_fake
def _linear_cross_entropy_backward_fake(h, weight, target, lse, grad, ignore_index, label_smoothing):
    return torch.empty_like(h, memory_format=torch.contiguous_format), \
        torch.empty_like(weight, memory_format=torch.contiguous_format)


@torch.library.custom_op("autoremat::linear_cross_entropy_backward_into_h", mutates_args=("h",))
def linear_cross_entropy_backward_into_h(h: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                                         lse: torch.Tensor, grad: torch.Tensor, ignore_index: int,
                                         label_smoothing: float) -> torch.Tensor:
    """`linear_cross_entropy_backward` with h's gradient written over h (contiguous, read by nothing
    after it): the weight's gradient is returned, h's is h. Only the eager backward runs it
    (`write_gradient_into_h`)."""
    return _backward_rows(h, weight, target, lse, grad, ignore_index, label_smoothing, h)


@linear_cross_entropy_backward_into_h.register_fake
def _linear_cross_entropy_backward_into_h_fake(h, weight, target, lse, grad, ignore_index, label_smoothing):
    return torch.empty_like(weight, memory_format=torch.contiguous_format)


def _setup(ctx, inputs, output) -> None:
    h, weight, target, ctx.ignore_index, ctx.label_smoothing = inputs
    ctx.mark_non_differentiable(output[1])
    ctx.save_for_backward(h, weight, target, output[1])


def _backward(ctx, grad, _grad_lse):
    h, weight, target, lse = ctx.saved_tensors
    grad_h, grad_w = linear_cross_entropy_backward(h, weight, target, lse, grad, ctx.ignore_index,
                                                   ctx.label_smoothing)
    return grad_h, grad_w, None, None, None


linear_cross_entropy.register_autograd(_backward, setup_context=_setup)


@register_flop_formula(torch.ops.autoremat.linear_cross_entropy)
def _forward_flops(h_shape, weight_shape, *args, **kwargs) -> int:
    return 2 * h_shape[0] * h_shape[1] * weight_shape[0]


@register_flop_formula(torch.ops.autoremat.linear_cross_entropy_backward)
def _backward_flops(h_shape, weight_shape, *args, **kwargs) -> int:
    return 6 * h_shape[0] * h_shape[1] * weight_shape[0]


def meta_scratch(node: fx.Node) -> int:
    """Bytes a fused GPU kernel of these ops allocates beyond its outputs (0 for any other node): a chunk x
    block of fp32 logits and its 16-bit copy, the block of W cast, and (backward) the chunk's fp32 dh."""
    ops = (torch.ops.autoremat.linear_cross_entropy.default, torch.ops.autoremat.linear_cross_entropy_backward.default)
    if node.op != "call_function" or node.target not in ops:
        return 0
    h, weight = node.args[0].meta["val"], node.args[1].meta["val"]
    (n, d), vocab, low = h.shape, weight.shape[0], h.element_size()
    chunk, block = _blocks(n, vocab, d)
    scratch = chunk * block * (4 + low) + block * d * low + 4 * 4 * chunk
    if node.target is ops[1]:
        scratch += 4 * chunk * d
    return scratch


def fused_linear_cross_entropy(h: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, *, ignore_index: int,
                               reduction: str, label_smoothing: float) -> torch.Tensor:
    """F.cross_entropy(F.linear(h, weight.to(h.dtype)).float(), target, ...) for h [N, d] in 16 bits,
    reduction "mean" or "sum"."""
    total = linear_cross_entropy(h, weight, target, ignore_index, label_smoothing)[0]
    if reduction == "mean":
        total = total / (target != ignore_index).sum()
    return total


def overwritable(joint: fx.GraphModule) -> dict[str, tuple[str, str]]:
    """{fused backward node: (its h-gradient getitem, h)} where `linear_cross_entropy_backward_into_h`
    could write the gradient over h: h is computed by an op of this graph (not an input the caller
    owns), is contiguous and has the gradient's layout. Whether h dies there is the plan's
    (recomputed_writes.write_over_dying_input)."""
    found: dict[str, tuple[str, str]] = {}
    for n in joint.graph.nodes:
        if n.op != "call_function" or n.target is not torch.ops.autoremat.linear_cross_entropy_backward.default:
            continue
        h = n.args[0]
        grads = [u for u in n.users if u.target is operator.getitem and u.args[1] == 0]
        hv = h.meta.get("val") if isinstance(h, fx.Node) else None
        if (len(grads) != 1 or h.op != "call_function" or h.target is operator.getitem
                or not isinstance(hv, torch.Tensor)):
            continue
        gv = grads[0].meta["val"]
        if hv.is_contiguous() and (hv.shape, hv.dtype, hv.stride()) == (gv.shape, gv.dtype, gv.stride()):
            found[n.name] = (grads[0].name, h.name)
    return found


def write_gradient_into_h(bw: fx.GraphModule, written: dict[str, str]) -> int:
    """Run the fused backward ops whose h-gradient getitem `written` names (it is written over h, which
    dies there: the schedule decided, recomputed_writes.write_over_dying_input) as
    `linear_cross_entropy_backward_into_h`, reading h where the gradient was read; the count rewritten."""
    by_name = {n.name: n for n in bw.graph.nodes}
    position = {n: i for i, n in enumerate(bw.graph.nodes)}
    done = 0
    for name, into in written.items():
        got, h = by_name.get(name), by_name.get(into)
        if got is None or h is None or got.target is not operator.getitem:
            continue
        op = got.args[0]
        if op.target is not torch.ops.autoremat.linear_cross_entropy_backward.default or op.args[0] is not h:
            continue
        if any(position[w] > position[op] for w in h.users):  # not the plan the profile described
            continue
        with bw.graph.inserting_before(op):
            new = bw.graph.call_function(torch.ops.autoremat.linear_cross_entropy_backward_into_h.default,
                                         op.args, op.kwargs)
        for g in list(op.users):
            g.replace_all_uses_with(h if g.args[1] == 0 else new)
            if g.args[1] == 1:
                new.meta = dict(g.meta)
            bw.graph.erase_node(g)
        bw.graph.erase_node(op)
        done += 1
    if done:
        bw.graph.lint()
        bw.recompile()
    return done
