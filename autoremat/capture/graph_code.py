"""A traced graph's eager code, planned again in place: the plan's forward and backward put behind the
autograd.Function AOTAutograd built while capturing, instead of tracing the step a second time.

The graphs of a step are planned jointly, so each is first traced and run with PyTorch's default
partition (`capture.aot.default_split`), and once the plan is known the step used to be traced again
through AOTAutograd with the plan's partition (issue 38: that second trace was most of the compile
stage, 0.7 to 2.2 s of the quick models' plans). Under compiler="eager" the plan's forward and backward
are Python code (`boxed_eager`), and AOTAutograd's autograd.Function only fixes how they are called:

- the forward returns the outputs AOTAutograd accounts for (mutated inputs, the user's outputs, ...),
  then the tensors saved for the backward, then the symbolic sizes saved;
- the backward takes the symbolic sizes, then the saved tensors (in the forward's order), then the
  gradients of the outputs.

The saved tensors are handed from one to the other through `ctx.save_for_backward`, as they are, and
nothing else about them is read. So a plan that saves K tensors where the capture's partition saved N
(K <= N) can run behind the same function: its forward returns its K saved tensors followed by N - K
empty ones (`_PAD`, one tensor of no elements), and its backward is given the first K. `GraphCode` is
that indirection, one per AOTAutograd call of an eager trace: it keeps a copy of the joint graph as it was
partitioned, checks a plan's forward and backward against the capture's convention (`fits`), and runs
them from then on (`swap`). A graph with symbolic sizes saved, a plan saving more than the capture
saved, or modules that differ from the capture's in anything but their saved tensors are not swapped:
the planner traces such a step again (planning/planned_in_place.py).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.fx as fx

from autoremat.torch_internals import copy_graph, handed_to_backward, mark_boxed_call, set_boxed_codegen

if TYPE_CHECKING:
    from autoremat.capture.aot import CapturedGraph
    from autoremat.capture.regions import RegionLinks

# What a planned forward returns in the capture's saved slots it does not use: AOTAutograd saves it for
# the backward (no bytes), and the planned backward is never given it.
_PAD = torch.empty(0)


def boxed_eager(gm: fx.GraphModule, example_inputs: Any = None) -> Callable:
    """Run an FX graph as Python, with boxed calling.

    The generated code takes one list, unpacks it and clears it, so each input (above all the
    tensors saved for backward) is freed after its last use instead of when the call returns.
    Without this a compiled step measured 259 MiB against 221 MiB eager on a 12-block
    transformer; with it, 221 MiB.
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


class GraphCode:
    """One AOTAutograd call's forward and backward, run as Python, swappable for a plan's (module docstring).

    `forward_compiler` and `backward_compiler` are the call's compilers; `partition` runs the partition callback
    on the joint graph and keeps a copy of it. Identical blocks call one such function (`same_regions`), each
    from its own place (`called_at`), and a plan may save other values in each: then the forward picks the
    partition of the place calling it, and tells the backward which one it ran by the last saved slot, an
    empty tensor whose second size is the partition's number (`_marker`)."""

    def __init__(self) -> None:
        self.cg: CapturedGraph | None = None  # a copy of the joint graph as it was partitioned
        self.capture: Convention | str = "not partitioned"  # the capture's convention, or why there is none
        self.fw: Callable | None = None
        self.bw: Callable | None = None
        self.plans: list[tuple[Callable, Callable, int]] = []  # each partition swapped in: forward, backward, saved
        self.plan_at: dict[int, int] = {}  # graph index -> its partition in `plans`
        self.position: int | None = None  # the graph index of the call running now (`called_at`)

    def partition(self, on_joint: Callable, cg: CapturedGraph) -> Partition:
        """`on_joint(cg)` (the partition callback's answer), a copy of the joint graph kept from before it."""
        self.cg = dataclasses.replace(cg, joint=fx.GraphModule(cg.joint, copy_graph(cg.joint.graph)))
        fw, bw = on_joint(cg)
        self.capture = convention(fw, bw, cg.num_fwd_outputs)
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
            outer, self.position = self.position, index
            try:
                return compiled(*args)
            finally:
                self.position = outer
        return call

    def fits(self, partitions: list[Partition]) -> str | None:
        """None if these partitions (distinct, one per group of places) can run behind this call's function."""
        capture = self.capture
        if isinstance(capture, str):
            return capture
        room = capture.saved - (len(partitions) > 1)  # several: the last slot says which one ran
        for fw, bw in partitions:
            plan = convention(fw, bw, capture.outputs)
            if isinstance(plan, str):
                return plan
            if plan.saved > room:
                return f"a plan saves {plan.saved} tensors where the capture has room for {room}"
            if plan.rest != capture.rest:
                return "the backward's inputs after the saved tensors differ"
        return None

    def swap(self, partitions: list[Partition], plan_at: dict[int, int]) -> None:
        """Run `partitions[plan_at[index]]` for the call at each graph index from now on; `fits` must have said
        yes."""
        reason = self.fits(partitions)
        if reason is not None:
            raise ValueError(f"these partitions cannot replace the captured one: {reason}")
        outputs = self.capture.outputs  # type: ignore[union-attr]
        self.plans = [(boxed_eager(fw), boxed_eager(bw), len(fw.graph.output_node().args[0]) - outputs)
                      for fw, bw in partitions]
        self.plan_at = dict(plan_at)

    def forward_compiler(self, gm: fx.GraphModule, example_inputs: Any) -> Callable:
        self.fw = boxed_eager(gm)

        def run(args: list) -> Any:
            if not self.plans:
                return self.fw(args)
            which = self.plan_at[self.position] if len(self.plans) > 1 else 0  # type: ignore[index]
            forward, _, saved = self.plans[which]
            pads = [_PAD] * (self.capture.saved - saved)  # type: ignore[union-attr]
            if len(self.plans) > 1:
                pads[-1] = _marker(which)
            return [*forward(args), *pads]

        mark_boxed_call(run)
        return run

    def backward_compiler(self, gm: fx.GraphModule, example_inputs: Any) -> Callable:
        self.bw = boxed_eager(gm)

        def run(args: list) -> Any:
            if not self.plans:
                return self.bw(args)
            room = self.capture.saved  # type: ignore[union-attr]
            which = args[room - 1].shape[1] if len(self.plans) > 1 else 0
            _, backward, saved = self.plans[which]
            given = args[:saved] + args[room:]
            args.clear()  # the pads and the capture's list go: the plan's backward frees its inputs as it goes
            return backward(given)

        mark_boxed_call(run)
        return run


def _marker(which: int) -> torch.Tensor:
    """The last saved slot of a forward that ran partition `which`: no elements, `which` its second size."""
    return torch.empty(0, which)


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
