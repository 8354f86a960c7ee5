"""Profile every node of a captured joint graph: bytes, FLOPs, time, and whether it may be recomputed.

The result is a `GraphProfile` (graph_profile.py), a plain description of the graph by node name that
the memory model and the solver read without touching FX again. Each node also gets ``node.meta["autoremat"]``.

    >>> import torch
    >>> from autoremat.capture.aot import capture
    >>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    >>> graphs = capture(model, (torch.randn(4, 8),))
    >>> prof = profile_graph(graphs[0])
    >>> prof.nodes["relu"].kind, prof.nodes["relu"].nbytes
    ('forward', 128)
"""

from __future__ import annotations

import hashlib
import operator
import re

import torch
import torch.fx as fx
from torch.utils.flop_counter import flop_registry

from autoremat.capture.captured import CapturedGraph
from autoremat.capture.regions import accumulate_grad
from autoremat.model.devices import DeviceSpec, get_device
from autoremat.model.graph_profile import GraphProfile, NodeProfile
from autoremat.model.inductor_code import mark_inductor_code
from autoremat.model.marks import user_mark
from autoremat.passes import fused_linear_loss
from autoremat.passes.remat import BATCH_NORM_WITH_STATS
from autoremat.passes.reuse import dying_inputs, forward_writable
from autoremat.passes.rng_replay import draw_scratch, is_draw, is_replay
from autoremat.torch_internals import (
    LOSS_CHUNK_TAG,
    LOSS_REGION_TAG,
    OpOverload,
    StorageWeakRef,
    arg_tree_leaves,
    effectful_op,
    functionalized_mutation,
    is_mutable_op,
    is_primal,
    is_tangent,
    mutated_input_indices,
    schema_effects,
    tagged,
    tree_map,
)

# Namespaces of torch's and autoremat's own ops. An op of any other namespace is a custom op
# (torch.library): recomputed when its schema is functional (recompute_ban), named in the plan's notes.
PURE_NAMESPACES = {"aten", "prims", "autoremat"}
# Ops that are never worth saving: recomputing them costs nothing (metadata only).
_VIEW_COST = 0.0


def _tensors(val) -> list[torch.Tensor]:
    if isinstance(val, torch.Tensor):
        return [val]
    if isinstance(val, (tuple, list)):
        return [t for v in val for t in _tensors(v)]
    return []


def _nbytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


def _dense_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _target_name(node: fx.Node) -> str:
    if node.op != "call_function":
        return node.op
    t = node.target
    if t is operator.getitem:
        return "getitem"
    if not isinstance(t, OpOverload) and hasattr(t, "__qualname__"):
        return f"{t.__module__}.{t.__qualname__}"  # a Python function: no address in the fingerprint
    return str(t)


def module_path_of(node: fx.Node) -> str:
    """The innermost nn.Module path a graph node was traced in ("" outside every module)."""
    # Backward nodes carry the forward node they came from in "fwd_nn_module_stack".
    stack = node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack")
    if not stack:
        return ""
    path = str(list(stack.values())[-1][0])
    path = re.sub(r"^L\['[^']*'\]\.?", "", path)  # "L['self'].blocks.0" -> "blocks.0"
    return re.sub(r"^__self__\.?", "", path)  # a compiled bound method's module: "__self__.0" -> "0"


def recompute_ban(node: fx.Node) -> str:
    """Why `node` must not be recomputed in the backward, or "" when recomputing it is safe.

    An op is judged by its schema and tags, whatever library registered it: one that declares no write
    and no alias, takes no Generator and is not tagged `nondeterministic_seeded` is a function of its
    inputs, so recomputing it gives the forward's value. Its bytes come from its fake kernel (the
    node's "val"), as for any op."""
    t = node.target
    if t is operator.getitem:
        return ""
    if is_draw(t):
        return "random op: recomputing it would draw fresh randomness (its draw is replayed instead)"
    if is_replay(t):
        return ""  # replays a saved generator state: the same draw every time
    wrapped = functionalized_mutation(t, node.args)
    if wrapped is not None:  # functionalization's form of a call that writes its arguments
        writes = schema_effects(wrapped)[0]
        return f"custom op {wrapped} mutates {', '.join(writes) or 'an input'}: recomputing it would write again"
    wrapped = effectful_op(t, node.args)
    if wrapped is not None:
        return f"custom op {wrapped} has declared side effects: recomputing it would repeat them"
    if not isinstance(t, OpOverload):
        return f"unsupported op {_target_name(node)} (no schema: a higher-order op or a Python function)"
    ns = t.namespace
    if ns in ("_c10d_functional", "c10d_functional", "c10d", "_dtensor"):
        return "collective: recomputing it would communicate again"
    writes, aliases, generator = schema_effects(t)
    custom = ns not in PURE_NAMESPACES
    if _is_random(t) or generator:
        why = "tagged nondeterministic_seeded" if _is_random(t) else "takes a Generator"
        return (f"custom op {t} is random ({why}): recomputing it would draw fresh randomness" if custom
                else "random op: recomputing it would draw fresh randomness")
    if writes or is_mutable_op(t):
        return (f"custom op {t} mutates {', '.join(writes) or 'an input'}: recomputing it would write again"
                if custom else "mutates an input")
    if custom and aliases:
        # A view's storage is its input's; a fake kernel need not say so, and a copy made in the
        # backward would be a new tensor, not that view.
        return f"custom op {t} aliases {', '.join(aliases)}: its output is not a buffer of its own"
    if custom and node.meta.get("val") is None:
        return f"custom op {t} has no fake kernel: the bytes of its output are unknown"
    if custom and not _tensors(node.meta.get("val")):
        return f"custom op {t} returns no tensor: nothing of it to save or recompute"
    if torch.Tag.nondeterministic_bitwise in t.tags and "index_put" in t.name():
        return "nondeterministic: recomputation may differ bitwise"
    return ""


def is_custom_op(node: fx.Node) -> bool:
    """A call of an op registered outside torch and autoremat (torch.library: transformers, flash-attn, ...)."""
    t = node.target
    if functionalized_mutation(t, node.args) is not None or effectful_op(t, node.args) is not None:
        return True
    return isinstance(t, OpOverload) and t.namespace not in PURE_NAMESPACES


def recomputes_without_buffers(node: fx.Node) -> bool:
    """A training-mode batch norm reads the running stats only to update them: its output, mean and
    rstd come from the batch alone. `passes.split` recomputes it as `_native_batch_norm_legit.no_stats`
    on the same input, the same kernel minus the update, so the recomputed output is the forward's bit
    for bit and the running stats are still updated once, by the forward."""
    return node.target is BATCH_NORM_WITH_STATS and bool(node.args[5])


def _is_random(t: object) -> bool:
    return isinstance(t, OpOverload) and torch.Tag.nondeterministic_seeded in t.tags


def _drawn_elements(val: object) -> int:
    """Elements a draw produces: its largest output (the generator state saved beside it is a copy)."""
    return max((t.numel() for t in _tensors(val)), default=0)


def _flops(node: fx.Node) -> tuple[float, bool]:
    t = node.target
    if not isinstance(t, OpOverload):
        return 0.0, False
    fn = flop_registry.get(t.overloadpacket) or flop_registry.get(t)
    if fn is None:
        return 0.0, False
    args, kwargs = pytree_map_vals((node.args, node.kwargs))
    try:
        return float(fn(*args, out_val=node.meta.get("val"), **kwargs)), True
    except Exception:  # a formula that does not fit this overload: treat as elementwise
        return 0.0, False


def pytree_map_vals(tree):
    return tree_map(lambda a: a.meta.get("val") if isinstance(a, fx.Node) else a, tree)


def profile_graph(cg: CapturedGraph, device: DeviceSpec | str | None = None) -> GraphProfile:
    """Describe every node of a captured joint graph (see the module docstring)."""
    dev = get_device(device if device is not None else cg.device)
    gm = cg.joint
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    primals = [n for n in placeholders if is_primal(n)]
    static = {primals[i].name for i in cg.static_input_indices if i < len(primals)}

    # Backward = everything downstream of a tangent; the rest is computable from the primals.
    backward: set[fx.Node] = set()
    for n in gm.graph.nodes:
        if is_tangent(n):
            backward.add(n)
        elif any(a in backward for a in n.all_input_nodes):
            backward.add(n)

    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    outs = list(arg_tree_leaves(*out_node.args))
    fw_outputs = [o.name for o in outs[: cg.num_fwd_outputs] if isinstance(o, fx.Node)]
    grad_outputs = [o.name for o in outs[cg.num_fwd_outputs :] if isinstance(o, fx.Node)]

    mutated = _mutated_primals(out_node, primals, static, grad_outputs_all=outs[cg.num_fwd_outputs :])

    owner: dict[StorageWeakRef, str] = {}  # each storage's first node: the one that allocates it
    nodes: dict[str, NodeProfile] = {}
    for n in gm.graph.nodes:
        if n.op != "output":
            nodes[n.name] = n.meta["autoremat"] = _node_profile(n, _kind(n, static, backward), owner, mutated, dev)
    if cg.compiler == "inductor":
        mark_inductor_code(gm, nodes, dev, {*fw_outputs, *grad_outputs})
    else:
        _eager_writes(gm, nodes)
    _link_tuples(nodes)

    return GraphProfile(
        nodes=nodes,
        fw_outputs=fw_outputs, grad_outputs=grad_outputs,
        released=[n.name for n in gm.graph.nodes if n.op == "call_function" and n.target is accumulate_grad],
        index=cg.index, fingerprint=fingerprint(gm),
        device=dev.name,
        notes=_constant_notes(gm),
        **_region_links(cg, primals, outs[: cg.num_fwd_outputs], outs[cg.num_fwd_outputs:]),
    )


def _kind(n: fx.Node, static: set[str], backward: set[fx.Node]) -> str:
    if n.op == "placeholder":
        return "tangent" if is_tangent(n) else ("param" if n.name in static else "input")
    if n.op == "get_attr":
        # A lifted tensor constant (`_tensor_constant0`): an attribute of the graph module, held
        # from compilation on. Like a parameter it is never computed, always there, and not part
        # of the step's activations (the forward and backward modules share the one tensor).
        return "constant"
    return "backward" if n in backward else "forward"


def _node_profile(n: fx.Node, kind: str, owner: dict, mutated: set[str], dev: DeviceSpec) -> NodeProfile:
    """One node's profile: its storage (the first node of a storage allocates it), bytes, time, and
    whether it may be recomputed."""
    val = n.meta.get("val")
    prof = NodeProfile(name=n.name, kind=kind, target=_target_name(n), inputs=tuple(a.name for a in n.all_input_nodes),
                       storage="", nbytes=0, module=module_path_of(n), mark=user_mark(n),
                       loss_region=bool(tagged(n, LOSS_REGION_TAG)), loss_chunk=tagged(n, LOSS_CHUNK_TAG) or 0)
    if isinstance(val, torch.Tensor):
        prof.dtype = str(val.dtype).replace("torch.", "")
        prof.shape = tuple(int(s) for s in val.shape)
        key = StorageWeakRef(val.untyped_storage())
        if key in owner:  # a view or an in-place result: shares an earlier allocation
            prof.storage = owner[key]
        else:
            owner[key] = n.name
            prof.storage = n.name
            prof.nbytes = _nbytes(val) if kind in ("forward", "backward", "tangent") else 0
    elif isinstance(val, (tuple, list)) and n.op == "call_function":
        prof.is_tuple = True
        used = {u.args[1] for u in n.users if u.target is operator.getitem}
        prof.transient_bytes = sum(_nbytes(t) for i, t in enumerate(val) if isinstance(t, torch.Tensor) and i not in used)
    if n.target is operator.getitem and isinstance(n.args[0], fx.Node):
        prof.tuple_parent = n.args[0].name
    if n.op == "call_function":
        prof.recompute_ban = recompute_ban(n)
        if not prof.recompute_ban and mutated & set(prof.inputs) and not recomputes_without_buffers(n):
            # The runtime writes the new value into the buffer after the forward, so a
            # backward recomputation would read the updated buffer (and trip autograd's
            # version check).
            prof.recompute_ban = "reads a buffer the forward updates"
        _price(n, prof, val, dev)
    return prof


def _price(n: fx.Node, prof: NodeProfile, val: object, dev: DeviceSpec) -> None:
    """FLOPs, bytes moved and roofline time of a call (a view costs next to nothing)."""
    flops, matmul = _flops(n)
    moved = sum(_dense_bytes(t) for a in n.all_input_nodes for t in _tensors(a.meta.get("val")))
    moved += sum(_dense_bytes(t) for t in _tensors(val))
    is_alias = prof.storage and prof.storage != n.name
    if n.target is operator.getitem or (is_alias and not flops):
        prof.flops, prof.bytes_moved, prof.time_s = 0.0, 0.0, _VIEW_COST
        return
    # a matmul runs at its inputs' rate (a 16-bit one may write fp32, or a tuple)
    ins = [t for a in n.all_input_nodes for t in _tensors(a.meta.get("val")) if t.is_floating_point()]
    rate = str(ins[0].dtype).replace("torch.", "") if matmul and ins else prof.dtype
    dtype = {"bfloat16": "bf16", "float16": "fp16"}.get(rate, "fp32")
    prof.flops = flops if matmul else float(sum(t.numel() for t in _tensors(val)))
    prof.bytes_moved = float(moved)
    prof.time_s = dev.op_time(prof.flops, prof.bytes_moved, dtype=dtype, matmul=matmul)
    # No op is timed on real tensors here: a custom op without a FLOP formula (register_flop_formula) is
    # priced as an elementwise op, by the bytes it reads and writes at the device's memory bandwidth. That
    # is a floor for a compute-bound kernel (a grouped matmul), so the plan's notes name such ops.
    prof.time_from_bytes = not matmul and is_custom_op(n)
    if is_draw(n.target) or is_replay(n.target) or _is_random(n.target):
        prof.time_s += _drawn_elements(val) * dev.random_draw_s_per_element
        prof.transient_bytes += draw_scratch(n)


def _eager_writes(gm: fx.GraphModule, nodes: dict[str, NodeProfile]) -> None:
    """Without Inductor, the backward module writes these pointwise results into a dying input
    (passes/reuse.py), and the forward ones the passes may write in place."""
    moved: dict[str, str] = {}
    for name, into in dying_inputs(gm).items():  # in graph order: a chain ends at the first buffer
        moved[name] = nodes[name].storage = nodes[into].storage
        nodes[name].nbytes = 0
        nodes[name].writes_into = into
    for prof in nodes.values():  # views of a moved result view the buffer it wrote into
        prof.storage = moved.get(prof.storage, prof.storage)
    for name, into in forward_writable(gm).items():
        nodes[name].writable = into
    for name, pair in fused_linear_loss.overwritable(gm).items():
        nodes[name].overwrites = pair


def _link_tuples(nodes: dict[str, NodeProfile]) -> None:
    for prof in nodes.values():
        if prof.tuple_parent and prof.storage == prof.name:
            nodes[prof.tuple_parent].tuple_out_bytes += prof.nbytes
        elif prof.tuple_parent and prof.storage and not nodes[prof.tuple_parent].storage:
            # A multi-output view op (split, chunk, unbind): the tuple itself keeps the viewed
            # storage alive until its last getitem, so it holds a reference too.
            nodes[prof.tuple_parent].storage = prof.storage


def _region_links(cg: CapturedGraph, primals: list[fx.Node], fw_outs: list, grads: list) -> dict:
    """A region's links (capture.CapturedGraph.links) in this graph's names. AOTAutograd keeps the
    region's inputs in order as its primals and returns its outputs last, after any mutated
    buffers; if the counts disagree (an output aliasing an input is returned outside the graph),
    the region is treated like a graph of its own."""
    links = cg.links
    if links is None or len(primals) != len(links.sources) or len(fw_outs) < links.outputs:
        return {}
    user = [o.name if isinstance(o, fx.Node) else None for o in fw_outs[len(fw_outs) - links.outputs:]]
    sources = {p.name: (cg.index - links.position + src[0], src[1])
               for p, src in zip(primals, links.sources) if src is not None}
    first = cg.index - links.position  # the index of the dynamo graph's first region: keys are per dynamo graph
    tied = {grads[i].name: f"{first}:{key}" for i, key in links.shared.items()
            if len(grads) == len(primals) and isinstance(grads[i], fx.Node)}
    return {"sources": sources, "user_outputs": user, "exported": [user[i] for i in links.exported if user[i]],
            "tied": tied}


def _constant_notes(gm: fx.GraphModule) -> list[str]:
    """Lifted tensor constants are not activations, and the ledger counts only the model's own tensors."""
    constants = {StorageWeakRef(n.meta["val"].untyped_storage()): (n.target, _nbytes(n.meta["val"]))
                 for n in gm.graph.nodes if n.op == "get_attr" and isinstance(n.meta.get("val"), torch.Tensor)}
    held = sum(nbytes for _, nbytes in constants.values())
    if not held:
        return []
    names = ", ".join(sorted(name for name, _ in constants.values()))
    return [f"{len(constants)} lifted tensor constant(s) ({names}) hold {held} B for as long as the compiled step "
            "lives, outside the activations and the ledger"]


def _mutated_primals(out_node: fx.Node, primals: list[fx.Node], static: set[str], grad_outputs_all: list) -> set[str]:
    """Names of the primals the forward mutates (returned as extra outputs, copied back by the runtime)."""
    idx = mutated_input_indices(out_node)
    if idx is not None:
        return {primals[i].name for i in idx if i < len(primals)}
    # No descriptors: assume every buffer (a static input without a gradient) may be mutated.
    return {p.name for i, p in enumerate(primals)
            if p.name in static and (i >= len(grad_outputs_all) or grad_outputs_all[i] is None)}


def fingerprint(gm: fx.GraphModule) -> str:
    """A structural hash of a joint graph: ops, wiring, shapes, dtypes, checkpoint marks (not values, names)."""
    h = hashlib.sha256()
    index = {}
    for i, n in enumerate(gm.graph.nodes):
        index[n] = i
        val = n.meta.get("val")
        shapes = [(tuple(t.shape), str(t.dtype)) for t in _tensors(val)]
        args = fx.node.map_arg((n.args, n.kwargs), lambda a: index.get(a, -1))
        h.update(repr((n.op, _target_name(n), args, shapes)).encode() + user_mark(n).encode())  # marks bind the plan
    return h.hexdigest()[:16]
