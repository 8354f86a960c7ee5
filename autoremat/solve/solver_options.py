"""How the solve stage's MIPs are solved: which solver, how long each may run, at what gap (`SolverOptions`).

The faces take these as `optimize(solver=..., time_limit=..., gap=...)`; `PlanOptions.solving()` hands them to
the solve stage as one value, and each function of solve/ that runs a MIP takes that value.
"""

from __future__ import annotations

from dataclasses import dataclass

from autoremat.solve import lp

# Relative optimality gap of each MIP: on deep stacks 1% solves many times faster than 0.1%, and to the
# same objective (benchmarks/solver_scale.py times the solve by depth).
DEFAULT_GAP = 0.01


@dataclass(frozen=True)
class SolverOptions:
    """The MIP solver to use ("auto" or "highs": `lp.check_solver`), the seconds one solve may take, and the
    relative optimality gap at which a MIP stops."""

    solver: str = "auto"
    time_limit: float = 10.0
    gap: float = DEFAULT_GAP

    def backend(self, time_limit: float | None = None, gap: float | None = None,
                stop_at: tuple[float, float] | None = None) -> lp.Solver:
        """The solver (`lp.named`), stopping at `time_limit` seconds and `gap` (this value's, where not given)
        and, with `stop_at`, as `lp.highs` says."""
        return lp.named(self.solver, self.time_limit if time_limit is None else time_limit,
                        self.gap if gap is None else gap, stop_at)


# What a caller that names no options gets.
SOLVER_DEFAULTS = SolverOptions()
