"""A step's dynamo graph kept from its first trace: every later trace of the step is a copy of it given
to the backend, and dynamo does not run the model's Python again.

A step is traced several times while it is planned, each time as the same dynamo graph under another
rewrite run before AOTAutograd (a pre-pass): the loss region at each chunk count
(autoremat.planning.loss_region), the step as one graph after one graph per block
(pipeline.one_graph_if_free), and the step with its plan, to compile it. Running dynamo on the whole
forward again for each would be a large share of each trace, growing with depth (benchmarks/plan_time.py
times the stages). So the first trace keeps the graph dynamo handed its backend, before
any rewrite (`Keeping`), and the others hand a fresh copy of it to the same backend (`step_tracing.trace_again`):
the planner gets what a full trace gives it (each region's profile; a region identical to one traced
before reused by `same_regions`), without the bytecode. The backend runs in a tracing context like
dynamo's (`tracing_like_dynamo`: FX's dead-code elimination reads it).

The planned step, with compiler="eager", is the code of the trace it was planned on with the plan swapped
in (planned_in_place.py), or where that cannot be, that graph traced again with the plan (`step_tracing.compile_planned`).
It is handed to the frame dynamo compiled at the first trace: the code that frame runs is re-pointed to it (`Late`),
and a recompile of the frame (a guard failing) goes to the planned step's backend, as it would have
gone to a frame compiled with that backend. Under Inductor the planned step is still compiled by
dynamo: Inductor's compilers read more of dynamo's context than this one provides.

Only a step dynamo captured as one graph of plain tensors is kept: with a graph break, what the second
graph sees depends on the Python between the two; under DDP's graph splitter or FSDP2, the inputs are
fake or distributed tensors that only dynamo's own context can trace. Those steps are traced in full.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from autoremat.capture.blocks import skipped
from autoremat.torch_internals import copy_dynamo_graph

log = logging.getLogger("autoremat")



@dataclass
class DynamoGraph:
    """One dynamo graph as dynamo handed it to the backend, before any pre-pass, with its example inputs, and
    what dynamo holds of it: the code it runs (`runs`) and the backend it calls on a recompile (`kept`)."""

    gm: fx.GraphModule
    example_inputs: list
    runs: Late
    kept: Keeping
    compiled: Any = None  # the step as the user calls it: the torch.compile'd model whose frame this graph is

    def fresh(self) -> fx.GraphModule:
        """A copy a pre-pass may rewrite (`copy_dynamo_graph`)."""
        return copy_dynamo_graph(self.gm)

    def run_planned(self, code: Callable, backend: Callable) -> None:
        """The step is compiled with its plan: dynamo's frame runs `code` from now on, and a recompile of it (a
        guard failing) goes to `backend`, the planned step's; no later graph is kept."""
        self.runs.target, self.kept.backend, self.kept.graphs = code, backend, None


class Late:
    """The code dynamo runs for a graph, re-pointed once the step is compiled with its plan (`step_tracing.compile_planned`).
    Dynamo calls what a backend returns with the graph's inputs as arguments (AOTAutograd's own `forward`
    takes them so), and so does this."""

    def __init__(self, target: Callable) -> None:
        self.target = target

    def __call__(self, *args: Any) -> Any:
        return self.target(*args)


class Keeping:
    """A dynamo backend that keeps each graph it is given (a copy, before the pre-pass rewrites it) in `graphs`
    and hands dynamo a `Late` of what `backend` compiled; `backend` is re-pointed with the code."""

    def __init__(self, backend: Callable, graphs: list[DynamoGraph]) -> None:
        self.backend = backend
        self.graphs: list[DynamoGraph] | None = graphs  # None once the step is compiled: recompiles not kept

    def __call__(self, gm: fx.GraphModule, example_inputs: list) -> Callable:
        if self.graphs is None:
            return self.backend(gm, example_inputs)
        copy = copy_dynamo_graph(gm)
        runs = Late(self.backend(gm, example_inputs))
        self.graphs.append(DynamoGraph(copy, list(example_inputs), runs, self))
        return runs


def keeping(backend: Callable, graphs: list[DynamoGraph] | None) -> Callable:
    """`backend`, keeping the graphs it is given in `graphs` (`Keeping`) unless that is None."""
    return backend if graphs is None else Keeping(backend, graphs)


def source_of(model: torch.nn.Module, kept: list[DynamoGraph] | None, compiled: Any) -> DynamoGraph | None:
    """The step's kept graph (`one_plain_graph`), noted as the graph of the frame `compiled`; else None."""
    graph = one_plain_graph(model, kept)
    if graph is not None:
        graph.compiled = compiled
    return graph


def one_plain_graph(model: torch.nn.Module, kept: list[DynamoGraph] | None) -> DynamoGraph | None:
    """The step's one dynamo graph, where it can be traced again without dynamo; else None (see above)."""
    if kept is None or len(kept) != 1 or skipped(model):
        return None
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return None  # DDP's buckets and FSDP2's unsharded parameters exist only while dynamo runs the step
    plain = all(type(x) in (torch.Tensor, torch.nn.Parameter) for x in kept[0].example_inputs
                if isinstance(x, torch.Tensor))
    return kept[0] if plain else None


