"""Each private torch API autoremat relies on (autoremat/torch_internals/), exercised on the installed torch.

A torch release that moves, renames or changes one of them fails the test named after it. `.ci/run`
runs this file on every torch version the package claims (2.11 and 2.13).
"""

from __future__ import annotations

import logging
import os
import shutil
import warnings
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.passes.split_module import split_module

import autoremat.torch_internals as ti
import autoremat.torch_internals.inductor as ti_inductor
from autoremat.capture.aot import _composite_ops_with_meta_kernels, boxed_eager, capture, default_split
from autoremat.model.profile import profile_graph
from autoremat.solve.heuristics import save_all

VERSION = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])


class Net(nn.Module):
    """Linear layers and a BatchNorm (its running statistics are buffers the forward mutates)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.bn, self.out = nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.bn(self.fc(x)))).square().mean()


@pytest.fixture(scope="module")
def captured():
    torch.manual_seed(0)
    (cg,) = capture(Net(), (torch.randn(6, 8),))
    return cg


def _placeholders(cg):
    return [n for n in cg.joint.graph.nodes if n.op == "placeholder"]


def test_primals_and_tangents_naming(captured):
    primals = [n for n in _placeholders(captured) if ti.is_primal(n)]
    tangents = [n for n in _placeholders(captured) if ti.is_tangent(n)]
    n_state = len(list(Net().parameters())) + len(list(Net().buffers()))
    assert len(primals) == n_state + 1  # parameters, buffers and the input
    assert len(tangents) == 1  # the scalar loss's incoming gradient
    assert len(primals) + len(tangents) == len(_placeholders(captured))


def test_aot_autograd_and_default_partition(captured):
    fw, bw = default_split(captured)
    assert isinstance(fw, fx.GraphModule) and isinstance(bw, fx.GraphModule)
    assert sum(1 for n in bw.graph.nodes if n.op == "placeholder" and "tangents" in n.name) == 1


def test_mutated_input_indices_name_the_batchnorm_buffers(captured):
    out_node = next(n for n in captured.joint.graph.nodes if n.op == "output")
    idx = ti.mutated_input_indices(out_node)
    assert idx is not None, "AOTAutograd no longer attaches output descriptors (meta['desc'])"
    primals = [n for n in _placeholders(captured) if ti.is_primal(n)]
    static = {primals[i].name for i in captured.static_input_indices}
    # BatchNorm1d updates running_mean, running_var and num_batches_tracked, all static inputs.
    assert len(idx) == 3 and {primals[i].name for i in idx} <= static


def test_extract_fwd_bwd_modules(captured):
    gp = profile_graph(captured, "cpu")
    (keep,) = save_all([gp])
    by_name = {n.name: n for n in captured.joint.graph.nodes}
    primals = [n for n in _placeholders(captured) if ti.is_primal(n)]
    saved = primals + [by_name[v] for v in sorted(keep)]
    fw, bw = ti.extract_fwd_bwd_modules(captured.joint, saved, [], num_fwd_outputs=captured.num_fwd_outputs,
                                        static_lifetime_input_nodes={primals[i] for i in captured.static_input_indices})
    fw_out = next(n for n in fw.graph.nodes if n.op == "output").args[0]
    assert len(fw_out) >= captured.num_fwd_outputs + len(keep)
    assert any(ti.is_tangent(n) for n in bw.graph.nodes)


def test_boxed_codegen_clears_its_argument_list():
    gm = fx.symbolic_trace(lambda x: x + 1)
    ti.set_boxed_codegen(gm)
    gm.recompile()
    args = [torch.ones(3)]
    out = gm.forward(args)
    assert args == [] and torch.equal(out, torch.full((3,), 2.0))


def test_copy_graph_copies_the_nodes_shares_the_codegen_and_does_not_warn(captured):
    graph = captured.joint.graph
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # Graph.__deepcopy__ would warn here (LeafSpec, from copying specs)
        copied = ti.copy_graph(graph)
    assert [n.name for n in copied.nodes] == [n.name for n in graph.nodes]
    assert not set(map(id, copied.nodes)) & set(map(id, graph.nodes))
    assert copied._codegen is graph._codegen
    first = next(iter(copied.nodes))
    first.meta["autoremat_test"] = 1  # editing the copy leaves the original alone
    assert "autoremat_test" not in next(iter(graph.nodes)).meta


def test_boxed_call_reaches_aot_autograd_with_one_list():
    seen = []

    def compiler(gm, example_inputs):
        run = boxed_eager(gm, example_inputs)  # marks itself with ti.mark_boxed_call

        def spy(args):
            seen.append(type(args))
            return run(args)

        ti.mark_boxed_call(spy)
        return spy

    f = torch.compile(lambda x: (x.sin() * 2).sum(), backend=ti.aot_autograd(fw_compiler=compiler, bw_compiler=compiler))
    x = torch.randn(4, requires_grad=True)
    f(x).backward()
    assert seen == [list, list]  # forward and backward, each called with one list
    assert torch.allclose(x.grad, 2 * x.detach().cos())


def test_tangents_boxed_is_what_the_memory_model_assumes():
    if VERSION == (2, 11):
        assert not ti.TANGENTS_BOXED
    elif VERSION >= (2, 13):
        assert ti.TANGENTS_BOXED
    assert isinstance(ti.TANGENTS_BOXED, bool)


def test_handed_to_backward():
    # sin(cos(x * w)): the backward reads x, w (mul's derivative), mul (cos's) and cos (sin's): four saved, by
    # position, before the output's gradient. With dynamic sizes the backward also needs x's sizes, saved apart.
    def f(x, w):
        return torch.sin(torch.cos(x * w))

    x, w = torch.randn(4, 8, requires_grad=True), torch.randn(8, requires_grad=True)
    seen = []

    def record(joint, joint_inputs, *, num_fwd_outputs, **kw):
        fw, bw = ti.default_partition(joint, joint_inputs, num_fwd_outputs=num_fwd_outputs, **kw)
        seen.append(ti.handed_to_backward(fw, bw, num_fwd_outputs))
        return fw, bw

    torch.compile(f, backend=ti.aot_autograd(fw_compiler=boxed_eager, bw_compiler=boxed_eager, partition_fn=record),
                  dynamic=False)(x, w).sum().backward()
    assert seen == [(4, ("tangents_1",))]
    torch._dynamo.reset()
    torch.compile(f, backend=ti.aot_autograd(fw_compiler=boxed_eager, bw_compiler=boxed_eager, partition_fn=record),
                  dynamic=True)(x, w).sum().backward()
    assert seen[1] == "it saves symbolic sizes or non-tensors for the backward"


def test_pad_saved_gives_aot_autograds_function_more_slots():
    # sin(cos(x * w)) again: four saved, then three empty tensors the backward takes and never reads.
    # AOTAutograd counts the partition's saved tensors after the partition returns, so its Function saves
    # seven and hands them to the backward before the output's gradient, and the gradients are eager's.
    def f(x, w):
        return torch.sin(torch.cos(x * w))

    x, w = torch.randn(4, 8, requires_grad=True), torch.randn(8, requires_grad=True)
    seen, handed = [], []

    def record(joint, joint_inputs, *, num_fwd_outputs, **kw):
        fw, bw = ti.default_partition(joint, joint_inputs, num_fwd_outputs=num_fwd_outputs, **kw)
        ti.pad_saved(fw, bw, num_fwd_outputs, 3)
        seen.append(ti.handed_to_backward(fw, bw, num_fwd_outputs))
        return fw, bw

    def backward_compiler(gm, example_inputs):
        run = boxed_eager(gm)

        def call(args):
            handed.append([tuple(a.shape) for a in args])
            return run(args)
        ti.mark_boxed_call(call)
        return call

    compiled = torch.compile(f, backend=ti.aot_autograd(fw_compiler=boxed_eager, bw_compiler=backward_compiler,
                                                        partition_fn=record), dynamic=False)
    compiled(x, w).sum().backward()
    assert seen == [(7, ("tangents_1",))]
    assert handed == [[(4, 8), (8,), (4, 8), (4, 8), (0,), (0,), (0,), (4, 8)]]  # x, w, mul, cos, pads, tangent
    got = [x.grad.clone(), w.grad.clone()]
    x.grad = w.grad = None
    f(x, w).sum().backward()
    assert torch.equal(got[0], x.grad) and torch.equal(got[1], w.grad)


def test_handed_to_backward_refuses_tensors_stashed_on_a_ctx():
    # A user autograd.Function that keeps x as `ctx.x` (not save_for_backward): AOTAutograd saves it apart,
    # without the version-counter check, and marks it so.
    class Stash(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.x = x
            return x.sin()

        @staticmethod
        def backward(ctx, g):
            return g * ctx.x.cos()

    seen = []

    def record(joint, joint_inputs, *, num_fwd_outputs, **kw):
        fw, bw = ti.default_partition(joint, joint_inputs, num_fwd_outputs=num_fwd_outputs, **kw)
        seen.append(ti.handed_to_backward(fw, bw, num_fwd_outputs))
        return fw, bw

    x = torch.randn(4, requires_grad=True)
    torch.compile(lambda x: Stash.apply(x * 2), backend=ti.aot_autograd(
        fw_compiler=boxed_eager, bw_compiler=boxed_eager, partition_fn=record), dynamic=False)(x).sum().backward()
    assert seen == ["it saves tensors without a version-counter check (stashed on an autograd.Function's ctx)"]
    assert torch.allclose(x.grad, 2 * (2 * x.detach()).cos())


def test_compiled_autograd_on():
    assert not ti.compiled_autograd_on()
    # torch's own patcher: pytest's monkeypatch (9.2) deletes what it set on a config module, which hides the
    # option from torch for the rest of the process
    with torch._dynamo.config.patch(compiled_autograd=True):
        assert ti.compiled_autograd_on()
    assert not ti.compiled_autograd_on()


def test_is_sym_node():
    gm = make_fx(lambda x: x.reshape(x.shape[0] * 2, -1), tracing_mode="symbolic")(torch.randn(4, 6))
    assert any(ti.is_sym_node(n) for n in gm.graph.nodes)
    static = make_fx(lambda x: x.reshape(8, -1))(torch.randn(4, 6))
    assert not any(ti.is_sym_node(n) for n in static.graph.nodes)


def test_annotate_tags_what_is_traced_inside_and_leaves_the_node_meta_alone():
    """ti.annotate adds to meta["custom"] of the ops traced inside it, on top of what the node being traced
    carries, and no further: the node's own meta is unchanged and the ops after the block carry the node's
    tags only (torch.fx.traceback.annotate updated the node's dict in place)."""
    def body(x):
        with ti.annotate({"chunk": 1}):
            y = x.sin()
        return y.cos()

    graph = fx.Graph()
    x = graph.placeholder("x")
    call = graph.call_function(body, (x,))
    call.meta["custom"] = {"region": True}
    graph.output(call)
    gm = fx.GraphModule(torch.nn.Module(), graph)
    with torch.fx.traceback.preserve_node_meta():
        traced = make_fx(lambda t: fx.Interpreter(gm).run(t))(torch.randn(3))
    tags = {n.target: n.meta.get("custom") for n in traced.graph.nodes if n.op == "call_function"}
    assert tags == {torch.ops.aten.sin.default: {"region": True, "chunk": 1},
                    torch.ops.aten.cos.default: {"region": True}}, tags
    assert call.meta["custom"] == {"region": True}
    assert ti.tagged(next(n for n in traced.graph.nodes if n.target is torch.ops.aten.sin.default), "chunk") == 1


def test_op_overloads_and_mutability():
    assert isinstance(torch.ops.aten.add.Tensor, ti.OpOverload)
    assert isinstance(torch.ops.aten.add, ti.OpOverloadPacket)
    assert ti.is_mutable_op(torch.ops.aten.add_.Tensor) and not ti.is_mutable_op(torch.ops.aten.add.Tensor)
    assert ti.schema_effects(torch.ops.aten.add_.Tensor) == (["self"], [], False)
    assert ti.schema_effects(torch.ops.aten.view.default) == ([], ["self", "return 0"], False)
    assert ti.schema_effects(torch.ops.aten.bernoulli.p) == ([], [], True)
    assert ti.schema_effects(torch.ops.aten.add.Tensor) == ([], [], False)


@torch.library.custom_op("autoremat_ti::bump", mutates_args=("count",))
def _bump(x: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    count.add_(1)
    return x * 2


_bump.register_fake(lambda x, count: torch.empty_like(x))


class _Bumps(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("count", torch.zeros(4))

    def forward(self, x):
        return self.lin(_bump(x, self.count)).sum()


def test_functionalized_mutations_and_effects_name_the_op_they_wrap():
    joint = capture(_Bumps(), (torch.randn(2, 4),))[0].joint
    wrapped = [ti.functionalized_mutation(n.target, n.args) for n in joint.graph.nodes if n.op == "call_function"]
    assert torch.ops.autoremat_ti.bump.default in wrapped, joint.graph
    assert ti.functionalized_mutation(torch.ops.aten.add.Tensor, ()) is None
    assert ti.effectful_op(torch.ops.aten.add.Tensor, ()) is None
    assert ti.effectful_op(torch.ops.higher_order.with_effects, (None, torch.ops.aten.add.Tensor)) is \
        torch.ops.aten.add.Tensor


def test_out_kernel_copies_names_the_out_overloads_that_allocate_their_result():
    from autoremat.measure import measure_peak

    x = torch.randn(256, 1024)  # 1 MiB

    def allocated(op, *args) -> int:
        return measure_peak(lambda: op(x, *args, out=x), device=torch.device("cpu"), baseline_bytes=0)[1].delta_peak_bytes

    assert ti.out_kernel_copies(torch.ops.aten.mul.Scalar_out)
    assert allocated(torch.ops.aten.mul.Scalar_out, 3.0) >= x.nbytes  # the functional result, then a copy
    assert not ti.out_kernel_copies(torch.ops.aten.mul.out)
    assert allocated(torch.ops.aten.mul.out, x) < x.nbytes


def test_meta_python_kernels_can_be_hidden_and_restored():
    ops = _composite_ops_with_meta_kernels()
    assert ops, "no composite op with a Python meta kernel found (capture.meta_traces_like_real has nothing to do)"
    assert all(ti.composite_with_meta_kernel(op) for op in ops)
    with ti.meta_python_kernels_hidden(ops):
        assert not any(ti.composite_with_meta_kernel(op) for op in ops)
    assert all(ti.composite_with_meta_kernel(op) for op in ops)


def test_inductor_compilers_resolve():
    fw, bw, table = ti.inductor_compilers()
    assert callable(fw) and callable(bw)
    assert torch.ops.aten.native_dropout.default in table or len(table) > 100


def test_the_vector_width_follows_aten_cpu_capability_and_is_pinned_only_when_unset():
    from torch._inductor import config

    assert ti.inductor_vector_width() in (0, 128, 256, 512)
    seen = []
    pinned = ti_inductor._with_our_settings(lambda: seen.append(config.cpp.simdlen))
    pinned()
    with config.patch({"cpp.simdlen": 128}):
        pinned()
    assert seen == [ti.inductor_vector_width(), 128] and config.cpp.simdlen is None
    with mock.patch.dict(os.environ, {"ATEN_CPU_CAPABILITY": "default"}):
        assert ti.inductor_vector_width() == 0  # no vector ISA: scalar kernels


def test_inductor_weighs_only_the_kernel_orders_the_memory_model_knows_and_its_cache_key_says_so():
    from torch._inductor import config, memory
    from torch._inductor.custom_graph_pass import CustomGraphPass

    original = memory.reorder_for_peak_memory
    seen = []

    def inside():
        reorder = memory.reorder_for_peak_memory
        seen.append((reorder.keywords["methods"], config.post_grad_custom_post_pass.uuid()))
    ti_inductor._with_our_settings(inside)()
    assert seen == [([memory.topological_sort_lpmf], ti.ORDERS_TAG)]
    assert memory.reorder_for_peak_memory is original and config.post_grad_custom_post_pass is None

    class Users(CustomGraphPass):  # a user's own pass still runs, and its uuid stays in the key
        def __call__(self, graph):
            seen.append("user's pass ran")

        def uuid(self):
            return "users"
    with config.patch(post_grad_custom_post_pass=Users()):
        ti_inductor._with_our_settings(lambda: config.post_grad_custom_post_pass(fx.Graph()))()
        ti_inductor._with_our_settings(lambda: seen.append(config.post_grad_custom_post_pass.uuid()))()
    with config.patch(post_grad_custom_post_pass=lambda graph: None):  # no uuid: Inductor's cache is bypassed
        ti_inductor._with_our_settings(lambda: seen.append(config.post_grad_custom_post_pass.uuid()))()
    assert seen[1:] == ["user's pass ran", (ti.ORDERS_TAG, "users"), None]


def test_inductor_kernel_probe_compiles_or_says_why():
    try:
        cxx = ti.inductor_cpp_compiler()
    except Exception as e:  # torch's InvalidCxxCompiler
        pytest.skip(f"no C++ compiler for Inductor here: {e}")
    if shutil.which(cxx) is None:
        pytest.skip(f"Inductor's C++ compiler {cxx!r} is not on PATH")
    ti.inductor_kernel_probe()  # raises Inductor's own error if its kernel does not build and run


def test_dynamo_records_linear_as_c_nn_linear():
    targets = []

    def look(gm, example_inputs):
        targets.extend(n.target for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    torch.compile(nn.Linear(4, 3), backend=look, dynamic=False)(torch.randn(2, 4))
    assert ti.C_NN_LINEAR in targets, targets


def test_pytree():
    a, b, c = torch.ones(1), torch.zeros(2), torch.full((3,), 2.0)
    assert ti.arg_tree_leaves([a, (b,)], {"k": c}) == [a, b, c]
    assert ti.tree_leaves(((a, b), {"k": c})) == [a, b, c]
    leaves, spec = ti.tree_flatten({"x": a, "y": [b, c]})
    assert leaves == [a, b, c] and spec.num_leaves == 3
    assert ti.tree_map(lambda t: t * 0, [a, (b,)])[1][0].sum() == 0


def test_fake_tensors():
    with ti.FakeTensorMode() as mode:
        fake = torch.ones(2)
        with ti.unset_fake_temporarily():
            real = torch.ones(2)
    assert ti.detect_fake_mode([fake]) is mode
    assert ti.detect_fake_mode([real]) is None
    assert real.sum().item() == 2.0
    assert logging.getLogger(ti.FAKE_TENSOR_LOGGER) is logging.getLogger(torch._subclasses.fake_tensor.log.name)


def test_storage_weak_ref_keys_shared_storage():
    x = torch.arange(6.0)
    assert ti.StorageWeakRef(x.view(2, 3).untyped_storage()) == ti.StorageWeakRef(x.untyped_storage())
    assert ti.StorageWeakRef(x.clone().untyped_storage()) != ti.StorageWeakRef(x.untyped_storage())


class _Wrapper(torch.Tensor):
    """The smallest traceable wrapper subclass (the protocol DTensor implements)."""

    @staticmethod
    def __new__(cls, inner):
        return torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype)

    def __init__(self, inner):
        self.inner = inner

    def __tensor_flatten__(self):
        return ["inner"], None

    @staticmethod
    def __tensor_unflatten__(inner_tensors, meta, outer_size, outer_stride):
        return _Wrapper(inner_tensors["inner"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise NotImplementedError


def test_is_traceable_wrapper_subclass():
    assert ti.is_traceable_wrapper_subclass(_Wrapper(torch.ones(2)))
    assert not ti.is_traceable_wrapper_subclass(torch.ones(2))


def test_dynamo_recompile_limit_reset_and_compile_id():
    assert isinstance(ti.recompile_limit(), int) and ti.recompile_limit() >= 1
    ti.dynamo_reset()
    ids = []

    def look(gm, example_inputs):
        ids.append(ti.dynamo_compile_id(gm))
        return gm.forward

    f = torch.compile(lambda x: x * 2, backend=look, dynamic=False)
    f(torch.ones(2))
    f(torch.ones(3))  # a new shape: the same frame compiled a second time
    assert len(ids) == 2 and ids[0][0] == ids[1][0] and [i[1] for i in ids] == [0, 1], ids


def test_graph_break_reasons():
    ti.dynamo_reset()

    def f(x):
        x = x + 1
        torch._dynamo.graph_break()
        return x * 2

    torch.compile(f, backend="eager")(torch.ones(2))
    reasons = ti.graph_break_reasons()
    assert reasons and all(isinstance(r, str) and r.splitlines() for r in reasons)


def test_dynamo_errors():
    with pytest.raises(ti.TorchRuntimeError) as err:
        torch.compile(lambda a, b: a @ b, backend="eager", dynamic=False)(torch.ones(2, 3), torch.ones(4, 5))
    assert ti.is_dynamo_error(err.value) and not ti.is_dynamo_error(ValueError("user's own"))
    op, where = ti.fake_run_failure(err.value)
    assert op == "matmul" and where.startswith("test_torch_internals.py:") and "a @ b" in where, (op, where)
    ti.dynamo_reset()
    with pytest.raises(ti.TorchRuntimeError) as err:
        torch.compile(lambda a: a.view(7), backend="eager", dynamic=False)(torch.ones(2, 3))
    assert ti.fake_run_failure(err.value)[0] == "Tensor.view"
    assert ti.fake_run_failure(ValueError("user's own")) == (None, None)

    def refuse(gm, example_inputs):
        raise ValueError("planned refusal")

    ti.dynamo_reset()
    with pytest.raises(ti.BackendCompilerFailed) as err:
        torch.compile(lambda x: x.cos(), backend=refuse)(torch.ones(2))
    assert isinstance(getattr(err.value, "inner_exception", None), ValueError)


def test_region_compilation_and_ddp_flag():
    compiled, flags = [], []
    assert not ti.ddp_optimizer_active()

    def compile_one(gm, example_inputs):
        compiled.append(len(example_inputs))
        return gm.forward

    def backend(gm, example_inputs):
        flags.append(ti.ddp_optimizer_active())
        calls = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
        half = {n: (0 if i < len(calls) // 2 else 1) for i, n in enumerate(calls)}
        cut = split_module(gm, None, lambda n: half[n], keep_original_order=True)
        ti.copy_split_metadata(gm, cut)
        ti.compile_submodules(cut, compile_one, example_inputs)
        cut.recompile()
        return cut

    f = torch.compile(lambda x: ((x + 1).sin() * 3).cos(), backend=backend, dynamic=False)
    x = torch.randn(5)
    assert torch.allclose(f(x), ((x + 1).sin() * 3).cos())
    assert len(compiled) == 2 and flags == [False]


def test_profiler_allocation_events():
    assert not ti.profiler_enabled()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        assert ti.profiler_enabled()
        t = torch.empty(1 << 20, dtype=torch.uint8)
        del t
    events = list(ti.allocation_events(prof))
    sizes = [nbytes for _, nbytes, device in events if device.type == "cpu"]
    assert (1 << 20) in sizes and -(1 << 20) in sizes, sizes[:10]


def test_queue_callback_runs_at_the_end_of_the_backward():
    order = []
    x = torch.ones(3, requires_grad=True)
    y = (x * 2).sum()

    def hook(grad):
        ti.queue_callback(lambda: order.append("end of backward"))
        order.append("hook")
        return grad

    x.register_hook(hook)
    y.backward()
    assert order == ["hook", "end of backward"]


class _Stash(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * 3

    @staticmethod
    def backward(ctx, grad):
        return grad * 3


def test_saved_tensors_by_origin_splits_eager_saves_from_a_compiled_graphs():
    """A compiled graph (AOTAutograd's node) between eager ops: sin saves its input, before the graph; the
    custom Function its input and exp its result, after it; the graph saves what its own backward reads (its
    input, and tanh's output)."""
    compiled = torch.compile(lambda t: torch.tanh(t * t), backend="aot_eager")
    x = torch.randn(8, requires_grad=True)
    a = torch.sin(x)
    b = compiled(a)
    c = _Stash.apply(b)
    d = torch.exp(c)
    saved = ti.saved_tensors_by_origin([d.sum()])

    def storages(ts):
        return {t.untyped_storage().data_ptr() for t in ts}
    assert storages(saved.before_a_graph) == storages([x])
    assert storages(saved.after_the_graphs) == storages([b, d])
    assert storages(saved.by_graphs) == storages([a, b])


def test_saved_tensors_by_origin_unpacks_nothing_a_hook_packed():
    """Inside a non-reentrant checkpoint, cos's input is packed by the checkpoint's hook, whose unpacking would
    run the region again: it is not read. sin's input, saved outside, is."""
    from torch.utils.checkpoint import checkpoint

    calls = []

    def region(t):
        calls.append(1)
        return torch.cos(t)

    x = torch.randn(8, requires_grad=True)
    y = checkpoint(region, torch.sin(x), use_reentrant=False)
    saved = ti.saved_tensors_by_origin([y.sum()])
    assert len(calls) == 1  # the forward's own call
    assert {t.untyped_storage().data_ptr() for t in saved.after_the_graphs} == {x.untyped_storage().data_ptr()}
    y.sum().backward()
    assert len(calls) == 2 and torch.allclose(x.grad, -torch.sin(torch.sin(x)) * torch.cos(x))


def test_weak_id_key_dictionary_keys_tensors_by_identity():
    owners = ti.WeakIdKeyDictionary()
    a, b = torch.zeros(2), torch.zeros(2)  # equal values, distinct tensors
    owners[a], owners[b] = "a", "b"
    assert owners[a] == "a" and owners[b] == "b"
    del a
    assert len(owners) == 1  # the entry went with its tensor


def test_inductor_cpp_compiler_names_the_compiler_inductor_would_call():
    cxx = os.environ.get("CXX", "g++")
    if shutil.which(cxx) is None:
        with pytest.raises(Exception, match="C\\+\\+ compiler"):
            ti.inductor_cpp_compiler()
    else:
        assert Path(shutil.which(ti.inductor_cpp_compiler()) or "").name == Path(shutil.which(cxx)).name


def test_has_triton_agrees_with_importing_triton():
    try:
        import triton  # noqa: F401
    except ImportError:
        assert ti.has_triton() is False
    else:  # importable: True exactly when a device Triton supports is there too
        assert isinstance(ti.has_triton(), bool)
        if torch.cuda.is_available():
            assert ti.has_triton()


def test_inductor_realize_reads_threshold_is_a_small_positive_count():
    import torch._inductor.config as inductor_config

    assert ti.inductor_realize_reads_threshold() == inductor_config.realize_reads_threshold >= 1


def test_inductor_max_pointwise_cat_inputs_covers_both_of_inductors_limits():
    import torch._inductor.config as inductor_config

    limit = ti.inductor_max_pointwise_cat_inputs()
    assert limit >= inductor_config.max_pointwise_cat_inputs >= 1
    assert limit >= getattr(inductor_config, "max_complex_pointwise_cat_inputs", 0)


def _inside_a_backward(callback) -> None:
    """Run `callback()` inside the backward of a one-op graph, as a compiled region's backward runs it."""

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 1

        @staticmethod
        def backward(ctx, g):
            callback()
            return g

    Probe.apply(torch.ones(1, requires_grad=True)).sum().backward()


def test_graph_task_id_names_the_running_backward_and_grows():
    ids = []
    for _ in range(2):
        _inside_a_backward(lambda: ids.append(ti.graph_task_id()))
    assert ti.graph_task_id() == -1 and ids[0] >= 0 and ids[1] > ids[0], ids


def _hand_over_inside_a_backward(run) -> tuple[torch.Tensor, bool, list[str]]:
    """`run(w, 2s)` from inside a running backward, as regions.accumulate_grad calls it, on a leaf whose
    .grad holds ones: the .grad after it, whether it is the same buffer, and which hooks fired."""
    w = nn.Parameter(torch.zeros(4))
    w.grad = torch.ones(4)
    buffer = w.grad
    fired = []
    w.register_hook(lambda g: fired.append("tensor") or g)
    w.register_post_accumulate_grad_hook(lambda p: fired.append("post-accumulate"))
    node = ti.gradient_node(w)  # held, as DDP's reducer holds it: a leaf keeps only a weak reference
    node.register_hook(lambda gi, go: fired.append("node"))
    _inside_a_backward(lambda: run(w, torch.full((4,), 2.0)))
    return w.grad, w.grad is buffer, sorted(fired)


def test_accumulate_into_grad_adds_to_grad_and_fires_every_hook_as_backward_does():
    """In place into .grad, and the tensor hook, the AccumulateGrad node's post hook (DDP's reducer) and
    the post-accumulate-grad hook each fire once, as under torch.autograd.backward(leaf, grad)."""
    ours, autograd = _hand_over_inside_a_backward(ti.accumulate_into_grad), _hand_over_inside_a_backward(
        torch.autograd.backward)
    assert torch.equal(ours[0], torch.full((4,), 3.0)) and ours[1], ours
    assert ours[2] == autograd[2] == ["node", "post-accumulate", "tensor"], (ours, autograd)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_clear_blas_workspaces_frees_them_and_the_next_matmul_allocates_them_again():
    from autoremat.torch_internals import clear_blas_workspaces

    a = torch.randn(64, 64, device="cuda")
    a @ a  # this thread's cuBLAS workspace exists now
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated()
    clear_blas_workspaces()
    freed = held - torch.cuda.memory_allocated()
    assert freed > 0
    out = a @ a
    del out
    assert torch.cuda.memory_allocated() - (held - freed) > 0


def test_aten_ops_of_reads_the_ops_a_function_runs_on_meta_tensors():
    ops = ti.aten_ops_of(lambda x, c: torch.tanh(x / 3.0) * c, [torch.randn(2, 5), torch.randn(5)])
    assert ops == [torch.ops.aten.div.Tensor, torch.ops.aten.tanh.default, torch.ops.aten.mul.Tensor]
    assert all(torch.Tag.pointwise in op.tags for op in ops)
    assert ti.aten_ops_of(lambda x: x[x > 0], [torch.randn(3)]) is None  # a data-dependent shape: not known


def test_compile_step_traces_log_calls_without_a_graph_break():
    import logging

    log = logging.getLogger("autoremat.test.compile_step")
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def f(x):
        y = x.sin()
        log.warning("between two ops")
        return y.cos()

    out = ti.compile_step(f, backend)(torch.randn(3))
    assert len(graphs) == 1 and torch.is_tensor(out)
