"""Every graph of a traced step planned jointly under one budget, and the step compiled with that plan.

`solve_step` solves the ILP over the trace's graph calls (budget.plan_graphs), `plan_jointly` builds the
`Plan` from the answer and `compile_with` compiles the step with it: under eager from the trace's kept
dynamo graph (step_tracing.compile_planned), else by tracing the step again with the plan applied.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from autoremat.capture.blocks import repeated_blocks, skipped
from autoremat.model.ledger import Ledger
from autoremat.planning.budget import plan_graphs, say_solving
from autoremat.planning.graph_calls import repeats
from autoremat.planning.plan import Plan, build_plan
from autoremat.planning.planned_step import PlannedStep
from autoremat.planning.planner import progress
from autoremat.planning.step_tracing import compile_planned, planner_for, trace_step
from autoremat.solve.decision import Decision

if TYPE_CHECKING:
    from autoremat.planning.options import TrainingStep
    from autoremat.planning.step_trace import StepTrace


def solve_step(step: TrainingStep, trace: StepTrace, budget: int, reserve: Ledger | None = None) -> Decision:
    """Every graph of the step (graph breaks, regions) solved jointly under one budget (`plan_graphs`).

    `reserve`: solve against this ledger instead (the fixed bytes plus memory a real step showed the model
    does not predict); the plan built from the answer still reports `step.ledger`."""
    profiles = say_solving(list(trace.calls), step.options)
    return plan_graphs(profiles, budget, reserve or step.ledger, step.dev, step.options, one_set=True)


def plan_jointly(step: TrainingStep, trace: StepTrace, budget: int, decision: Decision) -> PlannedStep:
    """The plan of `decision` (every graph of the step, solved jointly under `budget`), compiled."""
    ledger, dev = step.ledger, step.dev
    profiles = list(trace.calls)
    plan = build_plan(profiles, decision, ledger, budget, dev.name)
    if skipped(step.model):
        blocks = repeated_blocks(step.model)
        plan.notes.append(f"dynamo skipped {type(step.model).__name__}.forward (a graph break inside the loop over its "
                          f"blocks): each of its {len(blocks)} {type(blocks[0]).__name__} blocks was compiled on its "
                          "own and planned jointly with the others; the code around them runs eagerly, and the real "
                          "step's verification holds what it keeps to the budget")
    progress.info("compiling the planned step")
    if repeats(profiles):
        plan.notes.append(f"{len(profiles)} graph calls of {len({id(g) for g in profiles})} compiled graphs (a graph "
                          "break inside a loop compiles the loop body once, called per iteration) were planned "
                          "jointly under one budget")
    elif len(profiles) > 1:
        plan.notes.append(f"{len(profiles)} graphs (one per repeated block, and one per graph break) were planned "
                          "jointly under one budget")
    return compile_with(step, trace, budget, plan)


def compile_with(step: TrainingStep, trace: StepTrace, budget: int, plan: Plan) -> PlannedStep:
    """The step `trace` traced, compiled with `plan`, with the planner that applied it and its trace."""
    applier = planner_for(step, budget, plan=plan, pre_pass=trace.pre_pass, regions=trace.regions)
    # Inductor's compilers run in dynamo's own context: only eager's step is compiled from the kept graph
    if trace.source is not None and step.compiler == "eager":
        planned = compile_planned(step, applier, trace)
    else:
        planned = trace_step(step, applier)
    return PlannedStep(plan, planned.compiled, applier, planned)
