"""The Python face: `autoremat.optimize(model, budget=..., example_inputs=...)`.

    opt_model = autoremat.optimize(model, budget="2GB", example_inputs=(x,), optimizer="adamw")
    loss = opt_model(x).sum(); loss.backward()      # the user's loop, unchanged
    print(opt_model.plan.summary())

Planning happens here, once, by running the forward on the example inputs: AOTAutograd hands each
joint graph to the planner. If the model has graph breaks, the graphs are then planned again
together (they share the budget) and the model is compiled once more with the joint plan.
"""

from __future__ import annotations

import functools
import inspect
import logging
import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from autoremat.capture.aot import COMPILE_CLOCK
from autoremat.model.devices import DeviceSpec, blas_workspace_bytes, get_device
from autoremat.model.ledger import Ledger, ledger_for_model
from autoremat.model.precision_measure import FP32_KEPT
from autoremat.passes.loss_chunks import OUTPUTS, LossOption, compose
from autoremat.planning import precision_plan
from autoremat.planning.cache import PlanCache, precision_mode
from autoremat.planning.compilers import CompilerChoice, check_compiler, choose_compiler, run_with_fallback
from autoremat.planning.pipeline import build
from autoremat.planning.plan import Plan
from autoremat.planning.planner import (
    CapturePlanner,
    PlanMismatch,
    compile_and_trace,
    describe,
    require_graphs,
)
from autoremat.planning.precision_auto import plan_precision
from autoremat.progress import pulse, stages_on_stderr
from autoremat.remat_module import RematModule, input_key
from autoremat.solve.solver import DEFAULT_GAP, check_solver
from autoremat.torch_internals import tree_leaves
from autoremat.units import parse_budget

log = logging.getLogger("autoremat")


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
                        f"({describe(args, kwargs)}): {e}") from None


def _check_options(time_limit: float, gap: float, solver: str) -> None:
    if isinstance(time_limit, bool) or not isinstance(time_limit, (int, float)) or not time_limit > 0 \
            or not math.isfinite(time_limit):
        raise ValueError(f"time_limit must be a positive number of seconds, got {time_limit!r}")
    if isinstance(gap, bool) or not isinstance(gap, (int, float)) or not 0 <= gap < 1:
        raise ValueError(f"gap must be a relative optimality gap in [0, 1), got {gap!r}")
    check_solver(solver)


def _model_device(model: torch.nn.Module, args: tuple, kwargs: dict) -> torch.device:
    for t in [*model.parameters(), *tree_leaves((args, kwargs))]:
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
    compiler: str = "auto",
    regions: bool | str = "auto",
    release_grads: bool = True,
    verify: bool = True,
    world_size: int = 1,
    sharding: str = "none",
    cache: bool | str | Path = False,
    progress: bool = True,
    outputs: str = "all",
) -> RematModule:
    """Plan `model`'s training step to fit `budget` and return a module that runs that plan.

    budget: bytes for the whole step on the device: parameters, gradients, optimizer state,
        inputs, activations and temporaries. An int, or a string such as "20GB" or "20GiB".
    example_inputs: a tensor, a tuple of positional arguments, or a dict of keyword arguments,
        shaped like a real micro-batch (plans are made for these shapes; a new shape seen later
        is planned once more, on its own).
    optimizer: a torch.optim.Optimizer, or a name ("adamw", "adam", "sgd", "sgd_momentum",
        "adafactor", "adam8bit", ...) or None, to size its state.
    device: a name from `autoremat.model.devices.known_devices()` for the roofline; by default the
        model's device.
    plan: a Plan (e.g. `Plan.load("plan.json")`) to re-apply instead of solving.
    precision: "fp32" (default), "bf16" or "fp16" (every matmul-class call in that dtype; fp16 only
        where the example batch shows it is safe), or "auto": the ILP picks fp32 / bf16 / fp16 per
        call together with save/recompute. Parameters stay fp32; gradients arrive in fp32. A plan
        with fp16 calls has `plan.needs_grad_scaler`: use `torch.amp.GradScaler`.
    tolerance: for "auto", the most summed per-call relative error (measured on the example batch)
        the plan may spend; default: what autocast's choice (every matmul in bf16) is measured at.
    fp32_ops: the calls kept in fp32 whatever their inputs (default `precision_measure.FP32_KEPT`: norms,
        softmax, exp/log/pow, reductions, losses); a call left out of the list becomes castable.
    solver, time_limit, gap: the ILP solver ("auto" or "highs": HiGHS either way), its time limit in seconds per
        solve and its relative optimality gap. At the time limit the best plan found so far is used
        (plan.solver["status"] == "time_limit"); with none, a greedy or smallest-peak plan.
    compiler: "auto" (default): Inductor where it runs (CUDA with Triton; CPU with a working C++
        compiler, probed once per process), else "eager" with one warning saying why; "inductor";
        or "eager" (the FX graphs run as Python, op by op: no compile time, no C compiler).
        `plan.compiler` records the choice, the reason, and planning time with Inductor's share.
    regions: True: compile each repeated block (a transformer layer, a residual stage: module paths
        such as `h.3`) as a graph of its own, so that its parameter gradients reach `.grad` as soon as
        its backward finishes instead of all at the end of one graph (a second set of gradients alive
        at once). False: one graph per dynamo graph (each region costs one more call per step). "auto"
        (default): per block, unless the cut step recomputes nothing and one graph costs less time than
        the graph calls it saves (`plan.regions` and a note say which, and why); per block under
        torch.distributed.
    release_grads: with regions, hand each weight gradient to `.grad` (through autograd's own
        AccumulateGrad: hooks fire as in eager mode) as soon as it is computed, not when its block's
        backward ends. `loss.backward()` and `backward(inputs=...)` work as usual; the exception is
        `torch.autograd.grad` with respect to parameters, which raises a RuntimeError saying to pass
        release_grads=False.
    verify: run one real step at planning time (state restored afterwards) and re-plan once if
        the measured peak is above the prediction. Skipped on the meta device.
    cache: False, True (plans kept in $AUTOREMAT_CACHE_DIR or ~/.cache/autoremat) or a directory:
        a second optimize of the same step under the same options reuses the plan, re-checked by
        the simulator, without solving (plan.solver["path"] == "cache").
    progress: True: once planning has run for 2 s, write each stage to stderr (not when logging is
        configured: the stages are INFO records on the `autoremat.progress` logger). False: silent.
    outputs: "all" (default) or "loss". A vocabulary projection followed by cross-entropy (HF's
        causal-LM loss, `F.cross_entropy(logits.view(-1, V), y)`) is computed in chunks of token
        rows when the planner finds that faster within the budget (`plan.loss["chunks"]`; see
        autoremat.passes.loss_chunks). "all" keeps the model's logits output, computed whole; "loss"
        declares that only the loss is used: the logits output is returned as None and the full
        logits are never allocated.

    Raises `BudgetError` (with the ledger and the smallest budget that fits) if nothing fits, and
    TypeError / ValueError when example_inputs do not fit the model or an option is malformed.
    """
    budget_bytes = parse_budget(budget)
    _check_options(time_limit, gap, solver)
    if not (isinstance(regions, bool) or (isinstance(regions, str) and regions == "auto")):
        raise ValueError(f"regions must be True (one graph per repeated block), False (one graph) or 'auto' (per "
                         f"block unless one graph costs less time), got {regions!r}")
    if plan is not None and regions == "auto":
        regions = plan.regions  # captured as it was planned
    elif regions == "auto" and (world_size > 1 or sharding != "none" or torch.distributed.is_available()
                                and torch.distributed.is_initialized()):
        regions = True  # DDP's and FSDP2's gradient hand-over and overlap are built on the per-block graphs
    check_compiler(compiler)
    started, compiling = time.perf_counter(), COMPILE_CLOCK.seconds
    if outputs not in OUTPUTS:
        raise ValueError(f"outputs must be 'all' (the model's outputs as it returns them) or 'loss' (only the loss "
                         f"is used: the logits output becomes None and is never materialised), got {outputs!r}")
    if not isinstance(progress, bool):
        raise TypeError(f"progress must be True (stages on stderr once planning passes 2 s) or False, got {progress!r}")
    with stages_on_stderr(progress), pulse():
        args, kwargs = _split_inputs(example_inputs)
        _check_signature(model, args, kwargs)
        where = _model_device(model, args, kwargs)
        _check_precision(precision, tolerance, fp32_ops, where)
        choice = choose_compiler(compiler, where)
        compiler = choice.used
        fp32_ops = tuple(fp32_ops)
        dev = get_device(device if device is not None else where)

        workspaces = blas_workspace_bytes(dev, where.type)

        def ledger_for(args: tuple, kwargs: dict) -> Ledger:
            return ledger_for_model(model, optimizer, inputs=(args, kwargs), world_size=world_size, sharding=sharding,
                                    device_granularity=dev.alloc_granularity, workspaces=workspaces)

        ledger = ledger_for(args, kwargs)
        opts = {"solver": solver, "time_limit": time_limit, "gap": gap}
        store = PlanCache.open(cache) if plan is None else None
        fields = {"budget": budget_bytes, "ledger": ledger.to_dict(), "device": dev.name, "where": str(where),
                  "precision": precision_mode(str(where)), "verify": verify and where.type != "meta",
                  "compiler": compiler, "regions": regions, "release_grads": release_grads, "dtypes": {"mode": precision, "tolerance": tolerance, "fp32_ops": fp32_ops},
                  **opts}

        def builder(args: tuple, kwargs: dict, ledger: Ledger, used: str | None = None) -> Callable:
            return functools.partial(build, model, ledger=ledger, dev=dev, opts=opts, compiler=used or compiler, args=args,
                                     kwargs=kwargs, verify=verify, where=where, fp32_ops=fp32_ops,
                                     regions=regions, release_grads=release_grads, outputs=outputs)

        def plan_step(used: str) -> tuple[Plan, Any, CapturePlanner]:
            """Plan the step (or apply `plan`) with compiler `used` (run_with_fallback may ask twice)."""
            nonlocal compiler, fields
            compiler, fields = used, {**fields, "compiler": used}
            build_here = builder(args, kwargs, ledger)
            if plan is None and precision == "fp32":
                return build_here(budget_bytes, [], store, fields)
            if plan is None:
                return plan_precision(model, build_here, precision, tolerance, budget_bytes, ledger, dev, opts, args,
                                      kwargs, where, fp32_ops, store, fields)
            dtypes = plan.precision.get("dtypes") or []
            pre = precision_plan.pre_pass(dtypes, plan.precision.get("fp32_ops", fp32_ops)) if dtypes else None
            if plan.loss:  # the loss region as planned (one chunk of 16-bit logits: the fused loss)
                pre = compose(pre, LossOption(plan.loss.get("outputs", "all"), plan.loss["chunks"]).pre_pass())
            applier = CapturePlanner(budget_bytes, optimizer=optimizer, device=dev, ledger=ledger, plan=plan,
                                     pre_pass=pre, regions=regions, release_grads=release_grads, **opts)
            compiled = compile_and_trace(model, applier, compiler, args, kwargs)
            require_graphs(model, applier)
            traced = [p.fingerprint for p in applier.sequence()]
            if traced != [g.fingerprint for g in plan.graphs]:  # e.g. one more block: every graph matches, the step not
                raise PlanMismatch(f"the plan was made for {len(plan.graphs)} graph(s), but the model traced to graph(s) "
                                   f"{traced}: the model, its input shapes or dtypes, or the torch version differ. Plan "
                                   "again instead of re-applying this plan.")
            plan.notes.append(f"{len(applier.profiles)} graph(s) captured")
            return plan, compiled, applier

        asked = choice  # each input shape chooses as the first did: Inductor, else eager where only eager fits
        (plan, compiled, planner), choice = run_with_fallback(asked, plan_step)
        planner.strict = False
        _stamp(plan, choice, started, compiling)
        chosen = plan.precision.get("dtypes") or []

        def plan_shape(new_args: tuple, new_kwargs: dict) -> tuple[Plan, Any, CapturePlanner]:
            """A new input shape: the whole pipeline again, with the dtypes already chosen."""
            now, clock = time.perf_counter(), COMPILE_CLOCK.seconds
            shape_ledger = ledger_for(new_args, new_kwargs)
            made, used = run_with_fallback(asked, lambda c: builder(new_args, new_kwargs, shape_ledger, c)(
                budget_bytes, chosen, None, {**fields, "compiler": c}))
            _stamp(made[0], used, now, clock)
            return made

        return RematModule(model, compiled, plan, planner, key=input_key(model, args, kwargs), plan_shape=plan_shape,
                           progress=progress)


def _stamp(plan: Plan, choice: CompilerChoice, started: float, compiling: float) -> None:
    """The compiler chosen and why, and planning's wall time with the part Inductor's compilers took."""
    plan.compiler = {**choice.to_dict(), "planning_s": round(time.perf_counter() - started, 3),
                     "inductor_compile_s": round(COMPILE_CLOCK.seconds - compiling, 3)}


def _check_precision(precision: str, tolerance: float | None, fp32_ops: Any, where: torch.device) -> None:
    if precision not in precision_plan.MODES:
        raise ValueError(f"precision must be one of {', '.join(precision_plan.MODES)}, got {precision!r}")
    if tolerance is not None and (isinstance(tolerance, bool) or not isinstance(tolerance, (int, float))
                                  or not math.isfinite(tolerance) or tolerance < 0):
        raise ValueError(f"tolerance must be a finite number >= 0 (a summed relative error), got {tolerance!r}")
    if isinstance(fp32_ops, str) or not all(isinstance(o, str) for o in fp32_ops):
        raise TypeError(f"fp32_ops must be a list of call names such as {list(FP32_KEPT[:3])}, got {fp32_ops!r}")
    if precision == "fp16" and where.type == "meta":
        raise ValueError("precision='fp16' measures value ranges on the example batch (fp16 overflows where bf16 "
                         "does not), which meta tensors do not have: give real example inputs, or use "
                         "precision='bf16' or 'auto' on meta (auto then offers bf16 only, with estimated errors)")


