import dataclasses

import pytest
import torch

from autoremat.model.devices import (
    BLAS_THREADS,
    DeviceSpec,
    blas_workspace_bytes,
    cublas_workspace_bytes,
    cublaslt_workspace_bytes,
    dtype_key,
    get_device,
    known_devices,
    match_cuda_name,
)

torch.set_num_threads(1)


def test_known_devices():
    names = known_devices()
    for name in ("cpu", "v100", "a100", "l4", "rtx3090", "rtx4090", "h100", "h200"):
        assert name in names
        spec = get_device(name)
        assert spec.name == name
        assert set(spec.flops) == {"fp32", "tf32", "bf16", "fp16"}
        assert all(rate > 0 for rate in spec.flops.values())
        assert spec.mem_bandwidth > 0 and spec.launch_overhead_s > 0


def test_gpu_entries_are_sane():
    for name in known_devices():
        spec = get_device(name)
        if spec.kind != "cuda":
            continue
        assert spec.alloc_granularity == 512
        assert spec.memory_bytes >= 16 * 2**30
        # Tensor-core rates are never below the plain fp32 rate.
        assert spec.flops["fp16"] >= spec.flops["tf32"] >= spec.flops["fp32"]


def test_datasheet_figures():
    h100, h200 = get_device("h100"), get_device("h200")
    assert h200.flops == h100.flops
    assert h200.mem_bandwidth == 4.8e12 and h100.mem_bandwidth == 3.35e12
    assert h200.memory_bytes > h100.memory_bytes
    # Dense, not the 2:4 sparse figure: above the 788 TFLOP/s measured on an H200.
    assert 788e12 < h200.flops["bf16"] < 1000e12
    v100 = get_device("v100")
    assert v100.flops["bf16"] == v100.flops["fp32"] == v100.flops["tf32"]
    cpu = get_device("cpu")
    assert cpu.memory_bytes == 0 and cpu.alloc_granularity == 1
    assert cpu.flops["bf16"] == pytest.approx(cpu.flops["fp32"] / 10)


@pytest.mark.parametrize(
    "alias, name",
    [("H100", "h100"), ("a100-80gb", "a100"), ("A100_SXM4_80GB", "a100"), ("rtx 4090", "rtx4090"),
     ("RTX-3090", "rtx3090"), ("4090", "rtx4090"), (" L4 ", "l4"), ("CPU", "cpu")],
)
def test_aliases(alias, name):
    assert get_device(alias).name == name


@pytest.mark.parametrize(
    "cuda_name, key",
    [
        ("NVIDIA H200", "h200"),
        ("NVIDIA H100 80GB HBM3", "h100"),
        ("NVIDIA H100 PCIe", "h100"),
        ("NVIDIA A100-SXM4-80GB", "a100"),
        ("NVIDIA A100-PCIE-40GB", "a100"),
        ("Tesla V100-SXM2-32GB", "v100"),
        ("NVIDIA L4", "l4"),
        ("NVIDIA GeForce RTX 4090", "rtx4090"),
        ("NVIDIA GeForce RTX 3090 Ti", "rtx3090"),
        ("NVIDIA L40S", None),  # not an L4
        ("NVIDIA A10G", None),
    ],
)
def test_match_cuda_name(cuda_name, key):
    assert match_cuda_name(cuda_name) == key


def test_torch_devices_and_none():
    cpu = get_device("cpu")
    assert get_device(None) is cpu
    assert get_device(torch.device("cpu")) is cpu
    assert get_device(torch.device("meta")) is cpu
    assert get_device("meta") is cpu
    spec = dataclasses.replace(cpu, name="mine")
    assert get_device(spec) is spec


def test_unknown_device():
    with pytest.raises(ValueError, match="h100"):
        get_device("tpu-v5")
    with pytest.raises(TypeError):
        get_device(3)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA error")
def test_cuda_without_cuda():
    with pytest.raises(ValueError, match="CUDA is not available"):
        get_device(torch.device("cuda"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_device_gets_real_memory():
    spec = get_device(torch.device("cuda"))
    assert spec.kind == "cuda"
    assert spec.memory_bytes == torch.cuda.get_device_properties(0).total_memory


def test_dtype_key():
    assert dtype_key(torch.bfloat16) == "bf16"
    assert dtype_key(torch.float16) == "fp16"
    assert dtype_key(torch.float32) == "fp32"
    assert dtype_key("bfloat16") == "bf16"
    assert dtype_key(torch.int64) == "fp32"


def test_op_time_roofline():
    h100 = get_device("h100")
    t0 = h100.launch_overhead_s
    # Memory-bound: 1 GB moved dwarfs 1 MFLOP.
    t = h100.op_time(1e6, 1e9)
    assert t == pytest.approx(1e9 / h100.mem_bandwidth + t0)
    # Compute-bound: 1 PFLOP of bf16 matmul vs 1 MB moved.
    t = h100.op_time(1e15, 1e6, "bf16", matmul=True)
    assert t == pytest.approx(1e15 / h100.flops["bf16"] + t0)
    # An empty op still pays the launch.
    assert h100.op_time(0, 0) == t0


def test_op_time_is_monotone():
    spec = get_device("a100")
    times = [spec.op_time(f, 1e6, matmul=True) for f in (0, 1e6, 1e9, 1e12, 1e15)]
    assert times == sorted(times)
    assert times[0] == times[1]  # still memory-bound: more flops cost nothing
    times = [spec.op_time(1e9, b) for b in (0, 1e3, 1e6, 1e9, 1e12)]
    assert times == sorted(times)
    assert times[-1] > times[0]


def test_op_time_rates():
    a100 = get_device("a100")
    flops = 1e15
    fp32 = a100.op_time(flops, 0, "fp32", matmul=True)
    tf32 = a100.op_time(flops, 0, "fp32", matmul=True, allow_tf32=True)
    bf16 = a100.op_time(flops, 0, torch.bfloat16, matmul=True)
    assert fp32 > tf32 > bf16
    # Elementwise work uses the vector rate whatever the dtype on a GPU ...
    assert a100.op_time(flops, 0, "bf16") == fp32
    # ... but a CPU that emulates bf16 is slower at everything in bf16.
    cpu = get_device("cpu")
    assert cpu.op_time(1e9, 0, "bf16") > cpu.op_time(1e9, 0, "fp32")


def test_spec_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        get_device("h100").name = "x"
    assert isinstance(get_device("h100"), DeviceSpec)


MiB, KiB = 2**20, 2**10
BLAS_ENV = ("CUBLAS_WORKSPACE_CONFIG", "CUBLASLT_WORKSPACE_SIZE", "TORCH_CUBLASLT_UNIFIED_WORKSPACE")


def test_blas_workspaces_by_hand(monkeypatch):
    """cuBLAS and cuBLASLt workspaces are memory every GPU step holds and no graph shows. By hand from
    aten/src/ATen/cuda/CublasHandlePool.cpp (torch 2.11-2.13): cuBLAS 4096 KiB x 8 = 32 MiB on sm90, else
    4096 KiB x 2 + 16 KiB x 8; cuBLASLt 1024 KiB; one of each for the forward's thread and autograd's device
    thread."""
    for name in BLAS_ENV:
        monkeypatch.delenv(name, raising=False)
    assert BLAS_THREADS == 2
    assert get_device("h200").capability == get_device("h100").capability == (9, 0)
    assert blas_workspace_bytes(get_device("h200")) == 2 * (32 * MiB + 1 * MiB) == 69_206_016
    assert blas_workspace_bytes(get_device("a100")) == 2 * (8 * MiB + 128 * KiB + 1 * MiB)
    assert blas_workspace_bytes(get_device("cpu")) == 0
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # the deterministic-mode setting
    assert cublas_workspace_bytes((8, 0)) == 32 * MiB
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
    assert cublas_workspace_bytes((9, 0)) == 128 * KiB
    assert cublaslt_workspace_bytes((9, 0)) == 128 * KiB  # capped at the cuBLAS workspace (unified sizing)
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", "nonsense")
    assert cublas_workspace_bytes((9, 0)) == 32 * MiB  # torch warns and keeps its default
    monkeypatch.setenv("CUBLASLT_WORKSPACE_SIZE", "4096")
    assert cublaslt_workspace_bytes((9, 0)) == 4 * MiB
    monkeypatch.setenv("TORCH_CUBLASLT_UNIFIED_WORKSPACE", "1")
    assert cublaslt_workspace_bytes((9, 0)) == 0  # cuBLASLt then uses cuBLAS's workspace


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_blas_workspaces_measured():
    """On the device: a thread's first matmul allocates exactly cublas_workspace_bytes through the caching
    allocator, and its first addmm with a bias (cuBLASLt's epilogue) cublaslt_workspace_bytes more; a second
    matmul on that thread allocates nothing more. Each runs on a thread of its own (a new cuBLAS handle)."""
    import threading

    from autoremat.torch_internals import clear_blas_workspaces

    cap = torch.cuda.get_device_capability()
    a = torch.randn(256, 256, device="cuda")
    bias = torch.randn(256, device="cuda")
    grown: list[int] = []

    def first_matmuls() -> None:
        torch.cuda.synchronize()
        start = torch.cuda.memory_allocated()
        out = a @ a
        del out
        grown.append(torch.cuda.memory_allocated() - start)
        out = torch.addmm(bias, a, a)
        del out
        grown.append(torch.cuda.memory_allocated() - start)
        out = torch.addmm(bias, a, a) + (a @ a)
        del out
        grown.append(torch.cuda.memory_allocated() - start)

    torch.cuda.synchronize()
    clear_blas_workspaces()  # a handle a finished thread gave back keeps its workspace: start from none
    thread = threading.Thread(target=first_matmuls)
    thread.start()
    thread.join()
    assert grown[0] == cublas_workspace_bytes(cap), grown
    assert grown[1] == cublas_workspace_bytes(cap) + cublaslt_workspace_bytes(cap), grown
    assert grown[2] == grown[1], grown
