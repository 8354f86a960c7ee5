"""AOTAutograd's partition callback, which every face's planning goes through.

`Planner` profiles each joint graph and either applies a given plan to it or solves for it on its own.
`CapturePlanner` is `optimize`'s: its first trace only profiles (a graph cannot know the ones after it); the
function that traced returns what the trace left as a `StepTrace` (step_tracing.py), from which
`joint_plan.plan_jointly` plans every graph of the step together under the budget and compiles the step with
that plan (autoremat.planning.pipeline runs these stages and verifies the result on a real step). The
torch.compile face (autoremat.backend) builds its own step planner on `Planner`. The callback only
accumulates what AOTAutograd hands it; no other module writes its state, and what a trace left is read
through its `StepTrace`.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.fx as fx

from autoremat.capture.aot import default_split
from autoremat.capture.blocks import CaptureError  # noqa: F401  (part of the public namespace)
from autoremat.capture.captured import CapturedGraph
from autoremat.capture.tracing import Restore, describe  # noqa: F401 (faces)
from autoremat.model.devices import DeviceSpec, blas_workspace_bytes, get_device
from autoremat.model.graph_profile import GraphProfile
from autoremat.model.ledger import Ledger, ledger_from_graph
from autoremat.model.profile import fingerprint, profile_graph
from autoremat.model.schedule import make_schedule
from autoremat.model.scratch import calibrate_scratch
from autoremat.passes import split
from autoremat.planning.budget import budget_or_memory, plan_graphs
from autoremat.planning.graph_calls import CallLog
from autoremat.planning.options import DEFAULTS, PlanOptions
from autoremat.planning.plan import BudgetError, Plan, build_plan
from autoremat.planning.same_regions import RegionReuse
from autoremat.solve.decision import evaluate
from autoremat.solve.heuristics import save_all
from autoremat.torch_internals import BackendCompilerFailed
from autoremat.units import format_bytes

if TYPE_CHECKING:
    from autoremat.capture.graph_code import GraphCode
    from autoremat.capture.regions import RegionLinks
    from autoremat.planning.dynamo_graphs import DynamoGraph

log = logging.getLogger("autoremat")
# One short phrase per planning stage, at INFO: `logging.basicConfig(level=logging.INFO)` shows them,
# and the CLI's spinner does (planning a large model takes seconds to minutes).
progress = logging.getLogger("autoremat.progress")
_along: str | None = None  # how far the running stage is, as it last said (`along`)


def along(text: str | None) -> None:
    """How far the running stage is ("12 graph(s) traced"), shown when the faces' pulse repeats a stage
    silent for seconds (autoremat.progress.pulse). Cheap: nothing is logged here, so a stage may call it
    per graph or per candidate."""
    global _along
    _along = text


def along_now() -> str | None:
    return _along


class PlanMismatch(ValueError):
    """A saved plan was applied to a graph it was not made for."""


class Planner:
    """Partition callback: plan (or re-apply a plan to) every joint graph AOTAutograd produces."""

    def __init__(
        self,
        budget: int | None,
        *,
        optimizer: Any = "adamw",
        device: DeviceSpec | str | torch.device | None = None,
        ledger: Ledger | None = None,
        plan: Plan | None = None,
        options: PlanOptions = DEFAULTS,
        calibrate: bool = True,
    ) -> None:
        self.calibrate = calibrate
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int)):
            raise TypeError(f"Planner takes the budget in bytes (an int, parsed by the face), got {budget!r}")
        self.budget = budget
        self.optimizer = optimizer
        self.device = get_device(device) if device is not None else None
        self.ledger = ledger
        self.plan = plan
        self.options = options  # the solver's settings (solver, time_limit, gap) are read from it
        self.profiles: list[GraphProfile] = []
        self.plans: list[Plan] = []  # one per graph planned on its own
        self._reported: set[str] = set()  # graphs whose internal error was logged already

    def _device(self, cg: CapturedGraph) -> DeviceSpec:
        return self.device or get_device("cpu" if cg.device == "meta" else cg.device)

    def _profile(self, cg: CapturedGraph) -> GraphProfile:
        gp = profile_graph(cg, self._device(cg))
        if self.calibrate:
            try:
                calibrate_scratch(cg, gp)
            except RuntimeError as e:  # the caller runs a torch profiler, and profilers cannot nest
                if "already active" not in str(e):
                    raise
                gp.notes.append("op scratch not measured: a torch profiler was running while this graph compiled")
        self.profiles.append(gp)
        along(f"{len(self.profiles)} graph(s) traced and profiled, the last of {len(gp.nodes)} nodes")
        return gp

    def __call__(self, cg: CapturedGraph) -> tuple[fx.GraphModule, fx.GraphModule]:
        return self.apply(cg, self._profile(cg))[0]

    def apply(self, cg: CapturedGraph, gp: GraphProfile) -> tuple[tuple[fx.GraphModule, fx.GraphModule], set[str]]:
        """The forward and backward modules of graph `cg` (profiled as `gp`) under the plan (solved for it
        alone if there is none), and the values they save."""
        dev = self._device(cg)
        ledger = self.ledger or ledger_from_graph(cg, self.optimizer, dev.alloc_granularity,
                                                  blas_workspace_bytes(dev, cg.device))
        if self.plan is not None:
            saved = self._saved_from_plan(gp, cg.index)
        else:
            decision = plan_graphs([gp], self.budget, ledger, dev, self.options)
            plan = build_plan([gp], decision, ledger, self.budget or 0, dev.name)
            self.plans.append(plan)
            log.info("autoremat planned graph %d: %s", cg.index, plan.summary().splitlines()[1])
            saved = decision.saved[0]

        def need(fallback: set[str]) -> tuple[int, Ledger]:
            _, tl, _ = evaluate([gp], [fallback], dev.alloc_granularity)
            return ledger.needs(tl.peak), ledger

        modules, used = self._split(cg, gp, set(saved), need, budget_or_memory(self.budget, dev))
        if self.plan is not None and used == set(saved):
            self._compiled(cg, gp, used)
        return modules, used

    def _compiled(self, cg: CapturedGraph, gp: GraphProfile, saved: set[str] | None) -> None:
        """Hook: graph `cg` (profiled as `gp`) was partitioned saving `saved` (None: the default partition)."""

    def _split(self, cg: CapturedGraph, gp: GraphProfile, saved: set[str],
               need: Callable[[set[str]], tuple[int, Ledger]], limit: int) -> tuple[tuple, set[str]]:
        """The forward and backward modules for `saved`, and the saved set they really use.

        An internal inconsistency (the graph passes and the schedule disagree) is our bug, not the
        user's: it is logged once per graph, and the graph falls back to PyTorch's default partition
        (every value the backward reads is saved) if that fits `limit`; `need(saved)` says what the
        step needs with it. Otherwise a BudgetError says so.
        """
        try:
            return split(cg, make_schedule(gp, saved)), saved
        except Exception as e:  # noqa: BLE001 - any failure here is an internal error, see above
            fallback = save_all([gp])[0]
            if gp.fingerprint not in self._reported:
                self._reported.add(gp.fingerprint)
                log.error("autoremat internal error on graph %d (%s, %d nodes): %s: %s. Falling back to saving "
                          "every value the backward reads for this graph. Please report this model.",
                          cg.index, gp.fingerprint, len(gp.nodes), type(e).__name__, e, exc_info=True)
            needed, ledger = need(fallback)
            if needed > limit:
                raise BudgetError(
                    f"autoremat internal error while applying the plan to graph {cg.index} ({type(e).__name__}: "
                    f"{e}); the fallback, saving every value the backward reads, needs {format_bytes(needed)} "
                    f"({needed} bytes), more than the budget of {format_bytes(limit)}. Please report this model; "
                    "meanwhile a budget that large runs it.", ledger, needed) from e
            return default_split(cg), fallback

    def saved_for(self, gp: GraphProfile, index: int) -> frozenset[str] | None:
        """What a graph profiled as `gp` at `index` would save: the plan's set, or None while capturing."""
        if self.plan is None:
            return None
        try:
            return frozenset(self._saved_from_plan(gp, index))
        except PlanMismatch:
            return frozenset({"(not in the plan)"})  # matches no saved set

    def _saved_from_plan(self, gp: GraphProfile, index: int) -> set[str]:
        matches = [g for g in self.plan.graphs if g.fingerprint == gp.fingerprint]
        for g in sorted(matches, key=lambda g: g.index != index):  # same position first
            return set(g.saved) | set(g.again)  # a cut is named among the saved values (cuts.py)
        raise PlanMismatch(
            f"the plan was made for graph(s) {[g.fingerprint for g in self.plan.graphs]}, but the model "
            f"traced to graph {gp.fingerprint} ({len(gp.nodes)} nodes): the model, its input shapes or "
            "dtypes, or the torch version differ. Plan again instead of re-applying this plan."
        )


@contextlib.contextmanager
def own_errors():
    """Our errors (BudgetError, PlanMismatch) raised inside a backend reach the user unwrapped."""
    try:
        yield
    except BackendCompilerFailed as e:
        inner = getattr(e, "inner_exception", None)
        if isinstance(inner, (BudgetError, PlanMismatch)):
            raise inner from None
        raise


class StaleCache(PlanMismatch):
    """A cached plan that does not apply to the graph being traced: plan afresh."""


class CapturePlanner(Planner):
    """`optimize`'s planner: the plan cache in front of the solver, and forgiving once planning is done.

    lookup(fingerprint) -> Plan | None is asked when the first graph arrives (fingerprints exist only
    after tracing); a plan found is applied as the graphs are traced, or with apply_cached=False (eager)
    swapped into the capture's code afterwards (`joint_plan.compile_with`). The first trace only profiles
    (`_capture`). Once `optimize` has returned (`strict = False`), a graph identical to one already
    planned (an identical block, or a recompile caused by a guard on Python state) reuses that plan, and
    a graph that no plan was made for (the same input shape traced to another graph by such a recompile:
    new shapes get a pipeline of their own, see remat_module.RematModule) is planned on its own rather
    than raising PlanMismatch.
    """

    def __init__(self, *args: Any, lookup: Callable[[str], Plan | None] | None = None,
                 pre_pass: Callable | None = None, regions: bool = True, regions_seen: dict | None = None,
                 keep_graphs: bool = False, apply_cached: bool = True, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # identical regions traced once, over a memo every trace of the step shares (same_regions.py)
        self.same = RegionReuse(self, {} if regions_seen is None else regions_seen)
        self.pre_pass = pre_pass  # the dtype rewrite of each dynamo graph (precision), or None
        self.regions = regions  # one graph per repeated block (autoremat.capture.regions)
        self.release_grads = self.options.release_grads  # each weight gradient to .grad as soon as it exists (regions)
        self.lookup, self.apply_cached = lookup, apply_cached
        self.per_block = False  # whether a dynamo graph was split per repeated block (capture/regions.py)
        self.cached: Plan | None = None
        self.strict = True
        self.log = CallLog(self.profiles)  # which graphs the traced step calls (step_tracing.compile_and_trace)
        self.dynamo_graphs: list[DynamoGraph] | None = [] if keep_graphs else None  # kept: dynamo_graphs.py
        # Under eager, the code each graph call of its trace runs (aot_backend's `codes`): see StepTrace.codes.
        self.codes: list[tuple[int | None, RegionLinks | None, GraphCode | None]] = []

    def done(self) -> None:
        """Planning is over: forgiving from now on (class docstring)."""
        self.strict = False

    def took_over(self, profiles: tuple[GraphProfile, ...], codes: tuple, per_block: bool,
                  swapped: list[GraphCode]) -> None:
        """A plan was swapped into the codes of a trace (planned_in_place.py): this planner ends as its own
        trace would have left it: a profile per graph (the trace's own: the plan was solved on them), the
        codes it may swap a later plan into, and no identical region taking a swapped code as a capture's."""
        self.profiles.extend(profiles)
        self.codes, self.per_block = list(codes), per_block
        self.same.forget(swapped)

    def may_reuse(self) -> bool:
        """Whether an identical region may take a code traced before (same_regions.py): not after planning (a
        recompile), nor before the plan cache was asked (the first graph's fingerprint is its key)."""
        return self.strict and not (self.plan is None and self.lookup is not None and not self.profiles)

    def untraced(self) -> None:
        """What `apply` noted of graphs it partitioned outside a trace (planned_in_place.py): dropped."""
        self.same.untraced()

    def sequence(self) -> list[GraphProfile]:
        """The step's graphs as it calls them: a graph compiled once and called per block appears per call."""
        return self.log.sequence()

    def __call__(self, cg: CapturedGraph) -> tuple[fx.GraphModule, fx.GraphModule]:
        fp = fingerprint(cg.joint)
        if self.plan is None and self.lookup is not None and not self.profiles:
            self.cached = self.lookup(fp)
            self.plan = self.cached if self.apply_cached else None
        if self.cached is not None and self.plan is self.cached:
            try:
                return super().__call__(cg)
            except Exception as e:  # a cache entry is never trusted: any failure means plan afresh
                raise StaleCache(f"cached plan does not apply: {type(e).__name__}: {e}") from None
        if self.plan is None and self.strict:
            return self._capture(cg)
        known = [g.fingerprint for p in ([self.plan] if self.plan else []) + self.plans for g in p.graphs]
        if not self.strict and fp not in known and self.plan is not None:
            log.warning("autoremat: graph %s is new (dynamo recompiled the step to another graph, e.g. on a guard on "
                        "Python state): planning it on its own, unverified", fp)
            return self._with_plan(None, cg)
        if self.plan is None and fp in known:
            # An identical repeated block (regions), or a recompile caused by a guard on Python state
            # (then verification notes it, and dynamo runs eagerly past its recompile limit).
            log.info("autoremat: graph %s is identical to one planned already: reusing its plan", fp)
            return self._with_plan(next(p for p in self.plans if fp in {g.fingerprint for g in p.graphs}), cg)
        return super().__call__(cg)

    def _capture(self, cg: CapturedGraph) -> tuple[fx.GraphModule, fx.GraphModule]:
        """The first trace: profile the graph and run it unplanned (saving what the backward reads).

        The graphs of a step share its budget, and a graph cannot know the ones after it (graph
        breaks, regions), so nothing is solved here: `optimize` plans every graph jointly once the
        whole step has been seen, then compiles again with that plan.
        """
        self._compiled(cg, self._profile(cg), None)
        self.per_block = self.per_block or cg.links is not None
        return default_split(cg)

    def _compiled(self, cg: CapturedGraph, gp: GraphProfile, saved: set[str] | None) -> None:
        if self.strict:
            self.same.traced(cg.region_key, gp, saved)

    def adopt(self, gp: GraphProfile) -> None:
        """A region's profile moved from an identical one traced before (RegionReuse.reused)."""
        self.profiles.append(gp)
        self.per_block = True
        along(f"{len(self.profiles)} graph(s) traced and profiled, the last reused from an identical block")

    def _with_plan(self, plan: Plan | None, cg: CapturedGraph) -> tuple[fx.GraphModule, fx.GraphModule]:
        kept, self.plan = self.plan, plan
        try:
            return super().__call__(cg)
        finally:
            self.plan = kept


