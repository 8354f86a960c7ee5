"""How many pieces the loss region is chunked into: chosen by the ILP, count by count.

The loss rewrite (autoremat.passes.loss_chunks) turns the output projection + cross-entropy into k
chunks of token rows; each k is a trace of its own (the dynamo graph the first trace kept, rewritten and
traced by AOTAutograd again: planning.dynamo_graphs). The counts (loss_chunks.CANDIDATES) are traced
in increasing order, and each trace's ILP (`rows_time.trace_time`) gives its least predicted step time
under the budget: its ops once (more chunks, more and smaller kernels) plus the recomputation its plan
adds (more chunks, more memory freed). Where the ILP's rows see no plan for a count (they bound the
exact simulator conservatively, and near the floor see no room that it has), that count is planned in
full there and then, and its time is that plan's. Tracing stops at the first count that is no faster
than a smaller one: each count frees a quarter of the region the count before it left, for more
kernels, so the gain only shrinks (the largest count's trace, the costliest, then is never traced at a
budget where a smaller count is best).

The fastest count is then built and verified (pipeline.py builds it with `CountChoice`, from that trace, with its plan where it
was planned in full: the step is not traced again). If the full plan refuses a count the rows chose, the
next fastest is built; if none is left, the counts are planned in full, each calibrated against the
simulator, fastest first, skipping those that cannot beat the fastest plan that fits, and the fastest
that fits is kept; unless a count was refused because a real step measured more than the model predicted
(verification): the plans in full would rest on the same model, and the step is refused with the lowest
budget named. A floor query (no room at all) goes straight to the plans in full.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import TYPE_CHECKING

from autoremat.passes import loss_chunks
from autoremat.passes.loss_chunks import LossOption, compose
from autoremat.planning import precision_plan
from autoremat.planning.budget import plan_graphs, room_for
from autoremat.planning.loss_region import bounds
from autoremat.planning.loss_region.count_trace import ChunkCountTrace
from autoremat.planning.plan import BudgetError
from autoremat.planning.planner import along, progress
from autoremat.planning.step_tracing import planner_for, trace_step
from autoremat.solve.heuristics import save_all_peak
from autoremat.solve.rows_time import ops_once_time, trace_time
from autoremat.solve.solver_options import SolverOptions
from autoremat.units import format_bytes

if TYPE_CHECKING:
    from autoremat.planning.options import TrainingStep
    from autoremat.planning.planned_step import PlannedStep
from autoremat.planning.step_trace import StepTrace

# Chunking can free at most the loss region's own tensors (logits, log-probabilities and both their
# gradients, in fp32). Below this share of the step's activation peak with nothing recomputed it cannot
# change the plan much, and each count costs a trace and a solve: a 10-class head is left alone.
LOSS_REGION_SHARE = 0.01


def loss_region_matters(trace: StepTrace, loss: LossOption, granularity: int) -> bool:
    """Whether the loss region is large enough for its chunk count to be worth planning."""
    vocab = max(r.vocab for r in loss.reports)
    region = 4 * loss.rows() * vocab * 4
    return region >= LOSS_REGION_SHARE * save_all_peak(list(trace.graphs), granularity)


def fits_unchunked(trace: StepTrace, budget: int, ledger, dev) -> str | None:
    """Why no other chunk count is worth tracing, when the step as first traced (1 chunk) fits the budget
    with nothing recomputed; else None.

    Under the roofline a chunked trace's ops cost at least the whole's (the same FLOPs and bytes in
    more kernels, each launched), so with nothing to free no count beats 1.
    """
    whole, room = save_all_peak(list(trace.calls), dev.alloc_granularity), room_for(budget, ledger, dev)
    if whole > room:
        return None
    return (f"with everything saved the step needs {format_bytes(whole)} of activations, within the "
            f"{format_bytes(room)} the budget leaves: nothing to free, no other count traced")


class Traces:
    """The step traced at each chunk count, each on first use (count 1: the trace `build` started from)."""

    def __init__(self, step: TrainingStep, first: ChunkCountTrace, budget: int, dtypes) -> None:
        self.step, self.budget, self.dtypes = step, budget, dtypes
        self.counts = loss_chunks.candidates(first.loss.rows())
        self.traced: dict[int, ChunkCountTrace] = {1: first}
        self.base_time: dict[int, float] = {1: ops_once_time(list(first.trace.graphs))}
        self.outside_s: tuple[float, float] | None = None  # (least_outside's bound, the at_least it was given)

    def __getitem__(self, k: int) -> ChunkCountTrace:
        if k not in self.traced:
            progress.info("tracing the loss region in %d chunks", k)
            first = self.traced[1]
            self.traced[k] = _trace(self.step, first.trace, first.loss, k, self.budget, self.dtypes,
                                    f"chunk count {self.counts.index(k) + 1} of {len(self.counts)}")
            self.base_time[k] = ops_once_time(list(self.traced[k].trace.graphs))
        return self.traced[k]

    def least_outside(self, room: int, at_least: float, granularity: int, opts: SolverOptions) -> float:
        """bounds.least_outside on the first chunked trace, solved again only to reach a higher at_least."""
        if self.outside_s is None or self.outside_s[0] < at_least and self.outside_s[1] < at_least:
            first = self.traced[min(c for c in self.traced if c > 1)]
            self.outside_s = (bounds.least_outside(first, room, at_least, granularity, opts), at_least)
        return self.outside_s[0]

    def least_base_time(self, k: int) -> tuple[float, str] | None:
        """A lower bound of count k's time with nothing recomputed, without tracing it, and how it was found;
        None if the traces so far give none.

        Each chunk runs the same ops on rows/k rows, and under the roofline (devices.op_time) one op's k
        copies cost max(its FLOPs, k x its per-chunk fixed bytes + its row bytes) plus k launches: convex in k.
        So is the trace's sum, so the slope past the two largest chunked counts traced is at least the slope
        between them. Without Inductor the largest chunked count traced bounds it alone too, op by op
        (bounds.least_ops_time; Inductor fuses ops differently at another count: the chunks' weight
        gradients are summed by one kernel, not one add each, and it fell below that bound). The larger bound
        is taken. Only counts that split the rows evenly (the last chunk as large as the others)."""
        rows = self.traced[1].loss.rows()
        even = sorted(c for c in self.base_time if c > 1 and rows % c == 0)
        if not even or k <= even[-1] or rows % k:
            return None
        found = []
        if len(even) >= 2:
            (a, ta), (b, tb) = ((c, self.base_time[c]) for c in even[-2:])
            found.append((tb + (tb - ta) * (k - b) / (b - a), f"extrapolated from the {a}- and {b}-chunk traces"))
        b = even[-1]
        if b in self.traced and self.step.compiler == "eager" and (least := bounds.least_ops_time(
                list(self.traced[b].trace.graphs), self.base_time[b], rows, b, k, self.step.dev)) is not None:
            found.append((least, f"each op of the {b}-chunk trace's chunks copied {k // b} times"))
        return max(found, default=None)


def remembered_count(step: TrainingStep, store, fields: dict) -> int | None:
    """The chunk count a plan of this step was made with before (`remember_count`); None if none is remembered."""
    return store.load_count(_step_key(step, store, fields)) if store else None


def remember_count(step: TrainingStep, store, fields: dict, chunks: int) -> None:
    """With a plan cache, the count chosen for this step, for `remembered_count` to find."""
    if store is not None:
        store.store_count(_step_key(step, store, fields), chunks)


def _step_key(step: TrainingStep, store, fields: dict) -> str:
    """The cache's key for the step before it is traced, with the fields the pipeline adds for the first trace."""
    return store.step_key(step.model, step.args, step.kwargs,
                          {**fields, "outputs": step.options.outputs, "loss_chunks": None})


class CountChoice:
    """Which chunk count to build the step with, worked out from its traces at each count (module docstring).

    `first` is the step as first traced (1 chunk). The pipeline builds the counts `ranked` returns in turn
    (each from `trace(k)`, with its plan where one was made here), telling `refused` of one whose build was
    refused, and `chosen` of the one built, which records on its plan the counts considered and how the count
    was chosen (`plan.loss`). Once none is left, `planned_in_full` names the count to build (or raises the
    BudgetError of the lowest floor), and `chosen_in_full` records it.
    """

    def __init__(self, step: TrainingStep, first: ChunkCountTrace, budget: int, dtypes) -> None:
        self.step, self.budget = step, budget
        self.traces = Traces(step, first, budget, dtypes)
        self.table: dict[int, str] = {}
        self.refused_by: dict[int, BudgetError] = {}
        self.surveyed = False  # whether the ILP's rows ranked the counts (not at a floor query: no room)
        self.floors_stopped = False  # the survey stopped: none fits, and more chunks could not lower the floor
        self.full: dict[int, bool] = {}  # count -> whether it was planned in full when ranked

    def only_one(self) -> bool:
        """Nothing to choose: too few token rows for a second count."""
        return len(self.traces.counts) == 1

    def trace(self, k: int) -> ChunkCountTrace:
        """The step traced with the loss region in k chunks (traced now if it was not yet)."""
        return self.traces[k]

    def ranked(self) -> Iterator[int]:
        """The counts whose plans fit as the survey found them (`_survey`), fastest first, each said on progress
        as it is handed out. A floor query (budget=1) leaves no room: none, the counts go straight to the plans
        in full."""
        if room_for(self.budget, self.step.ledger, self.step.dev) <= 0:
            return
        self.surveyed = True
        fastest, self.floors_stopped = _survey(self.traces, self.budget, self.step, self.table, self.refused_by)
        for k in sorted(fastest, key=lambda c: (fastest[c], c)):
            self.full[k] = self.traces[k].decision is not None
            if self.full[k]:
                progress.info("the loss region in %d chunk(s): the fastest count, planned in full", k)
            else:
                progress.info("the ILP chose %d chunk(s) for the loss region", k)
            yield k

    def refused(self, k: int, error: BudgetError) -> None:
        self.refused_by[k] = error
        self.table[k] += "; chosen, refused by the exact simulator"

    def chosen(self, k: int, planned: PlannedStep) -> PlannedStep:
        self.table[k] += "; chosen" if self.full[k] else "; chosen by the ILP"
        return _record(planned, self.table, "the fastest of the counts planned" if self.full[k] else "ilp")

    def planned_in_full(self) -> int:
        """No ranked count was built: the counts planned in full (`_fastest_in_full`), or the BudgetError of
        the lowest floor where more plans could not help."""
        if self.surveyed:
            if self.floors_stopped:  # none fits, and more chunks could not lower the floor: nothing is left to plan
                _refuse_lowest(self.refused_by)
            if any(e.measured for e in self.refused_by.values()):
                # A real step measured more than the model predicted, and no plan of the counts with one held it:
                # the counts' plans in full would be priced by the same model, and each compiled and measured, only
                # to miss too and name the same budget (benchmarks/eager_code.py plans such steps at their floor).
                _refuse_lowest(self.refused_by)
            progress.info("no chunk count traced so far has a plan that fits: planning the counts in full, "
                          "fastest first")
        return _fastest_in_full(self.traces, self.refused_by, self.table, self.budget, self.step)

    def chosen_in_full(self, planned: PlannedStep) -> PlannedStep:
        return _record(planned, self.table, "each count planned in full")


def _survey(traces: Traces, budget: int, step: TrainingStep, table: dict,
            refused: dict) -> tuple[dict[int, float], bool]:
    """count -> its least predicted step time, for the counts traced in increasing order while more
    chunks pay, and that have a plan; and whether it stopped because none fits and the floors stopped
    falling.

    A count's time is the ILP's (`trace_time`: its rows, not calibrated). Where the rows see no plan
    (near the floor they see no room the exact simulator has) the count is planned in full at once, as
    `build` would plan it, and the plan kept for `build`; one that does not fit is skipped, and while none
    fits, more chunks are traced only while the floors fall (as in `_fastest_in_full`); once a smaller count
    fits, one that does not ends the survey (its floor is above one a smaller count reached: by the same
    argument, more chunks cannot lower it); so does a count whose plan in full peaks where more chunks shrink
    nothing (`floor_outside` where it does not fit, `binds_outside` where it does). Tracing stops at
    the first count no faster than a smaller one, or that could not be even with nothing recomputed in the
    region (`least_base_time` plus `Traces.least_outside`, what every count recomputes outside it): each
    count frees a quarter of what the count before it left, for more kernels (otherwise, where the rows see
    no plan for any count, every count would be traced, the largest the costliest, before any was planned
    in full).
    """
    dev, opts = step.dev, step.options.solving()
    room = room_for(budget, step.ledger, dev)
    fastest: dict[int, float] = {}
    falling: tuple[int, int] | None = None  # (floor, count) of the lowest floor so far, while none fits
    for k in traces.counts:
        if fastest and (least := traces.least_base_time(k)):
            best = min(fastest.values())
            if least[0] >= best:
                table[k] = (f"not traced: no faster than fewer chunks even with nothing recomputed (at least "
                            f"{1e3 * least[0]:.3f} ms, {least[1]})")
                break
            outside = traces.least_outside(room, best - least[0], dev.alloc_granularity, opts)
            if least[0] + outside >= best:
                table[k] = (f"not traced: no faster than fewer chunks (ops once at least {1e3 * least[0]:.3f} ms, "
                            f"{least[1]}; the ILP's rows recompute at least {1e3 * outside:.3f} ms outside the "
                            "loss region at any count)")
                break
        profiles = list(traces[k].trace.graphs)
        table[k] = f"ops once {1e3 * traces.base_time[k]:.3f} ms"
        if fastest and traces.base_time[k] >= min(fastest.values()):
            table[k] += "; no faster than fewer chunks even with nothing recomputed: no more counts traced"
            break
        progress.info("solving the ILP for the loss region in %d chunk(s)", k)
        along(f"{sum(len(g.nodes) for g in profiles)} nodes")
        beat = min(fastest.values(), default=None)
        time_s = trace_time(profiles, room, granularity=dev.alloc_granularity, beat=beat, options=opts)
        outside = False  # a plan in full that fits, peaking where more chunks free nothing
        if time_s is not None and beat is not None and time_s >= beat:
            table[k] += f"; the ILP's bound: at least {1e3 * time_s:.3f} ms"
        elif time_s is not None:
            table[k] += f"; the ILP's plan: {1e3 * time_s:.3f} ms predicted"
        else:
            table[k] += "; the ILP's rows see no plan at this budget"
            time_s, floor = _plan_count(traces, k, budget, step, table, refused)
            if time_s is None:
                if fastest:  # fewer chunks fit: the peak is outside the region, where more chunks change nothing
                    table[k] += "; fewer chunks fit the budget, so more cannot lower the floor: no more counts traced"
                    break
                why = f"the floor {bounds.OUTSIDE}" if bounds.floor_outside(traces[k], refused[k]) else None
                if why is None and falling is not None and floor >= falling[0]:
                    why = f"the floor was no lower than the {falling[1]}-chunk one"
                if why is not None:
                    table[k] += f"; {why}: no more counts traced"
                    _untraced(traces, table)
                    return fastest, True
                if falling is None or floor < falling[0]:
                    falling = (floor, k)
                continue
            outside = bounds.binds_outside(traces[k], traces[k].decision)
        no_faster = bool(fastest) and time_s >= min(fastest.values())
        fastest[k] = time_s
        if no_faster or outside:
            table[k] += "; no faster than fewer chunks" if no_faster else f"; its {bounds.OUTSIDE}"
            table[k] += ": no more counts traced"
            break
    _untraced(traces, table, "fewer chunks were already as fast")
    return fastest, False


def _untraced(traces: Traces, table: dict, why: str = "more chunks could not lower the floor") -> None:
    for k in traces.counts:
        table.setdefault(k, f"not traced: {why}")


def _plan_count(traces: Traces, k: int, budget: int, step: TrainingStep, table: dict,
                refused: dict) -> tuple[float | None, int]:
    """Count k planned in full, as `build` plans the step (plan_jointly: its calls, one saved set per
    compiled graph), its plan kept on its trace: (its predicted step time, 0), or (None, its floor)
    with its BudgetError in `refused` where it does not fit."""
    progress.info("planning the loss region in %d chunk(s) in full", k)
    count_trace = traces[k]
    try:
        d = plan_graphs(list(count_trace.trace.calls), budget, step.ledger, step.dev, step.options, one_set=True)
    except BudgetError as e:
        refused[k] = e
        table[k] += "; planned in full: does not fit"
        return None, e.smallest_budget if e.smallest_budget is not None else 2**62
    traces.traced[k] = dataclasses.replace(count_trace, decision=d)
    time_s = traces.base_time[k] + d.recompute_time_s
    table[k] += f"; planned in full: fits, predicted {time_s * 1e3:.3f} ms"
    return time_s, 0


def _trace(step: TrainingStep, first: StepTrace, loss: LossOption, k: int, budget: int, dtypes,
           which: str) -> ChunkCountTrace:
    """The step traced with the loss region in k chunks: from the dynamo graph the first trace kept where it
    can be (AOTAutograd alone: `dynamo_graphs`), else in full."""
    options = step.options
    option = LossOption(loss.outputs, k)
    pre = compose(precision_plan.pre_pass(dtypes, options.fp32_ops) if any(dtypes) else None, option.pre_pass())
    # regions="auto" traces the candidates per block; build decides on one graph for the count chosen
    planner = planner_for(step, budget, regions=options.regions is not False, pre_pass=pre)
    along(f"{which}: " + ("the step's dynamo graph, kept from the first trace, traced again with the rewrite"
                          if first.source is not None else "the whole step is traced with the rewrite"))
    return ChunkCountTrace(trace_step(step, planner, first.source), option)


def _fastest_in_full(traces: Traces, refused: dict, table: dict, budget: int, step: TrainingStep) -> int:
    """Plan the counts not already refused in full; the fastest that fits, or the BudgetError of the
    count with the lowest floor.

    In increasing count, which is the order of their time with nothing recomputed (the same FLOPs and
    bytes in more kernels, each launched: `traces.base_time`, a lower bound of each count's step time).
    Once a count cannot beat the fastest plan found so far even with nothing recomputed, no larger one
    can, and none is traced or planned: each plan in full is a whole plan's time, many times a trace's
    (benchmarks/plan_time.py --cliff times plans near the floor). The plan is kept for `build`.

    While none fits, a count is planned only if the one before it lowered the floor: a step's floor is the
    larger of its peak outside the loss region, which the count leaves alone, and the region's own, which
    more chunks only shrink; once a count does not lower the floor, the peak is outside the region and more
    chunks cannot lower it either, and the largest count's floor, the costliest to search, is not searched
    (benchmarks/plan_time.py --cliff times the floor query). A refused
    count whose floor is set outside the region (`floor_outside`) ends the counts at once.
    """
    best: tuple[float, int] | None = None
    falling: tuple[int, int] | None = None  # (floor, count) of the lowest floor so far, while floors fall
    stopped: str | None = None  # why the counts left are not planned
    for k in traces.counts:
        if k in refused:
            continue
        if stopped is not None:
            table[k] = (table[k] if k in traces.traced else "not traced") + f"; not planned: {stopped}"
            continue
        if best is not None and k not in traces.traced and (least := traces.least_base_time(k)) \
                and least[0] >= best[0]:
            stopped = (f"with nothing recomputed {k} chunks take at least {least[0] * 1e3:.3f} ms ({least[1]}), "
                       f"no faster than the {best[1]}-chunk plan ({best[0] * 1e3:.3f} ms)")
            table[k] = f"not traced; not planned: {stopped}"
            continue
        count_trace = traces[k]
        if not table.get(k, "").startswith("ops once"):
            table[k] = f"ops once {1e3 * traces.base_time[k]:.3f} ms"
        if best is not None and traces.base_time[k] >= best[0]:
            stopped = f"with nothing recomputed {k} chunks are no faster than the {best[1]}-chunk plan " \
                      f"({best[0] * 1e3:.3f} ms)"
            table[k] += f"; not planned: {stopped}"
            continue
        time_s, floor = _plan_count(traces, k, budget, step, table, refused) if count_trace.decision is None \
            else (traces.base_time[k] + count_trace.decision.recompute_time_s, 0)
        if time_s is None:
            if bounds.floor_outside(count_trace, refused[k]):
                stopped = f"the {k}-chunk floor {bounds.OUTSIDE}"
            elif best is None and falling is not None and floor >= falling[0]:
                stopped = f"the {k}-chunk floor was no lower than the {falling[1]}-chunk one"
            if falling is None or floor < falling[0]:
                falling = (floor, k)
            continue
        if best is None or time_s < best[0]:
            best = (time_s, k)
    if best is not None:
        return best[1]
    _refuse_lowest(refused)


def _refuse_lowest(refused: dict[int, BudgetError]) -> None:
    """Raise the BudgetError of the count with the lowest floor, naming the counts planned. Where a real step
    measured memory the model did not predict, only such refusals count: the others' floors lack it, and it is
    no smaller for them (a count refused by the model alone peaks over the budget the measured one fit)."""
    measured = {k: e for k, e in refused.items() if e.measured} or refused
    k, e = min(measured.items(), key=lambda ke: (ke[1].smallest_budget or 2**62, ke[0]))
    first, _, rest = str(e).partition("\n")
    raise BudgetError(f"{first} (the loss region chunked into {k} piece(s), the lowest floor of the chunk "
                      f"counts planned: {', '.join(map(str, sorted(refused)))})\n{rest}", e.ledger,
                      e.smallest_budget, e.peak_step, measured=e.measured, at_peak=e.at_peak) from None


def _record(planned: PlannedStep, table: dict, how: str) -> PlannedStep:
    """`planned`, its plan recording the counts considered (`table`) and how the count was chosen."""
    planned.plan.loss["candidates"] = {str(c): v for c, v in table.items()}
    planned.plan.loss["chosen_by"] = how
    return planned
