"""The graph calls of one step as `optimize` traces it, and one saved set per compiled graph.

A graph break inside a loop (`for block in self.blocks: ... torch._dynamo.graph_break()`) makes
dynamo skip the loop's frame and compile the loop body (`Block.forward`) on its own: one compiled
graph, called once per block. AOTAutograd hands the planner that graph once, so a step planned from
the graphs compiled (one block and the tail, on docs/backend.md's MLP stack) holds one block's saved
values where the real step holds one per block, and the prediction falls short of the real peak by the
others. `CallLog` records which compiled graph each call of the
traced forward ran, so the step is planned as the calls it makes (`planner.CapturePlanner.sequence`).

The calls of one compiled graph all run the same code, hence the same saved set, while the joint ILP
picks one per call position: `one_set_per_graph` keeps, for each graph called more than once, the set
of one of its positions for all of them, the one whose step fits and recomputes least (else the one
with the lowest peak), so the prediction is the simulation of the code that runs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from autoremat.model.graph_profile import GraphProfile
from autoremat.solve.decision import Decision, evaluate


class CallLog:
    """Wraps a dynamo backend so that each call of a compiled graph notes the profiles it runs, in order.

    `profiles` is the planner's list (a compile appends the profiles of the graphs it makes: one per
    region); calls are noted only while `recording` (the traced forward), not on later steps."""

    def __init__(self, profiles: list[GraphProfile]) -> None:
        self.profiles = profiles
        self.calls: list[GraphProfile] = []
        self.recording = False

    def wrap(self, backend: Callable) -> Callable:
        def compile_one(gm: Any, example_inputs: list) -> Callable:
            before = len(self.profiles)
            fn = backend(gm, example_inputs)
            made = self.profiles[before:]

            def call(*args: Any) -> Any:
                if self.recording:
                    self.calls.extend(made)
                return fn(*args)
            if getattr(fn, "_boxed_call", False):  # dynamo hands a boxed function its arguments as one list
                call._boxed_call = True  # type: ignore[attr-defined]
            return call
        return compile_one

    def sequence(self) -> list[GraphProfile]:
        """The profiles of the traced step's calls in order, where a compiled graph ran more than once;
        else the profiles as compiled (a step whose every graph ran once, or one not traced through this log)."""
        if repeats(self.calls) and {id(g) for g in self.calls} == {id(g) for g in self.profiles}:
            return list(self.calls)
        return list(self.profiles)


def repeats(profiles: list[GraphProfile]) -> bool:
    return len(profiles) > len({id(g) for g in profiles})


def one_set_per_graph(profiles: list[GraphProfile], decision: Decision, limit: int | None) -> Decision:
    """`decision` with one saved set for every position of a graph called several times (module docstring).
    limit: the activation bytes the step may take (None: keep the lowest peak)."""
    if not repeats(profiles):
        return decision
    saved = [set(s) for s in decision.saved]
    g = decision.granularity
    groups: dict[int, list[int]] = {}
    for i, gp in enumerate(profiles):
        groups.setdefault(id(gp), []).append(i)
    for positions in groups.values():
        if len(positions) < 2:
            continue
        options = {frozenset(saved[i]) for i in positions}
        scored = []
        for option in options:
            trial = [set(option) if i in positions else s for i, s in enumerate(saved)]
            try:
                schedules, tl, cost = evaluate(profiles, trial, g)
            except ValueError:  # a value the backward needs that this set recomputes from nothing
                continue
            fits = limit is not None and tl.peak <= limit  # no limit: the lowest peak
            scored.append(((not fits, cost if fits else tl.peak, sorted(option)), trial))
        if scored:
            saved = min(scored, key=lambda s: s[0])[1]
    schedules, tl, cost = evaluate(profiles, saved, g)
    return dataclasses.replace(decision, saved=saved, schedules=schedules, timeline=tl, recompute_time_s=cost,
                               notes=[*decision.notes, "a compiled graph called several times per step (a graph "
                                      "break inside a loop) saves the same values at every call"])
