"""The data the ILP's rows are made of (the names of ilp.py's formulation): fw_t and bw_t, the
live bytes of each step when nothing is saved or recomputed; size_v, the bytes a value owns; and the
identical repeated blocks whose decisions may be shared."""

from __future__ import annotations

from autoremat.capture.regions import block_of
from autoremat.model.graph_profile import GraphProfile
from autoremat.model.lifetimes import Lifetimes
from autoremat.model.memory import TANGENTS_HELD, Timeline, _Heap, _run
from autoremat.model.schedule import forward_slots


def block_twins(g: GraphProfile, life: Lifetimes) -> dict[str, str]:
    """Map each node of a repeated block to the same node of the first identical block.

    Two blocks are identical when their forward nodes, in order, have the same ops, shapes,
    dtypes, recompute bans and wiring (inputs named by position inside the block). Sharing their
    decisions shrinks the ILP by the number of repeats: the transformer-stack case.
    """
    blocks: dict[str, list[str]] = {}
    for v in life.fw_pos:
        key = block_of(g.nodes[v].module)
        if key:
            blocks.setdefault(key, []).append(v)
    first: dict[tuple, list[str]] = {}
    twins: dict[str, str] = {}
    for members in blocks.values():
        where = {v: i for i, v in enumerate(members)}
        sig = tuple(
            (g.nodes[v].target, g.nodes[v].shape, g.nodes[v].dtype, bool(g.nodes[v].recompute_ban),
             g.nodes[v].is_tuple, tuple(where.get(u, -1) for u in g.nodes[v].inputs))
            for v in members
        )
        if sig in first:
            twins.update(zip(members, first[sig]))
        else:
            first[sig] = members
    return twins


def static_profile(g: GraphProfile, granularity: int) -> tuple[list[int], list[int], list[str], dict[str, int]]:
    """fw_t and bw_t: live bytes at each forward and backward step when nothing is saved or
    recomputed; also the core forward that runs then, and each forward-side node's slot in it
    (schedule.forward_slots)."""
    heap = _Heap(granularity)
    forward, backward = Timeline(), Timeline()
    core, slot = forward_slots(g)
    bw = [n for n, p in g.nodes.items() if p.kind == "backward"]
    _run(g, core, heap, set(g.fw_outputs), [], "forward", forward)
    tangents = [n for n, p in g.nodes.items() if p.kind == "tangent" and p.nbytes]
    for t in tangents:
        heap.add(g.nodes[t].storage, g.nodes[t].nbytes)
    held = set(g.grad_outputs) | set(g.fw_outputs) | (set(tangents) if TANGENTS_HELD else set())
    _run(g, bw, heap, held, tangents, "backward", backward)
    return forward.during, backward.during, core, slot


def owned_size(g: GraphProfile, v: str, granularity: int) -> int:
    """size_v: the bytes v owns, rounded up to `granularity`."""
    p = g.nodes[v]
    if p.storage != v or v in g.fw_outputs:  # aliases own nothing; outputs are alive anyway
        return 0
    return -(-p.nbytes // granularity) * granularity if granularity > 1 else p.nbytes


def base_size(g: GraphProfile, v: str) -> int:
    """Bytes of the storage v is a view of (v's own, if it is no view)."""
    root = g.nodes[v].storage
    return g.nodes[root].nbytes if root in g.nodes else 0
