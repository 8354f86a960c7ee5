"""A traced graph's eager code, planned again in place: the plan's forward and backward put behind the
autograd.Function AOTAutograd built while capturing, instead of tracing the step a second time.

The graphs of a step are planned jointly, so each is first traced and run with PyTorch's default
partition (`capture.aot.default_split`), and once the plan is known the step could be traced again
through AOTAutograd with the plan's partition; that second trace would be most of the compile stage
(benchmarks/plan_time.py --quick times the stages). Under compiler="eager" the plan's forward and backward
are Python code (`boxed_eager`), and AOTAutograd's autograd.Function only fixes how they are called
(`torch_internals.handed_to_backward`): the forward returns its outputs, then the tensors it saves; the
Function puts those through `ctx.save_for_backward` and hands them to the backward by position, first
among its inputs, before the gradients of the outputs.

So a plan that saves K tensors where the capture's partition saved N (K <= N) can run behind the same
function: its forward returns its K saved tensors followed by N - K empty ones (no bytes), and its
backward is given the first K. A plan may save more than the capture's partition does, so the capture's
own partition saves some empty tensors too, after its own (`spare_slots`): N has room to spare.
`GraphCode` is that indirection, one per AOTAutograd call of an eager trace: it keeps a copy of the joint
graph as it was partitioned, checks a plan's partitions against the capture's convention (`prepare`), and
runs them from then on (`run`). Identical blocks call one such function (planning/same_regions.py), each
from its own place (`called_at`), and a plan may save other values in each: then the forward runs the
partition of the place calling it and names it in its last saved slot (an empty tensor whose second size is
the partition's number), which the backward reads.

What this relies on, and where it is refused (the planner then traces the step again,
planning/planned_in_place.py):
- a partition of the plain form: tensors only saved, none stashed without a version-counter check
  (`handed_to_backward`), the backward's other inputs the capture's;
- no forward of the step awaiting its backward while a plan is swapped in: planning runs whole steps;
- compiled autograd off: it traces the backward graph AOTAutograd kept (the capture's), not the code
  run here. A swapped forward refuses to run under it (`compiled_autograd_on`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
import torch.fx as fx

from autoremat.torch_internals import (
    compiled_autograd_on,
    copy_graph,
    handed_to_backward,
    mark_boxed_call,
    pad_saved,
    set_boxed_codegen,
)

if TYPE_CHECKING:
    from autoremat.capture.captured import CapturedGraph
    from autoremat.capture.regions import RegionLinks



def boxed_eager(gm: fx.GraphModule, example_inputs: Any = None) -> Callable:
    """Run an FX graph as Python, with boxed calling.

    The generated code takes one list, unpacks it and clears it, so each input (above all the
    tensors saved for backward) is freed after its last use instead of when the call returns.
    Without it a compiled step holds every saved tensor to the end of the backward and peaks above eager;
    with it, where eager does (benchmarks/remat_vs_peers.py's eager and autoremat rows on the transformer stack).
    """
    set_boxed_codegen(gm)
    gm.recompile()
    forward = gm.forward

    def run(args: list) -> Any:
        return forward(args)

    mark_boxed_call(run)
    return run


@dataclasses.dataclass
class Convention:
    """How one partition's forward and backward are called: counts, and the names that must agree."""

    outputs: int  # forward outputs before the saved tensors (AOTAutograd's `num_fwd_outputs`)
    saved: int  # tensors the forward saves for the backward
    rest: tuple[str, ...]  # the backward's inputs after the saved tensors (tangents_*, ...), by name


def convention(fw: fx.GraphModule, bw: fx.GraphModule, outputs: int) -> Convention | str:
    """The calling convention of the partition (fw, bw), or why it cannot be swapped."""
    handed = handed_to_backward(fw, bw, outputs)
    return handed if isinstance(handed, str) else Convention(outputs, *handed)


Partition = tuple[fx.GraphModule, fx.GraphModule]

# A plan may save more tensors than the capture's partition (which saves what the backward reads): two
# small values kept where one large one was, or a layer norm's statistics beside its input (a plan near
# checkpointing's peak can save one more than the capture did). Without a slot for each, the step is traced
# again with the plan, a large share of the plan's time (planned_in_place.py). Empty tensors are
# free to save, so the capture saves SPARE_SHARE of its count more, at least SPARE_MIN.
SPARE_SHARE, SPARE_MIN = 0.25, 4


def spare_slots(saved: int) -> int:
    """The empty slots added to a capture's partition that saves `saved` tensors."""
    return max(SPARE_MIN, math.ceil(SPARE_SHARE * saved))


class Runner(NamedTuple):
    """One partition swapped in: its forward and backward, run as Python, and how many tensors it saves."""

    forward: Callable
    backward: Callable
    saved: int


class GraphCode:
    """One AOTAutograd call's forward and backward, run as Python, swappable for a plan's (module docstring).

    `forward_compiler` and `backward_compiler` are the call's compilers; `partition` runs the partition
    callback on the joint graph and keeps a copy of it."""

    def __init__(self) -> None:
        self.cg: CapturedGraph | None = None  # a copy of the joint graph as it was partitioned
        self.capture: Convention | str = "not partitioned"  # the capture's convention, or why there is none
        self.runners: list[Runner] = []  # the partitions swapped in (none: the capture's runs)
        self.runner_at: dict[int, int] = {}  # graph index -> its partition in `runners`
        self.calling = threading.local()  # .position: the graph index of the call running in this thread

    def partition(self, on_joint: Callable, cg: CapturedGraph) -> Partition:
        """`on_joint(cg)` (the partition callback's answer) with spare slots (`spare_slots`), a copy of the
        joint graph kept from before it."""
        self.cg = dataclasses.replace(cg, joint=fx.GraphModule(cg.joint, copy_graph(cg.joint.graph)))
        fw, bw = on_joint(cg)
        capture = convention(fw, bw, cg.num_fwd_outputs)
        if isinstance(capture, Convention) and (spare := spare_slots(capture.saved)):
            pad_saved(fw, bw, cg.num_fwd_outputs, spare)
            capture = dataclasses.replace(capture, saved=capture.saved + spare)
        self.capture = capture
        return fw, bw

    def captured(self, index: int, links: RegionLinks | None) -> CapturedGraph:
        """The joint graph as it was partitioned, a fresh copy, at graph `index` with `links` (a region that
        reused this code sits elsewhere in the step)."""
        assert self.cg is not None
        joint = fx.GraphModule(self.cg.joint, copy_graph(self.cg.joint.graph))
        return dataclasses.replace(self.cg, joint=joint, index=index, links=links)

    def called_at(self, compiled: Callable, index: int) -> Callable:
        """`compiled` (this code's function) as the call at graph `index` runs it."""
        @functools.wraps(compiled)  # its attributes too: the tag, how dynamo calls it
        def call(*args: Any) -> Any:
            outer = getattr(self.calling, "position", None)
            self.calling.position = index
            try:
                return compiled(*args)
            finally:
                self.calling.position = outer
        return call

    def fits(self, partitions: list[Partition]) -> str | None:
        """None if these partitions (distinct, one per group of places) can run behind this call's function."""
        capture = self.capture
        if isinstance(capture, str):
            return capture
        slots = capture.saved - (len(partitions) > 1)  # several: the last slot names the one that ran
        for fw, bw in partitions:
            plan = convention(fw, bw, capture.outputs)
            if isinstance(plan, str):
                return plan
            if plan.saved > slots:
                return f"a plan saves {plan.saved} tensors where the capture has {slots} slots for them"
            if plan.rest != capture.rest:
                return "the backward's inputs after the saved tensors differ"
        return None

    def prepare(self, partitions: list[Partition]) -> list[Runner]:
        """The runners of `partitions`; raises ValueError where `fits` says no."""
        reason = self.fits(partitions)
        if reason is not None:
            raise ValueError(f"these partitions cannot replace the captured one: {reason}")
        outputs = self.capture.outputs  # type: ignore[union-attr]
        return [Runner(boxed_eager(fw), boxed_eager(bw), len(fw.graph.output_node().args[0]) - outputs)
                for fw, bw in partitions]

    def run(self, runners: list[Runner], runner_at: dict[int, int]) -> None:
        """Run `runners[runner_at[index]]` for the call at each graph index from now on (`prepare`d)."""
        self.runners, self.runner_at = list(runners), dict(runner_at)

    def _which(self) -> int:
        if len(self.runners) == 1:
            return 0
        position = getattr(self.calling, "position", None)
        if position not in self.runner_at:
            raise RuntimeError(f"autoremat internal error: a planned graph's code was called from graph {position}, "
                               f"which its plan does not name ({sorted(self.runner_at)}). Please report this model.")
        return self.runner_at[position]

    def forward_compiler(self, gm: fx.GraphModule, example_inputs: Any) -> Callable:
        captured = boxed_eager(gm)

        def run(args: list) -> Any:
            if not self.runners:
                return captured(args)
            if compiled_autograd_on():
                raise RuntimeError(
                    "autoremat's planned eager step does not run under compiled autograd, which would trace the "
                    "backward graph the plan replaced instead of running the plan's backward. Turn it off for this "
                    "step (torch._dynamo.config.compiled_autograd = False, and no compiled_autograd context).")
            which = self._which()
            runner = self.runners[which]
            empty = torch.empty(0)  # the slots this plan leaves: saved for the backward, no bytes, never read
            pads = [empty] * (self.capture.saved - runner.saved)  # type: ignore[union-attr]
            if len(self.runners) > 1:
                pads[-1] = torch.empty(0, which)
            return [*runner.forward(args), *pads]

        mark_boxed_call(run)
        return run

    def backward_compiler(self, gm: fx.GraphModule, example_inputs: Any) -> Callable:
        captured = boxed_eager(gm)

        def run(args: list) -> Any:
            if not self.runners:
                return captured(args)
            slots = self.capture.saved  # type: ignore[union-attr]
            runner = self.runners[args[slots - 1].shape[1] if len(self.runners) > 1 else 0]
            given = args[:runner.saved] + args[slots:]
            args.clear()  # the pads and the capture's list go: the plan's backward frees its inputs as it goes
            return runner.backward(given)

        mark_boxed_call(run)
        return run


def code_of(compiled: Callable) -> GraphCode | None:
    """The GraphCode behind what the eager backend compiled for one graph (`tag`), if any."""
    return getattr(compiled, "autoremat_code", None)


def tag(compiled: Callable, code: GraphCode) -> Callable:
    compiled.autoremat_code = code  # type: ignore[attr-defined]
    return compiled


def same_code(wrapper: Callable, compiled: Callable) -> Callable:
    """`wrapper` (which calls `compiled`), tagged with `compiled`'s GraphCode if it has one."""
    code = code_of(compiled)
    return wrapper if code is None else tag(wrapper, code)


def called_at(compiled: Callable, index: int) -> Callable:
    """`compiled` as the call at graph `index` runs it (`GraphCode.called_at`), if it has a GraphCode."""
    code = code_of(compiled)
    return compiled if code is None else code.called_at(compiled, index)
