"""Benchmark helpers that plan without timing a step (part of the shared module `common`; this file imports
no script).

  inductor_limits                   the budget range under compiler="inductor" (speed.py, inductor_prediction.py)
  chunking_off, meta_part,          the loss region: GPT-2 small 8 x 1024 planned on meta for an H100,
  meta_table                        its floors with and without the loss rewrite (loss_region.py, floor.py)
  scale_optimize, scale_floor,      mixed precision planned on meta for an H100 (precision_at_scale.py,
  scale_step                        plan_spread.py, precision_live_at_peak.py)
  live_at_peak                      the memory model's live storages at its simulated peak (live_at_peak.py,
                                    precision_live_at_peak.py, gpu_check.py)
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Iterator

import torch

import autoremat
from autoremat.model import memory
from autoremat.model.ledger import Ledger
from autoremat.passes import loss_chunks
from autoremat.solve.decision import evaluate
from examples.models import gpt2_small

GiB = 2**30


# --------------------------------------------------------------------------------------------
# Inductor's budget range


def inductor_limits(bench, outputs: str) -> tuple[int, int, int]:
    """(smallest feasible budget, the least budget that recomputes nothing, fixed bytes) under compiler="inductor".
    `bench` needs fresh() (a copy of the model) and ex (its example inputs), as common.Bench has."""
    torch._dynamo.reset()
    big = autoremat.optimize(bench.fresh(), budget=1 << 50, example_inputs=bench.ex, optimizer=None,
                             compiler="inductor", verify=False, progress=False, outputs=outputs)
    fixed = Ledger.from_dict(big.plan.ledger).fixed
    hi = big.plan.no_recompute_budget
    torch._dynamo.reset()
    try:
        autoremat.optimize(bench.fresh(), budget=fixed + 1, example_inputs=bench.ex, optimizer=None,
                           compiler="inductor", verify=False, progress=False, outputs=outputs)
        lo = fixed + 1
    except autoremat.BudgetError as e:
        lo = e.smallest_budget
    torch._dynamo.reset()
    return lo, hi, fixed


# --------------------------------------------------------------------------------------------
# the loss region planned on meta


LOSS_GOALS = {"all": 9 * GiB, "loss": 6 * GiB}  # the goals for GPT-2 small 8 x 1024's floors


@contextlib.contextmanager
def chunking_off() -> Iterator[None]:
    """The loss rewrite disabled (one chunk only): the baseline the loss rewrite is measured against."""
    kept = loss_chunks.CANDIDATES
    loss_chunks.CANDIDATES = (1,)
    try:
        yield
    finally:
        loss_chunks.CANDIDATES = kept


def meta_part(time_limit: float) -> list[dict]:
    """GPT-2 small 8 x 1024 on meta (H100 roofline): floors and a plan at each floor."""
    rows = []
    for setting, outputs, off in (("chunking off", "all", True), ("outputs=all", "all", False),
                                  ("outputs=loss", "loss", False)):
        row = dict(model="gpt2-small 8x1024 (meta, h100)", setting=setting)
        t0 = time.perf_counter()
        with chunking_off() if off else contextlib.nullcontext():
            torch._dynamo.reset()
            with torch.device("meta"):
                model, inputs = gpt2_small(batch=8, seq=1024)
            try:
                autoremat.optimize(model, 1, inputs, device="h100", time_limit=time_limit, outputs=outputs, compiler="eager")
            except autoremat.BudgetError as e:
                row["smallest_budget"] = e.smallest_budget
            torch._dynamo.reset()
            try:
                om = autoremat.optimize(model, row["smallest_budget"], inputs, device="h100", time_limit=time_limit,
                                        outputs=outputs, compiler="eager")
                row.update(status="planned at the floor", predicted_peak=om.plan.predicted_peak,
                           chunks=om.plan.loss.get("chunks", 1), summary_line=_loss_line(om.plan))
            except autoremat.BudgetError as e:
                row.update(status="infeasible at the floor", retry_budget=e.smallest_budget)
        row["wall_s"] = time.perf_counter() - t0
        goal = LOSS_GOALS.get(outputs) if not off else None
        row["goal"] = f"<= {goal / GiB:.0f} GiB: {'met' if row['smallest_budget'] <= goal else 'NOT met'}" \
            if goal else "-"
        print(f"  {setting}: floor {row['smallest_budget'] / GiB:.2f} GiB, {row['status']}, {row['goal']}",
              flush=True)
        rows.append(row)
    return rows


def _loss_line(plan) -> str:
    return next((line for line in plan.summary().splitlines() if line.startswith("loss ")), "")


def meta_table(rows: list[dict]) -> str:
    lines = ["| setting | smallest feasible budget | at that budget | plan says | goal |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['setting']} | {r['smallest_budget'] / GiB:.2f} GiB ({r['smallest_budget']} B) | "
                     f"{r['status']} | {r.get('summary_line', '-')} | {r['goal']} |")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# mixed precision at scale, planned on meta for an H100


SCALE_DEVICE = "h100"
SCALE_MODES = ("fp32", "bf16", "auto")
TINY = 10**9  # 1 GB: below every floor here, so optimize reports the smallest budget that fits


def scale_optimize(model, inputs, budget: int, precision: str, outputs: str, regions: bool | str = "auto"):
    """autoremat.optimize on meta for SCALE_DEVICE's roofline, AdamW, compiler="eager"."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return autoremat.optimize(model, budget=budget, example_inputs=inputs, device=SCALE_DEVICE,
                                  optimizer="adamw", precision=precision, progress=False, compiler="eager",
                                  outputs=outputs, regions=regions)


def scale_floor(model, inputs, precision: str, outputs: str) -> dict:
    """The smallest budget that fits: total, the fixed ledger, and the activation part beyond it."""
    try:
        scale_optimize(model, inputs, TINY, precision, outputs)
    except autoremat.BudgetError as e:
        fixed = e.ledger.fixed
        return {"total": e.smallest_budget, "fixed": fixed, "activations": e.smallest_budget - fixed}
    raise SystemExit(f"{precision}: 1 GB fits; pick a larger model")


def scale_step(model, inputs, budget: int, precision: str, outputs: str, regions: bool | str = "auto"):
    """{"fits": False} where `budget` does not fit, else (the predicted step's figures, the RematModule)."""
    try:
        om = scale_optimize(model, inputs, budget, precision, outputs, regions)
    except autoremat.BudgetError:
        return {"fits": False}
    p = om.plan
    out = {"fits": True, "time_s": p.forward_time_s + p.recompute_time_s, "peak": p.predicted_peak,
           "recompute_s": p.recompute_time_s}
    if precision == "auto":
        out["chosen"] = p.precision.get("auto", {}).get("chosen")
    return out, om


# --------------------------------------------------------------------------------------------
# the memory model's live set at its peak


def live_at_peak(profiles, saved: list[set[str]], granularity: int = 1) -> dict:
    """Replay the plan in memory.simulate, keeping a copy of the heap at its peak step."""
    best: dict = {"during": -1}
    heaps: list = []
    graph_position = {g.index: k for k, g in enumerate(profiles)}
    plain_heap, plain_step = memory._Heap, memory.Step

    class Observed(plain_heap):
        def __init__(self, *a) -> None:
            super().__init__(*a)
            heaps.append(self)
            self.snap: dict | None = None

        def add(self, name: str, nbytes: int) -> None:
            super().add(name, nbytes)
            # the heap as the op runs (its inputs and its output), before its inputs' last uses free them
            self.snap = (self.scope, name, dict(self.size))

    def step(graph, phase, node, during):
        # heaps[0] is the step's heap; the later ones are copies in which memory._kernel_order tries the kernel
        # orders Inductor weighs (phase ""), whose steps are not the step's
        if phase and during > best["during"] and heaps:
            h = heaps[0]
            # the op allocated (or wrote into a dying input's buffer: recomputed_writes.py) since the last step
            ran = h.snap is not None and h.snap[0] == h.scope
            best.update(during=during, graph=graph_position[graph], phase=phase, node=node,
                        live=h.snap[2] if ran else dict(h.size))
        if heaps and phase:
            heaps[0].snap = None
        return plain_step(graph, phase, node, during)

    memory._Heap, memory.Step = Observed, step
    try:
        evaluate(profiles, saved, granularity)
    finally:
        memory._Heap, memory.Step = plain_heap, plain_step
    return best
