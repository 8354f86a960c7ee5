"""A trace's least predicted step time as the ILP's rows see it, and lower bounds of it: what the loss region's
chunk counts are compared by (planning/loss_region/choice.py), each trace on its own: one joint ILP with a choice of
trace is larger than all of them together, and solves slower than the traces one by one.

The time is the trace's ops run once (T0) plus the recomputation of the ILP's plan under the room. The rows
are not calibrated against the exact simulator: the caller plans the trace it picks in full.
"""

from __future__ import annotations

import math

import pulp

from autoremat.model.graph_profile import GraphProfile
from autoremat.solve import lp
from autoremat.solve.ilp import TIE_BYTES, IlpModel
from autoremat.solve.solver_options import SOLVER_DEFAULTS, SolverOptions

__all__ = ["least_time", "ops_once_time", "trace_time"]


def ops_once_time(graphs: list[GraphProfile]) -> float:
    """T0: the predicted time of every op of `graphs` run once (no recomputation)."""
    return sum(p.time_s for g in graphs for p in g.nodes.values())


def trace_time(graphs: list[GraphProfile], room: int, *, granularity: int = 1,
               options: SolverOptions = SOLVER_DEFAULTS, beat: float | None = None) -> float | None:
    """The least predicted step time of one trace under `room` bytes as the ILP's rows see it: T0 plus the
    recomputation of the ILP's plan; None where the rows see no plan. With `beat` (another trace's least
    time), the MIP stops once its bound shows this trace no faster, and returns that bound."""
    model, ops = _model(graphs, granularity), ops_once_time(graphs)
    backend = _backend(options, None if beat is None else _objective_of(model, beat - ops))
    result = model.solve(room, backend)
    if getattr(backend, "stopped_at", None) is not None:
        return ops + _time_of(model, backend.stopped_at)
    return None if result.saved is None else ops + (pulp.value(model.time_expr) or 0.0)


def least_time(graphs: list[GraphProfile], room: int, *, at_least: float, granularity: int = 1,
               options: SolverOptions = SOLVER_DEFAULTS) -> float:
    """A lower bound of `trace_time(graphs, room)`: T0 plus the least recomputation the MIP has proved its rows
    need. The caller only asks whether it reaches `at_least`: the MIP stops once its bound does, or once it
    holds a plan below it (then no bound can reach it). An infinite `at_least` asks for the bound itself: the
    MIP runs to its gap or time limit. T0 alone where the MIP proved nothing (no plan, or no bound by its time
    limit)."""
    model, ops = _model(graphs, granularity), ops_once_time(graphs)
    backend = _backend(options, _objective_of(model, at_least - ops))
    if math.isfinite(at_least):
        backend.give_up_below = (at_least - ops) / model.total_time  # a plan's objective is at least its time's share
    result = model.solve(room, backend)
    bound = backend.stopped_at
    if bound is None and result.saved is not None:
        bound = backend.dual_bound()
    return ops if bound is None else ops + max(0.0, _time_of(model, bound))


def _model(graphs: list[GraphProfile], granularity: int) -> IlpModel:
    return IlpModel(graphs, granularity, block_drag=True, shared_blocks=True)


def _backend(options: SolverOptions, stop_bound: float | None) -> lp.Solver:
    return options.backend(stop_at=None if stop_bound is None else (float("inf"), stop_bound))


# The objective (ilp.IlpModel._set_objective) is the recomputation's share of the step's ops plus at most TIE_BYTES for the
# saved bytes it breaks ties by; a bound on it bounds the recomputation by that much less.
def _objective_of(model: IlpModel, recompute_s: float) -> float:
    return recompute_s / model.total_time + TIE_BYTES


def _time_of(model: IlpModel, objective: float) -> float:
    return (objective - TIE_BYTES) * model.total_time
