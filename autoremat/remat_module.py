"""What `autoremat.optimize` returns: `RematModule`, the model run with its plan, one plan per input shape.

A call with inputs of a shape not planned before runs the whole pipeline again (`plan_shape`, given
by `api.optimize`) under the same budget; `input_key` says what counts as a new shape.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import torch

from autoremat.planning.gc_set_aside import older_objects_set_aside
from autoremat.planning.plan import Plan
from autoremat.planning.planned_step import PlannedStep
from autoremat.planning.planner import CapturePlanner, describe, own_errors
from autoremat.progress import pulse, stages_on_stderr
from autoremat.torch_internals import recompile_limit, tree_flatten
from autoremat.units import format_bytes

log = logging.getLogger("autoremat")


class RematModule(torch.nn.Module):
    """`model` compiled with its plan. Parameters, buffers and state_dict are the model's own (the
    state_dict's keys too: no "model." prefix, so a checkpoint of either loads into the other).

    Plans are per input shape: a call with inputs of a shape (or dtype, or training mode) not seen
    before goes through the whole pipeline again for that shape (trace, plan every graph jointly,
    verify on one real step) before it runs, so a smaller last batch is held to the budget too.
    `plans` lists them; `plan` is the one made for the example inputs.

    It stands in for the model where libraries expect one (HF `Trainer`): a public attribute it does
    not have itself is the model's (`config`, `save_pretrained`, `generate`, `main_input_name`, ...),
    and `forward`'s signature is the model's (Trainer keeps the dataset columns it names). Generation
    runs the model itself: without a backward there is nothing to plan. Turning on HF gradient
    checkpointing is refused: the plan already chooses what to recompute.
    """

    def __init__(self, model: torch.nn.Module, planned: PlannedStep, key: tuple,
                 plan_shape: Callable[[tuple, dict], PlannedStep], progress: bool = True) -> None:
        super().__init__()
        self._progress = progress
        self.model = model
        self.plan = planned.plan  # the example inputs' plan
        self._planner = planned.applier
        self._plan_shape = plan_shape  # the whole pipeline for another input shape
        self._shapes: dict[tuple, PlannedStep] = {key: planned}  # each finished (PlannedStep.finished)
        self.register_state_dict_post_hook(_without_model_prefix)
        self.register_load_state_dict_pre_hook(_with_model_prefix)
        planned = self._planned_forward

        @functools.wraps(model.forward)  # inspect.signature(self.forward) is the model's
        def forward(*args: Any, **kwargs: Any) -> Any:
            return planned(*args, **kwargs)

        self.forward = forward

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)  # parameters, buffers, submodules (self.model)
        except AttributeError:
            if name.startswith("_"):
                raise
        model = self.__dict__["_modules"].get("model")
        if model is None:  # still being built
            raise AttributeError(f"'RematModule' object has no attribute {name!r}")
        try:
            return getattr(model, name)
        except AttributeError:
            raise AttributeError(f"'RematModule' object has no attribute {name!r}, nor has the "
                                 f"{type(model).__name__} it wraps") from None

    def _refuse_checkpointing(self, name: str) -> None:
        raise RuntimeError(
            f"{name}: autoremat already plans recomputation for this module ({100 * self.plan.overhead:.1f}% "
            f"predicted recompute under a {format_bytes(self.plan.budget)} budget); HF checkpointing on top would "
            f"recompute again and change the step the plan was made for. Leave it off (the Trainer's "
            f"activation_checkpointing / gradient_checkpointing arguments default to False).")

    def gradient_checkpointing_enable(self, *args: Any, **kwargs: Any) -> None:
        self._refuse_checkpointing("gradient_checkpointing_enable")

    def activation_checkpointing_enable(self, *args: Any, **kwargs: Any) -> None:
        self._refuse_checkpointing("activation_checkpointing_enable")

    def gradient_checkpointing_disable(self) -> None:
        """Nothing to do unless the model was planned with HF checkpointing on; then refused."""
        flag = "is_activation_checkpointing" if hasattr(type(self.model), "is_activation_checkpointing") \
            else "is_gradient_checkpointing"  # transformers 5 renamed it
        if getattr(self.model, flag, False):
            raise RuntimeError("gradient_checkpointing_disable: the plan was made with the model's own gradient "
                               "checkpointing on; turning it off changes the step. Call it on the model, then "
                               "autoremat.optimize again.")

    activation_checkpointing_disable = gradient_checkpointing_disable

    @property
    def num_graphs(self) -> int:
        return len(self.plan.graphs)

    @property
    def plans(self) -> list[Plan]:
        """One plan per input shape planned so far, the example inputs' first."""
        return [planned.plan for planned in self._shapes.values()]

    @property
    def _planners(self) -> list[CapturePlanner]:
        return [planned.applier for planned in self._shapes.values()]

    def _planned_forward(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return self.model(*args, **kwargs)  # no backward, nothing to plan: run eagerly
        key = input_key(self.model, args, kwargs)
        if key not in self._shapes:
            self._shapes[key] = self._new_shape(args, kwargs)
        with own_errors():
            return self._shapes[key].compiled(*args, **kwargs)

    def _new_shape(self, args: tuple, kwargs: dict) -> PlannedStep:
        limit = recompile_limit()
        if len(self._shapes) == limit:
            log.warning("autoremat: %d input shapes planned so far; each new one is traced, planned and verified "
                        "afresh (seconds each). Pad inputs to a few fixed shapes (bucketing) to avoid it.", limit)
        log.warning("autoremat: new input shape (%s): planning it under the same budget", describe(args, kwargs))
        with own_errors(), stages_on_stderr(self._progress), pulse(), older_objects_set_aside():
            planned = self._plan_shape(args, kwargs).finished()
        planned.plan.notes.append(f"planned for a new input shape: {describe(args, kwargs)}")
        return planned


def _without_model_prefix(module: torch.nn.Module, state_dict: dict, prefix: str, local_metadata: Any) -> None:
    inner = prefix + "model."
    for key in [k for k in state_dict if k.startswith(inner)]:
        state_dict[prefix + key[len(inner):]] = state_dict.pop(key)


def _with_model_prefix(module: torch.nn.Module, state_dict: dict, prefix: str, *rest: Any) -> None:
    for key in [k for k in state_dict if k.startswith(prefix)]:
        state_dict[prefix + "model." + key[len(prefix):]] = state_dict.pop(key)


def input_key(model: torch.nn.Module, args: tuple, kwargs: dict) -> tuple:
    """What a plan depends on besides the model: input shapes, dtypes, devices, non-tensor values,
    and training mode (dropout and BatchNorm trace differently in eval)."""
    if all(map(_unnested, args)) and all(map(_unnested, kwargs.values())):
        # Tensors and scalars only: their positions and keyword names are the whole structure. Said here
        # without a pytree flatten, whose cost per call a launch-bound step would feel
        # (benchmarks/fx_overhead.py times such steps).
        return ("flat", len(args), tuple(kwargs), model.training, *map(_leaf_key, args),
                *map(_leaf_key, kwargs.values()))
    leaves, spec = tree_flatten((args, kwargs))
    return (str(spec), model.training, *map(_leaf_key, leaves))


def _unnested(a: Any) -> bool:
    return a is None or isinstance(a, (torch.Tensor, bool, int, float, str))


def _leaf_key(a: Any) -> Any:
    if isinstance(a, torch.Tensor):
        return ("tensor", tuple(a.shape), a.dtype, a.device, a.requires_grad)
    try:
        hash(a)
    except TypeError:
        return ("object", type(a).__name__)
    return ("value", a)
