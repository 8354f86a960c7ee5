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
from autoremat.capture import aot_backend
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
    plan.notes.append(f"{len(planner.profiles)} graph(s) captured")
    return RematModule(model, compiled, plan, planner)


def _compile_and_trace(model, planner: Planner, compiler: str, args: tuple, kwargs: dict) -> Any:
    compiled = torch.compile(model, backend=aot_backend(planner, compiler=compiler), dynamic=False)
    try:
        with torch.enable_grad():
            out = compiled(*args, **kwargs)  # tracing plans every graph; the outputs are not needed
    except torch._dynamo.exc.BackendCompilerFailed as e:
        # Our own errors (BudgetError, PlanMismatch) reach the user as themselves, not wrapped.
        inner = getattr(e, "inner_exception", None)
        if isinstance(inner, (BudgetError, PlanMismatch)):
            raise inner from None
        raise
    del out
    return compiled


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
