"""Where Inductor's code frees and reuses buffers, for the memory model (memory._run) of a graph it runs.

Two things Inductor's generated code does that running the FX graph op by op does not:
  - a fused value (fusion.py) is not computed where the graph places it but inside the kernel of
    each op that reads it, so what it reads stays alive until that kernel has run
    (`kernel_last_use`);
  - a kernel Inductor generates (pointwise loops, reductions: everything but library calls such as
    matmuls and convolutions) writes its output into the buffer of an input that dies in that
    kernel, when both have the same dtype and size (torch/_inductor/scheduler.py
    `decide_inplace_update`, its `can_match_buffer_size`). Such an input is an intermediate of the
    graph or a saved activation handed to the backward (AOTAutograd donates those); never a
    parameter, the step's input or a tangent. `NodeProfile.inplace` marks the nodes that may do
    this (`fusion.own_kernel`, set by `inductor_code.mark_inductor_code`); `donor` finds the input. Only backward
    nodes are marked: on docs/backend.md's MLP stack Inductor kept a linear's output and the GELU
    reading it both alive, in the forward and where the backward recomputes them (why is not known).

Seen in the generated code as `buf4 = reinterpret_tensor(buf1, ...); del buf1  # reuse` (a GELU
backward written into the matmul output it reads). Counted as a fresh allocation beside its input, each
such kernel over-counted the peak by its output's bytes (benchmarks/inductor_buffers.py).
"""

from __future__ import annotations

from collections.abc import Callable

from autoremat.model.graph_profile import GraphProfile

NOT_DONATED = ("param", "input", "tangent", "constant")


def kernel_last_use(g: GraphProfile, order: list[str]) -> dict[str, int]:
    """Per value, the position in `order` of the last kernel that reads it: a fused reader counts at
    the position of the kernel it is inlined into (its last non-fused reader there, transitively)."""
    nodes = g.nodes
    readers: dict[str, list[int]] = {}
    for i, name in enumerate(order):
        for a in nodes[name].inputs:
            readers.setdefault(a, []).append(i)
    at = list(range(len(order)))
    for i in reversed(range(len(order))):
        if inlined(g, order[i]):
            at[i] = max((at[j] for j in readers.get(order[i], ()) if j > i), default=i)
    last: dict[str, int] = {}
    for a, js in readers.items():
        last[a] = max(at[j] for j in js)
    return last


def donor(g: GraphProfile, name: str, dying: list[str], sole_bytes: Callable[[str], int | None],
          nbytes: int) -> str | None:
    """The value among `dying` (inputs whose last kernel is `name`'s, alive and not held) whose storage
    `name`'s output of `nbytes` (rounded as the heap rounds) takes, or None. sole_bytes(storage): its
    bytes if only one value references it now, else None."""
    dtype = g.nodes[name].dtype
    for a in dying:
        root = g.nodes[a].storage
        r = g.nodes.get(root)
        if r is None or r.kind in NOT_DONATED or g.nodes[a].kind in NOT_DONATED or r.dtype != dtype:
            continue
        if sole_bytes(root) == nbytes:
            return a
    return None


def least_peak_first(g: GraphProfile, order: list[str], held: set[str], inputs: list[str],
                     granularity: int) -> list[str]:
    """`order` re-sorted as Inductor's scheduler sorts a graph's kernels for peak memory (torch/_inductor/
    memory.py `topological_sort_lpmf`; `reorder_for_peak_memory` runs the lowest-peak of the graph's own order
    and this one, by its own estimate, in autoremat's compiles: torch_internals keeps its other two sorts out):
    a greedy topological sort that runs next, among the kernels whose inputs exist, one that stays under
    the highest live total so far, freeing the most, else the one that allocates least; ties in graph order.

    Kernels are the nodes not `inlined`; an inlined one is placed just before the first kernel that reads it.
    """
    nodes = g.nodes
    inside = set(order)
    deps: dict[str, set[str]] = {}  # kernel -> the kernels it reads, through fused nodes

    def needs(name: str) -> set[str]:
        """What kernel `name` reads, through the inlined values it computes: nodes of `order` and inputs."""
        found: set[str] = set()
        for a in nodes[name].inputs:
            found |= needs(a) if a in inside and inlined(g, a) else {a}
        return found
    kernels = [n for n in order if not inlined(g, n)]
    index = {n: i for i, n in enumerate(kernels)}
    readers: dict[str, list[str]] = {}  # storage -> kernels reading it (or a view of it)
    reads: dict[str, set[str]] = {}
    for n in kernels:
        read = needs(n)
        deps[n] = read & inside
        reads[n] = {nodes[a].storage for a in read} - {""}
        for root in reads[n]:
            readers.setdefault(root, []).append(n)
    size = {n: _round(nodes[n].nbytes, granularity) if nodes[n].storage == n else 0 for n in kernels}
    frees: dict[str, int] = {n: 0 for n in kernels}
    left = {root: len(set(rs)) for root, rs in readers.items()}
    freeable = {nodes[n].storage for n in [*order, *inputs]} - {nodes[h].storage for h in held} - {""}
    kept = set(readers) - freeable
    for root, rs in readers.items():
        if left[root] == 1 and root not in kept:
            frees[rs[0]] += _root_bytes(g, root, granularity)
    for n in kernels:
        if n not in readers and n in freeable:
            frees[n] += size[n]
    indegree = {n: len(deps[n]) for n in kernels}
    users: dict[str, list[str]] = {}
    for n in kernels:
        for d in deps[n]:
            users.setdefault(d, []).append(n)
    ready = {n for n in kernels if not indegree[n]}
    live = top = 0
    sorted_kernels: list[str] = []
    done: set[str] = set()
    while ready:
        gap = top - live
        pick = min(ready, key=lambda n: (size[n] if size[n] > gap else 0, size[n] - frees[n], index[n]))
        ready.discard(pick)
        sorted_kernels.append(pick)
        done.add(pick)
        live += size[pick]
        top = max(top, live)
        live -= frees[pick]
        for u in users.get(pick, ()):
            indegree[u] -= 1
            if not indegree[u]:
                ready.add(u)
        for root in reads[pick]:
            if root in left:
                left[root] -= 1
                if left[root] == 1 and root not in kept:
                    last = next(r for r in readers[root] if r not in done)
                    frees[last] += _root_bytes(g, root, granularity)
    if len(sorted_kernels) != len(kernels):
        return order
    placed: set[str] = set()
    out: list[str] = []
    position = {n: i for i, n in enumerate(order)}

    def place_fused(name: str) -> None:
        for a in sorted(nodes[name].inputs, key=lambda a: position.get(a, -1)):
            if a in inside and inlined(g, a) and a not in placed:
                placed.add(a)
                place_fused(a)
                out.append(a)
    for n in sorted_kernels:
        place_fused(n)
        out.append(n)
    out += [n for n in order if n not in placed and n not in index]  # fused values no kernel reads
    return out


def inlined(g: GraphProfile, name: str) -> bool:
    """A fused value, or a view of one: no kernel of its own; computed inside each kernel that reads it."""
    p = g.nodes[name]
    return p.fused or (bool(p.storage) and p.storage != name and g.nodes[p.storage].fused)


def _root_bytes(g: GraphProfile, root: str, granularity: int) -> int:
    return _round(g.nodes[root].nbytes, granularity)


def _round(n: int, granularity: int) -> int:
    return -(-n // granularity) * granularity if granularity > 1 else n
