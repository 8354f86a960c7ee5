"""What planning hands the faces: a `PlannedStep`, the plan with the step compiled under it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    from autoremat.planning.plan import Plan
    from autoremat.planning.planner import CapturePlanner
    from autoremat.planning.step_trace import StepTrace


class PlannedStep(NamedTuple):
    """A planned step: the plan, the step compiled with it (as the user calls it), the partition callback
    that applied the plan (it goes on serving recompiles), and that callback's trace of the compiled step
    (what a re-plan starts from; None once planning is over, so that the kept graph is let go)."""

    plan: Plan
    compiled: Any
    applier: CapturePlanner
    trace: StepTrace | None

    def finished(self) -> PlannedStep:
        """Planning is over: the applier forgives from now on (CapturePlanner.done), the trace is let go."""
        self.applier.done()
        return self._replace(trace=None)
