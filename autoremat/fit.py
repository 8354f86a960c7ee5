"""Choose the micro-batch and the gradient-accumulation steps for a global batch under a byte budget.

    cfg = autoremat.fit(model, budget="24GB", global_batch=64, sample=one_example, optimizer=opt)
    for step, (x, y) in enumerate(loader(batch_size=cfg.micro_batch)):
        loss = loss_fn(cfg.model(x), y) / cfg.accumulation_steps
        loss.backward()
        if (step + 1) % cfg.accumulation_steps == 0:
            opt.step(); opt.zero_grad(set_to_none=True)

Every divisor of the global batch is planned on a meta-device twin of the model (shapes only: no
weights copied, nothing run on the device), from the smallest up. The fitting candidate with the
least predicted time per global batch wins; only that one is then planned for real, on the model's
own device, and returned as a `RematModule`. See docs/fit.md.
"""

from __future__ import annotations

import copy
import logging
import warnings
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from autoremat.api import _model_device, optimize
from autoremat.model.devices import DeviceSpec, get_device
from autoremat.model.ledger import Ledger
from autoremat.planning.options import PlanOptions, split_options
from autoremat.planning.plan import BudgetError, Plan
from autoremat.progress import LOGGER, muted, stages_on_stderr
from autoremat.remat_module import RematModule
from autoremat.torch_internals import tree_map
from autoremat.units import format_bytes, parse_budget


@dataclass
class MicroBatchPlan:
    """One micro-batch size as planned on the meta device."""

    micro_batch: int
    accumulation_steps: int
    fits: bool
    predicted_peak: int | None = None  # whole step at the plan's choice; None unless it fits
    smallest_budget: int | None = None  # when it does not fit: the least budget that would
    no_recompute_peak: int | None = None  # whole step if every activation were saved
    step_time_s: float = 0.0  # one micro-step: all ops once + recomputation
    recompute_time_s: float = 0.0  # the recomputation part of step_time_s
    accumulate_time_s: float = 0.0  # adding one micro-step's gradients into .grad
    note: str = ""

    @property
    def recompute_share(self) -> float:
        return self.recompute_time_s / self.step_time_s if self.step_time_s else 0.0

    @property
    def time_per_global_batch_s(self) -> float:
        # The first micro-step after zero_grad(set_to_none=True) hands autograd's gradient over
        # as .grad; each later one adds into it.
        return self.accumulation_steps * self.step_time_s + (self.accumulation_steps - 1) * self.accumulate_time_s


@dataclass
class FitConfig:
    micro_batch: int
    accumulation_steps: int
    model: RematModule
    plan: Plan
    candidates: list[MicroBatchPlan]
    warnings: list[str] = field(default_factory=list)  # also raised with warnings.warn
    notes: list[str] = field(default_factory=list)
    budget: int = 0
    global_batch: int = 0

    def report(self) -> str:
        lines = [
            f"autoremat.fit: global batch {self.global_batch} = micro-batch {self.micro_batch} x "
            f"{self.accumulation_steps} accumulation step(s), budget {format_bytes(self.budget)}",
            "",
            f"{'micro':>6} {'steps':>6} {'predicted peak':>15} {'no-recompute':>13} {'recompute':>10} "
            f"{'time/global batch':>18}  fits",
        ]
        for c in self.candidates:
            peak = format_bytes(c.predicted_peak) if c.predicted_peak is not None else "-"
            full = format_bytes(c.no_recompute_peak) if c.no_recompute_peak is not None else "-"
            over = f"{100 * c.recompute_share:.1f}%" if c.fits else "-"
            t = f"{1e3 * c.time_per_global_batch_s:.2f} ms" if c.fits else "-"
            mark = "  <- chosen" if c.micro_batch == self.micro_batch else ""
            fits = "yes" if c.fits else "no"
            lines.append(f"{c.micro_batch:>6} {c.accumulation_steps:>6} {peak:>15} {full:>13} {over:>10} "
                         f"{t:>18}  {fits}{mark}" + (f"  ({c.note})" if c.note else ""))
        lines += ["", "times are the planner's roofline predictions (ops once + recomputation + gradient "
                      "accumulation); the optimizer step, once per global batch, is the same for every row"]
        lines += [f"note: {n}" for n in self.notes]
        lines += [f"warning: {w}" for w in self.warnings]
        return "\n".join(lines)


progress = logging.getLogger(LOGGER)


# Inputs ------------------------------------------------------------------------------------------


def _batched(sample: Any, batch: int, device: torch.device | str | None = None) -> Any:
    """`sample` (one example, no batch dimension) as a batch of `batch` copies.

    On "meta" the tensors are shapes only. Elsewhere they are real, contiguous copies (not an
    expand() view): torch.compile guards on strides, and a stride-0 batch would be compiled for a
    layout the training loop never feeds, then compiled again on the first real batch.
    """
    def one(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t  # flags, ints, None: passed through unchanged
        if device == "meta":
            return torch.empty((batch, *t.shape), dtype=t.dtype, device="meta")
        return t.unsqueeze(0).repeat(batch, *([1] * t.dim()))

    return tree_map(one, sample)


def _as_example_inputs(inputs: Any) -> Any:
    """optimize() takes a tensor, a tuple of positional arguments or a dict of keyword arguments."""
    return tuple(inputs) if isinstance(inputs, list) else inputs


# The meta twin -----------------------------------------------------------------------------------


def _meta_twin(model: torch.nn.Module) -> tuple[torch.nn.Module, dict[int, torch.Tensor]]:
    """A copy of `model` whose parameters and buffers live on the meta device.

    deepcopy() would first copy every weight on the model's own device, which a model planned
    because it barely fits cannot afford; seeding deepcopy's memo with meta tensors copies the
    module structure only. Tied weights share one id, so they stay tied.
    """
    memo: dict[int, Any] = {}
    for p in model.parameters():
        memo[id(p)] = torch.nn.Parameter(p.detach().to("meta"), requires_grad=p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = b.detach().to("meta")
    twins = dict(memo)  # deepcopy adds its own entries to memo
    meta = copy.deepcopy(model, memo)
    return meta.to("meta"), twins  # to(): any tensor the memo missed (a buffer set outside init)


def _meta_optimizer(optimizer: Any, twins: dict[int, torch.Tensor]) -> tuple[Any, str | None]:
    """An optimizer of the same class and param groups over the twin's parameters.

    The ledger sizes optimizer state per parameter it finds in the optimizer, so the real
    optimizer (which lists the real parameters) would count nothing for the twin.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        return optimizer, None  # a name or None sizes state from shapes alone
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [twins[id(p)] for p in g["params"]]}
              for g in optimizer.param_groups]
    try:
        return type(optimizer)(groups), None
    except Exception as e:  # an optimizer class whose constructor takes more than param groups
        return "adamw", (f"could not rebuild {type(optimizer).__name__} on the meta device ({e}); "
                         "candidates were sized with AdamW's state (2 fp32 moments per parameter)")


def _accumulate_time(model: torch.nn.Module, dev: DeviceSpec) -> float:
    """Roofline time of `grad += new_grad` for every trainable parameter: read two, write one."""
    return sum(dev.op_time(p.numel(), 3 * p.numel() * p.element_size(), dtype=p.dtype)
               for p in model.parameters() if p.requires_grad)


# fit ---------------------------------------------------------------------------------------------


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _batchnorm_layers(model: torch.nn.Module) -> list[str]:
    return [name or type(model).__name__ for name, m in model.named_modules()
            if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]


def fit(
    model: torch.nn.Module,
    budget: int | str,
    global_batch: int,
    sample: Any,
    *,
    optimizer: Any = "adamw",
    device: DeviceSpec | str | None = None,
    micro_batches: list[int] | None = None,
    verify: bool = True,
    options: PlanOptions | None = None,
    **optimize_kwargs: Any,
) -> FitConfig:
    """Pick the micro-batch that trains `global_batch` examples fastest within `budget`, and plan it.

    sample: the model's inputs for ONE example, without a batch dimension (what `dataset[i]`
        returns): a tensor, a tuple of positional arguments or a dict of keyword arguments. Each
        tensor gets a leading batch dimension (sizes 1..global_batch); other values pass through.
        Tensors should be on the model's device.
    optimizer: a torch.optim.Optimizer or a name, as for `optimize`: its state is in the budget.
    device: a roofline name for the predictions (default: the model's device).
    micro_batches: the sizes to consider (default: every divisor of global_batch).
    verify, options, **optimize_kwargs: as `optimize`'s (solver, time_limit, compiler, precision "fp32" or
        "bf16", world_size, sharding...): the planning options go into one `PlanOptions`, used for every
        candidate (verify only for the one real `optimize` call).

    Raises `BudgetError` (with the ledger and the smallest budget) if micro-batch 1 does not fit.
    """
    budget = parse_budget(budget)
    options, rest = split_options(options, optimize_kwargs)
    options = replace(options, verify=verify)
    if options.precision not in ("fp32", "bf16"):
        # The candidates are planned on a meta twin, where ranges and errors cannot be measured.
        raise ValueError(f"fit plans micro-batches on meta tensors, so it takes precision 'fp32' or 'bf16', got "
                         f"{options.precision!r}; for 'auto' or 'fp16', call autoremat.optimize on "
                         "the micro-batch fit chose")
    where = _model_device(model, *_split(sample))
    notes: list[str] = []
    warns: list[str] = []

    candidates = plan_candidates(model, budget, global_batch, sample, optimizer=optimizer, device=device,
                                 micro_batches=micro_batches, warns=warns, options=options, **rest)
    fitting = sorted((c for c in candidates if c.fits), key=lambda c: (c.time_per_global_batch_s, -c.micro_batch))

    # Plan the winner for real. The real step can need more than the meta plan saw: kernel scratch
    # (CPU convolutions) is measured by running kernels, which meta cannot. Then the next best
    # candidate is tried; if none fits, the smallest micro-batch's error says what would.
    errors: dict[int, BudgetError] = {}
    opt_model = None
    for chosen in fitting:
        try:
            opt_model = optimize(model, budget, example_inputs=_as_example_inputs(_batched(sample, chosen.micro_batch)),
                                 optimizer=optimizer, device=device, options=options, **rest)
            break
        except BudgetError as e:
            errors[chosen.micro_batch] = e
            chosen.fits = False
            chosen.note = f"fits on meta, but on {where} needs {format_bytes(e.smallest_budget or 0)}"
            warns.append(f"micro-batch {chosen.micro_batch} fitted when planned on meta but not on {where} "
                         f"(kernel scratch the meta trace cannot see): {str(e).splitlines()[0]}")
    if opt_model is None:
        raise errors[min(errors)]
    if chosen.predicted_peak != opt_model.plan.predicted_peak:
        # Tracing on meta can take other kernels than the real device (SDPA falls back to its math
        # path there), so the two plans may differ; the real one is what runs.
        notes.append(f"micro-batch {chosen.micro_batch} planned on {where}: predicted peak "
                     f"{format_bytes(opt_model.plan.predicted_peak)} (the meta plan predicted "
                     f"{format_bytes(chosen.predicted_peak)})")

    bn = _batchnorm_layers(model)
    if bn and chosen.accumulation_steps > 1:
        msg = (f"BatchNorm layers {bn} normalize over each micro-batch of {chosen.micro_batch}, not the global "
               f"batch of {global_batch}: their statistics (and so the gradients) differ from one step on the "
               f"whole batch. Options: GroupNorm or LayerNorm (no batch dependence), or SyncBatchNorm when the "
               f"global batch is spread across devices instead of accumulation steps.")
        warns.append(msg)
    for w in warns:
        warnings.warn(w, stacklevel=2)
    return FitConfig(chosen.micro_batch, chosen.accumulation_steps, opt_model, opt_model.plan, candidates, warns,
                     notes, budget, global_batch)


def _split(sample: Any) -> tuple[tuple, dict]:
    if isinstance(sample, dict):
        return (), sample
    return (tuple(sample) if isinstance(sample, (tuple, list)) else (sample,)), {}


def plan_candidates(
    model: torch.nn.Module,
    budget: int | str,
    global_batch: int,
    sample: Any,
    *,
    optimizer: Any = "adamw",
    device: DeviceSpec | str | None = None,
    micro_batches: list[int] | None = None,
    warns: list[str] | None = None,
    options: PlanOptions | None = None,
    **optimize_kwargs: Any,
) -> list[MicroBatchPlan]:
    """Plan each micro-batch size on a meta twin of `model`, smallest first, until one does not fit.

    Nothing runs on the model's device and no weight is copied. Sizes after the first that does not
    fit are listed unplanned: activations grow with the micro-batch, so they would not fit either.
    Raises `BudgetError` if the smallest size does not fit. Arguments are `fit`'s.
    """
    budget = parse_budget(budget)
    sizes = _check_sizes(global_batch, micro_batches)
    dev = get_device(device if device is not None else _model_device(model, *_split(sample)))
    meta, twins = _meta_twin(model)
    meta_opt, why = _meta_optimizer(optimizer, twins)
    if why and warns is not None:
        warns.append(why)
    accumulate_s = _accumulate_time(model, dev)
    options, rest = split_options(options, optimize_kwargs)
    options = replace(options, verify=False)  # a meta twin cannot run a step
    keep = {"options": options, **{k: rest[k] for k in ("world_size", "sharding") if k in rest}}
    out: list[MicroBatchPlan] = []
    with stages_on_stderr(rest.get("progress", True)):
        _plan_sizes(out, sizes, meta, budget, sample, global_batch, meta_opt, dev, accumulate_s, keep)
    return out


def _plan_sizes(out: list[MicroBatchPlan], sizes: list[int], meta: torch.nn.Module, budget: int, sample: Any,
                global_batch: int, meta_opt: Any, dev: DeviceSpec, accumulate_s: float, keep: dict) -> None:
    for i, m in enumerate(sizes):
        c = MicroBatchPlan(m, global_batch // m, fits=False, accumulate_time_s=accumulate_s)
        out.append(c)
        inputs = _as_example_inputs(_batched(sample, m, device="meta"))
        progress.info("planning micro-batch %d on the meta device (%d of %d sizes)", m, i + 1, len(sizes))
        try:
            # capture traces meta models through the real decompositions (loss backward included)
            with muted():
                om = optimize(meta, budget, example_inputs=inputs, optimizer=meta_opt, device=dev,
                              progress=False, **keep)
        except BudgetError as e:
            if i == 0:
                raise  # even the smallest micro-batch does not fit: the ledger says why
            c.smallest_budget = e.smallest_budget
            c.note = f"needs {format_bytes(e.smallest_budget)}" if e.smallest_budget else "fixed parts exceed budget"
            out += [MicroBatchPlan(n, global_batch // n, fits=False, note="not planned: a smaller one did not fit")
                    for n in sizes[i + 1:]]
            break
        plan = om.plan
        c.fits = True
        c.predicted_peak = plan.predicted_peak
        c.no_recompute_peak = Ledger.from_dict(plan.ledger).step_peak(plan.baseline_peak)
        c.step_time_s = plan.forward_time_s + plan.recompute_time_s
        c.recompute_time_s = plan.recompute_time_s


def _check_sizes(global_batch: int, micro_batches: list[int] | None) -> list[int]:
    if global_batch < 1:
        raise ValueError(f"global_batch must be >= 1, got {global_batch}")
    sizes = sorted(set(micro_batches or _divisors(global_batch)))
    if bad := [m for m in sizes if m < 1 or global_batch % m]:
        raise ValueError(f"micro-batches {bad} do not divide global_batch {global_batch}")
    return sizes
