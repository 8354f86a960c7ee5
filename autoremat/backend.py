"""The `torch.compile` face: a backend that plans each joint graph under a byte budget.

    torch.compile(model, backend=autoremat.backend(budget="2GB"))
    torch.compile(model, backend="autoremat", options={"budget": "2GB"})   # registered by name

`Planner` is the machinery both faces share: it receives each joint graph from AOTAutograd,
profiles it, solves (or applies a given plan), and returns the forward and backward modules.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx

from autoremat.capture import CapturedGraph, aot_backend
from autoremat.devices import DeviceSpec, get_device
from autoremat.ledger import Ledger, optimizer_state_bytes
from autoremat.memory import make_schedule
from autoremat.passes import split
from autoremat.plan import SLACK, BudgetError, Plan, build_plan, merge_plans
from autoremat.profile import GraphProfile, calibrate_scratch, profile_graph
from autoremat.solver import DEFAULT_GAP, Decision, Infeasible, smallest_peak, solve
from autoremat.units import parse_budget

log = logging.getLogger("autoremat")


class PlanMismatch(ValueError):
    """A saved plan was applied to a graph it was not made for."""


def ledger_from_graph(cg: CapturedGraph, optimizer: Any, granularity: int) -> Ledger:
    """Fixed bytes when all we have is the graph: its parameters, their gradients and optimizer state."""
    nodes = list(cg.joint.graph.nodes)
    primals = [n for n in nodes if n.op == "placeholder" and n.name.startswith("primals")]
    outs = list(torch.utils._pytree.arg_tree_leaves(*next(n for n in nodes if n.op == "output").args))
    grads = outs[cg.num_fwd_outputs:]
    static = set(cg.static_input_indices)

    def nbytes(n: fx.Node) -> int:
        v = n.meta.get("val")
        size = v.untyped_storage().nbytes() if isinstance(v, torch.Tensor) else 0
        return -(-size // granularity) * granularity

    params = [p for i, p in enumerate(primals) if i in static]
    trainable = [p for i, p in enumerate(primals) if i in static and i < len(grads) and grads[i] is not None]
    inputs = [p for i, p in enumerate(primals) if i not in static]
    notes: list[str] = []
    state = optimizer_state_bytes(optimizer, [p.meta["val"] for p in trainable], granularity=granularity,
                                  notes=notes)
    return Ledger(
        parameters=sum(map(nbytes, params)),
        gradients=sum(map(nbytes, trainable)),
        optimizer_state=state,
        inputs=sum(map(nbytes, inputs)),
        notes=notes,
    )


class Planner:
    """Partition callback: plan (or re-apply a plan to) every joint graph AOTAutograd produces."""

    def __init__(
        self,
        budget: int | str | None,
        *,
        optimizer: Any = "adamw",
        device: DeviceSpec | str | torch.device | None = None,
        ledger: Ledger | None = None,
        plan: Plan | None = None,
        solver: str = "auto",
        time_limit: float = 10.0,
        gap: float = DEFAULT_GAP,
        calibrate: bool = True,
    ) -> None:
        self.calibrate = calibrate
        self.budget = parse_budget(budget) if budget is not None else None
        self.optimizer = optimizer
        self.device = get_device(device) if device is not None else None
        self.ledger = ledger
        self.plan = plan
        self.solver = solver
        self.time_limit = time_limit
        self.gap = gap
        self.profiles: list[GraphProfile] = []
        self.plans: list[Plan] = []  # one per graph planned on its own

    def _device(self, cg: CapturedGraph) -> DeviceSpec:
        return self.device or get_device("cpu" if cg.device == "meta" else cg.device)

    def __call__(self, cg: CapturedGraph) -> tuple[fx.GraphModule, fx.GraphModule]:
        dev = self._device(cg)
        gp = profile_graph(cg, dev)
        if self.calibrate:
            calibrate_scratch(cg, gp)
        self.profiles.append(gp)
        if self.plan is not None:
            saved = self._saved_from_plan(gp, cg.index)
            return split(cg, make_schedule(gp, saved))
        ledger = self.ledger or ledger_from_graph(cg, self.optimizer, dev.alloc_granularity)
        decision = plan_graphs([gp], self.budget, ledger, dev, solver=self.solver, time_limit=self.time_limit,
                                gap=self.gap)
        plan = build_plan([gp], decision, ledger, self.budget or 0, dev.name)
        self.plans.append(plan)
        log.info("autoremat planned graph %d: %s", cg.index, plan.summary().splitlines()[1])
        return split(cg, decision.schedules[0])

    def _saved_from_plan(self, gp: GraphProfile, index: int) -> set[str]:
        matches = [g for g in self.plan.graphs if g.fingerprint == gp.fingerprint]
        for g in sorted(matches, key=lambda g: g.index != index):  # same position first
            return set(g.saved)
        raise PlanMismatch(
            f"the plan was made for graph(s) {[g.fingerprint for g in self.plan.graphs]}, but the model "
            f"traced to graph {gp.fingerprint} ({len(gp.nodes)} nodes): the model, its input shapes or "
            "dtypes, or the torch version differ. Plan again instead of re-applying this plan."
        )

    @property
    def combined_plan(self) -> Plan | None:
        return merge_plans(self.plans) if self.plans else None


def plan_graphs(
    profiles: list[GraphProfile],
    budget: int | None,
    ledger: Ledger,
    device: DeviceSpec,
    *,
    solver: str = "auto",
    time_limit: float = 10.0,
    gap: float = DEFAULT_GAP,
) -> Decision:
    """Solve the save/recompute ILP for graphs that run in one step, under what the ledger leaves."""
    if budget is None:  # no budget: the device's memory, or no limit at all on a CPU
        budget = device.memory_bytes or 2**62
    activations = budget - ledger.fixed - SLACK  # SLACK: autograd's loss and seed scalars, held by no graph
    try:
        if activations <= 0:
            smallest = smallest_peak(profiles, granularity=device.alloc_granularity, solver=solver,
                                     time_limit=time_limit)
            raise Infeasible(smallest, "the fixed parts alone exceed the budget")
        return solve(profiles, activations, granularity=device.alloc_granularity, solver=solver,
                     time_limit=time_limit, gap=gap)
    except Infeasible as e:
        raise BudgetError.from_infeasible(budget, ledger, e, profiles, device) from None


def backend(
    budget: int | str | None = None,
    *,
    optimizer: Any = "adamw",
    device: DeviceSpec | str | None = None,
    solver: str = "auto",
    time_limit: float = 10.0,
    gap: float = DEFAULT_GAP,
    compiler: str = "eager",
) -> Callable:
    """A `torch.compile` backend that plans every graph under `budget` (see the module docstring).

    The budget pays for the graph's parameters, their gradients and `optimizer` state too. With graph
    breaks each graph is planned as it arrives; `autoremat.optimize` plans them jointly.
    """
    planner = Planner(budget, optimizer=optimizer, device=device, solver=solver, time_limit=time_limit, gap=gap)
    compile_fn = aot_backend(planner, compiler=compiler)

    def autoremat_backend(gm: fx.GraphModule, example_inputs: list) -> Callable:
        return compile_fn(gm, example_inputs)

    autoremat_backend.planner = planner  # type: ignore[attr-defined]
    return autoremat_backend


def registered_backend(gm: fx.GraphModule, example_inputs: list, options: dict | None = None) -> Callable:
    """Entry point for `torch.compile(backend="autoremat", options={...})`; options are `backend`'s."""
    return backend(**(options or {}))(gm, example_inputs)
