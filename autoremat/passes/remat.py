"""Graph passes that carry out a plan: split the joint graph into forward and backward modules.

The forward returns the user's outputs followed by the saved values; the backward takes the saved
values and the tangents and recomputes the rest just before first use. The node orders are
exactly `Schedule.forward` and `Schedule.backward`, the order the memory model simulated.
"""

from __future__ import annotations

import operator
from typing import Protocol

import torch
import torch.fx as fx

from autoremat.passes.fused_linear_loss import write_gradient_into_h
from autoremat.passes.recompute_names import base as again_base
from autoremat.passes.reuse import dying_inputs, write_into_dying
from autoremat.passes.rng_replay import forward_draws_once
from autoremat.torch_internals import extract_fwd_bwd_modules, is_primal, is_sym_node


# What `split` reads of the capture's graph and of the plan's order, named here as protocols: the passes
# import no pipeline stage, not even for annotations (capture imports the passes, and the model's profile
# imports this module), so the stages' own classes satisfy these by their fields.
class JointGraph(Protocol):
    """A captured joint graph (capture/captured.py's `CapturedGraph`)."""

    joint: fx.GraphModule
    num_fwd_outputs: int
    static_input_indices: list[int]
    compiler: str


class Order(Protocol):
    """The order a plan runs a graph in (model/schedule.py's `Schedule`)."""

    forward: list[str]
    backward: list[str]
    saved: list[str]
    written: dict[str, str]


def split(cg: JointGraph, schedule: Order) -> tuple[fx.GraphModule, fx.GraphModule]:
    """Forward and backward GraphModules that save `schedule.saved` and recompute the rest."""
    joint = cg.joint
    by_name = {n.name: n for n in joint.graph.nodes}
    primals = [n for n in joint.graph.nodes if is_primal(n)]
    # Every primal is offered to the backward (parameters and inputs are alive anyway, and a
    # recomputed op may read them); the ones the backward does not read are pruned.
    saved = primals + [by_name[n] for n in schedule.saved]
    saved_sym = [n for n in saved if is_sym_node(n)]
    saved = [n for n in saved if not is_sym_node(n)]
    static = {primals[i] for i in cg.static_input_indices if i < len(primals)}
    fw, bw = extract_fwd_bwd_modules(joint, saved, saved_sym, num_fwd_outputs=cg.num_fwd_outputs,
                                     static_lifetime_input_nodes=static)
    fw, bw = reorder(fw, schedule.forward, "forward"), reorder(bw, schedule.backward, "backward")
    batch_norm_without_running_stats(fw, bw, cg.num_fwd_outputs)
    forward_draws_once(fw)
    if cg.compiler != "inductor":  # as the profile assumed (profile.py): Inductor reuses buffers itself
        # recomputed forward values written into a dying recomputed input (autoremat/model/recomputed_writes.py),
        # backward values into a dying backward input (reuse.py)
        write_into_dying(bw, {**schedule.written, **dying_inputs(joint)})
        write_gradient_into_h(bw, schedule.written)  # dh over h (recomputed_writes.py)
    return fw, bw


BATCH_NORM_WITH_STATS = torch.ops.aten._native_batch_norm_legit_functional.default
_BATCH_NORM_NO_STATS = torch.ops.aten._native_batch_norm_legit.no_stats


def batch_norm_without_running_stats(fw: fx.GraphModule, bw: fx.GraphModule, num_fwd_outputs: int) -> None:
    """Recompute each training-mode batch norm of the backward without its running stats.

    A recomputed `_native_batch_norm_legit_functional` would read the running-stat buffers, which
    the runtime has updated in place since the forward (autograd's version check fails), and would
    compute an update nobody uses. `_native_batch_norm_legit.no_stats` is the same kernel without
    the update: from the same input it gives the same output, mean and rstd, bit for bit (see
    `profile.recomputes_without_buffers`). The buffers, then read by nothing in the backward, are no
    longer saved for it.
    """
    recomputed = [n for n in bw.graph.nodes if n.target is BATCH_NORM_WITH_STATS]
    for n in recomputed:
        x, weight, bias, _mean, _var, training, momentum, eps = n.args
        if any(u.target is not operator.getitem or u.args[1] > 2 for u in n.users):
            raise RuntimeError(f"autoremat internal error: the backward reads the running stats of {n.name}")
        with bw.graph.inserting_before(n):
            plain = bw.graph.call_function(_BATCH_NORM_NO_STATS, (x, weight, bias, training, momentum, eps))
        plain.meta = {**n.meta, "val": tuple(n.meta["val"][:3])}
        n.replace_all_uses_with(plain)
        bw.graph.erase_node(n)
    if not recomputed:
        return
    unread = {p.name for p in bw.graph.find_nodes(op="placeholder") if not p.users and is_primal(p)}
    for p in [p for p in bw.graph.find_nodes(op="placeholder") if p.name in unread]:
        bw.graph.erase_node(p)
    out = next(iter(fw.graph.find_nodes(op="output")))
    outs = list(out.args[0])
    kept = outs[:num_fwd_outputs] + [o for o in outs[num_fwd_outputs:]
                                     if not (isinstance(o, fx.Node) and o.name in unread)]
    out.args = (tuple(kept),)
    for gm in (fw, bw):
        gm.graph.lint()
        gm.recompile()


def _check_same_nodes(gm: fx.GraphModule, order: list[str], what: str) -> None:
    have = {n.name for n in gm.graph.nodes if n.op == "call_function"}
    if have != {again_base(n) for n in order}:
        extra, missing = sorted(have - set(order))[:5], sorted(set(order) - have)[:5]
        raise RuntimeError(
            f"autoremat internal error: the {what} graph differs from the simulated schedule "
            f"(in graph only: {extra}; in schedule only: {missing}). Please report this model."
        )


def reorder(gm: fx.GraphModule, order: list[str], what: str) -> fx.GraphModule:
    """Rebuild `gm` with its call_function nodes in `order` (placeholders and constants first, output last)."""
    _check_same_nodes(gm, order, what)
    old = {n.name: n for n in gm.graph.nodes}
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in gm.graph.nodes:  # inputs, and lifted tensor constants: there before any op runs
        if n.op in ("placeholder", "get_attr"):
            env[n] = graph.node_copy(n, env.__getitem__)
    for name in order:
        n = old[again_base(name)]
        if name == n.name:
            env[n] = graph.node_copy(n, env.__getitem__)
            continue
        # a value recomputed again after a cut (autoremat/model/cuts.py): a copy of the node, under the
        # schedule's name; every later reader reads the copy
        copy = graph.create_node(n.op, n.target, fx.node.map_arg(n.args, env.__getitem__),
                                 fx.node.map_arg(n.kwargs, env.__getitem__), name=name)
        copy.meta = dict(n.meta)
        env[n] = copy
    for n in gm.graph.nodes:
        if n.op == "output":
            graph.node_copy(n, env.__getitem__)
    # A view fails on a tensor whose real strides differ from the traced ones (a kernel whose
    # output layout does not match its fake-tensor rule). Batch norm's did; capture now traces it on
    # inputs in its kernel's layout, and calibration names any other such op in the plan's notes.
    # In the backward, reshape stays as the safety net: a view whenever one is possible, a copy
    # otherwise, so it never fails where view would.
    for n in graph.nodes if what == "backward" else ():
        if n.target is torch.ops.aten.view.default:
            n.target = torch.ops.aten.reshape.default
    graph.lint()
    return fx.GraphModule(gm, graph)
