"""Plans found without an ILP, for the ILP (solver.py) to beat.

`save_all` recomputes nothing. `checkpoint_blocks` saves only what crosses a repeated block
(checkpointing), `block_mode_plans` searches a family of per-block modes (save / selective /
checkpoint), and `greedy` turns saved values into recomputed ones while the simulated peak shrinks.
The ILP (solver.py) starts from these and must beat them. `spend_slack` goes the other way: it saves
recomputed values back while the plan still fits. Every search here is bounded by a count of
simulations, never by the clock, so one request gets one plan however loaded the machine is.
"""

from __future__ import annotations

import dataclasses

from autoremat.capture.regions import block_of
from autoremat.model.graph_profile import GraphProfile
from autoremat.model.lifetimes import lifetimes
from autoremat.model.memory import live_at_peak
from autoremat.passes.recompute_names import base
from autoremat.solve.decision import BlockModes, Decision, PlanPath, Refinement, Route, evaluate


def save_all(graphs: list[GraphProfile]) -> list[set[str]]:
    """No recomputation: save every forward value the backward reads."""
    return [set(lifetimes(g).needed) - {v for v in g.nodes if g.nodes[v].is_tuple} for g in graphs]


def save_all_peak(graphs: list[GraphProfile], granularity: int = 1) -> int:
    """The activation peak of `graphs` (a step's graph calls) with nothing recomputed."""
    return evaluate(graphs, save_all(graphs), granularity)[1].peak


def greedy(graphs: list[GraphProfile], room: int, granularity: int = 1, max_tries: int = 300) -> list[set[str]]:
    """A plan the simulator accepts, found without an ILP: recompute the biggest cheap values first.

    Starts from saving everything and turns saved values into recomputed ones, one at a time,
    largest bytes per second of recompute first, keeping a change only if the simulated peak does
    not grow. Stops as soon as the peak fits or after `max_tries` changes: a count, not a deadline,
    so a slower machine finds the same plan (each try simulates the whole step).
    """
    return greedy_with(graphs, room, granularity, max_tries, max_tries)[0]


def greedy_with(graphs: list[GraphProfile], room: int, granularity: int, max_tries: int,
                fewer: int) -> tuple[list[set[str]], list[set[str]]]:
    """`greedy`'s plan, and the plan it held after `fewer` tries (or at its end, if sooner): what
    `greedy(graphs, r, granularity, fewer)` gives for any room r it did not fit, since every try is the same
    until one fits. The smallest-peak search wants that one after a search toward the room found none."""
    saved = save_all(graphs)
    _, tl, _ = evaluate(graphs, saved, granularity)
    peak, early = tl.peak, None
    candidates = []
    for gi, g in enumerate(graphs):
        for v in saved[gi]:
            p = g.nodes[v]
            if not p.recompute_ban and p.nbytes:
                candidates.append((p.nbytes / (p.time_s + 1e-9), gi, v))
    for tries, (_, gi, v) in enumerate(sorted(candidates, reverse=True)):
        if tries == fewer:
            early = saved
        if peak <= room or tries >= max_tries:
            break
        trial = [set(s) for s in saved]
        trial[gi].discard(v)
        # Recomputing v needs its inputs: keep them saved (locality) unless they are free.
        trial[gi].update(u for u in graphs[gi].nodes[v].inputs if graphs[gi].nodes[u].kind == "forward"
                         and not graphs[gi].nodes[u].is_tuple)
        try:
            _, tl, _ = evaluate(graphs, trial, granularity, limit=peak)
        except ValueError:
            continue
        if tl.peak <= peak:
            saved, peak = trial, tl.peak
    return saved, saved if early is None else early


def checkpoint_blocks(graphs: list[GraphProfile]) -> list[set[str]]:
    """Save only what crosses a repeated block (and what may not be recomputed): checkpointing."""
    plans = []
    for g in graphs:
        life = lifetimes(g)
        fw_users: dict[str, list[str]] = {}
        for w, q in g.nodes.items():
            if q.kind == "forward":
                for u in q.inputs:
                    fw_users.setdefault(u, []).append(w)
        saved = set()
        for v in life.fw_pos:
            p = g.nodes[v]
            if p.is_tuple:
                continue
            crosses = any(block_of(g.nodes[w].module) != block_of(p.module) for w in fw_users.get(v, ()))
            parent_banned = bool(p.tuple_parent) and bool(g.nodes[p.tuple_parent].recompute_ban)
            if p.recompute_ban or parent_banned or crosses or v in g.fw_outputs:
                saved.add(v)
        plans.append(saved)
    return plans


def _crossing(g: GraphProfile) -> set[str]:
    """Forward values read by a forward node of another repeated block (block boundaries)."""
    out = set()
    for p in g.nodes.values():
        if p.kind != "forward":
            continue
        for v in p.inputs:
            q = g.nodes[v]
            if q.kind == "forward" and not q.is_tuple and block_of(q.module) != block_of(p.module):
                out.add(v)
    return out


def block_mode_plans(graphs: list[GraphProfile], room: int, granularity: int) -> list[Decision]:
    """Plans that give each repeated block one of three modes, searched along a family's frontier.

    Modes: save everything the backward reads; recompute only what is cheap (save matmul-class outputs,
    as selective checkpointing does); recompute the whole block (checkpointing). Earlier blocks hold
    their activations longest, so the family is: the first k blocks checkpointed, the next j
    selectively, the rest saved. Raising k or j lowers the peak and raises the recompute time, so
    for each k only the smallest j that fits is wanted, and it is no larger than the last k's: a
    staircase walk finds them in at most 3 (n + 1) simulations for n blocks (the whole family is
    (n + 1)(n + 2) / 2). Each candidate is simulated exactly; those that fit are returned.
    """
    modes = []
    for g in graphs:
        everything = save_all([g])[0]
        crossing = _crossing(g)
        keep = {v for v, p in g.nodes.items() if p.kind == "forward" and not p.is_tuple and (
            p.recompute_ban or v in g.fw_outputs or v in crossing
            or (p.tuple_parent and g.nodes[p.tuple_parent].recompute_ban))}
        heavy = {v for v, p in g.nodes.items() if p.kind == "forward" and not p.is_tuple
                 and (p.flops > 4 * max(1, p.nbytes) or (p.tuple_parent and g.nodes[p.tuple_parent].flops
                                                          > 4 * max(1, p.nbytes)))}
        blocks: dict[str, set[str]] = {}
        for v in lifetimes(g).fw_pos:
            blocks.setdefault(block_of(g.nodes[v].module), set()).add(v)
        order = [b for b in blocks if b]  # first appearance in forward order
        base = {v for v in everything if not block_of(g.nodes[v].module)} | (keep & blocks.get("", set()))
        per = {b: {"save": (everything | keep) & nodes, "selective": (keep | (heavy & everything)) & nodes,
                   "checkpoint": keep & nodes} for b, nodes in blocks.items() if b}
        modes.append((base, order, per))
    n = max((len(order) for _, order, _ in modes), default=0)
    if n == 0:
        return []

    def simulate(k: int, j: int) -> Decision | None:
        saved = []
        for base, order, per in modes:
            plan = set(base)
            for i, b in enumerate(order):
                plan |= per[b]["checkpoint" if i < k else "selective" if i < k + j else "save"]
            saved.append(plan)
        try:
            schedules, tl, cost = evaluate(graphs, saved, granularity, limit=room)
        except ValueError:
            return None
        if tl.peak > room:
            return None
        return Decision(saved, schedules, tl, cost, "heuristic", PlanPath(Route.BLOCK_MODES, BlockModes(k, j)))

    found, top = [], n
    for k in range(n + 1):
        j, cheapest = min(top, n - k), None
        while j >= 0 and (fits := simulate(k, j)) is not None:
            cheapest, top, j = fits, j, j - 1
        if cheapest is not None:
            found.append(cheapest)
    return found


# `spend_slack`'s simulations of the whole step: a count, not a deadline, bounds it, so one request gets one
# plan on any machine at any load (benchmarks/plan_spread.py repeats requests and compares their plans).
SLACK_TRIES = 32


def spend_slack(graphs: list[GraphProfile], plan: Decision, room: int, granularity: int,
                max_tries: int = SLACK_TRIES) -> Decision:
    """`plan` with recomputed values saved back, while the simulated peak still fits `room`.

    A plan from a heuristic (or an ILP whose rows were pessimistic) can leave room unused; each
    byte of it may buy back recomputation. Values are ranked most recompute seconds per byte first
    (the knapsack order) and tried in groups: all of them at once first, since most values are not
    live at the peak and cost nothing there; a group is kept whole if the simulated peak fits and the
    predicted recompute time falls, else it is halved and each half tried in rank order. Values
    larger than what is left are dropped from a group before it is tried. At most `max_tries`
    simulations of the whole step.
    """
    ranked = []
    for gi, (g, schedule) in enumerate(zip(graphs, plan.schedules)):
        for v in schedule.recomputed:
            p = g.nodes[v]
            if p.time_s > 0 and p.nbytes and not p.is_tuple:
                ranked.append((-p.time_s / p.nbytes, gi, v))
    ranked.sort()
    best, tries = plan, 0
    groups = [[(gi, v) for _, gi, v in ranked]]  # a stack: the next group to try is the last
    while groups and tries < max_tries and best.recompute_time_s > 0:
        group = [(gi, v) for gi, v in groups.pop() if graphs[gi].nodes[v].nbytes <= room - best.peak]
        if not group:
            continue
        tries += 1
        trial = _with_saved(graphs, best, group, granularity, limit=room)
        if trial is not None and trial.peak <= room and trial.recompute_time_s < best.recompute_time_s:
            best = trial
        elif len(group) > 1:
            half = len(group) // 2
            groups += [group[half:], group[:half]]  # the higher-ranked half is tried first
    if best is not plan:
        best = dataclasses.replace(best, path=plan.path.refined(Refinement.SLACK_SPENT), notes=[*plan.notes, (
            f"saved back recomputed values into the {room - plan.peak:,} B the plan left unused "
            f"({tries} simulation{'s' if tries != 1 else ''}): predicted recompute {plan.recompute_time_s * 1e3:.2f} -> "
            f"{best.recompute_time_s * 1e3:.2f} ms")])
    return best


def lower_peak(graphs: list[GraphProfile], plan: Decision, granularity: int, max_tries: int = 150) -> Decision:
    """`plan` with values saved back where that lowers the simulated peak.

    Saving a value can lower the peak: the recomputation it spares may otherwise run before the
    peak and hold its inputs and outputs there (checkpointing a transformer block recomputes
    attention before the MLP's backward, where the peak is, only because the MLP reads attention's
    output). So each round tries, in the graph holding the peak, every value recomputed before the
    peak step that can lower it (`_held_back`) and keeps the one that lowers the peak most (the cheaper
    on a tie; the first that lowers it is a worse guide: a small early value moves the recomputations
    and ends the search). The other values recomputed before the peak can only make the plan cheaper
    at the same peak; they are tried too when there are at most SLACK_TRIES of them (`spend_slack`'s
    bound on such a search) and the tries left cover them. Rounds go on until none
    lowers the peak or makes the plan cheaper, or after `max_tries` simulations of the whole step.
    A count, not a deadline, bounds it: the plan at a floor must be the plan the floor was found with.
    """
    best, tries = plan, 0
    while tries < max_tries:
        step = best.timeline.peak_step
        if step is None or step.phase != "backward":
            break
        at = next(i for i, g in enumerate(graphs) if g.index == step.graph)  # a Step names GraphProfile.index
        g, schedule = graphs[at], best.schedules[at]
        recomputed = set(schedule.recomputed)
        before = [v for v in schedule.backward[:schedule.backward.index(step.node)] if v in recomputed
                  and not g.nodes[v].is_tuple and g.nodes[v].nbytes and g.nodes[v].storage == v]
        lowering = _held_back(graphs, best, at, before, granularity)
        rest = [v for v in before if v not in lowering]  # only a cheaper plan at the same peak: while few
        found = None
        for v in lowering + (rest if len(rest) <= min(SLACK_TRIES, max_tries - tries - len(lowering)) else []):
            if tries >= max_tries:
                break
            tries += 1
            trial = _with_saved(graphs, best, [(at, v)], granularity, limit=(best if found is None else found).peak)
            key = (trial.peak, trial.recompute_time_s) if trial is not None else None
            if key is not None and key < (best.peak, best.recompute_time_s) and (
                    found is None or key < (found.peak, found.recompute_time_s)):
                found = trial
        if found is None:
            break
        best = found
    return best if best is plan else dataclasses.replace(best, path=plan.path.refined(Refinement.PEAK_LOWERED))


def _held_back(graphs: list[GraphProfile], plan: Decision, at: int, before: list[str], granularity: int) -> list[str]:
    """The values recomputed before the peak step (`before`: graph `at`'s backward up to it) whose saving
    can lower the peak: a recomputed value the peak holds, and the recomputed values on the way to its
    first reader that is not recomputed.

    The step's own nodes run in a fixed order, and a recomputed value runs just before its first reader
    (schedule.make_schedule). A value saved instead of recomputed lives to its last use as its copy did,
    so saving v lowers the peak only by moving a recomputation it holds past it: one held there whose
    first reader is v, or is recomputed for v's sake. Other values are not tried: saving them cannot lower
    the peak, and each trial is a simulation of the whole step."""
    g, schedule = graphs[at], plan.schedules[at]
    recomputed = set(schedule.recomputed)  # `before` holds only such values
    first_reader: dict[str, str] = {}
    for n in schedule.backward:
        for i in schedule.reads.get(n, g.nodes[base(n)].inputs):
            first_reader.setdefault(base(i), n)
    alive = {base(n) for gp, n, _ in live_at_peak(list(zip(graphs, plan.schedules)), granularity, plan.peak)
             if gp is g}
    tried: set[str] = set()
    for v in alive & recomputed:
        while v in recomputed and v not in tried:
            tried.add(v)
            v = first_reader.get(v, "")
    return [v for v in before if v in tried]


def _with_saved(graphs: list[GraphProfile], plan: Decision, values: list[tuple[int, str]],
                granularity: int, limit: float) -> Decision | None:
    """`plan` with `values` ((graph position, name) pairs) saved too, simulated; None if no schedule runs it.
    A trial over `limit` is not wanted: its simulation stops there (its timeline is cut short)."""
    saved = [set(s) for s in plan.saved]
    for gi, v in values:
        saved[gi].add(v)
    try:
        schedules, tl, cost = evaluate(graphs, saved, granularity, limit)
    except ValueError:
        return None
    return dataclasses.replace(plan, saved=saved, schedules=schedules, timeline=tl, recompute_time_s=cost)
