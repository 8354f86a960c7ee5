"""Per-op compute dtypes: which ops may run in bf16/fp16 and how safe that is.

This stage works on the graph dynamo hands to a backend (torch-level calls such as `linear`,
`matmul`, `softmax`), before AOTAutograd traces the training step. That is where a dtype is a
property of one call: cast the inputs of a matmul to bf16 and AOTAutograd derives a backward in
bf16 that casts the gradients back, so parameters stay fp32 master copies and their gradients
reach the optimizer in fp32.

- `castable(gm)`: the calls whose dtype the planner chooses. Matmul-class calls (linear, matmul,
  bmm, baddbmm, addmm, conv, scaled-dot-product attention), like autocast's lower-precision list.
  Calls autocast keeps in fp32 (`FP32_KEPT`: normalisations, softmax, exp/log/pow, reductions,
  losses) stay fp32 unless the user removes them from the list.
- `measure(gm, inputs)`: runs the fp32 graph once on the example batch and, per castable call, the
  largest magnitude it reads or writes, the share of its outputs that fp16 flushes to zero, and its
  relative error when it runs in bf16 or fp16 instead (inputs rounded, same op, compared in fp32).

The rewrite that runs the chosen calls in 16 bits is a graph pass: passes/dtypes.py (`apply_dtypes`).

    >>> import torch, torch.nn as nn
    >>> from autoremat.model.precision_measure import castable, measure
    >>> seen = {}
    >>> def backend(gm, inputs):
    ...     seen.update(measure(gm, inputs, castable(gm)))
    ...     return gm
    >>> _ = torch.compile(nn.Linear(8, 8), backend=backend)(torch.randn(4, 8))
    >>> sorted(seen), seen["linear"].fp16_safe
    (['linear'], True)
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.fx as fx

from autoremat.passes.op_kinds import FP32_KEPT, LOW, call_name, is_float, is_matmul, traced_value
from autoremat.torch_internals import tree_leaves, tree_map

FP16_MAX = 65504.0
FP16_TINY = 2.0**-24  # smallest fp16 subnormal: anything smaller becomes zero
FP16_SAFETY = 8.0  # fp16 is forbidden once a value comes within this factor of FP16_MAX
FP16_UNDERFLOW_SHARE = 1e-3  # ... or when more than this share of nonzero outputs flush to zero


def castable(gm: fx.GraphModule, fp32_ops: Iterable[str] = FP32_KEPT) -> list[str]:
    """Names of the calls whose compute dtype is a decision: matmul-class calls, and any call of
    the fp32 list the user removed from `fp32_ops`. Only calls that read a floating tensor count."""
    kept = set(fp32_ops)
    out = []
    for n in gm.graph.nodes:
        if n.op not in ("call_function", "call_method") or not is_float(traced_value(n)):
            continue
        if is_matmul(n) or (call_name(n) in FP32_KEPT and call_name(n) not in kept):
            out.append(n.name)
    return out


@dataclass
class OpStats:
    """What one castable call did on the example batch."""

    max_abs: float  # over its floating inputs and its output
    underflow: float  # share of its nonzero outputs smaller than fp16's smallest subnormal
    err_bf16: float  # relative error (Frobenius) of the output when run in bf16
    err_fp16: float

    @property
    def fp16_safe(self) -> bool:
        return self.max_abs * FP16_SAFETY < FP16_MAX and self.underflow <= FP16_UNDERFLOW_SHARE

    def to_dict(self) -> dict:
        return {"max_abs": self.max_abs, "underflow": self.underflow, "err_bf16": self.err_bf16,
                "err_fp16": self.err_fp16, "fp16_safe": self.fp16_safe}


def _rel_err(approx: torch.Tensor, exact: torch.Tensor) -> float:
    exact = exact.double()
    den = exact.norm().item()
    diff = (approx.double() - exact).norm().item()
    if math.isnan(diff):  # the low dtype overflowed
        return float("inf")
    return diff / den if den > 0 else (0.0 if diff == 0 else float("inf"))


class _Recorder(fx.Interpreter):
    """Run the graph in fp32; at each castable call, also run it on rounded inputs."""

    def __init__(self, gm: fx.GraphModule, names: set[str]) -> None:
        super().__init__(gm)
        self.names = names
        self.stats: dict[str, OpStats] = {}

    def run_node(self, n: fx.Node):
        out = super().run_node(n)
        if n.name in self.names and isinstance(out, torch.Tensor) and out.is_floating_point():
            args, kwargs = self.fetch_args_kwargs_from_env(n)
            flat = [a for a in tree_leaves((args, kwargs)) if is_float(a)]
            max_abs = max([out.detach().abs().max().item() if out.numel() else 0.0]
                          + [a.detach().abs().max().item() for a in flat if a.numel()])
            nonzero = out.detach() != 0
            tiny = (out.detach().abs() < FP16_TINY) & nonzero
            share = tiny.sum().item() / max(1, nonzero.sum().item())
            errs = {}
            for key, dtype in LOW.items():
                low_args, low_kwargs = tree_map(
                    lambda a, d=dtype: a.detach().to(d) if is_float(a) else a, (args, kwargs))
                with torch.random.fork_rng(devices=[out.device] if out.device.type == "cuda" else []):
                    low = getattr(self, n.op)(n.target, low_args, low_kwargs)
                errs[key] = _rel_err(low.float(), out.detach())
            self.stats[n.name] = OpStats(max_abs, share, errs["bf16"], errs["fp16"])
        return out


def measure(gm: fx.GraphModule, inputs: list, names: Iterable[str]) -> dict[str, OpStats]:
    """Run `gm` once in fp32 on `inputs` and return `OpStats` for each call in `names`.

    Inputs are cloned first (the graph may update BatchNorm statistics in place) and the RNG state
    is restored afterwards, so the measurement leaves the model and the random stream as they were.
    """
    names = set(names)
    if not names:
        return {}
    args = [a.detach().clone() if isinstance(a, torch.Tensor) and not isinstance(a, torch.nn.Parameter)
            else a for a in inputs]
    cuda = [a.device for a in args if isinstance(a, torch.Tensor) and a.device.type == "cuda"][:1]
    rec = _Recorder(gm, names)
    with torch.no_grad(), torch.random.fork_rng(devices=cuda):
        rec.run(*args)
    return rec.stats

