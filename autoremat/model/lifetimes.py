"""When each forward value is read in the backward: the view of a graph the ILP and the heuristics plan on.

`lifetimes` gives, per forward-side value, the first and last backward step that read it and the
earliest step a recomputed copy may be needed at; `output_spans` how long each graph's forward
outputs stay alive across the graphs of one step; `waiting_bytes` the tied gradients alive in each
backward. The first two are bounds: memory.simulate is exact.
"""

from __future__ import annotations

from dataclasses import dataclass

from autoremat.capture.regions import block_of
from autoremat.model.graph_profile import GraphProfile
from autoremat.model.inplace import kernel_last_use
from autoremat.model.memory import INF, _round
from autoremat.model.region_crossings import region_handoffs, tied_waits


@dataclass
class Lifetimes:
    fw_pos: dict[str, int]  # forward-side nodes in joint order
    bw_pos: dict[str, int]  # backward nodes in joint order
    first_read: dict[str, float]  # first backward position at which v is read, directly or via pass-through users
    start: dict[str, float]  # earliest position a recomputed v can be computed at (recomputed users drag it)
    last_read: dict[str, float]  # last backward position at which v is read (upper bound)
    needed: set[str]  # forward-side values a backward node reads directly
    follows: dict[str, set[str]]  # users whose recomputation may drag v earlier (accounted in `start`)


def lifetimes(g: GraphProfile, block_drag: bool = False) -> Lifetimes:
    nodes = g.nodes
    fw = [n for n, p in nodes.items() if p.kind == "forward"]
    bw = [n for n, p in nodes.items() if p.kind == "backward"]
    fw_pos = {n: i for i, n in enumerate(fw)}
    bw_pos = {n: i for i, n in enumerate(bw)}
    users: dict[str, list[str]] = {n: [] for n in nodes}
    for n, p in nodes.items():
        for i in p.inputs:
            users[i].append(n)
    direct_first: dict[str, float] = {}
    direct_last: dict[str, float] = {}
    needed: set[str] = set()
    grad_set = set(g.grad_outputs)
    # A backward view of a forward value keeps its storage alive until the view's last use.
    alias_last: dict[str, int] = {}
    for w in bw:
        root = nodes[w].storage
        if root and root != w and root in fw_pos:
            last = max([bw_pos[u] for u in users[w] if u in bw_pos] + [bw_pos[w]])
            alias_last[root] = max(alias_last.get(root, -1), last)
    # Under Inductor a fused reader has no kernel of its own: it is computed inside each kernel that
    # reads it, so its inputs are read there, up to the last such kernel (inplace.kernel_last_use, as
    # memory.simulate frees them). On graphs without fused values this adds nothing.
    kernel_last: dict[str, float] = {}
    if any(p.fused for p in nodes.values()):
        order = list(nodes)
        kernel_last = {v: bw_pos[order[i]] for v, i in kernel_last_use(g, order).items() if order[i] in bw_pos}
    for v in fw:
        bpos = [bw_pos[u] for u in users[v] if u in bw_pos] + ([alias_last[v]] if v in alias_last else [])
        if v in grad_set:
            bpos.append(len(bw))
        direct_first[v] = min(bpos, default=INF)
        direct_last[v] = max(bpos + ([kernel_last[v]] if v in kernel_last else []), default=-INF)
        if bpos:
            needed.add(v)

    def is_alias(w: str) -> bool:
        return bool(nodes[w].storage) and nodes[w].storage != w

    follows: dict[str, set[str]] = {}
    first_read: dict[str, float] = {}
    start: dict[str, float] = {}
    last_read: dict[str, float] = {}
    late: dict[str, float] = {}
    for v in reversed(fw):  # users come later in joint order, so they are done already
        fw_users = [w for w in users[v] if w in fw_pos]
        pass_through = {w for w in fw_users if direct_first[w] == INF or is_alias(w) or nodes[v].is_tuple}
        first_read[v] = min([direct_first[v], *(first_read[w] for w in pass_through)])
        # A recomputed user drags v to its own start; we allow that inside one repeated block (a
        # checkpoint-like segment) and account for it, and forbid it across blocks.
        same = {w for w in fw_users if block_drag and block_of(nodes[w].module) == block_of(nodes[v].module)}
        # A fused user (Inductor inlines it: fusion.py) is always recomputed where it is read, and
        # reads v there: it drags v in every model, which is accounted for, never forbidden.
        inlined = {w for w in fw_users if nodes[w].fused}
        follows[v] = pass_through | same | inlined
        start[v] = min([first_read[v], *(start[w] for w in follows[v])])
        # The latest a recomputed v is computed at: where it is read, or else where the latest user that
        # may drag it is computed. A saved input of v is read until then: a logits chunk saved for a
        # recomputed `logits - logsumexp`, whose own reader is recomputed, is held to that reader's step.
        late[v] = first_read[v] if first_read[v] != INF else max((late[w] for w in follows[v] if late[w] != INF),
                                                                  default=INF)
        later = ((last_read[w] if is_alias(w) else late[w]) for w in fw_users)
        last_read[v] = max([direct_last[v], *(t for t in later if t != INF)])
    # A multi-output op recomputed for one of its outputs makes all of them then: a recomputed output that is
    # read later (a layer norm's mean and rstd, read by its backward) is alive from the op's start.
    for v in fw:
        ins = nodes[v].inputs
        if len(ins) == 1 and ins[0] in fw_pos and nodes[ins[0]].is_tuple:
            start[v] = min(start[v], start[ins[0]])
    return Lifetimes(fw_pos, bw_pos, first_read, start, last_read, needed, follows)


def output_spans(graphs: list[GraphProfile], granularity: int = 1) -> list[list[tuple[int, int | None]]]:
    """Per graph, its forward outputs' (bytes, position of the last region that reads them, or None
    if the caller holds them to the end of the step): an upper bound on `handed_over`, for the ILP,
    which cannot know yet what each region saves."""
    last = {key: max(j for j, _ in consumers) for key, consumers in region_handoffs(graphs).items()}
    spans = []
    for k, g in enumerate(graphs):
        roots = {g.nodes[o].storage: o for o in g.fw_outputs if g.nodes[o].storage}
        spans.append([(_round(g.nodes[r].nbytes, granularity), last.get((k, o))) for r, o in roots.items()])
    return spans


def waiting_bytes(graphs: list[GraphProfile], granularity: int = 1) -> list[int]:
    """Per graph, the bytes of other regions' gradients of a shared input (a tied weight, an output two
    regions read) that wait in autograd while its backward runs (region_crossings.tied_waits): from the backward
    after the one that computed them to the end of the one they wait for."""
    waiting = [0] * len(graphs)
    for until, grads in tied_waits(graphs).items():
        for k, name in grads:
            nbytes = _round(graphs[k].nodes[graphs[k].nodes[name].storage].nbytes, granularity)
            for j in range(until, k):
                waiting[j] += nbytes
    return waiting
