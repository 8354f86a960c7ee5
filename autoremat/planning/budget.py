"""The one budget, from bytes to the solver: what it leaves the activations (`room_for`, through
`Ledger.room`), every graph of a step solved jointly under it (`plan_graphs`), and a cached plan held to
it again (`check_cached`). A budget that nothing fits becomes a `BudgetError` here, with the smallest
budget that would fit (`Ledger.needs` of the smallest peak found).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from autoremat.model.devices import DeviceSpec
from autoremat.model.graph_profile import GraphProfile
from autoremat.model.ledger import Ledger
from autoremat.planning.graph_calls import one_set_per_graph, repeats
from autoremat.planning.options import DEFAULTS, PlanOptions
from autoremat.planning.plan import BudgetError, Plan
from autoremat.solve.decision import Decision, PlanPath, Route, evaluate
from autoremat.solve.solver import Infeasible, smallest_peak, solve

if TYPE_CHECKING:
    from autoremat.planning.step_trace import StepTrace

progress = logging.getLogger("autoremat.progress")  # the planning stages, at INFO (planner.progress)


def budget_or_memory(budget: int | None, device: DeviceSpec) -> int:
    """The budget in bytes; without one, the device's memory, or no limit at all on a CPU."""
    return budget if budget is not None else device.memory_bytes or 2**62


def plan_graphs(
    profiles: list[GraphProfile],
    budget: int | None,
    ledger: Ledger,
    device: DeviceSpec,
    options: PlanOptions = DEFAULTS,
    *,
    one_set: bool = False,
) -> Decision:
    """Solve the save/recompute ILP for graphs that run in one step, under what the ledger leaves.

    one_set: a profile that appears at several positions (one compiled graph called several times)
    saves the same values at each (graph_calls.one_set_per_graph); else each position is planned on its own."""
    solving = options.solving()
    budget = budget_or_memory(budget, device)
    room = room_for(budget, ledger, device)
    one_set = one_set and repeats(profiles)

    def smallest() -> Decision:
        return smallest_peak(profiles, granularity=device.alloc_granularity, options=solving)
    try:
        if room <= 0 or room < ledger.after_backward:  # optimizer.step() must fit too
            raise Infeasible(smallest(), "the fixed parts and optimizer.step()'s temporaries exceed the budget")
        decision = solve(profiles, room, granularity=device.alloc_granularity, options=solving)
        if one_set:
            decision = one_set_per_graph(profiles, decision, room)
            if decision.peak > room:
                raise Infeasible(smallest(), "no plan with one saved set per compiled graph fits")
        return decision
    except Infeasible as e:
        if one_set:  # the floor reported is that of the code that runs: one saved set per compiled graph
            e.smallest = one_set_per_graph(profiles, e.smallest, None)
        raise BudgetError.from_infeasible(budget, ledger, e, profiles, device) from None


def say_solving(profiles: list[GraphProfile], options: PlanOptions) -> list[GraphProfile]:
    """The solving stage's progress line (before `plan_graphs` solves `profiles` for a step); returns them."""
    progress.info("solving for %d nodes in %d graph(s) (time limit %g s per solve)",
                  sum(len(g.nodes) for g in profiles), len(profiles), options.time_limit)
    return profiles


def room_for(budget: int | None, ledger: Ledger, device: DeviceSpec) -> int:
    """What `budget` (None: the device's memory) leaves the graphs' activations after the ledger's fixed part."""
    return ledger.room(budget_or_memory(budget, device))


def check_cached(trace: StepTrace, budget: int, ledger: Ledger, dev: DeviceSpec) -> Plan | None:
    """Re-simulate the cached plan `trace` found on the graphs it traced; return it only if it is what it claims."""
    cached, profiles = trace.cached, list(trace.calls)
    if [g.fingerprint for g in cached.graphs] != [p.fingerprint for p in profiles] or cached.budget != budget:
        return None
    try:
        _, tl, cost = evaluate(profiles, [set(g.saved) | set(g.again) for g in cached.graphs], dev.alloc_granularity)
    except Exception:  # names that are not in the graph, a value nobody may recompute
        return None
    if ledger.needs(tl.peak) > budget:
        return None
    plan = Plan.from_dict(cached.to_dict())  # a copy: the caller may append notes
    plan.solver = {**plan.solver, "path": str(PlanPath(Route.CACHE)), "solved_by": cached.solver.get("path"), "solve_time_s": 0.0}
    ledger.activations = tl.peak
    plan.activation_peak, plan.predicted_peak, plan.recompute_time_s = tl.peak, ledger.total, cost
    return plan
