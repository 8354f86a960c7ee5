"""Values recomputed twice: a cut in a backward after which recomputed values are computed afresh.

Recomputation is just in time: a recomputed value is emitted before its first backward reader and
lives to its last. When an early reader needs a value whose recomputation passes through values the
backward reads only much later, those are held all the way in between. In a checkpointed transformer
block the MLP's backward, which comes first, reads the mid-block residual; recomputing it recomputes
attention, and attention's softmax, dropout output, q, k, v are then alive through the whole MLP backward, where the block peaks
(benchmarks/live_at_peak.py lists what is live at a floor plan's peak: results/live_at_peak_cpu.md).

A *cut* before backward node c says: a value recomputed before c is not kept for readers from c on;
the first such reader recomputes it again (with whatever of its recomputed inputs is stale too). A
*narrow* cut recomputes again only the values c itself reads (with their inputs dead by then). The
first copies die at their last readers before c. The plan names its cuts among a graph's saved values (a
backward node is never a saved value, so the two cannot be confused; a narrow cut is the node's name
followed by `__again`): `GraphPlan.again` lists them.
Which cuts pay is found by the exact simulator (`autoremat.solve.cut_search.recompute_twice`), never assumed.

A copy is named `<value>__again<k>` (passes/recompute_names.py, which every stage reads).
"""

from __future__ import annotations

from autoremat.model.graph_profile import NodeProfile
from autoremat.passes.recompute_names import MARK


def cut_backward(nodes: dict[str, NodeProfile], backward: list[str], recomputed: set[str], cuts: set[str],
                 order: dict[str, int], narrow: frozenset[str] = frozenset()) -> tuple[
                     list[str], dict[str, tuple[str, ...]], dict[str, str]]:
    """The just-in-time backward `backward` with recomputation started afresh at each of `cuts` and `narrow`.

    At a cut c, every recomputed value emitted before c is stale: a reader from c on recomputes it again
    (with its stale recomputed inputs). At a narrow cut c, only the recomputed values c reads are
    emitted again, right before c, with those of their recomputed inputs that nothing at or after c
    reads otherwise (the rest are alive anyway). Later readers read the newest copy. Returns the new
    order, what each entry reads where that is not its node's own inputs, and the storage each copy
    lives in (its own, or the current copy of what it views)."""
    if not cuts and not narrow:
        return backward, {}, {}
    getitems: dict[str, list[str]] = {}
    for n in recomputed:
        if nodes[n].tuple_parent:
            getitems.setdefault(nodes[n].tuple_parent, []).append(n)
    last_read: dict[str, int] = {}  # in the plain order: a value read at or after a cut is alive there anyway
    for i, name in enumerate(backward):
        for a in nodes[name].inputs:
            last_read[a] = i
    current: dict[str, str] = {}  # recomputed value -> the entry holding it now
    stale: set[str] = set()
    copies: dict[str, int] = {}
    out: list[str] = []
    reads: dict[str, tuple[str, ...]] = {}
    storage: dict[str, str] = {}

    def emit(entry: str, node: str) -> None:
        ins = tuple(current.get(i, i) for i in nodes[node].inputs)
        if ins != nodes[node].inputs:
            reads[entry] = ins
        out.append(entry)

    def refresh(values: list[str], at: int) -> None:
        todo, seen = list(values), set()
        while todo:  # what must run again: the values, their stale or dead inputs, a tuple op's getitems
            n = todo.pop()
            if n in seen or n not in current:
                continue
            seen.add(n)
            todo.extend(u for u in nodes[n].inputs if u in stale or last_read.get(u, -1) < at)
            todo.extend(getitems.get(n, ()))
            if nodes[n].tuple_parent:
                todo.append(nodes[n].tuple_parent)
        for n in sorted(seen, key=order.__getitem__):
            copies[n] = copies.get(n, 1) + 1
            entry = f"{n}{MARK}{copies[n]}"
            emit(entry, n)
            root = nodes[n].storage
            storage[entry] = entry if root == n else current.get(root, root)
            current[n] = entry
            stale.discard(n)

    for i, name in enumerate(backward):
        if name in cuts:
            stale |= set(current)
        if name in narrow:
            refresh([a for a in nodes[name].inputs if a in current], i + 1)
        refresh([a for a in nodes[name].inputs if a in stale], i + 1)
        emit(name, name)
        if name in recomputed:
            current[name] = name
    return out, reads, storage
