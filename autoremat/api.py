"""The Python face: `autoremat.optimize(model, budget=..., example_inputs=...)`.

    opt_model = autoremat.optimize(model, budget="2GB", example_inputs=(x,), optimizer="adamw")
    loss = opt_model(x).sum(); loss.backward()      # the user's loop, unchanged
    print(opt_model.plan.summary())

Planning happens here, once, by running the forward on the example inputs: AOTAutograd hands each
joint graph to the planner. If the model has graph breaks, the graphs are then planned again
together (they share the budget) and the model is compiled once more with the joint plan.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx

from autoremat.backend import PlanMismatch, Planner, plan_graphs
from autoremat.cache import PlanCache, precision_mode
from autoremat.capture import CapturedGraph, aot_backend, compile_fresh
from autoremat.devices import DeviceSpec, get_device
from autoremat.heuristics import evaluate
from autoremat.ledger import Ledger, ledger_for_model
from autoremat.plan import SLACK, BudgetError, Plan, build_plan
from autoremat.profile import fingerprint
from autoremat.units import parse_budget

log = logging.getLogger("autoremat")


class RematModule(torch.nn.Module):
    """`model` compiled with its plan. Parameters, buffers and state_dict are the model's own."""

    def __init__(self, model: torch.nn.Module, compiled: Any, plan: Plan, planner: Planner) -> None:
        super().__init__()
        self.model = model
        self.plan = plan
        self._compiled = compiled
        self._planner = planner

    @property
    def num_graphs(self) -> int:
        return len(self.plan.graphs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return self.model(*args, **kwargs)  # no backward, nothing to plan: run eagerly
        with _own_errors():
            return self._compiled(*args, **kwargs)  # a new input shape traces and plans here


@contextlib.contextmanager
def _own_errors():
    """Our errors (BudgetError, PlanMismatch) raised inside a backend reach the user unwrapped."""
    try:
        yield
    except torch._dynamo.exc.BackendCompilerFailed as e:
        inner = getattr(e, "inner_exception", None)
        if isinstance(inner, (BudgetError, PlanMismatch)):
            raise inner from None
        raise


class _StaleCache(PlanMismatch):
    """A cached plan that does not apply to the graph being traced: plan afresh."""


class _Planner(Planner):
    """`optimize`'s planner: the plan cache in front of the solver, and forgiving once planning is done.

    lookup(fingerprint) -> Plan | None is asked when the first graph arrives (fingerprints exist only
    after tracing). Once `optimize` has returned (`strict = False`), a graph that no plan was made
    for (a new input shape, eval mode) is planned on its own instead of raising PlanMismatch, and a
    graph identical to one already planned (a recompile caused by a guard on Python state) reuses
    that plan instead of solving again.
    """

    def __init__(self, *args: Any, lookup: Callable[[str], Plan | None] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.lookup = lookup
        self.cached: Plan | None = None
        self.strict = True

    def __call__(self, cg: CapturedGraph) -> tuple[fx.GraphModule, fx.GraphModule]:
        fp = fingerprint(cg.joint)
        if self.plan is None and self.lookup is not None and not self.profiles:
            self.plan = self.cached = self.lookup(fp)
        if self.cached is not None and self.plan is self.cached:
            try:
                return super().__call__(cg)
            except Exception as e:  # a cache entry is never trusted: any failure means plan afresh
                raise _StaleCache(f"cached plan does not apply: {type(e).__name__}: {e}") from None
        known = [g.fingerprint for p in ([self.plan] if self.plan else []) + self.plans for g in p.graphs]
        if not self.strict and fp not in known and self.plan is not None:
            log.warning("autoremat: graph %s is new (input shapes or mode changed): planning it on its own", fp)
            return self._with_plan(None, cg)
        if self.plan is None and fp in known:
            log.warning("autoremat: the model recompiled to a graph already planned (dynamo guards on Python "
                        "state, e.g. a mutated global); reusing its plan. After torch._dynamo.config."
                        "recompile_limit recompiles dynamo runs the model eagerly, without a plan.")
            return self._with_plan(next(p for p in self.plans if fp in {g.fingerprint for g in p.graphs}), cg)
        return super().__call__(cg)

    def _with_plan(self, plan: Plan | None, cg: CapturedGraph) -> tuple[fx.GraphModule, fx.GraphModule]:
        kept, self.plan = self.plan, plan
        try:
            return super().__call__(cg)
        finally:
            self.plan = kept


def _split_inputs(example_inputs: Any) -> tuple[tuple, dict]:
    if isinstance(example_inputs, dict):
        return (), dict(example_inputs)
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,), {}
    if isinstance(example_inputs, (tuple, list)):
        return tuple(example_inputs), {}
    raise TypeError(
        f"example_inputs must be a tensor, a tuple/list of positional arguments or a dict of keyword "
        f"arguments, got {type(example_inputs).__name__}"
    )


def _describe(args: tuple, kwargs: dict) -> str:
    def one(a: Any) -> str:
        return f"Tensor{list(a.shape)}" if isinstance(a, torch.Tensor) else type(a).__name__

    return ", ".join([one(a) for a in args] + [f"{k}={one(v)}" for k, v in kwargs.items()])


def _check_signature(model: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    """Wrong arguments fail here, in one line, rather than deep inside dynamo."""
    try:
        sig = inspect.signature(model.forward).replace(return_annotation=inspect.Signature.empty)
    except (TypeError, ValueError):  # no Python signature to check against
        return
    try:
        sig.bind(*args, **kwargs)
    except TypeError as e:
        raise TypeError(f"example_inputs do not fit the model: {type(model).__name__}.forward{sig} cannot take "
                        f"({_describe(args, kwargs)}): {e}") from None


def _check_options(time_limit: float, gap: float, solver: str) -> None:
    if isinstance(time_limit, bool) or not isinstance(time_limit, (int, float)) or not time_limit > 0 \
            or not math.isfinite(time_limit):
        raise ValueError(f"time_limit must be a positive number of seconds, got {time_limit!r}")
    if isinstance(gap, bool) or not isinstance(gap, (int, float)) or not 0 <= gap < 1:
        raise ValueError(f"gap must be a relative optimality gap in [0, 1), got {gap!r}")
    if solver not in ("auto", "cbc", "highs"):
        raise ValueError(f"solver must be 'auto', 'cbc' or 'highs', got {solver!r}")


def _original_error(e: BaseException) -> BaseException | None:
    """The user-level exception dynamo wrapped (e.g. a shape mismatch in a matmul), if any."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if not type(e).__module__.startswith("torch._dynamo"):
            return e
        e = e.__cause__ or e.__context__
    return None


class _DropFakeTensorLog(logging.Filter):
    """Fake-tensor propagation logs a full traceback before re-raising; we report the error ourselves."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("failed while attempting to run meta")


@contextlib.contextmanager
def _inputs_must_fit(model: torch.nn.Module, args: tuple, kwargs: dict):
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    quiet = _DropFakeTensorLog()
    logger.addFilter(quiet)
    try:
        yield
    except torch._dynamo.exc.TorchRuntimeError as e:
        cause = _original_error(e)
        why = f"{type(cause).__name__}: {cause}" if cause else str(e).splitlines()[0]
        if cause is None:
            m = re.search(r"got (\w+)\('(.*?)'\)", str(e))
            why = f"{m.group(1)}: {m.group(2)}" if m else why
        raise ValueError(f"example_inputs do not fit the model: {type(model).__name__} cannot run on "
                         f"({_describe(args, kwargs)}): {why}") from None
    finally:
        logger.removeFilter(quiet)


def _model_device(model: torch.nn.Module, args: tuple, kwargs: dict) -> torch.device:
    for t in [*model.parameters(), *torch.utils._pytree.tree_leaves((args, kwargs))]:
        if isinstance(t, torch.Tensor):
            return t.device
    return torch.device("cpu")


def optimize(
    model: torch.nn.Module,
    budget: int | str,
    example_inputs: Any,
    *,
    optimizer: Any = "adamw",
    device: DeviceSpec | str | None = None,
    plan: Plan | None = None,
    solver: str = "auto",
    time_limit: float = 10.0,
    gap: float = 0.01,
    compiler: str = "eager",
    verify: bool = True,
    world_size: int = 1,
    sharding: str = "none",
    cache: bool | str | Path = False,
) -> RematModule:
    """Plan `model`'s training step to fit `budget` and return a module that runs that plan.

    budget: bytes for the whole step on the device: parameters, gradients, optimizer state,
        inputs, activations and temporaries. An int, or a string such as "20GB" or "20GiB".
    example_inputs: a tensor, a tuple of positional arguments, or a dict of keyword arguments,
        shaped like a real micro-batch (plans are made for these shapes; a new shape seen later
        is planned once more, on its own).
    optimizer: a torch.optim.Optimizer, or a name ("adamw", "adam", "sgd", "sgd_momentum",
        "adafactor", "adam8bit", ...) or None, to size its state.
    device: a name from `autoremat.devices.known_devices()` for the roofline; by default the
        model's device.
    plan: a Plan (e.g. `Plan.load("plan.json")`) to re-apply instead of solving.
    solver, time_limit, gap: the ILP solver ("auto", "cbc", "highs"), its time limit in seconds per
        solve and its relative optimality gap. At the time limit the best plan found so far is used
        (plan.solver["status"] == "time_limit"); with none, a greedy or smallest-peak plan.
    compiler: "eager" (FX graphs run as Python) or "inductor".
    verify: run one real step at planning time (state restored afterwards) and re-plan once if
        the measured peak is above the prediction. Skipped on the meta device.
    cache: False, True (plans kept in $AUTOREMAT_CACHE_DIR or ~/.cache/autoremat) or a directory:
        a second optimize of the same step under the same options reuses the plan, re-checked by
        the simulator, without solving (plan.solver["path"] == "cache").

    Raises `BudgetError` (with the ledger and the smallest budget that fits) if nothing fits, and
    TypeError / ValueError when example_inputs do not fit the model or an option is malformed.
    """
    budget_bytes = parse_budget(budget)
    _check_options(time_limit, gap, solver)
    args, kwargs = _split_inputs(example_inputs)
    _check_signature(model, args, kwargs)
    where = _model_device(model, args, kwargs)
    dev = get_device(device if device is not None else where)
    ledger = ledger_for_model(model, optimizer, inputs=(args, kwargs), world_size=world_size, sharding=sharding,
                              device_granularity=dev.alloc_granularity)
    opts = {"solver": solver, "time_limit": time_limit, "gap": gap}
    store = PlanCache.open(cache) if plan is None else None
    fields = {"budget": budget_bytes, "ledger": ledger.to_dict(), "device": dev.name, "where": str(where),
              "precision": precision_mode(str(where)), "verify": verify and where.type != "meta",
              "compiler": compiler, **opts}

    def make(lookup: Callable | None = None, applying: Plan | None = None) -> _Planner:
        return _Planner(budget_bytes, optimizer=optimizer, device=dev, ledger=ledger, plan=applying, lookup=lookup,
                        **opts)

    key: list[str] = []
    lookup = None
    if store is not None:
        def lookup(fp: str) -> Plan | None:
            key.append(store.key(fp, fields))
            return store.load(key[-1])

    planner = make(lookup, plan)
    try:
        compiled = _compile_and_trace(model, planner, compiler, args, kwargs)
    except _StaleCache as e:
        log.warning("autoremat: ignoring cached plan %s (%s)", store.path(key[-1]), e)
        store.discard(key[-1])
        planner = make()
        compiled = _compile_and_trace(model, planner, compiler, args, kwargs)
    if planner.cached is not None:
        hit = _check_cached(planner, budget_bytes, ledger, dev)
        if hit is not None:
            hit.notes.append(f"plan loaded from the cache ({store.path(key[-1])}); re-simulated, not solved")
            planner.strict = False
            return RematModule(model, compiled, hit, planner)
        log.warning("autoremat: cached plan %s no longer fits; planning again", store.path(key[-1]))
        store.discard(key[-1])
        planner = make()
        compiled = _compile_and_trace(model, planner, compiler, args, kwargs)
    if plan is None:
        plan = planner.combined_plan
        if len(planner.profiles) > 1:
            plan, compiled, planner = _replan_jointly(model, planner, budget_bytes, ledger, dev, compiler, args,
                                                      kwargs, opts)
        if verify and where.type != "meta":
            plan, compiled, planner = _verify(model, compiled, plan, planner, budget_bytes, ledger, dev, compiler,
                                              args, kwargs, opts, where)
        elif where.type == "meta":
            plan.notes.append("planned on the meta device: no real step was run to verify the prediction")
        plan.notes.append(f"{len(planner.profiles)} graph(s) captured")
        if store is not None and key:
            store.store(key[0], plan, fields)
    else:
        plan.notes.append(f"{len(planner.profiles)} graph(s) captured")
    planner.strict = False
    return RematModule(model, compiled, plan, planner)


def _check_cached(planner: _Planner, budget: int, ledger: Ledger, dev: DeviceSpec) -> Plan | None:
    """Re-simulate a cached plan on the graphs just traced; return it only if it is what it claims."""
    cached, profiles = planner.cached, planner.profiles
    if [g.fingerprint for g in cached.graphs] != [p.fingerprint for p in profiles] or cached.budget != budget:
        return None
    try:
        _, tl, cost = evaluate(profiles, [set(g.saved) for g in cached.graphs], dev.alloc_granularity)
    except Exception:  # names that are not in the graph, a value nobody may recompute
        return None
    if ledger.fixed + tl.peak + SLACK > budget:
        return None
    plan = Plan.from_dict(cached.to_dict())  # a copy: the caller may append notes
    plan.solver = {**plan.solver, "path": "cache", "solved_by": cached.solver.get("path"), "solve_time_s": 0.0}
    plan.activation_peak, plan.predicted_peak, plan.recompute_time_s = tl.peak, ledger.fixed + tl.peak, cost
    return plan


class _Restore:
    """Leave no trace of a planning step: buffers (BatchNorm stats), gradients and RNG as they were."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def __enter__(self) -> None:
        self.buffers = [b.detach().clone() for b in self.model.buffers()]
        self.grads = [p.grad for p in self.model.parameters()]
        self.rng = torch.get_rng_state()
        self.cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None

    def __exit__(self, *exc: object) -> None:
        with torch.no_grad():
            for b, saved in zip(self.model.buffers(), self.buffers):
                b.copy_(saved)
        for p, g in zip(self.model.parameters(), self.grads):
            p.grad = g
        torch.set_rng_state(self.rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)


def _loss(out: Any) -> torch.Tensor:
    """Something to call backward on: the output if scalar, else the sum of every float output."""
    leaves = [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
    if len(leaves) == 1 and leaves[0].numel() == 1:
        return leaves[0]
    if hasattr(out, "get") and isinstance(out.get("loss"), torch.Tensor):
        return out["loss"]
    return sum(t.float().sum() for t in leaves)


def _verify(model, compiled, plan, planner, budget, ledger, dev, compiler, args, kwargs, opts, where):
    """Run one real step and compare its peak with the prediction; re-plan once if the model missed.

    The memory model is exact for the kernels it knows; a kernel with unmeasured scratch would let
    the real peak pass the budget. The measured gap is reserved and the graphs are planned again.
    """
    from autoremat.measure import measure_peak  # a measuring tool, not a pipeline stage

    def step() -> None:
        _loss(compiled(*args, **kwargs)).backward()

    traced = len(planner.profiles)
    with _Restore(model):
        for p in model.parameters():
            p.grad = None
        _, m = measure_peak(step, device=where, baseline_bytes=0)
    if len(planner.profiles) != traced:
        # The step compiled again (dynamo guards on Python state the forward changes, e.g. a global
        # counter): the measurement includes tracing and says nothing about the plan.
        plan.notes.append("the model recompiled on its second call (it changes Python state that dynamo guards "
                          "on, e.g. a global); not verified, and later calls recompile too")
        return plan, compiled, planner
    measured = m.delta_peak_bytes if where.type == "cpu" else m.peak_bytes - m.baseline_bytes
    gap = measured - plan.activation_peak
    plan.notes.append(f"verified on one real step: measured activation peak {measured} B, predicted "
                      f"{plan.activation_peak} B")
    if ledger.fixed + measured <= budget or len(planner.profiles) != 1:
        return plan, compiled, planner  # the real step fits
    profiles = planner.profiles
    tighter = dict(ledger.to_dict(), notes=[*ledger.notes, f"{gap} B reserved for scratch the model did not see"])
    reserve = Ledger.from_dict(tighter)
    reserve.inputs += gap
    decision = plan_graphs(profiles, budget, reserve, dev, **opts)
    new = build_plan(profiles, decision, ledger, budget, dev.name)
    new.notes += plan.notes + [f"re-planned with {gap} B reserved for scratch the memory model missed"]
    applier = _Planner(budget, device=dev, ledger=ledger, plan=new, **opts)
    return new, _compile_and_trace(model, applier, compiler, args, kwargs), applier


def _compile_and_trace(model, planner: Planner, compiler: str, args: tuple, kwargs: dict) -> Any:
    compiled = compile_fresh(model, aot_backend(planner, compiler=compiler))
    with _own_errors(), _Restore(model), torch.enable_grad(), _inputs_must_fit(model, args, kwargs):
        out = compiled(*args, **kwargs)  # tracing plans every graph; the outputs are not needed
    del out
    _reshard(model)
    return compiled


def _reshard(model: torch.nn.Module) -> None:
    """A forward with no backward leaves FSDP2's gathered parameters in place; put the shards back."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch built without distributed
        return
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def _replan_jointly(model, planner, budget, ledger: Ledger, dev, compiler, args, kwargs, opts):
    """Graph breaks: the graphs share one step, so plan them together and compile again."""
    profiles = planner.profiles
    decision = plan_graphs(profiles, budget, ledger, dev, **opts)
    plan = build_plan(profiles, decision, ledger, budget, dev.name)
    plan.notes.append(f"the model has graph breaks: {len(profiles)} graphs were planned jointly")
    log.warning("autoremat: %d graphs (graph breaks); planned jointly under one budget", len(profiles))
    applier = _Planner(budget, device=dev, ledger=ledger, plan=plan, **opts)
    compiled = _compile_and_trace(model, applier, compiler, args, kwargs)
    return plan, compiled, applier
