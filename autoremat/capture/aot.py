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
import functools
import itertools
import os
import time
import types
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch
import torch.fx as fx

from autoremat.capture.captured import CapturedGraph
from autoremat.capture.graph_code import GraphCode, boxed_eager, called_at, code_of, same_code, tag
from autoremat.capture.regions import (
    LINKS,
    RegionLinks,
    compile_regions,
    region_key,
    release_gradients,
    with_stand_ins,
)
from autoremat.passes.decompositions import DECOMPOSITIONS, LAYOUT_DECOMPOSITIONS
from autoremat.passes.grad_upcast import fuse_gradient_upcasts
from autoremat.passes.matmul_accumulation import accumulate_into_matmuls
from autoremat.passes.rng_replay import replay_random_draws
from autoremat.passes.weight_casts import split_weight_casts
from autoremat.torch_internals import (
    OpOverload,
    OpOverloadPacket,
    aot_autograd,
    compile_step,
    composite_with_meta_kernel,
    copy_graph,
    default_partition,
    inductor_compilers,
    meta_python_kernels_hidden,
)


class SameRegions(Protocol):
    """A region identical to one compiled before (`regions.region_key`) takes that one's compiled code.

    `reused` answers for a region about to be traced (its graph index and links): the code compiled for
    an identical region (that code only, if `only` is given), after the planner has taken its profile,
    or None (then it is traced). `keep` offers the code compiled for a region that was traced.
    planning/same_regions.py implements both."""

    def reused(self, key: tuple, index: int, links: RegionLinks, gm: fx.GraphModule,
               only: Callable | None = None) -> Callable | None: ...

    def keep(self, key: tuple, compiled: Callable, gm: fx.GraphModule) -> None: ...


PartitionCallback = Callable[[CapturedGraph], tuple[fx.GraphModule, fx.GraphModule]]
PrePass = Callable[[int, fx.GraphModule, list], None]  # (graph index, dynamo graph, example inputs)


def _graph_device(gm: fx.GraphModule) -> str:
    for n in gm.graph.nodes:
        val = n.meta.get("val")
        if isinstance(val, torch.Tensor):
            return val.device.type
    return "cpu"




class CompileClock:
    """Seconds spent in Inductor's compilers in this process (the plan reports planning's share)."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def timed(self, compile_fn: Callable) -> Callable:
        @functools.wraps(compile_fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return compile_fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
        return run


COMPILE_CLOCK = CompileClock()


def aot_backend(on_joint: PartitionCallback, compiler: str = "eager", pre_pass: PrePass | None = None,
                regions: bool = False, release_grads: bool = True, trace_only: bool = False,
                same: SameRegions | None = None, codes: list | None = None) -> Callable:
    """A `torch.compile` backend that gives every joint graph to `on_joint` for partitioning.

    `compiler` is "eager" (run the FX graphs as Python, no C compiler needed) or "inductor".
    trace_only: the graphs are traced and profiled as `compiler` would see them (its decompositions and
    passes) but run as Python: a trace that is only profiled, never run as the step, does not pay for
    Inductor compiling its forward, seconds per graph.
    `pre_pass(index, gm, example_inputs)` sees (and may rewrite) each dynamo graph before
    AOTAutograd traces it: the precision stage casts there.
    same: a region identical to one compiled before reuses its code instead of being traced (regions only).
    Inductor compiles each region's backward on its first call and finds its forward's metadata by the
    order the regions were traced in (dynamo's DDPOptimizer context), which holds only while every compiled
    region's uses are one run: so Inductor's own code is reused from the region just before, in this graph.
    codes: under eager, each graph the trace calls is noted there as (index, links, GraphCode or None), in
    order, so that a plan can replace the code without a second trace (capture/graph_code.py).
    """
    # The region AOTAutograd is compiling now, its key for `same`, the parameters whose gradients it
    # releases early, and the index the next graph gets (a reused region takes one too).
    compiling: dict[str, Any] = {"links": None, "released": [], "key": None, "index": 0, "last": None, "code": None}
    in_runs = compiler == "inductor" and not trace_only  # Inductor's code: reused only from the region before

    def partition_fn(
        joint: fx.GraphModule,
        joint_inputs: Any,
        *,
        num_fwd_outputs: int,
        static_lifetime_input_indices: list[int] | None = None,
        **_: Any,
    ) -> tuple[fx.GraphModule, fx.GraphModule]:
        links = compiling["links"]
        split_weight_casts(joint)  # a 16-bit weight copy is cast again for the backward, not held
        accumulate_into_matmuls(joint)  # a gradient summed from products: no product held for the sum
        if compiler == "eager":  # Inductor lowers its own graphs: no Python calls, its own RNG handling
            compiling["released"] = _eager_passes(joint, num_fwd_outputs, static_lifetime_input_indices,
                                                  links if release_grads else None)
        cg = CapturedGraph(joint=joint, num_fwd_outputs=num_fwd_outputs,
                           static_input_indices=list(static_lifetime_input_indices or []), index=compiling["index"],
                           device=_graph_device(joint), links=compiling["links"], compiler=compiler,
                           region_key=compiling["key"])
        compiling["index"] += 1
        code = compiling["code"]
        return on_joint(cg) if code is None else code.partition(on_joint, cg)

    plain = _aot(compiler, trace_only, partition_fn)  # the compilers of a trace whose code is not noted

    def aot(gm: fx.GraphModule, example_inputs: list) -> Callable:  # one AOTAutograd call
        code = GraphCode() if codes is not None and compiler == "eager" else None
        compiling["code"] = code
        try:
            compiled = (plain if code is None else _aot(compiler, trace_only, partition_fn, code))(gm, example_inputs)
        finally:
            compiling["code"] = None
        if code is None:
            return compiled
        codes.append((code.cg.index if code.cg else None, compiling["links"], code))  # None: not partitioned
        return tag(compiled, code)

    def inner(gm: fx.GraphModule, example_inputs: list) -> Callable:  # the graph whole, as one call
        return called_at(aot(gm, example_inputs), compiling["index"] - 1)

    if regions:  # one graph per repeated block: gradients leave the backward block by block
        def one_region(gm: fx.GraphModule, example_inputs: list) -> Callable:
            links = gm.meta.get(LINKS)
            key = region_key(gm, example_inputs) if same is not None else None  # None outside a cut graph
            if key is not None:
                key = (compiler, trace_only, release_grads, key)
                only = compiling["last"] if in_runs else None
                may_reuse = not in_runs or only is not None  # Inductor's code: none before the first region
                if may_reuse and (hit := same.reused(key, compiling["index"], links, gm, only=only)) is not None:
                    if codes is not None:
                        codes.append((compiling["index"], links, code_of(hit)))
                    compiling["index"] += 1
                    compiling["last"] = hit
                    return called_at(hit, compiling["index"] - 1)
            compiling["links"], compiling["released"], compiling["key"] = links, [], key
            try:
                compiled = aot(gm, example_inputs)
                released = compiling["released"]
            finally:
                compiling["links"], compiling["released"], compiling["key"] = None, [], None
            compiled = same_code(with_stand_ins(compiled, released), compiled) if released else compiled
            if key is not None:
                same.keep(key, compiled, gm)
            compiling["last"] = compiled
            return called_at(compiled, compiling["index"] - 1)

        inner = functools.partial(compile_regions, compile_one=one_region)  # type: ignore[assignment]
    if pre_pass is None:
        return inner
    graphs = itertools.count()

    def backend(gm: fx.GraphModule, example_inputs: list) -> Callable:
        pre_pass(next(graphs), gm, example_inputs)
        return inner(gm, example_inputs)

    return backend


def _eager_passes(joint: fx.GraphModule, num_fwd_outputs: int, static: list[int] | None,
                  links: RegionLinks | None) -> list[int]:
    """The rewrites of a joint graph that eager's Python code needs; returns the parameters whose gradients
    the region releases early (with `links`: regions.release_gradients)."""
    replay_random_draws(joint)
    fuse_gradient_upcasts(joint)  # a 16-bit weight gradient written into fp32 rows, no whole copy
    if links is None:
        return []
    return release_gradients(joint, num_fwd_outputs, set(static or []), links.shared)


def _aot(compiler: str, trace_only: bool, partition_fn: Callable, code: GraphCode | None = None) -> Callable:
    """AOTAutograd with our partition function, the decompositions and compilers of `compiler` (under eager,
    `code`'s, which a plan may swap later)."""
    if compiler == "eager":
        fw_compiler, bw_compiler = (code.forward_compiler, code.backward_compiler) if code else (boxed_eager, boxed_eager)
        return aot_autograd(fw_compiler=fw_compiler, bw_compiler=bw_compiler, partition_fn=partition_fn,
                            decompositions={**LAYOUT_DECOMPOSITIONS, **DECOMPOSITIONS})
    if compiler == "inductor":
        fw_compiler, bw_compiler, inductor_table = inductor_compilers()
        fw_compiler, bw_compiler = (boxed_eager, boxed_eager) if trace_only else (
            COMPILE_CLOCK.timed(fw_compiler), COMPILE_CLOCK.timed(bw_compiler))
        # Inductor lowers only graphs decomposed with its own table; ours for dropout comes last.
        return aot_autograd(fw_compiler=fw_compiler, bw_compiler=bw_compiler, partition_fn=partition_fn,
                            decompositions={**inductor_table, **DECOMPOSITIONS})
    raise ValueError(f"compiler must be 'eager' or 'inductor', got {compiler!r}")


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
        kept = fx.GraphModule(cg.joint, copy_graph(cg.joint.graph))
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
    bound = fresh_forward(model)
    if any(p.is_meta for p in model.parameters()):
        return on_meta(_compile_fresh_bound(model, bound, backend))
    return _compile_fresh_bound(model, bound, backend)


_TORCH_DIR = os.path.dirname(torch.__file__)


def fresh_forward(module: torch.nn.Module) -> Callable:
    """`module.forward` bound from a copy of its function: the same code, in a distinct code object, so a
    dynamo cache of its own (`compile_fresh`)."""
    fn = module.forward.__func__ if hasattr(module.forward, "__func__") else type(module).forward
    code = fn.__code__.replace()  # equal, but a distinct object: a separate dynamo cache
    fresh = types.FunctionType(code, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    fresh.__kwdefaults__ = fn.__kwdefaults__
    fresh.__dict__.update(fn.__dict__)
    bound = types.MethodType(fresh, module)
    if fn.__code__.co_filename.startswith(_TORCH_DIR):
        # Dynamo does not trace a torch-internal forward (nn.Sequential's) as a frame of its own: it
        # wraps it in one `inner` function that every such compile shares, so their recompiles add
        # up against torch._dynamo.config.recompile_limit until the next one runs eagerly, unplanned.
        # A frame of our own, with a code object of its own, keeps each compile's count apart.
        return _own_frame(bound)
    return bound


def _own_frame(fn: Callable) -> Callable:
    def call(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    call.__code__ = call.__code__.replace()  # equal, but a distinct object: a separate dynamo cache
    return call


def on_meta(compiled: Callable) -> Callable:
    def call(*args: Any, **kwargs: Any) -> Any:
        with meta_traces_like_real():
            return compiled(*args, **kwargs)

    return call


def _compile_fresh_bound(model: torch.nn.Module, bound: Callable, backend: Callable) -> Callable:
    if not _has_call_hooks(model):
        return compile_step(bound, backend)

    # Calling the forward directly would skip the module's own hooks (FSDP2's fully_shard gathers
    # the root's parameters in a forward pre-hook). Run them around the fresh forward.
    def call(*args: Any, **kwargs: Any) -> Any:
        return _call_with_hooks(model, compiled_forward, args, kwargs)

    compiled_forward = compile_step(bound, backend)
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
