"""Private torch APIs: AOTAutograd's joint graphs and partitioner, the dispatcher's ops, pytree (listed in the package docstring)."""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.fx as fx
import torch.fx.traceback as fx_traceback
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.partitioners import _extract_fwd_bwd_modules, default_partition
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.fx.experimental.proxy_tensor import is_sym_node, make_fx
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

__all__ = ["C_NN_LINEAR", "LOSS_CHUNK_TAG", "LOSS_REGION_TAG", "OpOverload", "OpOverloadPacket", "TANGENTS_BOXED", "annotate", "aot_autograd", "arg_tree_leaves", "aten_ops_of", "composite_with_meta_kernel", "copy_graph", "default_partition", "effectful_op", "extract_fwd_bwd_modules", "forward_hooks", "functionalized_mutation", "handed_to_backward", "is_mutable_op", "is_primal", "is_sym_node", "is_tangent", "is_traceable_wrapper_subclass", "mark_boxed_call", "meta_python_kernels_hidden", "mutated_input_indices", "out_kernel_copies", "pad_saved", "schema_effects", "set_boxed_codegen", "tagged", "tree_flatten", "tree_leaves", "tree_map"]


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


def handed_to_backward(fw: fx.GraphModule, bw: fx.GraphModule, num_fwd_outputs: int) -> tuple[int, tuple[str, ...]] | str:
    """How AOTAutograd's autograd.Function calls the partition (fw, bw): (how many tensors the forward saves for
    the backward, the names of the backward's other inputs), or why the partition is not of that plain form.

    The compiled forward returns its `num_fwd_outputs` outputs, then the tensors it saves, then the symbolic
    sizes (and, on 2.13, opaque objects) it saves; the Function puts the tensors through
    `ctx.save_for_backward` (a view detached first) and calls the backward with them by position, first
    among its inputs, before the gradients of the outputs. Not of that plain form: symbolic sizes or opaque
    objects saved (they travel apart), or tensors a user's autograd.Function stashed on its ctx (marked
    `saved_tensor_with_no_vc_check`: saved last, without the version-counter check)."""
    saved = list(fw.graph.output_node().args[0])[num_fwd_outputs:]
    if any(not isinstance(n, fx.Node) or is_sym_node(n) or not isinstance(n.meta.get("val"), torch.Tensor)
           for n in saved):
        return "it saves symbolic sizes or non-tensors for the backward"
    if any(n.meta.get("saved_tensor_with_no_vc_check", False) for n in saved):
        return "it saves tensors without a version-counter check (stashed on an autograd.Function's ctx)"
    inputs = list(bw.graph.find_nodes(op="placeholder"))
    if len(inputs) < len(saved):
        return "its backward takes fewer inputs than the forward saves"
    return len(saved), tuple(n.name for n in inputs[len(saved):])


def pad_saved(fw: fx.GraphModule, bw: fx.GraphModule, num_fwd_outputs: int, count: int) -> None:
    """Make the partition (fw, bw), of handed_to_backward's plain form, save `count` more tensors after its
    own: empty ones the forward makes (no bytes) and the backward takes as inputs and never reads. The
    Function AOTAutograd builds around the partition then has that many more slots for saved tensors."""
    out = fw.graph.output_node()
    values = list(out.args[0])
    vals = [n.meta.get("val") for n in fw.graph.nodes if isinstance(n.meta.get("val"), torch.Tensor)]
    fake_mode = next((v.fake_mode for v in vals if hasattr(v, "fake_mode")), None)
    device = vals[0].device if vals else torch.device("cpu")
    pads = []
    with fw.graph.inserting_before(out):
        for _ in range(count):
            pad = fw.graph.call_function(torch.ops.aten.empty.memory_format, ([0],),
                                         {"dtype": torch.float32, "device": device})
            with fake_mode if fake_mode is not None else contextlib.nullcontext():
                pad.meta["val"] = torch.empty(0, device=device)
            pads.append(pad)
    out.args = ((*values, *pads),)
    saved = len(values) - num_fwd_outputs
    inputs = list(bw.graph.find_nodes(op="placeholder"))
    last = inputs[saved - 1] if saved else None  # the backward's inputs: the saved tensors, then the rest
    for pad in pads:
        taken = bw.graph.placeholder(f"{pad.name}_slot")
        taken.meta["val"] = pad.meta["val"]
        if last is not None:
            last.append(taken)
        elif inputs:
            inputs[0].prepend(taken)
        last = taken
    # Not recompiled here: AOTAutograd hands both to their compilers, which generate the code (boxed_eager)


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


# A key of a dynamo node's meta["custom"]: AOTAutograd copies "custom" onto every joint-graph node traced from
# that node, and a backward node's from the forward node of its seq_nr (copy_fwd_metadata_to_bw_nodes)
LOSS_REGION_TAG = "autoremat_loss_region"


# Which chunk of the chunked loss a node was traced from, numbered from 1, in the same meta["custom"]
LOSS_CHUNK_TAG = "autoremat_loss_chunk"


@contextlib.contextmanager
def annotate(extra: dict[str, Any]) -> Iterator[None]:
    """Add `extra` to meta["custom"] of the nodes traced inside, while node meta is preserved (AOTAutograd).

    torch.fx.traceback.current_meta is a shallow copy of the meta of the node being traced; its own
    `annotate` updates the "custom" dict in place, which is that node's dict, so the tag outlived the block
    and every later trace of the node carried it. A new dict is set instead."""
    meta = fx_traceback.current_meta
    had, old = "custom" in meta, meta.get("custom")
    meta["custom"] = {**(old or {}), **extra}
    try:
        yield
    finally:
        if had:
            meta["custom"] = old
        else:
            meta.pop("custom", None)


def tagged(node: torch.fx.Node, key: str) -> Any:
    """What a joint-graph node carries under `key` in its meta["custom"] (LOSS_REGION_TAG, LOSS_CHUNK_TAG), or
    None."""
    custom = node.meta.get("custom")
    return custom.get(key) if isinstance(custom, dict) else None


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


def schema_effects(op: OpOverload) -> tuple[list[str], list[str], bool]:
    """What `op`'s schema declares beyond a pure function: the arguments it writes (`Tensor(a!)`), the
    arguments and returns that alias another value without a write (`Tensor(a)`, a view), and whether it
    takes a Generator (it draws random numbers from it)."""
    schema = op._schema
    writes = [a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]
    aliases = [a.name for a in schema.arguments if a.alias_info is not None and not a.alias_info.is_write]
    aliases += [r.name or f"return {i}" for i, r in enumerate(schema.returns)
                if r.alias_info is not None and not r.alias_info.is_write]
    generator = any("Generator" in str(a.type) for a in schema.arguments)
    return writes, aliases, generator


# Functionalization turns a call of an op that mutates its arguments into one of these higher-order ops,
# whose first argument is that op (`auto_functionalized(op, **kwargs)`): the graph stays functional, the
# runtime still writes the mutated arguments back.
_FUNCTIONALIZED = tuple(getattr(torch.ops.higher_order, name) for name in ("auto_functionalized", "auto_functionalized_v2")
                        if hasattr(torch.ops.higher_order, name))
# A call of an op registered as having side effects, ordered by an effect token (`with_effects(token, op, ...)`).
_WITH_EFFECTS = getattr(torch.ops.higher_order, "with_effects", None)


def functionalized_mutation(target: object, args: tuple) -> OpOverload | None:
    """The mutating op a functionalized call (`auto_functionalized`) wraps, or None for any other target."""
    if target in _FUNCTIONALIZED and args and isinstance(args[0], OpOverload):
        return args[0]
    return None


def effectful_op(target: object, args: tuple) -> OpOverload | None:
    """The op a `with_effects` call (an op with declared side effects) wraps, or None for any other target."""
    if _WITH_EFFECTS is not None and target is _WITH_EFFECTS and len(args) > 1 and isinstance(args[1], OpOverload):
        return args[1]
    return None


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


def aten_ops_of(fn: Callable, values: list[torch.Tensor]) -> list[OpOverload] | None:
    """The ATen ops `fn(*tensors)` runs, traced on meta tensors shaped like `values`; None if it cannot be
    traced so (data-dependent control flow, an op without a meta kernel). Runs outside any fake mode, so it
    can be called from a dynamo backend while dynamo's fake mode is active."""
    metas = [torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device="meta") for v in values]
    try:
        with unset_fake_temporarily():
            graph = make_fx(fn)(*metas).graph
    except Exception:  # noqa: BLE001 - any failure to trace means "not known", never a wrong answer
        return None
    return [n.target for n in graph.nodes if n.op == "call_function"]


def forward_hooks(module: torch.nn.Module) -> list[Callable]:
    """The forward pre-hooks and forward hooks registered on `module` itself (nn.Module keeps them in private
    dicts; torch.nn.modules.module's global hooks are not among them)."""
    return [*module._forward_pre_hooks.values(), *module._forward_hooks.values()]
