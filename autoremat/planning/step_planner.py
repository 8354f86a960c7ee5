"""The backend's planner: follows the graph calls of each training step and plans them together.

Dynamo hands the backend (backend.py) one graph at a time, and a graph may run several times in one
step or at several input shapes, so `StepPlanner` plans steps, not graphs: a step it has not seen
runs every call at that call's most frugal plan, each checked against the budget with everything
the earlier calls of the step hold; once the step is complete its calls are planned jointly and
compiled again; a planned step is measured (step_window.py) and planned again with the gap reserved, or the
next step refused (docs/backend.md).
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from autoremat.capture.aot import aot_backend
from autoremat.capture.captured import CapturedGraph
from autoremat.model.devices import DeviceSpec, blas_workspace_bytes, get_device
from autoremat.model.graph_profile import GraphProfile
from autoremat.model.ledger import Ledger, parameter_bytes, storage_key
from autoremat.planning.budget import budget_or_memory, plan_graphs
from autoremat.planning.compilers import (
    CompilerChoice,
    check_compiler,
    choose_compiler,
    fits_without_inductor,
    neither_fits,
)
from autoremat.planning.plan import BudgetError, Plan, build_plan
from autoremat.planning.planner import Planner
from autoremat.planning.step_window import StepWindow
from autoremat.solve.decision import Decision, PlanPath, Route, evaluate
from autoremat.solve.heuristics import checkpoint_blocks, save_all
from autoremat.solve.solver import smallest_peak
from autoremat.torch_internals import in_backward, tree_leaves
from autoremat.units import format_bytes

log = logging.getLogger("autoremat")


@dataclass(eq=False)
class GraphUse:
    """One dynamo graph at one set of input shapes, compiled once per saved set a plan asks for."""

    gm: fx.GraphModule
    number: int  # in order of first call, for messages
    gp: GraphProfile | None = None
    frugal: frozenset[str] = frozenset()  # what it saves until its step is known (`StepPlanner._frugal`)
    compiled: dict[frozenset[str] | None, tuple[Callable, frozenset[str]]] = field(default_factory=dict)
    inference: bool = False  # compiled without a backward: nothing to plan
    stale: bool = False  # compiled by another compiler before (StepPlanner._eager_instead): frugal plan anew

    @property
    def first(self) -> frozenset[str]:
        """What it saves when first run: its frugal plan, or the fallback that replaced it."""
        return self.compiled[None][1] if None in self.compiled else self.frugal


@dataclass
class GraphCall:
    use: GraphUse
    saved: frozenset[str] | None  # what the plan of a known step asks for; None: the use's frugal plan
    inputs: int = 0  # bytes of the tensors it reads that no earlier call of the step returned (the batch)
    # id -> bytes of a parameter, its gradient and its optimizer state (a graph called for several
    # blocks gets each block's own parameters)
    params: dict[int, tuple[int, int, int]] = field(default_factory=dict)
    # the profile its code was planned on, where its use has been compiled again by another compiler since
    # (StepPlanner._eager_instead); None: its use's own
    gp: GraphProfile | None = None


class StepPlanner(Planner):
    """The backend's planner: follows each step's graph calls and plans them together (module docstring)."""

    def __init__(self, budget: int | None, **kwargs: Any) -> None:
        super().__init__(budget, **kwargs)
        self.compiler_requested = check_compiler(self.options.compiler)
        # "auto" is resolved when the first graph runs, on the device of its inputs (compilers.py)
        self.compiler: CompilerChoice | None = None
        self._compile_fn: Callable | None = None
        self.step: list[GraphCall] = []  # this step's graph calls so far, in forward order
        self.last_step: list[GraphCall] = []
        self.backward_seen = False
        self.steps: dict[tuple[GraphUse, ...], list[frozenset[str]]] = {}  # steps planned jointly: saved per call
        self.step_plans: list[Plan] = []  # one per step planned jointly, the latest last
        self._candidates: list[tuple[GraphUse, ...]] = []  # known steps this one may still turn out to be
        self._produced: set[int] = set()  # storages the step's calls returned (later calls' inputs)
        self._read: set[int] = set()  # input storages counted this step
        self._param_bytes: dict[int, tuple[weakref.ref, tuple[int, int, int]]] = {}
        self._request: tuple[GraphUse, frozenset[str] | None] | None = None  # what the compile under way applies
        self._applied: frozenset[str] = frozenset()
        self._uses = 0
        self._dev: DeviceSpec | None = self.device
        self.verified: set[tuple[GraphUse, ...]] = set()  # planned steps a real run measured within the budget
        self._window: StepWindow | None = None  # measuring the step under way
        self._where: torch.device | None = None  # the device the step's tensors are on
        self._said_unverified = False
        self._refusal: BudgetError | None = None  # a planned step measured over the budget and not re-planned

    def run(self, use: GraphUse, args: tuple) -> Any:
        """One call of a compiled graph: place it in its step, compile it if needed, check it, run it."""
        if self._window is not None and self._window.pending and not in_backward():
            window, self._window = self._window, None
            window.finish()  # the step just measured (CPU): checked before the next one starts
        if use.inference or not torch.is_grad_enabled():
            return self._compiled(use, None, args)[0](*args)
        if self.backward_seen:
            self._end_step()
        if self._refusal is not None:
            raise self._refusal
        if not self.step:
            self._open_window()
        call = GraphCall(use, self._planned(use))
        self.step.append(call)
        self._note_inputs(call, args)
        refused: BudgetError | None = None
        while True:
            try:
                fn, call.saved = self._compiled(use, call.saved, args)
                if use.inference:  # no input needs a gradient: no backward, nothing held
                    self.step.pop()
                elif not self._candidates:  # a step not planned before must fit as it goes
                    self._check_step()
                break
            except BudgetError as e:
                if refused is None and self._eager_instead():
                    refused, call.saved = e, None  # this call again, compiled by eager at its frugal plan
                    continue
                self._new_step()
                if refused is not None:  # back to Inductor: it was the choice, and eager does not fit either
                    self._compile_fn = aot_backend(self, compiler="inductor")
                    raise neither_fits(refused, e) from None
                raise
        if refused is not None:
            self.compiler = fits_without_inductor(refused)
        out = fn(*args)
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._produced.add(storage_key(t)[0])
                if t.grad_fn is not None:  # the step's forward ends when a backward reaches an output
                    t.register_hook(self._saw_backward)
        return out

    def _saw_backward(self, grad: torch.Tensor) -> None:
        self.backward_seen = True
        if self._window is not None:
            self._window.close_after_backward()

    def _open_window(self) -> None:
        """A planned step not yet measured is about to run: measure it to the end of its backward."""
        if self._window is not None:  # the last one never finished a backward
            self._window.cancel()
            self._window = None
        if not [s for s in self.steps if s not in self.verified] or self._where is None:
            return
        params = [p for ref, _ in self._param_bytes.values() if (p := ref()) is not None]
        try:
            if self._where.type == "cpu" and _ranks() > 1:  # the ranks would have to agree on re-planning (not built)
                raise RuntimeError("under torch.distributed the ranks' CPU measurements are not agreed on")
            self._window = StepWindow(self._where, params, self._check_measured)
        except (RuntimeError, ValueError) as e:  # the user's own profiler is running, or not cpu / cuda
            if not self._said_unverified:
                self._said_unverified = True
                log.info("autoremat: a planned step of the torch.compile backend is not measured (%s); "
                         "autoremat.optimize measures a step itself", e)

    def _check_measured(self, activations: int) -> None:
        """The end of a measured backward (`activations`: its measured peak above the fixed bytes): the
        step fits, or is planned again with the gap reserved, or the next step is refused."""
        self._window = None
        calls, key = self.step, tuple(c.use for c in self.step)
        if key not in self.steps:
            return  # not a planned step (its first run, at frugal plans, was checked call by call)
        ledger, limit = self._ledger(calls), budget_or_memory(self.budget, self._dev)
        if ledger.step_peak(activations) <= limit:
            self.verified.add(key)
            return
        predicted = self._need(calls, self.steps[key])[2].peak
        gap = activations - predicted
        log.warning("autoremat: a planned step measured %s over its prediction (memory outside the graphs, or "
                    "scratch the model did not see); planning it again with that reserved", format_bytes(gap))
        ledger.inputs += gap
        try:
            self.steps[key], plan = self._solve(calls, ledger)
        except BudgetError as e:
            self._refusal = BudgetError(
                f"budget {format_bytes(limit)} ({limit} bytes) was not met on a real step: it measured "
                f"{format_bytes(ledger.fixed - gap + activations)} against a prediction of "
                f"{format_bytes(ledger.fixed - gap + predicted)}, and with the difference reserved no plan fits "
                f"({str(e).splitlines()[0]})", e.ledger, e.smallest_budget, measured=True, at_peak=e.at_peak)
            return
        plan.notes.append(f"re-planned after a real step measured {gap} B over the prediction")
        self.step_plans.append(plan)

    def _planned(self, use: GraphUse) -> frozenset[str] | None:
        at = len(self.step)
        self._candidates = [s for s in self._candidates if len(s) > at and s[at] is use]
        # The plan made knowing the most calls after this one is safe for all of them.
        return self.steps[max(self._candidates, key=len)][at] if self._candidates else None

    def _note_inputs(self, call: GraphCall, args: tuple) -> None:
        """The call's parameters (leaves that get a .grad), and the inputs no earlier call produced."""
        if self._dev is None:
            where = next((a.device.type for a in args if isinstance(a, torch.Tensor)), "cpu")
            self._dev = get_device("cpu" if where == "meta" else where)
        g = self._dev.alloc_granularity
        for a in args:
            if not isinstance(a, torch.Tensor):
                continue
            self._where = self._where or a.device
            if isinstance(a, torch.nn.Parameter) or (a.is_leaf and a.requires_grad):
                kept = self._param_bytes.get(id(a))
                if kept is None or kept[0]() is not a:
                    kept = self._param_bytes[id(a)] = (weakref.ref(a), parameter_bytes(a, self.optimizer, g))
                call.params[id(a)] = kept[1]
                continue
            key, nbytes = storage_key(a)
            if key not in self._produced and key not in self._read:
                self._read.add(key)
                call.inputs += -(-nbytes // g) * g

    def _compiled(self, use: GraphUse, saved: frozenset[str] | None, args: tuple) -> tuple[Callable, frozenset[str]]:
        """The compiled step for `saved` (None: frugal) and the saved set it really uses; compiles on a miss."""
        if saved not in use.compiled:
            if self._window is not None:  # compiling allocates, and calibration runs a profiler of its own:
                self._window.cancel()     # this run says nothing about the plan; the next one is measured
                self._window = None
            self._request, count = (use, saved), len(self.profiles)
            try:
                fn = self._backend(args)(use.gm, list(args))  # real inputs: static shapes
            finally:
                self._request = None
            use.inference = len(self.profiles) == count  # AOTAutograd found no backward to partition
            use.compiled[saved] = (fn, frozenset() if use.inference else self._applied)
        return use.compiled[saved]

    def _backend(self, args: tuple) -> Callable:
        """AOTAutograd with the compiler chosen for this planner (once, at its first graph)."""
        if self._compile_fn is None:
            where = self._where or next((a.device for a in args if isinstance(a, torch.Tensor)), torch.device("cpu"))
            self.compiler = choose_compiler(self.compiler_requested, where)
            self._compile_fn = aot_backend(self, compiler=self.compiler.used)
        return self._compile_fn

    def _eager_instead(self) -> bool:
        """compiler="auto" chose Inductor and a call does not fit: compile with eager from now on, which can save
        what Inductor fuses (compilers.run_with_fallback does the same for optimize). Every graph compiles again
        at its next call and its steps are learnt again; the calls of this step already run keep what they hold."""
        if self.compiler is None or self.compiler.requested != "auto" or self.compiler.used != "inductor":
            return False
        self._compile_fn = aot_backend(self, compiler="eager")
        for c in self.step[:-1]:  # they ran, and hold what they saved, as Inductor's plans
            c.gp = c.use.gp
        for use in {c.use for c in (*self.step, *self.last_step)} | {u for key in self.steps for u in key}:
            use.compiled.clear()
            use.stale = True
        self.steps.clear()
        self.verified.clear()
        self._candidates = []
        return True

    def _new_step(self) -> None:
        self.step, self.backward_seen, self._candidates = [], False, list(self.steps)
        self._produced.clear()
        self._read.clear()

    def _end_step(self) -> None:
        """The step just finished is known now: plan its calls jointly, once; they compile again when next run."""
        calls = self.last_step = self.step
        self._new_step()
        key = tuple(c.use for c in calls)
        if not calls or key in self.steps or any(c.use.stale or c.gp is not None for c in calls):
            return  # a step that ran partly under another compiler (_eager_instead) is learnt again
        try:
            saved, plan = self._solve(calls, self._ledger(calls))
        except BudgetError:  # the solver found no plan it trusts; the plans that just ran fit
            saved = [c.saved for c in calls]
            plan = self._plan_of(calls, saved, "as first run")
        plan.notes.append(f"one step: {len(calls)} call(s) of {len(set(key))} compiled graph(s), planned jointly")
        self.steps[key] = saved
        self._candidates = list(self.steps)
        self.step_plans.append(plan)
        log.info("autoremat planned a step of %d graph call(s) jointly: %s", len(calls), plan.summary().splitlines()[1])

    def _solve(self, calls: list[GraphCall], ledger: Ledger) -> tuple[list[frozenset[str]], Plan]:
        """The calls of one step planned jointly under what `ledger` leaves: saved sets and the plan."""
        profiles = [c.use.gp for c in calls]
        decision = plan_graphs(profiles, self.budget, ledger, self._dev, self.options)
        return [frozenset(s) for s in decision.saved], build_plan(profiles, decision, ledger, self.budget or 0,
                                                                  self._dev.name)

    def _check_step(self) -> None:
        """The step so far, each call with the plan it runs, must fit; else a BudgetError before the call runs."""
        calls = self.step
        limit = budget_or_memory(self.budget, self._dev)
        if self._need(calls, [c.saved for c in calls])[0] <= limit:
            return
        smallest, ledger, tl = self._need(calls, [c.use.first for c in calls], current=True)
        ledger.activations, ledger.budget = tl.peak, limit
        gp = calls[-1].use.gp
        held = ""
        if len(calls) > 1:
            boundary = self._need(calls[:-1], [c.saved for c in calls[:-1]])[2].boundary
            held = (f"the {len(calls) - 1} earlier call(s) of the step hold {format_bytes(boundary)} of saved values "
                    "and outputs while it runs, and ")
        raise BudgetError(
            f"budget {format_bytes(limit)} ({limit} bytes) is too small for call {len(calls)} of this training step "
            f"(compiled graph {calls[-1].use.number}, {gp.fingerprint}, {len(gp.nodes)} nodes): {held}the "
            f"parameters, gradients, optimizer state and inputs of the graphs seen so far take "
            f"{format_bytes(ledger.fixed)}. The smallest budget that fits the step so far is {format_bytes(smallest)} "
            f"({smallest} bytes), every call at its most frugal plan; graphs still to come may need more."
            f"\n{ledger.format()}", ledger, smallest)

    def _need(self, calls: list[GraphCall], saved: list, current: bool = False) -> tuple[int, Ledger, Any]:
        """What the calls need together with these saved sets: (fixed + simulated peak + slack, ledger, timeline).
        The saved sets are those the calls ran with (on the profiles they were planned on), or with `current`
        their uses' own (`GraphUse.first`, on the uses' latest profiles)."""
        ledger = self._ledger(calls)
        profiles = [c.use.gp if current or c.gp is None else c.gp for c in calls]
        _, tl, _ = evaluate(profiles, [set(s) for s in saved], self._dev.alloc_granularity)
        return ledger.needs(tl.peak), ledger, tl

    def _ledger(self, calls: list[GraphCall]) -> Ledger:
        params = {k: v for c in calls for k, v in c.params.items()}  # a parameter read twice is held once
        parameters, gradients, state = (sum(p[i] for p in params.values()) for i in range(3))
        # cuBLAS's workspaces, on a GPU: held by the step's threads outside any graph (devices.blas_workspace_bytes)
        workspaces = blas_workspace_bytes(self._dev, self._where.type) if self._dev and self._where else 0
        return Ledger(parameters=parameters, gradients=gradients, optimizer_state=state,
                      inputs=sum(c.inputs for c in calls), workspaces=workspaces)

    def _plan_of(self, calls: list[GraphCall], saved: list, path: PlanPath) -> Plan:
        profiles, g = [c.gp or c.use.gp for c in calls], self._dev.alloc_granularity
        schedules, tl, cost = evaluate(profiles, [set(s) for s in saved], g)
        decision = Decision([set(s) for s in saved], schedules, tl, cost, "fits", path, granularity=g)
        return build_plan(profiles, decision, self._ledger(calls), self.budget or 0, self._dev.name)

    def __call__(self, cg: CapturedGraph) -> tuple[fx.GraphModule, fx.GraphModule]:
        """AOTAutograd's partition callback, during `_compiled`: apply what `_request` asks for."""
        use, asked = self._request
        self._dev = self._dev or self._device(cg)
        gp = self._profile(cg)
        if use.gp is None or use.stale:
            use.frugal, use.stale = self._frugal(gp), False
        use.gp = gp

        def need(fallback: set[str]) -> tuple[int, Ledger]:
            self._candidates = []  # the plan changed: check the rest of this step as it runs
            return self._need(self.step, [c.saved for c in self.step[:-1]] + [fallback])[:2]

        saved = set(use.frugal if asked is None else asked)
        modules, applied = self._split(cg, gp, saved, need, budget_or_memory(self.budget, self._dev))
        self._applied = frozenset(applied)
        self.plans.append(self._plan_of(self.step[-1:], [applied], PlanPath(Route.FRUGAL if asked is None else Route.JOINT)))
        return modules

    def _frugal(self, gp: GraphProfile) -> frozenset[str]:
        """What a call saves until its step is known: of the smallest-peak plan and the checkpoint plan (save
        only outputs and what may not be recomputed), the one whose boundary (what later calls see held) plus
        own peak is least."""
        g = self._dev.alloc_granularity
        smallest = smallest_peak([gp], granularity=g, options=self.options.solving())
        best, cost = save_all([gp])[0], None
        for saved in ([smallest.saved[0]] if smallest else []) + checkpoint_blocks([gp]):
            try:
                tl = evaluate([gp], [saved], g)[1]
            except ValueError:  # a value the backward needs that nobody may recompute
                continue
            if cost is None or tl.boundary + tl.peak < cost:
                best, cost = saved, tl.boundary + tl.peak
        return frozenset(best)

    @property
    def smallest_budget(self) -> int | None:
        """The least budget the latest step fits in as an unknown step first runs (each call at its frugal
        plan): below it the backend raises BudgetError. None before any step."""
        calls = [c for c in self.step or self.last_step if c.use.gp is not None]
        return self._need(calls, [c.use.first for c in calls], current=True)[0] if calls else None

    @property
    def combined_plan(self) -> Plan | None:
        """The latest step planned jointly; before one is complete, the first step as it runs."""
        if self.step_plans:
            return self.step_plans[-1]
        calls = [c for c in self.step if c.use.gp is not None]
        return self._plan_of(calls, [c.saved for c in calls], "as first run") if calls else None


def _ranks() -> int:
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
