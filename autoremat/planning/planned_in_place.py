"""The planned step compiled from the code of the trace it was planned on, without tracing it again.

`plan_jointly` plans every graph of a step from one trace of it, then compiles the step with the plan.
Under compiler="eager" that compile could trace the kept dynamo graph through AOTAutograd once more, now
with the plan's partition: a second trace of every graph whose plan differs from the capture's, a large
share of a plan's time (benchmarks/plan_time.py --quick times the stages). The trace the plan was made
from already has, for each graph, the joint graph as it was partitioned and an autograd.Function around its
code (capture/graph_code.py), so `swap_in_plan` partitions each joint graph with the plan, as the second
trace would have, and puts the result behind that function.

It is all or nothing: every graph of the trace must take its plan's partition (`GraphCode.fits`: several
partitions behind one code where identical blocks share it and their plans differ); otherwise nothing is
changed and the caller traces the step again. So it is under compiled autograd, which traces the backward
graph AOTAutograd kept instead of running the code swapped here. The applier ends as the second trace would have
left it: a profile per graph (the trace's own: the plan was solved on them), the codes it may swap a later
plan into (verification's re-plans), and no identical region taking a swapped code as a capture's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from autoremat import switches
from autoremat.torch_internals import compiled_autograd_on

if TYPE_CHECKING:
    from autoremat.capture.graph_code import GraphCode, Partition
    from autoremat.planning.planner import CapturePlanner
    from autoremat.planning.step_trace import StepTrace


def swap_in_plan(traced: StepTrace, applier: CapturePlanner) -> str | None:
    """Partition every graph of `traced` with `applier`'s plan and swap the result into its code.
    None when done (the applier has taken the trace over: CapturePlanner.took_over); else why not, with
    nothing swapped and the applier as it was (it may trace the step)."""
    if not switches.current().swap:
        return "swapping plans in is off"
    if compiled_autograd_on():
        return "compiled autograd is on: it reads the backward graph AOTAutograd kept, the capture's"
    # A graph with no backward (no input or weight needs a gradient) has nothing to partition: it runs as traced.
    entries = [(index, links, code) for index, links, code in traced.codes if code is None or code.cg is not None]
    profiles = traced.graphs
    if not entries or len(entries) != len(profiles):
        return "the trace did not note one eager code per graph"
    try:
        swaps = _prepared(entries, profiles, applier)
    finally:
        applier.untraced()  # what `apply` noted of these graphs: no trace of the applier hands back their code
    if isinstance(swaps, str):
        return swaps
    for code, runners, runner_at in swaps:
        code.run(runners, runner_at)
    applier.took_over(traced.graphs, traced.codes, traced.per_block, [code for code, _, _ in swaps])
    return None


def _prepared(entries: list, profiles: tuple, applier: CapturePlanner) -> list[tuple] | str:
    """For each code of the trace: its runners under the plan, and which one each graph calling it runs; or
    why some graph cannot take its plan this way. Nothing is swapped here."""
    per_code: dict[int, tuple[GraphCode, dict[int, tuple[Partition, frozenset[str]]]]] = {}
    # Calls of one code (identical blocks) that the plan has save the same values take one partition: it is
    # made once (a deep model's blocks are mostly alike, and each partition is a split of the joint graph).
    made: dict[tuple[int, frozenset[str] | None], tuple[Partition, frozenset[str]]] = {}
    for (index, links, code), gp in zip(entries, profiles):
        if code is None or gp.index != index:
            return f"graph {index} has no code a plan can be swapped into"
        wanted = (id(code), applier.saved_for(gp, index))
        if wanted not in made:
            modules, used = applier.apply(code.captured(index, links), gp)
            made[wanted] = (modules, frozenset(used))
        per_code.setdefault(id(code), (code, {}))[1][index] = made[wanted]
    swaps = []
    for code, at in per_code.values():
        distinct: dict[frozenset[str], int] = {}  # one partition per saved set: places saving the same share it
        partitions: list[Partition] = []
        for modules, used in at.values():
            if used not in distinct:
                distinct[used] = len(partitions)
                partitions.append(modules)
        reason = code.fits(partitions)
        if reason is not None:
            return f"graph {min(at)}: {reason}"
        swaps.append((code, code.prepare(partitions), {index: distinct[used] for index, (_, used) in at.items()}))
    return swaps
