"""What a face asks of planning (`PlanOptions`), and the step it is asked for (`TrainingStep`).

The faces check their arguments once, into these two objects, and hand them down whole: every
planning function reads the option it needs from `step.options` instead of taking it as one more
parameter. The stages below planning (solve/, model/) take plain values: `PlanOptions.solving()` is
what the solver is given (a `SolverOptions`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from autoremat.model.devices import DeviceSpec
from autoremat.model.ledger import Ledger
from autoremat.passes.loss_chunks import OUTPUTS
from autoremat.passes.op_kinds import FP32_KEPT
from autoremat.planning import precision_plan
from autoremat.planning.compilers import check_compiler
from autoremat.solve.lp import check_solver
from autoremat.solve.solver_options import DEFAULT_GAP, SolverOptions


@dataclass(frozen=True)
class PlanOptions:
    """How to plan: `optimize`'s keyword arguments other than the model's, checked by `check`."""

    solver: str = "auto"  # the MIP solver: "auto" or "highs"
    time_limit: float = 10.0  # seconds per MIP solve
    gap: float = DEFAULT_GAP  # relative optimality gap at which a MIP solve stops
    compiler: str = "auto"  # as asked: "auto", "inductor" or "eager" (TrainingStep.compiler is the one in use)
    regions: bool | str = "auto"  # a graph per repeated block (True), one graph (False), or whichever costs less
    precision: str = "fp32"  # "fp32", "bf16", "fp16" or "auto"
    tolerance: float | None = None  # precision="auto": the summed relative error allowed
    fp32_ops: tuple[str, ...] = FP32_KEPT  # calls kept in fp32 whatever the precision
    outputs: str = "all"  # "all": the model's outputs as returned; "loss": only the loss is used
    release_grads: bool = True  # gradients reach .grad as each region's backward ends
    verify: bool = True  # run one real step and hold the budget to what it measures

    def check(self, where: torch.device | None = None) -> None:
        """Raise a one-line ValueError/TypeError naming the bad option and what would work. `where`: the
        device the batch is on, where known (fp16 needs real values to measure ranges on)."""
        if isinstance(self.time_limit, bool) or not isinstance(self.time_limit, (int, float)) \
                or not self.time_limit > 0 or not math.isfinite(self.time_limit):
            raise ValueError(f"time_limit must be a positive number of seconds, got {self.time_limit!r}")
        if isinstance(self.gap, bool) or not isinstance(self.gap, (int, float)) or not 0 <= self.gap < 1:
            raise ValueError(f"gap must be a relative optimality gap in [0, 1), got {self.gap!r}")
        check_solver(self.solver)
        if not (isinstance(self.regions, bool) or (isinstance(self.regions, str) and self.regions == "auto")):
            raise ValueError(f"regions must be True (one graph per repeated block), False (one graph) or 'auto' (per "
                             f"block unless one graph costs less time), got {self.regions!r}")
        check_compiler(self.compiler)
        if self.outputs not in OUTPUTS:
            raise ValueError(f"outputs must be 'all' (the model's outputs as it returns them) or 'loss' (only the "
                             f"loss is used: the logits output becomes None and is never materialised), got "
                             f"{self.outputs!r}")
        self._check_precision(where)

    def _check_precision(self, where: torch.device | None) -> None:
        if self.precision not in precision_plan.MODES:
            raise ValueError(f"precision must be one of {', '.join(precision_plan.MODES)}, got {self.precision!r}")
        tol = self.tolerance
        if tol is not None and (isinstance(tol, bool) or not isinstance(tol, (int, float)) or not math.isfinite(tol)
                                or tol < 0):
            raise ValueError(f"tolerance must be a finite number >= 0 (a summed relative error), got {tol!r}")
        if isinstance(self.fp32_ops, str) or not all(isinstance(o, str) for o in self.fp32_ops):
            raise TypeError(f"fp32_ops must be a list of call names such as {list(FP32_KEPT[:3])}, "
                            f"got {self.fp32_ops!r}")
        if self.precision == "fp16" and where is not None and where.type == "meta":
            raise ValueError("precision='fp16' measures value ranges on the example batch (fp16 overflows where bf16 "
                             "does not), which meta tensors do not have: give real example inputs, or use "
                             "precision='bf16' or 'auto' on meta (auto then offers bf16 only, with estimated errors)")

    def solving(self) -> SolverOptions:
        """What the solve stage is given: the solver, its time limit and gap."""
        return SolverOptions(self.solver, self.time_limit, self.gap)


# The options of a caller that names none (a planner built in a test, the backend's defaults).
DEFAULTS = PlanOptions()


def one_options(options: PlanOptions | None, keywords: dict[str, Any]) -> PlanOptions:
    """The options a face was given: `options`, or those its keyword arguments (PlanOptions' fields) name;
    never a mix of the two, which would leave one of them silently unused."""
    if options is None:
        return replace(DEFAULTS, **keywords)
    if not isinstance(options, PlanOptions):
        raise TypeError(f"options must be an autoremat.PlanOptions, got {type(options).__name__}")
    given = [name for name, value in keywords.items() if value != getattr(DEFAULTS, name)]
    if given:
        raise ValueError(f"got options= and also the keyword(s) {', '.join(given)}: set them in the PlanOptions "
                         "(dataclasses.replace(options, ...)) or drop options=")
    return options


def split_options(options: PlanOptions | None, kwargs: dict[str, Any]) -> tuple[PlanOptions, dict[str, Any]]:
    """A face's `**kwargs` parted into its PlanOptions (via `one_options`) and the arguments that are not options."""
    mine = {k: v for k, v in kwargs.items() if k in vars(DEFAULTS)}
    return one_options(options, mine), {k: v for k, v in kwargs.items() if k not in mine}


@dataclass(frozen=True)
class TrainingStep:
    """The training step being planned: the model, one example batch, where it runs, what is fixed."""

    model: torch.nn.Module
    args: tuple
    kwargs: dict
    where: torch.device  # the device the model and batch are on ("meta": planned, never run)
    dev: DeviceSpec  # the device the plan is priced for
    ledger: Ledger  # the budget's fixed parts for this batch
    options: PlanOptions
    compiler: str  # the compiler in use: "inductor" or "eager"
    # the regions traced so far, for every trace of this step to reuse (planning/same_regions.py)
    regions_seen: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def checked(self) -> bool:
        """Whether a real step will measure the plan (verify on, a real device)."""
        return self.options.verify and self.where.type != "meta"

    def using(self, compiler: str) -> TrainingStep:
        return replace(self, compiler=compiler)

    def shaped(self, args: tuple, kwargs: dict, ledger: Ledger) -> TrainingStep:
        """The same step with another batch shape (and the ledger for it)."""
        return replace(self, args=args, kwargs=kwargs, ledger=ledger)
