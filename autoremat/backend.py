"""The `torch.compile` face: a backend that plans a training step's graphs under one byte budget.

    torch.compile(model, backend=autoremat.backend(budget="2GB"))
    torch.compile(model, backend="autoremat", options={"budget": "2GB"})   # registered by name

`planner.Planner` is the machinery every face shares: it receives each joint graph from AOTAutograd,
profiles it, solves (or applies a given plan), and returns the forward and backward modules.

Dynamo hands a backend one graph at a time, and a graph may run several times in one step (a
compiled block called in a loop) or at several input shapes (a dynamic graph). So the backend plans
steps, not graphs: each graph is compiled when it first runs, on its real inputs (static shapes),
and `StepPlanner` follows the graph calls of every step (in forward order, until a backward starts).
A step it has not seen runs every call at that call's most frugal plan, each call checked against
the budget together with everything the earlier calls of the step hold; once the step is complete,
its calls are planned jointly and compiled again (docs/backend.md). That planning is
step_planner.py; this module is the face dynamo calls.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx

from autoremat.model.devices import DeviceSpec
from autoremat.planning.options import PlanOptions
from autoremat.planning.step_planner import GraphUse, StepPlanner
from autoremat.solve.solver import DEFAULT_GAP
from autoremat.torch_internals import dynamo_compile_id, recompile_limit
from autoremat.units import parse_budget

log = logging.getLogger("autoremat")


# --- the torch.compile face: steps, seen at run time ------------------------------------------------

class _LazyGraph:
    """What the backend gives dynamo for one graph: compiled when first called, on the real inputs."""

    def __init__(self, owner: _Backend, gm: fx.GraphModule, dynamic: bool) -> None:
        self.owner, self.gm, self.dynamic = owner, gm, dynamic  # the owner lives as long as its graphs
        self.uses: dict[tuple | None, GraphUse] = {}

    def __call__(self, *args: Any) -> Any:
        planner = self.owner.planner
        key = _shapes(args) if self.dynamic else None  # a dynamic graph: one plan per set of shapes
        if key not in self.uses:
            planner._uses += 1
            self.uses[key] = GraphUse(self.gm, planner._uses)
        return planner.run(self.uses[key], args)


def _shapes(args: tuple) -> tuple:
    return tuple((tuple(a.shape), a.stride(), a.dtype, a.device, a.requires_grad) if isinstance(a, torch.Tensor)
                 else a if isinstance(a, (int, float, bool)) else type(a).__name__ for a in args)


def _is_dynamic(example_inputs: list) -> bool:
    sizes = [s for a in example_inputs if isinstance(a, torch.Tensor) for s in (*a.shape, *a.stride())]
    return any(isinstance(v, (torch.SymInt, torch.SymFloat)) for v in [*sizes, *example_inputs])


class _Backend:
    """What `backend()` returns: a dynamo backend, with the `StepPlanner` of its graphs as `.planner`."""

    __name__ = "autoremat"

    def __init__(self, planner: StepPlanner) -> None:
        self.planner = planner
        self._warned: set[int] = set()

    def __call__(self, gm: fx.GraphModule, example_inputs: list) -> Callable:
        self._warn_at_recompile_limit(gm)
        return _LazyGraph(self, gm, _is_dynamic(example_inputs))

    def _warn_at_recompile_limit(self, gm: fx.GraphModule) -> None:
        """Past torch._dynamo.config.recompile_limit dynamo runs the code eagerly: no plan, no budget."""
        cid, limit = dynamo_compile_id(gm), recompile_limit()
        if cid is None or cid[1] + 1 < limit or cid[0] in self._warned:
            return
        self._warned.add(cid[0])
        log.warning(
            "autoremat: dynamo has compiled frame %d %d times, its recompile limit (torch._dynamo.config."
            "recompile_limit). Another recompile of that code (e.g. a new input shape under dynamic=False) "
            "runs it eagerly, without a plan, and the step's memory is then not held to the budget. Leave "
            "dynamic at its default (autoremat plans each new shape of a dynamic graph itself), raise the "
            "limit, or set torch._dynamo.config.fail_on_recompile_limit_hit = True to make that an error.",
            cid[0], limit)


def backend(
    budget: int | str | None = None,
    *,
    optimizer: Any = "adamw",
    device: DeviceSpec | str | None = None,
    solver: str = "auto",
    time_limit: float = 10.0,
    gap: float = DEFAULT_GAP,
    compiler: str = "auto",
) -> Callable:
    """A `torch.compile` backend that plans every training step under `budget` (module docstring).

    The budget pays for the parameters, their gradients and `optimizer` state too. Graph breaks,
    graphs called several times per step and new input shapes all share the one budget.
    `compiler`: as `autoremat.optimize`'s ("auto", the default: Inductor where it runs, else eager
    with one warning; "inductor"; "eager"), chosen when the first graph runs, on its inputs' device;
    `.planner.compiler` then says which and why.
    """
    budget = parse_budget(budget) if budget is not None else None  # parsed here, once
    options = PlanOptions(solver=solver, time_limit=time_limit, gap=gap, compiler=compiler)
    options.check()
    return _Backend(StepPlanner(budget, optimizer=optimizer, device=device, options=options))


# One backend per torch.compile(..., options=...) call: dynamo hands every graph of that call the same
# options object, and those graphs share one budget. Held weakly: dynamo's graphs keep it alive.
_REGISTERED: dict[int, tuple[dict | None, weakref.ref]] = {}


def registered_backend(gm: fx.GraphModule, example_inputs: list, options: dict | None = None) -> Callable:
    """Entry point for `torch.compile(backend="autoremat", options={...})`; options are `backend`'s."""
    kept, ref = _REGISTERED.get(id(options), (None, None))
    be = ref() if ref is not None and kept is options else None
    if be is None:
        be = backend(**(options or {}))
        _REGISTERED[id(options)] = (options, weakref.ref(be))
    return be(gm, example_inputs)
