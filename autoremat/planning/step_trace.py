"""What planning reads of one trace of the training step.

AOTAutograd calls the partition callback (`planner.CapturePlanner`) once per graph while the step is traced,
so the callback accumulates. What leaves a trace is a `StepTrace`: a frozen value returned by the function
that traced (step_tracing.py), which every later stage (solving, compiling with a plan, the loss region's
chunk count, the regions="auto" form) takes as an argument.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from autoremat.capture.graph_code import GraphCode
    from autoremat.capture.regions import RegionLinks
    from autoremat.model.graph_profile import GraphProfile
    from autoremat.planning.dynamo_graphs import DynamoGraph
    from autoremat.planning.plan import Plan

GraphCall = tuple["int | None", "RegionLinks | None", "GraphCode | None"]  # (graph index, links, its eager code)


@dataclass(frozen=True)
class StepTrace:
    """One trace of the step, once it is over."""

    compiled: Any  # the step as traced (its torch.compile'd model); None where traced again from a kept graph
    calls: tuple[GraphProfile, ...]  # the profiles in the order the step calls them (graph_calls.CallLog.sequence)
    graphs: tuple[GraphProfile, ...]  # one profile per graph traced, in the order they were traced
    # Under eager, the code each graph call of the trace runs, and the traced step's code: a plan is swapped
    # into them instead of tracing again (planned_in_place.py).
    codes: tuple[GraphCall, ...]
    code: Any
    source: DynamoGraph | None  # the kept dynamo graph the profiles were traced from, if any (dynamo_graphs.py)
    per_block: bool  # whether the step was traced as one graph per repeated block (capture/regions.py)
    cached: Plan | None  # the plan cache's plan for the first graph's fingerprint, if one was found
    cached_applied: bool  # whether that plan was applied while tracing (then the trace is no capture)
    pre_pass: Callable | None  # the rewrite each dynamo graph was traced under (precision, the loss region)
    regions: bool  # whether repeated blocks were asked for as graphs of their own
