"""A plan's decision and its arithmetic: what each graph saves, replayed in the exact simulator.

`Decision` is what every planner (the ILP, the heuristics, save-all) returns: the saved values per
graph, the schedules they give, the simulated timeline (so the peak), the predicted recompute time,
and the route that produced it (`PlanPath`). `evaluate` turns saved sets into those schedules,
timeline and cost.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, replace
from enum import Enum

from autoremat.model import memory
from autoremat.model.graph_profile import GraphProfile
from autoremat.model.memory import Timeline, simulate
from autoremat.model.schedule import Schedule, make_schedule
from autoremat.passes.recompute_names import base


class Route(Enum):
    """Which planner produced a plan; the value is the text a plan's summary and JSON show."""

    SAVE_ALL = "save-all"  # everything fits: nothing recomputed
    ILP = "ilp"  # a budgeted ILP model's solution (`IlpVariant` says which model)
    ILP_MIN_PEAK = "ilp-min-peak"  # an ILP model's smallest-peak solution
    BLOCK_MODES = "block-modes"  # one mode per repeated block (`BlockModes` says how many of each)
    CHECKPOINT_BLOCKS = "checkpoint-blocks"  # checkpointing every repeated block
    GREEDY = "greedy"  # greedy's plan
    FRUGAL = "most frugal"  # the torch.compile backend's plan for a call before its step is known
    JOINT = "joint"  # a plan for a call handed over whole by its caller (the backend's step plan)
    CACHE = "cache"  # a plan re-used from the plan cache, not solved (the plan's solver["solved_by"] says how)


class Refinement(Enum):
    """A search run on a plan after its route found it, in the simulator; the value is its text."""

    SLACK_SPENT = "slack-spent"  # recomputed values saved back into unused room (heuristics.spend_slack)
    PEAK_LOWERED = "peak-lowered"  # values saved back where that lowers the peak (heuristics.lower_peak)
    RECOMPUTED_TWICE = "recomputed-twice"  # cuts that lower the peak (cut_search.recompute_twice)


@dataclass(frozen=True)
class IlpVariant:
    """Which ILP model gave the plan (ilp.py): recomputation dragged across a block, identical blocks sharing
    decisions; and whether the room had to be calibrated against the simulator (more than one round)."""

    block_drag: bool = False
    shared_blocks: bool = False
    calibrated: bool = False


@dataclass(frozen=True)
class BlockModes:
    """The per-block modes plan: the first `checkpoint` blocks checkpointed, the next `selective` selectively."""

    checkpoint: int
    selective: int


_ILP_ROUTES = (Route.ILP, Route.ILP_MIN_PEAK)
_BLOCK_MODES = re.compile(r"block-modes\(checkpoint (\d+), selective (\d+)\)")


@dataclass(frozen=True)
class PlanPath:
    """The route that produced a plan, what it says of itself (`detail`), and the refinements applied after it,
    in order. `str()` is the text a plan shows ("ilp+calibrated/block-drag+slack-spent"); `parse` reads it back."""

    route: Route
    detail: IlpVariant | BlockModes | None = None
    refinements: tuple[Refinement, ...] = ()

    def __post_init__(self) -> None:
        # An ILP route always names its model, so a path and its text's parse compare equal.
        if self.route in _ILP_ROUTES and self.detail is None:
            object.__setattr__(self, "detail", IlpVariant())

    def refined(self, refinement: Refinement) -> PlanPath:
        """This path with `refinement` applied after the ones it has."""
        return replace(self, refinements=(*self.refinements, refinement))

    def __str__(self) -> str:
        text, d = self.route.value, self.detail
        if isinstance(d, BlockModes):
            text += f"(checkpoint {d.checkpoint}, selective {d.selective})"
        elif isinstance(d, IlpVariant):
            text += ("+calibrated" if d.calibrated else "") + ("/block-drag" if d.block_drag else "") \
                + ("/shared-blocks" if d.shared_blocks else "")
        return text + "".join(f"+{r.value}" for r in self.refinements)

    @classmethod
    def parse(cls, text: str) -> PlanPath:
        """The path whose `str()` is `text` (a plan's JSON stores the text); ValueError for text no path gives."""
        head, *rest = text.split("+")
        flags = head.split("/")
        calibrated = flags[0] == Route.ILP.value and bool(rest) and rest[0].split("/")[0] == "calibrated"
        if calibrated:
            flags = [flags[0], *rest.pop(0).split("/")[1:]]
        name, flags = flags[0], flags[1:]
        try:
            refinements = tuple(Refinement(r) for r in rest)
            if (modes := _BLOCK_MODES.fullmatch(name)) is not None:
                detail: IlpVariant | BlockModes | None = BlockModes(int(modes[1]), int(modes[2]))
                route = Route.BLOCK_MODES
            else:
                route, detail = Route(name), None
        except ValueError:
            raise ValueError(f"not a plan path: {text!r}") from None
        if route in _ILP_ROUTES:
            if not set(flags) <= {"block-drag", "shared-blocks"}:
                raise ValueError(f"not a plan path: {text!r}")
            detail = IlpVariant("block-drag" in flags, "shared-blocks" in flags, calibrated)
        elif flags:
            raise ValueError(f"not a plan path: {text!r}")
        path = cls(route, detail, refinements)
        if str(path) != text:  # flags out of order or repeated: not a text any path gives
            raise ValueError(f"not a plan path: {text!r}")
        return path


@dataclass
class Decision:
    saved: list[set[str]]  # per graph
    schedules: list[Schedule]
    timeline: Timeline
    recompute_time_s: float
    status: str  # "optimal" | "time_limit" | "greedy" | "heuristic" | ...
    path: PlanPath  # which route produced it, and the refinements after it
    solve_time_s: float = 0.0
    rounds: int = 0
    solver: str = ""
    notes: list[str] = field(default_factory=list)
    granularity: int = 1

    @property
    def peak(self) -> int:
        return self.timeline.peak


def evaluate(graphs: list[GraphProfile], saved: list[set[str]], granularity: int = 1, limit: float = math.inf):
    """The schedules, timeline and recompute time of a saved set; with a `limit`, a timeline over it is cut
    short there (memory.simulate): for a search that keeps only plans at or under the limit."""
    schedules = [schedule_of(g, s) for g, s in zip(graphs, saved)]
    timeline = simulate(list(zip(graphs, schedules)), granularity, limit)
    cost = sum(g.nodes[n].time_s for g, sc in zip(graphs, schedules) for n in sc.recomputed)
    # values recomputed twice (cuts.py): each copy runs once more
    cost += sum(g.nodes[base(n)].time_s for g, sc in zip(graphs, schedules) if sc.again for n in sc.backward
                if n != base(n))
    return schedules, timeline, cost


# Schedules made so far, by graph and saved set. A search that changes one graph's saved set evaluates the
# step again, and every other graph's schedule is the one it had (a Schedule is never changed once made).
_SCHEDULES = memory.GraphMemo(256)


def schedule_of(g: GraphProfile, saved: set[str]) -> Schedule:
    """make_schedule(g, saved), remembered (memory.GraphMemo)."""
    return _SCHEDULES.get(g, lambda: (frozenset(saved),), lambda: make_schedule(g, saved))
