"""Choose, for every forward value the backward reads, save or recompute, within the activations' room:
the bytes the step's budget leaves them after the ledger's fixed part (`Ledger.room`).

The ILP itself (variables, rows, objective) is `ilp.IlpModel`; its formulation is written out in
ilp.py's docstring. This module is what is done with it: which models to build, how long each may
run, how a solution is checked against the exact simulator, and what is used when the ILP gives no
plan.

Two kinds of model are built, because a recomputed value lives as the schedule runs it, not as its own
readers alone would have it. The JIT schedule (memory.py) computes a recomputed value when its first
consumer runs, so a recomputed consumer w needed before u drags u forward in time, and u lives from then
to its last use. The local model forbids such a drag, so each value's rows are its own readers' (the
recomputation stays between the saved values it starts from); the block-drag model allows it inside one
repeated block (e.g. "transformer.h.3", the natural checkpoint segment, where such chains are what
checkpointing the block does) and allocates u from the earliest time a chain of recomputed consumers could
need it. Each comes full (every node its own variables) and with identical blocks sharing decisions (smaller:
the answer when the full one runs out of time on a huge graph; built only where a graph has identical
blocks, for elsewhere it is the full model again). Each solution is replayed by the exact simulator and
the ILP's room calibrated against it (tightened on overshoot, loosened on slack). The plans of
heuristics.py (per-block modes, checkpointing, greedy) compete with it, and are the answer when the
ILP runs out of time.
"""

from __future__ import annotations

import time
from collections import OrderedDict

from autoremat.model.graph_profile import GraphProfile
from autoremat.solve import heuristics, lp
from autoremat.solve.cut_search import recompute_twice, refine_further
from autoremat.solve.decision import Decision, IlpVariant, PlanPath, Route, evaluate
from autoremat.solve.heuristics import block_mode_plans, checkpoint_blocks, greedy, lower_peak, save_all, spend_slack
from autoremat.solve.ilp import IlpModel, IlpResult, block_twins
from autoremat.solve.precision_choices import DtypeChoices
from autoremat.solve.solver_options import DEFAULT_GAP, SOLVER_DEFAULTS, SolverOptions

__all__ = ["DEFAULT_GAP", "Decision", "IlpModel", "IlpResult", "Infeasible", "block_mode_plans", "checkpoint_blocks",
           "SolverOptions", "choose_dtypes", "evaluate", "greedy", "lower_peak", "save_all", "smallest_peak", "solve",
           "spend_slack"]

# Once one ILP model has given a plan, a later model's MIP stops as soon as it holds a solution as good
# as that plan's (within MATCH) and its bound shows it cannot beat it by more than this share of the
# step's time (the objective's unit, ilp.py): the later models are there to find a better plan,
# and one better by less is not worth the proof. The MIP's own gap is relative to the recomputation: where a
# plan recomputes a small share of the step, a later model can hold the plan already found at once and then
# spend seconds of branching proving a gain worth a hundredth of a percent of the step
# (benchmarks/plan_time.py times the solving stage).
LATER_MODEL_STEP_GAP = 0.002
MATCH = 1e-7  # objectives this close are the same plan's, summed over other rows (float rounding, about 1e-10)
# Share of `time_limit` after which `solve` starts no new work: building a model and handing it to
# the MIP solver cost time of their own (a sizable share of a solve on a large graph), so stop
# starting early enough to end near the limit.
SOLVE_SHARE = 0.85
# Share of the time left that one MIP may use: the rest covers PuLP handing the model over (outside
# the solver's own limit) and the calibration rounds after it.
MIP_SHARE = 0.7
# Seconds below which a MIP is not started (and the least it is given): less rarely finds a plan.
MIN_MIP_S = 0.5
NEXT_MODEL_MARGIN_S = 1.0  # seconds kept free, besides twice the last build's time, before building another model
# Calibration stops once a fitting plan leaves at most this share of the room unused.
SLACK_STOP = 0.01
# Each min-peak MIP (the calibration's, `smallest_peak`'s) gets this share of the time limit (at least MIN_PEAK_MIP_S),
# at this relative gap (the peak is what BudgetError reports, so it is solved tighter than DEFAULT_GAP)...
MIN_PEAK_MIP_SHARE = 1 / 4
MIN_PEAK_MIP_S = 2.0
MIN_PEAK_GAP = 1e-3
# ...and once one min-peak plan is in hand, no further model starts after this share of the limit:
# the rest goes to checkpointing and greedy.
MIN_PEAK_MODELS_SHARE = 1 / 2
# Greedy's changes toward the room, and when it looks for the smallest peak (each simulates the whole step).
GREEDY_TRIES, MIN_PEAK_GREEDY_TRIES = 300, 100
# A floor query's options where its caller names none: more time than a solve's, for the floor a BudgetError names.
FLOOR_DEFAULTS = SolverOptions(time_limit=30.0)


def min_peak_seconds(time_limit: float) -> float:
    """What one min-peak MIP may take under `time_limit`."""
    return max(MIN_PEAK_MIP_S, MIN_PEAK_MIP_SHARE * time_limit)


def _solve_model(model: IlpModel, graphs, room, options: SolverOptions, granularity, max_rounds, deadline,
                 stop_at: tuple[float, float] | None = None, min_peak_s: float = MIN_PEAK_MIP_S) -> Decision | None:
    """Solve one ILP model, calibrating its (conservative) rows against the exact simulator.

    If the simulated plan overshoots, ask the ILP for that much less. If it undershoots, the rows
    were pessimistic: ask for the slack back and keep the cheapest plan that fits. If the ILP finds
    nothing, learn how pessimistic its rows are from its own smallest-peak plan and retry once; that
    plan is kept if it fits (rows above the room, the simulator within it: the 12-block stack at
    checkpointing's peak, whose retry can then run out of time on a busy machine).

    `stop_at` (`lp.highs`) may end each budgeted MIP early; the objective of the best plan's solution is
    left in `model.best_objective`.
    """
    # `target` is what this round asks of the ILP: the room, calibrated against the simulator.
    target, best, learned, overshoots = room, None, False, 0
    model.last_status, model.best_objective = "infeasible", None
    for rounds in range(1, max_rounds + 1):
        remaining = deadline - time.perf_counter()
        if remaining < MIN_MIP_S:
            break
        # Each MIP gets most of what is left, less the time PuLP takes to hand the model to the
        # solver (outside the solver's own limit; about the model's build time).
        mip_s = MIP_SHARE * max(MIN_MIP_S, remaining - model.build_s)
        backend = options.backend(mip_s, stop_at=stop_at)
        result = model.solve(target, backend)
        status, saved = result.status, result.saved
        model.last_status = status
        if saved is None:
            if learned or best is not None:
                break
            learned = True
            low = _min_peak(model, options, min(mip_s, min_peak_s))
            if low.saved is None:
                break
            low_schedules, low_tl, low_cost = evaluate(graphs, low.saved, granularity)
            if low_tl.peak <= room:  # the rows' smallest peak may fit in the simulator: a plan in hand
                best = Decision(low.saved, low_schedules, low_tl, low_cost, low.status,
                                PlanPath(Route.ILP_MIN_PEAK, IlpVariant(model.block_drag)), rounds=rounds,
                                solver=type(backend).__name__,
                                notes=["the ILP found no plan within the activations' room, but its smallest-peak plan "
                                       "fits the simulator and is used"])
            offset = low.predicted_peak - low_tl.peak
            if offset <= 0:
                break
            target = room + offset
            continue
        schedules, tl, cost = evaluate(graphs, saved, granularity)
        if tl.peak <= room:
            if best is None or cost < best.recompute_time_s:
                path = PlanPath(Route.ILP, IlpVariant(model.block_drag, model.shared_blocks, calibrated=rounds > 1))
                best = Decision(saved, schedules, tl, cost, status, path, rounds=rounds,
                                solver=type(backend).__name__)
                model.best_objective = result.objective
            overshoots = 0
            slack = room - tl.peak
            if cost == 0 or slack <= SLACK_STOP * room or time.perf_counter() > deadline:
                break
            target += slack  # memory the rows could not see: offer it to the ILP
        else:
            if time.perf_counter() > deadline:
                break
            # The ILP was optimistic by this much: ask for less, and for more each time in a row it
            # still overshoots (a plan near the limit tends to move by less than the step asked).
            overshoots += 1
            # Below this plan's own row peak, or the ILP hands back the same plan: where its rows see
            # less than the simulator (fused values under Inductor), a target still above that peak
            # would be lowered round after round without changing anything.
            below = min(target, result.predicted_peak) if result.predicted_peak is not None else target
            target = below - (tl.peak - room) * 2 ** (overshoots - 1)
    return best


def solve(
    graphs: list[GraphProfile],
    room: int,
    *,
    granularity: int = 1,
    options: SolverOptions = SOLVER_DEFAULTS,
    max_rounds: int = 5,
) -> Decision:
    """Fastest plan whose simulated activation peak fits `room` bytes; see the module docstring.

    Two ILP models are solved: one that keeps recomputation local (exact start times) and one that
    lets it span a repeated block (checkpoint-like segments, start times bounded). The cheaper
    plan the simulator accepts wins; then the greedy plan, then the smallest-peak plan. Whatever
    room the chosen plan leaves unused is spent saving recomputed values back (`spend_slack`).
    Raises `Infeasible` carrying the smallest activation peak any plan reached.
    """
    t0 = time.perf_counter()
    time_limit = options.time_limit
    solver_name = type(options.backend()).__name__
    everything = save_all(graphs)
    schedules, tl, _ = evaluate(graphs, everything, granularity)
    if tl.peak <= room:  # no recomputation needed: nothing to solve
        return Decision(everything, schedules, tl, 0.0, "optimal", PlanPath(Route.SAVE_ALL), solver="none",
                        solve_time_s=time.perf_counter() - t0, granularity=granularity)
    deadline = t0 + SOLVE_SHARE * time_limit
    # Per-block modes (save / selective / checkpoint): cheap to search, a plan for the ILP to beat,
    # and the answer when the ILP runs out of time on a large graph.
    found = block_mode_plans(graphs, room, granularity)
    models, beat, twins = [], float("inf"), None  # beat: the objective of the best plan an ILP model gave
    # The full model first (with chained running sums it solves a 48-block stack in seconds), then
    # identical blocks sharing decisions (smaller: the answer when the full one runs out of time on
    # a huge graph), then the block-drag ones.
    for shared, block_drag in ((False, False), (True, False), (False, True), (True, True)):
        twins = _has_twins(graphs, models[0]) if shared and twins is None else twins
        if shared and not twins:
            continue
        if time.perf_counter() > deadline - NEXT_MODEL_MARGIN_S - 2 * (models[-1].build_s if models else 0.0):
            break
        models.append(IlpModel(graphs, granularity, block_drag, shared))
        d = _solve_model(models[-1], graphs, room, options, granularity, max_rounds, deadline,
                         None if beat == float("inf") else (beat + MATCH, beat - LATER_MODEL_STEP_GAP),
                         min_peak_seconds(time_limit))
        if d is not None:
            found.append(d)
        if models[-1].best_objective is not None:  # None where its plan is the min-peak one (bytes)
            beat = min(beat, models[-1].best_objective)
    best = min(found, key=lambda d: (d.recompute_time_s, d.peak), default=None)
    status = best.status if best else (models[0].last_status if models else "time_limit")
    if best is None:
        saved, fewer = heuristics.greedy_with(graphs, room, granularity, GREEDY_TRIES, MIN_PEAK_GREEDY_TRIES)
        schedules, tl, cost = evaluate(graphs, saved, granularity)
        if tl.peak <= room:
            best = Decision(saved, schedules, tl, cost, "greedy", PlanPath(Route.GREEDY), solver=solver_name,
                            notes=[f"ILP gave no plan that fits ({status}); used the greedy plan"])
    if best is None:
        # The floor query's own search (its candidates, not this room's): a refusal names the floor that a
        # query with budget=1 names, whatever budget asked, and a room at or above that floor gets its plan.
        # No try of greedy's fitted the room, so its plan after fewer tries is the floor query's greedy plan.
        best = smallest_peak(graphs, granularity=granularity, options=options, room=room, built=models,
                             greedy_plan=fewer)
        if best.peak > room:
            raise Infeasible(best, status)
        best.notes.append("the ILP found no plan within the activations' room; used the first plan of the "
                          "smallest-peak search that fits")
    if best.peak < room and best.recompute_time_s > 0:
        best = spend_slack(graphs, best, room, granularity)
    best.solve_time_s = time.perf_counter() - t0
    best.granularity = granularity
    return best


def _has_twins(graphs: list[GraphProfile], model: IlpModel) -> bool:
    """Whether some graph has identical blocks to share decisions between (a built model's lifetimes): without
    any, a shared model has the full one's variables and rows, and would be solved again to the same answers."""
    return any(block_twins(g, life) for g, life in zip(graphs, model.lifetimes))


# The smallest-peak plan found so far for each step, by its graphs' structure: the min-peak MIPs stop on time,
# so a later call on a busier machine could find a worse plan than the floor a BudgetError reported. Remembered,
# the floor a process reports is reachable, and never rises, in it. The least recently used is forgotten first.
FLOOR_MEMO_SIZE = 32
_floor_memo: OrderedDict[tuple, tuple[int, list[frozenset[str]], PlanPath]] = OrderedDict()


def _floor_key(graphs: list[GraphProfile], granularity: int) -> tuple:
    """What a remembered plan depends on: each graph's structure, its node names, and which nodes the
    compiler fuses or may not recompute (so an eager plan is never offered to an Inductor trace), or the user marked."""
    return (granularity, *((g.index, g.fingerprint, tuple(g.nodes), tuple(g.released),
                            tuple(n for n, p in g.nodes.items() if p.fused or p.recompute_ban or p.mark)) for g in graphs))


def _remember_floor(key: tuple, d: Decision) -> None:
    if key not in _floor_memo or d.peak < _floor_memo[key][0]:
        _floor_memo[key] = (d.peak, [frozenset(s) for s in d.saved], d.path)
    _floor_memo.move_to_end(key)
    while len(_floor_memo) > FLOOR_MEMO_SIZE:
        _floor_memo.popitem(last=False)


def forget_floors() -> None:
    """Every remembered floor forgotten: the next `smallest_peak` searches from nothing (a benchmark timing a
    search, a test comparing two searches)."""
    _floor_memo.clear()


def smallest_peak(graphs, *, granularity=1, options: SolverOptions = FLOOR_DEFAULTS, room: int | None = None,
                  built: list[IlpModel] = (), greedy_plan: list[set[str]] | None = None) -> Decision:
    """The plan with the smallest simulated activation peak we can find; with `room`, the first plan
    the search reaches that fits it.

    Candidates: each ILP model's min-peak solution, checkpointing every repeated block, greedy, and
    the best plan an earlier call found for the same graphs (`_floor_memo`); each is lowered further
    by saving values back (`heuristics.lower_peak`), the lowest then by recomputing values twice
    (`cut_search.recompute_twice`), and checkpointing too, and the lowest is kept.

    options: the solver and time limit (each min-peak MIP gets a share of it, at MIN_PEAK_GAP: its gap is not used).
    built: ILP models a caller already built for these graphs (`solve`'s), used where they are the floor
    query's own (`_floor_model`), so their min-peak solutions are not solved again; greedy_plan: greedy's plan
    after MIN_PEAK_GREEDY_TRIES tries, where a caller's search already found it (a search toward a room no
    try fits makes the tries a search toward no room makes).

    `room` is for a caller that needs a plan within a budget (`solve`, when neither the ILP nor greedy gave
    one), not the floor: the candidates are the floor query's, and after each stage the fastest plan found that
    fits is returned, and the later stages (hundreds of simulations of the whole step, the cliff in planning
    time near the floor that benchmarks/plan_time.py --cliff shows) are not run. Such a plan is not remembered
    as the floor. A floor query, and a room below every plan, search to the end, and so name the same floor.
    """
    start, time_limit = time.perf_counter(), options.time_limit
    models = [_floor_model(graphs, granularity, block_drag, built) for block_drag in (False, True)]
    min_peak_s = min_peak_seconds(time_limit)
    solver_name = type(options.backend(min_peak_s, MIN_PEAK_GAP)).__name__
    starts = []  # (saved sets, the path that found them): the search's starting plans
    status = "infeasible"
    for model in models:
        if starts and time.perf_counter() - start > MIN_PEAK_MODELS_SHARE * time_limit:
            break  # one min-peak plan in hand; the rest of the time goes to the plans below
        result = _min_peak(model, options, min_peak_s)
        status = result.status
        if result.saved is not None:
            starts.append((result.saved, PlanPath(Route.ILP_MIN_PEAK, IlpVariant(model.block_drag))))
    starts.append((checkpoint_blocks(graphs), PlanPath(Route.CHECKPOINT_BLOCKS)))
    if greedy_plan is None:
        greedy_plan = greedy(graphs, 0, granularity, MIN_PEAK_GREEDY_TRIES)
    starts.append((greedy_plan, PlanPath(Route.GREEDY)))
    key = _floor_key(graphs, granularity)
    remembered = [set(s) for s in _floor_memo[key][1]] if key in _floor_memo else None
    if remembered is not None:
        starts.append((remembered, _floor_memo[key][2]))
    candidates: list[Decision] = []
    for cand, path in starts:
        if any(c.saved == cand for c in candidates):
            continue
        try:
            schedules, tl, cost = evaluate(graphs, cand, granularity)
        except ValueError:  # a candidate the schedule cannot run (a needed value nobody may recompute)
            continue
        candidates.append(Decision(cand, schedules, tl, cost, status, path, solver=solver_name,
                                   granularity=granularity))
    if not candidates:
        return None
    if (fits := _fastest_within(candidates, room)) is not None:
        return fits
    # Every candidate is lowered, not only the best: saving values back can reorder them (the candidate with
    # the lower peak before lowering need not be the lower one after). At most five candidates, up to 150
    # simulations of the whole step each; a remembered plan was refined when it was found.
    lowered = [d if d.saved is remembered else lower_peak(graphs, d, granularity) for d in candidates]
    if (fits := _fastest_within(lowered, room)) is not None:
        return fits
    best = min(lowered, key=lambda d: (d.peak, d.recompute_time_s))
    if best.saved is not remembered:
        # then values recomputed twice where that lowers the simulated peak: from the best, and from
        # checkpointing (whose recomputed blocks leave the cuts the most to gain)
        refined = [recompute_twice(graphs, best, granularity)]
        blocks = next((d for d in candidates if d.path == PlanPath(Route.CHECKPOINT_BLOCKS)), None)
        if blocks is not None and best.path.route is not Route.CHECKPOINT_BLOCKS:
            refined.append(lower_peak(graphs, recompute_twice(graphs, blocks, granularity), granularity))
        best = min(refined, key=lambda d: (d.peak, d.recompute_time_s))
        if (fits := _fastest_within(refined, room)) is not None:
            return fits
        best = refine_further(graphs, best, granularity)
    _remember_floor(key, best)
    return best


def _floor_model(graphs, granularity: int, block_drag: bool, built) -> IlpModel:
    """The floor query's ILP model with `block_drag` (identical blocks sharing decisions): one of `built` that is
    that model, or a new one. A model without shared decisions is that model where no graph has identical
    blocks (`_has_twins`: it then has the same variables and rows)."""
    for m in built:
        if m.block_drag == block_drag and m.shared_blocks:
            return m
    for m in built:
        if m.block_drag == block_drag and not _has_twins(graphs, m):
            return m
    return IlpModel(graphs, granularity, block_drag, shared_blocks=True)


def _min_peak(model: IlpModel, options: SolverOptions, time_limit: float) -> IlpResult:
    """The model's min-peak solution at MIN_PEAK_GAP within `time_limit` (no stop_at: its objective is bytes),
    solved once: near the floor the calibration asks for it to learn the rows' pessimism, and `smallest_peak`
    asks again to start its search from it. Solved again only for a caller with more time than a solve that
    stopped on time had (single-threaded HiGHS finds nothing better in the same time)."""
    cached = model.min_peak
    if cached is None or (cached[0].status != lp.OPTIMAL and time_limit > cached[1]):
        model.min_peak = (model.solve(None, options.backend(time_limit, MIN_PEAK_GAP), min_peak=True), time_limit)
    return model.min_peak[0]


def _fastest_within(plans: list[Decision], room: int | None) -> Decision | None:
    """The plan of `plans` with the least recompute time whose peak fits `room`; None without a room or a fit."""
    fits = [d for d in plans if room is not None and d.peak <= room]
    return min(fits, key=lambda d: (d.recompute_time_s, d.peak), default=None)


class Infeasible(Exception):
    def __init__(self, smallest: Decision, status: str) -> None:
        super().__init__(f"no plan fits (solver status {status}); smallest peak found {smallest.peak} B")
        self.smallest = smallest
        self.status = status


def choose_dtypes(
    graphs: list[GraphProfile],
    choices: list[DtypeChoices | None],
    room: int,
    tolerance: float | None,
    *,
    granularity: int = 1,
    options: SolverOptions = SOLVER_DEFAULTS,
) -> list[dict[str, str]] | None:
    """Compute dtypes and save/recompute chosen together, on fp32-traced graphs: the first stage of
    precision="auto". Returns, per graph, the calls to run in bf16/fp16, or None if nothing fits.

    The memory rows see each value at 2 or 4 bytes per element as its owners decide; the objective
    is the recomputation time plus the dtype-dependent time of the step (faster 16-bit kernels,
    the casts they need); the measured errors of the chosen calls sum to at most `tolerance`. The
    caller traces the graphs again with these dtypes and solves save/recompute exactly on them
    (the second stage), since the rows here only approximate a mixed graph.
    """
    model = IlpModel(graphs, granularity, block_drag=False, choices=choices, tolerance=tolerance)
    result = model.solve(room, options.backend())
    if result.saved is None:
        return None
    return model.chosen_dtypes()
