"""A plan's decision and its arithmetic: what each graph saves, replayed in the exact simulator.

`Decision` is what every planner (the ILP, the heuristics, save-all) returns: the saved values per
graph, the schedules they give, the simulated timeline (so the peak) and the predicted recompute time.
`evaluate` turns saved sets into those schedules, timeline and cost.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from autoremat.model import memory
from autoremat.model.cuts import base
from autoremat.model.graph_profile import GraphProfile
from autoremat.model.memory import Timeline, simulate
from autoremat.model.schedule import Schedule, make_schedule


@dataclass
class Decision:
    saved: list[set[str]]  # per graph
    schedules: list[Schedule]
    timeline: Timeline
    recompute_time_s: float
    status: str  # "optimal" | "time_limit" | "greedy" | "save_all"
    path: str  # which route produced it: "ilp", "ilp+tighten", "greedy"
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
