"""How many pieces the loss region is chunked into: chosen by one ILP over the candidate traces.

The loss rewrite (autoremat.passes.loss_chunks) turns the output projection + cross-entropy into k
chunks of token rows; each k is a trace of its own. The step is traced at every candidate k
(loss_chunks.CANDIDATES), and one ILP (autoremat.ilp_choice) picks k together with the
save/recompute plan of that trace, under the budget, at the least predicted step time: more chunks
only where the memory they free saves more recomputation than their smaller matmuls cost.

The chosen trace is then planned in full and verified (`pipeline.build`). The ILP's rows bound the
exact simulator conservatively, so if the full plan refuses the chosen k, the ILP is asked again
without it; and if the ILP finds no trace at all (its rows see no room where calibration against the
simulator might), every remaining k is planned in full and the fastest that fits is kept.
"""

from __future__ import annotations

from collections.abc import Callable

from autoremat import precision_plan
from autoremat.heuristics import save_all_peak
from autoremat.ilp_choice import ChoiceModel, ops_once_time
from autoremat.passes import loss_chunks
from autoremat.passes.loss_chunks import LossOption, compose
from autoremat.plan import BudgetError
from autoremat.planner import CapturePlanner, activation_budget, compile_and_trace, plan_graphs, progress
from autoremat.solver import choose_trace
from autoremat.units import format_bytes

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
    whole, room = save_all_peak(planner.sequence(), dev.alloc_granularity), activation_budget(budget, ledger, dev)
    if whole > room:
        return None
    return (f"with everything saved the step needs {format_bytes(whole)} of activations, within the "
            f"{format_bytes(room)} the budget leaves: nothing to free, no other count traced")


def choose_chunks(model, traced: CapturePlanner, loss: LossOption, budget: int, dtypes, store, fields, *,
                  build: Callable, **kw):
    """Trace the step at each candidate chunk count, let the ILP choose one, and `build` the step with it.

    `traced` is the step as first traced (1 chunk); `build` is pipeline.build. Returns build's
    (plan, compiled, planner), with the candidates and how the count was chosen in `plan.loss`.
    """
    traces = {1: traced}
    for k in loss_chunks.candidates(loss.rows()):
        if k > 1:
            progress.info("tracing the loss region in %d chunks", k)
            traces[k] = _trace(model, loss, k, budget, dtypes, kw)
    if len(traces) == 1:  # nothing to choose (too few token rows for a second count)
        return build(model, budget, dtypes, store, fields, outputs=loss.outputs, chunks=1, **kw)
    dev, opts = kw["dev"], kw["opts"]
    activations = activation_budget(budget, kw["ledger"], dev)
    base_time = {k: ops_once_time(t.profiles) for k, t in traces.items()}
    table = {k: f"ops once {1e3 * base_time[k]:.3f} ms" for k in traces}
    # Built only when some budget is left for activations (a floor query, budget=1, goes straight on).
    ilp = ChoiceModel({k: t.profiles for k, t in traces.items()}, dev.alloc_granularity) if activations > 0 else None
    refused: dict[int, BudgetError] = {}
    while activations > 0:
        choice = choose_trace(ilp, activations, solver=opts["solver"], time_limit=opts["time_limit"], gap=opts["gap"])
        if choice.chosen is None:
            progress.info("the chunk-count ILP found no plan (%s): planning each count in full", choice.status)
            break
        k = choice.chosen
        progress.info("the ILP chose %d chunk(s) for the loss region", k)
        try:
            plan, compiled, planner = build(model, budget, dtypes, store, fields, outputs=loss.outputs, chunks=k, **kw)
        except BudgetError as e:
            refused[k] = e
            table[k] += "; chosen by the ILP, refused by the exact simulator"
            ilp.exclude(k)
            continue
        table[k] += (f"; chosen by the ILP (predicted {1e3 * choice.predicted_time_s:.3f} ms with its recomputation, "
                     f"activation rows up to {format_bytes(choice.predicted_peak)})")
        return _record(plan, table, "ilp"), compiled, planner
    k = _fastest_in_full(traces, base_time, refused, table, budget, kw)
    plan, compiled, planner = build(model, budget, dtypes, store, fields, outputs=loss.outputs, chunks=k, **kw)
    return _record(plan, table, "each count planned in full (the ILP found no plan)"), compiled, planner


def _trace(model, loss: LossOption, k: int, budget: int, dtypes, kw) -> CapturePlanner:
    pre = compose(precision_plan.pre_pass(dtypes, kw["fp32_ops"]) if any(dtypes) else None,
                  LossOption(loss.outputs, k).pre_pass())
    # regions="auto" traces the candidates per block; build decides on one graph for the count chosen
    planner = CapturePlanner(budget, device=kw["dev"], ledger=kw["ledger"], regions=kw["regions"] is not False,
                             release_grads=kw["release_grads"], pre_pass=pre, **kw["opts"])
    compile_and_trace(model, planner, kw["compiler"], kw["args"], kw["kwargs"])
    return planner


def _fastest_in_full(traces: dict, base_time: dict, refused: dict, table: dict, budget: int, kw) -> int:
    """Plan every count the ILP did not already see refused; the fastest that fits, or the BudgetError
    of the count with the lowest floor."""
    best: tuple[float, int] | None = None
    for k, planner in traces.items():
        if k in refused:
            continue
        try:
            d = plan_graphs(planner.profiles, budget, kw["ledger"], kw["dev"], **kw["opts"])
        except BudgetError as e:
            refused[k] = e
            table[k] += "; planned in full: does not fit"
            continue
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
