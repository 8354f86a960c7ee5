"""A step's dynamo graph kept from its first trace, so that a candidate differing only in its pre-pass is
traced by AOTAutograd alone: dynamo does not run the model's Python again.

The loss region's chunk counts (autoremat.planning.loss_region) are such candidates: each is the same
dynamo graph with another rewrite of its projection + cross-entropy (a pre-pass, run before AOTAutograd).
Re-running dynamo for each count re-executed the whole forward's bytecode (issue 38: about 0.9 s of each
2.3 s count traced on a 1-layer GPT-2, and more with depth). Handing a fresh copy of the kept graph to
the same backend gives the planner what a full trace gives it (the profiles of every region, each region
identical to one already traced reused by `same_regions`), without the bytecode.

Only a step dynamo captured as one graph of plain tensors is kept: with a graph break, what the second
graph sees depends on the Python between the two; under DDP's graph splitter or FSDP2, the inputs are
fake or distributed tensors that only dynamo's own context can trace. Those steps are traced in full.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.fx as fx

from autoremat.capture.aot import aot_backend, meta_traces_like_real
from autoremat.capture.blocks import skipped
from autoremat.capture.tracing import Restore
from autoremat.torch_internals import copy_dynamo_graph

if TYPE_CHECKING:
    from autoremat.planning.planner import CapturePlanner


@dataclass
class DynamoGraph:
    """One dynamo graph as dynamo handed it to the backend, before any pre-pass, with its example inputs."""

    gm: fx.GraphModule
    example_inputs: list

    def fresh(self) -> fx.GraphModule:
        """A copy a pre-pass may rewrite (`copy_dynamo_graph`)."""
        return copy_dynamo_graph(self.gm)


def keeping(backend: Callable, kept: list[DynamoGraph]) -> Callable:
    """`backend`, noting each dynamo graph it is given (a copy, before the pre-pass rewrites it) in `kept`."""
    def compile_one(gm: fx.GraphModule, example_inputs: list) -> Callable:
        kept.append(DynamoGraph(copy_dynamo_graph(gm), list(example_inputs)))
        return backend(gm, example_inputs)
    return compile_one


def one_plain_graph(model: torch.nn.Module, kept: list[DynamoGraph] | None) -> DynamoGraph | None:
    """The step's one dynamo graph, where it can be traced again without dynamo; else None (see above)."""
    if kept is None or len(kept) != 1 or skipped(model):
        return None
    plain = all(type(x) in (torch.Tensor, torch.nn.Parameter) for x in kept[0].example_inputs
                if isinstance(x, torch.Tensor))
    return kept[0] if plain else None


def trace_again(model: torch.nn.Module, compiler: str, planner: CapturePlanner, graph: DynamoGraph,
                errors: Callable[[], Any]) -> None:
    """Trace `graph` for `planner` as `compile_and_trace` would trace the step (its pre-pass, regions and
    compiler, capture only), from the dynamo graph kept: AOTAutograd and the profiles, no dynamo.

    `errors` is the context that hands our own errors raised inside the backend back unwrapped.
    """
    backend = planner.log.wrap(aot_backend(planner, compiler=compiler, pre_pass=planner.pre_pass,
                                           regions=planner.regions, release_grads=planner.release_grads,
                                           trace_only=True, same=planner.same))
    on_meta = any(p.is_meta for p in model.parameters())
    with errors(), Restore(model), torch.enable_grad(), \
            meta_traces_like_real() if on_meta else contextlib.nullcontext():
        backend(graph.fresh(), list(graph.example_inputs))
