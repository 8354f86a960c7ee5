"""A weight's 16-bit copy, cast again for the backward instead of held from the forward.

Under precision="bf16"/"fp16"/"auto" a linear layer reads `W.to(bf16)`. AOTAutograd's joint graph has one
cast node for it, read by the forward matmul and (through a transpose) by the backward's input-gradient
matmul. A plan that recomputes a block in its backward then recomputes that cast once, for the forward
matmul that rebuilds the activations, and holds the copy until its backward use, late in the block's
backward: at a small batch, every weight copy of the layer is alive at the peak, next to the activations
(benchmarks/precision_live_at_peak.py lists what is live at a 16-bit floor's peak).

`split_weight_casts(joint)` gives the backward its own cast of the same parameter (and its own views of
it). Both casts compute the same values from the same fp32 master weight, so the step's results do not
change. The duplicate is a forward-side value that only the backward reads: the plan saves it (held from
the forward, one more cast in the forward) or recomputes it right before its first backward use (one cast
in the backward), and the forward's copy dies after the forward matmul.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.fx as fx

from autoremat.passes.joint import backward_side
from autoremat.torch_internals import OpOverload, detect_fake_mode, is_primal

_CAST = torch.ops.aten._to_copy.default
_LOW = (torch.bfloat16, torch.float16)


def _is_view(n: fx.Node) -> bool:
    return n.op == "call_function" and isinstance(n.target, OpOverload) and n.target.is_view


def _fresh_value(n: fx.Node) -> torch.Tensor:
    """The node's value computed again from its inputs' traced values (fake or meta tensors): a new
    allocation for a cast, a view of that allocation for a view."""
    args = fx.node.map_arg(n.args, lambda a: a.meta["val"])
    kwargs = fx.node.map_arg(n.kwargs, lambda a: a.meta["val"])
    mode = detect_fake_mode([a.meta.get("val") for a in n.all_input_nodes])
    with mode if mode is not None else contextlib.nullcontext():
        return n.target(*args, **kwargs)


def _swapped(copies: dict[fx.Node, fx.Node], a: fx.Node) -> fx.Node:
    return copies.get(a, a)


def split_weight_casts(joint: fx.GraphModule) -> int:
    """Rewrite `joint` so that every 16-bit cast of a primal read by the backward has a backward-only
    duplicate (module docstring). Returns the number of casts duplicated."""
    graph = joint.graph
    backward = backward_side(graph)
    order = {n: i for i, n in enumerate(graph.nodes)}
    done = 0
    for cast in list(graph.nodes):
        if not (cast.target is _CAST and cast not in backward and cast.args and isinstance(cast.args[0], fx.Node)
                and is_primal(cast.args[0]) and cast.kwargs.get("dtype") in _LOW):
            continue
        # The cast and its forward-side views: what a backward reader may reach it through.
        chain, stack = [], [cast]
        while stack:
            v = stack.pop()
            chain.append(v)
            stack.extend(u for u in v.users if u not in backward and _is_view(u))
        readers = sorted({u for v in chain for u in v.users if u in backward}, key=order.__getitem__)
        if not readers or not any(u not in backward for v in chain for u in v.users if u not in chain):
            continue  # the backward alone reads it: nothing is held on the forward's behalf
        copies: dict[fx.Node, fx.Node] = {}
        swap = functools.partial(_swapped, copies)  # node -> its copy; other arguments as they are
        # Among the forward's nodes (PyTorch's partitioner takes what precedes the backward for forward),
        # right after the original: where in the joint it sits does not matter to the plan (a value only
        # the backward reads runs where its inputs exist, or is recomputed before its first reader).
        place = cast
        for v in sorted(chain, key=order.__getitem__):  # a view after what it views
            with graph.inserting_after(place):
                new = graph.node_copy(v, swap)
            new.meta = dict(v.meta)
            new.meta["val"] = _fresh_value(new)  # its own storage: the profile must not take it for an alias
            copies[v] = place = new
        for r in readers:
            r.args = fx.node.map_arg(r.args, swap)
            r.kwargs = fx.node.map_arg(r.kwargs, swap)
        for v in sorted(chain, key=order.__getitem__, reverse=True):  # the copy's views nobody reads
            if v is not cast and not copies[v].users:
                graph.erase_node(copies[v])
        done += 1
    if done:
        graph.lint()
        joint.recompile()
    return done
