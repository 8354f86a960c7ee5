"""Recomputed forward pointwise ops write their result into a recomputed input that dies at them.

A value recomputed in the backward lives only from its recomputation to its last reader there. In a
checkpointed attention the dropout's recomputed `mul` (the probabilities scaled by 1/(1-p)) is read
only by the `where` that applies the mask: when the `where` runs, the `mul` dies, yet as functional ops
both [batch, heads, seq, seq] tensors are alive at once
(tests/test_recomputed_runs.py::test_recomputed_ops_write_into_dying_inputs_with_eagers_gradients_and_the_predicted_peak
checks the rewrite's peak and gradients). Written with its out= variant into the dying input, the
`where` computes the same values element by element and allocates nothing (as `passes/reuse.py` does
for backward ops, where the joint order alone decides who dies where).

For a recomputed value, which reader is the last depends on the plan, so it is decided here, per
schedule, on the backward order the memory model runs (`schedule.make_schedule`): entry e may write
into entry u when the profile allows it (`NodeProfile.writable`: an out= variant, the same layout),
both are recomputed in this backward, and every value sharing u's storage (u, its views, earlier
writers into it) is read last at e and is not a graph output. The schedule's `storage` then names the
shared buffer for e and for every view of e (the simulator books no new bytes for it), and
`Schedule.written` tells the graph pass (`passes/remat.split`) which entries to rewrite. Only the
eager path: the profile lists no candidates for a graph Inductor compiles (it reuses buffers itself).

`write_over_dying_input` decides the same per schedule for a backward op whose profile names an
overwriting variant (`NodeProfile.overwrites`): the fused LM head's backward writes h's gradient over h.
"""

from __future__ import annotations

from autoremat.model.graph_profile import NodeProfile
from autoremat.passes.recompute_names import base


def _inputs_of(nodes: dict[str, NodeProfile], reads: dict[str, tuple[str, ...]], e: str) -> tuple[str, ...]:
    """What schedule entry e reads: copies recomputed twice read copies (cuts.py)."""
    return reads.get(e, nodes[base(e)].inputs)


def _last_reads(nodes: dict[str, NodeProfile], backward: list[str], reads: dict[str, tuple[str, ...]]) -> dict[str, int]:
    """{value: the position in `backward` of its last reader}."""
    last: dict[str, int] = {}
    for i, e in enumerate(backward):
        for a in _inputs_of(nodes, reads, e):
            last[a] = i
    return last


def write_recomputed(nodes: dict[str, NodeProfile], backward: list[str], reads: dict[str, tuple[str, ...]],
                     storage: dict[str, str], recomputed: set[str], held: set[str]) -> dict[str, str]:
    """{entry: the recomputed entry it writes into} for the backward order `backward` (module docstring).

    `reads` and `storage` are the schedule's (cuts.py: what copies read and where they live); `storage`
    is updated in place so that each writer, and each view of one, lives in the buffer written into.
    `held` are values alive past this graph (its outputs), never written into."""
    if not any(nodes[base(e)].writable for e in backward):
        return {}

    def inputs_of(e: str) -> tuple[str, ...]:
        return _inputs_of(nodes, reads, e)

    moved: dict[str, str] = {}  # an entry that wrote into another's buffer -> that buffer

    def root(e: str) -> str:
        s = storage.get(e, nodes[base(e)].storage)
        return moved.get(s, s)

    last = _last_reads(nodes, backward, reads)
    members: dict[str, list[str]] = {}  # buffer -> the entries so far that live in it
    written: dict[str, str] = {}
    for i, e in enumerate(backward):
        p = nodes[base(e)]
        if p.writable and base(e) in recomputed and p.storage == base(e) and p.nbytes and e not in held:
            ins = inputs_of(e)
            for u, own in zip(ins, p.inputs, strict=True):
                if own not in p.writable or base(u) not in recomputed:
                    continue
                r = root(u)
                group = members.get(r, [])
                if (r not in members or base(r) not in recomputed
                        or any(last.get(w, -1) > i or w in held for w in group)
                        or any(a != u and root(a) == r for a in ins)):  # e reads no other view of the buffer
                    continue
                written[e], moved[e] = u, r
                break
        r = root(e)
        if r:
            members.setdefault(r, []).append(e)
    for e in backward:
        if root(e) != storage.get(e, nodes[base(e)].storage):
            storage[e] = root(e)
    return written


def write_over_dying_input(nodes: dict[str, NodeProfile], backward: list[str], reads: dict[str, tuple[str, ...]],
                           storage: dict[str, str], held: set[str]) -> dict[str, str]:
    """{output entry: the input entry it is written over} for backward ops with an overwriting variant.

    `NodeProfile.overwrites` names such an op's output and the input its variant writes it over (the
    fused LM head's backward writes h's gradient over h: passes/fused_linear_loss.py). Whether h dies
    there depends on the plan (saved or recomputed, which copy it reads), so it is decided here: the
    input's storage must belong to a value computed in this step (saved or recomputed), not be `held`,
    and every value in it be read last at the op. `storage` is updated in place: the output and its
    views live in the input's buffer (the simulator books no new bytes for it, nor for it in the op's
    outputs)."""
    writers = [(i, e) for i, e in enumerate(backward) if nodes[base(e)].overwrites]
    if not writers:
        return {}

    def root(e: str) -> str:
        return storage.get(e, nodes[base(e)].storage)

    last = _last_reads(nodes, backward, reads)
    written: dict[str, str] = {}
    for i, e in writers:
        out, over = nodes[base(e)].overwrites
        u = _inputs_of(nodes, reads, e)[nodes[base(e)].inputs.index(over)]
        r = root(u)
        group = [w for w in {*last, *backward} if root(w) == r]
        if (out not in backward or not r or nodes[base(r)].kind != "forward" or r in held
                or any(w in held or last.get(w, -1) > i for w in group)):
            continue
        written[out], storage[out] = u, r
        for w in backward:  # the output's views view the buffer it was written into
            if w != out and w not in storage and nodes[base(w)].storage == out:
                storage[w] = r
    return written
