"""What crosses regions: values one region hands later regions (a residual stream crossing a graph
break) and when they die, and gradients that wait in autograd for another region's (`tied_waits`):
for the memory model (`memory.simulate`) and the ILP's rows (lifetimes.output_spans, waiting_bytes)."""

from __future__ import annotations

from autoremat.model.graph_profile import GraphProfile
from autoremat.model.schedule import Schedule
from autoremat.passes.recompute_names import base


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


def tied_waits(profiles: list[GraphProfile]) -> dict[int, list[tuple[int, str]]]:
    """Gradients that wait in autograd for another region's: {position whose backward they wait for:
    [(position of the region that computed them, the gradient)]}.

    A tied weight (GPT-2's embedding, also its LM head) is read by two regions; autograd sums their
    gradients in the weight's input buffer and runs its AccumulateGrad once both have arrived. The
    later region's backward runs first: its gradient waits there until the earlier region's backward
    returns the other one (tests/test_regions.py::test_a_tied_weights_gradient_waits_for_the_other_regions_and_the_plan_predicts_it
    measures it). Any gradient arriving in between is added to it in place and dies at once.
    The same holds for a region's output that two later regions read (a residual stream whose add
    falls in the next region: `x + block(x)` written outside the block): the later reader's gradient
    of it waits for the earlier reader's.
    """
    by_key: dict[str, list[tuple[int, str]]] = {}
    for k, g in enumerate(profiles):
        for name, key in g.tied.items():
            if g.nodes[name].storage:
                by_key.setdefault(key, []).append((k, name))
    waits: dict[int, list[tuple[int, str]]] = {}
    for grads in by_key.values():
        if len(grads) > 1:
            waits.setdefault(min(grads)[0], []).append(max(grads))
    return waits
