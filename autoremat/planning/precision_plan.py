"""Choose the compute dtype of every castable call for `optimize(..., precision=...)`.

precision="bf16" or "fp16" runs every castable call (precision_measure.castable) in that dtype; fp16 only
where the example batch shows it is safe (precision_measure.OpStats.fp16_safe), the rest stay fp32.
precision="auto" is the joint choice: the model is traced once in fp32 with each castable call
measured on the example batch, then one ILP (solver.choose_dtypes) picks per call fp32, bf16 or
fp16 together with save/recompute, under the memory budget and an error tolerance. The caller then
traces the step with those dtypes and plans save/recompute exactly on the mixed graphs.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from autoremat.capture.aot import capture
from autoremat.model import precision_measure as P
from autoremat.model.devices import DeviceSpec
from autoremat.model.graph_profile import GraphProfile
from autoremat.model.profile import profile_graph
from autoremat.passes.dtypes import apply_dtypes
from autoremat.solve.precision_choices import DtypeChoices, dtype_choices
from autoremat.solve.solver import choose_dtypes
from autoremat.solve.solver_options import SolverOptions

MODES = ("fp32", "bf16", "fp16", "auto")
# Without values (the meta device), a call's bf16 error is taken as bf16's unit roundoff: the relative
# error of rounding a value to its 8 significand bits, what casting an input costs. Every call then costs
# the same, and fp16, whose safety needs the values' range, is not offered.
BF16_ROUNDING = 2.0**-8


def estimated_stats() -> P.OpStats:
    """What a call is assumed to do when there is no batch to measure it on (see BF16_ROUNDING)."""
    return P.OpStats(max_abs=float("inf"), underflow=1.0, err_bf16=BF16_ROUNDING, err_fp16=float("inf"))


@dataclass
class Analysis:
    """The fp32 trace of one step, with what every castable call did on the example batch."""

    castable: list[list[str]] = field(default_factory=list)  # per dynamo graph
    kept: list[set[str]] = field(default_factory=list)  # calls that stay fp32 (FP32_KEPT), per graph
    stats: list[dict[str, P.OpStats]] = field(default_factory=list)
    profiles: list[GraphProfile] = field(default_factory=list)
    joints: list[fx.GraphModule] = field(default_factory=list)
    choices: dict[str, list[DtypeChoices]] = field(default_factory=dict)  # by device name: `choices_of`

    def default_tolerance(self) -> float:
        """The summed bf16 error of every castable call: what autocast's choice is estimated at."""
        return sum(s.err_bf16 for stats in self.stats for s in stats.values())


def analyse(model: torch.nn.Module, args: tuple, kwargs: dict, device: DeviceSpec,
            fp32_ops: Iterable[str] = P.FP32_KEPT, measure: bool = True) -> Analysis:
    """Trace `model` in fp32; with `measure`, run each graph once on the example batch (else `estimated_stats`)."""
    fp32_ops = tuple(fp32_ops)
    an = Analysis()

    def look(index: int, gm: fx.GraphModule, inputs: list) -> None:
        names = P.castable(gm, fp32_ops)
        an.castable.append(names)
        an.kept.append({n.name for n in gm.graph.nodes if P.call_name(n) in fp32_ops})
        an.stats.append(P.measure(gm, inputs, names) if measure else {c: estimated_stats() for c in names})

    graphs = capture(model, args, kwargs, pre_pass=look)
    for cg in graphs:
        an.joints.append(cg.joint)
        an.profiles.append(profile_graph(cg, device))
    return an


def fixed_dtypes(an: Analysis, mode: str) -> tuple[list[dict[str, str]], list[str]]:
    """Every castable call in `mode` ("bf16"/"fp16"); fp16 only where measured safe. Returns the
    dtypes per graph and the calls kept fp32 because fp16 was unsafe for them."""
    dtypes, unsafe = [], []
    for names, stats in zip(an.castable, an.stats):
        pick = {}
        for c in names:
            if mode == "fp16" and not stats[c].fp16_safe:
                unsafe.append(c)
                continue
            pick[c] = mode
        dtypes.append(pick)
    return dtypes, unsafe


def options(an: Analysis) -> list[dict[str, dict[str, float]]]:
    """Per graph: castable call -> {dtype: measured error} for the low dtypes it may use."""
    out = []
    for names, stats in zip(an.castable, an.stats):
        opts = {}
        for c in names:
            s = stats[c]
            opts[c] = {"bf16": s.err_bf16, **({"fp16": s.err_fp16} if s.fp16_safe else {})}
        out.append(opts)
    return out


def choices_of(an: Analysis, device: DeviceSpec) -> list[DtypeChoices]:
    """Per graph, what each dtype choice changes on `device` (precision_choices.dtype_choices), worked out
    once per analysis and device: the joint ILP and `predicted_gain` read the same, try after try."""
    if device.name not in an.choices:
        an.choices[device.name] = [dtype_choices(joint, prof, opts, kept, device)
                                   for joint, prof, opts, kept in zip(an.joints, an.profiles, options(an), an.kept)]
    return an.choices[device.name]


def auto_dtypes(an: Analysis, room: int, tolerance: float, device: DeviceSpec,
                options: SolverOptions) -> list[dict[str, str]] | None:
    """The joint ILP's dtypes within `room` bytes (what the budget leaves the activations) and `tolerance`; None if none fits."""
    return choose_dtypes(an.profiles, choices_of(an, device), room, tolerance,
                         granularity=device.alloc_granularity, options=options)


def predicted_gain(an: Analysis, dtypes: list[dict[str, str]], device: DeviceSpec) -> float:
    """Seconds a step's ops run once are predicted to save with the 16-bit calls of `dtypes` over fp32;
    negative where their casts and 16-bit ops cost more (a device without fast 16-bit math). Each value
    whose owning calls all run low gets its speedup, each low call costs its casts
    (precision_choices.DtypeChoices)."""
    gain = 0.0
    for choices, pick in zip(choices_of(an, device), dtypes):
        low = set(pick)
        gain += sum(s for name, s in choices.speedup.items() if choices.owners[name] <= low)
        gain -= sum(choices.cast_time.get(c, 0.0) for c in low)
    return gain


def error_estimate(an: Analysis, dtypes: list[dict[str, str]]) -> float:
    """Sum of the measured per-call errors of a dtype choice."""
    total = 0.0
    for stats, pick in zip(an.stats, dtypes):
        for c, d in pick.items():
            total += stats[c].err_bf16 if d == "bf16" else stats[c].err_fp16
    return total


def pre_pass(dtypes: list[dict[str, str]], fp32_ops: Iterable[str] = P.FP32_KEPT):
    """A capture pre-pass that applies `dtypes[i]` to dynamo graph i.

    A new input shape recompiles the step's graphs, in the same order, through the same backend: the
    indices count on (n, n+1, ...), so graph k of every recompile gets `dtypes[k % n]`.
    """
    fp32_ops = tuple(fp32_ops)

    def apply(index: int, gm: fx.GraphModule, inputs: list) -> None:
        if dtypes:
            apply_dtypes(gm, dtypes[index % len(dtypes)], fp32_ops)

    return apply
