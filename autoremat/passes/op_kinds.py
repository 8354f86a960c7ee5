"""Which calls of a dynamo (torch-level) graph are matrix products, which autocast keeps in fp32, and the
16-bit dtypes a call may be cast to: what the precision measurement (model/precision_measure.py) and the
dtype rewrite (passes/dtypes.py) both read of a call."""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
import torch.nn.functional as F

from autoremat.torch_internals import C_NN_LINEAR

LOW = {"bf16": torch.bfloat16, "fp16": torch.float16}

_MATMULS = {
    C_NN_LINEAR, F.linear, torch.matmul, operator.matmul, torch.mm, torch.bmm, torch.addmm,
    torch.baddbmm, torch.einsum, F.conv1d, F.conv2d, F.conv3d, torch.conv1d, torch.conv2d, torch.conv3d,
    F.scaled_dot_product_attention,
}
_MATMUL_METHODS = {"matmul", "mm", "bmm", "addmm", "baddbmm", "__matmul__"}
# What autocast runs in fp32 (its CUDA fp32 list, by function name), plus the losses and reductions.
FP32_KEPT = (
    "layer_norm", "group_norm", "batch_norm", "instance_norm", "rms_norm", "softmax", "log_softmax",
    "cross_entropy", "nll_loss", "mse_loss", "l1_loss", "smooth_l1_loss", "binary_cross_entropy_with_logits",
    "kl_div", "exp", "log", "log1p", "expm1", "pow", "rsqrt", "sum", "mean", "norm", "cumsum", "cumprod",
    "prod", "var", "std", "logsumexp",
)


def call_name(node: fx.Node) -> str:
    """The function or method name of a call node ('linear', 'softmax', ...), '' for other nodes."""
    if node.op == "call_method":
        return str(node.target)
    if node.op == "call_function":
        return getattr(node.target, "__name__", str(node.target)).lstrip("_")
    return ""


def is_matmul(node: fx.Node) -> bool:
    return (node.op == "call_function" and node.target in _MATMULS) or (
        node.op == "call_method" and node.target in _MATMUL_METHODS)


def traced_value(node) -> object:
    return node.meta.get("example_value") if isinstance(node, fx.Node) else None


def is_float(val) -> bool:
    return isinstance(val, torch.Tensor) and val.is_floating_point()
