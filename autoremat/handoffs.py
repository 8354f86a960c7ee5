"""Values one region hands later regions (a residual stream crossing a graph break), and when they die:
for the memory model (`memory.simulate`) and the ILP's output spans (lifetimes.output_spans)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from autoremat.cuts import base
from autoremat.profile import GraphProfile

if TYPE_CHECKING:
    from autoremat.memory import Schedule


def region_handoffs(profiles: list[GraphProfile]) -> dict[tuple[int, str], list[tuple[int, str]]]:
    """The values regions hand later regions, and nobody else holds: {(producer's position, its output):
    [(consumer's position, the consumer's primal)]}. A value the user also sees (`exported`) is not one."""
    position = {g.index: i for i, g in enumerate(profiles)}
    found: dict[tuple[int, str], list[tuple[int, str]]] = {}
    for j, g in enumerate(profiles):
        for primal, (index, output) in g.sources.items():
            k = position.get(index)
            if k is None or k >= j or output >= len(profiles[k].user_outputs):
                continue
            name = profiles[k].user_outputs[output]
            if name is not None and name not in profiles[k].exported:
                found.setdefault((k, name), []).append((j, primal))
    return found


def handed_over(graphs: list[tuple[GraphProfile, Schedule]],
                handoffs: dict[tuple[int, str], list[tuple[int, str]]]) -> dict[int, list[tuple[int, str]]]:
    """When the values one region hands later regions die: {moment: [(graph position, output)]}.

    Moments count the forwards 0..n-1, then the backwards n..2n-1 (the last graph's first). A
    region's output that only later regions read (not the user, not its own backward) lives until
    the last of them is done with it: the end of its forward, or of its backward if that reads it.
    Every other forward output is held to the end of the step, as the caller holds it.
    """
    n = len(graphs)
    read_back: dict[int, set[str]] = {}  # per consumer: what its backward (recomputation included) reads
    moments: dict[int, list[tuple[int, str]]] = {}
    for (k, name), consumers in handoffs.items():
        producer, producer_sched = graphs[k]
        if name in producer_sched.saved or producer.nodes[name].kind != "forward":
            continue  # its own backward holds it (released there), or it owns no storage of its own
        last = -1
        for j, primal in consumers:
            if j not in read_back:
                g, sched = graphs[j]
                read_back[j] = {base(i) for node in sched.backward for i in sched.reads.get(node, g.nodes[base(node)].inputs)}
            last = max(last, 2 * n - 1 - j if primal in read_back[j] else j)
        moments.setdefault(last, []).append((k, name))
    return moments
