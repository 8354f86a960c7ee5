"""Graph passes that carry out a plan: split the joint graph into forward and backward modules.

The forward returns the user's outputs followed by the saved values; the backward takes the saved
values and the tangents and recomputes the rest just before first use. The node orders are
exactly `Schedule.forward` and `Schedule.backward`, the order the memory model simulated.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.fx as fx

from autoremat.torch_internals import extract_fwd_bwd_modules, is_primal, is_sym_node

if TYPE_CHECKING:  # annotations only: the passes import no pipeline stage (capture imports passes)
    from autoremat.capture import CapturedGraph
    from autoremat.memory import Schedule


def split(cg: CapturedGraph, schedule: Schedule) -> tuple[fx.GraphModule, fx.GraphModule]:
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
    return reorder(fw, schedule.forward, "forward"), reorder(bw, schedule.backward, "backward")


def _check_same_nodes(gm: fx.GraphModule, order: list[str], what: str) -> None:
    have = {n.name for n in gm.graph.nodes if n.op == "call_function"}
    if have != set(order):
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
        env[old[name]] = graph.node_copy(old[name], env.__getitem__)
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
