"""How many pieces the loss region is chunked into: chosen by one ILP over the candidate traces.

The loss rewrite (autoremat.passes.loss_chunks) turns the output projection + cross-entropy into k
chunks of token rows; each k is a trace of its own. The step is traced at every candidate k
(loss_chunks.CANDIDATES), and one ILP (autoremat.solve.ilp_choice) picks k together with the
save/recompute plan of that trace, under the budget, at the least predicted step time: more chunks
only where the memory they free saves more recomputation than their smaller matmuls cost.

The chosen trace is then planned in full and verified (`pipeline.build`, from that trace: the step is
not traced again). The ILP's rows bound the exact simulator conservatively, so if the full plan
refuses the chosen k, the ILP is asked again without it; and if the ILP finds no trace at all (its
rows see no room where calibration against the simulator might, or it ran out of time), the
remaining counts are planned in full, fastest first, skipping those that cannot beat the fastest plan
that fits, and the fastest that fits is kept (with its plan: it is not solved again).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from autoremat.passes import loss_chunks
from autoremat.passes.loss_chunks import LossOption, compose
from autoremat.planning import precision_plan
from autoremat.planning.budget import plan_graphs, room_for
from autoremat.planning.plan import BudgetError
from autoremat.planning.planner import (
    CapturePlanner,
    along,
    planner_for,
    progress,
    trace_step,
)
from autoremat.solve.decision import Decision
from autoremat.solve.heuristics import save_all_peak
from autoremat.solve.ilp_choice import ChoiceModel, ops_once_time
from autoremat.solve.solver import choose_trace
from autoremat.units import format_bytes

if TYPE_CHECKING:
    from autoremat.planning.options import TrainingStep

# Chunking can free at most the loss region's own tensors (logits, log-probabilities and both their
# gradients, in fp32). Below this share of the step's activation peak with nothing recomputed it cannot
# change the plan much, and each candidate costs a trace and a solve: a 10-class head is left alone.
LOSS_REGION_SHARE = 0.01


def loss_region_matters(planner: CapturePlanner, loss: LossOption, granularity: int) -> bool:
    """Whether the loss region is large enough for its chunk count to be worth planning."""
    vocab = max(r.vocab for r in loss.reports)
    region = 4 * loss.rows() * vocab * 4
    return region >= LOSS_REGION_SHARE * save_all_peak(planner.profiles, granularity)


def fits_unchunked(planner: CapturePlanner, budget: int, ledger, dev) -> str | None:
    """Why no other chunk count is worth tracing, when the step as first traced (1 chunk) fits the budget
    with nothing recomputed; else None.

    Under the roofline a chunked trace's ops cost at least the whole's (the same FLOPs and bytes in
    more kernels, each launched), so with nothing to free no count beats 1.
    """
    whole, room = save_all_peak(planner.sequence(), dev.alloc_granularity), room_for(budget, ledger, dev)
    if whole > room:
        return None
    return (f"with everything saved the step needs {format_bytes(whole)} of activations, within the "
            f"{format_bytes(room)} the budget leaves: nothing to free, no other count traced")


@dataclass
class Candidate:
    """One chunk count of the loss region as traced (and planned in full, where it was): `build` plans
    and compiles the chosen one from this trace, without tracing the step again."""

    planner: CapturePlanner
    compiled: Any
    loss: LossOption
    decision: Decision | None = None  # plan_graphs' plan of its calls at the budget


def choose_chunks(step: TrainingStep, first: Candidate, budget: int, dtypes, store, fields, *, build: Callable):
    """Trace the step at each candidate chunk count, let the ILP choose one, and `build` the step with it.

    `first` is the step as first traced (1 chunk); `build` is pipeline.build, given the chosen count's
    trace (and its plan, if one was made here). Returns build's (plan, compiled, planner), with the
    candidates and how the count was chosen in `plan.loss`.
    """
    loss = first.loss
    traces = {1: first}
    counts = [k for k in loss_chunks.candidates(loss.rows()) if k > 1]
    for i, k in enumerate(counts):
        progress.info("tracing the loss region in %d chunks", k)
        along(f"chunk count {i + 1} of {len(counts)}: the whole step is traced with the rewrite")
        traces[k] = _trace(step, loss, k, budget, dtypes)

    def build_count(k: int):
        return build(step, budget, dtypes, store, fields, chunks=k, first=traces[k])
    if len(traces) == 1:  # nothing to choose (too few token rows for a second count)
        return build_count(1)
    dev, opts = step.dev, step.options.solving()
    room = room_for(budget, step.ledger, dev)
    base_time = {k: ops_once_time(t.planner.profiles) for k, t in traces.items()}
    table = {k: f"ops once {1e3 * base_time[k]:.3f} ms" for k in traces}
    # Built only when some budget is left for activations (a floor query, budget=1, goes straight on).
    if room > 0:
        progress.info("choosing the chunk count: one ILP over the %d traces", len(traces))
        along(f"{sum(len(g.nodes) for t in traces.values() for g in t.planner.profiles)} nodes over all counts")
        ilp = ChoiceModel({k: t.planner.profiles for k, t in traces.items()}, dev.alloc_granularity)
    refused: dict[int, BudgetError] = {}
    while room > 0:
        choice = choose_trace(ilp, room, solver=opts["solver"], time_limit=opts["time_limit"], gap=opts["gap"])
        if choice.chosen is None:
            progress.info("the chunk-count ILP found no plan (%s): planning the counts in full, fastest first",
                          choice.status)
            break
        k = choice.chosen
        progress.info("the ILP chose %d chunk(s) for the loss region", k)
        try:
            plan, compiled, planner = build_count(k)
        except BudgetError as e:
            refused[k] = e
            table[k] += "; chosen by the ILP, refused by the exact simulator"
            ilp.exclude(k)
            continue
        table[k] += (f"; chosen by the ILP (predicted {1e3 * choice.predicted_time_s:.3f} ms with its recomputation, "
                     f"activation rows up to {format_bytes(choice.predicted_peak)})")
        return _record(plan, table, "ilp"), compiled, planner
    k = _fastest_in_full(traces, base_time, refused, table, budget, step)
    plan, compiled, planner = build_count(k)
    return _record(plan, table, "each count planned in full (the ILP found no plan)"), compiled, planner


def _trace(step: TrainingStep, loss: LossOption, k: int, budget: int, dtypes) -> Candidate:
    options = step.options
    option = LossOption(loss.outputs, k)
    pre = compose(precision_plan.pre_pass(dtypes, options.fp32_ops) if any(dtypes) else None, option.pre_pass())
    # regions="auto" traces the candidates per block; build decides on one graph for the count chosen
    planner = planner_for(step, budget, regions=options.regions is not False, pre_pass=pre)
    compiled = trace_step(step, planner)
    return Candidate(planner, compiled, option)


def _fastest_in_full(traces: dict, base_time: dict, refused: dict, table: dict, budget: int, step: TrainingStep) -> int:
    """Plan the counts the ILP did not already see refused; the fastest that fits, or the BudgetError of
    the count with the lowest floor.

    In order of their time with nothing recomputed (`base_time`, a lower bound of each count's step
    time), and a count that cannot beat the fastest plan found so far even with nothing recomputed is
    not planned (issue 38: planning all four counts of a 1-layer GPT-2 in full took 345 s). The fastest
    plan that fits is the same as when every count is planned; the plan is kept for `build`.
    """
    best: tuple[float, int] | None = None
    for k in sorted(traces, key=lambda c: (base_time[c], c)):
        if k in refused:
            continue
        if best is not None and base_time[k] >= best[0]:
            table[k] += (f"; not planned: with nothing recomputed it is no faster than the {best[1]}-chunk plan "
                         f"({best[0] * 1e3:.3f} ms)")
            continue
        progress.info("planning the loss region in %d chunk(s) in full", k)
        planner = traces[k].planner
        try:
            # As build plans the step (plan_jointly): its calls, one saved set per compiled graph.
            d = plan_graphs(planner.sequence(), budget, step.ledger, step.dev, step.options, one_set=True)
        except BudgetError as e:
            refused[k] = e
            table[k] += "; planned in full: does not fit"
            continue
        traces[k].decision = d
        time_s = base_time[k] + d.recompute_time_s
        table[k] += f"; planned in full: fits, predicted {time_s * 1e3:.3f} ms"
        if best is None or time_s < best[0]:
            best = (time_s, k)
    if best is not None:
        return best[1]
    k, e = min(refused.items(), key=lambda ke: (ke[1].smallest_budget or 2**62, ke[0]))
    first, _, rest = str(e).partition("\n")
    raise BudgetError(f"{first} (the loss region chunked into {k} piece(s), the lowest floor of the chunk "
                      f"counts planned: {', '.join(map(str, sorted(refused)))})\n{rest}", e.ledger,
                      e.smallest_budget) from None


def _record(plan, table: dict, how: str):
    plan.loss["candidates"] = {str(c): v for c, v in table.items()}
    plan.loss["chosen_by"] = how
    return plan
