"""Regions: one dynamo graph cut into a graph per repeated block, so gradients leave the backward early.

A compiled graph is one autograd node: its backward returns every parameter gradient at its end,
and only then does autograd add them into `.grad`. For a whole model that means a second full set
of gradients alive on top of the `.grad` buffers, where eager adds each gradient as it is computed
(at a small batch this set dwarfs the activations). Cut into one graph per repeated block (a transformer layer, a
residual stage), each block's backward returns its own gradients as soon as it finishes, and
autograd accumulates them there, through its own AccumulateGrad nodes: post-accumulate-grad hooks,
DDP's reducer and FSDP2 see every gradient as they do in eager mode. Inside a region, each weight
gradient is handed to that same AccumulateGrad node as soon as it is computed (`release_gradients`),
so not even one block's gradients are alive together.

The cut is made on the dynamo graph, before AOTAutograd traces it (the way torch's DDPOptimizer
cuts graphs into gradient buckets): nodes are grouped by the repeated block their nn.Module belongs
to (`block_of` below), in graph order, with whatever runs before the first block (embeddings) and
after the last (final norm, head, loss) as regions of their own. Each region is then compiled by
AOTAutograd on its own and reaches the planner as one more graph of the step; the planner already
plans the graphs of a step jointly under one budget.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Callable, Container
from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch.fx.passes.split_module import split_module

from autoremat.torch_internals import (
    WeakIdKeyDictionary,
    accumulate_into_grad,
    compile_submodules,
    copy_split_metadata,
    ddp_optimizer_active,
    engine_will_run,
    gradient_node,
    graph_task_id,
    is_primal,
)


def block_of(module: str) -> str:
    """The repeated block a module path belongs to: "transformer.h.3.attn.c_attn" -> "transformer.h.3"."""
    parts = module.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return ""


_ROOT = re.compile(r"^L(\[[^\]]*\])+")
LINKS = "autoremat_links"  # the key of a region's `RegionLinks` in its GraphModule's meta
MIN_BLOCKS = 2  # below this there is nothing to gain: one region is the whole graph


def module_path(node: fx.Node) -> str:
    """The innermost nn.Module path a dynamo graph node was traced in ("" at the top level)."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    # Dynamo spells a path from the frame's local that holds the model: "L['self'].h[3].attn", or
    # "L['args'][0].model.layers[0]" when a decorator wraps the forward (HF's Llama). Drop that
    # root, keep the Python form: "h.3.attn".
    path = _ROOT.sub("", path).lstrip(".")
    return path.replace("[", ".").replace("]", "").replace("'", "")


def partition(gm: fx.GraphModule) -> dict[fx.Node, int] | None:
    """Region index per computing node, non-decreasing in graph order; None if fewer than two blocks.

    A region starts where a repeated block not seen before starts. Nodes outside every block join
    the region they follow, except those after the last block's last node: they form the tail.
    """
    compute = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output", "get_attr")]
    blocks = [block_of(module_path(n)) for n in compute]
    if len({b for b in blocks if b}) < MIN_BLOCKS:
        return None
    last = max(i for i, b in enumerate(blocks) if b)
    region, seen, current = {}, set(), None
    index = 0
    for i, (n, b) in enumerate(zip(compute, blocks)):
        if i > last and current != "":  # the tail: head, loss, outputs
            current, index = "", index + 1
        elif b and b not in seen:
            seen.add(b)
            if current is not None:
                index += 1
            current = b
        elif current is None:
            current = ""
        region[n] = index
    return region


def compile_regions(gm: fx.GraphModule, example_inputs: list, compile_one: Callable) -> Callable:
    """Compile `gm` as one graph per region with `compile_one` (an AOTAutograd backend), or whole."""
    region = partition(gm)
    if region is None or ddp_optimizer_active():
        # DDP's own graph splitter (torch._dynamo.config.optimize_ddp) has already cut this graph into
        # gradient buckets, which hands gradients over bucket by bucket: cutting again would break it.
        return compile_one(gm, example_inputs)
    cut = split_module(gm, None, lambda n: region[n], keep_original_order=True)
    copy_split_metadata(gm, cut)
    _link(cut)
    # The interpreter runs the cut graph on fake inputs, compiling each region as it reaches it
    # (with the outputs of the regions before it as example inputs) and swapping it in.
    compile_submodules(cut, compile_one, example_inputs)
    cut.recompile()
    return cut


@dataclass
class RegionLinks:
    """How one region's inputs and outputs connect to the other regions of its dynamo graph.

    A value one region hands the next lives only as long as a region still needs it: the memory
    model frees it there instead of holding it to the end of the step, as it must a user's output.
    """

    position: int  # this region's place among the regions of its dynamo graph
    sources: list[tuple[int, int] | None]  # per input: (producing region's position, its output index)
    outputs: int  # how many values this region returns
    exported: set[int]  # indices of the outputs the dynamo graph itself returns (the user sees them)
    # inputs another region reads too (tied weights; a region's output two later regions read): index ->
    # the input's name in the dynamo graph, the same in every region that reads it
    shared: dict[int, str] = field(default_factory=dict)


def _link(cut: fx.GraphModule) -> None:
    calls = [n for n in cut.graph.nodes if n.op == "call_module"]
    position = {n: i for i, n in enumerate(calls)}
    produced: dict[fx.Node, tuple[int, int]] = {}
    for n in cut.graph.nodes:
        if n.op == "call_function" and n.target is operator.getitem and n.args[0] in position:
            produced[n] = (position[n.args[0]], n.args[1])
    for call in calls:  # a region with one output returns it bare, not in a tuple
        if not any(u in produced for u in call.users):
            produced[call] = (position[call], 0)
    returned = {produced[a] for a in cut.graph.find_nodes(op="output")[0].all_input_nodes if a in produced}
    # A value several regions read: a tied weight (a placeholder), or a region's output that more than
    # one later region reads (a residual stream crossing a region's end). Its gradients meet in autograd.
    readers = {v: sum(u in position for u in v.users) for v in [*cut.graph.find_nodes(op="placeholder"), *produced]}
    for call in calls:
        sub = getattr(cut, str(call.target))
        sub.meta = dict(sub.meta)  # copy_split_metadata gave every region the one dict of the whole graph
        outputs = max([o for (r, o) in produced.values() if r == position[call]], default=-1) + 1
        sub.meta[LINKS] = RegionLinks(position[call], [produced.get(a) for a in call.args], outputs,
                                      {o for (r, o) in returned if r == position[call]},
                                      {i: a.name for i, a in enumerate(call.args) if readers.get(a, 0) > 1})


def region_key(gm: fx.GraphModule, example_inputs: list) -> tuple | None:
    """What AOTAutograd's trace of a region depends on, with its block's names left out: its ops and their
    wiring, its inputs' shapes, strides, dtypes and kinds, and how it links to the other regions.

    Two blocks of a ModuleList with one class have equal keys, so the second is traced to the same joint
    graph as the first and can reuse it (planning/same_regions.py). None for a region that reads an
    attribute or calls a module by name: those name the block itself.
    """
    links: RegionLinks | None = gm.meta.get(LINKS)
    if links is None:
        return None
    position: dict[fx.Node, int] = {}
    ops = []
    for i, n in enumerate(gm.graph.nodes):
        if n.op in ("call_module", "get_attr"):
            return None
        position[n] = i
        wiring = fx.node.map_arg((n.args, n.kwargs), lambda a: _At(position[a]))
        ops.append((n.op, None if n.op == "placeholder" else n.target, _hashable(wiring)))
    inputs = tuple(_input_key(t) for t in example_inputs)
    return (tuple(ops), inputs, links.outputs, tuple(sorted(links.exported)), tuple(sorted(links.shared.items())),
            tuple(s is None for s in links.sources))


@dataclass(frozen=True)
class _At:
    """A node's input, by its position in the region's graph."""

    index: int


def _hashable(x: object) -> object:
    if isinstance(x, (tuple, list)):
        return (type(x).__name__, *map(_hashable, x))
    if isinstance(x, dict):
        return ("dict", *((k, _hashable(v)) for k, v in x.items()))
    if isinstance(x, slice):
        return ("slice", _hashable(x.start), _hashable(x.stop), _hashable(x.step))
    try:
        hash(x)
    except TypeError:
        return ("repr", repr(x))
    return x


def _input_key(t: object) -> object:
    if not isinstance(t, torch.Tensor):
        return ("value", _hashable(t))
    return (tuple(t.shape), tuple(t.stride()), t.dtype, t.device.type, t.requires_grad,
            isinstance(t, torch.nn.Parameter), getattr(t, "_dynamo_static_input_type", None))


# --------------------------------------------------------------------------------------------
# gradients that leave a region's backward as soon as they are computed

# A parameter's detached stand-in, passed to a region's compiled step -> the parameter itself.
_OWNER: WeakIdKeyDictionary = WeakIdKeyDictionary()
# The backward running now, and for each region's anchor (by id) whether it accumulates into .grad:
# every accumulate_grad of a region asks about the same anchor, and the answer holds for a whole
# backward, so it is asked once per backward (the map is dropped when the next backward asks).
_accumulating_in: tuple[int, dict[int, bool]] = (-1, {})


@torch.fx.node.has_side_effect
def accumulate_grad(stand_in: torch.Tensor, grad: torch.Tensor, anchor: torch.Tensor) -> None:
    """Give one parameter's gradient to autograd now, in the middle of a region's backward.

    The autograd engine runs the parameter's own AccumulateGrad node (re-entrantly, as reentrant
    checkpointing does; `torch_internals.accumulate_into_grad`): `.grad` is added to in place, and
    tensor hooks, post-accumulate-grad hooks and node hooks (DDP's reducer) fire as in eager mode.
    The region then returns no gradient for the parameter: it was given its stand-in, which has no
    autograd edge, so AccumulateGrad runs once per backward.

    Only when this backward accumulates into `.grad` at all: `anchor`, a parameter of the region
    that kept its edge, says so (its AccumulateGrad runs in this backward). Under
    `torch.autograd.grad(out, inputs)` or `backward(inputs=...)` without the parameters, the
    gradient is dropped, as autograd would drop it, and `.grad` is left alone. Under
    `torch.autograd.grad` with respect to the parameters this region's gradients would never reach
    it (they have no edge): a clear error, not a silently missing gradient.
    """
    if _accumulating(anchor):
        accumulate_into_grad(_OWNER[stand_in], grad)


def _accumulating(anchor: torch.Tensor) -> bool:
    """Whether the running backward accumulates into `anchor`'s `.grad`, asked once per backward."""
    global _accumulating_in
    task = graph_task_id()
    if _accumulating_in[0] != task:
        _accumulating_in = (task, {})
    known = _accumulating_in[1]
    if id(anchor) not in known:
        try:
            known[id(anchor)] = engine_will_run(gradient_node(anchor))
        except RuntimeError as e:  # torch refuses the question while autograd.grad captures this parameter
            raise RuntimeError(
                "autoremat hands parameter gradients to .grad as soon as they are computed, so torch.autograd.grad "
                "cannot return them; optimize(..., release_grads=False) returns them as autograd does (each "
                "block's gradients are then alive together at the end of its backward)") from e
    return known[id(anchor)]


def release_gradients(joint: fx.GraphModule, num_fwd_outputs: int, static: set[int], shared: Container[int]) -> list[int]:
    """Rewrite a region's joint graph so that each parameter gradient leaves as soon as it exists.

    A compiled region's backward returns its gradients when it ends, so all of one block's weight
    gradients are alive together at its end (3 MiB for a d=256 transformer block, 800 MB for a 7B
    layer) where eager mode accumulates each as soon as it is computed. After the rewrite, an
    `accumulate_grad` node follows each parameter's gradient and the graph returns None for it;
    the memory model sees the gradient die there. Returns the primal indices rewritten: the
    caller passes stand-ins for those parameters (`with_stand_ins`).

    Left as they are: parameters another region reads too (a tied embedding: eager mode sums its
    gradients before one AccumulateGrad, and so must we); and the region's smallest parameter, the
    anchor: it keeps its autograd edge, so that autograd differentiates the region even when no
    other input needs a gradient (the first block: its input is data), and so that `accumulate_grad`
    can tell whether this backward accumulates into `.grad`.
    """
    primals = [n for n in joint.graph.find_nodes(op="placeholder") if is_primal(n)]
    out = joint.graph.find_nodes(op="output")[0]
    outs = list(out.args[0])
    grads = outs[num_fwd_outputs:]
    if len(grads) != len(primals):
        return []
    released = [i for i, g in enumerate(grads) if isinstance(g, fx.Node) and i in static and i not in shared]
    anchor = min(released, key=lambda i: primals[i].meta["val"].numel(), default=None)
    released = [i for i in released if i != anchor]
    for i in released:
        with joint.graph.inserting_after(grads[i]):
            node = joint.graph.call_function(accumulate_grad, (primals[i], grads[i], primals[anchor]))
        node.meta["val"] = None
        outs[num_fwd_outputs + i] = None
    out.args = (tuple(outs),)
    _weight_gradients_first(joint)
    joint.graph.lint()
    joint.recompile()
    return released


def _weight_gradients_first(joint: fx.GraphModule) -> None:
    """Compute each released weight gradient as soon as its inputs exist, and hand it over at once.

    Autograd's formula for a linear layer computes the input's gradient first, then the weight's, so
    the input gradient (d_in x tokens: the 4x-wide MLP's is the largest tensor of a block's backward)
    is alive while the weight gradient reads the activation. Nothing orders the two: with the weight
    gradient first, the activation it reads (saved or recomputed) can die before the input gradient
    is allocated. The nodes moved are those only the gradient needs (its matmul, a transpose, a bias
    gradient's sum); each goes right after the latest of its inputs, in graph order.
    """
    order = {n: i for i, n in enumerate(joint.graph.nodes)}
    for acc in [n for n in joint.graph.nodes if n.op == "call_function" and n.target is accumulate_grad]:
        own = {acc}
        todo = [acc.args[1]]
        while todo:
            n = todo.pop()
            if n.op != "call_function" or n in own or not all(u in own for u in n.users):
                continue
            own.add(n)
            todo.extend(n.all_input_nodes)
        for n in sorted(own, key=order.__getitem__):
            after = max(n.all_input_nodes, key=order.__getitem__, default=None)
            if after is not None and order[after] + 1 < order[n]:
                after.append(n)
                order = {n: i for i, n in enumerate(joint.graph.nodes)}


def with_stand_ins(compiled: Callable, released: list[int]) -> Callable:
    """`compiled` (a region rewritten by `release_gradients`) called with a detached stand-in for each
    released parameter, so that its gradient reaches the parameter only through `accumulate_grad`."""
    def run(*args: object) -> object:
        if torch.is_grad_enabled():
            args = list(args)
            for i in released:
                param = args[i]
                if isinstance(param, torch.Tensor) and param.requires_grad:
                    stand_in = param.detach()
                    _OWNER[stand_in] = param
                    args[i] = stand_in
        return compiled(*args)

    return run
