"""The loss region's chunk count (autoremat.planning.loss_region): each count's trace solved by its own ILP
(`rows_time.trace_time`: ops once plus the recomputation of its plan), more chunks traced only while they pay.

The planner must let the ILP choose: more chunks as the budget shrinks, none when memory is plentiful.
"""

from __future__ import annotations

import copy
import logging
import math

import pytest
import torch

import autoremat
from autoremat.passes import loss_chunks as LC
from autoremat.passes.loss_chunks import LossOption
from autoremat.planning.planner import CapturePlanner
from autoremat.planning.step_tracing import compile_and_trace
from autoremat.solve import lp
from autoremat.solve import solver as solver_module
from autoremat.solve.ilp import TIE_BYTES, IlpModel
from autoremat.solve.rows_time import least_time, ops_once_time, trace_time
from autoremat.solve.solver_options import SolverOptions
from examples.models import gpt2
from tests.models import HeadLM

BATCH, SEQ, VOCAB = 2, 32, 2048
COUNTS = (1, 4, 16)
EXACT = SolverOptions("highs", time_limit=30, gap=0)  # trace_time / least_time solved to the end


def traces() -> dict[int, list]:
    """The profiles of one small LM's step with its loss in k chunks, for each k in COUNTS."""
    torch.manual_seed(0)
    model, ex = gpt2(batch=BATCH, seq=SEQ, n_layer=1, n_embd=32, vocab=VOCAB, dropout=0.0)
    out = {}
    for k in COUNTS:
        planner = CapturePlanner(None, device="cpu", optimizer=None, pre_pass=LossOption("loss", k).pre_pass())
        compile_and_trace(copy.deepcopy(model), planner, "eager", (), ex)
        out[k] = planner.profiles
    return out


@pytest.fixture(scope="module")
def alternatives() -> dict[int, list]:
    torch.set_num_threads(1)
    return traces()


def solver() -> lp.Solver:
    return lp.highs(time_limit=30, gap=0)


def test_with_room_for_everything_one_chunk_is_fastest(alternatives) -> None:
    """With memory for everything, each trace costs its ops once plus only what may not be saved (a view,
    which would hold its base) recomputed; more chunks are the same FLOPs in more, smaller kernels, each
    launched, so the whole loss region is the fastest."""
    times = {k: trace_time(graphs, 10**12, options=EXACT) for k, graphs in alternatives.items()}
    for k, graphs in alternatives.items():
        assert times[k] >= ops_once_time(graphs), k
    assert min(times, key=times.get) == 1, times
    assert ops_once_time(alternatives[1]) < min(ops_once_time(alternatives[k]) for k in COUNTS if k > 1)


def test_near_the_least_peak_only_a_chunked_trace_has_a_plan(alternatives) -> None:
    """The rows' least peak of each trace (its min-peak solve): chunking frees logits-sized tensors, so the
    whole trace's is the highest, and just above the lowest one only a chunked trace has a plan."""
    least = {k: IlpModel(g, 1, block_drag=True, shared_blocks=True).solve(None, solver(), min_peak=True).predicted_peak
             for k, g in alternatives.items()}
    lowest = min(least, key=least.get)
    assert lowest > 1 and least[1] > least[lowest], least
    budget = int(least[lowest] * 1.02)
    assert budget < least[1]
    assert trace_time(alternatives[1], budget, options=EXACT) is None
    assert trace_time(alternatives[lowest], budget, options=EXACT) is not None


@pytest.mark.slow
def test_the_planner_lets_the_ilp_choose_the_chunk_count() -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model, ex = gpt2(batch=BATCH, seq=SEQ, n_layer=1, n_embd=32, vocab=VOCAB, dropout=0.0)
    with pytest.raises(autoremat.BudgetError) as info:
        autoremat.optimize(copy.deepcopy(model), 1, ex, optimizer=None, outputs="loss", compiler="eager")
    floor = info.value.smallest_budget
    # Just above the floor: at the floor itself the ILP's rows (upper bounds of the simulator) may see
    # no room, and each count is then planned in full (a heuristic's plan is what reaches the floor).
    tight, roomy = (autoremat.optimize(copy.deepcopy(model), b, ex, optimizer=None, outputs="loss",
                                       compiler="eager").plan.loss for b in (int(1.5 * floor), "1GB"))
    assert tight["chosen_by"] == "ilp", tight
    assert tight["chunks"] > 1 and set(tight["candidates"]) == {str(k) for k in LC.candidates(BATCH * SEQ)}, tight
    assert "chosen by the ILP" in tight["candidates"][str(tight["chunks"])]
    # Counts are traced in increasing order until one is no faster than fewer chunks: the traced ones come first.
    traced = [k for k, v in tight["candidates"].items() if not v.startswith("not traced")]
    assert traced == [str(k) for k in LC.candidates(BATCH * SEQ)][:len(traced)], tight
    # With everything saved the 1-chunk step fits 1 GB: no other count is traced.
    assert roomy["chosen_by"] == "everything saved fits unchunked" and roomy["chunks"] == 1, roomy
    assert list(roomy["candidates"]) == ["1"], roomy


@pytest.mark.parametrize("block_drag", [False, True])
def test_the_ilps_rows_bound_the_simulated_peak_of_each_plan_they_give(alternatives, block_drag) -> None:
    """ilp.py's rows are conservative: first(v) is a lower and last(v) an upper bound of when v is alive, so
    the peak the rows see at a solution is at least the exact simulator's for that plan. Checked at seven rooms
    from the rows' least peak to the peak of saving everything, on each trace.

    In a chunked loss, a chunk's logits feed `logits - logsumexp`, which only `exp` reads, which the backward
    reads: with both recomputed (the block-drag model lets a recomputed reader drag its input), saved logits
    are read when `exp` is recomputed, and a multi-output op recomputed for one output (a layer norm) makes its
    mean and rstd then too. Rows that count neither see less than the simulator on the 4- and 16-chunk
    traces, and every plan near the floor is then recalibrated round after round."""
    for k, graphs in alternatives.items():
        model = IlpModel(graphs, 1, block_drag=block_drag)
        least = model.solve(None, solver(), min_peak=True).predicted_peak
        # the rows may see more than saving everything peaks at (block drag's bounds on the 1-chunk trace)
        everything = max(least, solver_module.evaluate(graphs, solver_module.save_all(graphs))[1].peak)
        for i in range(7):
            room = math.ceil(least + (everything - least) * i / 6)
            result = model.solve(room, solver())
            assert result.saved is not None, (k, room)
            simulated = solver_module.evaluate(graphs, result.saved)[1].peak
            # the rows hold whole bytes; the solver's running sums carry float rounding
            assert simulated <= round(result.predicted_peak), (k, room, result.predicted_peak, simulated)


def test_a_trace_that_cannot_beat_another_stops_at_its_bound(alternatives, monkeypatch) -> None:
    """`trace_time(beat=...)`: the survey of chunk counts needs a count's time only where it beats the fastest
    count so far. Against a time the trace beats, the answer is its time without `beat`; against one it cannot
    beat, the MIP stops at a bound no lower than `beat` and no higher than its time (proving the exact time
    of a count that cannot win takes the MIP far longer than reaching that bound)."""
    graphs = alternatives[4]
    least = IlpModel(graphs, 1, block_drag=True, shared_blocks=True).solve(None, solver(), min_peak=True).predicted_peak
    budget = math.ceil(least * 1.05)
    exact = trace_time(graphs, budget, options=EXACT)
    ops = ops_once_time(graphs)
    assert exact is not None and exact > ops, "no recomputation at this budget: this checks less than it says"
    assert trace_time(graphs, budget, options=EXACT, beat=2 * exact) == pytest.approx(exact)
    beat, made, real = ops + 0.5 * (exact - ops), [], lp.highs
    monkeypatch.setattr(lp, "highs", lambda *a, **k: made.append(real(*a, **k)) or made[-1])
    bounded = trace_time(graphs, budget, options=EXACT, beat=beat)
    assert made[-1].stopped_at is not None, "the MIP ended before its bound reached `beat`"
    assert beat <= bounded <= exact * (1 + 1e-9), (beat, bounded, exact)


def test_a_lower_bound_stops_once_it_reaches_its_target_or_a_plan_shows_it_cannot(alternatives, monkeypatch) -> None:
    """`least_time(at_least=...)`: a lower bound of the trace's rows time, needed only against `at_least`. Solved
    to the end (gap 0) it is the time itself; against a target between T0 and that time, the MIP stops at a
    bound at least the target; against one above the time, it stops at the first plan below the target (no
    bound can reach it then) and returns a bound below it (otherwise the bound can run its whole time
    limit to show what its first plan already showed)."""
    graphs = alternatives[4]
    least = IlpModel(graphs, 1, block_drag=True, shared_blocks=True).solve(None, solver(), min_peak=True).predicted_peak
    budget = math.ceil(least * 1.05)
    exact, ops = trace_time(graphs, budget, options=EXACT), ops_once_time(graphs)
    assert exact is not None and exact > ops, "no recomputation at this budget: this checks less than it says"
    # to the end: the time, less what the objective's saved-bytes tie-break may add (TIE_BYTES of the ops)
    assert exact - TIE_BYTES * ops <= least_time(graphs, budget, at_least=float("inf"), options=EXACT) <= exact
    made, real = [], lp.highs
    monkeypatch.setattr(lp, "highs", lambda *a, **k: made.append(real(*a, **k)) or made[-1])
    target = ops + 0.5 * (exact - ops)
    bounded = least_time(graphs, budget, at_least=target, options=EXACT)
    assert made[-1].stopped_at is not None and target <= bounded <= exact * (1 + 1e-9), (target, bounded, exact)
    bounded = least_time(graphs, budget, at_least=2 * exact, options=EXACT)
    assert made[-1].gave_up and ops <= bounded < 2 * exact, (bounded, exact)


def test_the_loss_region_nodes_are_tagged_through_aotautograd(alternatives) -> None:
    """The chunked loss's dynamo node carries LOSS_REGION_TAG; AOTAutograd copies it onto the joint nodes
    traced from it, forward and backward, except a sum of gradient contributions (it copies no meta onto
    those). So every chunk-sized logits value ([rows / 4, vocabulary]) of the 4-chunk trace and its gradient
    is tagged, or adds tagged gradients (what loss_region.bounds.binds_outside counts as the region's), and nothing
    inside the transformer block is tagged."""
    (g,) = alternatives[4]
    rows = BATCH * SEQ // 4
    logits = {n: p for n, p in g.nodes.items() if p.shape == (rows, VOCAB)}
    assert {p.kind for p in logits.values()} == {"forward", "backward"}, logits
    assert all(p.loss_region for p in logits.values() if p.kind == "forward")
    untagged = [p for p in logits.values() if not p.loss_region]
    assert all(p.kind == "backward" and p.target.startswith("aten.add")
               and any(g.nodes[i].loss_region for i in p.inputs) for p in untagged), untagged
    assert len(untagged) < len(logits) / 2, untagged
    block = [n for n, p in g.nodes.items() if p.module.startswith("transformer.h.")]
    assert block and not any(g.nodes[n].loss_region for n in block)


def test_each_chunks_nodes_carry_its_number_and_the_shared_ones_none(alternatives) -> None:
    """torch_internals.annotate tags each chunk's ops with its number, forward and backward. The ops the chunks
    share (the rows' split, the gradients' concatenation) carry none: the tag does not outlive its chunk
    (torch's own annotate wrote it into the chunked loss node's meta, and every later op traced from that node
    carried chunk 1). Chunks 2 to 4 run the same ops; the first has one add fewer (its loss starts the sum). Each
    chunk's weight-gradient product is accumulated into the running sum (an addmm, passes/matmul_accumulation.py)
    but the one that starts it, the last chunk's (the backward runs the chunks last to first), a plain mm."""
    (g,) = alternatives[4]
    ops: dict[int, list[str]] = {}
    for p in g.nodes.values():
        ops.setdefault(p.loss_chunk, []).append(p.target)
    assert set(ops) == {0, 1, 2, 3, 4}, set(ops)
    assert {p.kind for p in g.nodes.values() if p.loss_chunk} == {"forward", "backward"}
    shared = {p.target for p in g.nodes.values() if p.loss_region and not p.loss_chunk}
    assert {"aten.split.Tensor", "aten.cat.default"} <= shared, shared
    assert [ops[k].count("aten.addmm.default") for k in (1, 2, 3, 4)] == [1, 1, 1, 0]
    ops[4][ops[4].index("aten.mm.default")] = "aten.addmm.default"
    for k in ops:  # the product that starts the sum is read through two transposes, an accumulated one through none
        ops[k] = [t for t in ops[k] if t != "aten.t.default"]
    assert sorted(ops[2]) == sorted(ops[3]) == sorted(ops[4])
    first = list(ops[2])
    first.remove("aten.add.Tensor")
    assert sorted(ops[1]) == sorted(first)


def _hand_graph():
    """Two chunks of 8 rows: a logits value z_i = h_i W^T per chunk, a weight-gradient piece w_i per chunk, and
    the sum of the pieces, untagged, into the gradient output. W is [10, 8]: its 8 columns equal a chunk's rows,
    so only the gradient chain tells its pieces are as large at any count. Bandwidth 100 B/s, launch 1 s."""
    from autoremat.model.devices import DeviceSpec
    from autoremat.model.graph_profile import GraphProfile, NodeProfile

    def node(name, kind, target, inputs, shape, time_s=0.0, moved=0.0, chunk=0):
        return NodeProfile(name=name, kind=kind, target=target, inputs=inputs, storage=name, nbytes=0, dtype="float32",
                           shape=shape, time_s=time_s, bytes_moved=moved, loss_chunk=chunk, loss_region=bool(chunk))
    mm = "aten.mm.default"
    nodes = [node("w", "param", "placeholder", (), (10, 8)), node("h1", "input", "placeholder", (), (8, 8)),
             node("h2", "input", "placeholder", (), (8, 8)),
             # memory-bound: h_i 256 B + W 320 B + z_i 320 B at 100 B/s, and a launch
             node("z1", "forward", mm, ("h1", "w"), (8, 10), 9.96, 896, chunk=1),
             node("z2", "forward", mm, ("h2", "w"), (8, 10), 9.96, 896, chunk=2),
             # compute-bound: 19 s of arithmetic
             node("w1", "backward", mm, ("z1", "h1"), (10, 8), 20.0, 896, chunk=1),
             node("w2", "backward", mm, ("z2", "h2"), (10, 8), 20.0, 896, chunk=2),
             node("gw", "backward", "aten.add.Tensor", ("w1", "w2"), (10, 8), 10.6, 960)]
    graph = GraphProfile(nodes={n.name: n for n in nodes}, fw_outputs=["z1", "z2"], grad_outputs=["gw"])
    dev = DeviceSpec(name="hand", kind="cpu", flops={"fp32": 1.0}, mem_bandwidth=100.0, memory_bytes=0,
                     alloc_granularity=1, launch_overhead_s=1.0)
    return graph, dev


def test_a_chunks_ops_split_into_more_copies_cost_at_least_this_much_more() -> None:
    """loss_region.bounds.least_ops_time, worked by hand for 2 chunks of 8 rows going to 8 chunks of 2 (m = 4 copies
    of each op of a chunk), each op costing max(its compute, (m x fixed + rows bytes) / bandwidth) + m launches:
    - z_i, memory-bound, reads W (320 B, fixed): max(8.96, (4 x 320 + 576) / 100) + 4 - 9.96 = 12.60 more;
    - w_i, compute-bound: only the launches, 3 more;
    - the sum adds chunk 2's piece: all 960 B fixed (the gradient chain), max(9.6, 38.4) + 4 - 10.6 = 31.80 more.
    The truth for the sum is 7 adds for 1 (63.6 more): an op with b - 1 copies is counted as such."""
    from autoremat.planning.loss_region.bounds import least_ops_time

    graph, dev = _hand_graph()
    least = least_ops_time([graph], 100.0, 16, 2, 8, dev)
    assert least == pytest.approx(100.0 + 2 * 12.60 + 2 * 3.0 + 31.8)
    graph.grad_outputs = []  # then W's pieces and their sum count as rows: the sum only adds its launches
    assert least_ops_time([graph], 100.0, 16, 2, 8, dev) == pytest.approx(100.0 + 2 * 12.60 + 2 * 3.0 + 3.0)
    for p in graph.nodes.values():
        p.loss_chunk = 0
    assert least_ops_time([graph], 100.0, 16, 2, 8, dev) is None  # no tags: no bound


def test_the_counts_end_where_the_floor_plan_peaks_outside_the_loss_region(monkeypatch) -> None:
    """A floor query plans counts in full while the floors fall. Once a count's most frugal plan peaks
    outside the loss region, the counts after it are not planned (loss_region.bounds.binds_outside); the floor
    is the one planning every count in full while floors fall finds."""
    from autoremat.planning.loss_region import bounds
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model, ex = gpt2(batch=BATCH, seq=SEQ, n_layer=1, n_embd=32, vocab=VOCAB, dropout=0.0)

    def floor_query() -> autoremat.BudgetError:
        with pytest.raises(autoremat.BudgetError) as info:
            autoremat.optimize(copy.deepcopy(model), 1, ex, optimizer=None, outputs="loss", compiler="eager",
                               progress=False)
        return info.value
    ruled = floor_query()
    monkeypatch.setattr(bounds, "binds_outside", lambda *a, **k: False)
    every = floor_query()
    assert ruled.smallest_budget == every.smallest_budget, (ruled.smallest_budget, every.smallest_budget)
    # BudgetError.peak_step: the step the floor plan peaks at, whose live bytes give the floor
    assert ruled.ledger.needs(ruled.peak_step.during) == ruled.smallest_budget, ruled.peak_step
    planned = [str(e).partition("chunk counts planned: ")[2].partition(")")[0].split(", ") for e in (ruled, every)]
    assert len(planned[0]) < len(planned[1]), planned  # the rule left a count out on this model


def test_a_floor_set_by_the_optimizer_step_ends_the_counts() -> None:
    """optimizer.step()'s temporaries (after the backward, never beside the activations) set the floor when
    the step needs no more with activations than without: then no chunk count can lower it. Worked by hand:
    fixed 1,000 B, optimizer.step() 500 B, SLACK 1,024 B, so the floor with no activations is 2,524 B."""
    from autoremat.model.ledger import Ledger
    from autoremat.planning.loss_region.bounds import _by_optimizer
    ledger = Ledger(parameters=400, gradients=400, optimizer_state=200, optimizer_step=500)
    assert ledger.needs(0) == 2524
    assert _by_optimizer(autoremat.BudgetError("", ledger, 2524))  # activations of at most 500 B
    assert not _by_optimizer(autoremat.BudgetError("", ledger, 2525))  # 501 B of activations set it
    assert not _by_optimizer(autoremat.BudgetError("", ledger, None))  # the fixed parts alone exceed the budget
    assert not _by_optimizer(autoremat.BudgetError("", Ledger(parameters=400, gradients=400, optimizer_state=200),
                                                   2024))  # no optimizer: nothing but activations to set it


def test_a_count_a_real_step_refused_ends_the_counts(caplog) -> None:
    """At the floor the model names, the chosen count's plan measures over on a real step (scratch an eager
    Function's backward allocates, which no trace sees), and with the gap reserved its re-plan no longer fits.
    The other counts' plans in full would be priced by the same model, which just missed: the step is refused
    at once, naming a budget over the floor, and says the refusal came from a real step (`benchmarks/plan_time.py
    --cliff --models gated`, a model with eager code, times planning at its floor)."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    # eager code between the trunk and the loss region, whose backward allocates as much as the logits
    model = HeadLM(VOCAB, 32, bias=False, gate=True, scratch=4 * 64 * VOCAB)
    ids = torch.randint(0, VOCAB, (4, 64))
    ex = {"ids": ids, "labels": ids}
    kw = dict(optimizer=None, outputs="loss", compiler="eager", progress=False)
    with pytest.raises(autoremat.BudgetError) as query:
        autoremat.optimize(copy.deepcopy(model), 1, ex, **kw)
    floor = query.value.smallest_budget
    assert not query.value.measured  # the floor query runs no step
    with caplog.at_level(logging.INFO, logger="autoremat"), pytest.raises(autoremat.BudgetError) as refused:
        autoremat.optimize(copy.deepcopy(model), floor, ex, **kw)
    assert refused.value.measured and refused.value.smallest_budget > floor, str(refused.value)
    assert "did not predict" in caplog.text  # verification measured the miss and re-planned
    assert "planning the counts in full" not in caplog.text


def _four_chunk_backward(vocab: int, d: int, rows: int = 8) -> tuple:
    """The backward of a loss region in 4 chunks of 2 token rows (8 rows), by hand, in fp32: per chunk its
    logits gradient g (2 x vocab), weight gradient w (vocab x d) and hidden rows' gradient h (2 x d); the
    weight gradients summed by untagged adds s (AOTAutograd tags no gradient sums), the hidden rows' pieces
    concatenated after the last chunk (dh). `rows` is the row count the loss pass reports. Returns (the
    count as traced, its plan)."""
    from types import SimpleNamespace

    from autoremat.model.graph_profile import GraphProfile, NodeProfile
    from autoremat.model.memory import simulate
    from autoremat.model.schedule import Schedule
    from autoremat.passes.loss_chunks import Report
    from autoremat.planning.loss_region.count_trace import ChunkCountTrace
    from autoremat.solve.decision import Decision

    def node(name, shape, inputs=(), region=True):
        return NodeProfile(name=name, kind="backward", target="t", inputs=tuple(inputs), storage=name,
                           nbytes=4 * shape[0] * shape[1], shape=shape, loss_region=region)
    nodes, order = [], []
    for i in range(1, 5):
        nodes += [node(f"g{i}", (2, vocab)), node(f"w{i}", (vocab, d), [f"g{i}"]), node(f"h{i}", (2, d), [f"g{i}"])]
        order += [f"g{i}", f"w{i}", f"h{i}"]
        if i > 1:
            nodes.append(node(f"s{i}", (vocab, d), ["w1" if i == 2 else f"s{i - 1}", f"w{i}"], region=False))
            order.append(f"s{i}")
    nodes.append(node("dh", (8, d), [f"h{i}" for i in range(1, 5)]))
    order.append("dh")
    g = GraphProfile(nodes={n.name: n for n in nodes}, fw_outputs=[], grad_outputs=["s4", "dh"])
    schedule = Schedule(forward=[], backward=order, saved=[], recomputed=[])
    plan = Decision([set()], [schedule], simulate([(g, schedule)]), 0.0, "optimal", "by hand")
    loss = LossOption("loss", 4, [Report(sites=1, rewritten=1, rows=rows, vocab=vocab)])
    return ChunkCountTrace(SimpleNamespace(calls=(g,)), loss), plan


def test_more_chunks_are_not_traced_where_the_peak_holds_nothing_they_shrink() -> None:
    """loss_region.bounds.binds_outside on a backward worked out by hand (_four_chunk_backward).

    Vocabulary 8, d = 3: the peak is the last add, s4: 384 B, of h1..h4 (24 B each: pieces the concatenation
    gathers from every chunk), s3, w4 and s4 (96 B each, parameter-sized). More chunks shrink none of them:
    the counts end. Vocabulary 64, d = 1: the peak is in the last chunk, at h4: 1,056 B, with its logits
    gradient g4 alive (512 B, which 16 chunks would make 4 times smaller): they go on. With the loss over 32
    rows, chunks of 8 rows, the weight gradients' 8 rows count as a chunk's by chance: they go on."""
    from autoremat.model.memory import live_at_peak
    from autoremat.planning.loss_region.bounds import binds_outside

    count, plan = _four_chunk_backward(8, 3)
    assert (plan.timeline.peak_step.node, plan.peak) == ("s4", 384)
    (g,) = count.trace.calls
    assert {n: b for _, n, b in live_at_peak([(g, plan.schedules[0])])} == {
        "h1": 24, "h2": 24, "h3": 24, "h4": 24, "s3": 96, "w4": 96, "s4": 96}
    assert binds_outside(count, plan)
    count, plan = _four_chunk_backward(64, 1)
    assert (plan.timeline.peak_step.node, plan.peak) == ("h4", 1056)
    (g,) = count.trace.calls
    assert {n: b for _, n, b in live_at_peak([(g, plan.schedules[0])])} == {
        "h1": 8, "h2": 8, "h3": 8, "s3": 256, "g4": 512, "w4": 256, "h4": 8}
    assert not binds_outside(count, plan)
    assert not binds_outside(*_four_chunk_backward(8, 3, rows=32))


def test_a_counts_ops_cost_no_less_than_the_two_counts_before_it_extrapolate_to(alternatives) -> None:
    """loss_region.choice.Traces.least_base_time: the time with nothing recomputed grows convexly with the chunk count
    (each chunk's ops on rows/k rows under the roofline, plus a launch each), so the 64-chunk trace costs at
    least the line through the 4- and 16-chunk traces, extrapolated: the bound that leaves the 64-chunk trace
    untraced when fewer chunks are already faster. Checked on the real traces of a 1-layer GPT-2."""
    from types import SimpleNamespace

    from autoremat.planning.loss_region.choice import Traces
    from autoremat.planning.loss_region.count_trace import ChunkCountTrace

    torch.manual_seed(0)
    model, ex = gpt2(batch=BATCH, seq=SEQ, n_layer=1, n_embd=32, vocab=VOCAB, dropout=0.0)
    planner = CapturePlanner(None, device="cpu", optimizer=None, pre_pass=LossOption("loss", 64).pre_pass())
    compile_and_trace(copy.deepcopy(model), planner, "eager", (), ex)
    base = {k: ops_once_time(g) for k, g in {**alternatives, 64: planner.profiles}.items()}
    loss = LossOption("loss", None, [LC.Report(sites=1, rewritten=0, rows=BATCH * SEQ, vocab=VOCAB)])
    traces = Traces(None, ChunkCountTrace(SimpleNamespace(graphs=tuple(alternatives[1])), loss), 1, [])
    traces.base_time.update({k: base[k] for k in COUNTS})  # as tracing those counts would have set them
    least, how = traces.least_base_time(64)
    assert least == pytest.approx(base[16] + 4 * (base[16] - base[4])) and "4- and 16-chunk" in how
    assert base[4] < base[16] < least <= base[64], base
    assert traces.least_base_time(16) is None  # traced: its own time is known, no bound is needed
    traces.base_time = {1: base[1], 4: base[4]}
    assert traces.least_base_time(64) is None  # one chunked count gives no slope, and its trace is not at hand


def test_the_largest_chunked_trace_bounds_a_larger_count_op_by_op(alternatives) -> None:
    """With only the 4-chunk trace at hand, loss_region.bounds.least_ops_time bounds the 16-chunk trace's ops once from
    below, on the real traces of a 1-layer GPT-2 (no slope to extrapolate yet); not under Inductor."""
    from types import SimpleNamespace

    from autoremat.model.devices import get_device
    from autoremat.planning.loss_region.choice import Traces
    from autoremat.planning.loss_region.count_trace import ChunkCountTrace

    base = {k: ops_once_time(g) for k, g in alternatives.items()}
    loss = LossOption("loss", None, [LC.Report(sites=1, rewritten=0, rows=BATCH * SEQ, vocab=VOCAB)])
    step = SimpleNamespace(compiler="eager", dev=get_device("cpu"))
    traces = Traces(step, ChunkCountTrace(SimpleNamespace(graphs=tuple(alternatives[1])), loss), 1, [])
    traces.traced[4] = ChunkCountTrace(SimpleNamespace(graphs=tuple(alternatives[4])), loss)
    traces.base_time[4] = base[4]
    least, how = traces.least_base_time(16)
    assert base[4] < least <= base[16] and "4-chunk trace" in how, (least, base)
    step.compiler = "inductor"
    assert traces.least_base_time(16) is None


@pytest.fixture(scope="module")
def two_layers() -> tuple[dict[int, list], LossOption]:
    """A 2-layer GPT-2 (d 64, 4 x 64 tokens, vocabulary 1,024) traced with its loss in 4 and 16 chunks: most
    of what its plans recompute near the floor is in the blocks, outside the loss region."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model, ex = gpt2(batch=4, seq=64, n_layer=2, n_embd=64, vocab=1024, dropout=0.0)
    out = {}
    for k in (4, 16):
        planner = CapturePlanner(None, device="cpu", optimizer=None, pre_pass=LossOption("loss", k).pre_pass())
        compile_and_trace(copy.deepcopy(model), planner, "eager", (), ex)
        out[k] = planner.profiles
    return out, LossOption("loss", 4, [LC.Report(sites=1, rewritten=0, rows=4 * 64, vocab=1024)])



def _four_chunks(graphs: dict[int, list], loss: LossOption):
    from types import SimpleNamespace

    from autoremat.planning.loss_region.count_trace import ChunkCountTrace

    return ChunkCountTrace(SimpleNamespace(graphs=tuple(graphs[4])), loss)


def test_no_count_recomputes_less_outside_the_loss_region_than_its_rows_with_the_region_free(two_layers) -> None:
    """loss_region.bounds.least_outside: the 4-chunk trace with its loss region costing nothing (`region_free`) is a
    relaxation of every count's rows, so what its rows must recompute bounds each count's from below: ops once
    plus that bound is at most `trace_time` of the 4- and the 16-chunk trace, at five rooms from the 16-chunk
    rows' least peak to the peak of saving everything."""
    from autoremat.planning.loss_region.bounds import least_outside

    graphs, loss = two_layers
    four = _four_chunks(graphs, loss)
    least = IlpModel(graphs[16], 1, block_drag=True, shared_blocks=True).solve(None, solver(), min_peak=True).predicted_peak
    everything = solver_module.evaluate(graphs[4], solver_module.save_all(graphs[4]))[1].peak
    bounds = []
    for i in range(5):
        room = math.ceil(least + (everything - least) * i / 4)
        bounds.append(least_outside(four, room, float("inf"), 1, EXACT))
        for k, g in graphs.items():
            time_s = trace_time(g, room, options=EXACT)
            assert time_s is None or ops_once_time(g) + bounds[-1] <= time_s * (1 + 1e-9), (k, room, bounds[-1])
    assert bounds[0] > 0, "nothing recomputed outside the region at the least room: this checks less than it says"


def test_a_count_the_rows_outside_the_region_rule_out_is_not_traced(two_layers, monkeypatch) -> None:
    """At 1.3 times the 16-chunk rows' least peak the 4-chunk plan takes T4; 16 chunks with nothing recomputed
    take at least least16 < T4 (so ops alone do not end the survey), but no count recomputes less than R outside
    the loss region, and least16 + R >= T4: the 16-chunk trace is never made (a trace made only to lose). Nearer
    the least peak the 4-chunk plan recomputes more than 16 chunks would, and the survey rightly traces them."""
    from types import SimpleNamespace

    from autoremat.model.devices import get_device
    from autoremat.planning.loss_region import choice as loss_region
    from autoremat.planning.loss_region.bounds import least_outside

    graphs, loss = two_layers
    room = math.ceil(1.3 * IlpModel(graphs[16], 1, block_drag=True, shared_blocks=True)
                     .solve(None, solver(), min_peak=True).predicted_peak)
    dev = get_device("cpu")
    step = SimpleNamespace(compiler="eager", dev=dev, ledger=SimpleNamespace(room=lambda budget: budget),
                           options=SimpleNamespace(solving=lambda: EXACT))
    traces = loss_region.Traces(step, _four_chunks(graphs, loss), room, [])
    traces.counts = [4, 16]
    traces.traced[4], traces.base_time[4] = _four_chunks(graphs, loss), ops_once_time(graphs[4])
    four_time, least16 = trace_time(graphs[4], room, options=EXACT), traces.least_base_time(16)[0]
    outside = least_outside(_four_chunks(graphs, loss), room, float("inf"), dev.alloc_granularity, EXACT)
    assert least16 < four_time <= least16 + outside, (least16, four_time, outside)  # the case this checks

    def no_trace(*a, **k):
        raise AssertionError("the 16-chunk trace was made")
    monkeypatch.setattr(loss_region, "_trace", no_trace)
    table: dict = {}
    fastest, _ = loss_region._survey(traces, room, step, table, {})
    assert fastest == {4: pytest.approx(four_time)}, fastest
    assert table[16].startswith("not traced: no faster than fewer chunks (ops once at least"), table[16]
