"""Verification: one real step of a compiled plan, measured in the accumulation steady state, holds the plan
to the budget.

The memory model is exact for the kernels it knows. What it does not know (scratch of a kernel it has not
measured, eager code between graphs, a compiler's kernel that holds more buffers at once than the graph's
order shows) would let the real peak pass the budget; so the step is measured, and a plan that misses is
planned again with the measured gap reserved, or refused with `BudgetError`. The budget never passes
silently.
"""

from __future__ import annotations

from typing import Any

import torch

from autoremat.model.ledger import Ledger
from autoremat.planning.joint_plan import plan_jointly, solve_step
from autoremat.planning.options import TrainingStep
from autoremat.planning.plan import BudgetError
from autoremat.planning.planned_step import PlannedStep
from autoremat.planning.planner import Restore, along, progress
from autoremat.torch_internals import tree_leaves
from autoremat.units import format_bytes

UNMEASURED = object()  # verify_on_step: no real step of this plan has been measured yet

# Plans made again after the first one missed. The gap is a property of the plan as much as of the model:
# a re-planned step recomputes other values and can miss by more than the gap reserved for it (near the
# floor under Inductor: benchmarks/lora.py plans a LoRA GPT-2 there), so the largest gap seen so far
# is reserved each time, and planning stops when a gap no larger than that is measured over the budget
# (the same reserve would give the same plan).
REPLANS = 3


def measure_planned(step: TrainingStep, planned: PlannedStep) -> int | None:
    """`measure_step` of the step just planned and compiled, said on progress (a long verification is
    mostly AOTAutograd compiling the backward at its first call)."""
    progress.info("verifying the plan on a real step")
    if step.compiler == "inductor":
        along("Inductor compiles the backward graphs on this first backward")
    return _measured(step, planned)


def _measured(step: TrainingStep, planned: PlannedStep) -> int | None:
    """`measure_step` of `step`'s compiled plan (under Inductor a warm step first: measure_step says why), less
    what the eager code between its graphs saved (`Ledger.of_graphs`)."""
    measured = measure_step(step.model, planned.compiled, planned.applier, step.args, step.kwargs, step.where,
                            warm=step.compiler == "inductor")
    return None if measured is None else step.ledger.of_graphs(measured)


def verify_on_step(step: TrainingStep, planned: PlannedStep, budget: int, measured: Any = UNMEASURED) -> PlannedStep:
    """Run one real step and hold the budget to what it measures: re-plan if the model missed.

    The measured gap is reserved, the graphs (all of them: they share the step) are planned again, and
    the new plan is measured too; up to REPLANS times, each reserving the largest gap seen. A plan that
    still does not fit is never returned: BudgetError says what was measured and which budget held the
    last plan. `measured`: what measure_step already returned for this plan, if it ran.
    """
    ledger, plan = step.ledger, planned.plan
    if measured is UNMEASURED:
        measured = measure_planned(step, planned)
    if measured is None:
        # The step compiled again (dynamo guards on Python state the forward changes, e.g. a global
        # counter): the measurement includes tracing and says nothing about the plan.
        plan.notes.append("the model recompiled on its second call (it changes Python state that dynamo guards "
                          "on, e.g. a global); not verified, and later calls recompile too")
        return planned
    plan.notes.append(f"verified on one real step (steady state, .grad buffers present): measured activation "
                      f"peak {measured} B, predicted {plan.activation_peak} B")
    reserved, tried = 0, []
    while ledger.step_peak(measured) > budget:
        gap = measured - plan.activation_peak
        tried.append((plan.activation_peak, measured))
        if len(tried) > REPLANS or gap <= reserved:
            raise _missed(ledger, budget, tried, reserved)
        reserved = gap
        reserve = Ledger.from_dict(dict(ledger.to_dict(), notes=[
            *ledger.notes, f"{reserved} B reserved for memory the model did not predict"]))
        reserve.inputs += reserved
        progress.info("re-planning with %d bytes the memory model did not predict", reserved)
        try:
            trace = planned.trace
            planned = plan_jointly(step, trace, budget, solve_step(step, trace, budget, reserve))
        except BudgetError as e:
            if len(tried) == 1:
                e.measured = True  # the gap a real step measured, reserved, is what no longer fits
                raise
            raise _missed(ledger, budget, tried, reserved) from e
        new = planned.plan
        new.notes += [n for n in plan.notes if n not in new.notes]  # the first plan's, and earlier re-plans'
        new.notes.append(f"re-planned with {reserved} B reserved for memory the model did not predict")
        plan, measured = new, _measured(step, planned)
        if measured is None:
            return planned
        held = ledger.step_peak(measured) <= budget
        plan.notes.append(f"{'verified the re-planned step' if held else 'the re-planned step was over the budget'}: "
                          f"measured activation peak {measured} B, predicted {plan.activation_peak} B")
    return planned


def _missed(ledger: Ledger, budget: int, tried: list[tuple[int, int]], reserved: int) -> BudgetError:
    """The refusal once the plans made (predicted, measured activation bytes each) all measured over."""
    (predicted, measured), last = tried[0], tried[-1][1]
    again = "" if len(tried) == 1 else (
        f"; re-planned {len(tried) - 1} time(s), up to {format_bytes(reserved)} reserved for what it missed, the "
        f"last plan measured {format_bytes(ledger.step_peak(last))}")
    return BudgetError(
        f"budget {format_bytes(budget)} ({budget} bytes) was not met on a real step: the plan predicted "
        f"{format_bytes(ledger.step_peak(predicted))} but measured {format_bytes(ledger.step_peak(measured))}{again}. "
        f"The memory model misses something this model allocates; a budget of {format_bytes(ledger.needs(last))} "
        f"holds the last plan.\n{ledger.format()}", ledger, ledger.needs(last), measured=True)


def measure_step(model, compiled, planner, args, kwargs, where, warm: bool = False) -> int | None:
    """Activation bytes of one real step in the accumulation steady state, state restored after.

    Every trainable parameter has a `.grad` already (zeros), as on every micro-step after the
    first, so what autograd allocates on top of the gradient buffers is what is measured. The step
    measured runs the artefact the user's next call runs: if a call traces again (dynamo guards on
    Python state the forward changes), the call after it runs what that trace compiled, so that one
    is measured. None if every call traces again.

    warm: run one step unmeasured first. Inductor compiles each backward graph when it first runs, and
    that compile allocates: it copies the CPU generator's state while it generates code
    (`preserve_rng_state`). Measured, that one-off would be taken for a plan that missed, and the whole step
    planned and compiled again for a few KB no later step allocates (benchmarks/plan_time.py's inductor
    variant plans at the floor). No user step pays it once verification has run the plan.
    """
    from autoremat.measure import measure_peak  # a measuring tool, not a pipeline stage

    def step() -> None:
        out = compiled(*args, **kwargs)  # held through the backward, as a training loop holds it
        loss_of(out).backward()

    measured = None
    with Restore(model), torch.enable_grad():
        for p in model.parameters():
            p.grad = torch.zeros_like(p) if p.requires_grad else None
        if where.type == "cuda" or warm:
            # `warm`: see the docstring. On CUDA, cuBLAS allocates its workspaces on a thread's first matmul and
            # keeps them (the ledger holds them: devices.blas_workspace_bytes); autograd's device thread may not
            # have run one yet. One step first, so that the one measured is the steady state of the user's loop
            # and the workspaces are not counted twice.
            step()
        for _ in range(2):
            traced = len(planner.profiles)
            _, m = measure_peak(step, device=where, baseline_bytes=0)
            if len(planner.profiles) == traced:
                measured = m.delta_peak_bytes if where.type == "cpu" else m.peak_bytes - m.baseline_bytes
                break
    return _agreed(measured, where)


def _agreed(measured: int | None, where: torch.device) -> int | None:
    """Under torch.distributed every rank must take the same decision (keep, re-plan or refuse): one
    rank refusing while the others train would leave them waiting in a collective, and ranks can measure
    different peaks (each process has its own allocator state and timing). The largest measurement decides for all."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return measured
    if torch.distributed.get_world_size() == 1:
        return measured
    value = torch.tensor([-1 if measured is None else measured], dtype=torch.int64,
                         device=where if where.type == "cuda" else "cpu")
    torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MAX)
    return None if value.item() < 0 else int(value.item())


def loss_of(out: Any) -> torch.Tensor:
    """Something to call backward on: the output if scalar, else the sum of every float output."""
    leaves = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
    if len(leaves) == 1 and leaves[0].numel() == 1:
        return leaves[0]
    if hasattr(out, "get") and isinstance(out.get("loss"), torch.Tensor):
        return out["loss"]
    return sum(t.float().sum() for t in leaves)
