"""The loss region traced at one chunk count: the value the count's choice (choice.py) and its bounds
(bounds.py) both read, in a module of its own so that neither imports the other."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from autoremat.passes.loss_chunks import LossOption
from autoremat.solve.decision import Decision

if TYPE_CHECKING:
    from autoremat.planning.step_trace import StepTrace


@dataclass(frozen=True)
class ChunkCountTrace:
    """One chunk count of the loss region as traced (and planned in full, where it was): `build` plans
    and compiles the chosen one from this trace, without tracing the step again."""

    trace: StepTrace
    loss: LossOption
    decision: Decision | None = None  # plan_graphs' plan of its calls at the budget
