"""The objective every ILP of the solver minimises, written once (ilp.py's model).

Within the room: the least predicted time (recomputation and casts, scaled by the step's total),
ties broken toward fewer saved bytes and toward bf16 over fp16. For the smallest peak: the least cap,
ties broken toward the least time.
"""

from __future__ import annotations

from dataclasses import dataclass

from autoremat.solve import lp

# Weight of saved bytes in the budgeted objective: small enough never to outweigh recompute time,
# large enough to break its ties toward saving less (keeps the plan's peak monotonic in the room).
TIE_BYTES = 1e-4
# Weight of each fp16 call in the budgeted objective: fp16 needs loss scaling, so on a tie prefer bf16.
FP16_PENALTY = 1e-3
# Weight of recompute time (scaled to bytes) when minimising the peak: among plans with the same
# peak, the cheapest one, without letting time move the peak by more than a rounding.
MIN_PEAK_TIME_WEIGHT = 1e-3


@dataclass
class Terms:
    """What the objective weighs: recompute (and cast) time T, saved bytes, fp16 calls, and their scales."""

    time_expr: lp.Expression
    bytes_expr: lp.Expression
    fp16_expr: lp.Expression
    total_time: float
    total_bytes: float


def set_objective(prob: lp.Problem, cap: lp.Variable, min_peak: bool, terms: Terms) -> None:
    """The ILP's objective: within the room (the caller has fixed `cap` to it), the least time, ties toward
    fewer saved bytes and bf16 over fp16; with `min_peak` (`cap` free), the least cap, ties toward the least
    time."""
    if min_peak:
        prob.setObjective(cap + MIN_PEAK_TIME_WEIGHT * terms.total_bytes / terms.total_time * terms.time_expr)
    else:
        prob.setObjective(terms.time_expr / terms.total_time + TIE_BYTES * terms.bytes_expr / terms.total_bytes
                          + FP16_PENALTY * terms.fp16_expr)
