"""The step traced for a planner: in full (dynamo, then AOTAutograd hands each joint graph to the planner),
or again from the dynamo graph its first trace kept (dynamo_graphs.py: AOTAutograd alone), and the planned
step compiled from that kept graph. Each function that traces returns the trace as a frozen `StepTrace`,
which every later stage reads instead of the planner (step_trace.py).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from autoremat.capture.aot import aot_backend, compile_fresh, meta_traces_like_real
from autoremat.capture.blocks import compile_blocks, no_graph_error, remember_skipped, repeated_blocks, skipped
from autoremat.capture.tracing import Restore, eager_saved_bytes, inputs_must_fit, reshard
from autoremat.planning.dynamo_graphs import DynamoGraph, keeping, source_of
from autoremat.planning.planned_in_place import swap_in_plan
from autoremat.planning.planner import CapturePlanner, own_errors
from autoremat.planning.step_trace import StepTrace
from autoremat.torch_internals import tracing_like_dynamo

if TYPE_CHECKING:
    from autoremat.planning.options import TrainingStep

log = logging.getLogger("autoremat")


def require_graphs(model: torch.nn.Module, trace: StepTrace) -> None:
    """A step dynamo ran without any graph would run eagerly, unplanned, past any budget."""
    if not trace.graphs:
        raise no_graph_error(model)


def compile_and_trace(model, planner: CapturePlanner, compiler: str, args: tuple, kwargs: dict) -> StepTrace:
    """Compile `model` with `planner` as its partition callback and run its forward once: the step's trace."""
    # A trace that can only capture (no plan to apply, no cache to find one in) is profiled and thrown
    # away: it is not compiled by Inductor (`plan_jointly` compiles the step with its plan).
    trace_only = planner.plan is None and planner.lookup is None and planner.strict
    backend = keeping(step_backend(planner, compiler, trace_only), planner.dynamo_graphs)
    blocks = repeated_blocks(model) if skipped(model) else []
    compiled = compile_blocks(model, blocks, backend) if blocks else compile_fresh(model, backend)
    _trace(model, planner, compiled, args, kwargs)
    if not planner.profiles and not blocks and (blocks := repeated_blocks(model)):
        # Dynamo ran the whole forward eagerly (a graph break inside the block loop): compile each
        # block on its own instead, now and in every later trace of this model (capture/blocks.py).
        remember_skipped(model)
        compiled = compile_blocks(model, blocks, backend)
        _trace(model, planner, compiled, args, kwargs)
    source = source_of(model, planner.dynamo_graphs, compiled)
    return trace_of(planner, compiled, source, source.runs.target if source is not None else None)


def _trace(model: torch.nn.Module, planner: CapturePlanner, compiled: Any, args: tuple, kwargs: dict) -> None:
    """Run the forward once (it traces every graph); the ledger learns what eager code between graphs saved."""
    planner.log.recording = True
    try:
        with own_errors(), Restore(model), torch.enable_grad(), inputs_must_fit(model, args, kwargs):
            out = compiled(*args, **kwargs)
            if planner.ledger is not None and planner.device is not None:
                planner.ledger.eager_saved = eager_saved_bytes(out, model, args, kwargs, planner.device.alloc_granularity)
    finally:
        planner.log.recording = False
    del out
    reshard(model)


def planner_for(step: TrainingStep, budget: int, **kw: Any) -> CapturePlanner:
    """A CapturePlanner for the step being planned (its device, ledger and options); `kw` adds the rest."""
    return CapturePlanner(budget, device=step.dev, ledger=step.ledger, options=step.options,
                          regions_seen=step.regions_seen, **kw)


def trace_step(step: TrainingStep, planner: CapturePlanner, source: DynamoGraph | None = None) -> StepTrace:
    """`compile_and_trace` for the step being planned; given `source`, that kept graph traced again (the
    trace's `compiled` is then None: the step the user calls is the frame `source` came from)."""
    if source is None:
        return compile_and_trace(step.model, planner, step.compiler, step.args, step.kwargs)
    _, code = trace_again(step.model, step.compiler, planner, source)
    return trace_of(planner, None, source, code)


def trace_of(planner: CapturePlanner, compiled: Any, source: DynamoGraph | None, code: Any) -> StepTrace:
    """What `planner`'s trace of the step leaves (`StepTrace`), once the function that traced is done:
    `compiled` the step it traced, `source` the kept dynamo graph it was traced from, `code` that step's code."""
    return StepTrace(compiled=compiled, calls=tuple(planner.sequence()), graphs=tuple(planner.profiles),
                     codes=tuple(planner.codes), code=code, source=source, per_block=planner.per_block,
                     cached=planner.cached, cached_applied=planner.cached is not None and planner.plan is planner.cached,
                     pre_pass=planner.pre_pass, regions=planner.regions)


def step_backend(planner: CapturePlanner, compiler: str, trace_only: bool) -> Callable:
    """The backend a step is traced with for `planner`: its pre-pass, regions and compiler, each graph's calls
    noted in its log."""
    return planner.log.wrap(aot_backend(planner, compiler=compiler, pre_pass=planner.pre_pass,
                                        regions=planner.regions, release_grads=planner.release_grads,
                                        trace_only=trace_only, same=planner.same, codes=planner.codes))


def trace_again(model: torch.nn.Module, compiler: str, planner: CapturePlanner, graph: DynamoGraph, *,
                trace_only: bool = True) -> tuple[Callable, Callable]:
    """Trace `graph` for `planner` as `compile_and_trace` would trace the step, from the dynamo graph kept:
    AOTAutograd and the profiles (and with trace_only=False, the plan applied), no dynamo. Returns the
    backend and the code it compiled."""
    backend = step_backend(planner, compiler, trace_only)
    on_meta = any(p.is_meta for p in model.parameters())
    with own_errors(), Restore(model), torch.enable_grad(), tracing_like_dynamo(), \
            meta_traces_like_real() if on_meta else contextlib.nullcontext():
        code = backend(graph.fresh(), list(graph.example_inputs))
    return backend, code


def compile_planned(step: TrainingStep, applier: CapturePlanner, traced: StepTrace) -> StepTrace:
    """The step compiled with `applier`'s plan, made from `traced`'s trace of the dynamo graph kept, and handed
    to the frame dynamo compiled it from: its code re-pointed, and its recompiles (a guard failing) sent to
    the applier's backend. The plan is swapped into the code of `traced`'s trace where it can be
    (planned_in_place.py), else that graph is traced again with it. Returns the applier's trace, whose
    `compiled` is the step as the user calls it (that frame's torch.compile'd model)."""
    graph = traced.source
    assert graph is not None
    with tracing_like_dynamo():  # the context the partition runs in when traced (FX's dead-code elimination reads it)
        why_not = swap_in_plan(traced, applier)
    if why_not is None:
        backend, code = step_backend(applier, step.compiler, trace_only=False), traced.code
    else:
        log.debug("autoremat: the planned step is traced again: %s", why_not)
        backend, code = trace_again(step.model, step.compiler, applier, graph, trace_only=False)
    graph.run_planned(code, backend)
    return trace_of(applier, graph.compiled, graph, code)
