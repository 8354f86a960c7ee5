"""Per-block compilation, for a forward that dynamo skips whole.

A graph break inside the loop over a model's blocks (an unsupported call, data-dependent control flow)
makes dynamo give up on the whole forward frame: it runs eagerly. Dynamo still compiles a block's own
forward as a frame of its own when that forward is user code, and autoremat plans those graphs. When the
blocks are torch's own modules (`nn.Sequential`, `nn.TransformerEncoderLayer`), dynamo does not compile
their frames either, and nothing is captured. Then each block of the model's largest run of identical
blocks is compiled on its own, as per-block `torch.compile` does, and the top-level code around the blocks
(embeddings, the loss) runs eagerly: those graphs are planned jointly, under the one budget, and the
memory the eager code holds is what the real-step verification measures and reserves.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from autoremat.capture.aot import fresh_forward, on_meta
from autoremat.torch_internals import compile_step, graph_break_reasons

# Models whose forward dynamo was seen to skip whole: their later traces compile per block at once.
_SKIPPED: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()


def repeated_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The children of the ModuleList / Sequential whose identical blocks (one class, two or more) hold the
    most parameters: the model's block loop. Empty if the model has no such container."""
    best: list[torch.nn.Module] = []
    best_size = -1
    for container in model.modules():
        if not isinstance(container, (torch.nn.ModuleList, torch.nn.Sequential)):
            continue
        blocks = list(container.children())
        if len(blocks) < 2 or len({type(b) for b in blocks}) != 1:
            continue
        size = sum(p.numel() for b in blocks for p in b.parameters())
        if size > best_size:
            best, best_size = blocks, size
    return best


def skipped(model: torch.nn.Module) -> bool:
    """Whether dynamo was seen to run this model's whole forward eagerly (`remember_skipped`)."""
    return model in _SKIPPED


def remember_skipped(model: torch.nn.Module) -> None:
    _SKIPPED.add(model)


def compile_blocks(model: torch.nn.Module, blocks: list[torch.nn.Module], backend: Callable) -> Callable:
    """A callable that runs `model` eagerly with each of `blocks` compiled by `backend`, each from a fresh
    copy of its forward's code (a dynamo cache of its own, as `aot.compile_fresh` does for the model)."""
    compiled = [compile_step(fresh_forward(block), backend) for block in blocks]

    def call(*args: Any, **kwargs: Any) -> Any:
        with _forwards(blocks, compiled):
            return model(*args, **kwargs)

    return on_meta(call) if any(p.is_meta for p in model.parameters()) else call


@contextmanager
def _forwards(blocks: list[torch.nn.Module], forwards: list[Callable]) -> Iterator[None]:
    """Each block's forward replaced for the call (an instance attribute: nn.Module.__call__ runs it between
    the block's own hooks), and put back after it."""
    had = [b.__dict__.get("forward") for b in blocks]
    for block, forward in zip(blocks, forwards, strict=True):
        block.forward = forward
    try:
        yield
    finally:
        for block, old in zip(blocks, had, strict=True):
            if old is None:
                del block.forward
            else:
                block.forward = old


class CaptureError(ValueError):
    """torch.compile could not capture the training step (no graph of it, or its trace failed on an op that
    eager PyTorch runs), so nothing could be planned."""


def no_graph_error(model: torch.nn.Module) -> CaptureError:
    """What to tell a user whose step dynamo captured no graph of (it would run eagerly, unplanned, past any
    budget)."""
    reasons = [r.splitlines()[0] for r in graph_break_reasons()][-3:]
    if skipped(model):
        return CaptureError(
            f"torch.compile captured no graph of {type(model).__name__}.forward, nor of its "
            f"{len(repeated_blocks(model))} blocks compiled one by one, so there is nothing to plan and the budget "
            "could not be held: dynamo ran them all eagerly. Remove the graph breaks it reports, or compile the "
            "model with fullgraph=True to see where they are." + (f" Graph breaks seen: {reasons}" if reasons else ""))
    return CaptureError(
        f"torch.compile captured no graph of {type(model).__name__}.forward, so there is nothing to plan and the "
        "budget could not be held: dynamo ran the whole forward eagerly, and the model has no repeated blocks (an "
        "nn.ModuleList or nn.Sequential of one module class) for autoremat to compile one by one. A graph break "
        "inside a loop (e.g. torch._dynamo.graph_break() or an unsupported call in `for w in self.weights:`) makes "
        "dynamo skip the frame. Remove the break, move it out of the loop, or put the loop body in a module of its "
        "own held in an nn.ModuleList." + (f" Graph breaks seen: {reasons}" if reasons else ""))
