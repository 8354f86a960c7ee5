"""What the passes over a joint (forward + backward) graph share."""

from __future__ import annotations

import torch.fx as fx

from autoremat.torch_internals import is_tangent


def backward_side(graph: fx.Graph) -> set[fx.Node]:
    """The nodes of a joint graph that depend on a tangent: its backward (joint order is topological)."""
    backward: set[fx.Node] = set()
    for n in graph.nodes:
        if is_tangent(n) or any(a in backward for a in n.all_input_nodes):
            backward.add(n)
    return backward
