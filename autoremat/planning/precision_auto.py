"""The precision stage, where planning a step starts (`plan_step`): choose the step's compute dtypes
(precision="fp32" / "bf16" / "fp16" / "auto"), then run the pipeline (pipeline.plan_with_dtypes) with them.

"bf16" and "fp16" run every castable call in that dtype (fp16 only where the example batch shows it
is safe). "auto" weighs its candidates by predicted step time within the memory budget and an error
tolerance (default: what autocast's choice, every castable call in bf16, is estimated at):

    fp32 (when it fits) | the joint ILP's per-call dtypes (precision_plan.auto_dtypes) | every call in bf16

Each candidate is traced with its dtypes and planned exactly; the fastest that fits and is as accurate as
autocast on the example batch is kept, and the plan says which it kept and why (`plan.notes`,
`plan.precision["auto"]`). When fp32 does not fit and no candidate is as accurate as autocast, the
all-bf16 plan is returned with a warning that says so: never a silent fallback.

On the meta device there are no values to measure: each call's bf16 error is taken as bf16's unit
roundoff (precision_plan.BF16_ROUNDING), fp16 is not offered, and accuracy is not checked on a batch.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any

import torch

from autoremat.measure import grad_rel_err
from autoremat.planning import precision_plan
from autoremat.planning.options import TrainingStep
from autoremat.planning.pipeline import plan_with_dtypes
from autoremat.planning.plan import BudgetError, Plan
from autoremat.planning.planned_step import PlannedStep
from autoremat.planning.planner import Restore, progress
from autoremat.planning.verify import loss_of

# precision="auto": tries of the joint dtype ILP before its other candidates decide alone.
AUTO_TRIES = 3
# When the ILP's dtypes do not fit once traced, the next try asks for this share of the activations'
# room: the mixed graphs need more than the fp32-traced rows saw (casts, 16-bit copies).
AUTO_ROOM_SHRINK = 0.95
# When the mixed plan's measured error is above autocast's, the next try divides the tolerance by
# this: the per-call errors add up to more than their sum on the example batch suggested.
AUTO_TOLERANCE_DIVISOR = 4


def step_time(plan: Plan) -> float:
    """Predicted time of one step under the plan: every op once, plus what it recomputes."""
    return plan.forward_time_s + plan.recompute_time_s


def plan_step(step: TrainingStep, budget: int, store, fields: dict) -> PlannedStep:
    """The step's dtypes chosen (`step.options.precision`; module docstring), then the step traced with them
    and planned under `budget` (pipeline.plan_with_dtypes). fp32 goes straight to the pipeline."""
    model, args, kwargs, where = step.model, step.args, step.kwargs, step.where
    mode, tolerance = step.options.precision, step.options.tolerance
    if mode == "fp32":
        return plan_with_dtypes(step, budget, [], store, fields)
    with Restore(model), torch.enable_grad():
        an = precision_plan.analyse(model, args, kwargs, step.dev, step.options.fp32_ops, measure=where.type != "meta")
    info: dict[str, Any] = {"mode": mode}
    if mode in ("bf16", "fp16"):
        dtypes, unsafe = precision_plan.fixed_dtypes(an, mode)
        planned = plan_with_dtypes(step, budget, dtypes, store, fields)
        if unsafe:
            planned.plan.notes.append(f"fp16 would overflow or underflow in {len(unsafe)} call(s) on the example batch; "
                              f"kept in fp32: {', '.join(unsafe[:8])}")
            info["kept_fp32_unsafe"] = unsafe
    else:
        tol = an.default_tolerance() if tolerance is None else float(tolerance)
        info["tolerance"] = tol
        planned = _auto(step, an, tol, budget, store, fields, info)
    plan = planned.plan
    stats = {c: s.to_dict() for st in an.stats for c, s in st.items()}
    picked = plan.precision.get("dtypes") or []
    info["error_estimate"] = precision_plan.error_estimate(an, picked) if an.stats and any(an.stats) else None
    info["calls"] = stats
    plan.precision = {**info, **plan.precision}
    if where.type != "meta" and "loss_rel_err" not in plan.precision and picked:
        plan.precision.update(precision_errors(model, planned.compiled, args, kwargs, where))
    plan.budget = budget
    return planned


def _auto(step: TrainingStep, an, tol: float, budget: int, store, fields: dict, info: dict) -> PlannedStep:
    """precision="auto": the fastest of fp32, the joint ILP's dtypes and all-bf16 (module docstring)."""
    model, args, kwargs, where, ledger = step.model, step.args, step.kwargs, step.where, step.ledger
    meta = where.type == "meta"

    def checked(result: PlannedStep) -> bool:
        if meta:
            result.plan.precision["accuracy"] = "estimated (meta device: no batch to measure)"
            return True
        errors = precision_errors(model, result.compiled, args, kwargs, where)
        result.plan.precision.update(errors)
        return as_accurate_as_autocast(errors)

    try:
        fp32 = plan_with_dtypes(step, budget, [], None, fields)
    except BudgetError:
        fp32 = None
    candidates: dict[str, PlannedStep] = {} if fp32 is None else {"fp32": fp32}
    why: dict[str, str] = {} if fp32 is not None else {"fp32": "does not fit the budget"}
    room = ledger.room(budget)
    if fp32 is not None:  # the mixed plan may not use more memory than the fp32 one does
        room = min(room, fp32.plan.activation_peak)
    ilp_tol, ilp_dtypes = tol, None
    for attempt in range(AUTO_TRIES):
        dtypes = precision_plan.auto_dtypes(an, room, ilp_tol, step.dev, step.options.solving())
        reason = ("the joint ILP found no dtypes within the budget" if dtypes is None
                  else "the joint ILP chose fp32 for every call" if not any(dtypes)
                  else _no_faster(an, dtypes, fp32, step))
        if reason is not None:
            why["ilp"] = reason
            break
        try:
            result = plan_with_dtypes(step, min(budget, ledger.needs(room)), dtypes, store, fields)
        except BudgetError:
            why["ilp"] = "the ILP's dtypes did not fit once traced"
            room = int(room * AUTO_ROOM_SHRINK)
            continue
        if checked(result):
            candidates["ilp"], ilp_dtypes = result, dtypes
            why.pop("ilp", None)
            break
        why["ilp"] = f"after {attempt + 1} tries the ILP's mixed plan was still less accurate than autocast"
        ilp_tol /= AUTO_TOLERANCE_DIVISOR
    bf16_dtypes = precision_plan.fixed_dtypes(an, "bf16")[0]
    bf16_error = precision_plan.error_estimate(an, bf16_dtypes)
    bf16_checked: bool | None = None
    if ilp_dtypes != bf16_dtypes and (bf16_error <= tol or not candidates) and (reason := _no_faster(an, bf16_dtypes, fp32, step)):
        why["bf16"] = reason
    elif ilp_dtypes != bf16_dtypes and (bf16_error <= tol or not candidates):
        try:
            result = plan_with_dtypes(step, budget, bf16_dtypes, store, fields)
        except BudgetError as e:
            why["bf16"] = "every call in bf16 does not fit"
            if not candidates:
                raise BudgetError(f"precision='auto': nothing fits: fp32 does not, {why.get('ilp', '')}, and "
                                  f"{why['bf16']}.\n{e}", e.ledger, e.smallest_budget, e.peak_step) from e
        else:
            bf16_checked = checked(result)
            if bf16_error > tol:
                why["bf16"] = f"its estimated error {bf16_error:.2e} is above the tolerance {tol:.2e}"
            if bf16_checked or not candidates:
                candidates["bf16"] = result
            else:
                why["bf16"] = "less accurate than autocast on the example batch"
    times = {name: step_time(r.plan) for name, r in candidates.items()}
    chosen = min(times, key=times.__getitem__)
    plan = candidates[chosen].plan
    plan.precision.setdefault("dtypes", [])  # fp32 chosen: no call runs in 16 bits
    info["auto"] = {"chosen": chosen, "predicted_step_s": times, "not_taken": why}
    info["dtypes_chosen_by"] = {"fp32": "fp32", "ilp": "ilp (joint with save/recompute)", "bf16": "all-bf16"}[chosen]
    others = ", ".join(f"{n} {t * 1e3:.2f} ms" for n, t in times.items() if n != chosen)
    plan.notes.append(f"precision='auto' chose {chosen} (predicted step {times[chosen] * 1e3:.2f} ms"
                      + (f"; {others}" if others else "") + ")"
                      + ("" if not why else "; not taken: " + "; ".join(f"{k}: {v}" for k, v in why.items())))
    if chosen == "bf16" and bf16_checked is False:
        message = ("precision='auto': fp32 does not fit this budget and no plan within it was as accurate as "
                   f"autocast on the example batch ({why.get('ilp', 'the joint ILP found nothing')}); every castable "
                   "call runs in bf16, with the errors in plan.precision. A larger budget lets fp32 or a mixed plan fit.")
        plan.notes.append(message)
        warnings.warn(message, stacklevel=4)
    return candidates[chosen]


def _no_faster(an, dtypes: list[dict[str, str]], fp32, step: TrainingStep) -> str | None:
    """Why a candidate's dtypes cannot beat fp32's plan even with nothing recomputed, so that it is not
    traced; None if they might, or fp32 does not fit. As with the loss region's chunk counts
    (loss_region.bounds.least_ops_time), each candidate is a trace, a plan and a compile: its ops once (fp32's, less what its 16-bit calls are
    predicted to save) are a lower bound of its step time."""
    cost = -precision_plan.predicted_gain(an, dtypes, step.dev)
    if fp32 is None or cost < fp32.plan.recompute_time_s:
        return None
    return (f"not traced: its 16-bit calls are predicted to add {cost * 1e3:.3f} ms of ops and casts, no less "
            f"than the {fp32.plan.recompute_time_s * 1e3:.3f} ms fp32's plan recomputes")


def as_accurate_as_autocast(errors: dict[str, float]) -> bool:
    # "As accurate" up to the rounding of the fp32 results compared: each relative error is measured
    # from a value and a reference that are each within one fp32 rounding (eps / 2) of what they stand
    # for, so two errors equal before rounding can differ by 2 * eps after it. Without this margin a
    # loss one ulp from fp32's counted as less accurate than autocast's loss that landed exactly on it.
    margin = 2 * torch.finfo(torch.float32).eps
    return (errors["loss_rel_err"] <= errors["autocast_loss_rel_err"] + margin
            and errors["grad_rel_err"] <= errors["autocast_grad_rel_err"] + margin)


def precision_errors(model, compiled, args, kwargs, where) -> dict[str, float]:
    """Relative error of the loss and of all gradients versus fp32 eager, for the compiled step and
    for torch.autocast(bf16) on the same batch (same random stream, state restored after each)."""
    params = [p for p in model.parameters() if p.requires_grad]
    rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None

    def run(fn, autocast: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        with Restore(model):
            torch.set_rng_state(rng)
            if cuda_rng is not None:
                torch.cuda.set_rng_state_all(cuda_rng)
            for p in params:
                p.grad = None
            amp = torch.autocast(where.type, dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
            with torch.enable_grad(), amp:
                loss = loss_of(fn(*args, **kwargs))
            loss.backward()
            grads = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).detach().double().flatten()
                               for p in params])
            return loss.detach().double(), grads

    progress.info("measuring the precision errors against fp32 and autocast")
    ref_loss, ref_grads = run(model)
    ac_loss, ac_grads = run(model, autocast=True)
    loss, grads = run(compiled)
    rel = grad_rel_err  # ||x - ref|| / ||ref||, of the loss as of the concatenated gradients
    return {"loss_rel_err": rel(loss, ref_loss), "grad_rel_err": rel(grads, ref_grads),
            "autocast_loss_rel_err": rel(ac_loss, ref_loss), "autocast_grad_rel_err": rel(ac_grads, ref_grads)}
