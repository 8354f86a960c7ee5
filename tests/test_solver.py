"""Solver limits: each path that can produce a plan (save-all, optimal ILP, time limit, per-block
modes, greedy, smallest peak) and Infeasible is forced and asserted by its name in Decision.path;
options reach the solver; plans are deterministic."""

import dataclasses
import importlib
import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autoremat
from autoremat.capture.aot import capture
from autoremat.model.ledger import SLACK
from autoremat.model.profile import profile_graph
from autoremat.planning.plan import Ledger, build_plan
from autoremat.solve import decision, heuristics, solver
from autoremat.solve.decision import BlockModes, IlpVariant, PlanPath, Refinement, Route
from autoremat.solve.solver_options import SolverOptions
from examples import models

budget_module = importlib.import_module("autoremat.planning.budget")  # where every face calls the solver


@pytest.fixture(scope="module")
def stack():
    """A 4-block transformer traced on the meta device, with its save-all and smallest peaks."""
    torch.manual_seed(0)
    model, ex = models.transformer_stack(n_layer=4, d=16, seq=8, batch=2)
    (cg,) = capture(model.to("meta"), (ex[0].to("meta"),))
    gp = profile_graph(cg, "cpu")
    _, base, _ = solver.evaluate([gp], solver.save_all([gp]))
    smallest = solver.smallest_peak([gp])
    return gp, base.peak, smallest.peak


def _mid(stack):
    gp, hi, lo = stack
    return gp, (hi + lo) // 2


def test_optimal_path(stack):
    gp, budget = _mid(stack)
    d = solver.solve([gp], budget)
    assert d.status == "optimal" and d.path.route is Route.ILP and not d.path.refinements, d.path
    assert d.peak <= budget


def test_time_limit_path_uses_the_best_plan_found(stack, monkeypatch):
    """What a solver returns when it stops at its limit with an incumbent: reported, and used."""
    gp, budget = _mid(stack)
    real = solver.IlpModel.solve

    def stopped_early(self, *args, **kwargs):
        result = real(self, *args, **kwargs)
        return dataclasses.replace(result, status="time_limit") if result.saved is not None else result

    monkeypatch.setattr(solver.IlpModel, "solve", stopped_early)
    d = solver.solve([gp], budget)
    assert d.status == "time_limit" and d.path.route is Route.ILP and d.peak <= budget
    plan = build_plan([gp], d, Ledger(0, 0, 0), budget, "cpu")
    assert plan.solver["status"] == "time_limit"
    assert any("time limit" in n for n in plan.notes), plan.notes
    assert "time_limit" in plan.summary()


def _no_ilp(monkeypatch):
    """Every ILP solve, budgeted or min-peak, finds nothing: what a solver that gives up reports. Its tests
    take `no_floors_remembered`, so no smallest-peak plan comes from an earlier call whose ILP found one."""
    monkeypatch.setattr(solver.IlpModel, "solve", lambda self, *a, **k: solver.IlpResult("infeasible"))


class Unrepeated(nn.Module):
    """No repeated block (no module path with an index): the per-block modes have nothing to choose."""

    def __init__(self, w: int = 16) -> None:
        super().__init__()
        self.up, self.mid, self.down = nn.Linear(w, 4 * w), nn.Linear(4 * w, 4 * w), nn.Linear(4 * w, w)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.tanh(self.mid(F.gelu(self.up(x))))).square().mean()


# Texts of the paths the planners give (the plan JSON's solver["path"]), and the typed path each reads back as.
PATH_TEXTS = {
    "save-all": PlanPath(Route.SAVE_ALL),
    "ilp": PlanPath(Route.ILP, IlpVariant()),
    "ilp+calibrated/block-drag/shared-blocks+slack-spent": PlanPath(
        Route.ILP, IlpVariant(block_drag=True, shared_blocks=True, calibrated=True), (Refinement.SLACK_SPENT,)),
    "ilp-min-peak/block-drag": PlanPath(Route.ILP_MIN_PEAK, IlpVariant(block_drag=True)),
    "block-modes(checkpoint 2, selective 11)+slack-spent": PlanPath(Route.BLOCK_MODES, BlockModes(2, 11),
                                                                    (Refinement.SLACK_SPENT,)),
    "checkpoint-blocks+recomputed-twice+peak-lowered": PlanPath(
        Route.CHECKPOINT_BLOCKS, refinements=(Refinement.RECOMPUTED_TWICE, Refinement.PEAK_LOWERED)),
    "greedy": PlanPath(Route.GREEDY),
    "cache": PlanPath(Route.CACHE),
}


def test_a_plan_path_reads_back_from_its_text():
    for text, path in PATH_TEXTS.items():
        assert str(path) == text and PlanPath.parse(text) == path, (text, path)
    for text in ("ilp+tighten", "checkpoint", "greedy/block-drag", "ilp/shared-blocks/block-drag", ""):
        with pytest.raises(ValueError):
            PlanPath.parse(text)


def test_a_plan_saved_and_loaded_keeps_its_path(stack, tmp_path):
    """The plan JSON stores the path's text: a plan saved and loaded compares equal and reads back the
    decision's typed path, and a plan JSON holding any path's text (as saved before paths were typed) loads."""
    gp, budget = _mid(stack)
    d = solver.solve([gp], budget)
    plan = build_plan([gp], d, Ledger(0, 0, 0), budget, "cpu")
    plan.save(tmp_path / "plan.json")
    loaded = type(plan).load(tmp_path / "plan.json")
    assert loaded == plan and loaded.solver_path == d.path and plan.summary() == loaded.summary()
    assert f"solver: {d.path} (" in plan.summary()
    raw = json.loads(plan.to_json())
    for text, path in PATH_TEXTS.items():
        old = type(plan).from_json(json.dumps({**raw, "solver": {**raw["solver"], "path": text}}))
        assert old.solver_path == path and f"solver: {text} (" in old.summary()


def test_save_all_path_when_everything_fits(stack):
    gp, hi, _ = stack
    d = solver.solve([gp], hi)
    assert d.path == PlanPath(Route.SAVE_ALL) and d.status == "optimal" and d.recompute_time_s == 0 and d.peak == hi


def test_the_no_recompute_budget_is_the_least_that_recomputes_nothing():
    """Plan.no_recompute_budget is what a benchmark or a Pareto sweep takes as the top of the range: at it
    the plan saves everything, and one byte less makes it recompute (fixed + baseline_peak alone did)."""
    torch.manual_seed(0)
    model, ex = models.transformer_stack(n_layer=2, d=16, seq=8, batch=2)
    roomy = autoremat.optimize(model, budget=10**9, example_inputs=ex, verify=False, compiler="eager").plan
    top = roomy.no_recompute_budget
    assert top == Ledger.from_dict(roomy.ledger).fixed + roomy.baseline_peak + SLACK, top
    at = autoremat.optimize(model, budget=top, example_inputs=ex, verify=False, compiler="eager").plan
    assert at.solver_path == PlanPath(Route.SAVE_ALL) and at.recompute_time_s == 0, at.summary()
    assert at.no_recompute_budget == top
    below = autoremat.optimize(model, budget=top - 1, example_inputs=ex, verify=False, compiler="eager").plan
    assert below.solver_path.route is not Route.SAVE_ALL and below.recompute_time_s > 0, below.summary()
    assert below.predicted_peak <= top - 1


def test_block_modes_path_when_the_ilp_finds_nothing(stack, monkeypatch, no_floors_remembered):
    # between save-all and checkpointing (one of the modes): the smallest peak, with values recomputed
    # twice (cut_search.py), is below every per-block mode
    gp, hi, _ = stack
    budget = (hi + solver.evaluate([gp], solver.checkpoint_blocks([gp]))[1].peak) // 2
    _no_ilp(monkeypatch)
    d = solver.solve([gp], budget)
    assert d.path.route is Route.BLOCK_MODES and isinstance(d.path.detail, BlockModes) and d.status == "heuristic", (d.status, d.path)
    assert d.peak <= budget and d.recompute_time_s > 0


def test_greedy_path_when_the_ilp_and_the_block_modes_find_nothing(monkeypatch, no_floors_remembered):
    # narrow and long: with backward buffers reused (passes/reuse.py) a [256, 16] input left greedy nothing to lower
    (cg,) = capture(Unrepeated(8).to("meta"), (torch.empty(512, 8, device="meta"),))
    gp = profile_graph(cg, "cpu")
    hi = solver.evaluate([gp], solver.save_all([gp]))[1].peak
    budget = solver.evaluate([gp], solver.greedy([gp], 0))[1].peak
    assert budget < hi, "greedy should lower this graph's peak"
    assert solver.block_mode_plans([gp], 10**12, 1) == []  # nothing repeated to choose modes for
    _no_ilp(monkeypatch)
    d = solver.solve([gp], budget)
    assert d.path == PlanPath(Route.GREEDY) and d.status == "greedy", (d.status, d.path)
    assert d.peak <= budget and any("used the greedy plan" in n for n in d.notes), d.notes
    smallest = solver.smallest_peak([gp])  # the lowest of greedy's and checkpointing's plans, each lowered
    # where saving values back can lower it (here none can), then values recomputed twice (cut_search.py) lower it
    assert smallest.peak < budget and Refinement.RECOMPUTED_TWICE in smallest.path.refinements, (smallest.path, smallest.peak, budget)
    with pytest.raises(solver.Infeasible) as err:  # below that: nothing fits
        solver.solve([gp], smallest.peak - 1)
    assert err.value.smallest.path == smallest.path and err.value.smallest.peak == smallest.peak


def test_infeasible_carries_the_checkpointing_plan_when_the_ilp_finds_nothing(stack, monkeypatch,
                                                                              no_floors_remembered):
    """Without an ILP, the smallest peak comes from checkpointing every block (greedy stops higher)."""
    gp, _, _ = stack
    _no_ilp(monkeypatch)
    blocks_peak = solver.evaluate([gp], solver.checkpoint_blocks([gp]))[1].peak
    assert blocks_peak < solver.evaluate([gp], solver.greedy([gp], 0))[1].peak
    smallest = solver.smallest_peak([gp])
    assert smallest.path.route is Route.CHECKPOINT_BLOCKS and smallest.peak <= blocks_peak, smallest.path
    with pytest.raises(solver.Infeasible) as err:
        solver.solve([gp], smallest.peak - 1)
    assert err.value.smallest.path == smallest.path and err.value.smallest.peak == smallest.peak
    assert err.value.status == "infeasible"


def test_smallest_peak_path_when_greedy_does_not_fit_either(stack, monkeypatch):
    """The budgeted ILPs find nothing, but the min-peak ILP does: its plan is used if it fits."""
    gp, hi, lo = stack
    real = solver.IlpModel.solve

    def only_min_peak(self, budget, backend, min_peak=False):
        return real(self, budget, backend, min_peak=True) if min_peak else solver.IlpResult("infeasible")

    monkeypatch.setattr(solver.IlpModel, "solve", only_min_peak)
    greedy_peak = solver.evaluate([gp], solver.greedy([gp], 0))[1].peak
    blocks_peak = solver.evaluate([gp], solver.checkpoint_blocks([gp]))[1].peak
    floor = min(greedy_peak, blocks_peak)
    assert lo < floor, (lo, floor)  # a budget between: only the min-peak plan fits
    d = solver.solve([gp], (lo + floor) // 2)
    assert d.path.route is Route.ILP_MIN_PEAK, d.path
    assert any("smallest-peak plan" in n for n in d.notes)
    with pytest.raises(solver.Infeasible):
        solver.solve([gp], lo - 1)


def test_the_min_peak_plan_found_while_calibrating_is_kept_when_it_fits(stack, monkeypatch):
    """The budgeted ILP finds nothing, so the calibration solves for the rows' smallest peak to learn how
    pessimistic they are. That plan fits the simulator here: it is a plan in hand, used even when the
    retry at the learned budget finds nothing (a busy machine's time limit), without the smallest-peak
    search that would otherwise follow (made to fail here)."""
    gp, hi, lo = stack
    real = solver.IlpModel.solve
    low = real(solver.IlpModel([gp], 1, block_drag=False), None, SolverOptions(gap=1e-3).backend(), min_peak=True)
    budget = solver.evaluate([gp], low.saved)[1].peak  # the raw min-peak plan's simulated peak: it just fits

    def only_min_peak(self, budget, backend, min_peak=False):
        return real(self, budget, backend, min_peak=True) if min_peak else solver.IlpResult("infeasible")

    def no_search(*args, **kwargs):
        raise AssertionError("the smallest-peak search ran: the calibration's plan was dropped")

    monkeypatch.setattr(solver.IlpModel, "solve", only_min_peak)
    monkeypatch.setattr(solver, "smallest_peak", no_search)
    d = solver.solve([gp], budget)
    assert d.path.route is Route.ILP_MIN_PEAK and d.peak <= budget, (d.path, d.peak, budget)
    assert any("smallest-peak plan" in n for n in d.notes), d.notes


def test_gap_and_time_limit_reach_the_solver(monkeypatch):
    seen = {}
    real = budget_module.solve

    def spy(*args, **kwargs):
        seen.update(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(budget_module, "solve", spy)
    torch.manual_seed(0)
    model, ex = models.mlp(batch=256, width=32, depth=3)
    base = autoremat.optimize(model, budget=10**9, example_inputs=ex, verify=False, compiler="eager").plan
    budget = Ledger.from_dict(base.ledger).fixed + (base.baseline_peak * 9) // 10
    autoremat.optimize(model, budget=budget, example_inputs=ex, verify=False, gap=0.05, time_limit=7.0, compiler="eager")
    assert seen["options"] == SolverOptions(time_limit=7.0, gap=0.05)


@pytest.mark.slow
def test_a_real_tiny_time_limit_still_gives_a_plan_that_fits_and_says_how():
    torch.manual_seed(0)
    model, ex = models.transformer_stack(n_layer=8, d=32, seq=16, batch=2)
    (cg,) = capture(model.to("meta"), (ex[0].to("meta"),))
    gp = profile_graph(cg, "cpu")
    hi = solver.evaluate([gp], solver.save_all([gp]))[1].peak
    lo = solver.smallest_peak([gp]).peak
    d = solver.solve([gp], (hi + lo) // 2, options=SolverOptions("highs", time_limit=0.05))
    assert d.peak <= (hi + lo) // 2
    # Which path depends on the machine's speed; each is named. The block-mode walk is bounded by a count
    # of simulations, not by the time limit, so its plan is always in hand for the ILP to beat.
    assert d.status in ("optimal", "time_limit", "greedy") or d.path.route is Route.BLOCK_MODES \
        or "smallest-peak" in " ".join(d.notes), d


DETERMINISM = textwrap.dedent("""
    import json, sys, torch
    torch.set_num_threads(1)
    sys.path.insert(0, {root!r})
    import autoremat
    from examples import models
    torch.manual_seed(0)
    model, ex = models.transformer_stack(n_layer=2, d=16, seq=8, batch=2)
    om = autoremat.optimize(model, budget={budget}, example_inputs=ex, verify=False, compiler="eager")
    print(json.dumps([[g.saved, g.recomputed] for g in om.plan.graphs]))
""")


def test_same_model_and_budget_give_the_same_plan_in_fresh_processes():
    torch.manual_seed(0)
    model, ex = models.transformer_stack(n_layer=2, d=16, seq=8, batch=2)
    base = autoremat.optimize(model, budget=10**9, example_inputs=ex, verify=False, compiler="eager").plan
    fixed = Ledger.from_dict(base.ledger).fixed
    with pytest.raises(autoremat.BudgetError) as err:
        autoremat.optimize(model, budget=fixed + 1, example_inputs=ex, verify=False, compiler="eager")
    budget = (err.value.smallest_budget + fixed + base.baseline_peak) // 2
    root = str(Path(__file__).resolve().parents[1])
    script = DETERMINISM.format(root=root, budget=budget)
    runs = [subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=root, timeout=300)
            for _ in range(2)]
    for r in runs:
        assert r.returncode == 0, r.stderr[-2000:]
    plans = [json.loads(r.stdout.strip().splitlines()[-1]) for r in runs]
    assert plans[0] == plans[1]
    assert plans[0][0][1], "the budget should force some recomputation"


def test_saving_values_back_lowers_checkpointings_peak_and_spends_slack_on_time():
    """Checkpointing a block recomputes attention before the MLP's backward (the peak) only because
    the MLP reads attention's output: saving values back lowers that peak (`lower_peak`), and a
    plan that leaves budget unused saves back what costs most to recompute (`spend_slack`)."""
    model, ex = models.transformer_stack(n_layer=4, d=64, seq=32, batch=2, dropout=0.0)
    (cg,) = capture(model.to("meta"), (ex[0].to("meta"),))
    # Planned alone, as the torch.compile backend plans the third graph of a step: its steps name index 2.
    gp = dataclasses.replace(profile_graph(cg, "cpu"), index=2)
    blocks = solver.evaluate([gp], solver.checkpoint_blocks([gp]))
    plan = solver.Decision(solver.checkpoint_blocks([gp]), blocks[0], blocks[1], blocks[2], "heuristic",
                           PlanPath(Route.CHECKPOINT_BLOCKS))
    lowered = solver.lower_peak([gp], plan, 1)
    assert lowered.peak < plan.peak and lowered.recompute_time_s <= plan.recompute_time_s, (lowered.peak, plan.peak)
    assert lowered.path == PlanPath(Route.CHECKPOINT_BLOCKS, refinements=(Refinement.PEAK_LOWERED,))
    schedules, tl, cost = solver.evaluate([gp], lowered.saved)  # the plan is what the simulator says it is
    assert (tl.peak, cost) == (lowered.peak, lowered.recompute_time_s)

    spent = solver.spend_slack([gp], plan, plan.peak + (plan.peak - lowered.peak), 1)
    assert spent.recompute_time_s < plan.recompute_time_s and spent.peak <= plan.peak + (plan.peak - lowered.peak)
    assert spent.path.refinements == (Refinement.SLACK_SPENT,) and any("saved back" in n for n in spent.notes), spent.notes
    assert solver.spend_slack([gp], plan, plan.peak, 1) is plan  # no slack: nothing to spend


def test_a_floor_once_found_is_found_again_when_the_search_runs_out_of_time(monkeypatch, no_floors_remembered):
    """`smallest_peak` stops on time, so a busier machine can find a worse plan than an earlier call did;
    the floor a BudgetError reported must stay reachable at exactly that budget. A search given no time
    (the MIP stopped at once, greedy past its deadline) still returns the best plan found before."""
    torch.manual_seed(0)
    model, ex = models.transformer_stack(n_layer=4, d=16, seq=8, batch=2, dropout=0.1)
    (cg,) = capture(model.to("meta"), (ex[0].to("meta"),))
    gp = profile_graph(cg, "cpu")
    found = solver.smallest_peak([gp])

    monkeypatch.setattr(solver, "MIN_PEAK_MIP_S", 0.0)
    again = solver.smallest_peak([gp], options=SolverOptions(time_limit=0.0))
    assert (again.peak, again.saved) == (found.peak, found.saved), (again.peak, again.path, found.peak, found.path)
    assert solver.evaluate([gp], again.saved)[1].peak == found.peak  # the plan is what the simulator says

    solver.forget_floors()  # what the same rushed search finds on its own: no better
    assert solver.smallest_peak([gp], options=SolverOptions(time_limit=0.0)).peak >= found.peak


def test_a_search_for_a_room_stops_at_the_first_plan_that_fits(stack, monkeypatch, no_floors_remembered):
    """With a room, `smallest_peak` returns the fastest plan of the first of its stages that fits it, and
    simulates no further (the whole search is for the floor); a room below every plan it finds
    gets the whole search, and the floor."""
    gp, hi, _ = stack
    simulations = []
    real = decision.simulate  # what every evaluation of a saved set calls
    monkeypatch.setattr(decision, "simulate", lambda *a, **k: simulations.append(1) or real(*a, **k))

    def searched(room):  # from nothing remembered: a remembered floor plan is not lowered again
        solver.forget_floors()
        simulations.clear()
        return solver.smallest_peak([gp], room=room), len(simulations)

    (full, n_full), (roomy, n_roomy) = searched(None), searched(hi)
    assert roomy.peak <= hi and n_roomy < n_full, (roomy.peak, n_roomy, n_full)
    at_floor, _ = searched(full.peak)
    assert at_floor.peak <= full.peak and at_floor.recompute_time_s > 0
    below, n_below = searched(full.peak - 1)
    # nothing fits: the whole search, whose floor the caller reports (the MIPs of this tiny stack end well
    # within their time limits, so two searches from nothing remembered are the same search)
    assert below.peak == full.peak and n_below == n_full


def test_every_smallest_peak_candidate_is_lowered_before_one_is_kept(no_floors_remembered):
    """Saving values back reorders the candidates: the plan with the lowest peak before `lower_peak` is
    not always the lowest after it, so the floor is the lowest lowered candidate."""
    torch.manual_seed(0)
    model, ex = models.transformer_stack(n_layer=4, d=64, seq=32, batch=2, dropout=0.1)
    (cg,) = capture(model.to("meta"), (ex[0].to("meta"),))
    gp = profile_graph(cg, "cpu")
    floor = solver.smallest_peak([gp])
    blocks = solver.evaluate([gp], solver.checkpoint_blocks([gp]))
    checkpointing = solver.Decision(solver.checkpoint_blocks([gp]), *blocks, "heuristic", PlanPath(Route.CHECKPOINT_BLOCKS))
    assert floor.peak <= solver.lower_peak([gp], checkpointing, 1).peak
    assert solver.evaluate([gp], floor.saved)[1].peak == floor.peak


def test_the_heuristics_plans_do_not_depend_on_the_clock(monkeypatch):
    """`block_mode_plans`, `spend_slack` and `greedy` are bounded by counts of simulations, not by deadlines:
    on a machine so slow that every clock reading is an hour later, they return the plans they return at
    full speed (at a 7B Llama's scale the ILP finds no plan, so these searches are the answer there),
    and the block-mode walk simulates at most 3 (n + 1) of the family's (n + 1)(n + 2) / 2 members."""
    model, ex = models.transformer_stack(n_layer=6, d=64, seq=32, batch=2, dropout=0.0)
    (cg,) = capture(model.to("meta"), (ex[0].to("meta"),))
    gp = profile_graph(cg, "cpu")
    hi = solver.evaluate([gp], solver.save_all([gp]))[1].peak
    lo = solver.evaluate([gp], solver.checkpoint_blocks([gp]))[1].peak
    budget = (hi + lo) // 2
    simulations = []
    evaluate = heuristics.evaluate
    monkeypatch.setattr(heuristics, "evaluate", lambda *a, **k: simulations.append(1) or evaluate(*a, **k))

    def plans():
        simulations.clear()
        modes = heuristics.block_mode_plans([gp], budget, 1)
        walked = len(simulations)
        best = min(modes, key=lambda d: (d.recompute_time_s, d.peak))
        spent = heuristics.spend_slack([gp], best, budget, 1)
        greedy = heuristics.greedy([gp], lo, 1, max_tries=20)
        return [(d.path, d.saved) for d in modes], (spent.path, spent.saved, spent.recompute_time_s), walked, \
            greedy, best

    fast = plans()
    clock = iter(range(0, 10**9, 3600))
    monkeypatch.setattr(time, "perf_counter", lambda: float(next(clock)))
    assert plans()[:4] == fast[:4]
    modes, spent, walked, greedy, best = fast
    assert greedy != solver.save_all([gp]), "greedy recomputed nothing: the comparison shows nothing"
    assert len(modes) >= 2 and walked <= 3 * (6 + 1), (modes, walked)
    assert Refinement.SLACK_SPENT in spent[0].refinements and spent[2] < best.recompute_time_s, (spent[0], best.path)


def test_a_simulation_given_a_limit_stops_at_the_first_step_over_it(stack):
    """memory.simulate(limit=...): a search keeps only plans at or under its best peak, so a trial is replayed
    only until a step goes over it (Timeline.cut_short); at or above the whole step's peak nothing changes."""
    gp, _, _ = stack
    saved = solver.save_all([gp])
    full = solver.evaluate([gp], saved)[1]
    whole = solver.evaluate([gp], saved, limit=full.peak)[1]
    assert not whole.cut_short and [s.during for s in whole.steps] == [s.during for s in full.steps]
    cut = solver.evaluate([gp], saved, limit=full.peak - 1)[1]
    first_over = next(i for i, s in enumerate(full.steps) if s.during > full.peak - 1)
    assert cut.cut_short and len(cut.steps) == first_over + 1
    assert cut.peak == full.steps[first_over].during > full.peak - 1
    early = solver.evaluate([gp], saved, limit=full.steps[0].during - 1)[1]  # over at the very first step
    assert early.cut_short and len(early.steps) == 1


def _saved_and_peak(result):
    return result.saved, result.predicted_peak


def test_the_shared_block_models_are_solved_only_where_a_graph_has_identical_blocks(stack, monkeypatch):
    """Sharing decisions ties the variables of identical blocks; in a graph with one block (a region, a
    1-layer model) there is none to tie, the shared model is the full one and its answer is the same, so
    `solve` builds it only where some graph has twins (4 models on the 4-block stack, 2 on one block)."""
    torch.manual_seed(0)
    model, ex = models.transformer_stack(n_layer=1, d=16, seq=8, batch=2)
    (cg,) = capture(model.to("meta"), (ex[0].to("meta"),))
    one = profile_graph(cg, "cpu")
    _, top, _ = solver.evaluate([one], solver.save_all([one]))
    room = (top.peak + solver.smallest_peak([one]).peak) // 2
    backend = SolverOptions().backend()
    for drag in (False, True):
        full, shared = (solver.IlpModel([one], 1, drag, s) for s in (False, True))
        assert full.prob.numVariables() == shared.prob.numVariables()
        assert full.prob.numConstraints() == shared.prob.numConstraints()
        low = full.solve(None, backend, min_peak=True)
        assert _saved_and_peak(low) == _saved_and_peak(shared.solve(None, backend, min_peak=True))
        rows_room = int(low.predicted_peak) + (top.peak - int(low.predicted_peak)) // 2  # feasible for the rows
        a = full.solve(rows_room, backend)
        assert a.saved is not None and _saved_and_peak(a) == _saved_and_peak(shared.solve(rows_room, backend))

    built = []
    real = solver.IlpModel.__init__

    def counted(self, graphs, granularity, block_drag, shared_blocks=False, **kw):
        built.append((block_drag, shared_blocks))
        real(self, graphs, granularity, block_drag, shared_blocks, **kw)

    monkeypatch.setattr(solver.IlpModel, "__init__", counted)
    assert solver.solve([one], room).peak <= room
    assert built == [(False, False), (True, False)]
    built.clear()
    gp, budget = _mid(stack)
    solver.solve([gp], budget)
    assert built == [(False, False), (False, True), (True, False), (True, True)]


def test_only_values_that_hold_back_a_recomputation_at_the_peak_are_tried_for_lowering_it(monkeypatch):
    """heuristics._held_back, worked by hand. Forward a <- x, b <- a, c <- x, d <- x (100 B each); the backward
    runs v (reads d), u (reads b), p (reads c, 1,000 B of scratch), w (reads a), each returning 4 B. With
    everything recomputed, a and b run before u (b's first reader), and a is held past p for w: p's step
    holds a, c, the forward's 4 B output, v's, u's and p's gradients and the scratch, 1,216 B. d runs before
    v and is dead by then. Saving b moves a's recomputation past p (1,116 B); a and c are held there
    themselves; saving d cannot change p's step. So a, b, c are tried for lowering, d only for a cheaper plan
    at the same peak, while such values are at most heuristics.SLACK_TRIES."""
    from autoremat.model.profile import GraphProfile, NodeProfile

    def node(name, kind, *inputs, nbytes=100, scratch=0):
        return NodeProfile(name=name, kind=kind, target="t", inputs=tuple(inputs), storage=name, nbytes=nbytes,
                           time_s=1e-3, transient_bytes=scratch)
    nodes = [node("x", "input", nbytes=0), node("a", "forward", "x"), node("b", "forward", "a"),
             node("c", "forward", "x"), node("d", "forward", "x"), node("out", "forward", "b", "c", "d", nbytes=4),
             node("v", "backward", "d", nbytes=4), node("u", "backward", "b", nbytes=4),
             node("p", "backward", "c", nbytes=4, scratch=1000), node("w", "backward", "a", nbytes=4)]
    g = GraphProfile(nodes={n.name: n for n in nodes}, fw_outputs=["out"], grad_outputs=["v", "u", "p", "w"])
    schedules, timeline, cost = solver.evaluate([g], [set()])
    plan = solver.Decision([set()], schedules, timeline, cost, "optimal", PlanPath(Route.JOINT))
    assert schedules[0].backward == ["d", "v", "a", "b", "u", "c", "p", "w"]
    assert (timeline.peak_step.node, timeline.peak) == ("p", 1216)
    assert heuristics._held_back([g], plan, 0, ["d", "a", "b", "c"], 1) == ["a", "b", "c"]
    assert solver.lower_peak([g], plan, 1).saved == [{"b", "c", "d"}]  # b lowers the peak; c and d cost nothing
    assert solver.evaluate([g], [{"b"}])[1].peak == 1116
    monkeypatch.setattr(heuristics, "SLACK_TRIES", 0)  # d is only tried while such values are few
    lowered = solver.lower_peak([g], plan, 1)
    assert lowered.saved == [{"b", "c"}] and lowered.peak == 1116


def test_a_plan_at_the_floor_solves_each_models_min_peak_problem_once(stack, monkeypatch, no_floors_remembered):
    """Near the floor the budgeted ILP finds nothing; the calibration solves each model for its rows' smallest
    peak, and the smallest-peak search that follows starts from the same solutions: each model's min-peak
    MIP is solved once (a second solve repeats work the plan waits for: `benchmarks/plan_time.py --cliff` times
    planning at the floor, its "ILP solve" stage in the .json). The plan is the one a search from fresh models finds."""
    gp, _, _ = stack
    floor = solver.smallest_peak([gp])
    real, solved, searches = solver.IlpModel.solve, [], []

    def counted(self, room, backend, min_peak=False):
        solved.append((id(self), min_peak))
        return real(self, room, backend, min_peak=min_peak)

    real_search = solver.smallest_peak
    monkeypatch.setattr(solver.IlpModel, "solve", counted)
    monkeypatch.setattr(solver, "smallest_peak", lambda *a, **k: searches.append(k) or real_search(*a, **k))
    solver.forget_floors()
    d = solver.solve([gp], floor.peak)
    assert searches and searches[0]["built"], "the search did not run on the calibrated models"
    per_model = [m for m, min_peak in solved if min_peak]
    assert per_model and len(per_model) == len(set(per_model)), solved
    assert (d.peak, d.saved) == (floor.peak, floor.saved), (d.peak, d.path, floor.peak, floor.path)


def test_greedys_plan_after_fewer_tries_is_the_plan_a_shorter_search_finds(stack):
    """Every try of greedy's search is the same until the peak fits, so the plan a search toward a room held
    after n tries is what a search of n tries finds: `solve` hands it to the smallest-peak search instead of
    running that search again (which would make two greedy searches of one trace at its floor)."""
    gp, _, lo = stack
    for fewer in (0, 7, 40, 10**6):
        full, early = heuristics.greedy_with([gp], lo // 2, 1, 300, fewer)
        assert early == heuristics.greedy([gp], lo // 2, 1, max_tries=fewer), fewer
        assert full == heuristics.greedy([gp], lo // 2, 1, max_tries=300)


def test_a_plan_at_the_floor_runs_greedys_search_once(stack, monkeypatch, no_floors_remembered):
    """At the floor no ILP plan fits: greedy searches toward the room, and the smallest-peak search that follows
    takes its plan after fewer tries from that search, with the same floor."""
    gp, _, _ = stack
    floor = solver.smallest_peak([gp])
    searches = []
    real = heuristics.greedy_with
    monkeypatch.setattr(solver, "greedy", lambda *a, **k: pytest.fail("greedy's search ran a second time"))
    monkeypatch.setattr(heuristics, "greedy_with", lambda *a, **k: searches.append(a) or real(*a, **k))
    solver.forget_floors()
    d = solver.solve([gp], floor.peak)
    assert len(searches) == 1 and d.peak == floor.peak, (searches, d.path)


def test_a_min_peak_solve_that_stopped_on_time_is_solved_again_only_with_more_time(stack, monkeypatch):
    """The calibration and the smallest-peak search ask for the same min-peak MIP, each within its share of the
    time limit. One that stopped on time is kept for a caller with no more time (single-threaded HiGHS would
    stop at the same incumbent) and solved again for a caller with more; an optimal one is solved once
    (solving an optimal one again finds nothing new, and on a large model that MIP takes seconds)."""
    gp, _, _ = stack
    model = solver.IlpModel([gp], 1, block_drag=True)
    real, solves = solver.IlpModel.solve, []
    monkeypatch.setattr(solver.IlpModel, "solve", lambda self, *a, **k: solves.append(a) or real(self, *a, **k))
    highs = SolverOptions("highs")
    rushed = solver._min_peak(model, highs, 1e-3)
    assert rushed.status != "optimal", "the MIP finished within a millisecond: this checks less than it says"
    assert solver._min_peak(model, highs, 1e-3) is rushed and len(solves) == 1
    full = solver._min_peak(model, highs, 60)
    assert full.status == "optimal" and len(solves) == 2
    assert solver._min_peak(model, highs, 120) is full and len(solves) == 2
