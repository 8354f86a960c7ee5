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
import functools
import inspect
import logging
import math
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx

from autoremat import mixed
from autoremat.backend import PlanMismatch, Planner, plan_graphs
from autoremat.cache import PlanCache, precision_mode
from autoremat.capture import CapturedGraph, aot_backend, compile_fresh, default_split
from autoremat.devices import DeviceSpec, get_device
from autoremat.heuristics import evaluate
from autoremat.ledger import Ledger, ledger_for_model
from autoremat.plan import SLACK, BudgetError, Plan, build_plan
from autoremat.precision import FP32_KEPT
from autoremat.profile import fingerprint
from autoremat.solver import DEFAULT_GAP
from autoremat.units import format_bytes, parse_budget

log = logging.getLogger("autoremat")
# One short phrase per planning stage, at INFO: `logging.basicConfig(level=logging.INFO)` shows them,
# and the CLI's spinner does (planning a large model takes seconds to minutes).
progress = logging.getLogger("autoremat.progress")


class RematModule(torch.nn.Module):
    """`model` compiled with its plan. Parameters, buffers and state_dict are the model's own.

    Plans are per input shape: a call with inputs of a shape (or dtype, or training mode) not seen
    before goes through the whole pipeline again for that shape (trace, plan every graph jointly,
    verify on one real step) before it runs, so a smaller last batch is held to the budget too.
    `plans` lists them; `plan` is the one made for the example inputs.
    """

    def __init__(self, model: torch.nn.Module, compiled: Any, plan: Plan, planner: Planner,
                 key: tuple | None = None, plan_shape: Callable[[tuple, dict], tuple] | None = None) -> None:
        super().__init__()
        self.model = model
        self.plan = plan
        self._compiled = compiled
        self._planner = planner
        self._plan_shape = plan_shape
        self._shapes: dict[tuple, tuple[Plan, Any, Planner]] = {}
        if key is not None:
            self._shapes[key] = (plan, compiled, planner)

    @property
    def num_graphs(self) -> int:
        return len(self.plan.graphs)

    @property
    def plans(self) -> list[Plan]:
        """One plan per input shape planned so far, the example inputs' first."""
        return [p for p, _, _ in self._shapes.values()] or [self.plan]

    @property
    def _planners(self) -> list[Planner]:
        return [planner for _, _, planner in self._shapes.values()] or [self._planner]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return self.model(*args, **kwargs)  # no backward, nothing to plan: run eagerly
        compiled = self._compiled
        if self._plan_shape is not None:
            key = input_key(self.model, args, kwargs)
            if key not in self._shapes:
                self._shapes[key] = self._new_shape(args, kwargs)
            compiled = self._shapes[key][1]
        with _own_errors():
            return compiled(*args, **kwargs)

    def _new_shape(self, args: tuple, kwargs: dict) -> tuple[Plan, Any, Planner]:
        limit = torch._dynamo.config.recompile_limit
        if len(self._shapes) == limit:
            log.warning("autoremat: %d input shapes planned so far; each new one is traced, planned and verified "
                        "afresh (seconds each). Pad inputs to a few fixed shapes (bucketing) to avoid it.", limit)
        log.warning("autoremat: new input shape (%s): planning it under the same budget", _describe(args, kwargs))
        with _own_errors():
            plan, compiled, planner = self._plan_shape(args, kwargs)
        planner.strict = False
        plan.notes.append(f"planned for a new input shape: {_describe(args, kwargs)}")
        return plan, compiled, planner


def input_key(model: torch.nn.Module, args: tuple, kwargs: dict) -> tuple:
    """What a plan depends on besides the model: input shapes, dtypes, devices, non-tensor values,
    and training mode (dropout and BatchNorm trace differently in eval)."""
    leaves, spec = torch.utils._pytree.tree_flatten((args, kwargs))

    def one(a: Any) -> Any:
        if isinstance(a, torch.Tensor):
            return ("tensor", tuple(a.shape), a.dtype, str(a.device), a.requires_grad)
        try:
            hash(a)
        except TypeError:
            return ("object", type(a).__name__)
        return ("value", a)

    return (str(spec), model.training, *map(one, leaves))


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

    def __init__(self, *args: Any, lookup: Callable[[str], Plan | None] | None = None,
                 pre_pass: Callable | None = None, regions: bool = True, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.pre_pass = pre_pass  # the dtype rewrite of each dynamo graph (precision), or None
        self.regions = regions  # one graph per repeated block (autoremat.regions)
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
        if self.plan is None and self.strict:
            return self._capture(cg)
        known = [g.fingerprint for p in ([self.plan] if self.plan else []) + self.plans for g in p.graphs]
        if not self.strict and fp not in known and self.plan is not None:
            log.warning("autoremat: graph %s is new (input shapes or mode changed): planning it on its own", fp)
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
        self._profile(cg)
        return default_split(cg)

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
    precision: str = "fp32",
    tolerance: float | None = None,
    fp32_ops: Sequence[str] = FP32_KEPT,
    solver: str = "auto",
    time_limit: float = 10.0,
    gap: float = DEFAULT_GAP,
    compiler: str = "eager",
    regions: bool = True,
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
    precision: "fp32" (default), "bf16" or "fp16" (every matmul-class call in that dtype; fp16 only
        where the example batch shows it is safe), or "auto": the ILP picks fp32 / bf16 / fp16 per
        call together with save/recompute. Parameters stay fp32; gradients arrive in fp32. A plan
        with fp16 calls has `plan.needs_grad_scaler`: use `torch.amp.GradScaler`.
    tolerance: for "auto", the most summed per-call relative error (measured on the example batch)
        the plan may spend; default: what autocast's choice (every matmul in bf16) is measured at.
    fp32_ops: the calls kept in fp32 whatever their inputs (default `precision.FP32_KEPT`: norms,
        softmax, exp/log/pow, reductions, losses); a call left out of the list becomes castable.
    solver, time_limit, gap: the ILP solver ("auto", "cbc", "highs"), its time limit in seconds per
        solve and its relative optimality gap. At the time limit the best plan found so far is used
        (plan.solver["status"] == "time_limit"); with none, a greedy or smallest-peak plan.
    compiler: "eager" (FX graphs run as Python) or "inductor".
    regions: compile each repeated block (a transformer layer, a residual stage: module paths such as
        `h.3`) as a graph of its own, so that its parameter gradients reach `.grad` as soon as its
        backward finishes instead of all at the end of one graph (a second set of gradients alive at
        once). False: one graph per dynamo graph.
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
    _check_precision(precision, tolerance, fp32_ops, where)
    fp32_ops = tuple(fp32_ops)
    dev = get_device(device if device is not None else where)

    def ledger_for(args: tuple, kwargs: dict) -> Ledger:
        return ledger_for_model(model, optimizer, inputs=(args, kwargs), world_size=world_size, sharding=sharding,
                                device_granularity=dev.alloc_granularity)

    ledger = ledger_for(args, kwargs)
    opts = {"solver": solver, "time_limit": time_limit, "gap": gap}
    store = PlanCache.open(cache) if plan is None else None
    fields = {"budget": budget_bytes, "ledger": ledger.to_dict(), "device": dev.name, "where": str(where),
              "precision": precision_mode(str(where)), "verify": verify and where.type != "meta",
              "compiler": compiler, "regions": regions, "dtypes": {"mode": precision, "tolerance": tolerance, "fp32_ops": fp32_ops},
              **opts}

    def builder(args: tuple, kwargs: dict, ledger: Ledger) -> Callable:
        return functools.partial(_build, model, ledger=ledger, dev=dev, opts=opts, compiler=compiler, args=args,
                                 kwargs=kwargs, verify=verify, where=where, fp32_ops=fp32_ops,
                                 regions=regions)

    build = builder(args, kwargs, ledger)
    if plan is not None:
        dtypes = plan.precision.get("dtypes") or []
        applier = _Planner(budget_bytes, optimizer=optimizer, device=dev, ledger=ledger, plan=plan,
                           pre_pass=mixed.pre_pass(dtypes, plan.precision.get("fp32_ops", fp32_ops)) if dtypes
                           else None, regions=regions, **opts)
        compiled = _compile_and_trace(model, applier, compiler, args, kwargs)
        _require_graphs(model, applier)
        traced = [p.fingerprint for p in applier.profiles]
        if traced != [g.fingerprint for g in plan.graphs]:  # e.g. one more block: every graph matches, the step not
            raise PlanMismatch(f"the plan was made for {len(plan.graphs)} graph(s), but the model traced to graph(s) "
                               f"{traced}: the model, its input shapes or dtypes, or the torch version differ. Plan "
                               "again instead of re-applying this plan.")
        plan.notes.append(f"{len(applier.profiles)} graph(s) captured")
        plan, planner = plan, applier
    elif precision == "fp32":
        plan, compiled, planner = build(budget_bytes, [], store, fields)
    else:
        plan, compiled, planner = _plan_precision(model, build, precision, tolerance, budget_bytes, ledger, dev,
                                                  opts, args, kwargs, where, fp32_ops, store, fields)
    planner.strict = False
    chosen = plan.precision.get("dtypes") or []

    def plan_shape(new_args: tuple, new_kwargs: dict) -> tuple[Plan, Any, _Planner]:
        """A new input shape: the whole pipeline again, with the dtypes already chosen."""
        return builder(new_args, new_kwargs, ledger_for(new_args, new_kwargs))(budget_bytes, chosen, None, fields)

    return RematModule(model, compiled, plan, planner, key=input_key(model, args, kwargs), plan_shape=plan_shape)


class CaptureError(ValueError):
    """torch.compile captured no graph of the training step, so nothing could be planned."""


def _require_graphs(model: torch.nn.Module, planner: Planner) -> None:
    """A step dynamo ran without any graph would run eagerly, unplanned, past any budget."""
    if planner.profiles:
        return
    reasons = [r.splitlines()[0] for r in torch._dynamo.utils.counters["graph_break"]][-3:]
    raise CaptureError(
        f"torch.compile captured no graph of {type(model).__name__}.forward, so there is nothing to plan and the "
        "budget could not be held: dynamo ran the whole forward eagerly. A graph break inside a loop (e.g. "
        "torch._dynamo.graph_break() or an unsupported call in `for block in self.blocks:`) makes dynamo skip the "
        "frame. Remove the break, or move it out of the loop." + (f" Graph breaks seen: {reasons}" if reasons else ""))


def _build(model, budget: int, dtypes: list[dict[str, str]], store: PlanCache | None, fields: dict, *, ledger, dev,
           opts, compiler, args, kwargs, verify, where, fp32_ops, regions) -> tuple[Plan, Any, _Planner]:
    """Trace the step with `dtypes` applied, plan it under `budget` (cache first), verify it."""
    pre = mixed.pre_pass(dtypes, fp32_ops) if any(dtypes) else None
    key: list[str] = []
    lookup = None
    if store is not None:
        def lookup(fp: str) -> Plan | None:
            key.append(store.key(fp, fields))
            return store.load(key[-1])

    def make(lookup: Callable | None = None) -> _Planner:
        return _Planner(budget, device=dev, ledger=ledger, lookup=lookup, pre_pass=pre, regions=regions, **opts)

    planner = make(lookup)
    progress.info("capturing the training step")
    try:
        compiled = _compile_and_trace(model, planner, compiler, args, kwargs)
    except _StaleCache as e:
        log.warning("autoremat: ignoring cached plan %s (%s)", store.path(key[-1]), e)
        store.discard(key[-1])
        planner = make()
        compiled = _compile_and_trace(model, planner, compiler, args, kwargs)
    _require_graphs(model, planner)
    if planner.cached is not None:
        hit = _check_cached(planner, budget, ledger, dev)
        if hit is not None:
            hit.notes.append(f"plan loaded from the cache ({store.path(key[-1])}); re-simulated, not solved")
            return hit, compiled, planner
        log.warning("autoremat: cached plan %s no longer fits; planning again", store.path(key[-1]))
        store.discard(key[-1])
        planner = make()
        compiled = _compile_and_trace(model, planner, compiler, args, kwargs)
    plan, compiled, planner = _plan_jointly(model, planner, budget, ledger, dev, compiler, args, kwargs, opts)
    if verify and where.type != "meta":
        plan, compiled, planner = _verify(model, compiled, plan, planner, budget, ledger, dev, compiler,
                                          args, kwargs, opts, where)
    elif where.type == "meta":
        plan.notes.append("planned on the meta device: no real step was run to verify the prediction")
    plan.notes.append(f"{len(planner.profiles)} graph(s) captured")
    if dtypes:
        plan.precision = {**plan.precision, "dtypes": dtypes, "fp32_ops": list(fp32_ops)}
        plan.needs_grad_scaler = any(d == "fp16" for pick in dtypes for d in pick.values())
    if store is not None and key:
        store.store(key[0], plan, fields)
    return plan, compiled, planner


def _check_precision(precision: str, tolerance: float | None, fp32_ops: Any, where: torch.device) -> None:
    if precision not in mixed.MODES:
        raise ValueError(f"precision must be one of {', '.join(mixed.MODES)}, got {precision!r}")
    if tolerance is not None and (isinstance(tolerance, bool) or not isinstance(tolerance, (int, float))
                                  or not math.isfinite(tolerance) or tolerance < 0):
        raise ValueError(f"tolerance must be a finite number >= 0 (a summed relative error), got {tolerance!r}")
    if isinstance(fp32_ops, str) or not all(isinstance(o, str) for o in fp32_ops):
        raise TypeError(f"fp32_ops must be a list of call names such as {list(FP32_KEPT[:3])}, got {fp32_ops!r}")
    if precision in ("auto", "fp16") and where.type == "meta":
        raise ValueError(f"precision={precision!r} measures value ranges and errors on the example batch, which "
                         "meta tensors do not have: give real example inputs, or use precision='bf16' on meta")


def _plan_precision(model, build, mode, tolerance, budget, ledger, dev, opts, args, kwargs, where, fp32_ops,
                    store, fields):
    """precision="bf16" | "fp16" | "auto": choose dtypes, then plan the step traced with them.

    "auto" first plans in fp32 (the fallback, and the memory the mixed plan must not exceed), then
    solves the joint dtype ILP on the fp32 graphs, traces with its dtypes and plans exactly. The
    result is checked on the example batch against fp32 and against torch.autocast; while its loss
    or gradient error is above autocast's, the tolerance is cut and the dtypes chosen again.
    """
    with _Restore(model), torch.enable_grad():
        an = mixed.analyse(model, args, kwargs, dev, fp32_ops, measure=where.type != "meta")
    info: dict[str, Any] = {"mode": mode}
    if mode in ("bf16", "fp16"):
        dtypes, unsafe = mixed.fixed_dtypes(an, mode)
        plan, compiled, planner = build(budget, dtypes, store, fields)
        if unsafe:
            plan.notes.append(f"fp16 would overflow or underflow in {len(unsafe)} call(s) on the example batch; "
                              f"kept in fp32: {', '.join(unsafe[:8])}")
            info["kept_fp32_unsafe"] = unsafe
    else:
        tol = an.default_tolerance() if tolerance is None else float(tolerance)
        info["tolerance"] = tol
        try:
            fp32 = build(budget, [], None, fields)
        except BudgetError:
            fp32 = None
        cap = budget - ledger.fixed - SLACK
        if fp32 is not None:  # the mixed plan may not use more memory than the fp32 one does
            cap = min(cap, fp32[0].activation_peak)
        result, why = None, "the joint ILP found no dtypes within the budget"
        for attempt in range(3):
            dtypes = mixed.auto_dtypes(an, cap, tol, dev, **opts)
            if dtypes is not None and not any(dtypes):
                why = "the joint ILP chose fp32 for every call (16-bit is not faster here and not needed to fit)"
                break
            if dtypes is None:
                break
            try:
                result = build(min(budget, ledger.fixed + cap + SLACK), dtypes, store, fields)
            except BudgetError:
                result, why = None, "the ILP's dtypes did not fit once traced"
                cap = int(cap * 0.95)  # the mixed graphs need more than the fp32-traced rows saw
                continue
            errors = _precision_errors(model, result[1], args, kwargs, where)
            result[0].precision.update(errors)
            if _as_accurate_as_autocast(errors):
                break
            why = f"after {attempt + 1} tries the mixed plan's error was still above autocast's"
            result, tol = None, tol / 4
        if result is None and fp32 is not None:
            result = fp32
            result[0].notes.append(f"precision='auto' kept every call in fp32: {why}")
        elif result is None:  # fp32 does not fit: autocast's choice, every castable call in bf16
            result = build(budget, mixed.fixed_dtypes(an, "bf16")[0], store, fields)  # BudgetError if not
            errors = _precision_errors(model, result[1], args, kwargs, where)
            result[0].precision.update(errors)
            result[0].notes.append("precision='auto': fp32 does not fit and the joint ILP's dtypes did not fit or "
                                   "were less accurate than autocast; every castable call runs in bf16")
            if not _as_accurate_as_autocast(errors):
                result[0].notes.append("this all-bf16 plan's error is above autocast's on the example batch "
                                       "(see plan.precision); no plan within the budget was as accurate")
        plan, compiled, planner = result
        info["dtypes_chosen_by"] = "ilp (joint with save/recompute)" if plan.precision.get("dtypes") else "fp32"
    stats = {c: s.to_dict() for st in an.stats for c, s in st.items()}
    picked = plan.precision.get("dtypes") or []
    info["error_estimate"] = mixed.error_estimate(an, picked) if an.stats and any(an.stats) else None
    info["calls"] = stats
    plan.precision = {**info, **plan.precision}
    if where.type != "meta" and "loss_rel_err" not in plan.precision and picked:
        plan.precision.update(_precision_errors(model, compiled, args, kwargs, where))
    plan.budget = budget
    return plan, compiled, planner


def _as_accurate_as_autocast(errors: dict[str, float]) -> bool:
    # "As accurate" up to the rounding of the fp32 results compared: each relative error is measured
    # from a value and a reference that are each within one fp32 rounding (eps / 2) of what they stand
    # for, so two errors equal before rounding can differ by 2 * eps after it. Without this margin a
    # loss one ulp from fp32's counted as less accurate than autocast's loss that landed exactly on it.
    margin = 2 * torch.finfo(torch.float32).eps
    return (errors["loss_rel_err"] <= errors["autocast_loss_rel_err"] + margin
            and errors["grad_rel_err"] <= errors["autocast_grad_rel_err"] + margin)


def _precision_errors(model, compiled, args, kwargs, where) -> dict[str, float]:
    """Relative error of the loss and of all gradients versus fp32 eager, for the compiled step and
    for torch.autocast(bf16) on the same batch (same random stream, state restored after each)."""
    params = [p for p in model.parameters() if p.requires_grad]
    rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None

    def run(fn, autocast: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        with _Restore(model):
            torch.set_rng_state(rng)
            if cuda_rng is not None:
                torch.cuda.set_rng_state_all(cuda_rng)
            for p in params:
                p.grad = None
            amp = torch.autocast(where.type, dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
            with torch.enable_grad(), amp:
                loss = _loss(fn(*args, **kwargs))
            loss.backward()
            grads = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).detach().double().flatten()
                               for p in params])
            return loss.detach().double(), grads

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        den = b.norm().item()
        return (a - b).norm().item() / den if den else float((a - b).norm().item())

    progress.info("measuring the precision errors against fp32 and autocast")
    ref_loss, ref_grads = run(model)
    ac_loss, ac_grads = run(model, autocast=True)
    loss, grads = run(compiled)
    return {"loss_rel_err": rel(loss, ref_loss), "grad_rel_err": rel(grads, ref_grads),
            "autocast_loss_rel_err": rel(ac_loss, ref_loss), "autocast_grad_rel_err": rel(ac_grads, ref_grads)}


def _check_cached(planner: _Planner, budget: int, ledger: Ledger, dev: DeviceSpec) -> Plan | None:
    """Re-simulate a cached plan on the graphs just traced; return it only if it is what it claims."""
    cached, profiles = planner.cached, planner.profiles
    if [g.fingerprint for g in cached.graphs] != [p.fingerprint for p in profiles] or cached.budget != budget:
        return None
    try:
        _, tl, cost = evaluate(profiles, [set(g.saved) for g in cached.graphs], dev.alloc_granularity)
    except Exception:  # names that are not in the graph, a value nobody may recompute
        return None
    if ledger.fixed + max(tl.peak, ledger.optimizer_step) + SLACK > budget:
        return None
    plan = Plan.from_dict(cached.to_dict())  # a copy: the caller may append notes
    plan.solver = {**plan.solver, "path": "cache", "solved_by": cached.solver.get("path"), "solve_time_s": 0.0}
    ledger.activations = tl.peak
    plan.activation_peak, plan.predicted_peak, plan.recompute_time_s = tl.peak, ledger.total, cost
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
    """Run one real step and hold the budget to what it measures: re-plan once if the model missed.

    The memory model is exact for the kernels it knows; a kernel with unmeasured scratch would let
    the real peak pass the budget. The measured gap is reserved, the graphs (all of them: they share
    the step) are planned again, and the new plan is measured too. A plan that still does not fit
    is never returned: BudgetError says what was measured.
    """
    progress.info("verifying the plan on a real step")
    measured = _measure_step(model, compiled, planner, args, kwargs, where)
    if measured is None:
        # The step compiled again (dynamo guards on Python state the forward changes, e.g. a global
        # counter): the measurement includes tracing and says nothing about the plan.
        plan.notes.append("the model recompiled on its second call (it changes Python state that dynamo guards "
                          "on, e.g. a global); not verified, and later calls recompile too")
        return plan, compiled, planner
    plan.notes.append(f"verified on one real step (steady state, .grad buffers present): measured activation "
                      f"peak {measured} B, predicted {plan.activation_peak} B")
    if ledger.fixed + measured <= budget:
        return plan, compiled, planner
    gap = measured - plan.activation_peak
    reserve = Ledger.from_dict(dict(ledger.to_dict(),
                                    notes=[*ledger.notes, f"{gap} B reserved for scratch the model did not see"]))
    reserve.inputs += gap
    progress.info("re-planning with %d bytes the memory model did not predict", gap)
    decision = plan_graphs(planner.profiles, budget, reserve, dev, **opts)
    new = build_plan(planner.profiles, decision, ledger, budget, dev.name)
    new.notes += plan.notes + [f"re-planned with {gap} B reserved for memory the model did not predict"]
    applier = _Planner(budget, device=dev, ledger=ledger, plan=new, pre_pass=planner.pre_pass,
                       regions=planner.regions, **opts)
    compiled = _compile_and_trace(model, applier, compiler, args, kwargs)
    again = _measure_step(model, compiled, applier, args, kwargs, where)
    if again is not None and ledger.fixed + again > budget:
        raise BudgetError(
            f"budget {format_bytes(budget)} ({budget} bytes) was not met on a real step: the plan predicted "
            f"{format_bytes(ledger.fixed + plan.activation_peak)} but measured {format_bytes(ledger.fixed + measured)}; "
            f"re-planned with the {format_bytes(gap)} difference reserved, it measured "
            f"{format_bytes(ledger.fixed + again)}. The memory model misses something this model allocates; a "
            f"budget of {format_bytes(ledger.fixed + again + SLACK)} holds the re-planned step.\n{ledger.format()}",
            ledger, None)
    if again is not None:
        new.notes.append(f"verified the re-planned step: measured activation peak {again} B")
    return new, compiled, applier


def _measure_step(model, compiled, planner, args, kwargs, where) -> int | None:
    """Activation bytes of one real step in the accumulation steady state, state restored after.

    Every trainable parameter has a `.grad` already (zeros), as on every micro-step after the
    first, so what autograd allocates on top of the gradient buffers is what is measured. None if
    the call traced again instead of running the plan.
    """
    from autoremat.measure import measure_peak  # a measuring tool, not a pipeline stage

    def step() -> None:
        out = compiled(*args, **kwargs)  # held through the backward, as a training loop holds it
        _loss(out).backward()

    traced = len(planner.profiles)
    with _Restore(model), torch.enable_grad():
        for p in model.parameters():
            p.grad = torch.zeros_like(p) if p.requires_grad else None
        _, m = measure_peak(step, device=where, baseline_bytes=0)
    if len(planner.profiles) != traced:
        return None
    return m.delta_peak_bytes if where.type == "cpu" else m.peak_bytes - m.baseline_bytes


def _compile_and_trace(model, planner: _Planner, compiler: str, args: tuple, kwargs: dict) -> Any:
    compiled = compile_fresh(model, aot_backend(planner, compiler=compiler, pre_pass=planner.pre_pass,
                                                regions=planner.regions))
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


def _plan_jointly(model, planner, budget, ledger: Ledger, dev, compiler, args, kwargs, opts):
    """Every graph of the step (graph breaks, regions) under one budget, then compile with the plan."""
    profiles = planner.profiles
    progress.info("solving for %d nodes in %d graph(s) (time limit %g s per solve)",
                  sum(len(g.nodes) for g in profiles), len(profiles), opts["time_limit"])
    decision = plan_graphs(profiles, budget, ledger, dev, **opts)
    plan = build_plan(profiles, decision, ledger, budget, dev.name)
    progress.info("compiling the planned step")
    if len(profiles) > 1:
        plan.notes.append(f"{len(profiles)} graphs (one per repeated block, and one per graph break) were planned "
                          "jointly under one budget")
    applier = _Planner(budget, device=dev, ledger=ledger, plan=plan, pre_pass=planner.pre_pass,
                       regions=planner.regions, **opts)
    compiled = _compile_and_trace(model, applier, compiler, args, kwargs)
    return plan, compiled, applier
