"""The one place that speaks PuLP's API, so the ILP modules run on PuLP 3 and PuLP 4 alike.

PuLP 4 (Python 3.12 and newer) rebuilt the modelling layer on a Rust core. Four things the ILP
modules rely on changed, and this module gives each one spelling that works on both majors:

- a variable is made by its problem (`prob.add_variable`); `LpVariable(name, lowBound=...)` is
  gone. PuLP 3.3 already has `add_variable`, which is why the floor of the supported range is 3.3;
- `LpAffineExpression()` no longer builds an empty expression: `zero()` and `of(var)` do;
- `solve()` returns a statistics object instead of a status code, and `sol_status` is gone:
  `solve()` here returns autoremat's own status words either way;
- CBC is no longer bundled, so HiGHS (through `highspy`, a hard dependency) is the solver.

Everything else the ILP modules use (`lpSum`, `value`, arithmetic and comparisons on variables
and expressions, bounds set through `lowBound` / `upBound`) reads the same on both.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys

import highspy
import pulp

PULP_MAJOR = int(pulp.__version__.split(".")[0])

Problem = pulp.LpProblem
Variable = pulp.LpVariable
Expression = pulp.LpAffineExpression
Solver = pulp.LpSolver

# The statuses `solve` reports. A solution exists only for the first two; "time_limit" means the
# solver stopped early (time, node or gap limit) holding an incumbent that satisfies every row.
OPTIMAL, TIME_LIMIT, INFEASIBLE, NOT_SOLVED = "optimal", "time_limit", "infeasible", "not solved"


# The ILP solvers a caller may name: HiGHS is the one solver (PuLP 4 no longer bundles CBC), and
# "auto" stays accepted so that code written for the choice keeps working.
SOLVERS = ("auto", "highs")


def check_solver(name: str) -> None:
    """A clear error for a solver name autoremat does not run."""
    if name == "cbc":
        raise ValueError("solver='cbc' is no longer supported: PuLP 4 does not bundle CBC, and autoremat "
                         "solves with HiGHS (highspy, installed with autoremat); use solver='highs' or 'auto'")
    if name not in SOLVERS:
        raise ValueError(f"solver must be one of {SOLVERS}, got {name!r}")


def problem(name: str) -> Problem:
    """An empty minimisation problem."""
    return pulp.LpProblem(name, pulp.LpMinimize)


def binary(prob: Problem, name: str) -> Variable:
    """A 0/1 variable of `prob`."""
    return prob.add_variable(name, cat=pulp.LpBinary)


def continuous(prob: Problem, name: str, low: float | None = None, up: float | None = None) -> Variable:
    """A continuous variable of `prob`, free where a bound is None."""
    return prob.add_variable(name, low, up, cat=pulp.LpContinuous)


def zero() -> Expression:
    """An empty expression, to add terms to."""
    return pulp.lpSum([])


def of(var: Variable) -> Expression:
    """The expression 1 * var (a variable alone is not an expression in either major)."""
    return pulp.lpSum([var])


def named(name: str, time_limit: float, gap: float, stop_at: tuple[float, float] | None = None) -> Solver:
    """The solver `name` ("auto" or "highs": `check_solver`) as `highs` configures it."""
    check_solver(name)
    return highs(time_limit, gap, stop_at)


def highs(time_limit: float, gap: float, stop_at: tuple[float, float] | None = None) -> Solver:
    """HiGHS through highspy, single-threaded (plans must not depend on the machine's core count),
    silent, stopping at `time_limit` seconds or the relative `gap`; with `stop_at` = (objective, bound),
    also once it holds a solution whose objective is at most `objective` and its lower bound on the
    objective has reached `bound`."""
    if stop_at is None:
        solver = pulp.HiGHS(msg=False, timeLimit=time_limit, gapRel=gap, threads=1)
    else:
        solver = HiGHS(msg=False, timeLimit=time_limit, gapRel=gap, threads=1)
        solver.stop_at = stop_at
    if not solver.available():
        raise RuntimeError("autoremat solves its ILP with HiGHS, but PuLP cannot load highspy: "
                           "`pip install highspy` (a dependency of autoremat) and try again")
    return solver


class HiGHS(pulp.HiGHS):
    """PuLP's HiGHS (and named so in plans) that stops a MIP from its interrupt callback at `stop_at`
    (`highs`). Both PuLP majors create the highspy model in `createAndConfigureSolver`, and the callback
    is attached there."""

    stop_at = (float("-inf"), float("inf"))
    stopped_at: float | None = None
    give_up_below = float("-inf")  # also stop once a solution's objective is below this (`gave_up`)
    gave_up = False

    def createAndConfigureSolver(self, lp):  # noqa: N802 - PuLP's name
        super().createAndConfigureSolver(lp)
        self._highs = lp.solverModel
        lp.solverModel.setCallback(self._interrupt, None)
        lp.solverModel.startCallback(highspy.cb.HighsCallbackType.kCallbackMipInterrupt)

    def dual_bound(self) -> float | None:
        """The MIP's lower bound on the objective when it ended: no solution lies below it. None before a
        solve, or where HiGHS reports none."""
        highs_model = getattr(self, "_highs", None)
        bound = None if highs_model is None else highs_model.getInfo().mip_dual_bound
        return bound if bound is not None and math.isfinite(bound) else None

    def _interrupt(self, callback_type, message, data_out, data_in, user_data) -> None:
        objective, bound = self.stop_at
        if data_out.mip_primal_bound <= objective and data_out.mip_dual_bound >= bound:
            data_in.user_interrupt = True
            self.stopped_at = data_out.mip_dual_bound  # the lower bound that ended it
        elif data_out.mip_primal_bound < self.give_up_below:
            data_in.user_interrupt = self.gave_up = True


def solve(prob: Problem, solver: Solver) -> str:
    """Solve `prob` and return one of the statuses above (or the solver's own word for another
    outcome without a solution, such as "unbounded")."""
    with quiet_stdout():
        result = prob.solve(solver)
    if PULP_MAJOR >= 4:
        status = result.status
        if result.has_solution:
            return OPTIMAL if status == pulp.LpSolveStatus.Optimal else TIME_LIMIT
        if status == pulp.LpSolveStatus.Infeasible:
            return INFEASIBLE
        return NOT_SOLVED if status in (pulp.LpSolveStatus.NotSolved, pulp.LpSolveStatus.TimeLimit) \
            else status.name.lower()
    if prob.sol_status == pulp.LpSolutionOptimal:
        return OPTIMAL
    if prob.sol_status == pulp.LpSolutionIntegerFeasible:
        return TIME_LIMIT
    return pulp.LpStatus[prob.status].lower()


def has_solution(status: str) -> bool:
    return status in (OPTIMAL, TIME_LIMIT)


def constraint_count(prob: Problem) -> int:
    return prob.numConstraints()


@contextlib.contextmanager
def quiet_stdout():
    """HiGHS prints a banner from C++ whatever msg says; keep the user's stdout clean."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # no real stdout (pytest capture, notebooks)
        yield
        return
    sys.stdout.flush()
    saved = os.dup(fd)
    with open(os.devnull, "w") as null:
        os.dup2(null.fileno(), fd)
        try:
            yield
        finally:
            os.dup2(saved, fd)
            os.close(saved)
