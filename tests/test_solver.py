"""Solver limits: each path that can produce a plan (save-all, optimal ILP, time limit, per-block
modes, greedy, smallest peak) and Infeasible is reached through public inputs (budgets, SolverOptions'
time limit, small graphs) and asserted by its typed Decision.path; options reach the solver; plans are
deterministic."""

import dataclasses
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
from autoremat.planning.options import PlanOptions
from autoremat.planning.plan import Ledger, build_plan
from autoremat.solve import heuristics, solver
from autoremat.solve.decision import BlockModes, IlpVariant, PlanPath, Refinement, Route
from autoremat.solve.solver_options import SolverOptions
from examples import models


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


def test_the_ilp_stops_at_its_time_limit_and_a_plan_found_so_says_it(stack):
    """A MIP given less time than it needs (a tiny SolverOptions.time_limit) stops there without proving its
    answer, where one given time enough proves it; a plan whose MIP stopped at its limit is used, and says so."""
    gp, budget = _mid(stack)
    model = solver.IlpModel([gp], 1, block_drag=True)
    rushed = model.solve(None, SolverOptions("highs", time_limit=1e-3).backend(), min_peak=True)
    assert rushed.status != "optimal", "the MIP finished within a millisecond: this checks less than it says"
    assert model.solve(None, SolverOptions("highs", time_limit=60).backend(), min_peak=True).status == "optimal"
    d = dataclasses.replace(solver.solve([gp], budget), status="time_limit")  # as a MIP stopped at its limit
    plan = build_plan([gp], d, Ledger(0, 0, 0), budget, "cpu")
    assert plan.solver["status"] == "time_limit"
    assert any("time limit" in n for n in plan.notes), plan.notes
    assert "time_limit" in plan.summary()


# Too short a time limit to build any ILP model (solve keeps NEXT_MODEL_MARGIN_S free before building one): the
# ILP gives no plan, and the plans found without it are the answer.
NO_TIME = SolverOptions(time_limit=0.01)


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


def test_block_modes_path_when_the_ilp_gives_no_plan(stack, no_floors_remembered):
    # between save-all and checkpointing (one of the modes)
    gp, hi, _ = stack
    budget = (hi + solver.evaluate([gp], solver.checkpoint_blocks([gp]))[1].peak) // 2
    d = solver.solve([gp], budget, options=NO_TIME)
    assert d.path.route is Route.BLOCK_MODES and isinstance(d.path.detail, BlockModes) and d.status == "heuristic", \
        (d.status, d.path)
    assert d.peak <= budget and d.recompute_time_s > 0
    assert d.solve_time_s < 60, d.solve_time_s  # loosely: no MIP ran, only the block-mode walk's simulations


def test_greedy_path_when_the_ilp_and_the_block_modes_find_nothing(no_floors_remembered):
    # narrow and long: with backward buffers reused (passes/reuse.py) a [256, 16] input left greedy nothing to lower
    (cg,) = capture(Unrepeated(8).to("meta"), (torch.empty(512, 8, device="meta"),))
    gp = profile_graph(cg, "cpu")
    hi = solver.evaluate([gp], solver.save_all([gp]))[1].peak
    budget = solver.evaluate([gp], solver.greedy([gp], 0))[1].peak
    assert budget < hi, "greedy should lower this graph's peak"
    assert solver.block_mode_plans([gp], 10**12, 1) == []  # nothing repeated to choose modes for
    d = solver.solve([gp], budget, options=NO_TIME)
    assert d.path == PlanPath(Route.GREEDY) and d.status == "greedy", (d.status, d.path)
    assert d.peak <= budget and any("used the greedy plan" in n for n in d.notes), d.notes
    smallest = solver.smallest_peak([gp])  # the floor: what a query with budget=1 names
    assert smallest.peak < budget, (smallest.path, smallest.peak, budget)
    with pytest.raises(solver.Infeasible) as err:  # below that: nothing fits, and the refusal names the floor
        solver.solve([gp], smallest.peak - 1, options=NO_TIME)
    assert err.value.smallest.path == smallest.path and err.value.smallest.peak == smallest.peak


def test_a_refusal_carries_the_floor_plan(stack, no_floors_remembered):
    """Below every plan's peak, `solve` refuses with the plan of the smallest peak found: the floor a query with
    budget=1 names (`smallest_peak`), at or below checkpointing's and greedy's peaks."""
    gp, _, _ = stack
    blocks_peak = solver.evaluate([gp], solver.checkpoint_blocks([gp]))[1].peak
    greedy_peak = solver.evaluate([gp], solver.greedy([gp], 0))[1].peak
    smallest = solver.smallest_peak([gp])
    assert smallest.peak <= min(blocks_peak, greedy_peak), (smallest.path, smallest.peak, blocks_peak, greedy_peak)
    with pytest.raises(solver.Infeasible) as err:
        solver.solve([gp], smallest.peak - 1)
    assert err.value.smallest.path == smallest.path and err.value.smallest.peak == smallest.peak
    assert str(smallest.peak) in str(err.value)


def test_a_budget_neither_greedy_nor_checkpointing_reaches_gets_a_plan(stack):
    """Between the floor and the lower of greedy's and checkpointing's peaks only the ILP's plans (or the
    smallest-peak search's) fit: one is found."""
    gp, hi, lo = stack
    greedy_peak = solver.evaluate([gp], solver.greedy([gp], 0))[1].peak
    blocks_peak = solver.evaluate([gp], solver.checkpoint_blocks([gp]))[1].peak
    floor = min(greedy_peak, blocks_peak)
    assert lo < floor, (lo, floor)  # a budget between: neither plan fits
    d = solver.solve([gp], (lo + floor) // 2)
    assert d.peak <= (lo + floor) // 2, (d.path, d.peak)
    assert d.path.route not in (Route.GREEDY, Route.BLOCK_MODES, Route.SAVE_ALL), d.path
    with pytest.raises(solver.Infeasible):
        solver.solve([gp], lo - 1)


def test_a_budget_at_the_ilps_smallest_peak_plan_gets_that_plan_or_a_faster_one(stack):
    """At the simulated peak of the ILP's own smallest-peak plan, the budgeted ILP's rows see no room (they are
    conservative), and the calibration solves for that plan: it fits, so the answer is it or a faster plan,
    never the smallest-peak search's."""
    gp, hi, lo = stack
    low = solver.IlpModel([gp], 1, block_drag=False).solve(None, SolverOptions(gap=1e-3).backend(), min_peak=True)
    _, low_timeline, low_cost = solver.evaluate([gp], low.saved)
    budget = low_timeline.peak  # the min-peak plan's simulated peak: it just fits
    d = solver.solve([gp], budget)
    assert d.peak <= budget and d.recompute_time_s <= low_cost, (d.path, d.peak, budget)
    assert not any("smallest-peak search" in n for n in d.notes), d.notes


def test_gap_and_time_limit_reach_the_solver():
    """optimize's solver keywords become the solve stage's SolverOptions, and its time limit bounds the ILP: one too
    short to build a model leaves the plan to the searches without it."""
    assert PlanOptions(gap=0.05, time_limit=7.0).solving() == SolverOptions("auto", time_limit=7.0, gap=0.05)
    torch.manual_seed(0)
    model, ex = models.mlp(batch=256, width=32, depth=3)
    base = autoremat.optimize(model, budget=10**9, example_inputs=ex, verify=False, compiler="eager").plan
    budget = Ledger.from_dict(base.ledger).fixed + (base.baseline_peak * 9) // 10
    rushed = autoremat.optimize(model, budget=budget, example_inputs=ex, verify=False, gap=0.05,
                                time_limit=NO_TIME.time_limit, compiler="eager").plan
    assert rushed.predicted_peak <= budget and rushed.solver_path.route is not Route.ILP, rushed.summary()


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


def test_a_floor_once_found_is_found_again_when_the_search_is_rushed(no_floors_remembered):
    """`smallest_peak` stops on time, so a busier machine can find a worse plan than an earlier call did;
    the floor a BudgetError reported must stay reachable at exactly that budget. A search given almost no time
    (one min-peak model, then no more) still returns the best plan found before."""
    torch.manual_seed(0)
    model, ex = models.transformer_stack(n_layer=4, d=16, seq=8, batch=2, dropout=0.1)
    (cg,) = capture(model.to("meta"), (ex[0].to("meta"),))
    gp = profile_graph(cg, "cpu")
    found = solver.smallest_peak([gp])

    rushed = SolverOptions(time_limit=1e-3)
    again = solver.smallest_peak([gp], options=rushed)
    assert (again.peak, again.saved) == (found.peak, found.saved), (again.peak, again.path, found.peak, found.path)
    assert solver.evaluate([gp], again.saved)[1].peak == found.peak  # the plan is what the simulator says

    solver.forget_floors()  # what the same rushed search finds on its own: no better
    assert solver.smallest_peak([gp], options=rushed).peak >= found.peak


def test_a_search_for_a_room_stops_at_the_first_plan_that_fits(stack, no_floors_remembered):
    """With a room, `smallest_peak` returns the fastest plan of the first of its stages that fits it, sooner
    than the whole search for the floor; a room below every plan it finds gets the whole search, and the floor."""
    gp, hi, _ = stack

    def searched(room):  # from nothing remembered: a remembered floor plan is not lowered again
        solver.forget_floors()
        started = time.perf_counter()
        return solver.smallest_peak([gp], room=room), time.perf_counter() - started

    (full, full_s), (roomy, roomy_s) = searched(None), searched(hi)
    assert roomy.peak <= hi and roomy_s < full_s, (roomy.peak, roomy_s, full_s)
    at_floor, _ = searched(full.peak)
    assert at_floor.peak <= full.peak and at_floor.recompute_time_s > 0
    below, _ = searched(full.peak - 1)
    # nothing fits: the whole search, whose floor the caller reports (the MIPs of this tiny stack end well
    # within their time limits, so two searches from nothing remembered are the same search)
    assert (below.peak, below.saved) == (full.peak, full.saved)


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
    """`block_mode_plans`, `spend_slack` and `greedy` are bounded by counts of simulations, not by deadlines
    (at a 7B Llama's scale the ILP finds no plan, so these searches are the answer there): on a machine so
    slow that every clock reading is an hour later, they return the plans they return at full speed."""
    model, ex = models.transformer_stack(n_layer=6, d=64, seq=32, batch=2, dropout=0.0)
    (cg,) = capture(model.to("meta"), (ex[0].to("meta"),))
    gp = profile_graph(cg, "cpu")
    hi = solver.evaluate([gp], solver.save_all([gp]))[1].peak
    lo = solver.evaluate([gp], solver.checkpoint_blocks([gp]))[1].peak
    budget = (hi + lo) // 2

    def plans():
        modes = heuristics.block_mode_plans([gp], budget, 1)
        best = min(modes, key=lambda d: (d.recompute_time_s, d.peak))
        spent = heuristics.spend_slack([gp], best, budget, 1)
        greedy = heuristics.greedy([gp], lo, 1, max_tries=20)
        return [(d.path, d.saved) for d in modes], (spent.path, spent.saved, spent.recompute_time_s), greedy, best

    first = plans()
    clock = iter(range(0, 10**9, 3600))
    monkeypatch.setattr(time, "perf_counter", lambda: float(next(clock)))
    monkeypatch.setattr(time, "monotonic", lambda: float(next(clock)))
    assert plans()[:3] == first[:3]
    modes, spent, greedy, best = first
    assert greedy != solver.save_all([gp]), "greedy recomputed nothing: the comparison shows nothing"
    assert len(modes) >= 2, modes
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


def test_a_shared_blocks_model_of_a_graph_without_identical_blocks_is_the_full_model(stack):
    """Sharing decisions ties the variables of identical blocks; in a graph with one block (a region, a
    1-layer model) there is none to tie: the shared model is the full one, with the same answers (which is why
    `solve` builds it only where some graph has identical blocks)."""
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
    d = solver.solve([one], room)
    # and so no plan of a graph without identical blocks comes from a shared-blocks model
    assert d.peak <= room and not (isinstance(d.path.detail, IlpVariant) and d.path.detail.shared_blocks), d.path


def test_only_values_that_hold_back_a_recomputation_at_the_peak_are_tried_for_lowering_it():
    """`lower_peak`, worked by hand. Forward a <- x, b <- a, c <- x, d <- x (100 B each); the backward
    runs v (reads d), u (reads b), p (reads c, 1,000 B of scratch), w (reads a), each returning 4 B. With
    everything recomputed, a and b run before u (b's first reader), and a is held past p for w: p's step
    holds a, c, the forward's 4 B output, v's, u's and p's gradients and the scratch, 1,216 B. d runs before
    v and is dead by then. Saving b moves a's recomputation past p (1,116 B); a and c are held there
    themselves; saving d cannot change p's step. So a, b, c are tried for lowering first (with two tries, a and
    b: b lowers the peak), d only for a cheaper plan at the same peak, while tries are left."""
    from autoremat.model.graph_profile import GraphProfile, NodeProfile

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
    assert solver.lower_peak([g], plan, 1).saved == [{"b", "c", "d"}]  # b lowers the peak; c and d cost nothing
    assert solver.evaluate([g], [{"b"}])[1].peak == 1116
    # two tries: d (first in the backward) is not among them, so b, the value that lowers the peak, is found
    lowered = solver.lower_peak([g], plan, 1, max_tries=2)
    assert lowered.saved == [{"b"}] and lowered.peak == 1116


def test_a_plan_at_the_floor_is_the_floor_searchs_plan_in_bounded_time(stack, no_floors_remembered):
    """Near the floor the budgeted ILP finds nothing; the calibration solves each model for its rows' smallest
    peak, and the smallest-peak search that follows starts from the same solutions and from greedy's search
    toward the room, so planning at the floor costs about one floor search, not two (`benchmarks/plan_time.py
    --cliff` times planning at the floor). The plan is the one a search from nothing remembered finds."""
    gp, _, _ = stack
    started = time.perf_counter()
    floor = solver.smallest_peak([gp])
    floor_s = time.perf_counter() - started
    solver.forget_floors()
    started = time.perf_counter()
    d = solver.solve([gp], floor.peak)
    solve_s = time.perf_counter() - started
    assert (d.peak, d.saved) == (floor.peak, floor.saved), (d.peak, d.path, floor.peak, floor.path)
    assert any("smallest-peak" in n for n in d.notes), d.notes
    assert solve_s < 3 * floor_s + 10, (solve_s, floor_s)  # loosely: a machine shared with other work


def test_greedys_plan_after_fewer_tries_is_the_plan_a_shorter_search_finds(stack):
    """Every try of greedy's search is the same until the peak fits, so the plan a search toward a room held
    after n tries is what a search of n tries finds: `solve` hands it to the smallest-peak search instead of
    running that search again (which would make two greedy searches of one trace at its floor)."""
    gp, _, lo = stack
    for fewer in (0, 7, 40, 10**6):
        full, early = heuristics.greedy_with([gp], lo // 2, 1, 300, fewer)
        assert early == heuristics.greedy([gp], lo // 2, 1, max_tries=fewer), fewer
        assert full == heuristics.greedy([gp], lo // 2, 1, max_tries=300)


