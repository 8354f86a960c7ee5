"""Which values to recompute twice: cuts (passes/again.py) that lower the simulated peak.

At the peak step of a backward, the recomputed values alive there that the step does not read were
emitted for an earlier reader and are held for a later one. A cut before that later reader frees
them after the earlier one and computes them again for it. Each round tries a cut before every
backward node after the peak (in the graph holding it) that reads such a value, simulates the whole
step, and keeps the cut that lowers the peak most (the cheaper on a tie); rounds go on until no cut
lowers it or after `max_tries` simulations. Like `heuristics.lower_peak`, a count bounds it, not a
deadline: the plan at a floor is the plan the floor was found with.
"""

from __future__ import annotations

import dataclasses

from autoremat.decision import Decision, evaluate
from autoremat.passes.again import MARK, base
from autoremat.profile import GraphProfile


def recompute_twice(graphs: list[GraphProfile], plan: Decision, granularity: int, max_tries: int = 400) -> Decision:
    """`plan` with cuts added where they lower the simulated peak (module docstring)."""
    best, tries = plan, 0
    while tries < max_tries:
        step = best.timeline.peak_step
        if step is None or step.phase != "backward":
            break
        at = next(i for i, g in enumerate(graphs) if g.index == step.graph)
        g, schedule = graphs[at], best.schedules[at]
        entries = schedule.backward
        here = entries.index(step.node)
        read_here = set(schedule.reads.get(step.node, g.nodes[base(step.node)].inputs))
        recomputed = set(schedule.recomputed)
        held = {e for e in entries[:here] if base(e) in recomputed and e not in read_here}
        candidates = []  # the first backward reader after the peak of each value held across it
        for e in entries[here + 1:]:
            if not held:
                break
            if e in g.nodes and g.nodes[e].kind == "backward":
                hit = held & set(schedule.reads.get(e, g.nodes[e].inputs))
                if hit and e not in schedule.again and e + MARK not in schedule.again:
                    candidates.append(e)
                held -= hit
        found = None
        for c in [m for e in candidates for m in (e, e + MARK)]:  # a cut, a narrow cut (passes/again.py)
            if tries >= max_tries:
                break
            tries += 1
            saved = [set(s) for s in best.saved]
            saved[at].add(c)
            schedules, tl, cost = evaluate(graphs, saved, granularity)
            key = (tl.peak, cost)
            if key < (best.peak, best.recompute_time_s) and (found is None or key < (found.peak, found.recompute_time_s)):
                found = dataclasses.replace(best, saved=saved, schedules=schedules, timeline=tl, recompute_time_s=cost)
        if found is None:
            break
        best = found
    if best is plan:
        return plan
    cuts = sum(len(s.again) for s in best.schedules) - sum(len(s.again) for s in plan.schedules)
    return dataclasses.replace(best, path=plan.path + "+recomputed-twice", notes=[*plan.notes, (
        f"recomputed values twice at {cuts} cut(s) (GraphPlan.again): simulated peak {plan.peak:,} -> {best.peak:,} B, "
        f"predicted recompute {plan.recompute_time_s * 1e3:.2f} -> {best.recompute_time_s * 1e3:.2f} ms")])
