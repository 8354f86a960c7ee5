"""The fixed part of a training step's memory: everything that is not activations.

Parameters, gradients, optimizer state, fp32 master weights and the input batch stay
resident through the whole step, so the planner subtracts them from the budget before
it decides what activations to keep. Figures are per rank once sharding is applied.
"""

import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field

import torch

from autoremat.units import format_bytes

SHARDINGS = ("none", "zero1", "zero2", "zero3", "fsdp")

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
_ADAFACTOR_ASSUMED_SIDE = 1024

_DTYPES = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
}


@dataclass
class Ledger:
    parameters: int
    gradients: int
    optimizer_state: int
    master_weights: int = 0
    inputs: int = 0
    gathered: int = 0  # FSDP/ZeRO-3: one block's unsharded parameters (+ the prefetched next) and gradients
    activations: int = 0  # filled by the planner: peak activation + temporary bytes
    budget: int | None = None
    world_size: int = 1
    sharding: str = "none"
    notes: list[str] = field(default_factory=list)

    @property
    def fixed(self) -> int:
        states = self.gradients + self.optimizer_state + self.master_weights
        return self.parameters + states + self.inputs + self.gathered

    @property
    def total(self) -> int:
        return self.fixed + self.activations

    @property
    def headroom(self) -> int | None:
        return None if self.budget is None else self.budget - self.total

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Ledger":
        d = dict(d)
        d["notes"] = list(d.get("notes", []))
        return cls(**d)

    def format(self) -> str:
        rows = [
            ("parameters", self.parameters),
            ("gradients", self.gradients),
            ("optimizer state", self.optimizer_state),
        ]
        if self.master_weights:
            rows.append(("master weights", self.master_weights))
        if self.gathered:
            rows.append(("gathered block (fsdp)", self.gathered))
        rows += [
            ("inputs", self.inputs),
            ("activations + temporaries", self.activations),
            ("total", self.total),
        ]
        if self.budget is not None:
            rows += [("budget", self.budget), ("headroom", self.headroom)]
        width = max(len(label) for label, _ in rows) + 2
        lines = []
        if self.world_size > 1 or self.sharding != "none":
            lines.append(f"per rank, {self.sharding} sharding over {self.world_size} rank(s)")
        for label, n in rows:
            lines.append(f"{label:<{width}}{format_bytes(n, si=True):>10}   ({format_bytes(n)})")
        if self.budget is None:
            lines.append(f"{'budget':<{width}}{'none':>10}")
        lines += [f"note: {note}" for note in self.notes]
        return "\n".join(lines)


def _round_up(n: int, granularity: int) -> int:
    return -(-n // granularity) * granularity


def _storage(t: torch.Tensor) -> tuple[int, int]:
    """(identity, bytes) of the storage behind `t`.

    The StorageImpl address identifies a storage even on the meta device, where every
    data_ptr() is 0; views and tied weights share it. Tensor subclasses without a
    plain storage count as their own allocation.
    """
    try:
        storage = t.untyped_storage()
        return storage._cdata, storage.nbytes()
    except (RuntimeError, NotImplementedError, TypeError):
        return id(t), t.numel() * t.element_size()


def _unique_storage_bytes(
    tensors: Iterable[torch.Tensor], granularity: int, dtype: torch.dtype | None = None
) -> int:
    """Bytes of the storages behind `tensors`, each counted once and rounded up.

    With `dtype`, floating-point storages are counted as if cast to it (what
    model.to(dtype) does to parameters and buffers).
    """
    seen, total = set(), 0
    for t in tensors:
        key, nbytes = _storage(t)
        if key in seen:
            continue
        seen.add(key)
        if dtype is not None and t.is_floating_point():
            nbytes = nbytes // t.element_size() * dtype.itemsize
        total += _round_up(nbytes, granularity)
    return total


def _flatten_tensors(obj: object) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        obj = list(obj.values())
    if isinstance(obj, (list, tuple)):
        return [t for item in obj for t in _flatten_tensors(item)]
    return []


def _resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {list(_DTYPES)} or a torch.dtype")
    return _DTYPES[dtype]


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
        key, nbytes = _storage(t)
        if key not in seen:
            seen.add(key)
            total += _round_up(nbytes, granularity)
    return total


def _named_state_bytes(name: str, shape: tuple[int, ...], granularity: int) -> int:
    n = math.prod(shape)
    if name == "adafactor" and len(shape) >= 2:
        rows, cols = math.prod(shape[:-1]), math.prod(shape[:-2]) * shape[-1]
        return _round_up(rows * 4, granularity) + _round_up(cols * 4, granularity)
    if name in ("adam8bit", "adamw8bit"):
        scales = -(-n // _BLOCK_8BIT) * 4
        return 2 * (_round_up(n, granularity) + _round_up(scales, granularity))
    per_element = _NAMED_BYTES_PER_ELEMENT[name]
    if per_element == 0:
        return 0
    # Each state tensor is its own allocation: round per 4-byte moment.
    return int(per_element // 4) * _round_up(n * 4, granularity)


def _check_name(optimizer: str | None) -> str:
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
        name = _check_name(optimizer)
        shapes = [tuple(p.shape) if isinstance(p, torch.Tensor) else tuple(p) for p in params]
        return sum(_named_state_bytes(name, shape, granularity) for shape in shapes)

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
            total += sum(_round_up(n * itemsize, granularity) for n in numels)
    if unknown and notes is not None:
        notes.append(
            f"optimizer {type(optimizer).__name__} is not known: assumed 2 state tensors "
            "per parameter, like Adam"
        )
    return total


def _shard(ledger: Ledger) -> Ledger:
    """Divide the sharded parts of a replicated ledger by world_size (ceil)."""
    n, mode = ledger.world_size, ledger.sharding
    if mode == "none" or n == 1:
        return ledger
    ledger.optimizer_state = -(-ledger.optimizer_state // n)
    ledger.master_weights = -(-ledger.master_weights // n)
    if mode in ("zero2", "zero3", "fsdp"):
        ledger.gradients = -(-ledger.gradients // n)
    if mode in ("zero3", "fsdp"):
        ledger.parameters = -(-ledger.parameters // n)
    return ledger


def _check_sharding(world_size: int, sharding: str) -> str:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1; got {world_size!r}")
    mode = sharding.lower()
    if mode not in SHARDINGS:
        raise ValueError(f"unknown sharding {sharding!r}; options: {list(SHARDINGS)}")
    return mode


def _wants_master(master_weights: bool | None, optimizer: object, dtype: torch.dtype) -> bool:
    if master_weights is not None:
        return master_weights
    # A named optimizer stands for a mixed-precision recipe that updates an fp32 copy of
    # 16-bit weights. A real torch optimizer updates the parameters in place in their
    # own dtype, so it implies no copy.
    named = isinstance(optimizer, str) and optimizer.lower() != "none"
    return named and dtype.itemsize == 2


def ledger_for_model(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | str | None = None,
    *,
    inputs: object = (),
    param_dtype: torch.dtype | None = None,
    master_weights: bool | None = None,
    world_size: int = 1,
    sharding: str = "none",
    device_granularity: int = 1,
) -> Ledger:
    """Fixed memory of one training step of `model`, per rank.

    `param_dtype` counts floating parameters and buffers as if cast to it. Every
    allocation is rounded up to `device_granularity` (512 for CUDA).
    """
    mode = _check_sharding(world_size, sharding)
    if isinstance(optimizer, str):
        _check_name(optimizer)
    g = device_granularity
    params = list(model.parameters())  # already deduplicated: tied weights once
    trainable = [p for p in params if p.requires_grad]
    notes: list[str] = []

    parameters = _unique_storage_bytes([*params, *model.buffers()], g, param_dtype)
    # Each trainable Parameter gets its own .grad, even if it is a view of shared storage.
    gradients = sum(_round_up(p.numel() * (param_dtype or p.dtype).itemsize, g) for p in trainable)
    optimizer_state = optimizer_state_bytes(
        optimizer, trainable, dtype=param_dtype, granularity=g, notes=notes
    )

    master = 0
    floating = [p for p in trainable if p.is_floating_point()]
    dtype = param_dtype or (floating[0].dtype if floating else torch.float32)
    if _wants_master(master_weights, optimizer, dtype):
        master = sum(_round_up(p.numel() * 4, g) for p in floating)
    ledger = Ledger(
        parameters=parameters,
        gradients=gradients,
        optimizer_state=optimizer_state,
        master_weights=master,
        inputs=_unique_storage_bytes(_flatten_tensors(inputs), g),
        world_size=world_size,
        sharding=mode,
        notes=notes,
    )
    ledger = _shard(ledger)
    if mode in ("zero3", "fsdp") and world_size > 1:
        ledger.gathered = _gathered_working_set(model, param_dtype, g, notes)
    return ledger


def _shard_units(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules FSDP gathers one at a time: fully_shard units if applied, else repeated blocks."""
    try:
        from torch.distributed.fsdp import FSDPModule

        units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    except ImportError:
        units = []
    if units:
        return units
    blocks = [m for name, m in model.named_modules() if name.split(".")[-1].isdigit()]
    return blocks or [model]


def _gathered_working_set(model: torch.nn.Module, param_dtype, g: int, notes: list[str]) -> int:
    """Bytes FSDP holds unsharded at once: the largest unit's parameters, twice (the one computing
    and the next one prefetched, FSDP2's default of one), plus its gradients before reduce-scatter."""
    units = _shard_units(model)
    inner = {id(m) for u in units for m in u.modules() if m is not u and m in units}
    largest_params = largest_grads = 0
    for u in units:
        own = [p for m in u.modules() if m is u or id(m) not in inner for p in m.parameters(recurse=False)]
        nbytes = sum(_round_up(_global_numel(p) * (param_dtype or p.dtype).itemsize, g) for p in own)
        grads = sum(_round_up(_global_numel(p) * (param_dtype or p.dtype).itemsize, g) for p in own if p.requires_grad)
        largest_params, largest_grads = max(largest_params, nbytes), max(largest_grads, grads)
    notes.append(f"fsdp: {len(units)} unit(s); the largest is gathered with one prefetched "
                 f"({format_bytes(2 * largest_params)} parameters, {format_bytes(largest_grads)} gradients)")
    return 2 * largest_params + largest_grads


def _global_numel(p: torch.Tensor) -> int:
    full = getattr(p, "full_tensor", None)  # a DTensor shard: count the whole parameter
    return math.prod(p.shape) if full is None else math.prod(p.size())


def ledger_for_count(
    n_params: int,
    *,
    param_dtype: str | torch.dtype = "fp32",
    grad_dtype: str | torch.dtype | None = None,
    optimizer: str | None = "adamw",
    master_weights: bool | None = None,
    world_size: int = 1,
    sharding: str = "none",
    trainable_fraction: float = 1.0,
) -> Ledger:
    """Fixed memory from a parameter count alone (no model), per rank.

    7e9 fp16 params with AdamW: parameters 14 GB, gradients 14 GB, optimizer state
    56 GB and fp32 master weights 28 GB.
    """
    mode = _check_sharding(world_size, sharding)
    name = _check_name(optimizer)
    if n_params < 0:
        raise ValueError(f"n_params must be >= 0; got {n_params}")
    if not 0.0 <= trainable_fraction <= 1.0:
        raise ValueError(f"trainable_fraction must be in [0, 1]; got {trainable_fraction}")
    p_dtype = _resolve_dtype(param_dtype)
    g_dtype = p_dtype if grad_dtype is None else _resolve_dtype(grad_dtype)
    n_params = int(n_params)
    n_train = round(n_params * trainable_fraction)
    notes: list[str] = []

    if name == "adafactor":
        side = _ADAFACTOR_ASSUMED_SIDE
        optimizer_state = math.ceil(n_train * 4 * 2 / side)
        notes.append(
            f"adafactor without parameter shapes: factored moments estimated as if all "
            f"matrices had a smaller side of {side}"
        )
    else:
        optimizer_state = _named_state_bytes(name, (n_train,), 1)
    master = n_train * 4 if _wants_master(master_weights, name, p_dtype) else 0
    ledger = Ledger(
        parameters=n_params * p_dtype.itemsize,
        gradients=n_train * g_dtype.itemsize,
        optimizer_state=optimizer_state,
        master_weights=master,
        world_size=world_size,
        sharding=mode,
        notes=notes,
    )
    return _shard(ledger)
