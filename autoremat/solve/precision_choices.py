"""What each compute-dtype choice changes in a joint graph traced in fp32: the ILP's inputs.

precision_measure.py decides which dynamo calls may run in 16 bits and how much error each adds; here each
aten node of the fp32 joint graph is traced back to those calls (`from_node` provenance), so the
solver knows which values become 16-bit with which calls (their *owners*), how much faster the ops
get on the device, and what the casts cost.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.fx as fx

from autoremat.model.devices import DeviceSpec
from autoremat.model.graph_profile import GraphProfile


@dataclass
class DtypeChoices:
    """What the ILP may choose for one joint graph (traced in fp32) and what each choice changes.

    options: castable call -> {low dtype: its measured relative error}; only safe dtypes appear.
    owners: forward node of the joint graph -> the castable calls that must all be low for it to be
        low (its bytes halve); a value read only by castable calls is owned by them (they read a
        low copy of it instead).
    speedup: forward node -> (fp32 time - low time) of it and its backward, in seconds.
    cast_time: castable call -> time of the casts it needs (weights cast again in the backward).
    """

    options: dict[str, dict[str, float]]
    owners: dict[str, frozenset[str]]
    speedup: dict[str, float]
    cast_time: dict[str, float]


_MATMUL_ATEN = ("aten.mm", "aten.addmm", "aten.bmm", "aten.baddbmm", "aten.convolution")


def origin(node: fx.Node) -> str:
    """The dynamo graph call an aten node of the joint graph was traced from ('' if unknown)."""
    src = node.meta.get("from_node")
    return src[0].name if src else ""


def dtype_choices(joint: fx.GraphModule, profile: GraphProfile, options: dict[str, dict[str, float]],
                  kept: set[str], device: DeviceSpec) -> DtypeChoices:
    """Map the per-call `options` onto the fp32 joint graph `joint` (profiled as `profile`).

    `kept` names the dynamo calls that stay fp32 whatever their inputs are (FP32_KEPT calls).
    """
    nodes = profile.nodes
    owners: dict[str, frozenset[str]] = {}
    by_name = {n.name: n for n in joint.graph.nodes}
    speedup: dict[str, float] = {}
    cast_bytes: dict[str, dict[str, tuple[int, bool]]] = {c: {} for c in options}
    for name, p in nodes.items():
        if p.kind != "forward":
            continue
        n = by_name[name]
        src = origin(n)
        if src in options:
            owners[name] = frozenset([src])
            for i in p.inputs:
                q = nodes[i]
                if origin(by_name[i]) != src and q.nbytes and q.dtype.startswith("float"):
                    cast_bytes[src][i] = (q.nbytes, q.kind in ("param", "input"))
        elif src in kept:
            continue
        elif p.tuple_parent:
            if p.tuple_parent in owners:
                owners[name] = owners[p.tuple_parent]
        elif p.dtype.startswith("float"):
            floats = [i for i in p.inputs if nodes[i].dtype.startswith("float") and nodes[i].shape not in ((), None)]
            if floats and all(i in owners for i in floats):
                owners[name] = frozenset().union(*(owners[i] for i in floats))
    # A value only castable calls read is read through a low copy: it is as good as low.
    users: dict[str, list[str]] = {}
    for name, p in nodes.items():
        if p.kind == "forward":
            for i in p.inputs:
                users.setdefault(i, []).append(name)
    for name, p in nodes.items():
        if p.kind == "forward" and name not in owners and p.dtype.startswith("float") and users.get(name):
            srcs = {origin(by_name[u]) for u in users[name]}
            if srcs <= set(options):
                owners[name] = frozenset(srcs)
    for name in owners:
        p = nodes[name]
        if p.time_s and p.storage == name:
            matmul = p.target.startswith(_MATMUL_ATEN)
            low = device.op_time(p.flops, p.bytes_moved / 2, dtype="bf16", matmul=matmul)
            speedup[name] = (p.time_s - low) * (3 if matmul else 2)  # forward + backward (two matmuls)
    cast_time = {c: sum(device.op_time(0.0, 1.5 * b) * (2 if weight else 1) for b, weight in ins.values())
                 for c, ins in cast_bytes.items()}
    return DtypeChoices(options, owners, speedup, cast_time)
