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
  handed_to_backward           AOTAutograd's autograd.Function: the forward's saved tensors follow its
                               outputs and reach the backward by position, as its first inputs, through
                               ctx.save_for_backward (capture/graph_code.py swaps a plan's partition in
                               behind a captured Function, relying on it)
  pad_saved                    the same convention: empty tensors added to what a partition saves give the
                               Function more slots, so a plan saving more than the capture still fits
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
  forward_hooks                nn.Module._forward_pre_hooks and _forward_hooks: a module's own forward hooks
  aten_ops_of                  torch.fx.experimental.proxy_tensor.make_fx on meta tensors, outside dynamo's fake
                               mode: the ATen ops a dynamo graph's node runs, so a pass can read their schema tags
  LOSS_REGION_TAG, tagged      a key the loss-chunk pass puts in its node's meta["custom"]: AOTAutograd copies
                               "custom" onto the joint nodes traced from it, and onto their backward nodes by
                               seq_nr, so the profile knows the chunked loss region's nodes
  LOSS_CHUNK_TAG, annotate     torch.fx.traceback.current_meta, the meta of the node being traced: each chunk's
                               ops traced under {LOSS_CHUNK_TAG: its number} in "custom", copied the same way
                               (planning/loss_region/bounds.py)
Dispatcher and ops:
  OpOverload, OpOverloadPacket torch._ops: what an aten call's target is
  is_mutable_op                OpOverload._schema.is_mutable
  schema_effects               OpOverload._schema's arguments and returns: their alias_info (is_write) and
                               types, what an op declares it writes, aliases, or draws from a Generator
  functionalized_mutation      torch.ops.higher_order.auto_functionalized(_v2): how a mutating op appears
                               in a functionalized joint graph, the op as its first argument
  effectful_op                 torch.ops.higher_order.with_effects: an op with declared side effects, the
                               op as its second argument (after the effect token)
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
                               grouping the model does not know; where Inductor picks one of those
                               (benchmarks/speed.py's GPT-2 with dropout), the real peak can pass the
                               model's (results/speed_cpu.md: predicted against measured); verification
                               catches it
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
  fake_run_failure             TorchRuntimeError's text ("failed to run FX node with fake tensors: <kind>
                               <target>(*...") and its `real_stack`: the op dynamo's fake-tensor run
                               failed on, and the user's line that called it (capture/tracing.py)
  is_inductor_error            an exception class from torch._inductor (CppCompileError, ...), by module name
  compiled_autograd_on         torch._dynamo.config.compiled_autograd and
                               torch._dynamo.compiled_autograd.compiled_autograd_enabled: the backward is
                               traced from AOTAutograd's kept graph, not run through the compiled backward
  ddp_optimizer_active         torch._guards.TracingContext.try_get().ddp_optimizer_ctx: DDP's
                               graph splitter has already cut this graph
  copy_split_metadata,         torch._dynamo.backends.distributed: propagate_dynamo_source and
  compile_submodules           propagate_metadata onto a split graph's submodules; SubmodCompiler to
                               compile each region of it as the interpreter reaches it
  copy_dynamo_graph            a dynamo graph copied with its placeholders' Node._dynamo_source (kept to
                               trace a candidate again without dynamo: planning.dynamo_graphs)
  compile_step                 torch._dynamo.config's ignore_logging_functions (ignore_logger_methods before),
                               recompile_limit and accumulated_recompile_limit: autoremat's own compiles trace
                               log calls as no-ops, and many plans of one model fit under the limit
  tracing_like_dynamo          torch._guards.tracing(TracingContext(FakeTensorMode())): the context dynamo
                               runs a backend in, for such a trace (FX's dead-code elimination reads it)
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
  saved_tensors_by_origin      the autograd graph after a forward: nodes' `_raw_saved_*` attributes (a
                               custom Function's `_raw_saved_tensors`), each SavedTensor's `data` and
                               `unpack_hook` (read without unpacking), and the class name
                               CompiledFunctionBackward of AOTAutograd's node for a compiled graph: what
                               autograd saved for the eager code before a graph, after the last, and the
                               graphs' own (capture/tracing.py)
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

from autoremat.torch_internals.aot import (
    C_NN_LINEAR,
    LOSS_CHUNK_TAG,
    LOSS_REGION_TAG,
    TANGENTS_BOXED,
    OpOverload,
    OpOverloadPacket,
    annotate,
    aot_autograd,
    arg_tree_leaves,
    aten_ops_of,
    composite_with_meta_kernel,
    copy_graph,
    default_partition,
    effectful_op,
    extract_fwd_bwd_modules,
    forward_hooks,
    functionalized_mutation,
    handed_to_backward,
    is_mutable_op,
    is_primal,
    is_sym_node,
    is_tangent,
    is_traceable_wrapper_subclass,
    mark_boxed_call,
    meta_python_kernels_hidden,
    mutated_input_indices,
    out_kernel_copies,
    pad_saved,
    schema_effects,
    set_boxed_codegen,
    tagged,
    tree_flatten,
    tree_leaves,
    tree_map,
)
from autoremat.torch_internals.dynamo import (
    FAKE_TENSOR_LOGGER,
    BackendCompilerFailed,
    FakeTensorMode,
    TorchRuntimeError,
    compile_step,
    compile_submodules,
    compiled_autograd_on,
    copy_dynamo_graph,
    copy_split_metadata,
    ddp_optimizer_active,
    detect_fake_mode,
    dynamo_compile_id,
    dynamo_reset,
    fake_run_failure,
    graph_break_reasons,
    is_dynamo_error,
    is_inductor_error,
    recompile_limit,
    tracing_like_dynamo,
    unset_fake_temporarily,
)
from autoremat.torch_internals.engine import (
    SavedTensors,
    StorageWeakRef,
    WeakIdKeyDictionary,
    accumulate_into_grad,
    allocation_events,
    backward_entry_code,
    clear_blas_workspaces,
    engine_will_run,
    gradient_node,
    graph_task_id,
    in_backward,
    profiler_enabled,
    queue_callback,
    saved_tensors_by_origin,
)
from autoremat.torch_internals.inductor import (
    ORDERS_TAG,
    has_triton,
    inductor_compilers,
    inductor_cpp_compiler,
    inductor_kernel_probe,
    inductor_max_pointwise_cat_inputs,
    inductor_realize_reads_threshold,
    inductor_vector_width,
)

__all__ = [
    "BackendCompilerFailed",
    "C_NN_LINEAR",
    "LOSS_CHUNK_TAG",
    "LOSS_REGION_TAG",
    "FAKE_TENSOR_LOGGER",
    "FakeTensorMode",
    "ORDERS_TAG",
    "OpOverload",
    "OpOverloadPacket",
    "StorageWeakRef",
    "TANGENTS_BOXED",
    "TorchRuntimeError",
    "WeakIdKeyDictionary",
    "accumulate_into_grad",
    "allocation_events",
    "annotate",
    "aot_autograd",
    "arg_tree_leaves",
    "backward_entry_code",
    "clear_blas_workspaces",
    "compile_step",
    "compile_submodules",
    "compiled_autograd_on",
    "composite_with_meta_kernel",
    "copy_graph",
    "copy_dynamo_graph",
    "copy_split_metadata",
    "ddp_optimizer_active",
    "default_partition",
    "detect_fake_mode",
    "dynamo_compile_id",
    "dynamo_reset",
    "engine_will_run",
    "extract_fwd_bwd_modules",
    "forward_hooks",
    "fake_run_failure",
    "handed_to_backward",
    "gradient_node",
    "graph_break_reasons",
    "graph_task_id",
    "has_triton",
    "in_backward",
    "inductor_compilers",
    "inductor_cpp_compiler",
    "inductor_kernel_probe",
    "inductor_max_pointwise_cat_inputs",
    "inductor_realize_reads_threshold",
    "inductor_vector_width",
    "is_dynamo_error",
    "is_inductor_error",
    "is_mutable_op",
    "effectful_op",
    "functionalized_mutation",
    "schema_effects",
    "is_primal",
    "aten_ops_of",
    "is_sym_node",
    "is_tangent",
    "is_traceable_wrapper_subclass",
    "mark_boxed_call",
    "pad_saved",
    "meta_python_kernels_hidden",
    "mutated_input_indices",
    "out_kernel_copies",
    "profiler_enabled",
    "queue_callback",
    "recompile_limit",
    "SavedTensors",
    "saved_tensors_by_origin",
    "set_boxed_codegen",
    "tagged",
    "tree_flatten",
    "tree_leaves",
    "tracing_like_dynamo",
    "tree_map",
    "unset_fake_temporarily",
]
