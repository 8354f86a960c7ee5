"""The loss region's chunk count (autoremat.planning.loss_region): each count's trace solved by its own ILP
(`solver.trace_time`: ops once plus the recomputation of its plan), more chunks traced only while they pay.

The planner must let the ILP choose: more chunks as the budget shrinks, none when memory is plentiful.
"""

from __future__ import annotations

import copy

import pytest
import torch

import autoremat
from autoremat.passes import loss_chunks as LC
from autoremat.passes.loss_chunks import LossOption
from autoremat.planning.planner import CapturePlanner, compile_and_trace
from autoremat.solve import lp
from autoremat.solve.ilp import IlpModel
from autoremat.solve.solver import ops_once_time, trace_time
from examples.models import gpt2

BATCH, SEQ, VOCAB = 2, 32, 2048
COUNTS = (1, 4, 16)


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
    times = {k: trace_time(graphs, 10**12, solver="highs", time_limit=30, gap=0) for k, graphs in alternatives.items()}
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
    assert trace_time(alternatives[1], budget, solver="highs", time_limit=30, gap=0) is None
    assert trace_time(alternatives[lowest], budget, solver="highs", time_limit=30, gap=0) is not None


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
                                       compiler="eager").plan.loss for b in (int(1.3 * floor), "1GB"))
    assert tight["chosen_by"] == "ilp", tight
    assert tight["chunks"] > 1 and set(tight["candidates"]) == {str(k) for k in LC.candidates(BATCH * SEQ)}, tight
    assert "chosen by the ILP" in tight["candidates"][str(tight["chunks"])]
    # Counts are traced in increasing order until one is no faster than fewer chunks: the traced ones come first.
    traced = [k for k, v in tight["candidates"].items() if not v.startswith("not traced")]
    assert traced == [str(k) for k in LC.candidates(BATCH * SEQ)][:len(traced)], tight
    # With everything saved the 1-chunk step fits 1 GB: no other count is traced.
    assert roomy["chosen_by"] == "everything saved fits unchunked" and roomy["chunks"] == 1, roomy
    assert list(roomy["candidates"]) == ["1"], roomy
