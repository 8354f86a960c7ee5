"""Optimizers' memory: the state they keep between steps, and the temporaries of `step()` itself.

State (Adam's two moments, SGD's momentum) is resident for the whole training step and is part of
the ledger's fixed bytes. `step()` also allocates temporaries while it runs, after the backward has
freed the activations, so they compete with the activation peak rather than add to it. Per implementation
(tests/test_optimizer_step.py::test_the_ledger_predicts_what_adamw_step_allocates measures `opt.step()`
against the ledger):

| implementation | Adam / AdamW temporaries | SGD (momentum) |
|---|---|---|
| foreach (`foreach=True`; the default when every parameter is on CUDA) | one full parameter-sized set: the list of sqrt(v) | none |
| for-loop (`foreach=False`; the default on CPU) | per parameter, sqrt(v) and its quotient, while the previous parameter's denominator is still referenced: max over i of 2 s_i + s_(i-1) | none |
| fused (`fused=True`) | none | none |

For an optimizer class not in this table the temporaries are taken to be one parameter-sized set
(what a foreach implementation of any elementwise rule allocates), and a ledger note says so.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from autoremat.units import round_up, storage_key

# Bytes of state per parameter element for optimizers given by name. Names describe
# a mixed-precision recipe, where moments live in fp32 whatever the parameter dtype.
_NAMED_BYTES_PER_ELEMENT = {
    "none": 0.0,
    "sgd": 0.0,
    "sgd_momentum": 4.0,
    "momentum": 4.0,
    "lion": 4.0,  # one fp32 momentum
    "adam": 8.0,
    "adamw": 8.0,
    "adafactor": 4.0,  # only for 1-D params; matrices are factored (see below)
    "adam8bit": 2.0,  # one byte per moment, plus blockwise scales (see below)
    "adamw8bit": 2.0,
}
OPTIMIZER_NAMES = tuple(_NAMED_BYTES_PER_ELEMENT)

# 8-bit Adam (bitsandbytes) quantizes each moment in blocks of 2048 elements with one
# fp32 absmax scale per block.
_BLOCK_8BIT = 2048

# Without shapes (ledger_for_count) Adafactor's factored moment is estimated as if
# every parameter sat in matrices whose smaller side is 1024. Real transformers have
# hidden sizes >= 1024, so this over- rather than under-estimates a negligible term.
ADAFACTOR_ASSUMED_SIDE = 1024

def _class_state_numels(
    optimizer: torch.optim.Optimizer, group: dict, shape: torch.Size
) -> list[int] | None:
    """Element counts of the state tensors a torch optimizer creates for one parameter.

    Mirrors each optimizer's lazy state initialization. The per-parameter `step`
    counters (and NAdam's mu_product, ASGD's eta/mu) are 0-d tensors, normally kept
    on the CPU; they are ignored here and in the measured state alike. Returns None for
    an optimizer class this table does not know.
    """
    n = shape.numel()
    o = torch.optim
    if isinstance(optimizer, (o.Adam, o.AdamW)):
        return [n] * (3 if group.get("amsgrad") else 2)
    if isinstance(optimizer, o.SGD):
        return [n] if group.get("momentum", 0) != 0 else []
    if isinstance(optimizer, o.RMSprop):
        return [n] * (1 + (group.get("momentum", 0) > 0) + bool(group.get("centered")))
    if isinstance(optimizer, o.Adafactor):
        if len(shape) < 2:
            return [n]
        # Row factor is shape with the last dim reduced; column factor with dim -2 reduced.
        return [math.prod(shape[:-1]), math.prod(shape[:-2]) * shape[-1]]
    if isinstance(optimizer, (o.Adamax, o.NAdam, o.RAdam, o.Adadelta, o.Rprop, o.SparseAdam)):
        return [n, n]
    if isinstance(optimizer, (o.Adagrad, o.ASGD)):
        return [n]
    if hasattr(o, "Muon") and isinstance(optimizer, o.Muon):
        return [n]
    return None


def _measured_state_bytes(state: dict, p: torch.Tensor, seen: set, granularity: int) -> int:
    total = 0
    for t in state.values():
        # 0-d step counters are ignored (see _class_state_numels); state offloaded to
        # another device does not occupy this one.
        if not isinstance(t, torch.Tensor) or t.dim() == 0 or t.device != p.device:
            continue
        key, nbytes = storage_key(t)
        if key not in seen:
            seen.add(key)
            total += round_up(nbytes, granularity)
    return total


def named_state_bytes(name: str, shape: tuple[int, ...], granularity: int) -> int:
    n = math.prod(shape)
    if name == "adafactor" and len(shape) >= 2:
        rows, cols = math.prod(shape[:-1]), math.prod(shape[:-2]) * shape[-1]
        return round_up(rows * 4, granularity) + round_up(cols * 4, granularity)
    if name in ("adam8bit", "adamw8bit"):
        scales = -(-n // _BLOCK_8BIT) * 4
        return 2 * (round_up(n, granularity) + round_up(scales, granularity))
    per_element = _NAMED_BYTES_PER_ELEMENT[name]
    if per_element == 0:
        return 0
    # Each state tensor is its own allocation: round per 4-byte moment.
    return int(per_element // 4) * round_up(n * 4, granularity)


def check_name(optimizer: str | None) -> str:
    name = "none" if optimizer is None else optimizer.lower()
    if name not in _NAMED_BYTES_PER_ELEMENT:
        raise ValueError(f"unknown optimizer {optimizer!r}; known names: {list(OPTIMIZER_NAMES)}")
    return name


def optimizer_state_bytes(
    optimizer: torch.optim.Optimizer | str | None,
    params: Iterable[torch.Tensor | tuple[int, ...]],
    *,
    dtype: torch.dtype | None = None,
    granularity: int = 1,
    notes: list[str] | None = None,
) -> int:
    """Bytes of optimizer state held for `params`.

    `optimizer` is a torch.optim.Optimizer, a name from OPTIMIZER_NAMES, or None. For a
    real optimizer, state that already exists is measured (each storage once) and the
    rest is inferred from its class and param-group settings, in the parameter dtype
    (or `dtype`, when the model is going to be cast). For a name, `params` may also
    be shapes. Assumptions worth reporting are appended to `notes`.
    """
    params = list(params)
    if not isinstance(optimizer, torch.optim.Optimizer):
        name = check_name(optimizer)
        shapes = [tuple(p.shape) if isinstance(p, torch.Tensor) else tuple(p) for p in params]
        return sum(named_state_bytes(name, shape, granularity) for shape in shapes)

    wanted = {id(p) for p in params}
    seen: set = set()
    total = 0
    unknown = False
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in wanted:
                continue
            wanted.discard(id(p))  # a parameter listed twice still has one state
            state = optimizer.state.get(p)
            if state:
                total += _measured_state_bytes(state, p, seen, granularity)
                continue
            numels = _class_state_numels(optimizer, group, p.shape)
            if numels is None:
                unknown = True
                numels = [p.numel()] * 2
            itemsize = (dtype or p.dtype).itemsize
            total += sum(round_up(n * itemsize, granularity) for n in numels)
    if unknown and notes is not None:
        notes.append(
            f"optimizer {type(optimizer).__name__} is not known: assumed 2 state tensors "
            "per parameter, like Adam"
        )
    return total


_ADAM_FAMILY = (torch.optim.Adam, torch.optim.AdamW)
_NO_TEMPORARIES = (torch.optim.SGD,)


def optimizer_step_bytes(
    optimizer: torch.optim.Optimizer | str | None,
    params: Iterable[torch.Tensor],
    *,
    dtype: torch.dtype | None = None,
    granularity: int = 1,
    notes: list[str] | None = None,
) -> int:
    """Bytes `optimizer.step()` allocates while it runs, for `params` (see the module docstring).

    A name ("adamw") stands for torch's class with its defaults: foreach when every parameter is
    on CUDA, the for-loop otherwise.
    """
    params = [p for p in params if p.requires_grad]
    if not params:
        return 0
    sizes = [round_up(p.numel() * (dtype or p.dtype).itemsize, granularity) for p in params]
    on_cuda = all(p.device.type == "cuda" for p in params)
    if not isinstance(optimizer, torch.optim.Optimizer):
        name = check_name(optimizer)
        if name in ("none", "sgd", "sgd_momentum", "momentum"):
            return 0
        if name in ("adam", "adamw"):
            return sum(sizes) if on_cuda else _for_loop(sizes)
        if notes is not None:
            notes.append(f"optimizer {name!r}: step() temporaries taken as one parameter-sized set")
        return sum(sizes)
    if isinstance(optimizer, _NO_TEMPORARIES):
        return 0
    fused, foreach, for_loop = [], [], []
    for group in optimizer.param_groups:
        members = {id(q) for q in group["params"]}
        mine = [s for p, s in zip(params, sizes) if id(p) in members]
        if group.get("fused"):
            fused += mine
        elif group.get("foreach") or (group.get("foreach") is None and on_cuda):
            foreach += mine
        else:
            for_loop += mine
    if not isinstance(optimizer, _ADAM_FAMILY):
        if notes is not None:
            notes.append(f"optimizer {type(optimizer).__name__}: step() temporaries not measured; taken as one "
                         "parameter-sized set")
        return sum(foreach + for_loop + fused)
    # Param groups step one after another: their temporaries do not add up.
    return max(sum(foreach), _for_loop(for_loop))


def _for_loop(sizes: list[int]) -> int:
    return max((2 * s + (sizes[i - 1] if i else 0) for i, s in enumerate(sizes)), default=0)
