"""The user's checkpoint marks (model/marks.py) in the ILP: MUST marks as bounds, PREFER marks as a tie-break.

  must_save v        r_v = 0, and s_v = 1 where the backward reads v
  must_recompute v   s_v = 0 (the choice row s_v + r_v >= 1 then recomputes it where the backward reads it)
  prefer_*           no row: in the objective's tie-break on saved bytes (objective.TIE_BYTES, far below any
                     recompute time) a PREFER_RECOMPUTE value's bytes count twice and a PREFER_SAVE value's
                     not at all, so a hint decides only among plans of the same predicted time

`schedule.make_schedule` forces the MUST marks onto every saved set, whichever planner chose it; these
bounds make the ILP optimise over exactly those plans, and its smallest peak (BudgetError's floor) too.
"""

from __future__ import annotations

import pulp

from autoremat.model.graph_profile import GraphProfile
from autoremat.model.lifetimes import Lifetimes
from autoremat.model.marks import PREFER_RECOMPUTE, PREFER_SAVE, must_marks
from autoremat.solve import lp


def bound_marks(g: GraphProfile, life: Lifetimes, s: dict, r: dict) -> None:
    """The MUST bounds of one graph's s_v / r_v (module docstring)."""
    marks = must_marks(g)
    for v in sorted(marks.save & r.keys()):
        r[v].upBound = 0
        if v in life.needed and v in s and s[v].upBound != 0:
            s[v].lowBound = 1
    for v in sorted(marks.recompute & s.keys()):
        s[v].upBound = 0


def hinted_bytes(g: GraphProfile, saved_bytes: dict) -> lp.Expression:
    """What the PREFER marks add to the tie-break's saved bytes: +S_v for PREFER_RECOMPUTE, -S_v for PREFER_SAVE."""
    sign = {PREFER_RECOMPUTE: 1, PREFER_SAVE: -1}
    return pulp.lpSum(sign[g.nodes[v].mark] * b for v, b in saved_bytes.items() if g.nodes[v].mark in sign)
