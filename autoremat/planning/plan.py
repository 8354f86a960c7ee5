"""The plan: what autoremat decided, as a plain dataclass that round-trips through JSON.

A plan can be printed (`summary`), saved and loaded (`save`, `load`), diffed, and re-applied to the
same model (`autoremat.optimize(model, ..., plan=plan)`); each graph carries a structural
fingerprint so a plan is never applied to a graph it was not made for.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from autoremat.model.graph_profile import GraphProfile
from autoremat.model.ledger import Ledger
from autoremat.model.marks import mark_counts, must_marks
from autoremat.model.memory import Timeline, live_at_peak
from autoremat.model.schedule import Schedule
from autoremat.passes.loss_chunks import describe as describe_loss
from autoremat.passes.recompute_names import base
from autoremat.solve.decision import Decision, PlanPath, evaluate
from autoremat.solve.heuristics import save_all
from autoremat.units import format_bytes

SCHEMA_VERSION = 1


@dataclass
class GraphPlan:
    index: int
    fingerprint: str
    saved: list[str]
    recomputed: list[str]
    dtypes: dict[str, str] = field(default_factory=dict)  # compute dtype per forward node
    # per nn.Module path: node counts and owned bytes, {"saved": n, "saved_bytes": b, "recomputed": ..., ...}
    modules: dict[str, dict[str, int]] = field(default_factory=dict)
    num_nodes: int = 0
    again: list[str] = field(default_factory=list)  # backward nodes where recomputation starts afresh (cuts.py)


@dataclass
class Plan:
    budget: int
    ledger: dict
    graphs: list[GraphPlan]
    predicted_peak: int  # bytes, whole step: fixed parts + activation peak
    activation_peak: int
    peak_at: str  # where the peak happens: "backward of graph 0 at mm_3"
    forward_time_s: float  # predicted time of all ops once (forward + backward), no recomputation
    recompute_time_s: float
    solver: dict
    device: str
    needs_grad_scaler: bool = False
    # precision: mode, dtypes (per graph: dynamo call -> "bf16"/"fp16"), tolerance, measured errors
    # versus fp32 (and what torch.autocast gives on the same batch), per-call measurements
    precision: dict = field(default_factory=dict)
    timeline: list[list] = field(default_factory=list)  # [graph, phase, node, live bytes during]
    baseline_peak: int = 0  # activation peak with no recomputation (save everything)
    baseline_timeline: list[list] = field(default_factory=list)
    versions: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    # the loss region (autoremat.passes.loss_chunks): chunks chosen, outputs, token rows, candidates tried
    loss: dict = field(default_factory=dict)
    # compiler: requested, used ("eager"/"inductor"), reason, planning_s (wall time of optimize's planning,
    # compiles included) and inductor_compile_s (the part spent in Inductor's compilers)
    compiler: dict = field(default_factory=dict)
    # whether the step ran as one graph per repeated block (autoremat.capture.regions); regions="auto" decides
    # (pipeline.one_graph_if_free), and re-applying the plan with "auto" captures it the same way
    regions: bool = True
    schema: int = SCHEMA_VERSION

    @property
    def overhead(self) -> float:
        """Predicted step-time increase from recomputation, as a fraction."""
        return self.recompute_time_s / self.forward_time_s if self.forward_time_s else 0.0

    @property
    def solver_path(self) -> PlanPath:
        """The route that produced the plan and the refinements after it, typed; `solver["path"]` holds its text,
        as the JSON stores it."""
        return PlanPath.parse(self.solver["path"])

    @property
    def no_recompute_budget(self) -> int:
        """The least budget at which these graphs are planned with nothing recomputed: the fixed parts,
        the save-everything activation peak (or optimizer.step()'s temporaries, if larger) and the SLACK
        every plan keeps for autograd's scalars. `fixed + baseline_peak` alone is SLACK short of it, and
        a plan there recomputes something to free those bytes."""
        ledger = Ledger.from_dict(self.ledger)
        return ledger.needs(self.baseline_peak)

    # JSON ----------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Plan:
        if d.get("schema") != SCHEMA_VERSION:
            raise ValueError(f"plan schema {d.get('schema')!r} is not supported (this autoremat reads {SCHEMA_VERSION})")
        d = dict(d)
        d["graphs"] = [GraphPlan(**g) for g in d["graphs"]]
        return cls(**d)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        return cls.from_dict(json.loads(text))

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json())

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        return cls.from_json(Path(path).read_text())

    # Reading -------------------------------------------------------------------------------
    def summary(self) -> str:
        ledger = Ledger.from_dict(self.ledger)
        lines = [
            f"autoremat plan: {len(self.graphs)} graph(s), budget {format_bytes(self.budget)} on {self.device}",
            f"predicted peak {format_bytes(self.predicted_peak)} ({format_bytes(self.activation_peak)} "
            f"activations and temporaries, peak at {self.peak_at})",
            f"predicted recompute overhead {100 * self.overhead:.1f}% of the step "
            f"({self.recompute_time_s * 1e3:.3f} ms of {self.forward_time_s * 1e3:.3f} ms)",
            f"solver: {self.solver.get('path')} ({self._solver_details()})",
            *self._compiler_lines(),
            "",
            ledger.format(),
            "",
        ]
        lines += self._module_lines()
        if self.loss:
            lines += ["", describe_loss(self.loss.get("chunks", 1), self.loss.get("outputs", "all"),
                                        self.loss.get("rows", 0), self.loss.get("fused", 0))]
        lines += self._precision_lines()
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)

    def _compiler_lines(self) -> list[str]:
        c = self.compiler
        if not c:
            return []
        why = f"; {c['reason']}" if c.get("requested") == "auto" else ""
        return [f"compiler: {c.get('used')} (requested {c.get('requested')!r}{why}); planning took "
                f"{c.get('planning_s', 0):.1f} s, {c.get('inductor_compile_s', 0):.1f} s of it in Inductor's compilers"]

    def _solver_details(self) -> str:
        # Heuristic paths name no solver, and plans saved by older versions may lack a field:
        # print what is there rather than an empty slot.
        s = self.solver
        details = [s.get("status"), s.get("solver"), f"{s.get('solve_time_s', 0):.2f} s"]
        return ", ".join(str(d) for d in details if d)

    def _module_lines(self) -> list[str]:
        """What each module saves for the backward and what it recomputes, in bytes and in nodes."""
        merged: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        for g in self.graphs:
            for mod, counts in g.modules.items():
                for k, v in counts.items():
                    merged[mod][k] += v
        with_bytes = all("saved_bytes" in c for c in merged.values())  # plans saved before bytes were kept
        if with_bytes:
            lines = [f"{'module':<40} {'saved':>10} {'nodes':>5}  {'recomputed':>10} {'nodes':>5}"]
        else:
            lines = [f"{'module':<40} {'saved':>6} {'recomputed':>10}"]
        for mod in sorted(merged, key=_natural_key):
            c, name = merged[mod], mod or "(top level)"
            if with_bytes:
                lines.append(f"{name:<40} {format_bytes(c['saved_bytes']):>10} {c['saved']:>5}  "
                             f"{format_bytes(c['recomputed_bytes']):>10} {c['recomputed']:>5}")
            else:
                lines.append(f"{name:<40} {c['saved']:>6} {c['recomputed']:>10}")
        return lines

    def _precision_lines(self) -> list[str]:
        p = self.precision
        if not p:
            return []
        picked = [d for pick in p.get("dtypes", []) for d in pick.values()]
        calls = len(p.get("calls", {})) or len(picked)
        line = (f"precision {p.get('mode')}: {picked.count('bf16')} call(s) bf16, {picked.count('fp16')} fp16, "
                f"{calls - len(picked)} fp32 of {calls} castable")
        if self.needs_grad_scaler:
            line += "; fp16 present: use torch.amp.GradScaler"
        lines = ["", line]
        if "loss_rel_err" in p:
            lines.append(f"error vs fp32 on the example batch: loss {p['loss_rel_err']:.2e}, gradients "
                         f"{p['grad_rel_err']:.2e} (torch.autocast bf16: {p['autocast_loss_rel_err']:.2e}, "
                         f"{p['autocast_grad_rel_err']:.2e})")
        return lines


def build_plan(
    profiles: list[GraphProfile],
    decision: Decision,
    ledger: Ledger,
    budget: int,
    device: str,
) -> Plan:
    """Gather a solver decision into a Plan."""
    graphs = []
    for g, sched in zip(profiles, decision.schedules):
        dtypes = {n: "fp32" if g.nodes[n].dtype == "float32" else g.nodes[n].dtype
                  for n in g.forward_side() if g.nodes[n].dtype}
        graphs.append(GraphPlan(
            index=g.index, fingerprint=g.fingerprint, saved=list(sched.saved),
            recomputed=list(sched.recomputed), again=list(sched.again), dtypes=dtypes, modules=_module_table(g, sched), num_nodes=len(g.nodes),
        ))
    ledger.activations = decision.peak
    ledger.budget = budget
    _, baseline, _ = evaluate(profiles, save_all(profiles), decision.granularity)
    step = decision.timeline.peak_step
    peak_at = f"{step.phase} of graph {step.graph} at {step.node}" if step else "boundary"
    return Plan(
        budget=budget,
        ledger=ledger.to_dict(),
        graphs=graphs,
        predicted_peak=ledger.total,  # fixed + the larger of the activation peak and optimizer.step()'s
        activation_peak=decision.peak,
        peak_at=peak_at,
        forward_time_s=sum(p.time_s for g in profiles for p in g.nodes.values()),
        recompute_time_s=decision.recompute_time_s,
        solver={"status": decision.status, "path": str(decision.path), "solver": decision.solver,
                "solve_time_s": round(decision.solve_time_s, 4), "rounds": decision.rounds},
        device=device,
        timeline=_compress(decision.timeline),
        baseline_peak=baseline.peak,
        baseline_timeline=_compress(baseline),
        versions={"torch": torch.__version__, "autoremat": _version()},
        notes=list(decision.notes) + [n for g in profiles for n in g.notes] + _solver_notes(decision)
        + _unsupported_notes(profiles) + _mark_notes(profiles),
    )


def _solver_notes(decision: Decision) -> list[str]:
    if decision.status == "time_limit":
        return ["the ILP solver stopped at its time limit: the best plan found so far is used (it fits, but "
                "may recompute more than the optimum); raise time_limit for a better one"]
    return []


def _unsupported_notes(profiles: list[GraphProfile]) -> list[str]:
    """The custom and unsupported ops the plan always saves, each with why (model/profile.recompute_ban),
    and the custom ops it may recompute whose time is an estimate from their bytes."""
    forward = [p for g in profiles for p in g.nodes.values() if p.kind == "forward"]
    saved = sorted({p.recompute_ban for p in forward if p.recompute_ban.startswith(("custom op", "unsupported op"))})
    notes = []
    if saved:
        notes.append(f"{len(saved)} custom or unsupported op(s) are always saved, never recomputed: {'; '.join(saved)}")
    estimated = sorted({p.target for p in forward if p.time_from_bytes and not p.recompute_ban})
    if estimated:
        notes.append(f"{len(estimated)} custom op(s) may be recomputed, timed by the bytes they move at the device's "
                     f"memory bandwidth (no FLOP formula; torch.utils.flop_counter.register_flop_formula gives "
                     f"one): {', '.join(estimated)}")
    return notes


def _mark_notes(profiles: list[GraphProfile]) -> list[str]:
    """The user's torch.utils.checkpoint marks: the MUST ones held, the PREFER ones hints (model/marks.py)."""
    counts: dict[str, int] = defaultdict(int)
    for g in profiles:
        for mark, n in mark_counts(g).items():
            counts[mark] += n
    if not counts:
        return []
    said = ", ".join(f"{n} {mark.upper()}" for mark, n in sorted(counts.items()))
    return [f"checkpoint marks from the model ({said}): no plan recomputes a MUST_SAVE value or saves a "
            "MUST_RECOMPUTE one; PREFER_* marks (every op of a plain checkpoint() call) only break ties"] + [
        d for g in profiles for d in must_marks(g).dropped]


def _module_table(g: GraphProfile, sched: Schedule) -> dict[str, dict[str, int]]:
    """Per module: how many values it saves for the backward and recomputes, and their bytes."""
    modules: dict[str, dict[str, int]] = defaultdict(
        lambda: {"saved": 0, "saved_bytes": 0, "recomputed": 0, "recomputed_bytes": 0})
    held: set[str] = set()
    for n in sched.saved:
        node = g.nodes[n]
        counts = modules[_top_module(node.module)]
        counts["saved"] += 1
        storage = node.storage or n  # a saved view keeps its base alive; count each storage once
        if storage not in held:
            held.add(storage)
            counts["saved_bytes"] += g.nodes[storage].nbytes
    for n in sched.recomputed:
        node = g.nodes[n]
        counts = modules[_top_module(node.module)]
        counts["recomputed"] += 1
        counts["recomputed_bytes"] += node.nbytes if node.storage == n else 0  # a view allocates nothing
    return dict(modules)


def _natural_key(module: str) -> list[str | int]:
    """Sort "h.2" before "h.10": runs of digits compare as numbers."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", module)]


def _top_module(path: str) -> str:
    """Group decisions two levels deep (e.g. "transformer.h.3"), enough to read a stack."""
    parts = path.split(".")
    return ".".join(parts[:3])


def _compress(tl: Timeline, points: int = 2000) -> list[list]:
    stride = max(1, len(tl.steps) // points)
    peak = tl.peak_step
    keep = [s for i, s in enumerate(tl.steps) if i % stride == 0 or s is peak]  # in time order
    return [[s.graph, s.phase, s.node, s.during] for s in keep]


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("autoremat")
    except PackageNotFoundError:
        return "0+local"


@dataclass(frozen=True)
class LiveTensor:
    """A tensor live at a plan's peak, as the memory model holds it: the op that allocated it, the module that
    op ran in (nn_module_stack; "" outside any), its bytes (rounded up to the allocator's granularity), and
    its node's kind: "forward", "backward", "recomputed" (a forward value the backward computes again), or
    what the step starts with ("param", "input", "tangent")."""

    op: str
    module: str
    nbytes: int
    phase: str
    node: str

    def __str__(self) -> str:
        where = f" in {self.module}" if self.module else ""
        return f"{format_bytes(self.nbytes)} ({self.nbytes} bytes) {self.op}{where} ({self.phase}, node {self.node})"


TOP_AT_PEAK = 5  # the tensors a refusal names: enough to show what holds the memory, few enough to read


def live_at_floor(profiles: list[GraphProfile], frugal: Decision, top: int = TOP_AT_PEAK) -> list[LiveTensor]:
    """The `top` largest tensors live at the peak of the most memory-frugal plan found, largest first."""
    live = live_at_peak(list(zip(profiles, frugal.schedules)), frugal.granularity, frugal.peak)
    # a value the plan recomputes is live at a backward peak as its recomputed copy; at a forward peak, as the
    # forward's own, which the backward does not keep
    step = frugal.timeline.peak_step
    in_backward = step is not None and step.phase == "backward"
    recomputed = {id(g): set(sc.recomputed) if in_backward else set() for g, sc in zip(profiles, frugal.schedules)}
    out = []
    for g, name, nbytes in sorted(live, key=lambda t: -t[2])[:top]:
        p = g.nodes.get(name) or g.nodes.get(base(name))
        kind = p.kind if p is not None else "?"
        if kind == "forward" and base(name) in recomputed[id(g)]:
            kind = "recomputed"
        out.append(LiveTensor(op=p.target if p is not None else "?", module=p.module if p is not None else "",
                              nbytes=nbytes, phase=kind, node=name))
    return out


class BudgetError(ValueError):
    """The budget is below the smallest one any plan fits in; says which budget would fit, and where the
    memory model found the floor, which tensors are live at that plan's peak (`at_peak`, largest first)."""

    def __init__(self, message: str, ledger: Ledger, smallest_budget: int | None, peak_step=None,
                 measured: bool = False, at_peak: list[LiveTensor] | None = None) -> None:
        super().__init__(message)
        self.ledger = ledger
        self.smallest_budget = smallest_budget
        self.peak_step = peak_step  # where the most memory-frugal plan found peaks (memory.Step), if one was found
        # Refused after a real step measured more than the memory model predicted (planning/verify.py), not by
        # the memory model alone.
        self.measured = measured
        self.frugal = None  # from_infeasible: the most memory-frugal plan found (a solve.Decision), if any
        self.at_peak: list[LiveTensor] = list(at_peak or [])

    @classmethod
    def from_infeasible(cls, budget, ledger: Ledger, error, profiles, device) -> BudgetError:
        smallest = getattr(error, "smallest", None)
        ledger.budget = budget
        at_peak: list[LiveTensor] = []
        if smallest is not None:
            ledger.activations = smallest.peak
            # A little room for what no graph holds: autograd's loss and seed-gradient scalars.
            need = ledger.needs(smallest.peak)
            why = (f"the smallest budget that fits is {format_bytes(need)} ({need} bytes): "
                   f"{format_bytes(ledger.fixed)} fixed + {format_bytes(smallest.peak)} activations at the "
                   f"most memory-frugal plan found")
            if ledger.after_backward > smallest.peak:
                why += (f"; optimizer.step()'s temporaries ({format_bytes(ledger.optimizer_step)}, after the "
                        "backward) set the floor: a fused optimizer (fused=True) allocates none")
            at_peak = live_at_floor(profiles, smallest)
        else:
            need = None
            why = (f"the fixed parts alone ({format_bytes(ledger.fixed)}) exceed it; more than "
                   f"{format_bytes(ledger.fixed)} is needed before any activation")
        msg = (f"budget {format_bytes(budget)} ({budget} bytes) is too small for this training step on "
               f"{device.name}: {why}.\n{ledger.format()}")
        if at_peak:
            step = smallest.timeline.peak_step
            when = f" (graph {step.graph}'s {step.phase}, at {step.node})" if step is not None else ""
            msg += (f"\nLargest tensors live at that plan's peak{when}:\n"
                    + "\n".join(f"  {t}" for t in at_peak))
        refused = cls(msg, ledger, need, smallest.timeline.peak_step if smallest is not None else None,
                      at_peak=at_peak)
        refused.frugal = smallest  # the most memory-frugal plan found (solve.Decision): what sets its peak
        return refused
