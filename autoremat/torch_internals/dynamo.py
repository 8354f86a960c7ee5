"""Private torch APIs: fake tensors and dynamo: compile ids, graph breaks, errors, region compilation (listed in the package docstring)."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
from collections.abc import Callable, Iterator

import torch
import torch.fx as fx
from torch._dynamo.exc import BackendCompilerFailed, TorchRuntimeError
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily

__all__ = ["BackendCompilerFailed", "compile_step", "FAKE_TENSOR_LOGGER", "FakeTensorMode", "TorchRuntimeError", "compile_submodules", "compiled_autograd_on", "copy_dynamo_graph", "copy_split_metadata", "ddp_optimizer_active", "detect_fake_mode", "dynamo_compile_id", "dynamo_reset", "graph_break_reasons", "fake_run_failure", "is_dynamo_error", "is_inductor_error", "recompile_limit", "tracing_like_dynamo", "unset_fake_temporarily"]


# -- fake tensors ------------------------------------------------------------------------------

FAKE_TENSOR_LOGGER = "torch._subclasses.fake_tensor"


def detect_fake_mode(inputs: list) -> FakeTensorMode | None:
    from torch._dynamo.utils import detect_fake_mode as detect

    return detect(inputs)


# -- dynamo ------------------------------------------------------------------------------------

def recompile_limit() -> int:
    return torch._dynamo.config.recompile_limit


def dynamo_reset() -> None:
    torch._dynamo.reset()


def graph_break_reasons() -> list[str]:
    """The graph-break reasons dynamo has counted in this process, oldest first."""
    return list(torch._dynamo.utils.counters["graph_break"])


def dynamo_compile_id(gm: fx.GraphModule) -> tuple[int, int] | None:
    """(frame id, how many times that frame was compiled before this graph), or None if unknown."""
    cid = gm.meta.get("dynamo_compile_id")
    return None if cid is None else (cid.frame_id, cid.frame_compile_id)


def is_dynamo_error(e: BaseException) -> bool:
    """An exception dynamo raised itself (wrapping the user's), not the user's own."""
    return type(e).__module__.startswith("torch._dynamo")


_FAILED_NODE = re.compile(r"failed to run FX node with fake tensors: (call_\w+) (.*?)\(\*")
_CALLABLE_NAME = re.compile(r"<(?:built-in (?:method|function)|function|method) ([\w.]+)")
_TORCH_DIR = os.path.dirname(torch.__file__)


def fake_run_failure(e: BaseException) -> tuple[str | None, str | None]:
    """For dynamo's TorchRuntimeError (an FX node its fake-tensor run failed on): the node's op as a
    short name (`mul`, `Tensor.view`, `mylib.my_op.default`) and where the user's code called it
    (`file.py:12: code`), each None where the error does not say. Read from the error's text (dynamo's
    "failed to run FX node with fake tensors: <op kind> <target>(*args...)") and its `real_stack`, the
    user's stack at the failing call."""
    op = where = None
    m = _FAILED_NODE.search(str(e))
    if m:
        kind, target = m.groups()
        named = _CALLABLE_NAME.match(target)
        op = named.group(1) if named else target
        op = f"Tensor.{op}" if kind == "call_method" else op
    stack = getattr(e, "real_stack", None) or []
    frames = [f for f in stack if not f.filename.startswith(_TORCH_DIR)]
    if frames:
        f = frames[-1]
        where = f"{os.path.basename(f.filename)}:{f.lineno}" + (f": {f.line.strip()}" if f.line else "")
    return op, where


def is_inductor_error(e: BaseException) -> bool:
    """An exception Inductor raised (its C++ build failing, a lowering missing), not dynamo's or the user's."""
    return type(e).__module__.startswith("torch._inductor")


def ddp_optimizer_active() -> bool:
    """DDP's graph splitter (torch._dynamo.config.optimize_ddp) is compiling the current graph."""
    context = torch._guards.TracingContext.try_get()
    return getattr(context, "ddp_optimizer_ctx", None) is not None


def compiled_autograd_on() -> bool:
    """Compiled autograd configured (torch._dynamo.config.compiled_autograd) or running (its context,
    torch._dynamo.compiled_autograd.compiled_autograd_enabled): the backward is then traced from the graph
    AOTAutograd kept for each compiled function, not run through the function's compiled backward. Cheap: a
    swapped forward asks on every call (capture/graph_code.py), and nothing is imported here."""
    running = sys.modules.get("torch._dynamo.compiled_autograd")  # never imported: never enabled
    return bool(torch._dynamo.config.compiled_autograd or (running is not None and running.compiled_autograd_enabled))


def copy_split_metadata(gm: fx.GraphModule, cut: fx.GraphModule) -> None:
    """Give the submodules of `cut` (a split_module of `gm`) the dynamo source and meta of `gm`; every
    submodule gets the one meta dict of `gm`."""
    from torch._dynamo.backends.distributed import propagate_dynamo_source, propagate_metadata

    propagate_dynamo_source(gm, cut)
    propagate_metadata(gm, cut)


def compile_submodules(cut: fx.GraphModule, compile_one: Callable, example_inputs: list) -> None:
    """Compile each submodule of `cut` with `compile_one` and swap it in, in order, on fake inputs.

    dynamo's DDP optimizer does the same per gradient bucket: the interpreter runs the cut graph,
    compiling each submodule as it reaches it (the outputs of those before it as example inputs).
    """
    from torch._dynamo.backends.distributed import SubmodCompiler

    fake_mode = detect_fake_mode(example_inputs) or FakeTensorMode()
    SubmodCompiler(cut, compile_one, fake_mode).run(*example_inputs)


def copy_dynamo_graph(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of a dynamo graph a pass may rewrite: new nodes (`aot.copy_graph`), the same attributes (those
    dynamo set on its module too), its module-level meta, and each input's dynamo source (a Node attribute, not in its meta: the region
    splitter's `propagate_dynamo_source` reads it)."""
    from autoremat.torch_internals.aot import copy_graph

    copy = fx.GraphModule(gm, copy_graph(gm.graph))
    copy.meta.update(gm.meta)
    for name, value in vars(gm).items():  # what dynamo set on its module (`_param_name_to_source`, ...)
        vars(copy).setdefault(name, value)
    for old, new in zip(gm.graph.find_nodes(op="placeholder"), copy.graph.find_nodes(op="placeholder")):
        if hasattr(old, "_dynamo_source"):
            new._dynamo_source = old._dynamo_source
    return copy


@contextlib.contextmanager
def tracing_like_dynamo() -> Iterator[None]:
    """The context dynamo runs a backend in: a TracingContext with a fake mode of its own.

    A dynamo graph traced again without dynamo (planning.dynamo_graphs) must see what a backend sees. Not
    only AOTAutograd and the region splitter read the context's fake mode: FX's dead-code elimination
    keeps a random op alive outside one (`Graph.eliminate_dead_code` treats seeded ops as impure unless a
    TracingContext says Inductor's `fallback_random` is off), so a partition made outside it carried an
    unused attention forward into the backward.
    """
    from torch._guards import TracingContext, tracing

    with tracing(TracingContext(FakeTensorMode())):
        yield


# The logging.Logger methods that only emit a record (and return None), and those libraries add beside them
# (transformers' `warning_once`): the ones a compiled step may skip. Methods that answer something
# (`isEnabledFor`, `getEffectiveLevel`) are not among them.
_EMITTING = ("debug", "info", "warning", "warn", "error", "exception", "critical", "fatal", "log")

# Dynamo's per-code recompile limit as autoremat's own compiles see it. Each plan compiles the model afresh (a
# code object of its own for the forward: capture/aot.fresh_forward), but frames dynamo compiles apart from it
# (after a graph break, or a function shared by many modules, like transformers' deprecation wrapper) keep one
# code object across plans and gather an entry per plan: past torch's limit of 8 such a frame runs eagerly,
# unplanned, and a plan made around it no longer matches the step. 64 leaves room for many plans of one model
# in one process (a floor query, a fit search) while a frame that recompiles on every call (a forward that
# changes a global dynamo guards on) still stops recompiling, and keeping compiled code, after a bounded number.
OWN_RECOMPILE_LIMIT = 64


def compile_step(fn: Callable, backend: Callable) -> Callable:
    """`torch.compile(fn, backend=backend, dynamic=False)` for autoremat's own compiles. Every call runs with

    - `logging.Logger` calls that emit a record traced as no-ops (torch._dynamo.config.ignore_logging_functions), not as graph
      breaks. A log call computes nothing the step's tensors depend on, but dynamo splits the graph at one: a
      warning between a model's vocabulary projection and its loss (transformers warns there about an unset
      `loss_type`) puts them in two graphs, and the loss region is then never seen whole. The compiled step
      does not emit the message; the model's eager forward still does.
    - dynamo's recompile limits raised to OWN_RECOMPILE_LIMIT (see there). Past it dynamo runs the frame
      eagerly, as it does past its own limit, and autoremat says so where it reuses a plan."""
    compiled = torch.compile(fn, backend=backend, dynamic=False)
    methods = {getattr(logging.Logger, name) for name in dir(logging.Logger)
               if name in _EMITTING or name.startswith(tuple(f"{e}_" for e in _EMITTING))}
    config = torch._dynamo.config
    # torch 2.13 names the set ignore_logging_functions (ignore_logger_methods, its older name, is an alias)
    ignored = "ignore_logging_functions" if hasattr(config, "ignore_logging_functions") else "ignore_logger_methods"
    limits = [name for name in ("recompile_limit", "accumulated_recompile_limit") if hasattr(config, name)]

    def call(*args, **kwargs):
        patch = {ignored: set(getattr(config, ignored)) | methods,
                 **{name: max(getattr(config, name), OWN_RECOMPILE_LIMIT) for name in limits}}
        with config.patch(patch):
            return compiled(*args, **kwargs)

    return call
