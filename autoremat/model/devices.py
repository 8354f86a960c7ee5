"""Roofline device table: enough about a device to predict how long an op takes.

All compute figures are dense (no 2:4 sparsity) peaks from the vendor documents named
next to them. Peaks are optimistic: real kernels reach only a part of the datasheet
rate. The planner only compares op times with each other, so a uniform
optimism costs little; measured times from profiling replace these when available.
"""

import dataclasses
import os
import re
import warnings
from dataclasses import dataclass

import torch

# Datasheet HBM/GDDR capacities are binary: an "80GB" part has 80 GiB of DRAM (a bit
# less is visible to CUDA). When a real CUDA device is seen, its reported total
# memory replaces these nominal figures.
_GiB = 2**30
_T = 1e12


@dataclass(frozen=True)
class DeviceSpec:
    name: str
    kind: str  # "cpu" | "cuda"
    flops: dict[str, float]  # dense FLOP/s for "fp32", "tf32", "bf16", "fp16"
    mem_bandwidth: float  # bytes/s
    memory_bytes: int  # device memory; 0 means unknown (CPU)
    alloc_granularity: int  # the CUDA caching allocator rounds every block to 512 B
    launch_overhead_s: float  # fixed cost per op (kernel launch / eager dispatch)
    # Seconds per element a random draw costs beyond the roofline. A GPU draws from Philox at
    # memory speed (0); a CPU steps a Mersenne Twister element by element, far slower than its
    # arithmetic, which matters when the plan weighs replaying a dropout mask against saving it.
    random_draw_s_per_element: float = 0.0
    # Seconds one more compiled graph costs per step (its AOTAutograd call in the forward and in the
    # backward: Python on the host, whatever the device). regions="auto" weighs it against recomputation.
    region_call_s: float = 0.0
    # CUDA compute capability (major, minor); None for a CPU. It sizes cuBLAS's workspace (`blas_workspace_bytes`).
    capability: tuple[int, int] | None = None

    def op_time(
        self,
        flops: float,
        bytes_moved: float,
        dtype: str | torch.dtype = "fp32",
        matmul: bool = False,
        allow_tf32: bool = False,
    ) -> float:
        """Roofline estimate in seconds: the slower of compute and memory, plus launch."""
        key = dtype_key(dtype)
        if matmul:
            # tf32 only exists as a matmul mode for fp32 inputs.
            rate = self.flops["tf32" if key == "fp32" and allow_tf32 else key]
        elif self.kind == "cuda":
            # Elementwise/reduction kernels run on the vector units, not the tensor
            # cores. bf16/fp16 packed math can reach ~2x fp32 on Ampere and newer, but
            # such kernels are memory-bound anyway, so the fp32 rate is a fair model.
            rate = self.flops["fp32"]
        else:
            # On CPUs without native 16-bit math the emulation slows every op alike.
            rate = self.flops[key]
        return max(flops / rate, bytes_moved / self.mem_bandwidth) + self.launch_overhead_s

    def fused_op_time(self, flops: float, dtype: str | torch.dtype = "fp32") -> float:
        """An elementwise op inlined into another kernel's loop: its arithmetic, no traffic, no launch."""
        key = dtype_key(dtype)
        return flops / self.flops["fp32" if self.kind == "cuda" else key]


def dtype_key(dtype: str | torch.dtype) -> str:
    """Map a torch dtype or a short name onto a rate key of DeviceSpec.flops."""
    if isinstance(dtype, str):
        if dtype in ("fp32", "tf32", "bf16", "fp16"):
            return dtype
        dtype = getattr(torch, dtype, None)
    if dtype == torch.bfloat16:
        return "bf16"
    if dtype == torch.float16:
        return "fp16"
    # fp64, integer and bool ops are rare in training graphs and mostly memory-bound;
    # the fp32 rate keeps them from being mistaken for free.
    return "fp32"


# Host time of one more graph call per step (regions="auto" weighs it against recomputation). Measured by
# benchmarks/launch_overhead.py's `region_call` rows (results/launch_overhead_cpu.json): a stack run as one
# graph against one graph per block, nothing recomputed, so the difference is the calls and the gradient
# hand-offs between them. The hand-off is not priced apart: its fitted slope
# (`s_per_handoff` in the same results file) is within the fit's noise.
REGION_CALL_S = 40e-6


def _gpu(
    name: str, fp32: float, tf32: float, bf16: float, fp16: float, bw: float, mem_gib: float,
    capability: tuple[int, int],
) -> DeviceSpec:
    return DeviceSpec(
        name=name,
        kind="cuda",
        flops={"fp32": fp32, "tf32": tf32, "bf16": bf16, "fp16": fp16},
        mem_bandwidth=bw,
        memory_bytes=int(mem_gib * _GiB),
        alloc_granularity=512,
        launch_overhead_s=5e-6,
        # host-side Python: the CPU figure below (a GPU host was not measured); it shows where the GPU waits
        # on the host, in launch-bound steps
        region_call_s=REGION_CALL_S,
        capability=capability,
    )


_DEVICES: dict[str, DeviceSpec] = {
    # A rough nominal figure for a generic 2-core AVX2 server, not a datasheet value:
    # 2 cores x 2 FMA units x 8 fp32 lanes x 2 flops x ~3 GHz is ~200 GFLOP/s peak,
    # of which eager PyTorch reaches roughly a quarter. bf16/fp16 have no native
    # arithmetic on such a CPU and run about an order of magnitude slower than fp32, hence 1/10 of the rate.
    "cpu": DeviceSpec(
        name="cpu",
        kind="cpu",
        flops={"fp32": 50e9, "tf32": 50e9, "bf16": 5e9, "fp16": 5e9},
        mem_bandwidth=20e9,
        memory_bytes=0,
        alloc_granularity=1,
        # Per kernel of Inductor-compiled code, the default compiler (an op fused into another kernel costs
        # none: DeviceSpec.fused_op_time). It is the slope of step time over op count in
        # benchmarks/launch_overhead.py (results/launch_overhead_cpu.json), rounded up. It matters for small
        # steps: priced too high, recomputation looks dear and regions="auto" cuts graphs apart that run
        # faster whole (benchmarks/dropout_gap.py).
        launch_overhead_s=1e-6,
        # A dropout mask drawn again costs far more than the arithmetic it feeds (a draw per element against
        # one multiply per element), so replaying a mask is priced per element.
        random_draw_s_per_element=4.7e-9,
        region_call_s=REGION_CALL_S,
    ),
    # NVIDIA Tesla V100 datasheet (SXM2, 32 GB): 15.7 TFLOPS fp32, 125 TFLOPS fp16
    # tensor, 900 GB/s. Volta has no tf32 and no bf16 (bf16 is emulated through fp32),
    # so both get the fp32 rate: a "no gain" model.
    "v100": _gpu("v100", 15.7 * _T, 15.7 * _T, 15.7 * _T, 125 * _T, 900e9, 32, (7, 0)),
    # NVIDIA A100 Tensor Core GPU datasheet (80GB SXM): 19.5 TFLOPS fp32, 156 TFLOPS tf32,
    # 312 TFLOPS bf16/fp16 (dense; the 312/624 figures with * are sparse), 2,039 GB/s.
    "a100": _gpu("a100", 19.5 * _T, 156 * _T, 312 * _T, 312 * _T, 2039e9, 80, (8, 0)),
    # NVIDIA L4 Tensor Core GPU datasheet: 30.3 TFLOPS fp32; tf32 120 and bf16/fp16 242
    # TFLOPS are quoted with sparsity, so dense is half. 24 GB GDDR6, 300 GB/s.
    "l4": _gpu("l4", 30.3 * _T, 60 * _T, 121 * _T, 121 * _T, 300e9, 24, (8, 9)),
    # NVIDIA Ampere GA102 GPU architecture whitepaper (GeForce RTX 3090): 35.6 TFLOPS
    # fp32, tf32 35.6 dense, bf16/fp16 tensor with fp32 accumulate 71 dense (PyTorch
    # accumulates in fp32; GeForce runs that at half the fp16-accumulate rate), 936 GB/s.
    "rtx3090": _gpu("rtx3090", 35.6 * _T, 35.6 * _T, 71 * _T, 71 * _T, 936e9, 24, (8, 6)),
    # NVIDIA Ada Lovelace GPU architecture whitepaper (GeForce RTX 4090): 82.6 TFLOPS
    # fp32, tf32 82.6 dense, bf16/fp16 tensor with fp32 accumulate 165.2 dense, 1,008 GB/s.
    "rtx4090": _gpu("rtx4090", 82.6 * _T, 82.6 * _T, 165.2 * _T, 165.2 * _T, 1008e9, 24, (8, 9)),
    # NVIDIA H100 Tensor Core GPU datasheet (H100 SXM): 67 TFLOPS fp32; tf32 989 and
    # bf16/fp16 1,979 TFLOPS are quoted with sparsity, so dense is half. 80 GB, 3.35 TB/s.
    "h100": _gpu("h100", 67 * _T, 494.5 * _T, 989.5 * _T, 989.5 * _T, 3.35e12, 80, (9, 0)),
    # NVIDIA H200 Tensor Core GPU datasheet (H200 SXM): same compute as H100 SXM,
    # 141 GB HBM3e at 4.8 TB/s.
    "h200": _gpu("h200", 67 * _T, 494.5 * _T, 989.5 * _T, 989.5 * _T, 4.8e12, 141, (9, 0)),
}

# Extra spellings, already normalized (lowercase, no spaces, dashes or underscores).
_ALIASES = {
    "a10080gb": "a100",
    "a100sxm": "a100",
    "a100sxm480gb": "a100",
    "h100sxm": "h100",
    "h200sxm": "h200",
    "v100sxm2": "v100",
    "3090": "rtx3090",
    "4090": "rtx4090",
    "geforcertx3090": "rtx3090",
    "geforcertx4090": "rtx4090",
}

# Tokens of torch.cuda.get_device_name(), e.g. "NVIDIA A100-SXM4-80GB" -> "a100". Whole
# tokens, not substrings, so that "NVIDIA L40S" is not taken for an L4. PCIe variants
# map to the SXM entry (faster than reality) but get their real memory size.
_CUDA_TOKENS = {
    "h200": "h200",
    "h100": "h100",
    "a100": "a100",
    "v100": "v100",
    "l4": "l4",
    "3090": "rtx3090",
    "4090": "rtx4090",
}


# cuBLAS's and cuBLASLt's workspaces (aten/src/ATen/cuda/CublasHandlePool.cpp, torch 2.11 to 2.13): torch
# allocates each through the caching allocator the first time a matmul runs on a (cuBLAS handle, stream) pair, and
# keeps it for the life of the process. Handles are per thread: the thread that calls the forward has one, and
# autograd runs a CUDA backward on a device thread of its own, which has another. So a training step holds two of
# each, outside any graph, and torch.cuda.max_memory_allocated counts them: the budget must hold them too, or a
# plan that meets it on the graphs' bytes misses it on a real step (benchmarks/gpu_check.py, on a GPU).
BLAS_THREADS = 2
_KiB = 1024


def cublas_workspace_bytes(capability: tuple[int, int]) -> int:
    """The cuBLAS workspace of one (handle, stream): CUBLAS_WORKSPACE_CONFIG's ":SIZE_KiB:COUNT" pairs summed, or
    torch's default: 32 MiB on sm90 (Hopper), else 4096 KiB x 2 + 16 KiB x 8."""
    default = 4096 * 8 * _KiB if capability == (9, 0) else 4096 * _KiB * 2 + 16 * _KiB * 8
    config = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    if not config:
        return default
    pairs = re.findall(r":([0-9]+):([0-9]+)", config)
    if not pairs:
        return default  # torch warns and uses its default
    return sum(int(size) * _KiB * int(count) for size, count in pairs)


def cublaslt_workspace_bytes(capability: tuple[int, int]) -> int:
    """The cuBLASLt workspace of one (handle, stream): CUBLASLT_WORKSPACE_SIZE KiB (default 1024), at most the
    cuBLAS workspace unless TORCH_CUBLASLT_UNIFIED_WORKSPACE is set false; 0 when it is set true, where cuBLASLt
    uses cuBLAS's own (c10::utils::check_env's spellings)."""
    unified = os.environ.get("TORCH_CUBLASLT_UNIFIED_WORKSPACE")
    flag = None if unified is None else unified.strip().lower() in ("1", "y", "yes", "true", "on")
    if flag:
        return 0
    try:
        size = int(os.environ.get("CUBLASLT_WORKSPACE_SIZE", "1024")) * _KiB
    except ValueError:
        size = 1024 * _KiB  # torch warns and uses its default
    return size if flag is False else min(size, cublas_workspace_bytes(capability))


def blas_workspace_bytes(spec: "DeviceSpec", runs_on: str = "cuda") -> int:
    """Bytes of matmul-library workspace a training step on `spec` holds, allocated once and never freed: one
    cuBLAS and one cuBLASLt workspace per thread that runs matmuls (BLAS_THREADS). `runs_on` is the device
    type of the step's tensors: "cuda", or "meta" when the step is planned for a GPU without one. 0 on a CPU,
    and for a step whose tensors are on the CPU whatever device its op times are modelled on."""
    if runs_on not in ("cuda", "meta") or spec.kind != "cuda" or spec.capability is None:
        return 0
    one = cublas_workspace_bytes(spec.capability) + cublaslt_workspace_bytes(spec.capability)
    return BLAS_THREADS * -(-one // spec.alloc_granularity) * spec.alloc_granularity


def known_devices() -> list[str]:
    return list(_DEVICES)


def _normalize(name: str) -> str:
    return re.sub(r"[\s\-_]", "", name.lower())


def match_cuda_name(name: str) -> str | None:
    """Table entry for a torch.cuda.get_device_name() string, or None if unknown."""
    tokens = re.split(r"[\s\-_]+", name.lower())
    return next((key for token, key in _CUDA_TOKENS.items() if token in tokens), None)


def _cuda_spec(device: torch.device) -> DeviceSpec:
    if not torch.cuda.is_available():
        raise ValueError(
            f"{device} was requested but CUDA is not available; "
            f"pass a device name instead, one of {known_devices()}"
        )
    props = torch.cuda.get_device_properties(device)
    key = match_cuda_name(props.name)
    capability = (props.major, props.minor)
    if key is not None:
        return dataclasses.replace(_DEVICES[key], memory_bytes=props.total_memory, capability=capability)
    warnings.warn(
        f"unknown GPU {props.name!r}: predicting op times with A100-like rates; "
        f"pass one of {known_devices()} for a better model",
        stacklevel=3,
    )
    generic = _DEVICES["a100"]
    return dataclasses.replace(generic, name=props.name, memory_bytes=props.total_memory, capability=capability)


def get_device(spec: "DeviceSpec | str | torch.device | None" = None) -> DeviceSpec:
    """Resolve a DeviceSpec, a table name ("h100", "A100-80GB"), a torch.device or None (cpu)."""
    if spec is None:
        return _DEVICES["cpu"]
    if isinstance(spec, DeviceSpec):
        return spec
    if isinstance(spec, str):
        key = _normalize(spec)
        key = _ALIASES.get(key, key)
        if key in _DEVICES:
            return _DEVICES[key]
        if not re.fullmatch(r"(cuda|meta)(:\d+)?", spec.strip().lower()):
            raise ValueError(f"unknown device {spec!r}; known devices: {known_devices()}")
        spec = torch.device(spec.strip().lower())
    if isinstance(spec, torch.device):
        # Meta tensors are how models too big for this machine get captured; there is
        # no hardware behind them, so the generic CPU entry stands in.
        if spec.type in ("cpu", "meta"):
            return _DEVICES["cpu"]
        if spec.type == "cuda":
            return _cuda_spec(spec)
        raise ValueError(
            f"unsupported device type {spec.type!r}; known devices: {known_devices()}"
        )
    raise TypeError(
        f"expected a DeviceSpec, a device name or a torch.device; got {type(spec).__name__}"
    )
