"""The PyTorch Lightning face: a callback that plans the module `training_step` calls, on the first batch.

    trainer = lightning.Trainer(callbacks=[autoremat.lightning.Budget("20GB")], ...)
    trainer.fit(lit_module)          # lit_module.model is planned at its first training call

On the first training batch, `Budget` hooks the designated submodule (`module="model"`: the one whose
forward `training_step` calls). Its first call with gradients enabled hands the very arguments
`training_step` passed to `autoremat.optimize`, together with the optimizer Lightning built (so the
ledger counts its state), and puts the returned `RematModule` in the submodule's place: the user's
`training_step` runs the plan unchanged, and the parameters are the same objects, so the optimizer,
checkpoints (`RematModule`'s state_dict keys are the model's) and validation (`no_grad`: the model runs
eagerly) see no difference. At `teardown` the plain module is put back; `callback.planned` keeps the
planned one and `callback.plan` its plan.

The budget is the whole step's. What the step holds outside the submodule, and autoremat therefore
does not plan, is reserved from it before planning: parameters of the LightningModule outside the
submodule with their gradients and optimizer state, the batch tensors the submodule is not given, and
`reserve=` (what `training_step` computes outside the submodule, e.g. a loss over its output).

Refused, each with a one-line reason and what would work: a Trainer precision other than 32-true
(autoremat chooses the dtypes: `precision="bf16"` here), a strategy other than one device, more than
one optimizer, a submodule already planned or compiled, a module name the LightningModule lacks.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.strategies import SingleDeviceStrategy
from lightning.pytorch.utilities import rank_zero_info

from autoremat.api import optimize
from autoremat.measure import live_tensor_bytes
from autoremat.model.devices import get_device
from autoremat.model.ledger import ledger_for_model
from autoremat.planning.options import PlanOptions, split_options
from autoremat.planning.plan import BudgetError, Plan
from autoremat.remat_module import RematModule
from autoremat.units import format_bytes, parse_budget

log = logging.getLogger("autoremat")

# optimize's arguments the callback supplies itself; world_size/sharding belong to multi-device strategies
_SUPPLIED = {"model", "budget", "example_inputs", "optimizer", "world_size", "sharding"}
_OPTIONS = [n for n in inspect.signature(optimize).parameters if n not in _SUPPLIED | {"options"}]
# Lightning's 32-true runs no GradScaler: an fp16 plan ("fp16", or "auto" choosing fp16) would need one
_PRECISIONS = ("fp32", "bf16")
_FULL_PRECISION = ("32-true", "32", 32)

ModuleSpec = str | Callable[[LightningModule], torch.nn.Module]


class Budget(Callback):
    """Plan the submodule `training_step` calls so that the whole training step fits `budget`.

    budget: bytes for the step on the device ("20GB", "512MiB" or an int), as `autoremat.optimize`'s.
    module: the dotted name of the submodule whose forward `training_step` calls ("model", "net.backbone"),
        or a function from the LightningModule to that submodule.
    reserve: bytes to hold back for what `training_step` allocates outside the submodule (a loss over its
        output, a metric); the submodule's own step is planned within the rest.
    options, **keywords: the planning options as one `autoremat.PlanOptions`, or as `autoremat.optimize`'s
        keywords (compiler="eager", precision="bf16", outputs="loss", verify, ...), and its other keywords
        (device, cache, progress).
    """

    def __init__(self, budget: int | str, *, module: ModuleSpec = "model", reserve: int | str = 0,
                 options: PlanOptions | None = None, **keywords: Any) -> None:
        self.budget = parse_budget(budget)
        self.reserve = 0 if reserve == 0 else parse_budget(reserve)
        unknown = sorted(set(keywords) - set(_OPTIONS))
        if unknown:
            raise TypeError(f"Budget: unknown option(s) {', '.join(unknown)}; autoremat.optimize's options are "
                            f"{', '.join(_OPTIONS)} (the model, inputs and optimizer come from the Trainer)")
        plan_options, rest = split_options(options, keywords)
        plan_options.check()
        if plan_options.precision not in _PRECISIONS:
            raise ValueError(f"Budget(precision={plan_options.precision!r}): under Lightning's 32-true precision "
                             f"no GradScaler runs, which fp16 calls need; use one of {', '.join(_PRECISIONS)}")
        if not (isinstance(module, str) or callable(module)):
            raise TypeError(f"Budget(module={module!r}): give the submodule's dotted name (e.g. 'model') or a "
                            "function from the LightningModule to the submodule")
        self.target = module
        self.options = plan_options
        self.keywords = rest  # optimize's keywords that are not planning options (device, cache, progress)
        self.plan: Plan | None = None  # the plan of the last fit's first training call
        self.planned: RematModule | None = None  # ... and the module that ran it
        self.reserved = 0  # bytes the last plan left to what runs outside the submodule
        self._site: tuple[torch.nn.Module, str, torch.nn.Module] | None = None  # parent, name, plain module
        self._optimizer: torch.optim.Optimizer | None = None
        self._batch: Any = None

    # -- Lightning hooks -------------------------------------------------------------------------------

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Everything that can be refused is refused here, before a batch is drawn."""
        _check_trainer(trainer)
        parent, name, sub = _resolve(pl_module, self.target)
        self._optimizer = _optimizer_for(trainer.optimizers, sub)
        self._site = (parent, name, sub)

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if self._site is None or self._planning_pending() or self._is_planned():
            return
        self._batch = batch  # for the bytes of the batch the submodule is not given
        self._hook_first_call(pl_module)

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self._planning_pending():  # a budget silently not held would be worse than stopping
            name = self._site[1]  # type: ignore[misc]
            self._restore()
            raise ValueError(f"Budget(module={name!r}): training_step did not call it with gradients enabled on "
                             f"the first batch, so nothing was planned; name the submodule whose forward it calls "
                             f"(children of {type(pl_module).__name__}: {_children(pl_module)})")

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._restore()

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._restore()

    # -- planning ------------------------------------------------------------------------------------

    def _planning_pending(self) -> bool:
        return self._site is not None and "forward" in vars(self._site[2])

    def _is_planned(self) -> bool:
        parent, name, _ = self._site  # type: ignore[misc]
        return isinstance(getattr(parent, name), RematModule)

    def _hook_first_call(self, pl_module: LightningModule) -> None:
        """The submodule's next call with gradients enabled plans it: the arguments `training_step` passes
        are then known exactly (after whatever it does to the batch), which no guess from the batch is."""
        parent, name, sub = self._site  # type: ignore[misc]
        plain_forward = sub.forward

        def forward(*args: Any, **kwargs: Any) -> Any:
            if not torch.is_grad_enabled():  # validation or a no_grad probe: nothing to plan for
                return plain_forward(*args, **kwargs)
            del sub.forward  # the instance hook: optimize traces the module's own forward
            planned = self._plan(pl_module, sub, args, kwargs)
            setattr(parent, name, planned)
            return planned(*args, **kwargs)

        sub.forward = forward

    def _plan(self, pl_module: LightningModule, sub: torch.nn.Module, args: tuple, kwargs: dict) -> RematModule:
        example, keywords = _example_inputs(sub, args, kwargs)
        where = next((p.device for p in sub.parameters()), torch.device("cpu"))
        granularity = get_device(self.keywords.get("device") or where).alloc_granularity
        self.reserved = self.reserve + _outside_bytes(pl_module, sub, self._optimizer, (self._batch, args, kwargs),
                                                      granularity)
        self._batch = None
        given = self.budget - self.reserved
        what = self._reserved_words()
        if given <= 0:
            raise BudgetError(f"Budget({format_bytes(self.budget)}): {what} leave nothing for the submodule "
                              f"{self._name()!r}; a budget above {format_bytes(self.reserved)} is needed", None, None)
        try:
            planned = optimize(sub, given, example, optimizer=self._optimizer, options=self.options, **self.keywords)
        except BudgetError as e:
            if not self.reserved:
                raise
            smallest = None if e.smallest_budget is None else e.smallest_budget + self.reserved
            fits = "" if smallest is None else f"; Budget({format_bytes(smallest)}) fits"
            head, _, rest = str(e).partition("\n")
            raise BudgetError(f"Budget({format_bytes(self.budget)}) leaves the submodule {self._name()!r} "
                              f"{format_bytes(given)} after {what}{fits}. For the submodule: {head}\n{rest}",
                              e.ledger, smallest) from None
        if keywords is not None:
            _call_by_keyword(planned, keywords)
        self.planned, self.plan = planned, planned.plan
        head = "\n".join(planned.plan.summary().splitlines()[:4])
        rank_zero_info(f"autoremat.lightning: planned {self._name()!r} on the first training batch\n{head}"
                       + (f"\nreserved from the budget: {what}" if self.reserved else ""))
        return planned

    def _reserved_words(self) -> str:
        outside = self.reserved - self.reserve
        parts = [f"{format_bytes(outside)} held outside the submodule (parameters, gradients, optimizer state, "
                 "batch)"]
        if self.reserve:
            parts.append(f"reserve={format_bytes(self.reserve)}")
        return " and ".join(parts)

    def _name(self) -> str:
        return self._site[1] if self._site is not None else str(self.target)

    def _restore(self) -> None:
        """Put the plain module back (a second fit plans again, with that fit's optimizer and batch)."""
        if self._site is None:
            return
        parent, name, sub = self._site
        vars(sub).pop("forward", None)
        setattr(parent, name, sub)
        self._site, self._batch = None, None


def _check_trainer(trainer: Trainer) -> None:
    if trainer.precision not in _FULL_PRECISION:
        raise ValueError(f"Trainer(precision={trainer.precision!r}): autoremat.lightning.Budget plans the step's "
                         "dtypes itself; use Trainer(precision='32-true') with Budget(..., precision='bf16') for "
                         "bf16 matmuls (Lightning's autocast around the planned graphs is not what was planned)")
    if not isinstance(trainer.strategy, SingleDeviceStrategy):
        raise ValueError(f"Trainer strategy {type(trainer.strategy).__name__}: autoremat.lightning.Budget plans "
                         "a one-device step (strategy='auto' with devices=1); for DDP or FSDP call "
                         "autoremat.optimize with world_size= and sharding= (docs/distributed.md)")


def _resolve(pl_module: LightningModule, target: ModuleSpec) -> tuple[torch.nn.Module, str, torch.nn.Module]:
    """(parent, attribute name, module) of the submodule to plan, or a one-line error naming the choices."""
    children = _children(pl_module)
    if callable(target):
        sub = target(pl_module)
        path = next((n for n, m in pl_module.named_modules() if m is sub and n), None)
        if path is None:
            raise ValueError(f"Budget(module=...): the function returned a {type(sub).__name__} that is not a "
                             f"submodule of {type(pl_module).__name__}; its child modules are {children}")
    else:
        path = target
        try:
            sub = pl_module.get_submodule(path) if path else pl_module
        except AttributeError:
            raise ValueError(f"Budget(module={path!r}): {type(pl_module).__name__} has no such submodule; its "
                             f"child modules are {children} (name the one training_step calls)") from None
        if sub is pl_module:
            raise ValueError(f"Budget(module={path!r}): the LightningModule itself cannot be replaced; name the "
                             f"submodule training_step calls, one of {children}")
    if isinstance(sub, RematModule):
        raise ValueError(f"Budget(module={path!r}): it is already a RematModule (planned by autoremat.optimize); "
                         "pass the plain module, or drop the callback")
    if getattr(sub, "_orig_mod", None) is not None:  # torch.compile's wrapper
        raise ValueError(f"Budget(module={path!r}): it is torch.compile'd; autoremat compiles the planned step "
                         "itself: pass the uncompiled module")
    parent_path, _, name = path.rpartition(".")
    return pl_module.get_submodule(parent_path), name, sub


def _children(pl_module: LightningModule) -> str:
    return ", ".join(repr(n) for n, _ in pl_module.named_children()) or "none"


def _optimizer_for(optimizers: list[torch.optim.Optimizer], sub: torch.nn.Module) -> torch.optim.Optimizer | None:
    if len(optimizers) > 1:
        raise ValueError(f"configure_optimizers returned {len(optimizers)} optimizers: autoremat.lightning.Budget "
                         "plans one optimizer's step; return one optimizer (param groups may differ), or plan each "
                         "network with autoremat.optimize")
    if not optimizers:  # Lightning trains without one (with a warning): no optimizer state to count
        return None
    return optimizers[0]


def _outside_bytes(pl_module: LightningModule, sub: torch.nn.Module, optimizer: Any, given: tuple,
                   granularity: int) -> int:
    """Bytes the step holds that the submodule's plan does not see: the LightningModule's other parameters,
    buffers, gradients and optimizer state, the larger optimizer.step() over all of them, and the batch
    tensors not passed to the submodule (`given` = (batch, args, kwargs))."""
    whole = ledger_for_model(pl_module, optimizer, device_granularity=granularity)
    own = ledger_for_model(sub, optimizer, device_granularity=granularity)
    step = max(0, whole.optimizer_step - own.optimizer_step)
    batch, args, kwargs = given
    rest_of_batch = live_tensor_bytes(batch, args, kwargs) - live_tensor_bytes(args, kwargs)
    return whole.fixed - own.fixed + step + rest_of_batch


def _example_inputs(sub: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[Any, inspect.Signature | None]:
    """optimize's example_inputs for a call: the positional tuple, the keyword dict, or for a call with both
    the arguments bound by name (returned with the signature, so later calls are bound the same way)."""
    if not kwargs:
        return tuple(args), None
    if not args:
        return dict(kwargs), None
    sig = inspect.signature(sub.forward)
    return _bound(sig, args, kwargs), sig


def _bound(sig: inspect.Signature, args: tuple, kwargs: dict) -> dict:
    bound = sig.bind(*args, **kwargs)
    named: dict = {}
    for name, value in bound.arguments.items():
        kind = sig.parameters[name].kind
        if kind is inspect.Parameter.VAR_POSITIONAL:
            raise ValueError(f"the submodule's forward{sig} was called with *{name}: positional arguments beyond "
                             "its named ones cannot be planned with keyword arguments; pass them by name")
        if kind is inspect.Parameter.VAR_KEYWORD:
            named.update(value)
        else:
            named[name] = value
    return named


def _call_by_keyword(planned: RematModule, sig: inspect.Signature) -> None:
    """The plan is keyed by how it is called: a call mixing positional and keyword arguments was planned by
    keyword, so every later call is bound the same way (else each would count as a new input shape)."""
    run = planned.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        return run(**_bound(sig, args, kwargs))

    planned.forward = forward
