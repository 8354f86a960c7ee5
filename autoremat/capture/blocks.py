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
    compiled = [torch.compile(fresh_forward(block), backend=backend, dynamic=False) for block in blocks]

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
