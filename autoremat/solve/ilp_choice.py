"""One ILP over alternative traces of the same step: which trace to run, and its save/recompute plan.

A graph rewrite that trades time for memory with a discrete knob (the loss region's chunk count,
autoremat.passes.loss_chunks) gives one trace of the step per setting. Each trace k is an
`ilp.IlpModel` of its own, built inside one shared problem as an `ilp.Alternative`:

  z_k in {0,1},  sum_k z_k = 1                     exactly one trace runs
  s_v, r_v <= z_k for v in trace k                 an unchosen trace saves and recomputes nothing
  s_v + r_v >= z_k for v in N_k                    the chosen trace's backward has what it reads
  static_t * z_k + (variable bytes)_t <= cap       every memory row of trace k (ilp.py's families)

and the objective prices each trace's own compute time (its ops run once, T0_k) beside the
recomputation the plan adds (`objective.set_objective`, the same objective as one trace's):

  within the room: min (sum_k T0_k z_k + T) / T_all + TIE_BYTES * sum_v S_v / B_all + FP16_PENALTY * sum_c f_c
  smallest peak:    min cap + MIN_PEAK_TIME_WEIGHT * (B_all / T_all) * (sum_k T0_k z_k + T)

So more chunks (more, smaller projections) are chosen only where their memory buys back more
recomputation time than they cost. The rows of each trace are those of `IlpModel` (conservative
bounds of the exact simulator), so the caller plans the chosen trace in full afterwards
(`solver.solve`: calibration against the simulator, the heuristics competing) and, if the
simulator refuses it, asks this model again with that trace excluded.
"""

from __future__ import annotations

from dataclasses import dataclass

import pulp

from autoremat.model.profile import GraphProfile
from autoremat.solve import lp
from autoremat.solve.ilp import IlpModel
from autoremat.solve.objective import Terms, set_objective


@dataclass
class Alternative:
    """This model is one of several alternative traces of the step inside one larger ILP (ilp_choice.py).

    Its variables live in `prob` under `prefix`; `gate` in {0,1} says whether this trace is the one
    run: every s_v, r_v (and dtype choice) is at most the gate and the needed rows read
    s_v + r_v >= gate, so an unchosen trace saves and recomputes nothing, and each memory row reads
    static * gate + (variable bytes) <= cap: exact for the chosen trace, 0 <= cap for the others.
    """

    prob: lp.Problem
    cap: lp.Variable
    gate: lp.Variable
    prefix: str


@dataclass
class Choice:
    """One solve: the trace chosen (None without a solution) and what each trace's rows say."""

    status: str
    chosen: object | None = None
    predicted_peak: float | None = None  # the chosen trace's largest row at the solution
    predicted_time_s: float | None = None  # the chosen trace's ops once, plus the recomputation the plan adds
    saved: list[set[str]] | None = None  # per graph of the chosen trace, the values the solution saves


class ChoiceModel:
    """The ILP over `alternatives` (key -> the graphs of that trace); see the module docstring."""

    def __init__(self, alternatives: dict, granularity: int, block_drag: bool = True,
                 shared_blocks: bool = True) -> None:
        self.granularity = granularity
        self.models: dict = {}
        self.base_time: dict = {}  # T0_k: every op of trace k once
        self.prob = lp.problem("autoremat_choice")
        self.cap = lp.continuous(self.prob, "cap", 0)
        self.z = {k: lp.binary(self.prob, f"z_{i}") for i, k in enumerate(alternatives)}
        self.prob += pulp.lpSum(self.z.values()) == 1
        for i, (k, graphs) in enumerate(alternatives.items()):
            within = Alternative(self.prob, self.cap, self.z[k], f"k{i}_")
            self.models[k] = IlpModel(graphs, granularity, block_drag, shared_blocks, within=within)
            self.base_time[k] = ops_once_time(graphs)
        self.time_expr = pulp.lpSum(t * self.z[k] for k, t in self.base_time.items()) + pulp.lpSum(
            m.time_expr for m in self.models.values())
        self.bytes_expr = pulp.lpSum(m.bytes_expr for m in self.models.values())
        self.fp16_expr = pulp.lpSum(m.fp16_expr for m in self.models.values())  # 0 while traces carry no dtype choices
        self.total_time = max(max(self.base_time.values()), 1e-12)
        self.total_bytes = max(m.total_bytes for m in self.models.values())

    def exclude(self, k) -> None:
        """Trace k may not be chosen (the exact simulator refused its plan)."""
        self.z[k].upBound = 0

    def solve(self, room: int | None, solver: lp.Solver, min_peak: bool = False) -> Choice:
        """The trace and plan of least predicted time under `room` bytes (or, `min_peak`, the least peak)."""
        if not min_peak and all(m.floor > room or self.z[k].upBound == 0 for k, m in self.models.items()):
            return Choice("infeasible")
        self.cap.lowBound, self.cap.upBound = (0, None) if min_peak else (room, room)
        set_objective(self.prob, self.cap, min_peak, Terms(self.time_expr, self.bytes_expr, self.fp16_expr,
                                                           self.total_time, self.total_bytes))
        status = lp.solve(self.prob, solver)
        if not lp.has_solution(status):
            return Choice(status)
        chosen = max(self.z, key=lambda k: self.z[k].value() or 0)
        rows = self.models[chosen].rows
        peak = max((static + (pulp.value(expr) or 0) for static, expr in rows), default=0)
        saved = [{v for v, var in s.items() if (var.value() or 0) > 0.5} for s in self.models[chosen].s]
        return Choice(status, chosen, peak, pulp.value(self.time_expr), saved)


def ops_once_time(graphs: list[GraphProfile]) -> float:
    """T0: the predicted time of every op of `graphs` run once (no recomputation)."""
    return sum(p.time_s for g in graphs for p in g.nodes.values())
