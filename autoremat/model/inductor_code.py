"""What Inductor's generated code allocates that a joint graph does not show, marked on a graph's profile.

A fused node allocates nothing and costs its arithmetic only (fusion.py); a backward kernel may write
into a dying input (inplace.py); a backward cat's inputs may be computed into its buffer
(`fusion.concat_writes`); an attention kernel's expanded mask may be copied densely (`sdpa_dense_copies`).
`profile.profile_graph` calls `mark_inductor_code` for a graph Inductor will compile.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from autoremat.model.devices import DeviceSpec
from autoremat.model.fusion import concat_writes, epilogue_reductions, fused_nodes, own_kernel
from autoremat.model.graph_profile import NodeProfile

_aten = torch.ops.aten
# The attention kernels Inductor runs as fallbacks under `sdpa_constraint` (torch/_inductor/lowering.py, torch 2.11
# to 2.13), and for each the argument position of the attention mask (bias) that CUDA's efficient forward keeps
# expanded.
SDPA_CONSTRAINED = {
    _aten._scaled_dot_product_efficient_attention.default, _aten._scaled_dot_product_efficient_attention_backward.default,
    _aten._scaled_dot_product_flash_attention.default, _aten._scaled_dot_product_flash_attention_backward.default,
    _aten._scaled_dot_product_cudnn_attention.default, _aten._scaled_dot_product_cudnn_attention_backward.default,
    _aten._scaled_dot_product_flash_attention_for_cpu.default,
    _aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
}
_KEPT_EXPANDED = (_aten._scaled_dot_product_efficient_attention.default, 3)


def _expanded(val: object) -> bool:
    """A view that repeats elements (a zero stride on a dimension of size > 1): an attention mask broadcast to
    every head, as CUDA's SDPA hands its kernels one (attention.cpp preprocess_mask)."""
    return isinstance(val, torch.Tensor) and any(st == 0 and sz > 1 for st, sz in zip(val.stride(), val.shape))


def sdpa_dense_copies(gm: fx.GraphModule, nodes: dict[str, NodeProfile], dev: DeviceSpec) -> None:
    """An expanded argument of an attention kernel under Inductor: copied densely, or kept as a view only when
    its base is a buffer of its own.

    Inductor's `sdpa_constraint` gives the kernel its arguments in a dense layout. On a CPU it copies every
    expanded one: an additive mask broadcast over the heads becomes a dense copy, one per head, that the plan
    must count. On CUDA it keeps the efficient forward's mask expanded, and any other expanded argument
    whose base is a realized buffer (a value the forward handed over, an input: a view with strides), but copies
    one whose base is computed in the same kernel graph: a mask recomputed in the backward (its `where`) reached
    the efficient backward as a dense (batch, heads, seq, seq) fp32 copy, the size of a whole attention matrix
    (tests/test_fusion.py::test_on_cuda_inductor_keeps_an_expanded_masks_base_saved_so_no_copy_is_made).
    So: on a CPU the copy is the kernel's scratch; on CUDA the base is never recomputed (the plan saves it, the
    backward reads a buffer, and no copy is made)."""
    for n in gm.graph.nodes:
        if n.op != "call_function" or n.target not in SDPA_CONSTRAINED or n.name not in nodes:
            continue
        for i, a in enumerate([*n.args, *n.kwargs.values()]):
            val = a.meta.get("val") if isinstance(a, fx.Node) else None
            if not _expanded(val):
                continue
            on_cuda = val.device.type == "cuda" or (val.device.type == "meta" and dev.kind == "cuda")
            if not on_cuda:
                nodes[n.name].transient_bytes += val.numel() * val.element_size()
            elif (n.target, i) != _KEPT_EXPANDED:
                root = nodes[a.name].storage or a.name
                if root in nodes and nodes[root].kind == "forward" and not nodes[root].recompute_ban:
                    nodes[root].recompute_ban = ("Inductor would copy its view expanded for an attention kernel "
                                                 "densely if it were recomputed (sdpa_constraint): saved instead")


def mark_inductor_code(gm: fx.GraphModule, nodes: dict[str, NodeProfile], dev: DeviceSpec, outputs: set[str]) -> None:
    """What Inductor's code does that the graph does not show: a fused node allocates nothing and costs its
    arithmetic only; a backward kernel may write into a dying input (inplace.py); a backward cat's inputs
    may be computed into its buffer (fusion.concat_writes)."""
    sdpa_dense_copies(gm, nodes, dev)
    aliases = {name: p.storage for name, p in nodes.items() if p.storage}
    banned = {name for name, p in nodes.items() if p.recompute_ban}
    fused = fused_nodes(gm, outputs, aliases, banned)
    for name in fused:
        p = nodes[name]
        p.fused, p.nbytes = True, 0
        p.time_s = dev.fused_op_time(p.flops, dtype={"bfloat16": "bf16", "float16": "fp16"}.get(p.dtype, "fp32"))
    backward = {name for name, p in nodes.items() if p.kind == "backward"}
    # A reduction taken into the kernel it feeds still reads its input from memory: it keeps its time.
    graph_nodes = {n.name: n for n in gm.graph.nodes}
    for name in epilogue_reductions(gm, fused, backward, aliases, outputs):
        nodes[name].fused, nodes[name].nbytes = True, 0
        fused.add(name)
        nodes[name].inputs += _producer_reads(name, nodes, graph_nodes, fused)
    for n in gm.graph.nodes:
        if n.name in nodes:
            p = nodes[n.name]
            p.inplace = p.kind == "backward" and n.name not in fused and p.storage == n.name and own_kernel(n)
    into, cats = concat_writes(gm, backward, aliases, outputs)
    for name, cat in into.items():
        nodes[name].into = cat
    for cat in cats:
        nodes[cat].inplace = False  # its buffer exists before it runs: no input's to take


def _producer_reads(reduction: str, nodes: dict[str, NodeProfile], graph_nodes: dict[str, fx.Node],
                    fused: set[str]) -> tuple[str, ...]:
    """The buffers the kernels producing a reduction's inputs read, where that reduction runs in the kernel its
    sum feeds (fusion.epilogue_reductions): Inductor takes those producers into that kernel too, so what they
    read lives until it runs: a biased head over loss chunks can compute several chunks' logits gradients, with
    the scatter buffers of their targets, in the kernel that adds up the bias gradient, all alive at once
    (benchmarks/inductor_buffers.py bert lists those buffers against the model). Only buffers the backward computes (a saved forward value is
    held by the plan, not by this kernel), and only producers Inductor generates (an extern kernel runs
    where the graph has it). Inductor does not always take them in (it may run each chunk's kernel on its own, below
    the prediction): the model errs on the safe side."""
    own = nodes[reduction].inputs
    reads: dict[str, None] = {}  # in order, once each
    for v in own:
        owner = nodes[v].storage or v
        if owner not in graph_nodes or owner in fused or nodes[owner].kind != "backward" \
                or not own_kernel(graph_nodes[owner]):
            continue
        reads.update(dict.fromkeys(i for i in nodes[owner].inputs if i not in own and i not in fused
                                   and nodes[i].kind == "backward" and nodes[i].storage))
    return tuple(reads)
