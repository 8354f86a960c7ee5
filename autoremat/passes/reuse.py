"""Backward pointwise ops write their result into an input that dies at them (buffer reuse).

The joint graph is functional: every backward op allocates its output, so at a pointwise op whose
input is read by nothing after it (`gelu_backward(grad, x)` at a transformer MLP's backward: the
incoming gradient, the saved fc output and the result, three [tokens, 4d] tensors at once) the
input and the result are alive together for one step. A pointwise op may write into a dying input
of the same shape, dtype and strides instead: its out= variant (`gelu_backward.grad_input`,
`mul.out`) with that input as `out` computes the same values with the same kernel, element by
element, and allocates nothing.

`dying_inputs` finds these pairs in a joint graph, from its structure alone: the input must be a
backward value (so its last reader is the same in every plan: backward ops keep their joint order
and recomputed forward ops never read them), own its storage with no view of it anywhere, and be
read last by the op. The profile marks the op's result as sharing the input's storage (the memory
model and the ILP then see it), and `write_into_dying` rewrites the backward module to match.
Only the eager path uses it: Inductor plans its own buffer reuse.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from autoremat.torch_internals import OpOverload, is_tangent, out_kernel_copies


def out_variant(op: OpOverload) -> tuple[OpOverload, str] | None:
    """The out= overload of `op` taking the same arguments plus one written output, and that output's name.

    Only an overload with a kernel of its own: the generated out= wrapper of an op that has only a
    functional kernel (`mul.Scalar_out`, `div.Scalar_out`, `native_dropout_backward.out`) allocates the
    whole result and copies it into `out`, so writing through it saves nothing and the memory model, which
    books no output for a writer, would under-predict by that result
    (tests/test_recomputed_runs.py::test_an_out_overload_that_copies_its_result_is_not_written_through).
    """
    names = [(a.name, str(a.type)) for a in op._schema.arguments]  # pow.Tensor_Scalar is not pow.Tensor_Tensor_out
    packet = op.overloadpacket
    for overload in packet.overloads():
        candidate = getattr(packet, overload)
        args = candidate._schema.arguments
        written = [a for a in args if a.alias_info is not None and a.alias_info.is_write]
        if len(written) == 1 and written[0].kwarg_only and [
                (a.name, str(a.type)) for a in args if a is not written[0]] == names:
            return None if out_kernel_copies(candidate) else (candidate, written[0].name)
    return None


def _rewritable(n: fx.Node) -> bool:
    op = n.target
    return (n.op == "call_function" and isinstance(op, OpOverload) and torch.Tag.pointwise in op.tags
            and torch.Tag.nondeterministic_seeded not in op.tags and not op._schema.is_mutable
            and isinstance(n.meta.get("val"), torch.Tensor) and out_variant(op) is not None)


def _same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and a.stride() == b.stride() and a.device == b.device


def dying_inputs(joint: fx.GraphModule) -> dict[str, str]:
    """{backward pointwise node: the backward input it may write its result into}.

    The input may be a view (an `mm` output viewed as [batch, seq, 4d]): every value sharing its
    storage must be a backward value read by nothing after the node.
    """
    from torch.multiprocessing.reductions import StorageWeakRef

    nodes = list(joint.graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    backward: set[fx.Node] = set()
    sharing: dict[StorageWeakRef, list[fx.Node]] = {}  # the values of each storage (views included)
    for n in nodes:
        if is_tangent(n) or any(a in backward for a in n.all_input_nodes):
            backward.add(n)
        val = n.meta.get("val")
        if isinstance(val, torch.Tensor) and n.op != "output":
            sharing.setdefault(StorageWeakRef(val.untyped_storage()), []).append(n)
    found: dict[str, str] = {}
    taken: set[StorageWeakRef] = set()
    leaving = set(nodes[-1].all_input_nodes) if nodes and nodes[-1].op == "output" else set()
    for n in nodes:
        if n not in backward or not _rewritable(n):
            continue
        val = n.meta["val"]
        for u in n.args:
            uval = u.meta.get("val") if isinstance(u, fx.Node) else None
            if not isinstance(uval, torch.Tensor) or u.target is operator.getitem or not _same_layout(uval, val):
                continue
            key = StorageWeakRef(uval.untyped_storage())
            group = sharing.get(key, [])
            if key in taken or not all(w in backward and w.op == "call_function" for w in group):
                continue
            # A value the graph returns goes to autograd, which sums a gradient that waits for another
            # (a tied weight's) into a new tensor when it is a view: written into a view, or into a chain
            # of buffers that began in one, it would cost that tensor beyond the prediction (GPT-2's tied
            # LM head). So it is written only into a whole contiguous buffer of its own.
            if n in leaving and (len(group) > 1 or u.name in found.values() or u.name in found
                                 or not uval.is_contiguous()):
                continue
            if all(position[r] <= position[n] for w in group for r in w.users):
                found[n.name] = u.name
                taken.add(key)
                break
    return found


def forward_writable(joint: fx.GraphModule) -> dict[str, tuple[str, ...]]:
    """{forward pointwise node: the inputs it could write its result into, were they to die at it}.

    Whether a forward value dies at a reader depends on the plan (what is saved, what recomputed, where
    recomputation is cut), so this lists only what the structure allows (an out= variant, an input of
    the result's shape, dtype and strides, computed by an op and not a tuple's part); the schedule
    decides which recomputed copies do write (`autoremat.model.recomputed_writes`).
    """
    backward: set[fx.Node] = set()
    found: dict[str, tuple[str, ...]] = {}
    for n in joint.graph.nodes:
        if is_tangent(n) or any(a in backward for a in n.all_input_nodes):
            backward.add(n)
            continue
        if not _rewritable(n):
            continue
        into = tuple(dict.fromkeys(
            u.name for u in n.args if isinstance(u, fx.Node) and u.op == "call_function"
            and u.target is not operator.getitem and isinstance(u.meta.get("val"), torch.Tensor)
            and _same_layout(u.meta["val"], n.meta["val"])))
        if into:
            found[n.name] = into
    return found


def write_into_dying(gm: fx.GraphModule, pairs: dict[str, str]) -> int:
    """Rewrite the nodes of `pairs` found in backward module `gm` to their out= variants; the count rewritten."""
    by_name = {n.name: n for n in gm.graph.nodes}
    position = {n: i for i, n in enumerate(gm.graph.nodes)}
    done = 0
    for name, into in pairs.items():
        n, u = by_name.get(name), by_name.get(into)
        if n is None or u is None or u not in n.args:
            continue
        if any(position[w] > position[n] for w in u.users):  # not the plan the profile described: leave the node functional
            continue
        op, out = out_variant(n.target)
        n.target = op
        n.kwargs = {**n.kwargs, out: u}
        done += 1
    if done:
        gm.graph.lint()
        gm.recompile()
    return done

