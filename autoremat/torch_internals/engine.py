"""Private torch APIs: the profiler's allocator events and the autograd engine's callbacks, CUDA's BLAS workspaces (listed in the package docstring)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["StorageWeakRef", "WeakIdKeyDictionary", "accumulate_into_grad", "allocation_events", "backward_entry_code", "clear_blas_workspaces", "engine_will_run", "gradient_node", "graph_task_id", "in_backward", "profiler_enabled", "queue_callback", "saved_tensors_by_origin", "SavedTensors"]


# -- profiler and autograd engine --------------------------------------------------------------

def profiler_enabled() -> bool:
    return bool(torch._C._autograd._profiler_enabled())


def backward_entry_code() -> Any:
    """The code object of the Python function every `.backward()` / `autograd.grad` runs the C++ engine from:
    its return is the first moment after a backward that is outside the engine."""
    return torch.autograd.graph._engine_run_backward.__code__


def in_backward() -> bool:
    """Whether this code runs inside the autograd engine (a node of a backward is executing)."""
    return torch._C._current_autograd_node() is not None


def allocation_events(prof: torch.profiler.profile) -> Iterator[tuple[int, int, torch.device]]:
    """(start time ns, signed bytes, device) of every allocation (+) and free (-) a stopped profiler saw."""
    kineto_results = prof.profiler.kineto_results if prof.profiler is not None else None
    if kineto_results is None:
        raise RuntimeError(
            "profiler produced no results (was it stopped by someone else?)"
        )
    alloc_tag = torch._C._profiler._EventType.Allocation
    # allocation events are nested under the op that made them, so walk the whole tree;
    # iteratively, since the depth is up to the callers' nesting
    stack = list(kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if node.tag == alloc_tag:
            ef = node.extra_fields
            yield node.start_time_ns, int(ef.alloc_size), ef.device
        stack.extend(node.children)


# AOTAutograd's autograd.Function for a compiled graph: its backward node's class name
_COMPILED_GRAPH_NODE = "CompiledFunctionBackward"


def _compiled_graph_node(node: Any) -> bool:
    return type(node).__name__ == _COMPILED_GRAPH_NODE


def _saved_by(node: Any) -> Iterator[torch.Tensor]:
    """What autograd saved for `node`'s backward, read without unpacking it: each SavedTensor of a built-in
    op's `_raw_saved_*` attributes, or of a custom Function's `_raw_saved_tensors`, gives its tensor (`data`).
    One a saved-tensors hook packed (a non-reentrant checkpoint's, which would recompute its region to
    unpack it) holds what its hook kept, which is not read: verification measures it."""
    for name in dir(node):
        if not name.startswith("_raw_saved_"):
            continue
        try:
            value = getattr(node, name)
        except RuntimeError:  # already freed by a backward
            continue
        for saved in value if isinstance(value, (tuple, list)) else (value,):
            if getattr(saved, "unpack_hook", None) is None and isinstance(data := getattr(saved, "data", None), torch.Tensor):
                yield data


class SavedTensors(NamedTuple):
    """What autograd saved on the way to a step's outputs, by who saved it."""

    before_a_graph: list[torch.Tensor]  # by ops outside the compiled graphs whose output a later graph reads
    after_the_graphs: list[torch.Tensor]  # by ops outside them that no graph reads from (a loss after the last)
    by_graphs: list[torch.Tensor]  # by compiled graphs, for their own backward


def _walk(starts: list[Any]) -> dict[int, Any]:
    """Every autograd node reachable from `starts`, by id; held, so that no id is reused by another node's
    Python object while the walk runs (they are made as they are reached)."""
    stack, seen = list(starts), {}
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen[id(node)] = node
        stack += [f for f, _ in node.next_functions]
    return seen


def saved_tensors_by_origin(roots: list[torch.Tensor]) -> SavedTensors:
    """Every tensor autograd saved on the way to `roots` (the autograd graph walked from their nodes), by
    who saved it. An op outside the graphs is before a graph when the graph's node reaches it. Only valid
    before the backward frees what was saved."""
    nodes = _walk([t.grad_fn for t in roots if t.grad_fn is not None])
    compiled = {key for key, n in nodes.items() if _compiled_graph_node(n)}
    below = _walk([f for key in compiled for f, _ in nodes[key].next_functions])
    out = SavedTensors([], [], [])
    for key, node in nodes.items():
        kind = out.by_graphs if key in compiled else out.before_a_graph if key in below else out.after_the_graphs
        kind.extend(_saved_by(node))
    return out


def queue_callback(callback: Callable[[], None]) -> None:
    """Run `callback` when the autograd engine finishes the backward it is running now."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def gradient_node(t: torch.Tensor) -> Any:
    """The autograd node a gradient of `t` flows into: a leaf's AccumulateGrad."""
    return torch.autograd.graph.get_gradient_edge(t).node


def engine_will_run(node: Any) -> bool:
    """Whether the backward now running will execute `node` (only valid inside a backward)."""
    return torch._C._will_engine_execute_node(node)


def graph_task_id() -> int:
    """The id of the backward running now (ids only grow), or -1 outside a backward."""
    return torch._C._current_graph_task_id()


def accumulate_into_grad(leaf: torch.Tensor, grad: torch.Tensor) -> None:
    """Run `leaf`'s AccumulateGrad node with `grad` through the autograd engine, re-entrantly when called
    inside a backward: `.grad` is added to and every hook on the node or the tensor fires, as
    `torch.autograd.backward(leaf, grad)` does. That wrapper first checks its arguments in Python
    (shapes, dtypes, symbolic sizes): most of the call's time (benchmarks/fx_overhead.py's
    `hand_off_cost`), paid once per parameter per backward; `grad` is a gradient the graph computed for `leaf`, of its shape and dtype already."""
    torch.autograd.Variable._execution_engine.run_backward(
        (leaf,), (grad,), False, False, (), allow_unreachable=True, accumulate_grad=True)


def clear_blas_workspaces() -> None:
    torch._C._cuda_clearCublasWorkspaces()
