"""A gradient summed from matmul products is accumulated by the matmuls themselves (`addmm`).

A weight read by several matmuls in the forward (the vocabulary projection of a chunked loss, once per
chunk; a tied embedding; a layer applied twice) gets one product per use in the backward, and AOTAutograd
sums them with pointwise adds: `g = (mm_1 + mm_2) + mm_3 ...`. The two compilers run that sum differently:
  - eager runs each add as it comes: the running sum, the new product and the new sum are alive at once;
  - Inductor fuses a chain of pointwise adds into one loop over all the products, written at the last add
    (model/fusion.py), so every product is alive until then. With the loss region in k chunks, k copies of
    the vocabulary x hidden weight gradient were alive at the backward's peak, and more chunks raised the
    floor they were meant to lower.

`addmm(acc, a, b)` computes `acc + a @ b` in the matmul's own call (a library kernel under both compilers,
so Inductor does not fuse through it): the product is never a tensor of its own, and each step of the sum
holds only the running sum and its successor. The sum's order, and so its result up to rounding inside the
matmul, does not change.

A bias read by several projections gets one column sum per use, `g.sum(0)`, summed by adds too. Those are left
as they are: Inductor runs them inside the kernel of the last add (fusion.epilogue_reductions models it), and
accumulated one by one (as `addmm(acc[:, None], g^T, ones)`) the step held a scatter buffer of Inductor's pool
that the memory model does not see (tests/test_fusion.py's biased-head tests measured it over the prediction).
"""

from __future__ import annotations

import torch
import torch.fx as fx

from autoremat.passes.joint import backward_side

_MM = torch.ops.aten.mm.default
_ADD = torch.ops.aten.add.Tensor
_ADDMM = torch.ops.aten.addmm.default
# a transpose as a core ATen op: the graphs here are already decomposed, and Inductor lowers no `t`
_PERMUTE = torch.ops.aten.permute.default
# the op a running sum is accumulated by (planning/loss_region/bounds.py reads it as such)
ACCUMULATING = ("aten.addmm.default",)
_TRANSPOSES = (torch.ops.aten.t.default, torch.ops.aten.transpose.int, torch.ops.aten.permute.default)


def _matrix(n: fx.Node) -> torch.Tensor | None:
    val = n.meta.get("val")
    return val if isinstance(val, torch.Tensor) and val.dim() == 2 else None


def _product(n: fx.Node) -> tuple[fx.Node, bool] | None:
    """(mm, transposed) where `n` is an mm read only through 2-D transposes (an even count: the product
    itself; odd: its transpose), each read once; None otherwise."""
    flips = 0
    while n.op == "call_function" and n.target in _TRANSPOSES:
        if n.target is torch.ops.aten.permute.default and list(n.args[1]) != [1, 0]:
            return None
        if len(n.users) != 1 or _matrix(n) is None:
            return None
        n, flips = n.args[0], flips + 1
    if n.op != "call_function" or n.target is not _MM or len(n.users) != 1:
        return None
    return n, flips % 2 == 1


def _sum_of_products(n: fx.Node) -> bool:
    """`n` is a product or a running sum of them (an mm or addmm, read through 2-D transposes). Only such sums
    are rewritten: a product added to another kind of gradient (a tied embedding's) is left to the add, whose
    buffers the Inductor memory model follows; as an addmm, Inductor's code for it held more than the model
    predicted (tests/test_inplace.py's GPT-2 under Inductor checks the prediction)."""
    while n.op == "call_function" and n.target in _TRANSPOSES:
        n = n.args[0]
    return n.op == "call_function" and n.target in (_MM, _ADDMM)


def accumulate_into_matmuls(joint: fx.GraphModule) -> int:
    """Rewrite each backward `add(acc, product)` (module docstring) as an `addmm`; returns the count."""
    graph = joint.graph
    backward = backward_side(graph)
    order = {n: i for i, n in enumerate(graph.nodes)}
    done = 0
    for add in [n for n in graph.nodes if n.target is _ADD and n in backward]:
        if add.kwargs or len(add.args) != 2 or not all(isinstance(a, fx.Node) for a in add.args):
            continue
        out = _matrix(add)
        vals = [_matrix(a) for a in add.args]
        if out is None or any(v is None or v.shape != out.shape or v.dtype != out.dtype for v in vals):
            continue
        # the product computed last is folded in; the other operand is the running sum
        found = [(p, a) for a in add.args if (p := _product(a)) is not None]
        if not found:
            continue
        (mm, transposed), operand = max(found, key=lambda f: order[f[0][0]])
        acc = add.args[1] if operand is add.args[0] else add.args[0]
        if not _sum_of_products(acc):
            continue
        a, b = mm.args
        if transposed:  # acc + (a @ b)^T == acc + b^T @ a^T
            with graph.inserting_before(add):
                a, b = graph.call_function(_PERMUTE, (b, [1, 0])), graph.call_function(_PERMUTE, (a, [1, 0]))
            a.meta["val"], b.meta["val"] = mm.args[1].meta["val"].t(), mm.args[0].meta["val"].t()
        with graph.inserting_before(add):
            fused = graph.call_function(_ADDMM, (acc, a, b))
        # the product's provenance (its module, its loss chunk: the addmm is that product), the add's value; not
        # "eager_input_vals", the arguments Inductor checks a call against
        fused.meta = {k: v for k, v in mm.meta.items() if k not in ("eager_input_vals", "val")}
        fused.meta["val"] = add.meta["val"]
        add.replace_all_uses_with(fused)
        graph.erase_node(add)
        dead = operand
        while dead is not mm:
            nxt = dead.args[0]
            graph.erase_node(dead)
            dead = nxt
        graph.erase_node(mm)
        done += 1
    if done:
        graph.lint()
        joint.recompile()
    return done
