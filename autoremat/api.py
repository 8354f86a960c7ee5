"""The Python face: `autoremat.optimize(model, budget=..., example_inputs=...)`.

    opt_model = autoremat.optimize(model, budget="2GB", example_inputs=(x,), optimizer="adamw")
    loss = opt_model(x).sum(); loss.backward()      # the user's loop, unchanged
    print(opt_model.plan.summary())

Planning happens here, once, by running the forward on the example inputs: AOTAutograd hands each
joint graph to the planner. If the model has graph breaks, the graphs are then planned again
together (they share the budget) and the model is compiled once more with the joint plan.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from autoremat.backend import PlanMismatch, Planner, plan_graphs
from autoremat.capture import aot_backend, compile_fresh
from autoremat.devices import DeviceSpec, get_device
from autoremat.ledger import Ledger, ledger_for_model
from autoremat.plan import BudgetError, Plan, build_plan
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
        return self._compiled(*args, **kwargs)


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
    time_limit: float = 30.0,
    compiler: str = "eager",
    verify: bool = True,
    world_size: int = 1,
    sharding: str = "none",
) -> RematModule:
    """Plan `model`'s training step to fit `budget` and return a module that runs that plan.

    budget: bytes for the whole step on the device: parameters, gradients, optimizer state,
        inputs, activations and temporaries. An int, or a string such as "20GB" or "20GiB".
    example_inputs: a tensor, a tuple of positional arguments, or a dict of keyword arguments,
        shaped like a real micro-batch (plans are made for these shapes).
    optimizer: a torch.optim.Optimizer, or a name ("adamw", "adam", "sgd", "sgd_momentum",
        "adafactor", "adam8bit", ...) or None, to size its state.
    device: a name from `autoremat.devices.known_devices()` for the roofline; by default the
        model's device.
    plan: a Plan (e.g. `Plan.load("plan.json")`) to re-apply instead of solving.
    compiler: "eager" (FX graphs run as Python) or "inductor".
    verify: run one real step at planning time (state restored afterwards) and re-plan once if
        the measured peak is above the prediction.

    Raises `BudgetError` (with the ledger and the smallest budget that fits) if nothing fits.
    """
    budget_bytes = parse_budget(budget)
    args, kwargs = _split_inputs(example_inputs)
    where = _model_device(model, args, kwargs)
    dev = get_device(device if device is not None else where)
    ledger = ledger_for_model(model, optimizer, inputs=(args, kwargs), world_size=world_size, sharding=sharding,
                              device_granularity=dev.alloc_granularity)
    planner = Planner(budget_bytes, optimizer=optimizer, device=dev, ledger=ledger, plan=plan, solver=solver,
                      time_limit=time_limit)
    compiled = _compile_and_trace(model, planner, compiler, args, kwargs)
    if plan is None:
        plan = planner.combined_plan
        if len(planner.profiles) > 1:
            plan, compiled = _replan_jointly(model, planner, budget_bytes, ledger, dev, compiler, args, kwargs,
                                             solver, time_limit)
        if verify and where.type != "meta":
            plan, compiled = _verify(model, compiled, plan, planner, budget_bytes, ledger, dev, compiler, args,
                                     kwargs, solver, time_limit, where)
    plan.notes.append(f"{len(planner.profiles)} graph(s) captured")
    return RematModule(model, compiled, plan, planner)


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


def _verify(model, compiled, plan, planner, budget, ledger, dev, compiler, args, kwargs, solver, time_limit, where):
    """Run one real step and compare its peak with the prediction; re-plan once if the model missed.

    The memory model is exact for the kernels it knows; a kernel with unmeasured scratch would let
    the real peak pass the budget. The measured gap is reserved and the graphs are planned again.
    """
    from autoremat.measure import measure_peak  # a measuring tool, not a pipeline stage

    def step() -> None:
        _loss(compiled(*args, **kwargs)).backward()

    with _Restore(model):
        for p in model.parameters():
            p.grad = None
        _, m = measure_peak(step, device=where, baseline_bytes=0)
    measured = m.delta_peak_bytes if where.type == "cpu" else m.peak_bytes - m.baseline_bytes
    gap = measured - plan.activation_peak
    plan.notes.append(f"verified on one real step: measured activation peak {measured} B, predicted "
                      f"{plan.activation_peak} B")
    if ledger.fixed + measured <= budget or len(planner.profiles) != 1:
        return plan, compiled  # the real step fits
    profiles = planner.profiles
    tighter = dict(ledger.to_dict(), notes=[*ledger.notes, f"{gap} B reserved for scratch the model did not see"])
    reserve = Ledger.from_dict(tighter)
    reserve.inputs += gap
    decision = plan_graphs(profiles, budget, reserve, dev, solver=solver, time_limit=time_limit)
    new = build_plan(profiles, decision, ledger, budget, dev.name)
    new.notes += plan.notes + [f"re-planned with {gap} B reserved for scratch the memory model missed"]
    applier = Planner(budget, device=dev, ledger=ledger, plan=new)
    return new, _compile_and_trace(model, applier, compiler, args, kwargs)


def _compile_and_trace(model, planner: Planner, compiler: str, args: tuple, kwargs: dict) -> Any:
    compiled = compile_fresh(model, aot_backend(planner, compiler=compiler))
    try:
        with _Restore(model), torch.enable_grad():
            out = compiled(*args, **kwargs)  # tracing plans every graph; the outputs are not needed
    except torch._dynamo.exc.BackendCompilerFailed as e:
        # Our own errors (BudgetError, PlanMismatch) reach the user as themselves, not wrapped.
        inner = getattr(e, "inner_exception", None)
        if isinstance(inner, (BudgetError, PlanMismatch)):
            raise inner from None
        raise
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


def _replan_jointly(model, planner, budget, ledger: Ledger, dev, compiler, args, kwargs, solver, time_limit):
    """Graph breaks: the graphs share one step, so plan them together and compile again."""
    profiles = planner.profiles
    decision = plan_graphs(profiles, budget, ledger, dev, solver=solver, time_limit=time_limit)
    plan = build_plan(profiles, decision, ledger, budget, dev.name)
    plan.notes.append(f"the model has graph breaks: {len(profiles)} graphs were planned jointly")
    log.warning("autoremat: %d graphs (graph breaks); planned jointly under one budget", len(profiles))
    applier = Planner(budget, device=dev, ledger=ledger, plan=plan)
    compiled = _compile_and_trace(model, applier, compiler, args, kwargs)
    return plan, compiled
