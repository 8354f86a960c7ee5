"""Pointwise fusion as Inductor does it, so that the profile of a graph Inductor will run allocates
what Inductor's code allocates.

Inductor inlines a pointwise op into the kernels that read it: its value is never written to memory
unless something needs it whole. A forward-side pointwise node is *fused* (it owns no bytes, and
the plan never saves it: a saved value is a graph output, which Inductor must write) when
  - its op is pointwise (torch.Tag.pointwise) and it may be recomputed (not random, no buffer read),
  - it is not an output of the joint graph (forward output or gradient),
  - every node that reads it, directly or through views of it, is itself pointwise or a reduction
    (sum, mean, amax, ...) or an indexed load (gather, index): those become one loop with it. A matmul, a convolution or any op that
    Inductor calls as a library kernel needs its input in memory;
  - it has at most `reads_threshold` readers: Inductor writes a value out once more kernels read it
    (torch._inductor.config.realize_reads_threshold, read through torch_internals).

Backward-side pointwise nodes under the same rule are fused too (they never cross into another
graph). Recomputing a fused node inside its consumer's loop reads nothing from memory, so its time
is its arithmetic only (plus no launch of its own).

A constant fill (`full`, `zeros`, `scalar_tensor`, `iota`, ...) is a pointwise loop to Inductor too: it
lowers every tensor constructor to a loop body that writes its constant (torch/_inductor/lowering.py's
`tensor_constructor` and `full`), inlined into its readers under the same rule (an attention mask's fill
value, read by a `where`, is never written).

A concatenation is no kernel either (`concat_writes`): Inductor allocates the cat's buffer and has the
kernels that compute its inputs write straight into their slices of it (ir.ConcatKernel), so that
buffer exists from the first such kernel on, and those inputs own no buffer of their own.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from autoremat.torch_internals import OpOverload, inductor_max_pointwise_cat_inputs, inductor_realize_reads_threshold

# Reductions Inductor lowers as loops that their pointwise inputs fuse into, and indexed loads
# (gather, index, embedding), whose data input is read element by element inside the loop.
LOOP_OPS = frozenset({"sum", "mean", "amax", "amin", "prod", "var", "var_mean", "std", "argmax", "argmin",
                      "any", "all", "norm", "logsumexp", "gather", "index", "index_select", "embedding"})

# Ops Inductor calls as library kernels (extern_kernels.*): they allocate their output beside their inputs.
EXTERN = frozenset({"mm", "addmm", "bmm", "baddbmm", "addmv", "mv", "dot", "convolution", "convolution_backward",
                    "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                    "_scaled_dot_product_cudnn_attention", "_scaled_mm", "_int_mm"})


# Library kernels whose output Inductor lets a cat place (their `out=` may be a slice of the cat's buffer);
# bmm and convolution outputs are copied into it instead (seen in the generated code, torch 2.13, CPU).
INTO_CAT_EXTERN = frozenset({"mm", "addmm"})


def own_kernel(n: fx.Node) -> bool:
    """Inductor generates this op's loop itself (an ATen or prims op, not a library call, not a random draw),
    so its output may take the buffer of an input that dies in that loop (inplace.py). An op another library
    registers (autoremat's own included) is called as it is, and allocates its own output."""
    t = n.target
    return n.op == "call_function" and isinstance(t, OpOverload) and t.namespace in ("aten", "prims") and \
        t.overloadpacket.__name__ not in EXTERN and torch.Tag.nondeterministic_seeded not in t.tags and \
        isinstance(n.meta.get("val"), torch.Tensor)


# Tensor constructors that write a constant (or the index, iota): Inductor lowers them as pointwise loops.
FILLS = frozenset({"full", "full_like", "new_full", "zeros", "zeros_like", "new_zeros", "ones", "ones_like",
                   "new_ones", "scalar_tensor", "iota"})


def is_pointwise(n: fx.Node) -> bool:
    return n.op == "call_function" and isinstance(n.target, OpOverload) and torch.Tag.pointwise in n.target.tags


def is_fill(n: fx.Node) -> bool:
    return n.op == "call_function" and isinstance(n.target, OpOverload) and \
        n.target.overloadpacket.__name__ in FILLS


def _loop_op(n: fx.Node) -> bool:
    """A node Inductor generates a loop for (it may read a fused producer)."""
    if is_pointwise(n):
        return True
    return n.op == "call_function" and isinstance(n.target, OpOverload) and \
        n.target.overloadpacket.__name__ in LOOP_OPS


def fused_nodes(gm: fx.GraphModule, outputs: set[str], aliases: dict[str, str], banned: set[str]) -> set[str]:
    """Names of the nodes Inductor would not write to memory (module docstring).

    outputs: the joint graph's outputs; aliases: node -> the node owning its storage (views point at
    their base); banned: nodes that may not be recomputed.
    """
    threshold = inductor_realize_reads_threshold()
    viewers = _viewers(gm, aliases)
    fused: set[str] = set()
    for n in gm.graph.nodes:
        if not (is_pointwise(n) or is_fill(n)) or n.name in outputs or n.name in banned or aliases.get(n.name, n.name) != n.name:
            continue
        if not isinstance(n.meta.get("val"), torch.Tensor):
            continue
        views = viewers.get(n.name, [])
        if any(v.name in outputs for v in views):
            continue
        readers = _readers(n, viewers, aliases)
        if not readers or len(readers) > threshold:
            continue
        if all(_loop_op(u) for u in readers):
            fused.add(n.name)
    return fused


def _viewers(gm: fx.GraphModule, aliases: dict[str, str]) -> dict[str, list[fx.Node]]:
    """Node name -> the views of its storage."""
    viewers: dict[str, list[fx.Node]] = {}
    for n in gm.graph.nodes:
        base = aliases.get(n.name, n.name)
        if base != n.name:
            viewers.setdefault(base, []).append(n)
    return viewers


def _readers(n: fx.Node, viewers: dict[str, list[fx.Node]], aliases: dict[str, str]) -> list[fx.Node]:
    """The nodes that read `n`'s value, directly or through a view of it (views themselves left out)."""
    return [u for m in (n, *viewers.get(n.name, [])) for u in m.users if aliases.get(u.name, u.name) != n.name]


def concat_writes(gm: fx.GraphModule, backward: set[str], aliases: dict[str, str],
                  outputs: set[str]) -> tuple[dict[str, str], set[str]]:
    """(backward value -> the cat whose buffer Inductor computes it into, the cats Inductor lowers as a
    ConcatKernel).

    Inductor lowers `aten.cat` on the CPU, and on a GPU over more than
    `torch._inductor.config.max_pointwise_cat_inputs` inputs, as one buffer that its inputs are
    realized into (torch/_inductor/lowering.py `cat`, ir.py `ConcatKernel.realize_into`). An input is
    computed into its slice, owning no buffer, when its buffer's layout is still Inductor's to choose:
    it is computed in this graph by a kernel Inductor generates or by an mm/addmm, is no view, no graph
    output and has no other reader (which may fix its layout first). Any other input (a saved value, a
    view, a bmm or convolution output, a getitem of a library call) keeps its buffer and is copied in
    at the cat. Either way the cat writes into no input's buffer (it is never `inplace`).

    Only backward cats (a split's or chunk's gradient) are followed into: a forward cat's inputs can
    be saved or recomputed apart from it, and the memory model keeps their buffers their own.
    """
    limit = inductor_max_pointwise_cat_inputs()
    into: dict[str, str] = {}
    cats: set[str] = set()
    for n in gm.graph.nodes:
        if n.op != "call_function" or n.target is not torch.ops.aten.cat.default:
            continue
        val, parts = n.meta.get("val"), n.args[0]
        if not isinstance(val, torch.Tensor) or not isinstance(parts, (list, tuple)):
            continue
        if val.device.type == "cpu" and val.dtype in (torch.int8, torch.uint8):
            continue  # Inductor falls back to aten's cat for these
        if val.device.type != "cpu" and len(parts) <= limit:
            continue  # on a GPU it may be one pointwise kernel reading its inputs (not modelled: not measured)
        cats.add(n.name)
        if n.name not in backward:
            continue
        for a in parts:
            if not isinstance(a, fx.Node) or a.name not in backward or a.name in outputs or parts.count(a) != 1:
                continue
            v = a.meta.get("val")
            if not isinstance(v, torch.Tensor) or v.dtype != val.dtype or v.numel() == 0:
                continue
            if aliases.get(a.name, a.name) != a.name or len(a.users) != 1:
                continue
            extern = isinstance(a.target, OpOverload) and a.target.overloadpacket.__name__ in INTO_CAT_EXTERN
            if extern or own_kernel(a):
                into[a.name] = n.name
    return into, cats


# Reductions whose result Inductor may compute inside the kernel that consumes it (below).
_REDUCTIONS = frozenset({"sum", "mean", "amax", "amin", "prod"})


def epilogue_reductions(gm: fx.GraphModule, fused: set[str], backward: set[str], aliases: dict[str, str],
                        outputs: set[str]) -> set[str]:
    """Backward reductions that Inductor computes inside the kernel their result feeds, not where the graph
    runs them.

    A pointwise kernel of a reduction's output size that reads it (directly, or through fused pointwise
    nodes) takes the reduction into its own loop, and so does every other reduction of that size it reads:
    one kernel, run once the last of their inputs exists. Where fused adds sum several reductions (the bias
    gradient of a projection applied chunk by chunk, or of a weight used twice), each reduction's input
    then lives until that kernel runs, not until the reduction's place in the graph: a biased output head over
    k loss chunks holds every chunk's logits gradient until its bias gradient's one kernel
    (tests/test_fusion.py's `test_reductions_summed_by_fused_adds_run_in_the_kernel_that_adds_them`).

    fused: `fused_nodes`' answer; backward: the backward nodes; aliases: node -> the node owning its storage.
    """
    views = _viewers(gm, aliases)

    def kernels(n: fx.Node, seen: set[str]) -> list[fx.Node] | None:
        """The kernels `n`'s value reaches through fused nodes, or None if it is read any other way."""
        found: list[fx.Node] = []
        for u in _readers(n, views, aliases):
            if u.name in seen:
                continue
            seen.add(u.name)
            if u.name in fused:
                more = kernels(u, seen)
                if more is None:
                    return None
                found += more
            elif is_pointwise(u):
                found.append(u)
            else:
                return None
        return found

    out: set[str] = set()
    for n in gm.graph.nodes:
        if n.name not in backward or n.name in outputs or n.name in fused or aliases.get(n.name, n.name) != n.name:
            continue
        if not (isinstance(n.target, OpOverload) and n.target.overloadpacket.__name__ in _REDUCTIONS):
            continue
        val = n.meta.get("val")
        if not isinstance(val, torch.Tensor) or any(v.name in outputs for v in views.get(n.name, [])):
            continue
        found = kernels(n, set())
        if found and all(isinstance(k.meta.get("val"), torch.Tensor) and k.meta["val"].numel() == val.numel()
                         for k in found):
            out.add(n.name)
    return out
