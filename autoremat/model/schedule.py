"""The order a plan runs in: a `Schedule` of one graph's forward and backward for a saved set.

Every forward value the backward reads and the plan does not save is recomputed just before its first
backward reader (just in time); values recomputed twice follow a cut (cuts.py); recomputed pointwise
results may be written into an input that dies at them (recomputed_writes.py). The forward runs the
nodes only the backward reads as soon as their inputs exist (`forward_slots`). memory.py replays a
schedule and counts its live bytes.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

from autoremat.model.cuts import cut_backward
from autoremat.model.graph_profile import GraphProfile, NodeProfile
from autoremat.model.marks import force_marks
from autoremat.model.recomputed_writes import write_over_dying_input, write_recomputed
from autoremat.passes.recompute_names import MARK, base


class PlanError(ValueError):
    """A saved set that cannot be executed (the backward needs a value nobody may recompute)."""


@dataclass
class Schedule:
    forward: list[str]  # forward graph, in execution order
    backward: list[str]  # backward graph, recomputed nodes placed just before their first use
    saved: list[str]  # forward values handed to the backward
    recomputed: list[str]  # forward-side nodes that run again in the backward
    again: list[str] = field(default_factory=list)  # backward nodes where recomputation starts afresh (cuts.py)
    reads: dict[str, tuple[str, ...]] = field(default_factory=dict)  # entries reading a copy (cuts.py)
    storage: dict[str, str] = field(default_factory=dict)  # each copy's storage (cuts.py), a writer's (below)
    written: dict[str, str] = field(default_factory=dict)  # entries written into a dying input (recomputed_writes.py)


def forward_ancestors(g: GraphProfile, seeds) -> set[str]:
    """The forward-side nodes among `seeds` and everything they read, transitively."""
    found: set[str] = set()
    stack = list(seeds)
    while stack:
        name = stack.pop()
        if name in found or g.nodes[name].kind != "forward":
            continue
        found.add(name)
        stack.extend(g.nodes[name].inputs)
    return found


def forward_slots(g: GraphProfile) -> tuple[list[str], dict[str, int]]:
    """The core forward (what the forward outputs need, in joint order) and a slot for every
    forward-side node: its index in the core, or, for a node only the backward reads (a detach, a
    transposed weight, a mask cast), the index of the core step after which all its inputs exist.

    The joint graph places those backward-only nodes late, among the backward ops; computed there
    in the forward they would keep their inputs alive to its end. Run as soon as their inputs
    exist they cost nothing extra, so the forward runs them there (`make_schedule`).
    """
    hit = _SLOTS.get(id(g))
    if hit is not None and hit[0]() is g:  # every evaluate() asks again for the same graph
        return hit[1]
    nodes = g.nodes
    core = forward_ancestors(g, g.fw_outputs)
    order = [n for n, p in nodes.items() if p.kind == "forward" and n in core]
    slot = {n: i for i, n in enumerate(order)}
    for n, p in nodes.items():  # joint order is topological
        if p.kind == "forward" and n not in slot:
            slot[n] = max((slot[i] for i in p.inputs if i in slot), default=-1)
    key = id(g)
    _SLOTS[key] = (weakref.ref(g, lambda _: _SLOTS.pop(key, None)), (order, slot))
    return order, slot


# forward_slots per graph, by id while the graph lives (a graph's structure never changes once profiled)
_SLOTS: dict[int, tuple[weakref.ref, tuple[list[str], dict[str, int]]]] = {}


def make_schedule(g: GraphProfile, saved: set[str]) -> Schedule:
    """Execution order of the forward and backward graphs for one graph's saved set."""
    nodes = g.nodes
    order = {name: i for i, name in enumerate(nodes)}
    # a backward node marks a cut, its name + MARK a narrow one (cuts.py)
    cuts = {s for s in saved if s in nodes and nodes[s].kind == "backward"}
    narrow = {base(s) for s in saved if s not in nodes and base(s) in nodes and nodes[base(s)].kind == "backward"}
    # the user's MUST_SAVE / MUST_RECOMPUTE marks hold whichever planner chose `saved` (marks.py)
    saved = force_marks(g, _handed_over(nodes, {s for s in saved if s in nodes}))
    recomputed, needed_bw = _needed(g, saved)
    used_saved = set()
    for name in needed_bw | recomputed:
        used_saved.update(i for i in nodes[name].inputs if i in saved)

    # Forward graph: whatever the forward outputs and the saved values need.
    in_fw = forward_ancestors(g, [*g.fw_outputs, *used_saved])
    core, slot = forward_slots(g)
    in_core = set(core)
    forward = sorted(in_fw, key=lambda n: (slot[n], n not in in_core, order[n]))

    backward = _just_in_time(g, needed_bw, recomputed, order)
    cuts &= set(backward)
    narrow &= set(backward)
    backward, reads, copy_storage = cut_backward(nodes, backward, recomputed, cuts, order, frozenset(narrow))
    held = {*g.fw_outputs, *g.grad_outputs}
    written = write_recomputed(nodes, backward, reads, copy_storage, recomputed, held)
    written.update(write_over_dying_input(nodes, backward, reads, copy_storage, held))
    return Schedule(
        forward=forward,
        backward=backward,
        saved=sorted(used_saved, key=order.__getitem__),
        recomputed=sorted(recomputed, key=order.__getitem__),
        again=sorted(cuts, key=order.__getitem__) + [n + MARK for n in sorted(narrow, key=order.__getitem__)],
        reads=reads,
        storage=copy_storage,
        written=written,
    )


def _handed_over(nodes: dict[str, NodeProfile], saved: set[str]) -> set[str]:
    """The storages the forward hands the backward for a saved set: forward tensors only, bases for views,
    a fused value's inputs for the value."""
    # A tuple (multi-output op) is not a tensor: its getitems are what gets saved.
    saved = {s for s in saved if nodes[s].kind == "forward" and not nodes[s].is_tuple}
    # Hand over storages, not views: a saved view (a detach, a transpose) is replaced by its base,
    # and the backward re-derives the view for free. The autograd runtime keeps a saved view's
    # base alive past the view's last use (autograd holds the base a saved
    # view was made from as long as the view is saved), so saving the base is both cheaper to model and what actually frees memory.
    for v in list(saved):
        root = nodes[v].storage
        if root and root != v:
            saved.discard(v)
            if nodes[root].kind == "forward" and not nodes[v].recompute_ban:
                saved.add(root)
            elif nodes[v].recompute_ban:
                saved.add(v)
    # A fused value (Inductor inlines it: fusion.py) is never handed over: its inputs are, and the
    # backward recomputes it inside the loop that reads it.
    stack = [v for v in saved if nodes[v].fused]
    seen: set[str] = set()
    while stack:
        v = stack.pop()
        saved.discard(v)
        if v in seen:
            continue
        seen.add(v)
        for u in nodes[v].inputs:
            q = nodes[u]
            if q.kind != "forward" or q.is_tuple or u in saved:
                continue
            root = q.storage if q.storage and nodes[q.storage].kind == "forward" else u
            if q.fused or nodes[root].fused:  # a view of a fused value unwinds to the value's own inputs
                stack.append(root)
            else:
                saved.add(root)

    return saved


def _needed(g: GraphProfile, saved: set[str]) -> tuple[set[str], set[str]]:
    """What the backward runs: the forward values it recomputes and its own nodes, from the gradients
    it must produce back through its reads."""
    nodes = g.nodes
    recomputed: set[str] = set()
    needed_bw: set[str] = set()
    stack = [*g.grad_outputs, *g.released]
    while stack:
        name = stack.pop()
        p = nodes[name]
        if p.kind in ("param", "input", "tangent", "constant") or name in needed_bw or name in recomputed:
            continue
        if p.kind == "forward":
            if name in saved:
                continue
            if p.recompute_ban:
                raise PlanError(f"the backward needs {name} ({p.target}), which is not saved and {p.recompute_ban}")
            recomputed.add(name)
        else:
            needed_bw.add(name)
        stack.extend(p.inputs)

    return recomputed, needed_bw


def _just_in_time(g: GraphProfile, needed_bw: set[str], recomputed: set[str], order: dict[str, int]) -> list[str]:
    """The backward order before cuts: backward nodes in joint order, each after the recomputed values it reads."""
    nodes = g.nodes
    # Backward graph: backward nodes in joint order (the autograd engine's order), each preceded
    # by the recomputed values it needs that are not there yet: just-in-time recomputation.
    backward: list[str] = []
    emitted: set[str] = set()
    # A multi-output op's outputs all exist from the moment it runs until its last getitem: emit
    # the recomputed getitems right after it, so the unused parts die at once (and we know when).
    getitems: dict[str, list[str]] = {}
    for n in recomputed:
        if nodes[n].tuple_parent:
            getitems.setdefault(nodes[n].tuple_parent, []).append(n)

    def emit_recomputed(name: str) -> None:
        todo, seen = [name], set()
        while todo:
            n = todo.pop()
            if n in seen or n in emitted or n not in recomputed:
                continue
            seen.add(n)
            todo.extend(nodes[n].inputs)
            todo.extend(getitems.get(n, ()))
        for n in sorted(seen, key=order.__getitem__):
            emitted.add(n)
            backward.append(n)

    for name in sorted(needed_bw, key=order.__getitem__):
        for i in nodes[name].inputs:
            emit_recomputed(i)
        backward.append(name)
    for name in g.grad_outputs:
        emit_recomputed(name)
    return backward
