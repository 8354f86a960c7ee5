"""The dtype rewrite: run chosen calls of a dynamo graph in bf16 or fp16 (precision="bf16"/"fp16"/"auto").

`apply_dtypes(gm, dtypes)` casts the inputs of the chosen calls, lets the low dtype flow through the
ops that follow (type promotion decides, as in eager), and casts back to fp32 in front of every
`FP32_KEPT` call. An attention call run in 16 bits becomes `passes.fused_attention.fused_attention`:
one fused kernel that keeps its output and a logsumexp and recomputes the scores in its backward, as
GPU flash kernels do (with dropout, `passes.attention.attention_16bit`: 16-bit scores and probabilities). It is applied to each dynamo graph before AOTAutograd traces it (precision_plan.pre_pass),
so the joint graph, its profile and its plan see the 16-bit values.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.fx as fx
import torch.nn.functional as F

from autoremat.passes.fused_attention import fused_attention
from autoremat.passes.op_kinds import FP32_KEPT, LOW, call_name, is_float, is_matmul, traced_value

_INHERITED = ("nn_module_stack", "stack_trace", "source_fn_stack")


def apply_dtypes(gm: fx.GraphModule, dtypes: dict[str, str], fp32_ops: Iterable[str] = FP32_KEPT) -> int:
    """Rewrite `gm` so that each call named in `dtypes` computes in that dtype ("bf16"/"fp16").

    Its floating inputs are cast, its output stays in the low dtype, later calls follow type
    promotion, and every input of an `fp32_ops` call (or of a matmul left in fp32) that may be low
    is cast back to fp32 first.
    Returns the number of casts inserted.
    """
    low = {name: LOW[d] for name, d in dtypes.items() if d in LOW}
    if not low:
        return 0
    kept = set(fp32_ops)
    graph = gm.graph
    maybe_low: set[fx.Node] = set()
    casts = 0

    def cast(node: fx.Node, arg, dtype: torch.dtype):
        nonlocal casts
        if not isinstance(arg, fx.Node) or not (is_float(traced_value(arg)) or arg in maybe_low):
            return arg
        with graph.inserting_before(node):
            casts += 1
            new = graph.call_method("to", (arg, dtype))
        # The cast belongs to the call it feeds: same module path, so the region cut, checkpointing
        # and the plan's per-module table put it beside that call (a cast without one looked like a
        # value crossing blocks, and checkpointing saved every cast).
        for key in _INHERITED:
            if key in node.meta:
                new.meta[key] = node.meta[key]
        return new

    def recast(node: fx.Node, dtype: torch.dtype, only_low: bool) -> None:
        def one(a):
            return cast(node, a, dtype) if not only_low or a in maybe_low else a

        node.args = fx.node.map_arg(node.args, one)
        node.kwargs = fx.node.map_arg(node.kwargs, one)

    for node in list(graph.nodes):
        if node.op not in ("call_function", "call_method"):
            continue
        if node.name in low:
            recast(node, low[node.name], only_low=False)
            maybe_low.add(node)
            if node.target is F.scaled_dot_product_attention:
                node.target = fused_attention  # not the math fallback's fp32 interior (passes/fused_attention.py)
        elif call_name(node) in kept or is_matmul(node):
            # fp32 calls; matmuls do not promote mixed dtypes, so a fp32 one gets fp32 inputs too
            recast(node, torch.float32, only_low=True)
        elif any(a in maybe_low for a in node.all_input_nodes):
            maybe_low.add(node)  # may be low: type promotion decides at run time
    graph.lint()
    gm.recompile()
    return casts
