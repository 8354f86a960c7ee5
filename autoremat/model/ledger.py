"""The fixed part of a training step's memory: everything that is not activations.

Parameters, gradients, optimizer state, fp32 master weights and the input batch stay
resident through the whole step, so the planner subtracts them from the budget before it
decides what activations to keep; so are the tensors autograd saves for eager code between
the graphs (no plan changes them; they are alive at the forward/backward turn, where a step
peaks, and freed before optimizer.step()). Figures are per rank once sharding is applied.
"""

import math
from collections.abc import Iterable
from dataclasses import dataclass, field, fields
from typing import Any

import torch
import torch.fx as fx

from autoremat.capture.captured import CapturedGraph
from autoremat.model.optimizers import (
    ADAFACTOR_ASSUMED_SIDE,
    OPTIMIZER_NAMES,
    check_name,
    named_state_bytes,
    optimizer_state_bytes,
    optimizer_step_bytes,
)
from autoremat.torch_internals import arg_tree_leaves, is_primal, tree_leaves
from autoremat.units import format_bytes, round_up, storage_key

__all__ = ["OPTIMIZER_NAMES", "SLACK", "Ledger", "ledger_for_count", "ledger_for_model", "optimizer_state_bytes",
           "parameter_bytes", "storage_key"]

SHARDINGS = ("none", "zero1", "zero2", "zero3", "fsdp")
# Bytes every budget keeps beyond the graphs' activations for what no graph holds: autograd's loss and
# seed-gradient scalars.
SLACK = 1024

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
    # Tensors autograd saved for the eager code between the step's graphs (a graph break, a dynamo-disabled
    # function): held from that code's forward to its backward, across the graphs after it; measured on the
    # planning trace's forward (capture/tracing.eager_saved_bytes)
    eager_saved: int = 0
    gathered: int = 0  # FSDP/ZeRO-3: one block's unsharded parameters (+ the prefetched next) and gradients
    # cuBLAS/cuBLASLt workspaces on a GPU: allocated once per thread that runs matmuls, kept for the process's life
    # (devices.blas_workspace_bytes); 0 on a CPU.
    workspaces: int = 0
    # Temporaries of optimizer.step(): allocated after the backward has freed the activations, so the
    # step needs fixed + max(activations, optimizer_step), not the sum (autoremat.model.optimizers).
    optimizer_step: int = 0
    activations: int = 0  # filled by the planner: peak activation + temporary bytes
    budget: int | None = None
    world_size: int = 1
    sharding: str = "none"
    notes: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        for f in fields(self):
            _check_plain(f.name, getattr(self, f.name))

    @property
    def fixed(self) -> int:
        states = self.gradients + self.optimizer_state + self.master_weights
        return self.parameters + states + self.inputs + self.eager_saved + self.gathered + self.workspaces

    @property
    def total(self) -> int:
        return self.step_peak(self.activations)

    @property
    def after_backward(self) -> int:
        """What optimizer.step()'s temporaries need over the fixed parts: what eager code saved is freed by then."""
        return self.optimizer_step - self.eager_saved

    def step_peak(self, activations: int) -> int:
        """The whole step's peak when its graphs peak at `activations` bytes: the fixed parts and the larger
        of the activations and optimizer.step()'s temporaries (they never coexist). A measured peak is held
        to the budget with this; a predicted one with `needs`."""
        return self.fixed + max(activations, self.after_backward)

    def needs(self, activations: int) -> int:
        """The budget a step needs whose graphs are predicted to peak at `activations` bytes: `step_peak`
        and SLACK. The one place this sum is written: every floor, check and re-plan asks here."""
        return self.step_peak(activations) + SLACK

    def of_graphs(self, measured: int) -> int:
        """A real step's measured activation peak (above its baseline) less what eager code saved, which this
        ledger holds: what a plan's predicted peak, its graphs' alone, is compared with. Those tensors are
        alive at the step's forward/backward turn, so a real peak includes them."""
        return max(0, measured - self.eager_saved)

    def room(self, budget: int) -> int:
        """What `budget` leaves the graphs' activations: the inverse of `needs` wherever the activations
        outgrow optimizer.step()'s temporaries (`needs` checks the other case)."""
        return budget - self.fixed - SLACK

    @property
    def headroom(self) -> int | None:
        return None if self.budget is None else self.budget - self.total

    def to_dict(self) -> dict:
        """Plain numbers and strings only (a plan's JSON, and safe to deepcopy)."""
        out = {f.name: _check_plain(f.name, getattr(self, f.name)) for f in fields(self)}
        out["notes"] = [str(n) for n in self.notes]
        return out

    @classmethod
    def from_dict(cls, d: dict) -> "Ledger":
        d = dict(d)
        d["notes"] = list(d.get("notes", []))
        return cls(**d)

    def format(self) -> str:
        rows = [("parameters", self.parameters), ("gradients", self.gradients), ("optimizer state", self.optimizer_state)]
        rows += [(label, n) for label, n in (("master weights", self.master_weights), ("gathered block (fsdp)", self.gathered),
                                             ("cuBLAS workspaces", self.workspaces)) if n]
        rows += [("inputs", self.inputs)] + ([("saved by eager code", self.eager_saved)] if self.eager_saved else [])
        rows.append(("activations + temporaries", self.activations))
        if self.optimizer_step:
            rows.append(("optimizer.step() temporaries", self.optimizer_step))
        rows.append(("total", self.total))
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


def _check_plain(name: str, value: object) -> object:
    """A ledger holds byte counts of concrete shapes; a symbolic size would poison every copy of it."""
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.Tensor)):
        raise TypeError(f"ledger field {name!r} holds a {type(value).__name__} ({value}), not a plain number: "
                        "a ledger is made for concrete shapes (trace with static shapes, or read the sizes of real "
                        "tensors)")
    return value


def parameter_bytes(p: torch.Tensor, optimizer: object, granularity: int = 1) -> tuple[int, int, int]:
    """Bytes of one parameter, of its gradient (0 if frozen) and of its optimizer state, each rounded up."""
    data = round_up(storage_key(p)[1], granularity)
    if not p.requires_grad:
        return data, 0, 0
    grad = round_up(p.numel() * p.element_size(), granularity)
    return data, grad, optimizer_state_bytes(optimizer, [p], granularity=granularity)


def _unique_storage_bytes(
    tensors: Iterable[torch.Tensor], granularity: int, dtype: torch.dtype | None = None
) -> int:
    """Bytes of the storages behind `tensors`, each counted once and rounded up.

    With `dtype`, floating-point storages are counted as if cast to it (what
    model.to(dtype) does to parameters and buffers).
    """
    seen, total = set(), 0
    for t in tensors:
        key, nbytes = storage_key(t)
        if key in seen:
            continue
        seen.add(key)
        if dtype is not None and t.is_floating_point():
            nbytes = nbytes // t.element_size() * dtype.itemsize
        total += round_up(nbytes, granularity)
    return total


def _resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {list(_DTYPES)} or a torch.dtype")
    return _DTYPES[dtype]


def _shard(ledger: Ledger) -> Ledger:
    """Divide the sharded parts of a replicated ledger by world_size (ceil)."""
    n, mode = ledger.world_size, ledger.sharding
    if mode == "none" or n == 1:
        return ledger
    ledger.optimizer_state = -(-ledger.optimizer_state // n)
    ledger.optimizer_step = -(-ledger.optimizer_step // n)  # each rank steps its own shard of the state
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
    workspaces: int = 0,
) -> Ledger:
    """Fixed memory of one training step of `model`, per rank.

    `param_dtype` counts floating parameters and buffers as if cast to it. Every
    allocation is rounded up to `device_granularity` (512 for CUDA). `workspaces`: the
    matmul libraries' workspaces the device holds (devices.blas_workspace_bytes).
    """
    mode = _check_sharding(world_size, sharding)
    if isinstance(optimizer, str):
        check_name(optimizer)
    g = device_granularity
    params = list(model.parameters())  # already deduplicated: tied weights once
    trainable = [p for p in params if p.requires_grad]
    notes: list[str] = []

    parameters = _unique_storage_bytes([*params, *model.buffers()], g, param_dtype)
    # Each trainable Parameter gets its own .grad, even if it is a view of shared storage.
    gradients = sum(round_up(p.numel() * (param_dtype or p.dtype).itemsize, g) for p in trainable)
    optimizer_state = optimizer_state_bytes(
        optimizer, trainable, dtype=param_dtype, granularity=g, notes=notes
    )
    optimizer_step = optimizer_step_bytes(optimizer, trainable, dtype=param_dtype, granularity=g, notes=notes)

    master = 0
    floating = [p for p in trainable if p.is_floating_point()]
    dtype = param_dtype or (floating[0].dtype if floating else torch.float32)
    if _wants_master(master_weights, optimizer, dtype):
        master = sum(round_up(p.numel() * 4, g) for p in floating)
    ledger = Ledger(
        parameters=parameters,
        gradients=gradients,
        optimizer_state=optimizer_state,
        master_weights=master,
        inputs=_unique_storage_bytes([t for t in tree_leaves(inputs) if isinstance(t, torch.Tensor)], g),
        optimizer_step=optimizer_step,
        workspaces=workspaces,
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
        nbytes = sum(round_up(_global_numel(p) * (param_dtype or p.dtype).itemsize, g) for p in own)
        grads = sum(round_up(_global_numel(p) * (param_dtype or p.dtype).itemsize, g) for p in own if p.requires_grad)
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
    name = check_name(optimizer)
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
        side = ADAFACTOR_ASSUMED_SIDE
        optimizer_state = math.ceil(n_train * 4 * 2 / side)
        notes.append(
            f"adafactor without parameter shapes: factored moments estimated as if all "
            f"matrices had a smaller side of {side}"
        )
    else:
        optimizer_state = named_state_bytes(name, (n_train,), 1)
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


def ledger_from_graph(cg: CapturedGraph, optimizer: Any, granularity: int, workspaces: int = 0) -> Ledger:
    """Fixed bytes when all we have is the graph: its parameters, their gradients and optimizer state, and
    `workspaces` (the matmul libraries' on a GPU: devices.blas_workspace_bytes)."""
    nodes = list(cg.joint.graph.nodes)
    primals = [n for n in nodes if is_primal(n)]
    outs = list(arg_tree_leaves(*next(n for n in nodes if n.op == "output").args))
    grads = outs[cg.num_fwd_outputs:]
    static = set(cg.static_input_indices)

    def nbytes(n: fx.Node) -> int:
        v = n.meta.get("val")
        size = v.untyped_storage().nbytes() if isinstance(v, torch.Tensor) else 0
        return -(-size // granularity) * granularity

    params = [p for i, p in enumerate(primals) if i in static]
    trainable = [p for i, p in enumerate(primals) if i in static and i < len(grads) and grads[i] is not None]
    inputs = [p for i, p in enumerate(primals) if i not in static]
    notes: list[str] = []
    state = optimizer_state_bytes(optimizer, [p.meta["val"] for p in trainable], granularity=granularity,
                                  notes=notes)
    return Ledger(parameters=sum(map(nbytes, params)), gradients=sum(map(nbytes, trainable)), optimizer_state=state,
                  inputs=sum(map(nbytes, inputs)), workspaces=workspaces, notes=notes)
