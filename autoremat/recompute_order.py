"""The order of a run of recomputed values: what frees memory runs as soon as it can.

The backward recomputes a value just before its first reader, together with what it needs that is not
there yet: a run of consecutive recomputed entries, in the joint graph's order. That order is the
forward's, which is not the cheapest once the run is only a rebuild. In a recomputed attention the
contiguous copy of v (`clone_2`, for `probs @ v`) comes after the scores, the softmax and the dropout,
so the fused qkv projection (1.5 MiB on the 12-block stack of benchmarks/floor.py) stays alive through
all of them; made as soon as q and k are, it is the last reader of the projection, which dies at once
(0.5 MiB in its place, three [batch, heads, seq, seq] tensors later).

`tighten` reorders each run: among the entries whose inputs in the run have run, the first (in the
run's order) that frees at least the bytes it allocates runs next (a view, a tuple's part, the last
reader of a buffer no entry after the run reads); otherwise the run's next entry in its order. Moving
such an entry earlier never raises the live bytes at any moment: from its new place to its old one it
adds at most what it frees, and from there on nothing changes. The values are the same (every
recomputed op is pure: a random draw is replayed from its saved state), and the graph pass builds the
backward in exactly this order (`passes/remat.reorder`), so the memory model replays what runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from autoremat.cuts import base

if TYPE_CHECKING:  # annotations only
    from autoremat.profile import NodeProfile


def tighten(nodes: dict[str, NodeProfile], backward: list[str], reads: dict[str, tuple[str, ...]],
            storage: dict[str, str], recomputed: set[str], held: set[str]) -> list[str]:
    """`backward` with each run of recomputed entries reordered (module docstring)."""

    def inputs_of(e: str) -> tuple[str, ...]:
        return reads.get(e, nodes[base(e)].inputs)

    def root(e: str) -> str:
        return storage.get(e, nodes[base(e)].storage)

    last: dict[str, int] = {}
    for i, e in enumerate(backward):
        for a in inputs_of(e):
            last[a] = i
    out: list[str] = []
    i = 0
    while i < len(backward):
        if base(backward[i]) not in recomputed:
            out.append(backward[i])
            i += 1
            continue
        j = i
        while j < len(backward) and base(backward[j]) in recomputed:
            j += 1
        out.extend(_run_order(nodes, backward[i:j], j, last, inputs_of, root, held) if j - i > 2 else backward[i:j])
        i = j
    return out


def _run_order(nodes, run: list[str], end: int, last: dict[str, int], inputs_of, root, held: set[str]) -> list[str]:
    """One run (entries `run`, ending before position `end`) in its memory-first order."""
    where = {e: i for i, e in enumerate(run)}
    ins = {e: inputs_of(e) for e in run}
    roots = {e: root(e) for e in run}
    profile = {e: nodes[base(e)] for e in run}
    # a buffer the run allocates dies in it when no value living in it is read after the run or held
    aliases: dict[str, list[str]] = {}
    for e in run:
        if roots[e] in where:
            aliases.setdefault(roots[e], []).append(e)
    dies = {s for s, vs in aliases.items() if all(last.get(v, -1) < end and v not in held for v in vs)}
    readers: dict[str, set[str]] = {s: set() for s in dies}  # buffer -> the run's entries still to read it
    waiting: dict[str, int] = {}  # entry -> its inputs in the run not yet run
    users: dict[str, list[str]] = {}
    for e in run:
        deps = {a for a in ins[e] if a in where}
        waiting[e] = len(deps)
        for a in deps:
            users.setdefault(a, []).append(e)
            if roots[a] in readers:
                readers[roots[a]].add(e)
    cost = {e: (p.nbytes if roots[e] == e else 0) + p.transient_bytes + p.tuple_out_bytes for e, p in profile.items()}

    def freed(e: str) -> int:
        gone = {roots[a] for a in ins[e] if a in where and roots[a] in readers and readers[roots[a]] == {e}}
        return sum(profile[s].nbytes for s in gone)

    ready = {e for e in run if not waiting[e]}
    order: list[str] = []
    head = 0
    while len(order) < len(run):
        while run[head] not in waiting:  # the run's next entry in its own order (always ready)
            head += 1
        first = run[head]
        pick = first
        for e in sorted(ready, key=where.__getitem__):
            if e != first and (profile[e].tuple_parent or cost[e] <= min(cost[first], freed(e))):
                pick = e
                break
        ready.discard(pick)
        del waiting[pick]
        order.append(pick)
        for u in users.get(pick, ()):
            waiting[u] -= 1
            if not waiting[u]:
                ready.add(u)
        for a in ins[pick]:
            if a in where and roots[a] in readers:
                readers[roots[a]].discard(pick)
    return order
