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
import time
from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch

from autoremat.capture.aot import COMPILE_CLOCK
from autoremat.model.devices import DeviceSpec, blas_workspace_bytes, get_device
from autoremat.model.ledger import Ledger, ledger_for_model
from autoremat.passes.loss_chunks import LossOption, compose
from autoremat.passes.op_kinds import FP32_KEPT
from autoremat.planning import precision_plan
from autoremat.planning.cache import PlanCache, precision_mode
from autoremat.planning.compilers import CompilerChoice, choose_compiler, run_with_fallback
from autoremat.planning.gc_set_aside import older_objects_set_aside
from autoremat.planning.options import PlanOptions, TrainingStep, one_options
from autoremat.planning.pipeline import plan_with_dtypes
from autoremat.planning.plan import Plan
from autoremat.planning.planned_step import PlannedStep
from autoremat.planning.planner import PlanMismatch, describe
from autoremat.planning.precision_auto import plan_step
from autoremat.planning.step_tracing import planner_for, require_graphs, trace_step
from autoremat.progress import pulse, stages_on_stderr
from autoremat.remat_module import RematModule, input_key
from autoremat.solve.solver import DEFAULT_GAP
from autoremat.torch_internals import forward_hooks, tree_leaves
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


def _check_trainable(model: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    """A step whose nothing requires grad has no backward: there is no training step to plan."""
    if any(p.requires_grad for p in model.parameters()):
        return
    if any(isinstance(t, torch.Tensor) and t.requires_grad for t in tree_leaves((args, kwargs))):
        return
    frozen = sum(1 for _ in model.parameters())
    raise ValueError(f"{type(model).__name__} has no trainable parameter ({frozen} parameter tensor(s), every one with "
                     "requires_grad=False) and no example input requires grad, so its step has no backward to plan: "
                     "unfreeze what should train (PEFT's get_peft_model leaves the LoRA adapters trainable; "
                     "model.requires_grad_(True) for full fine-tuning)")


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
    options: PlanOptions | None = None,
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
    fp32_ops: the calls kept in fp32 whatever their inputs (default `passes.op_kinds.FP32_KEPT`: norms,
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
    verify: run one real step at planning time (state restored afterwards); if it measures over the
        budget, plan again with the gap reserved (up to three times, each measured), else BudgetError.
        Skipped on the meta device.
    cache: False, True (plans kept in $AUTOREMAT_CACHE_DIR or ~/.cache/autoremat) or a directory:
        a second optimize of the same step under the same options reuses the plan, re-checked by
        the simulator, without solving (plan.solver["path"] == "cache").
    progress: True: once planning has run for 2 s, write each stage to stderr (not when logging is
        configured: the stages are INFO records on the `autoremat.progress` logger). False: silent.
    options: the planning keywords above (solver ... outputs, release_grads, verify) as one
        `autoremat.PlanOptions`, instead of as keywords; giving both is a ValueError.
    outputs: "all" (default) or "loss". A vocabulary projection followed by cross-entropy (HF's
        causal-LM loss, `F.cross_entropy(logits.view(-1, V), y)`) is computed in chunks of token
        rows when the planner finds that faster within the budget (`plan.loss["chunks"]`; see
        autoremat.passes.loss_chunks). "all" keeps the model's logits output, computed whole; "loss"
        declares that only the loss is used: the logits output is returned as None and the full
        logits are never allocated.

    Raises `BudgetError` (with the ledger and the smallest budget that fits) if nothing fits, and
    TypeError / ValueError when example_inputs do not fit the model or an option is malformed.
    """
    budget = parse_budget(budget)
    asked = one_options(options, dict(solver=solver, time_limit=time_limit, gap=gap, compiler=compiler,
                                      regions=regions, precision=precision, tolerance=tolerance, fp32_ops=fp32_ops,
                                      outputs=outputs, release_grads=release_grads, verify=verify))
    if not isinstance(progress, bool):
        raise TypeError(f"progress must be True (stages on stderr once planning passes 2 s) or False, got {progress!r}")
    started, compiling = time.perf_counter(), COMPILE_CLOCK.seconds
    with stages_on_stderr(progress), pulse(), older_objects_set_aside():
        args, kwargs = _split_inputs(example_inputs)
        _check_signature(model, args, kwargs)
        _check_trainable(model, args, kwargs)
        where = _model_device(model, args, kwargs)
        options = _checked(asked, where, plan, world_size, sharding)
        first_choice = choose_compiler(options.compiler, where)
        dev = get_device(device if device is not None else where)
        workspaces = blas_workspace_bytes(dev, where.type)

        def ledger_for(args: tuple, kwargs: dict) -> Ledger:
            return ledger_for_model(model, optimizer, inputs=(args, kwargs), world_size=world_size, sharding=sharding,
                                    device_granularity=dev.alloc_granularity, workspaces=workspaces)

        step = TrainingStep(model, args, kwargs, where, dev, ledger_for(args, kwargs), options, first_choice.used)
        store = PlanCache.open(cache) if plan is None else None
        fields = _cache_fields(budget, step)

        def attempt(c: str) -> PlannedStep:
            """Plan the step with compiler `c` (run_with_fallback may ask twice), or re-apply `plan`."""
            if plan is not None:
                return _reapply(step.using(c), budget, plan, optimizer)
            return plan_step(step.using(c), budget, store, {**fields, "compiler": c})
        planned, choice = run_with_fallback(first_choice, attempt)
        planned = planned.finished()
        made = planned.plan
        _stamp(made, choice, started, compiling)
        made.notes.extend(hook_notes(model))
        chosen = made.precision.get("dtypes") or []

        def plan_shape(new_args: tuple, new_kwargs: dict) -> PlannedStep:
            """A new input shape: the whole pipeline again, with the dtypes already chosen."""
            now, clock = time.perf_counter(), COMPILE_CLOCK.seconds
            shaped = step.shaped(new_args, new_kwargs, ledger_for(new_args, new_kwargs))
            shape_plan, used = run_with_fallback(first_choice, lambda c: plan_with_dtypes(
                shaped.using(c), budget, chosen, None, {**fields, "compiler": c}))
            _stamp(shape_plan.plan, used, now, clock)
            return shape_plan

        return RematModule(model, planned, key=input_key(model, args, kwargs), plan_shape=plan_shape,
                           progress=progress)


def _checked(options: PlanOptions, where: torch.device, plan: Plan | None, world_size: int,
             sharding: str) -> PlanOptions:
    """`options` checked, with regions="auto" settled where only one form can serve."""
    options.check(where)
    options = replace(options, fp32_ops=tuple(options.fp32_ops))
    if plan is not None and options.regions == "auto":
        return replace(options, regions=plan.regions)  # captured as it was planned
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    if options.regions == "auto" and (world_size > 1 or sharding != "none" or distributed):
        # DDP's and FSDP2's gradient hand-over and overlap are built on the per-block graphs
        return replace(options, regions=True)
    return options


def _cache_fields(budget: int, step: TrainingStep) -> dict:
    """What a cached plan must have been made for, besides the step's graphs (the plan cache's key)."""
    o = step.options
    return {"budget": budget, "ledger": step.ledger.to_dict(), "device": step.dev.name, "where": str(step.where),
            "precision": precision_mode(str(step.where)), "verify": step.checked, "compiler": step.compiler,
            "regions": o.regions, "release_grads": o.release_grads,
            "dtypes": {"mode": o.precision, "tolerance": o.tolerance, "fp32_ops": o.fp32_ops},
            **asdict(o.solving())}


def _reapply(step: TrainingStep, budget: int, plan: Plan, optimizer: Any) -> PlannedStep:
    """Trace the step once more and apply `plan` to it as it is (no solving), refusing a step it was not for."""
    o = step.options
    dtypes = plan.precision.get("dtypes") or []
    pre = precision_plan.pre_pass(dtypes, plan.precision.get("fp32_ops", o.fp32_ops)) if dtypes else None
    if plan.loss:  # the loss region as planned (one chunk of 16-bit logits: the fused loss)
        pre = compose(pre, LossOption(plan.loss.get("outputs", "all"), plan.loss["chunks"]).pre_pass())
    applier = planner_for(step, budget, optimizer=optimizer, plan=plan, pre_pass=pre, regions=o.regions)
    trace = trace_step(step, applier)
    require_graphs(step.model, trace)
    traced = [p.fingerprint for p in trace.calls]
    if traced != [g.fingerprint for g in plan.graphs]:  # e.g. one more block: every graph matches, the step not
        raise PlanMismatch(f"the plan was made for {len(plan.graphs)} graph(s), but the model traced to graph(s) "
                           f"{traced}: the model, its input shapes or dtypes, or the torch version differ. Plan "
                           "again instead of re-applying this plan.")
    plan.notes.append(f"{len(trace.graphs)} graph(s) captured")
    return PlannedStep(plan, trace.compiled, applier, trace)


def hook_notes(model: torch.nn.Module) -> list[str]:
    """The forward hooks on the model's submodules that are not torch's own: they run inside the traced step and
    change what it computes and saves, so the plan is the hooked model's, not a fresh one's. Said, because such a
    hook is often left behind by an earlier setup: transformers' gradient_checkpointing_enable() registers one
    (`make_inputs_require_grads`) that gradient_checkpointing_disable() does not remove."""
    found = []
    for name, module in model.named_modules():
        for hook in forward_hooks(module):
            fn = hook.func if isinstance(hook, functools.partial) else hook
            if not getattr(fn, "__module__", "").startswith("torch."):
                found.append(f"{name or type(model).__name__}: {getattr(fn, '__qualname__', repr(fn))}")
    if not found:
        return []
    return [f"{len(found)} forward hook(s) on the model and its submodules run inside the planned step and shape its plan: "
            f"{'; '.join(found)}; a hook left from an earlier setup makes this plan differ from a fresh model's "
            "(remove it first, e.g. transformers' disable_input_require_grads())"]


def _stamp(plan: Plan, choice: CompilerChoice, started: float, compiling: float) -> None:
    """The compiler chosen and why, and planning's wall time with the part Inductor's compilers took."""
    plan.compiler = {**choice.to_dict(), "planning_s": round(time.perf_counter() - started, 3),
                     "inductor_compile_s": round(COMPILE_CLOCK.seconds - compiling, 3)}


