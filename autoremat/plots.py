"""Pictures of a plan: live memory over the step, and predicted overhead against budget.

    plot_timeline(plan, "timeline.png")
    plot_pareto([(budget, overhead), ...], (plan.budget, plan.overhead), "pareto.svg")

The format follows the file extension (.png, .svg or .pdf). matplotlib is an optional
dependency (`pip install autoremat[plot]`), imported only when a plot is drawn.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any

from autoremat.model.ledger import Ledger
from autoremat.planning.plan import Plan

FORMATS = (".png", ".svg", ".pdf")
MISSING = "install autoremat[plot] (matplotlib) to draw plots"


def check_path(path: str | Path) -> None:
    """Fail before a long planning run, not after it, on a path we could not write."""
    path = Path(path)
    if path.suffix.lower() not in FORMATS:
        raise ValueError(f"plot file {str(path)!r} must end in one of {', '.join(FORMATS)}")
    if not path.parent.is_dir():
        raise ValueError(f"directory {str(path.parent)!r} does not exist (for {str(path)!r})")


def require_matplotlib() -> Any:
    try:
        import matplotlib
    except ImportError as e:
        raise ImportError(MISSING) from e
    matplotlib.use("Agg")  # files only: no display needed, and none is touched
    import matplotlib.pyplot as plt

    return plt


def _unit(nbytes: float) -> tuple[float, str]:
    return (2**30, "GiB") if nbytes >= 2**30 else (2**20, "MiB") if nbytes >= 2**20 else (2**10, "KiB")


def shared_x(plan: Plan) -> tuple[list[float], list[float]]:
    """x positions of `plan.timeline`'s rows and of `plan.baseline_timeline`'s, on one axis.

    The axis is the plan's own op order (recomputed ops included). The step without recomputation
    runs fewer ops, and not all in the same order (a view the plan recomputes in the backward runs
    in its forward), so the row number of one curve is not the other's. Each op that both run in
    the same relative order (graph, phase and node alike) is drawn at the plan's position; the
    baseline's other rows are spaced evenly between those anchors.
    """
    plan_x = [float(i) for i in range(len(plan.timeline))]
    base = plan.baseline_timeline
    if not base:
        return plan_x, []
    keys = [tuple(r[:3]) for r in plan.timeline]
    base_keys = [tuple(r[:3]) for r in base]
    anchors: dict[int, float] = {}
    matcher = difflib.SequenceMatcher(None, base_keys, keys, autojunk=False)
    for block in matcher.get_matching_blocks():
        for k in range(block.size):
            anchors[block.a + k] = float(block.b + k)
    # the ends: the two step's first and last ops share their positions
    anchors.setdefault(0, 0.0)
    anchors.setdefault(len(base) - 1, float(max(len(keys) - 1, 0)))
    known = sorted(anchors)
    base_x = [0.0] * len(base)
    for lo, hi in zip(known, known[1:]):
        for i in range(lo, hi + 1):
            base_x[i] = anchors[lo] + (anchors[hi] - anchors[lo]) * (i - lo) / (hi - lo)
    if len(known) == 1:
        base_x[known[0]] = anchors[known[0]]
    return plan_x, base_x


def plot_timeline(plan: Plan, path: str | Path) -> None:
    """Live bytes at each op of the step, with and without the plan's recomputation.

    The fixed bytes (parameters, gradients, optimizer state, inputs) are added so that the y axis
    is the whole step's memory and the budget line means what it says. Both curves share one x
    axis, the plan's op order (`shared_x`): an op both run sits at the same x on both.
    """
    check_path(path)
    plt = require_matplotlib()
    fixed = Ledger.from_dict(plan.ledger).fixed
    scale, unit = _unit(max(plan.budget, fixed + plan.baseline_peak))
    fig, ax = plt.subplots(figsize=(9, 4.5))
    plan_x, base_x = shared_x(plan)
    for timeline, xs, label, style in ((plan.baseline_timeline, base_x, "no recomputation", ":"),
                                       (plan.timeline, plan_x, "autoremat plan", "-")):
        if not timeline:
            continue
        ys = [(fixed + row[3]) / scale for row in timeline]
        ax.plot(xs, ys, style, lw=1.4, label=f"{label} (peak {max(ys):.2f} {unit})")
    ax.axhline(plan.budget / scale, color="tab:red", lw=1, label=f"budget {plan.budget / scale:.2f} {unit}")
    ax.axhline(fixed / scale, color="gray", lw=0.8, ls="--", label=f"fixed {fixed / scale:.2f} {unit}")
    boundary = next((i for i, row in enumerate(plan.timeline) if row[1] == "backward"), None)
    if boundary is not None:
        ax.axvline(boundary, color="black", lw=0.8, ls="-.")
        ax.annotate(" forward | backward", (boundary, ax.get_ylim()[0]), ha="center", va="bottom", fontsize=8)
    ax.set_xlabel("op in the training step, in the plan's order (recomputed ops included)")
    ax.set_ylabel(f"live memory ({unit})")
    ax.set_title(f"autoremat plan on {plan.device}: predicted peak {plan.predicted_peak / scale:.2f} {unit}, "
                 f"overhead {100 * plan.overhead:.1f}%", fontsize=10)
    ax.legend(fontsize=8, loc="upper left")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_pareto(points: list[tuple[int, float]], chosen: tuple[int, float] | None, path: str | Path) -> None:
    """Predicted step-time overhead of recomputation against the budget (bytes, fraction)."""
    check_path(path)
    plt = require_matplotlib()
    budgets = [b for b, _ in points] + ([chosen[0]] if chosen else [])
    scale, unit = _unit(max(budgets, default=1))
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([b / scale for b, _ in points], [100 * o for _, o in points], "o-", lw=1.4, label="best plan")
    if chosen is not None:
        ax.plot([chosen[0] / scale], [100 * chosen[1]], "*", ms=14, color="tab:red",
                label=f"chosen ({chosen[0] / scale:.2f} {unit}, {100 * chosen[1]:.1f}%)")
    ax.set_xlabel(f"budget ({unit})")
    ax.set_ylabel("predicted recompute overhead (% of step)")
    ax.set_title("time vs memory: smallest feasible budget to no recomputation", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
