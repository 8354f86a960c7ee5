"""The pipeline `optimize` runs for one input shape: trace, plan jointly, compile, verify.

    capture every graph of the step -> plan them jointly under one budget -> compile with the plan
    -> run one real step in the accumulation steady state and measure it -> re-plan with the
    measured gap, or refuse with BudgetError: the budget never passes silently (verify.py).

`plan_with_dtypes` is that pipeline for given compute dtypes: it captures the step, has the loss region's
chunk count chosen from traces (loss_region/), and `build` plans the step captured at that count. The
stage before it, `precision_auto.plan_step`, is
where every face's plan starts: it chooses the dtypes (precision="bf16" / "fp16" / "auto"; fp32 goes
straight on) and checks the result against fp32 and torch.autocast.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from autoremat.model.devices import get_device
from autoremat.model.ledger import Ledger
from autoremat.passes.loss_chunks import LossOption, compose
from autoremat.planning import precision_plan
from autoremat.planning import verify as verification
from autoremat.planning.budget import check_cached, plan_graphs, room_for, say_solving
from autoremat.planning.cache import PlanCache
from autoremat.planning.dynamo_graphs import DynamoGraph
from autoremat.planning.joint_plan import compile_with, plan_jointly, solve_step
from autoremat.planning.loss_region import choice as chunk_count
from autoremat.planning.loss_region.count_trace import ChunkCountTrace
from autoremat.planning.options import DEFAULTS, PlanOptions, TrainingStep
from autoremat.planning.plan import BudgetError, Plan
from autoremat.planning.planned_step import PlannedStep
from autoremat.planning.planner import CapturePlanner, StaleCache, log, progress
from autoremat.planning.step_trace import StepTrace
from autoremat.planning.step_tracing import planner_for, require_graphs, trace_step
from autoremat.solve.decision import Decision
from autoremat.solve.heuristics import save_all_peak
from autoremat.solve.solver import smallest_peak
from autoremat.units import format_bytes


class _Tracer:
    """Traces the step for `capture` and `build` in either form (one graph per block, or one graph): a cached plan,
    if any, is looked up by the first graph's fingerprint as it arrives, and a stale one discarded."""

    def __init__(self, step: TrainingStep, budget: int, pre: Any, store: PlanCache | None, fields: dict) -> None:
        self.step, self.budget, self.pre, self.store, self.fields = step, budget, pre, store, fields
        self.keys: list[str] = []  # the cache keys looked up, in order
        self.source: DynamoGraph | None = None  # the step's dynamo graph, kept by its first trace (dynamo_graphs.py)

    def _lookup(self, fingerprint: str) -> Plan | None:
        self.keys.append(self.store.key(fingerprint, self.fields))
        return self.store.load(self.keys[-1])

    def planner(self, split: bool, lookup: bool = True) -> CapturePlanner:
        # Under eager a cached plan is swapped into the capture's code (`_from_cache`); Inductor compiles each
        # graph as it is traced, so there the plan is applied while tracing.
        return planner_for(self.step, self.budget, lookup=self._lookup if lookup and self.store is not None else None,
                           pre_pass=self.pre, regions=split, keep_graphs=True,
                           apply_cached=self.step.compiler != "eager")

    def __call__(self, split: bool) -> TracedForm:
        """Capture the step, with the cache key used (None if the cache was not looked up). The second form
        traced (one graph, after one graph per block) is traced from the dynamo graph the first kept."""
        looked = len(self.keys)
        planner = self.planner(split)
        if self.source is not None and self.store is None:
            return TracedForm(trace_step(self.step, planner, self.source), planner, None)
        try:
            trace = trace_step(self.step, planner)
        except StaleCache as e:
            log.warning("autoremat: ignoring cached plan %s (%s)", self.store.path(self.keys[-1]), e)
            self.store.discard(self.keys[-1])
            planner = self.planner(split, lookup=False)
            trace = trace_step(self.step, planner)
        require_graphs(self.step.model, trace)
        self.source = self.source or trace.source
        return TracedForm(trace, planner, self.keys[-1] if len(self.keys) > looked else None)


def plan_with_dtypes(step: TrainingStep, budget: int, dtypes: list[dict[str, str]], store: PlanCache | None,
                     fields: dict) -> PlannedStep:
    """Trace the step with `dtypes` applied, choose its loss region's chunk count, and `build` it with that
    count under `budget` (cache first).

    The count is the one a plan of this step was cached with, if its plan is still in the cache; else the
    loss region as the model wrote it (one chunk), unless the first trace shows a projection -> cross-entropy
    pattern large enough to matter that does not fit with nothing recomputed: then the loss region's choice
    (autoremat.planning.loss_region.choice.CountChoice) works from the traces at each count which count to build.
    """
    known = chunk_count.remembered_count(step, store, fields)
    if known is not None:
        progress.info("the plan cache has a plan with the loss region in %d chunk(s): tracing that count", known)
        hit = capture(step, budget, dtypes, store, fields, known)
        if isinstance(hit, PlannedStep):
            return hit  # else the step traced at the remembered count has no plan in the cache: planned afresh
    captured = capture(step, budget, dtypes, store, fields, None)
    if isinstance(captured, PlannedStep):
        return captured
    loss, traced, dev = captured.loss, captured.traced.trace, step.dev
    chunks_note = None
    if loss.found and chunk_count.loss_region_matters(traced, loss, dev.alloc_granularity):
        chunks_note = chunk_count.fits_unchunked(traced, budget, step.ledger, dev)
        if chunks_note is None:
            planned = _build_chosen_count(step, budget, dtypes, store, fields, ChunkCountTrace(traced, loss))
            chunk_count.remember_count(step, store, fields, planned.plan.loss["chunks"])
            return planned
    return build(step, budget, captured, chunks_note)


def _build_chosen_count(step: TrainingStep, budget: int, dtypes: list[dict[str, str]], store: PlanCache | None,
                        fields: dict, first: ChunkCountTrace) -> PlannedStep:
    """The step built with the chunk count the loss region's choice ranks first, from that count's trace; if
    its build is refused (the exact simulator, or a real step), the next; once none is left, the count the
    choice plans in full (or its BudgetError)."""
    choice = chunk_count.CountChoice(step, first, budget, dtypes)
    if choice.only_one():  # nothing to choose (too few token rows for a second count)
        return build_with_count(step, budget, dtypes, store, fields, 1, choice.trace(1))
    for k in choice.ranked():
        try:
            planned = build_with_count(step, budget, dtypes, store, fields, k, choice.trace(k))
        except BudgetError as e:
            choice.refused(k, e)
            continue
        return choice.chosen(k, planned)
    k = choice.planned_in_full()
    return choice.chosen_in_full(build_with_count(step, budget, dtypes, store, fields, k, choice.trace(k)))


def build_with_count(step: TrainingStep, budget: int, dtypes: list[dict[str, str]], store: PlanCache | None,
                     fields: dict, chunks: int, traced_at: ChunkCountTrace | None = None) -> PlannedStep:
    """The step captured with its loss region in `chunks` pieces (from `traced_at`, that count's trace, where
    there is one) and built: the cache's plan for it, else planned, verified."""
    captured = capture(step, budget, dtypes, store, fields, chunks, traced_at)
    return captured if isinstance(captured, PlannedStep) else build(step, budget, captured)


@dataclass(frozen=True)
class Captured:
    """The step traced at one chunk count, the plan cache asked and no plan found there: what `build` plans."""

    traced: TracedForm
    tracer: _Tracer  # traces the step again in another form (regions="auto"), with the same rewrite and cache
    loss: LossOption  # the loss region's rewrite, with what it found
    chunks: int | None  # the loss region's chunk count (None: as the model wrote it)
    dtypes: list[dict[str, str]]
    fields: dict  # what the plan cache keys its plan by
    form_key: str | None  # the cache's key for the form planned (regions="auto"), if there is a cache


def capture(step: TrainingStep, budget: int, dtypes: list[dict[str, str]], store: PlanCache | None, fields: dict,
            chunks: int | None, traced_at: ChunkCountTrace | None = None) -> PlannedStep | Captured:
    """Trace the step with `dtypes` applied and the loss region in `chunks` pieces (autoremat.passes.loss_chunks;
    `step.options.outputs` says whether the logits output is kept): the plan cache's plan for it where it has
    one that holds, else the capture to plan.

    traced_at: the step already traced with these dtypes and `chunks` (by the loss region's choice), and
    its plan at the budget if one was solved: neither is done again (without a plan cache: a cached plan is
    looked up by a trace's first graph as it arrives).
    """
    options = step.options
    outputs, regions = options.outputs, options.regions
    loss = LossOption(outputs, chunks)
    fields = {**fields, "outputs": outputs, "loss_chunks": chunks}
    pre = compose(precision_plan.pre_pass(dtypes, options.fp32_ops) if any(dtypes) else None, loss.pre_pass())
    if traced_at is not None:
        loss.reports = list(traced_at.loss.reports)  # what the pass found in that trace (pre_pass() reset them)
    trace = _Tracer(step, budget, pre, store, fields)
    form_key = (store.step_key(step.model, step.args, step.kwargs, {**fields, "traced_dtypes": dtypes})
                if store is not None and regions == "auto" else None)
    if traced_at is not None and store is None:
        traced = TracedForm(traced_at.trace, None, None, decision=traced_at.decision)
    elif (hit := _remembered_form(step, trace, budget, form_key)) is not None:
        return hit
    else:
        progress.info("capturing the training step")
        traced = trace(regions if isinstance(regions, bool) else True)  # "auto" captures per block first
    hit, traced = _from_cache(step, traced, budget, trace)
    if hit is not None:
        return hit
    return Captured(traced, trace, loss, chunks, dtypes, fields, form_key)


def build(step: TrainingStep, budget: int, captured: Captured, chunks_note: str | None = None) -> PlannedStep:
    """Plan the captured step under `budget`, at the chunk count it was captured with, and verify it.

    regions="auto" may take the step as one graph instead (`one_graph_if_free`). `chunks_note`: why no other
    chunk count was traced, for the plan to record."""
    options, ledger, dev = step.options, step.ledger, step.dev
    traced, trace, store = captured.traced, captured.tracer, captured.tracer.store
    regions_note, per_block_step = None, None
    checked = step.checked
    if options.regions == "auto" and traced.trace.per_block:
        traced, per_block_step = one_graph_if_free(traced, trace, budget, step)
        hit, traced = _from_cache(step, traced, budget, trace)
        if hit is not None:  # the one graph's plan, cached
            return hit
        regions_note = traced.note
    store_key = traced.store_key
    decision = traced.decision or plan_graphs(say_solving(list(traced.trace.calls), options), budget, ledger, dev,
                                              options, one_set=True)
    planned = plan_jointly(step, traced.trace, budget, decision)
    measured: Any = verification.UNMEASURED
    if per_block_step is not None and checked:
        measured = verification.measure_planned(step, planned)  # and whether one graph is kept
        # One graph is kept only if a real step of it fits and its prediction held: else the per-block step,
        # planned and verified as usual.
        predicted = planned.plan.activation_peak
        if measured is not None and (ledger.step_peak(measured) > budget or measured > WHOLE_HELD * predicted):
            store_key = per_block_step.store_key
            regions_note = f"{per_block_step.note} ({measured} B of activations measured, {predicted} B predicted)"
            planned = plan_jointly(step, per_block_step.trace, budget, solve_step(step, per_block_step.trace, budget))
            measured = verification.UNMEASURED
    if checked:  # one graph kept: the step just measured is its verification
        planned = verification.verify_on_step(step, planned, budget, measured=measured)
    elif step.where.type == "meta":
        planned.plan.notes.append("planned on the meta device: no real step was run to verify the prediction")
    _describe(planned, captured.loss, captured.chunks, chunks_note, regions_note, captured.dtypes, options)
    if store is not None and store_key:
        store.store(store_key, planned.plan, captured.fields)
        if captured.form_key is not None:
            store.store_form(captured.form_key, planned.applier.regions)  # kept only where one graph was planned
    return planned


def _remembered_form(step: TrainingStep, trace: _Tracer, budget: int, form_key: str | None) -> PlannedStep | None:
    """regions="auto": build's result from the plan cache where the last plan of this step was one graph, that
    form traced alone (its plan is stored under the one graph's key); None where it was not, or its plan is
    not in the cache (a stale one is discarded: the step is then captured per block as usual)."""
    if form_key is None or trace.store.load_form(form_key) is not False:
        return None
    progress.info("the plan cache has a plan of this step as one graph: tracing that form")
    return _from_cache(step, trace(False), budget, trace)[0]


def _from_cache(step: TrainingStep, traced: TracedForm, budget: int,
                trace: _Tracer) -> tuple[PlannedStep | None, TracedForm]:
    """build's PlannedStep from the plan cache, and the form to plan from otherwise: the plan `traced`'s first
    graph found there, re-simulated on the graphs traced and compiled with them. None if none was found, or
    if it is not what it claims; then its entry is discarded and the form to plan afresh from is the capture
    itself where the plan was not applied while tracing (eager), else the step traced again without it."""
    found, store = traced.trace, trace.store
    if found.cached is None:
        return None, traced
    where = store.path(traced.store_key)
    plan = check_cached(found, budget, step.ledger, step.dev)
    applied = found.cached_applied  # while tracing: its trace is no capture to plan afresh from
    why = "no longer fits"
    if plan is not None:
        try:
            if applied:
                planned = PlannedStep(plan, found.compiled, traced.tracer, found)
            else:
                planned = compile_with(step, found, budget, plan)
            plan.notes.append(f"plan loaded from the cache ({where}); re-simulated, not solved")
            return planned, traced
        except Exception as e:  # noqa: BLE001 - an entry is never trusted: any failure means plan afresh
            why, applied = f"could not be applied ({type(e).__name__}: {e})", True  # the code may be half changed
    log.warning("autoremat: cached plan %s %s; planning again", where, why)
    store.discard(traced.store_key)
    afresh = traced.afresh(trace) if applied else dataclasses.replace(traced, trace=dataclasses.replace(found, cached=None))
    return None, afresh


def _describe(planned: PlannedStep, loss: LossOption, chunks: int | None, chunks_note: str | None,
              regions_note: str | None, dtypes: list, options: PlanOptions) -> None:
    """What the plan records of how the step was traced: graphs, regions, the loss region, dtypes."""
    plan = planned.plan
    plan.notes.append(f"{len(planned.applier.profiles)} graph(s) captured")
    plan.regions = planned.applier.regions
    if regions_note:
        plan.notes.append(regions_note)
    if loss.found:
        kept = max(r.logits_kept for r in loss.reports)
        plan.loss = {"chunks": chunks or 1, "outputs": options.outputs, "rows": loss.rows(), "logits_kept": kept,
                     "fused": max(r.fused for r in loss.reports),
                     "skipped": list(dict.fromkeys(w for r in loss.reports for w in r.skipped))}
        if chunks_note:
            plan.loss.update(candidates={"1": chunks_note}, chosen_by="everything saved fits unchunked")
        if options.outputs == "loss" and kept:
            plan.notes.append(f"outputs='loss', but {kept} logits tensor(s) feed more than the loss (another use in "
                              "the model, or an output derived from them): they are still computed whole")
    if dtypes:
        plan.precision = {**plan.precision, "dtypes": dtypes, "fp32_ops": list(options.fp32_ops)}
        plan.needs_grad_scaler = any(d == "fp16" for pick in dtypes for d in pick.values())


# regions="auto" keeps one graph only if a real step of it measured at most this much over its prediction.
WHOLE_HELD = 1.05


@dataclass(frozen=True)
class TracedForm:
    """The step as traced in one form (one graph per block, or one graph): what planning starts from."""

    trace: StepTrace
    tracer: CapturePlanner | None  # the planner that traced it (it applies a cached plan it applied while tracing)
    store_key: str | None  # the plan cache's key for it, if the cache was looked up
    note: str = ""  # why this form (regions="auto")
    decision: Decision | None = None  # its plan at the budget, where one_graph_if_free already solved it

    def afresh(self, tracer: _Tracer) -> TracedForm:
        """This form traced again without the plan cache (a cached plan was applied while tracing it)."""
        planner = tracer.planner(self.trace.regions, lookup=False)
        return dataclasses.replace(self, trace=trace_step(tracer.step, planner), tracer=planner)


def one_graph_if_free(per_block: TracedForm, trace: Callable[[bool], TracedForm], budget: int,
                      step: TrainingStep) -> tuple[TracedForm, TracedForm | None]:
    """regions="auto": the step as one graph when that costs less time than the graph calls it saves.

    Cutting the step into one graph per repeated block lets each block's gradients reach `.grad` as
    soon as its backward ends, which is what lowers the floor; but each region is one more
    AOTAutograd call per step (`DeviceSpec.region_call_s`), which a step of small kernels pays for
    (benchmarks/speed.py --with-cut compares both forms at equal budgets). So when the per-block step's
    save-everything peak fits the budget (it recomputes nothing), the step is traced once more
    uncut. If that one's save-everything peak fits too, nothing is recomputed either way and one graph
    (no region calls; gradients at the end of the backward, as the memory model sees) is used. If it
    does not, one graph is planned at the budget, and used when its predicted recomputation costs
    less than the graph calls it saves.

    Under Inductor the one-graph prediction can be low: the model runs the backward's kernels in the
    least-peak-first order where that peaks lower, as Inductor's reorder_for_peak_memory does by its
    own estimate, but where that estimate ties two orders Inductor keeps the graph's, which may peak
    higher (tests/test_fusion.py's MLP is such a case; the per-block step's prediction stays exact). So under
    Inductor one graph is taken only when a real step will be measured (`checked`: verify on a real
    device), and `build` goes back to the per-block step if that step is over the budget or over its
    prediction by more than WHOLE_HELD.

    Returns the form to plan, its `note` saying why, and the per-block step to fall back on (its `note`
    saying why) when one graph was taken, else None.
    """
    ledger, dev = step.ledger, step.dev
    room = room_for(budget, ledger, dev)
    per_block_graphs = list(per_block.trace.calls)
    saved_per_block, n_per_block = save_all_peak(per_block_graphs, dev.alloc_granularity), len(per_block_graphs)
    said = f"regions='auto': {n_per_block} graphs, one per repeated block (and per graph break)"
    if saved_per_block > room:
        return dataclasses.replace(per_block, note=(
            f"{said}, so that gradients leave the backward as blocks finish: with everything saved the step "
            f"would need {format_bytes(saved_per_block)} of activations, over the {format_bytes(room)} the budget "
            "leaves")), None
    if step.compiler == "inductor" and not step.checked:
        return dataclasses.replace(per_block, note=(
            f"{said}: nothing is recomputed with them, but one graph's peak under Inductor is not predicted "
            "exactly and no real step will measure it (verify=False, or the meta device)")), None
    progress.info("tracing the step again as one graph (nothing is recomputed with one graph per block)")
    whole = trace(False)
    graphs = list(whole.trace.calls)
    saved_whole, calls = save_all_peak(graphs, dev.alloc_granularity), n_per_block - len(graphs)
    calls_s = calls * dev.region_call_s
    over = (f"with everything saved one graph would need {format_bytes(saved_whole)}, over the {format_bytes(room)} "
            "the budget leaves")
    if saved_whole > room:
        progress.info("solving for %d nodes in one graph (time limit %g s per solve)",
                      sum(len(g.nodes) for g in graphs), step.options.time_limit)
        try:
            decision = plan_graphs(graphs, budget, ledger, dev, step.options, one_set=True)
            whole, recompute_s = dataclasses.replace(whole, decision=decision), decision.recompute_time_s
        except BudgetError:
            recompute_s = None
        if recompute_s is None or recompute_s >= calls_s:
            why = ("planned at the budget it does not fit" if recompute_s is None else
                   f"planned at the budget it would recompute {1e3 * recompute_s:.3f} ms a step, not less than the "
                   f"{1e3 * calls_s:.3f} ms of the {calls} graph calls it saves")
            return dataclasses.replace(per_block, note=(
                f"{said}: nothing is recomputed with them ({format_bytes(saved_per_block)} of activations with "
                f"everything saved), but {over}; {why}")), None
        note = (f"regions='auto': one graph for the step, not {n_per_block} (one per repeated block): {over}, and "
                f"its plan recomputes {1e3 * recompute_s:.3f} ms a step, less than the {1e3 * calls_s:.3f} ms of "
                f"the {calls} AOTAutograd calls per step it saves (the per-block step recomputes nothing)")
    else:
        note = (f"regions='auto': one graph for the step, not {n_per_block} (one per repeated block): nothing is "
                f"recomputed either way ({format_bytes(saved_whole)} of activations with everything saved, "
                f"within the {format_bytes(room)} the budget leaves), and one graph saves {calls} AOTAutograd "
                "calls per step")
    return dataclasses.replace(whole, note=note), dataclasses.replace(per_block, note=(
        f"{said}: one graph measured over the budget or more than {100 * (WHOLE_HELD - 1):.0f}% over its "
        "prediction on a real step"))


def pareto_points(profiles: list, plan: Plan, device: str, options: PlanOptions = DEFAULTS, *,
                  count: int = 8) -> list[tuple[int, float]]:
    """(budget, predicted recompute overhead) at `count` budgets from the smallest that fits to none."""
    dev = get_device(device)
    ledger = Ledger.from_dict(plan.ledger)
    smallest = smallest_peak(profiles, granularity=dev.alloc_granularity, options=options.solving())
    low = ledger.needs(smallest.peak)
    high = max(plan.no_recompute_budget, ledger.needs(plan.activation_peak))
    budgets = sorted({round(low + (high - low) * i / (count - 1)) for i in range(count)})
    forward = plan.forward_time_s or 1.0
    points = []
    for b in budgets:
        try:
            # A fresh ledger each time: plan_graphs records the budget it was given in it.
            decision = plan_graphs(profiles, b, Ledger.from_dict(plan.ledger), dev, options)
        except BudgetError:
            if b != low:
                continue
            decision = smallest  # at the very edge the search can miss what the min-peak plan reached
        points.append((b, decision.recompute_time_s / forward))
    return points
