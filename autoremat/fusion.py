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
"""

from __future__ import annotations

import torch
import torch.fx as fx

from autoremat.torch_internals import OpOverload, inductor_realize_reads_threshold

# Reductions Inductor lowers as loops that their pointwise inputs fuse into, and indexed loads
# (gather, index, embedding), whose data input is read element by element inside the loop.
LOOP_OPS = frozenset({"sum", "mean", "amax", "amin", "prod", "var", "var_mean", "std", "argmax", "argmin",
                      "any", "all", "norm", "logsumexp", "gather", "index", "index_select", "embedding"})

# Ops Inductor calls as library kernels (extern_kernels.*): they allocate their output beside their inputs.
EXTERN = frozenset({"mm", "addmm", "bmm", "baddbmm", "addmv", "mv", "dot", "convolution", "convolution_backward",
                    "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                    "_scaled_dot_product_cudnn_attention", "_scaled_mm", "_int_mm"})


def own_kernel(n: fx.Node) -> bool:
    """Inductor generates this op's loop itself (not a library call, not a random draw), so its output may
    take the buffer of an input that dies in that loop (inplace.py)."""
    t = n.target
    return n.op == "call_function" and isinstance(t, OpOverload) and t.overloadpacket.__name__ not in EXTERN and \
        torch.Tag.nondeterministic_seeded not in t.tags and isinstance(n.meta.get("val"), torch.Tensor)


def is_pointwise(n: fx.Node) -> bool:
    return n.op == "call_function" and isinstance(n.target, OpOverload) and torch.Tag.pointwise in n.target.tags


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
    viewers: dict[str, list[fx.Node]] = {}
    for n in gm.graph.nodes:
        base = aliases.get(n.name, n.name)
        if base != n.name:
            viewers.setdefault(base, []).append(n)
    fused: set[str] = set()
    for n in gm.graph.nodes:
        if not is_pointwise(n) or n.name in outputs or n.name in banned or aliases.get(n.name, n.name) != n.name:
            continue
        if not isinstance(n.meta.get("val"), torch.Tensor):
            continue
        views = viewers.get(n.name, [])
        if any(v.name in outputs for v in views):
            continue
        readers = [u for m in (n, *views) for u in m.users if aliases.get(u.name, u.name) != n.name]
        if not readers or len(readers) > threshold:
            continue
        if all(_loop_op(u) for u in readers):
            fused.add(n.name)
    return fused


