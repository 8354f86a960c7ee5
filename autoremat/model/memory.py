"""The memory model: the live bytes at every step of the order a plan will run in.

A plan is, per graph, the set of forward values saved for the backward; every other forward value
the backward reads is recomputed just before its first backward use (`schedule.make_schedule` gives
that order, a `Schedule`). The graph passes build the forward and backward modules in exactly this
order, so `simulate` replays what will run: each op allocates its output, a value dies after its last use in its graph (boxed code
generation makes this true of saved tensors too), a storage is freed when the last value that
aliases it dies, forward outputs live to the end of the step, and gradients live until their
backward graph returns (a tied weight's, until the other region that reads the weight returns its own:
`region_crossings.tied_waits`).

Bytes that are fixed for the whole step (parameters, gradient buffers, optimizer state, inputs)
are not simulated here; they come from the ledger.
"""

from __future__ import annotations

import bisect
import math
import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from autoremat import switches
from autoremat.model.graph_profile import GraphProfile
from autoremat.model.inplace import donor, kernel_last_use, least_peak_first
from autoremat.model.region_crossings import handed_over, region_handoffs, tied_waits
from autoremat.model.schedule import Schedule
from autoremat.passes.recompute_names import base
from autoremat.torch_internals import TANGENTS_BOXED

INF = math.inf
# The gradients a compiled backward receives for the forward's outputs (its tangents): torch 2.13
# boxes them (autograd.Function.boxed_grads_call), so each dies after its last use in the graph;
# torch 2.11 keeps them in the argument tuple until the backward returns
# (tests/test_torch_internals.py::test_tangents_boxed_is_what_the_memory_model_assumes checks which does).
TANGENTS_HELD = not TANGENTS_BOXED


class _OverLimit(Exception):
    """A step of a simulation given a limit went over it: the rest of the step is not replayed."""


@dataclass(slots=True)
class Step:
    graph: int
    phase: str  # "forward" | "backward"
    node: str
    during: int  # live bytes while the node runs (inputs, output and its temporaries)


@dataclass
class Timeline:
    """The live bytes at every step of a replay, as flat lists: the searches replay the whole step hundreds of
    times per plan, and one object per step makes Python's garbage collector run about twice as often
    (benchmarks/plan_time.py shows planning time). `steps` builds `Step`s for a reader."""

    during: list[int] = field(default_factory=list)  # per step, in time order
    nodes: list[str] = field(default_factory=list)  # the node each step runs
    spans: list[tuple[int, int, str]] = field(default_factory=list)  # (first step, graph index, phase) per graph run
    boundary: int = 0  # live bytes between the last forward and the first backward graph
    # simulate(limit=...) stopped at the first step over the limit: the steps end there, its peak is that step's
    cut_short: bool = False
    _peak_step: Step | None = field(default=None, repr=False, compare=False)
    _peak_index: int | None = field(default=None, repr=False, compare=False)

    @property
    def peak(self) -> int:
        i = self.peak_index
        return self.during[i] if i is not None else self.boundary

    @property
    def peak_index(self) -> int | None:
        """The first step with the most live bytes (where a replay was cut short, its last: the one over)."""
        if self._peak_index is None and self.during:
            self._peak_index = self.during.index(max(self.during))
        return self._peak_index

    @property
    def peak_step(self) -> Step | None:
        if self._peak_step is None and self.peak_index is not None:
            self._peak_step = self._step(self.peak_index)
        return self._peak_step

    @property
    def steps(self) -> list[Step]:
        """Every step as a `Step` (the peak's is `peak_step` itself)."""
        peak = self.peak_index
        return [self.peak_step if i == peak else self._step(i) for i in range(len(self.during))]

    def _step(self, i: int) -> Step:
        _, graph, phase = self.spans[bisect.bisect_right(self.spans, (i, math.inf)) - 1]
        return Step(graph, phase, self.nodes[i], self.during[i])


def _round(n: int, granularity: int) -> int:
    return -(-n // granularity) * granularity if granularity > 1 else n


class _Heap:
    """Live storages, reference-counted by the values that alias them.

    Node names repeat across the graphs of one step (every graph has an `addmm`), so a storage is
    keyed by the graph it belongs to (`scope`, set before each graph runs) as well as by its name.
    """

    def __init__(self, granularity: int) -> None:
        self.refs: dict[tuple[int, str], int] = {}
        self.size: dict[tuple[int, str], int] = {}
        self.live = 0
        self.granularity = granularity
        self.scope = 0

    def add(self, name: str, nbytes: int) -> None:
        storage = (self.scope, name)
        if storage not in self.refs:
            self.refs[storage] = 0
            self.size[storage] = _round(nbytes, self.granularity)
            self.live += self.size[storage]
        self.refs[storage] += 1

    def sole_bytes(self, name: str) -> int | None:
        return self.size[(self.scope, name)] if self.refs.get((self.scope, name)) == 1 else None

    def drop(self, name: str) -> None:
        storage = (self.scope, name)
        self.refs[storage] -= 1
        if self.refs[storage] == 0:
            self.live -= self.size.pop(storage)
            del self.refs[storage]


def _kernel_order(g: GraphProfile, order: list[str], heap: _Heap, held: set[str], inputs: list[str]) -> list[str]:
    """The order a graph runs in: its own, or for a graph Inductor runs, the one its scheduler picks
    (inplace.py): the least-peak-first one where its peak is lower than the graph's own order's, both
    estimated as Inductor does, before it decides which outputs to write in place (a tie keeps the
    graph's order)."""
    if not any(p.fused or p.inplace for p in g.nodes.values()):
        return order
    # The choice depends on the graph, the order, what is held and handed in, and this graph's own storages
    # on the heap: both orders start from the same heap, the other graphs' storages add the same bytes to
    # every step of either, and a trial frees only this graph's. A search that changes one graph's saved
    # set asks the same question of every other graph again, and those repeats were most of a many-graph
    # smallest-peak search (benchmarks/plan_time.py).
    def key() -> tuple:
        own = frozenset((name, size, heap.refs[(scope, name)]) for (scope, name), size in heap.size.items()
                        if scope == heap.scope)
        return heap.granularity, tuple(order), frozenset(held), tuple(inputs), own
    return _ORDERS.get(g, key, lambda: _weigh_orders(g, order, heap, held, inputs))


class GraphMemo:
    """Answers about a graph, remembered by key while the `remember` switch is on (autoremat/switches.py),
    the least recently used forgotten once there are more than `size`. An entry holds its graph weakly and
    is found only for that graph: a graph's id is reused once it is gone."""

    every: list[GraphMemo] = []

    def __init__(self, size: int) -> None:
        self.size = size
        self.entries: OrderedDict[tuple, tuple[weakref.ref, Any]] = OrderedDict()
        GraphMemo.every.append(self)

    def get(self, g: GraphProfile, key: Callable[[], tuple], compute: Callable[[], Any]) -> Any:
        """compute(), or what it gave before for `g` and key() (called only while `remember` is on)."""
        if not switches.current().remember:
            return compute()
        k = (id(g), *key())
        hit = self.entries.get(k)
        if hit is not None and hit[0]() is g:
            self.entries.move_to_end(k)
            return hit[1]
        value = compute()
        self.entries[k] = (weakref.ref(g), value)
        if len(self.entries) > self.size:
            self.entries.popitem(last=False)
        return value


def forget() -> None:
    """Every GraphMemo emptied (a benchmark timing a search from nothing remembered, a test)."""
    for memo in GraphMemo.every:
        memo.entries.clear()


# Each entry holds a graph's orders or last uses: a few tens of KB for a graph of 1,000 nodes.
_ORDERS = GraphMemo(256)
_LAST_USES = GraphMemo(256)


def _weigh_orders(g: GraphProfile, order: list[str], heap: _Heap, held: set[str], inputs: list[str]) -> list[str]:
    other = least_peak_first(g, order, held, inputs, heap.granularity)
    if other == order:
        return order
    trial = []
    for o in (order, other):
        copy = _Heap(heap.granularity)
        copy.refs, copy.size, copy.live, copy.scope = dict(heap.refs), dict(heap.size), heap.live, heap.scope
        tl = Timeline()
        _run(g, o, copy, held, inputs, "", tl, in_place=False)
        trial.append(max(tl.during, default=0))
    return other if trial[1] < trial[0] else order


def _run(
    g: GraphProfile,
    order: list[str],
    heap: _Heap,
    held: set[str],
    inputs: list[str],
    phase: str,
    tl: Timeline,
    reads: dict[str, tuple[str, ...]] | None = None,
    storage: dict[str, str] | None = None,
    in_place: bool = True,
    limit: float = INF,
) -> None:
    """Execute `order` on `heap`: allocate outputs, free values after their last use here.

    `inputs` are values alive on entry (owned by this graph from now on); `held` never die here.
    """
    nodes = g.nodes
    reads, storage = reads or {}, storage or {}

    def inputs_of(name: str) -> tuple[str, ...]:
        return reads[name] if name in reads else nodes[base(name)].inputs

    def storage_of(name: str) -> str:
        if name in storage:
            return storage[name]
        p = nodes[base(name)]
        # Computed into a cat's buffer (fusion.concat_writes); Inductor's own estimate of an order does not
        # see this (in_place=False: _kernel_order's trial runs)
        return p.into if p.into and in_place else p.storage

    if any(p.fused or p.inplace for p in nodes.values()):
        # Inductor's kernels read fused values' inputs (inplace.py); most of a search's steps run a graph's same order
        last_use = _LAST_USES.get(g, lambda: (tuple(order),), lambda: kernel_last_use(g, order))
    else:  # eager: each op reads its inputs (copies recomputed twice read copies: cuts.py)
        last_use = {a: i for i, name in enumerate(order) for a in inputs_of(name)}
    # A multi-output op's outputs written over a dying input (recomputed_writes.write_over_dying_input)
    # are not allocated while it runs; the input's buffer is kept for them from the op to their getitem.
    overwritten: dict[str, list[str]] = {}
    for out, r in storage.items():
        p = nodes.get(out)
        if p is not None and p.tuple_parent and p.storage == out and r != out:
            overwritten.setdefault(p.tuple_parent, []).append(out)
    pinned: dict[str, str] = {}  # such an output -> the buffer kept for it until it takes its own reference
    dies: dict[int, list[str]] = {}
    for a, i in last_use.items():
        dies.setdefault(i, []).append(a)
    alive: set[str] = set()
    tl.spans.append((len(tl.during), g.index, phase))
    during_at, names = tl.during, tl.nodes

    def release(name: str) -> None:
        if name in alive and name not in held:
            alive.discard(name)
            heap.drop(storage_of(name))

    for name in inputs:
        if nodes[name].storage:
            alive.add(name)
    for name in list(alive):
        if name not in last_use:  # handed over but never read here
            release(name)

    for i, name in enumerate(order):
        p = nodes[base(name)]
        if in_place and p.inplace and p.storage == name and not p.into:  # writes into an input dying here (inplace.py)
            dying = [a for a in dies.get(i, ()) if a in alive and a not in held]
            reused = donor(g, name, dying, heap.sole_bytes, _round(p.nbytes, heap.granularity))
            if reused:
                release(reused)
        if p.storage:
            root = storage_of(name)
            # the first value computed into a cat's buffer allocates all of it
            heap.add(root, p.nbytes if root == name else nodes[root].nbytes if root == p.into else 0)
            alive.add(name)
        # A multi-output op's outputs are counted by its getitems, one step later; while it runs
        # they exist together with its scratch.
        outs = p.tuple_out_bytes
        for out in overwritten.get(name, ()):
            outs -= nodes[out].nbytes
            pinned[out] = storage[out]
            heap.add(pinned[out], 0)
        during = heap.live + _round(p.transient_bytes, heap.granularity) + _round(outs, heap.granularity)
        during_at.append(during)
        names.append(name)
        if during > limit:  # before the releases: the heap is left as it is while this node runs (live_at_peak)
            raise _OverLimit
        for a in dies.get(i, ()):
            release(a)
        if name not in last_use:
            release(name)
        if name in pinned:
            heap.drop(pinned.pop(name))


def simulate(graphs: list[tuple[GraphProfile, Schedule]], granularity: int = 1, limit: float = INF) -> Timeline:
    """Live bytes over one training step: every forward graph in order, then the backwards reversed.

    With a `limit`, the replay stops at the first step over it (`Timeline.cut_short`, whose peak is that
    step's): a search that only keeps a plan under its best peak so far need not replay the rest of one
    that is already over it, as most of a floor search's trials are."""
    tl = Timeline()
    try:
        _replay(graphs, granularity, limit, tl)
    except _OverLimit:
        tl.cut_short = True
    return tl


def live_at_peak(graphs: list[tuple[GraphProfile, Schedule]], granularity: int = 1,
                 peak: int | None = None) -> list[tuple[GraphProfile, str, int]]:
    """The storages alive while the step's peak node runs (the first, where several reach the peak), as
    (graph, the node whose allocation it is, bytes); with the peak node's transient bytes and unused
    tuple outputs, they make up its `during`. For a caller asking what sets a plan's peak (the loss
    region's chunk counts: which of these more chunks would shrink; the floor search: which recomputed
    values the peak holds). `peak`: these schedules' simulated peak, where the caller has it (a plan's
    timeline), so that the step is replayed once."""
    peak = simulate(graphs, granularity).peak if peak is None else peak
    heap = _Heap(granularity)
    try:
        _replay(graphs, granularity, peak - 1, Timeline(), heap)
    except _OverLimit:
        return [(graphs[scope][0], name, size) for (scope, name), size in heap.size.items()]
    if peak > 0:
        raise ValueError(f"live_at_peak: no step of these schedules reaches the peak given ({peak} B)")
    return []  # nothing allocated at all


def _replay(graphs: list[tuple[GraphProfile, Schedule]], granularity: int, limit: float, tl: Timeline,
            heap: _Heap | None = None) -> None:
    heap = _Heap(granularity) if heap is None else heap
    saved_alive: list[list[str]] = []
    handoffs = region_handoffs([g for g, _ in graphs])
    release = handed_over(graphs, handoffs)
    passed_on: list[set[str]] = [set() for _ in graphs]  # outputs only later regions read: no caller holds them
    for k, name in handoffs:
        passed_on[k].add(name)
    n = len(graphs)
    meets = tied_waits([g for g, _ in graphs])  # freed when the backward of the region they wait for ends
    waiting = {held for grads in meets.values() for held in grads}

    def release_at(moment: int) -> None:
        for k, name in release.get(moment, ()):
            heap.scope = k
            heap.drop(graphs[k][0].nodes[name].storage)

    for scope, (g, sched) in enumerate(graphs):
        heap.scope = scope
        # Values that cross into the backward, and forward outputs (held by the caller), stay.
        held = set(sched.saved) | set(g.fw_outputs)
        _run(g, _kernel_order(g, sched.forward, heap, held, []), heap, held, [], "forward", tl, limit=limit)
        saved_alive.append(list(sched.saved))
        release_at(scope)
    tl.boundary = heap.live
    for scope in reversed(range(n)):
        (g, sched), saved = graphs[scope], saved_alive[scope]
        heap.scope = scope
        tangents = [n for n, p in g.nodes.items() if p.kind == "tangent" and p.nbytes]
        for t in tangents:
            heap.add(g.nodes[t].storage, g.nodes[t].nbytes)
        # Saved values were counted once each by the forward; the backward now owns those
        # references, and gradients are held until the graph returns them.
        # A forward output that only later regions read (not the caller) is theirs, not held: if this
        # backward saved it, it dies at its last use here, after those regions' backwards.
        caller_held = set(g.fw_outputs) - passed_on[scope]
        held = set(g.grad_outputs) | caller_held | (set(tangents) if TANGENTS_HELD else set())
        order = _kernel_order(g, sched.backward, heap, held, saved + tangents)
        _run(g, order, heap, held, saved + tangents, "backward", tl, sched.reads, sched.storage, limit=limit)
        for name in set(g.grad_outputs) | (set(tangents) if TANGENTS_HELD else set()):
            p = g.nodes[name]
            if p.kind in ("backward", "tangent") and p.storage and (scope, name) not in waiting:
                heap.drop(p.storage)
        release_at(2 * n - 1 - scope)
        for k, name in meets.get(scope, ()):
            heap.scope = k
            heap.drop(graphs[k][0].nodes[name].storage)
