"""Every private PyTorch API autoremat uses, in one place, so a torch release that breaks one breaks here.

No other module of autoremat touches `torch._*`, `torch.utils._*`, private attributes or private
naming conventions of torch; they import what they need from this module, which imports nothing from
autoremat. tests/test_torch_internals.py exercises each name below on the installed torch, so a
release that moves or changes one fails a test named after it. Checked on torch 2.11.0 and 2.13.0
(`.ci/run` runs that test on both).

AOTAutograd (joint graphs, partitioning):
  aot_autograd                 torch._dynamo.backends.common: the dynamo backend that traces a joint graph
  default_partition            torch._functorch.partitioners: torch's save-what-the-backward-reads split,
                               what the capture pass hands back while it only records graphs
  extract_fwd_bwd_modules      torch._functorch.partitioners._extract_fwd_bwd_modules: cut a joint
                               graph at a given set of saved values (passes.split); its keyword
                               arguments differ between releases, so only those it takes are passed
  set_boxed_codegen            torch.fx.graph._BoxedCodeGen: generated code takes one list and clears
                               it, so saved tensors die after their last use (capture.boxed_eager)
  copy_graph                   fx.Graph's `_tracer_cls` and `_codegen`: a copy of a graph that shares its
                               code generator (Graph.__deepcopy__ deep-copies it, and copying its
                               pytree specs fires torch's own LeafSpec FutureWarning in 2.11-2.13)
  mark_boxed_call              the `_boxed_call` attribute: AOTAutograd then calls a compiled function
                               with one list of inputs (boxed), which it may clear
  TANGENTS_BOXED               torch.autograd.Function.boxed_grads_call exists (2.13): a compiled
                               backward's tangents die after their last use, not when it returns
  is_primal, is_tangent        the joint graph's placeholder names `primals_*` / `tangents_*`
  mutated_input_indices        the output node's meta["desc"]: the class name InputMutationAOTOutput
                               and its `mutated_input.idx`, which forward outputs are input mutations
  is_sym_node                  torch.fx.experimental.proxy_tensor: symbolic-size nodes are saved apart
Dispatcher and ops:
  OpOverload, OpOverloadPacket torch._ops: what an aten call's target is
  is_mutable_op                OpOverload._schema.is_mutable
  out_kernel_copies            torch._C._dispatch_has_kernel_for_dispatch_key: an out= overload whose only
                               kernel is the generated CompositeExplicitAutograd wrapper (mul.Scalar_out)
                               runs the functional op and copies its result into `out` (passes/reuse.py)
  meta_python_kernels_hidden   OpOverload.py_kernels[DispatchKey.Meta] and _dispatch_cache, with
  composite_with_meta_kernel   torch._C._dispatch_has_kernel_for_dispatch_key and torch._meta_registrations:
                               hide the Python meta kernels of composite ops so meta traces decompose
                               like real devices (capture.meta_traces_like_real)
  inductor_compilers           torch._inductor.compile_fx.compile_fx_inner, decomposition.select_decomp_table;
                               each compile runs with config.cpp.simdlen pinned to the vector width
                               Inductor picks here (cpu_vec_isa.pick_vec_isa, which reads
                               ATEN_CPU_CAPABILITY): the FX graph cache keys on the config but not on that
                               variable, so without the pin a kernel cached under one capability is
                               reused, and fails to build, under another ('at::vec' has not been declared);
                               and with config.layout_optimization off: on a graph with convolutions it
                               lays intermediates out channels-last, also the values a graph hands to the
                               next one (regions), and a dropout traced on such an input draws its mask in
                               that memory order, not in eager's (the masks were not eager's);
                               and with torch._inductor.memory.reorder_for_peak_memory trying only its
                               least-peak-first sort (`topological_sort_lpmf`) beside the graph's own
                               order: the two the memory model replays (inplace.least_peak_first). Its
                               other two sorts (bfs, dfs) work on Inductor's fused kernels, whose
                               grouping the model does not know; on speed.py's GPT-2 with dropout the
                               backward ran the bfs order (Inductor's estimate 307,656 B against lpmf's
                               310,016), measured 2,652 B over the model's peak
  inductor_kernel_probe        torch._functorch.aot_autograd.aot_function: one tiny pointwise+reduction
                               kernel through those compilers, no dynamo (safe inside a backend's call)
  inductor_cpp_compiler        torch._inductor.cpp_builder.get_cpp_compiler: the C++ compiler Inductor's
                               CPU backend would call (config.cpp.cxx, from $CXX); raises if none is found
  has_triton                   torch.utils._triton.has_triton: Triton importable for this device
  inductor_realize_reads_threshold  torch._inductor.config.realize_reads_threshold: how many readers
                               a pointwise value may have before Inductor writes it out (fusion)
  C_NN_LINEAR                  torch._C._nn.linear: F.linear's builtin, as dynamo records it (precision)
  arg_tree_leaves, tree_leaves, torch.utils._pytree: flatten and map nested inputs and outputs (the
  tree_flatten, tree_map       output node's args, a step's arguments, a model's outputs)
Fake tensors and storages:
  unset_fake_temporarily, FakeTensorMode, detect_fake_mode   run real kernels while tracing (profile);
                               the fake mode the region compiler runs in (regions)
  StorageWeakRef               torch.multiprocessing.reductions: which values share one allocation
  is_traceable_wrapper_subclass  torch.utils._python_dispatch: tensor subclasses (DTensor) in measure
  FAKE_TENSOR_LOGGER           the logger name torch._subclasses.fake_tensor (its traceback is silenced)
Dynamo:
  recompile_limit, dynamo_reset, graph_break_reasons   torch._dynamo.config.recompile_limit,
                               torch._dynamo.reset, torch._dynamo.utils.counters["graph_break"]
  dynamo_compile_id            the graph's meta["dynamo_compile_id"] (frame_id, frame_compile_id)
  BackendCompilerFailed, TorchRuntimeError, is_dynamo_error   torch._dynamo.exc and its module name
  is_inductor_error            an exception class from torch._inductor (CppCompileError, ...), by module name
  ddp_optimizer_active         torch._guards.TracingContext.try_get().ddp_optimizer_ctx: DDP's
                               graph splitter has already cut this graph
  copy_split_metadata,         torch._dynamo.backends.distributed: propagate_dynamo_source and
  compile_submodules           propagate_metadata onto a split graph's submodules; SubmodCompiler to
                               compile each region of it as the interpreter reaches it
Profiler and autograd engine:
  profiler_enabled             torch._C._autograd._profiler_enabled
  allocation_events            torch._C._profiler._EventType.Allocation, prof.profiler.kineto_results
                               and its experimental_event_tree(): (time, signed bytes, device) per event
  queue_callback               torch.autograd.Variable._execution_engine.queue_callback: run at the
                               end of the current backward
  WeakIdKeyDictionary          torch.utils.weak (undocumented): tensors as weak keys by identity, for
                               the parameter behind each stand-in a region is called with (regions)
  engine_will_run, gradient_node   torch._C._will_engine_execute_node and
                               torch.autograd.graph.get_gradient_edge: whether the running backward
                               executes a parameter's AccumulateGrad (it accumulates into .grad)
  graph_task_id                torch._C._current_graph_task_id: which backward is running (a counter,
                               -1 outside one), so a fact about it is looked up once per backward
CUDA:
  clear_blas_workspaces        torch._C._cuda_clearCublasWorkspaces (CUDA builds only): free every cuBLAS and
                               cuBLASLt workspace, so the next matmul of a thread allocates its own afresh
                               (tests measure devices.blas_workspace_bytes with it)
  accumulate_into_grad         Variable._execution_engine.run_backward on a leaf and its gradient: what
                               torch.autograd.backward(leaf, grad) runs, without its Python argument
                               checks (regions.accumulate_grad, once per parameter per backward)

Not listed, and used in place: the FX node meta keys torch.fx documents and every FX pass reads
("val", "example_value", "nn_module_stack", "fwd_nn_module_stack", "from_node").
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.fx as fx
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.exc import BackendCompilerFailed, TorchRuntimeError
from torch._functorch.partitioners import _extract_fwd_bwd_modules, default_partition
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily
from torch.fx.experimental.proxy_tensor import is_sym_node
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import is_traceable_wrapper_subclass
from torch.utils.weak import WeakIdKeyDictionary

__all__ = [
    "BackendCompilerFailed", "C_NN_LINEAR", "arg_tree_leaves", "FAKE_TENSOR_LOGGER", "FakeTensorMode", "OpOverload", "OpOverloadPacket",
    "StorageWeakRef", "TANGENTS_BOXED", "TorchRuntimeError", "aot_autograd", "allocation_events",
    "composite_with_meta_kernel", "out_kernel_copies", "compile_submodules", "copy_graph", "copy_split_metadata", "ddp_optimizer_active", "default_partition",
    "detect_fake_mode", "dynamo_compile_id", "dynamo_reset", "extract_fwd_bwd_modules", "graph_break_reasons",
    "has_triton", "inductor_compilers", "inductor_cpp_compiler", "inductor_kernel_probe", "inductor_realize_reads_threshold", "is_dynamo_error", "is_inductor_error", "is_mutable_op", "is_primal", "is_sym_node", "is_tangent",
    "is_traceable_wrapper_subclass", "mark_boxed_call", "meta_python_kernels_hidden", "mutated_input_indices", "profiler_enabled",
    "queue_callback", "recompile_limit", "set_boxed_codegen", "tree_flatten", "tree_leaves", "tree_map", "unset_fake_temporarily",
    "WeakIdKeyDictionary", "engine_will_run", "gradient_node", "graph_task_id", "accumulate_into_grad",
]

# -- AOTAutograd -------------------------------------------------------------------------------

_EXTRACT_PARAMS = set(inspect.signature(_extract_fwd_bwd_modules).parameters)


def extract_fwd_bwd_modules(joint: fx.GraphModule, saved: list[fx.Node], saved_sym: list[fx.Node], *,
                            num_fwd_outputs: int, static_lifetime_input_nodes: set[fx.Node]):
    """Forward and backward modules of `joint` that hand `saved` (and `saved_sym`) from one to the other."""
    kwargs: dict[str, Any] = {"num_fwd_outputs": num_fwd_outputs}
    if "static_lifetime_input_nodes" in _EXTRACT_PARAMS:
        kwargs["static_lifetime_input_nodes"] = static_lifetime_input_nodes
    if "ignore_must_be_in_fw_bw" in _EXTRACT_PARAMS:
        kwargs["ignore_must_be_in_fw_bw"] = True  # our schedule decides placement
    return _extract_fwd_bwd_modules(joint, saved, saved_sym, **kwargs)


def set_boxed_codegen(gm: fx.GraphModule) -> None:
    """Make `gm`'s generated forward take one list of inputs and clear it as it unpacks it."""
    gm.graph.set_codegen(torch.fx.graph._BoxedCodeGen())


def copy_graph(graph: fx.Graph) -> fx.Graph:
    """New nodes (meta dicts copied shallowly, as Graph.__deepcopy__ does) and the same code generator.

    The generator holds the pytree specs the graph was traced with; nothing changes it once traced,
    so sharing it is safe, and it avoids deep-copying the specs, which warns on every capture.
    """
    new = fx.Graph(tracer_cls=graph._tracer_cls)
    copied = new.graph_copy(graph, {}, return_output_node=True)
    new._codegen = graph._codegen
    if copied is not None:
        value, old_output = copied
        out = new.output(value, type_expr=getattr(old_output, "type", None))
        out.meta = dict(old_output.meta)
    return new


def mark_boxed_call(fn: Callable) -> None:
    """Tell AOTAutograd that `fn` takes its inputs as one list (and may clear it)."""
    fn._boxed_call = True  # type: ignore[attr-defined]


TANGENTS_BOXED = hasattr(torch.autograd.Function, "boxed_grads_call")


def is_primal(node: fx.Node) -> bool:
    """A joint graph's forward input (parameter, buffer or step input): AOTAutograd names them primals_*."""
    return node.op == "placeholder" and node.name.startswith("primals")


def is_tangent(node: fx.Node) -> bool:
    """A joint graph's incoming gradient of a forward output: AOTAutograd names them tangents_*."""
    return node.op == "placeholder" and node.name.startswith("tangents")


def mutated_input_indices(output_node: fx.Node) -> set[int] | None:
    """Indices of the primals the forward mutates, from the output node's descriptors; None when the
    graph has none (the caller must then assume the worst)."""
    descs = output_node.meta.get("desc")
    if not descs:
        return None
    return {d.mutated_input.idx for d in descs
            if type(d).__name__ == "InputMutationAOTOutput" and hasattr(d.mutated_input, "idx")}


# -- dispatcher and ops ------------------------------------------------------------------------

OpOverload = torch._ops.OpOverload
OpOverloadPacket = torch._ops.OpOverloadPacket
C_NN_LINEAR = torch._C._nn.linear
arg_tree_leaves = torch.utils._pytree.arg_tree_leaves
tree_leaves = torch.utils._pytree.tree_leaves
tree_flatten = torch.utils._pytree.tree_flatten
tree_map = torch.utils._pytree.tree_map


def is_mutable_op(op: OpOverload) -> bool:
    return bool(op._schema.is_mutable)


def out_kernel_copies(op: OpOverload) -> bool:
    """`op`, an out= overload, has a CompositeExplicitAutograd kernel: the wrapper PyTorch generates for an op
    with only a functional kernel, which allocates the whole result and then copies it into `out`."""
    return torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "CompositeExplicitAutograd")


def composite_with_meta_kernel(op: OpOverload) -> bool:
    """`op` decomposes (CompositeImplicitAutograd) on real devices but has a Python kernel on meta."""
    import torch._meta_registrations  # noqa: F401  # registers the Python meta kernels

    return (torch._C.DispatchKey.Meta in op.py_kernels
            and torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "CompositeImplicitAutograd"))


@contextlib.contextmanager
def meta_python_kernels_hidden(ops: tuple[OpOverload, ...]) -> Iterator[None]:
    """Remove the Python meta kernels of `ops` for the duration (the dispatcher then decomposes them)."""
    hidden = [(op, op.py_kernels.pop(torch._C.DispatchKey.Meta)) for op in ops]
    for op, _ in hidden:
        op._dispatch_cache.clear()
    try:
        yield
    finally:
        for op, kernel in hidden:
            op.py_kernels[torch._C.DispatchKey.Meta] = kernel
            op._dispatch_cache.clear()



def inductor_compilers() -> tuple[Callable, Callable, dict]:
    """Inductor's forward and backward compilers for aot_autograd, and its decomposition table."""
    from torch._inductor.compile_fx import compile_fx_inner
    from torch._inductor.decomposition import select_decomp_table

    fw = _with_our_settings(compile_fx_inner)
    return fw, _with_our_settings(functools.partial(compile_fx_inner, is_backward=True)), select_decomp_table()


def inductor_vector_width() -> int:
    """Bits of the vector ISA Inductor's CPU code generator uses here (after ATEN_CPU_CAPABILITY); 0 for none."""
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    isa = pick_vec_isa()
    return int(isa.bit_width()) if isa else 0


def _with_our_settings(compile_fn: Callable) -> Callable:
    """compile_fn with config.cpp.simdlen set to the width Inductor would pick anyway, with
    config.layout_optimization off, and with the kernel orders Inductor tries for peak memory cut to
    the two the memory model knows (module docstring).

    Pinning simdlen leaves the generated code as it was; the FX graph cache key then says which vector
    ISA it is for. A simdlen the user set is left alone. Cutting the kernel orders can change the
    code (the order its kernels run in); `_orders_the_model_knows` keeps that code apart in the cache.
    Without layout optimisation every value keeps the strides the graph was traced with, eager's: a
    dropout mask is drawn in eager's order, and no layout copies that the memory model does not know
    of are made.
    """
    from torch._inductor import config

    @functools.wraps(compile_fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        patch: dict[str, Any] = {"layout_optimization": False}
        if config.cpp.simdlen is None:
            patch["cpp.simdlen"] = inductor_vector_width()
        with config.patch(patch), _orders_the_model_knows():
            return compile_fn(*args, **kwargs)
    return run


ORDERS_TAG = "autoremat: reorder_for_peak_memory weighs the graph's order and lpmf only (1)"


@contextlib.contextmanager
def _orders_the_model_knows() -> Iterator[None]:
    """While Inductor compiles one of autoremat's graphs, its peak-memory reordering weighs the graph's
    own order against least-peak-first only. The scheduler imports `reorder_for_peak_memory` from
    torch._inductor.memory when it runs, so the module attribute is what it calls.

    The FX graph cache key does not see that attribute, so code cached without it (by an older autoremat,
    or by torch.compile on the same graph) would be reused. The key does include the uuid of
    config.post_grad_custom_post_pass: a pass that runs the user's own (if any) and whose uuid adds
    ORDERS_TAG keeps the two apart."""
    from torch._inductor import config, memory
    from torch._inductor.custom_graph_pass import CustomGraphPass

    users = config.post_grad_custom_post_pass  # None, a pass, or (torch 2.13) a list of passes
    theirs = list(users) if isinstance(users, (list, tuple)) else [] if users is None else [users]

    class Tagged(CustomGraphPass):
        def __call__(self, graph: fx.Graph) -> None:
            for p in theirs:
                p(graph)

        def uuid(self) -> Any:
            ids = [p.uuid() if isinstance(p, CustomGraphPass) else None for p in theirs]
            if None in ids:
                return None  # a pass of theirs Inductor cannot key: it bypasses its cache, as it would anyway
            return (ORDERS_TAG, *ids) if ids else ORDERS_TAG

    original = memory.reorder_for_peak_memory
    memory.reorder_for_peak_memory = functools.partial(original, methods=[memory.topological_sort_lpmf])
    try:
        with config.patch(post_grad_custom_post_pass=Tagged()):
            yield
    finally:
        memory.reorder_for_peak_memory = original


def inductor_kernel_probe() -> None:
    """Compile and run one small CPU kernel (pointwise ops into a reduction) through `inductor_compilers`.

    Raises what Inductor raises when its generated C++ does not build or load here.
    """
    from torch._functorch.aot_autograd import aot_function

    fw, _, table = inductor_compilers()
    x = torch.arange(64, dtype=torch.float32)  # long enough for vector code with a scalar tail
    fn = aot_function(lambda t: ((t * 0.5).sin() + 1.0).sum(), fw_compiler=fw, decompositions=table)
    with torch.no_grad():
        got = fn(x)
    want = ((x * 0.5).sin() + 1.0).sum()
    if not torch.allclose(got, want, rtol=1e-4, atol=1e-4):
        raise RuntimeError(f"Inductor's probe kernel computed {got.item()} instead of {want.item()}")


def inductor_cpp_compiler() -> str:
    """The C++ compiler Inductor's CPU backend calls (a path or a name); raises when none is found."""
    from torch._inductor.cpp_builder import get_cpp_compiler

    return get_cpp_compiler()


def inductor_realize_reads_threshold() -> int:
    """Readers of a pointwise value beyond which Inductor stores it instead of inlining it."""
    from torch._inductor import config

    return int(config.realize_reads_threshold)


def inductor_max_pointwise_cat_inputs() -> int:
    """Inputs up to which Inductor may lower a cat on a GPU as one pointwise kernel (beyond: a ConcatKernel)."""
    from torch._inductor import config

    # torch 2.13 splits the limit in two (complex inputs, simple inputs); a cat is a ConcatKernel past both
    return max(int(config.max_pointwise_cat_inputs), int(getattr(config, "max_complex_pointwise_cat_inputs", 0)))


def has_triton() -> bool:
    """Whether Triton imports and supports a device here (what Inductor's GPU backend needs)."""
    from torch.utils._triton import has_triton as triton_here

    return bool(triton_here())


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


def is_inductor_error(e: BaseException) -> bool:
    """An exception Inductor raised (its C++ build failing, a lowering missing), not dynamo's or the user's."""
    return type(e).__module__.startswith("torch._inductor")


def ddp_optimizer_active() -> bool:
    """DDP's graph splitter (torch._dynamo.config.optimize_ddp) is compiling the current graph."""
    context = torch._guards.TracingContext.try_get()
    return getattr(context, "ddp_optimizer_ctx", None) is not None


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
    (shapes, dtypes, symbolic sizes): 40-60 us of a 55-80 us call here, paid once per parameter per
    backward; `grad` is a gradient the graph computed for `leaf`, of its shape and dtype already."""
    torch.autograd.Variable._execution_engine.run_backward(
        (leaf,), (grad,), False, False, (), allow_unreachable=True, accumulate_grad=True)


def clear_blas_workspaces() -> None:
    torch._C._cuda_clearCublasWorkspaces()
