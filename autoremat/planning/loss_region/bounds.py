"""Whether more chunks of the loss region can lower a chunk count's peak: the judgements that end the counts
(autoremat.planning.loss_region) before the costliest, the most chunks, is traced and planned."""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

import torch

from autoremat.model.memory import live_at_peak
from autoremat.passes.matmul_accumulation import ACCUMULATING
from autoremat.passes.recompute_names import base
from autoremat.planning.plan import BudgetError
from autoremat.solve.decision import Decision
from autoremat.solve.rows_time import least_time, ops_once_time
from autoremat.solve.solver_options import SolverOptions

if TYPE_CHECKING:
    from autoremat.model.graph_profile import GraphProfile
    from autoremat.planning.loss_region.count_trace import ChunkCountTrace

OUTSIDE = "plan's peak holds nothing sized by the chunk's rows, which is all more chunks shrink"
# least_outside's MIP gets this share of the time limit: it only spares a trace, a few seconds at most
OUTSIDE_SHARE = 1 / 4


def floor_outside(count_trace: ChunkCountTrace, refused: BudgetError) -> bool:
    """Whether a refused count's floor is set where more chunks change nothing: by optimizer.step()'s
    temporaries, or at a peak of its most memory-frugal plan that holds no chunk-sized value (`binds_outside`).
    A larger count's floor search, the longest of a floor query, would then end at the same floor
    (benchmarks/plan_time.py --cliff times the floor query)."""
    return _by_optimizer(refused) or binds_outside(count_trace, refused.frugal)


def binds_outside(count_trace: ChunkCountTrace, plan: Decision | None) -> bool:
    """Whether the count's plan peaks where more chunks shrink nothing that is alive.

    More chunks shrink the values of the chunk being computed: those traced from the chunked loss
    (NodeProfile.loss_region), or backward sums of them (AOTAutograd tags no gradient sums), with a
    dimension that is a chunk's row count (logits, log-probabilities, their gradients, a chunk's hidden
    rows). They do not shrink a parameter-sized value the chunks add up (the head's weight gradient), nor
    the pieces every chunk leaves for one node that reads them all (the hidden rows' gradient, concatenated
    after the last chunk): k times as many pieces, each k times smaller. Where a dimension of another value
    equals a chunk's rows by chance, the value counts as the chunk's: the judgement errs toward tracing more
    counts. Outside the region entirely (its forward runs after the rest of the forward, its backward before
    the rest of the backward) no value of a chunk is alive.

    For a refused count's most frugal plan this bounds what more chunks can do (`floor_outside`); for a plan
    that fits only when planned in full (near the floor) it is a judgement: the peak that binds is one more
    chunks leave alone, so they are not traced (a head whose floor is set by adding up the weight gradient's
    chunks reaches the same floor at any larger count, each costlier to plan). False where that is not
    known: no plan, or a torch that did not carry the loss region's tag onto the backward nodes."""
    if plan is None or plan.timeline.peak_step is None:
        return False
    graphs = list(count_trace.trace.calls)
    if not any(p.loss_region and p.kind == "backward" for g in graphs for p in g.nodes.values()):
        return False
    rows, k = count_trace.loss.rows(), count_trace.loss.chunks or 1
    size = -(-rows // k)
    sizes = {size, rows - (k - 1) * size}
    peak = plan.timeline.peak_step
    live = live_at_peak(list(zip(graphs, plan.schedules)), plan.granularity, plan.peak)
    at_peak = [(g, base(name)) for g, name, _ in live]
    at_peak.append((next(g for g in graphs if g.index == peak.graph), base(peak.node)))
    readers = {id(g): _readers(g) for g in {id(g): g for g, _ in at_peak}.values()}  # the graphs holding them
    return not any(_shrinks(g.nodes, name, sizes, k, readers[id(g)]) for g, name in at_peak)


def _readers(g) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for name, p in g.nodes.items():
        for i in p.inputs:
            out.setdefault(i, []).append(name)
    return out


def _shrinks(nodes: dict, name: str, sizes: set[int], k: int, readers: dict[str, list[str]]) -> bool:
    """Whether more chunks shrink this value: one of the chunk being computed, not a piece a later kernel
    gathers from every chunk (binds_outside). A kernel reads what the views and the fused nodes it computes
    read (fusion.py): under Inductor each chunk's bias-gradient sum is fused into the one kernel that adds
    them all up (fusion.epilogue_reductions), which so gathers every chunk's logits gradient."""
    if not _of_a_chunk(nodes, name, sizes):
        return False
    return k == 1 or not any(sum(_of_a_chunk(nodes, i, sizes) for i in _kernel_reads(nodes, r)) >= k
                             for r in _kernels_reading(nodes, name, readers))


def _inlined(p) -> bool:
    """A node that runs inside its readers' kernels: fused by Inductor, or a view of its input's storage."""
    return p.fused or (p.storage != p.name and p.kind != "param")


def _kernels_reading(nodes: dict, name: str, readers: dict[str, list[str]]) -> set[str]:
    out: set[str] = set()
    for r in readers.get(name, ()):
        out |= _kernels_reading(nodes, r, readers) if _inlined(nodes[r]) else {r}
    return out


def _kernel_reads(nodes: dict, name: str) -> set[str]:
    out: set[str] = set()
    for i in nodes[name].inputs:
        out |= _kernel_reads(nodes, i) if _inlined(nodes[i]) and nodes[i].inputs else {i}
    return out


def _of_a_chunk(nodes: dict, name: str, sizes: set[int]) -> bool:
    p = nodes[name]
    in_region = p.loss_region or (p.kind == "backward" and any(nodes[i].loss_region for i in p.inputs))
    return in_region and any(d in sizes for d in p.shape)


def _by_optimizer(refused: BudgetError) -> bool:
    """Whether optimizer.step()'s temporaries, not the activations, set a refused count's floor: it is what
    the step needs with no activations at all. (Read from the error, not from `ledger.activations`: every
    count's error shares the step's one ledger.)"""
    floor, ledger = refused.smallest_budget, refused.ledger
    return floor is not None and ledger.after_backward > 0 and floor <= ledger.needs(0)


def region_free(count_trace: ChunkCountTrace) -> list[GraphProfile]:
    """Copies of a chunked trace's profiles in which the loss region costs nothing: its values hold no bytes
    and take no time. Its values are those the loss pass tagged, and the backward ones AOTAutograd leaves
    untagged that read them and either read nothing else (the weight gradient's running sum, the hidden
    rows' gradient put together) or have a dimension of a chunk's rows.

    A chunk count changes only those values; everything else is the same op on the same bytes at any count.
    So the ILP's rows of this copy need at most the recomputation any count's rows need (a lower bound:
    loss_region.choice.Traces.least_outside). A value freed that was not the region's only frees more."""
    rows, k = count_trace.loss.rows(), count_trace.loss.chunks or 1
    size = -(-rows // k)
    sizes = {size, rows - (k - 1) * size}
    out = []
    for g in count_trace.trace.graphs:  # the trace's own, as trace_time solves it
        free: set[str] = set()
        nodes = dict(g.nodes)
        for name, p in g.nodes.items():  # in the graph's order: a value's inputs come before it
            reads = [i for i in p.inputs if i in g.nodes]
            gathers = p.kind == "backward" and any(i in free for i in reads) and (
                all(i in free for i in reads) or any(d in sizes for d in p.shape))
            if p.loss_region or p.loss_chunk or gathers:
                free.add(name)
                nodes[name] = dataclasses.replace(p, nbytes=0, transient_bytes=0, tuple_out_bytes=0, time_s=0.0,
                                                  flops=0.0, bytes_moved=0.0)
        out.append(dataclasses.replace(g, nodes=nodes))
    return out


def least_outside(count_trace: ChunkCountTrace, room: int, at_least: float, granularity: int,
                  opts: SolverOptions) -> float:
    """A lower bound of the recomputation the ILP's rows need at any chunk count: what they need for this
    chunked trace with its loss region free (`region_free`), proved by the MIP until it reaches `at_least`.
    Every count recomputes at least this outside the region, so a larger count whose ops once fall short of
    a smaller count's plan by less than it cannot beat that plan, and is not traced."""
    free = region_free(count_trace)
    ops = ops_once_time(free)
    limit = OUTSIDE_SHARE * opts.time_limit
    return least_time(free, room, at_least=ops + at_least, granularity=granularity,
                      options=dataclasses.replace(opts, time_limit=limit)) - ops


def least_ops_time(graphs: list, ops_once: float, rows: int, b: int, k: int, dev) -> float | None:
    """A lower bound of the step's time with nothing recomputed (ops once) with the loss region in k chunks,
    from its trace in b < k chunks (`graphs`, whose ops once take `ops_once`), both splitting the rows evenly;
    None where the trace carries no chunk tags (NodeProfile.loss_chunk).

    Each op of a chunk has k/b times as many copies in k chunks, on k/b times fewer rows. Under the roofline
    (devices.op_time) the b identical copies of an op cost max(compute, (b x fixed + rows)/bandwidth) + b
    launches, where the fixed bytes are those of values as large at any count, and the rows' bytes and the
    compute are shared among the copies; so each copy at b costs at least `_split_cost` more at k. The ops of a
    chunk are those tagged with it, and the gradient sums AOTAutograd leaves untagged that add a chunk's value
    (the weight gradient's running sum: one add more per chunk; a product accumulated into it is an addmm of
its chunk). An op every chunk shares is tagged with none
    and runs once at any count (the rows' split, the mean's divisor, the gradients' concatenation); an op with
    a copy in all chunks but one (a sum of b values has b - 1 adds) counts b - 1 copies, which only lowers the
    bound. A trace that would only show k chunks no faster than b is a large share of a plan's time, so it is
    skipped where the bound already shows it; benchmarks/chunk_bound.py compares the bound with real traces."""
    size, m, extra, tagged = rows // b, k / b, 0.0, False
    for g in graphs:
        fixed = _fixed_values(g, size)
        for p in g.nodes.values():
            tagged |= bool(p.loss_chunk)
            if _copied_per_chunk(p, g.nodes):
                extra += _split_cost(p, g.nodes, fixed, m, dev)
    return ops_once + extra if tagged else None


def _copied_per_chunk(p, nodes: dict) -> bool:
    """Tagged with a chunk, or a gradient sum AOTAutograd left untagged that adds a chunk's value. A chunk's
    addmm (addmv) is the running sum with its product (column sum) accumulated, no chunk's own value: an add reading it (a tied
    weight's other gradient) runs once at any count."""
    if p.loss_chunk:
        return True
    return p.kind == "backward" and p.target == "aten.add.Tensor" and any(
        nodes[i].loss_chunk and nodes[i].target not in ACCUMULATING for i in p.inputs if i in nodes)


def _fixed_values(g, size: int) -> set[str]:
    """The values of a trace in b chunks (of `size` rows) that are as large at any count: those with no
    dimension of a chunk's rows, and, whatever their shape, the parameters, their views, and the pieces summed
    into a gradient output (a weight gradient's pieces and partial sums). A value whose dimension equals a
    chunk's rows by chance (a hidden size) and is none of those counts as a chunk's, which only lowers the
    bound."""
    nodes = g.nodes
    fixed = {n for n, p in nodes.items() if size not in p.shape or p.kind == "param"
             or (p.storage in nodes and nodes[p.storage].kind == "param")}
    todo = [n for n in g.grad_outputs if n in nodes]
    while todo:
        n = todo.pop()
        fixed.add(n)
        p = nodes[n]
        if p.target == "aten.add.Tensor":
            todo += [i for i in p.inputs if i in nodes and nodes[i].shape == p.shape and i not in fixed]
        elif p.target in ACCUMULATING and p.inputs and p.inputs[0] in nodes:
            # a product accumulated into the running sum (passes/matmul_accumulation.py): the sum is its first input
            todo += [i for i in p.inputs[:1] if nodes[i].shape == p.shape and i not in fixed]
        elif p.storage in nodes and p.storage != n and p.storage not in fixed:  # a view of a partial sum
            todo.append(p.storage)
    return fixed


def _split_cost(p, nodes: dict, fixed: set[str], m: float, dev) -> float:
    """What one op of a chunk costs more as m copies on 1/m of its rows (least_ops_time)."""
    if p.fused or p.time_s <= 0:  # inlined into a kernel (no traffic, no launch), or a view
        return 0.0
    launch = dev.launch_overhead_s if p.time_s >= dev.launch_overhead_s else 0.0
    values = [*(i for i in p.inputs if i in nodes), *([] if p.is_tuple else [p.name])]
    held = min(p.bytes_moved, sum(_dense_bytes(nodes[v]) for v in values if v in fixed))
    memory = (m * held + p.bytes_moved - held) / dev.mem_bandwidth
    return max(p.time_s - launch, memory) + m * launch - p.time_s


def _dense_bytes(p) -> int:
    if not p.dtype:
        return 0
    return math.prod(p.shape) * getattr(torch, p.dtype).itemsize
