"""One ILP over alternative traces of the step (autoremat.solve.ilp_choice): the loss region's chunk count.

The joint model must give what solving each trace's own ILP and keeping the fastest would give, and
the planner must let it choose: more chunks as the budget shrinks, none when memory is plentiful.
"""

from __future__ import annotations

import copy

import pulp
import pytest
import torch

import autoremat
from autoremat.passes import loss_chunks as LC
from autoremat.passes.loss_chunks import LossOption
from autoremat.planning.planner import CapturePlanner, compile_and_trace
from autoremat.solve import lp
from autoremat.solve.ilp import IlpModel
from autoremat.solve.ilp_choice import ChoiceModel
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


def each_alone(alternatives: dict, budget: int) -> dict[int, float]:
    """Per trace, its own ILP's least predicted time (ops once + recomputation) under `budget`."""
    best = {}
    for k, graphs in alternatives.items():
        m = IlpModel(graphs, 1, block_drag=True, shared_blocks=True)
        r = m.solve(budget, solver())
        if r.saved is not None:
            best[k] = sum(p.time_s for g in graphs for p in g.nodes.values()) + pulp.value(m.time_expr)
    return best


def test_the_joint_model_picks_what_solving_each_trace_alone_would(alternatives) -> None:
    joint = ChoiceModel(alternatives, 1)
    low = joint.solve(None, solver(), min_peak=True).predicted_peak
    high = max(m.solve(None, solver(), min_peak=True).predicted_peak for m in
               (IlpModel(g, 1, block_drag=True, shared_blocks=True) for g in alternatives.values()))
    picked = []
    for budget in (int(low * 1.02), int((low + high) / 2), int(high * 3)):
        alone = each_alone(alternatives, budget)
        got = ChoiceModel(alternatives, 1).solve(budget, solver())
        assert alone, budget
        assert got.chosen is not None and got.predicted_peak <= budget
        fastest = min(alone.values())
        # The same optimum (to the solver's tolerance; the joint objective adds a tie-break on bytes).
        assert got.predicted_time_s == pytest.approx(fastest, rel=1e-3), (budget, got, alone)
        picked.append(got.chosen)
    assert picked[-1] == 1, picked  # plenty of memory: the unchunked trace, which runs the fewest ops
    assert picked[0] > 1, picked  # near the least peak: only a chunked trace fits


def test_an_excluded_trace_is_not_chosen(alternatives) -> None:
    joint = ChoiceModel(alternatives, 1)
    first = joint.solve(10**12, solver()).chosen
    joint.exclude(first)
    second = joint.solve(10**12, solver()).chosen
    assert second is not None and second != first


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
    # With everything saved the 1-chunk step fits 1 GB: no other count is traced.
    assert roomy["chosen_by"] == "everything saved fits unchunked" and roomy["chunks"] == 1, roomy
    assert list(roomy["candidates"]) == ["1"], roomy
