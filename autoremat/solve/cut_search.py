"""The search for cuts (cuts.py) that lower a plan's simulated peak: which values to recompute twice.

At the peak step of a backward, the recomputed values alive there that the step does not read were
emitted for an earlier reader and are held for a later one. A cut before that later reader frees
them after the earlier one and computes them again for it. Each round tries a cut before every
backward node after the peak (in the graph holding it) that reads such a value, simulates the whole
step, and keeps the cut that lowers the peak most (the cheaper on a tie); a cut is tried in every graph
of the same fingerprint at once (the repeated blocks of a stack peak in turn), then in this graph
alone. Rounds go on until no cut lowers it or after `max_tries` simulations. Like `heuristics.lower_peak`, a count bounds it, not a
deadline: the plan at a floor is the plan the floor was found with.
"""

from __future__ import annotations

import dataclasses

from autoremat.model.graph_profile import GraphProfile
from autoremat.passes.recompute_names import MARK, base
from autoremat.solve.decision import Decision, Refinement, evaluate
from autoremat.solve.heuristics import lower_peak


def recompute_twice(graphs: list[GraphProfile], plan: Decision, granularity: int, max_tries: int = 400,
                    unsave: bool = True) -> Decision:
    """`plan` with cuts added where they lower the simulated peak (module docstring).

    When no cut lowers it and `unsave` is set, a value saved across the peak is recomputed instead, with
    the cuts that then pay (a search of its own, without this move): a saved value that the min-peak
    plan needed only because recomputing it would have held more is worth trying again once cuts exist.
    """
    best, tries = plan, 0
    while tries < max_tries:
        step = best.timeline.peak_step
        if step is None or step.phase != "backward":
            break
        at = next(i for i, g in enumerate(graphs) if g.index == step.graph)
        g, schedule = graphs[at], best.schedules[at]
        if any(p.fused for p in g.nodes.values()):
            break  # Inductor's graph: it fuses and reorders the backward itself (a cut is not kept as written)
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
        # a cut or a narrow cut (cuts.py), in every identical graph (a repeated block) and in this one
        twins = [k for k, h in enumerate(graphs) if h.fingerprint == g.fingerprint]
        places = [twins, [at]] if len(twins) > 1 else [[at]]
        trials = [(c, "", where) for where in places for e in candidates for c in (e, e + MARK)]
        # a cut made narrow or wide: which is better moves as later cuts and saved values change
        trials += [(_other_kind(c), c, where) for where in places for c in schedule.again]
        found = None
        for c, old, where in trials:
            if tries >= max_tries:
                break
            tries += 1
            saved = [set(s) for s in best.saved]
            for k in where:
                saved[k].discard(old)
                saved[k].add(c)
            schedules, tl, cost = evaluate(graphs, saved, granularity, limit=(best if found is None else found).peak)
            key = (tl.peak, cost)
            if key < (best.peak, best.recompute_time_s) and (found is None or key < (found.peak, found.recompute_time_s)):
                found = dataclasses.replace(best, saved=saved, schedules=schedules, timeline=tl, recompute_time_s=cost)
        if found is None and unsave:
            found, used = _unsave_one(graphs, best, at, granularity, max_tries - tries)
            tries += used
        if found is None:
            break
        best = found
    if best is plan:
        return plan
    cuts = sum(len(s.again) for s in best.schedules) - sum(len(s.again) for s in plan.schedules)
    return dataclasses.replace(best, path=plan.path.refined(Refinement.RECOMPUTED_TWICE), notes=[*plan.notes, (
        f"recomputed values twice at {cuts} cut(s) (GraphPlan.again): simulated peak {plan.peak:,} -> {best.peak:,} B, "
        f"predicted recompute {plan.recompute_time_s * 1e3:.2f} -> {best.recompute_time_s * 1e3:.2f} ms")])


REFINE_MIN_GAIN = 0.01  # of the peak: refine_further's rounds go on while each lowers it by this much


def refine_further(graphs: list[GraphProfile], plan: Decision, granularity: int, rounds: int = 3) -> Decision:
    """`plan` searched again for cuts and values saved back, while a round lowers its peak.

    Each search is bounded by a count of simulations, and one that ran out may have stopped far from
    where a fresh one ends, so a second search starts from the first one's result. A round that lowers the peak by less than `REFINE_MIN_GAIN` of it is the last:
    each round is hundreds of simulations of the whole step, most of a floor search's, and rounds after such
    a small gain rarely find more (benchmarks/floor_search.py times floor searches)."""
    for _ in range(rounds):
        again = lower_peak(graphs, recompute_twice(graphs, plan, granularity), granularity)
        if (again.peak, again.recompute_time_s) >= (plan.peak, plan.recompute_time_s):
            break
        gained = plan.peak - again.peak
        plan = again
        if gained < REFINE_MIN_GAIN * plan.peak:
            break
    return plan


def _other_kind(cut: str) -> str:
    """The wide cut at a narrow cut's node, or the narrow one at a wide cut's (cuts.py)."""
    return cut[:-len(MARK)] if cut.endswith(MARK) else cut + MARK


def _unsave_one(graphs: list[GraphProfile], plan: Decision, at: int, granularity: int, budget: int,
                widest: int = 6, inner: int = 40) -> tuple[Decision | None, int]:
    """The best of: each of the `widest` largest values saved across the peak of graph position `at`,
    recomputed instead, then cut where that pays; None if none lowers the peak. Also the simulations used."""
    held = []
    for k in range(at + 1):  # what earlier graphs saved is alive through this backward; this one's, to its use
        g = graphs[k]
        for v in plan.schedules[k].saved:
            p = g.nodes[v]
            if p.nbytes and p.storage == v and not p.recompute_ban and v not in g.fw_outputs:
                held.append((p.nbytes, k, v))
    found, used = None, 0
    for _, k, v in sorted(held, reverse=True)[:widest]:
        if used >= budget:
            break
        saved = [set(s) for s in plan.saved]
        saved[k].discard(v)
        used += 1
        try:
            schedules, tl, cost = evaluate(graphs, saved, granularity)
        except ValueError:  # nobody may recompute something it needs
            continue
        trial = dataclasses.replace(plan, saved=saved, schedules=schedules, timeline=tl, recompute_time_s=cost)
        trial = recompute_twice(graphs, trial, granularity, max_tries=min(inner, budget - used), unsave=False)
        used += inner
        if trial.peak < plan.peak and (found is None or (trial.peak, trial.recompute_time_s)
                                       < (found.peak, found.recompute_time_s)):
            found = trial
    return found, used
