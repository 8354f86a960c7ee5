"""Capture a model's training step as AOTAutograd joint graphs (forward + backward in one FX graph).

TorchDynamo traces the model's forward (splitting it at graph breaks), AOTAutograd traces each piece
jointly with its backward and hands the joint graph to a partition function. `aot_backend` builds a
`torch.compile` backend whose partition function is ours: it wraps each joint graph in a
`CapturedGraph` and asks a callback for the forward and backward modules. `capture` is the
read-only use of it: it records the joint graphs of one forward call and changes nothing.

    >>> import torch
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh())
    >>> graphs = capture(model, (torch.randn(2, 4),))
    >>> len(graphs), graphs[0].num_fwd_outputs
    (1, 1)
"""

from __future__ import annotations

import contextlib
import copy
import functools
import itertools
import os
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from autoremat.regions import LINKS, RegionLinks, compile_regions
from autoremat.torch_internals import (
    OpOverload,
    OpOverloadPacket,
    aot_autograd,
    composite_with_meta_kernel,
    default_partition,
    inductor_compilers,
    mark_boxed_call,
    meta_python_kernels_hidden,
    set_boxed_codegen,
)


@dataclass
class CapturedGraph:
    """One joint forward+backward graph and what AOTAutograd told us about it."""

    joint: fx.GraphModule
    num_fwd_outputs: int
    static_input_indices: list[int]  # primals that live across steps: parameters and buffers
    index: int  # order of this graph within the step (several when the model has graph breaks)
    device: str  # device of the traced tensors ("cpu", "cuda", "meta")
    links: RegionLinks | None = None  # for a region: how it connects to its neighbours (autoremat.regions)


PartitionCallback = Callable[[CapturedGraph], tuple[fx.GraphModule, fx.GraphModule]]
PrePass = Callable[[int, fx.GraphModule, list], None]  # (graph index, dynamo graph, example inputs)


def boxed_eager(gm: fx.GraphModule, example_inputs: Any) -> Callable:
    """Run an FX graph as Python, with boxed calling.

    The generated code takes one list, unpacks it and clears it, so each input (above all the
    tensors saved for backward) is freed after its last use instead of when the call returns.
    Without this a compiled step measured 259 MiB against 221 MiB eager on a 12-block
    transformer; with it, 221 MiB.
    """
    set_boxed_codegen(gm)
    gm.recompile()
    forward = gm.forward

    def run(args: list) -> Any:
        return forward(args)

    mark_boxed_call(run)
    return run


def _graph_device(gm: fx.GraphModule) -> str:
    for n in gm.graph.nodes:
        val = n.meta.get("val")
        if isinstance(val, torch.Tensor):
            return val.device.type
    return "cpu"


def _native_dropout(x: torch.Tensor, p: float, train: bool | None) -> Any:
    """Dropout as a random bool mask and a masked scale, so that the output can be recomputed.

    The mask is the only random value (1 byte per element, always saved); the output becomes a
    pure function of the input and the mask. On CPU this reproduces eager's dropout draw for draw:
    eager fills a noise tensor laid out like the input (`bernoulli_`, in memory order), divides it
    by 1 - p and multiplies; we draw the mask in the input's memory order, then compute the same
    products (checked bit for bit, transposed inputs too; where eager's x * 0 gives -0.0 or NaN for
    a dropped element, this gives +0.0). CUDA's fused kernel draws differently: left
    alone there, so dropout outputs are saved rather than recomputed on GPUs.
    """
    if x.device.type not in ("cpu", "meta") or train is False or p == 0 or x.numel() == 0:
        return NotImplemented
    if p >= 1:
        return torch.zeros_like(x), torch.zeros_like(x, dtype=torch.bool)
    order = sorted(range(x.dim()), key=lambda d: (-x.stride(d), d))  # outermost in memory first
    if not x.permute(order).is_contiguous():
        return NotImplemented  # overlapping or gapped layout: keep the fused op (saved, not recomputed)
    drawn = torch.ops.aten.bernoulli.p(torch.empty([x.shape[d] for d in order], dtype=torch.bool, device=x.device),
                                       1 - p)
    mask = drawn.permute([order.index(d) for d in range(x.dim())])
    # Eager multiplies by a noise tensor of 0 and 1 / (1 - p), the latter computed by the same div
    # kernel as `scale` here: x * scale where kept is the same product, bit for bit. Selecting with
    # the mask, rather than multiplying by a float copy of it, leaves the backward needing only the
    # bool mask (where's gradient), never a float noise tensor (measured: a saved or recomputed
    # float noise cost a full-size tensor at the attention backward's peak).
    scale = torch.div(torch.ones((), dtype=x.dtype, device=x.device), 1 - p)
    return torch.where(mask, torch.mul(x, scale), 0), mask


def _batch_norm_format(t: torch.Tensor) -> torch.memory_format:
    """The layout batch norm's kernels give their output: `input.suggest_memory_format()` (dense
    channels-last stays channels-last, anything else becomes contiguous)."""
    if t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last):
        return torch.channels_last
    if t.dim() == 5 and t.is_contiguous(memory_format=torch.channels_last_3d):
        return torch.channels_last_3d
    return torch.contiguous_format


def _contiguous_format(t: torch.Tensor) -> torch.memory_format:
    return torch.contiguous_format


def _in_kernel_layout(op: OpOverload, inputs: list[int],
                      kernel_format: Callable[[torch.Tensor], torch.memory_format]) -> Callable:
    """`op` traced on inputs laid out as its kernel lays out its output, so that traced strides are real.

    Some kernels choose their output's layout otherwise than their fake-tensor rule (on CPU, checked
    in tests/test_capture.py): batch norm returns `empty_like(input, input.suggest_memory_format())`,
    contiguous for a transposed (N, C, L) input, where the fake tensor keeps the transposed strides
    (and in the backward grad_out's); layer norm's backward returns a contiguous grad_input where
    the fake tensor follows a transposed grad_out. A view the graph takes of such an output fails at
    run time, or, turned into a reshape, copies bytes the memory model never saw (issue 12: 14%
    under-predicted). Copying `inputs` (positions; the first decides the layout) into that layout
    first makes fake and real strides agree; the copy is an ordinary graph node that the memory
    model counts, and the kernel would otherwise have made it or worked around it internally.
    """
    def decomposition(*args: Any, **kwargs: Any) -> Any:
        fmt = kernel_format(args[inputs[0]])
        if all(args[i].is_contiguous(memory_format=fmt) for i in inputs):
            return NotImplemented  # already in the kernel's layout: trace the op itself
        args = list(args)
        for i in inputs:
            args[i] = args[i].contiguous(memory_format=fmt)
        return op(*args, **kwargs)

    return decomposition


def _dropout_backward_as_on_cpu(grad: torch.Tensor, mask: torch.Tensor, scale: float) -> Any:
    """native_dropout_backward as the CPU kernel computes it, `grad * mask * scale`
    (aten/src/ATen/native/Dropout.cpp): its output keeps grad's layout, where the fake-tensor rule
    returns a contiguous tensor. Traced as those two multiplications, the fake strides are the
    real ones, and the kernel's grad-sized intermediate becomes a node the memory model sees."""
    if grad.device.type not in ("cpu", "meta"):
        return NotImplemented  # CUDA runs a fused kernel of its own
    return torch.mul(torch.mul(grad, mask), scale)


_aten = torch.ops.aten
# The eager compiler runs these ops as traced; inductor lowers them itself and picks its own strides.
LAYOUT_DECOMPOSITIONS = {
    **{op: _in_kernel_layout(op, [0], _batch_norm_format)
       for op in (_aten._native_batch_norm_legit_functional.default, _aten._native_batch_norm_legit_no_training.default,
                  _aten._native_batch_norm_legit.no_stats)},
    _aten.native_batch_norm_backward.default: _in_kernel_layout(_aten.native_batch_norm_backward.default, [1, 0],
                                                                _batch_norm_format),
    _aten.native_layer_norm_backward.default: _in_kernel_layout(_aten.native_layer_norm_backward.default, [1, 0],
                                                                _contiguous_format),
    _aten.native_dropout_backward.default: _dropout_backward_as_on_cpu,
}
DECOMPOSITIONS = {torch.ops.aten.native_dropout.default: _native_dropout}


def aot_backend(on_joint: PartitionCallback, compiler: str = "eager", pre_pass: PrePass | None = None,
                regions: bool = False) -> Callable:
    """A `torch.compile` backend that gives every joint graph to `on_joint` for partitioning.

    `compiler` is "eager" (run the FX graphs as Python, no C compiler needed) or "inductor".
    `pre_pass(index, gm, example_inputs)` sees (and may rewrite) each dynamo graph before
    AOTAutograd traces it: the precision stage casts there.
    """
    counter = itertools.count()
    compiling: dict[str, RegionLinks | None] = {"links": None}  # the region AOTAutograd is compiling now

    def partition_fn(
        joint: fx.GraphModule,
        joint_inputs: Any,
        *,
        num_fwd_outputs: int,
        static_lifetime_input_indices: list[int] | None = None,
        **_: Any,
    ) -> tuple[fx.GraphModule, fx.GraphModule]:
        cg = CapturedGraph(
            joint=joint,
            num_fwd_outputs=num_fwd_outputs,
            static_input_indices=list(static_lifetime_input_indices or []),
            index=next(counter),
            device=_graph_device(joint),
            links=compiling["links"],
        )
        return on_joint(cg)

    if compiler == "eager":
        inner = aot_autograd(fw_compiler=boxed_eager, bw_compiler=boxed_eager, partition_fn=partition_fn,
                             decompositions={**LAYOUT_DECOMPOSITIONS, **DECOMPOSITIONS})
    elif compiler == "inductor":
        fw_compiler, bw_compiler, inductor_table = inductor_compilers()
        # Inductor lowers only graphs decomposed with its own table; ours for dropout comes last.
        inner = aot_autograd(
            fw_compiler=fw_compiler,
            bw_compiler=bw_compiler,
            partition_fn=partition_fn,
            decompositions={**inductor_table, **DECOMPOSITIONS},
        )
    else:
        raise ValueError(f"compiler must be 'eager' or 'inductor', got {compiler!r}")
    if regions:  # one graph per repeated block: gradients leave the backward block by block
        aot = inner

        def one_region(gm: fx.GraphModule, example_inputs: list) -> Callable:
            compiling["links"] = gm.meta.get(LINKS)
            try:
                return aot(gm, example_inputs)
            finally:
                compiling["links"] = None

        inner = functools.partial(compile_regions, compile_one=one_region)
    if pre_pass is None:
        return inner
    graphs = itertools.count()

    def backend(gm: fx.GraphModule, example_inputs: list) -> Callable:
        pre_pass(next(graphs), gm, example_inputs)
        return inner(gm, example_inputs)

    return backend


def default_split(cg: CapturedGraph) -> tuple[fx.GraphModule, fx.GraphModule]:
    """PyTorch's own save-what-the-backward-reads partition (no recomputation)."""
    return default_partition(
        cg.joint,
        None,
        num_fwd_outputs=cg.num_fwd_outputs,
        static_lifetime_input_indices=cg.static_input_indices,
    )


def capture(model: Callable, example_inputs: tuple, example_kwargs: dict | None = None,
            pre_pass: PrePass | None = None) -> list[CapturedGraph]:
    """Trace one forward call of `model` and return its joint graphs, in execution order."""
    graphs: list[CapturedGraph] = []

    def record(cg: CapturedGraph) -> tuple[fx.GraphModule, fx.GraphModule]:
        kept = fx.GraphModule(cg.joint, copy.deepcopy(cg.joint.graph))
        graphs.append(CapturedGraph(kept, cg.num_fwd_outputs, cg.static_input_indices, cg.index, cg.device))
        return default_split(cg)

    backend = aot_backend(record, pre_pass=pre_pass)
    # A module goes through compile_fresh: its own dynamo cache, and meta models traced like real ones.
    compiled = compile_fresh(model, backend) if isinstance(model, torch.nn.Module) else torch.compile(
        model, backend=backend, dynamic=False)
    with torch.enable_grad():
        compiled(*example_inputs, **(example_kwargs or {}))
    return graphs


@functools.cache
def _composite_ops_with_meta_kernels() -> tuple[OpOverload, ...]:
    """aten ops that decompose on a real device but have a Python kernel of their own on meta."""
    found = []
    for name in dir(torch.ops.aten):
        packet = getattr(torch.ops.aten, name, None)
        if not isinstance(packet, OpOverloadPacket):
            continue
        for overload in packet.overloads():
            op = getattr(packet, overload)
            if composite_with_meta_kernel(op):
                found.append(op)
    return tuple(found)


@contextlib.contextmanager
def meta_traces_like_real() -> Iterator[None]:
    """Trace on meta through the same decompositions a real device takes.

    Under torch.compile the Python dispatcher prefers a Python Meta kernel over an op's
    CompositeImplicitAutograd decomposition. For nll_loss (cross_entropy) that kernel has no
    autograd formula, so the joint graph traced on meta had no backward at all, and its plan
    predicted a tenth of the real peak. Hiding those kernels while tracing makes the op decompose
    as it does on CPU and CUDA, backward included.
    """
    with meta_python_kernels_hidden(_composite_ops_with_meta_kernels()):
        yield


def compile_fresh(model: torch.nn.Module, backend: Callable) -> Callable:
    """`torch.compile(model)` with a cache of its own.

    Dynamo caches compiled graphs on the forward's code object, and a second compile of the same
    model with another backend can hit the first one's cache. Compiling a copy of the forward
    function (a new code object, same globals and closure) makes every plan trace afresh.
    """
    fn = model.forward.__func__ if hasattr(model.forward, "__func__") else type(model).forward
    code = fn.__code__.replace()  # equal, but a distinct object: a separate dynamo cache
    fresh = types.FunctionType(code, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    fresh.__kwdefaults__ = fn.__kwdefaults__
    fresh.__dict__.update(fn.__dict__)
    bound = types.MethodType(fresh, model)
    if fn.__code__.co_filename.startswith(_TORCH_DIR):
        # Dynamo does not trace a torch-internal forward (nn.Sequential's) as a frame of its own: it
        # wraps it in one `inner` function that every such compile shares, so their recompiles add
        # up against torch._dynamo.config.recompile_limit until the next one runs eagerly, unplanned.
        # A frame of our own, with a code object of its own, keeps each compile's count apart.
        bound = _own_frame(bound)
    if any(p.is_meta for p in model.parameters()):
        return _on_meta(_compile_fresh_bound(model, bound, backend))
    return _compile_fresh_bound(model, bound, backend)


_TORCH_DIR = os.path.dirname(torch.__file__)


def _own_frame(fn: Callable) -> Callable:
    def call(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    call.__code__ = call.__code__.replace()  # equal, but a distinct object: a separate dynamo cache
    return call


def _on_meta(compiled: Callable) -> Callable:
    def call(*args: Any, **kwargs: Any) -> Any:
        with meta_traces_like_real():
            return compiled(*args, **kwargs)

    return call


def _compile_fresh_bound(model: torch.nn.Module, bound: Callable, backend: Callable) -> Callable:
    if not _has_call_hooks(model):
        return torch.compile(bound, backend=backend, dynamic=False)

    # Calling the forward directly would skip the module's own hooks (FSDP2's fully_shard gathers
    # the root's parameters in a forward pre-hook). Run them around the fresh forward.
    def call(*args: Any, **kwargs: Any) -> Any:
        return _call_with_hooks(model, compiled_forward, args, kwargs)

    compiled_forward = torch.compile(bound, backend=backend, dynamic=False)
    return call


def _has_call_hooks(model: torch.nn.Module) -> bool:
    return bool(model._forward_pre_hooks or model._forward_hooks)


def _call_with_hooks(model: torch.nn.Module, forward: Callable, args: tuple, kwargs: dict) -> Any:
    """What nn.Module._call_impl does with the module's forward (pre-)hooks, around `forward`."""
    for hook_id, hook in list(model._forward_pre_hooks.items()):
        if hook_id in model._forward_pre_hooks_with_kwargs:
            result = hook(model, args, kwargs)
            if result is not None:
                args, kwargs = result
        else:
            result = hook(model, args)
            if result is not None:
                args = result if isinstance(result, tuple) else (result,)
    out = forward(*args, **kwargs)
    for hook_id, hook in list(model._forward_hooks.items()):
        if hook_id in model._forward_hooks_with_kwargs:
            result = hook(model, args, kwargs, out)
        else:
            result = hook(model, args, out)
        if result is not None:
            out = result
    return out
