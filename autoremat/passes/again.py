"""Values recomputed twice: a cut in a backward after which recomputed values are computed afresh.

Recomputation is just in time: a recomputed value is emitted before its first backward reader and
lives to its last. When an early reader needs a value whose recomputation passes through values the
backward reads only much later, those are held all the way in between. In a checkpointed transformer
block the MLP's backward, which comes first, reads the mid-block residual; recomputing it recomputes
attention, and attention's softmax, dropout output, q, k, v (4.75 MiB on the 12-block stack of
benchmarks/floor.py) are then alive through the whole MLP backward, where the block peaks.

A *cut* before backward node c says: a value recomputed before c is not kept for readers from c on;
the first such reader recomputes it again (with whatever of its recomputed inputs is stale too). The
first copy dies at its last reader before c. The plan names its cuts among a graph's saved values (a
backward node is never a saved value, so the two cannot be confused): `GraphPlan.again` lists them.
Which cuts pay is found by the exact simulator (`autoremat.twice.recompute_twice`), never assumed.

A copy is named `<value>__again<k>`; `base` gives the value's own name back.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: the passes import no pipeline stage
    from autoremat.profile import NodeProfile

MARK = "__again"


def base(name: str) -> str:
    """The node a (possibly re-emitted) schedule entry computes."""
    return name.split(MARK, 1)[0]


def cut_backward(nodes: dict[str, NodeProfile], backward: list[str], recomputed: set[str], cuts: set[str],
                 order: dict[str, int]) -> tuple[list[str], dict[str, tuple[str, ...]], dict[str, str]]:
    """The just-in-time backward `backward` with recomputation started afresh at each of `cuts`.

    Returns the new order, what each entry reads where that is not its node's own inputs (a copy, or a
    node reading a copy), and the storage each copy lives in (its own, or the current copy of what it
    views)."""
    if not cuts:
        return backward, {}, {}
    getitems: dict[str, list[str]] = {}
    for n in recomputed:
        if nodes[n].tuple_parent:
            getitems.setdefault(nodes[n].tuple_parent, []).append(n)
    current: dict[str, str] = {}  # recomputed value -> the entry holding it now
    stale: set[str] = set()  # recomputed values whose current entry may not be read any more
    copies: dict[str, int] = {}
    out: list[str] = []
    reads: dict[str, tuple[str, ...]] = {}
    storage: dict[str, str] = {}

    def resolve(i: str) -> str:
        return current.get(i, i)

    def emit(entry: str, node: str) -> None:
        ins = tuple(resolve(i) for i in nodes[node].inputs)
        if ins != nodes[node].inputs:
            reads[entry] = ins
        out.append(entry)

    def refresh(value: str) -> None:
        todo, seen = [value], set()
        while todo:  # the stale recomputed values this one needs, and the getitems of a tuple op
            n = todo.pop()
            if n in seen or n not in stale:
                continue
            seen.add(n)
            todo.extend(nodes[n].inputs)
            todo.extend(getitems.get(n, ()))
        for n in sorted(seen, key=order.__getitem__):
            copies[n] = copies.get(n, 1) + 1
            entry = f"{n}{MARK}{copies[n]}"
            emit(entry, n)
            root = nodes[n].storage
            storage[entry] = entry if root == n else resolve(root)
            current[n] = entry
            stale.discard(n)

    for name in backward:
        if name in cuts:
            stale |= set(current)
        if name in recomputed:
            for i in nodes[name].inputs:
                if i in stale:
                    refresh(i)
            emit(name, name)
            current[name] = name
            continue
        for i in nodes[name].inputs:
            if i in stale:
                refresh(i)
        emit(name, name)
    return out, reads, storage

