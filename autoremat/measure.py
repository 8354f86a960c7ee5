"""
Measure the real peak memory of a region of code (e.g. one training step).

Two methods:
- CPU (and CUDA on request): the PyTorch profiler with profile_memory=True. It sees every
  allocation the c10 allocator makes inside the region, including those made by
  torch.compile'd code (aot_autograd, inductor). A TorchDispatchMode-based tracker would not
  do here: entering one makes a compiled function silently fall back to eager.
  The profiler only sees what happens inside the region, so the absolute peak is
  baseline (bytes already live before the region) + max running delta within it.
- CUDA: the caching allocator's own counters (max_memory_allocated), which are absolute.

Caveats of the profiler method:
- The CPU allocator only knows the size of blocks allocated while memory profiling was on. The
  free of an older block inside the region is not reported, so the peak errs high (never low)
  by up to that block. Free such tensors before the region (zero_grad(set_to_none=True) outside
  it), or run the warm-up step under a PeakMeter too: blocks it allocates are known later.
  That case also makes c10 print a one-time "Memory block of unknown size" warning to stderr.
- Profilers can't nest: the meter refuses to start inside another torch profiler.
- Allocations from every thread of the process count, merged in time order.

Usage (`autoremat.measure_peak` is this module's):
    out, m = autoremat.measure_peak(lambda: train_step(model, x), baseline_objs=(model, x, opt))
    print(m.peak_bytes, m)
or
    with PeakMeter(baseline_objs=(model, x)) as meter:
        train_step(model, x)
    print(meter.result.peak_bytes)

It also holds the one measure of how far two sets of gradients differ (`grad_rel_err`, and per parameter
`param_rel_errs`), which the tests, the benchmarks and the precision check all use.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # typing.Self is Python 3.11+; the package supports 3.10
    from typing import Self

import torch
from torch.profiler import ProfilerActivity, profile

from autoremat.torch_internals import allocation_events, is_traceable_wrapper_subclass, profiler_enabled

METHOD_PROFILER = "profiler"
METHOD_CUDA = "cuda_max_memory_allocated"


@dataclass
class PeakMeasurement:
    peak_bytes: int  # absolute: baseline + max delta
    baseline_bytes: int  # live before the region
    delta_peak_bytes: int  # max running delta within the region
    device: str  # "cpu" or "cuda:0"
    method: str  # "profiler" or "cuda_max_memory_allocated"

    def __str__(self) -> str:
        from autoremat.units import format_bytes

        return (f"peak {format_bytes(self.peak_bytes)} = {format_bytes(self.baseline_bytes)} live before + "
                f"{format_bytes(self.delta_peak_bytes)} at most inside ({self.method} on {self.device})")


# -----------------------------------------------------------------------------
# bytes already live: unique storages reachable from modules / optimizers / tensors


def _extent(t: torch.Tensor) -> tuple[int, int] | None:
    """The bytes of its storage that tensor t reaches, [first, last+1), or None if it has no elements."""
    if t.numel() == 0:
        return None
    first = last = t.storage_offset()
    for size, stride in zip(t.shape, t.stride()):
        reach = (size - 1) * stride
        if reach < 0:
            first += reach
        else:
            last += reach
    item = t.element_size()
    return first * item, (last + 1) * item


def _union_bytes(spans: list[tuple[int, int]]) -> int:
    total, end = 0, None
    for lo, hi in sorted(spans):
        if end is None or lo >= end:
            total += hi - lo
            end = hi
        elif hi > end:
            total += hi - end
            end = hi
    return total


def live_tensor_bytes(*objs: Any, device: str | torch.device | None = None) -> int:
    """
    Sum the bytes held by objs, each storage once. Understands tensors (and their .grad),
    nn.Modules (parameters, buffers, grads), optimizers (state tensors only: pass the model too
    for params and grads), and lists/tuples/sets/dicts of these, recursively.

    A tensor counts the part of its storage it reaches (from its first to its last element), and
    the parts of one storage reached by several tensors count once: tied weights, views and an
    object passed twice are not double counted, and a batch sliced from a larger tensor
    (`data[:4]`) counts its 4 rows, not the whole of `data` (pass `data` itself to count it all).
    If device is given, only storages on that device type (and index, if given) count.
    """
    want = None if device is None else torch.device(device)
    spans: dict[tuple[str, int | None, int], list[tuple[int, int]]] = {}

    def add_tensor(t: torch.Tensor) -> None:
        if is_traceable_wrapper_subclass(t):
            # wrapper subclasses (e.g. DTensor) have no storage of their own; the data lives
            # in their inner tensors
            inner_names, _ = t.__tensor_flatten__()
            for name in inner_names:
                add_tensor(getattr(t, name))
        elif t.device.type != "meta":
            dev = t.device
            if want is None or (
                dev.type == want.type
                and (want.index is None or dev.index == want.index)
            ):
                s = t.untyped_storage()
                extent = _extent(t)
                # zero-size storages all have data_ptr 0: skip them, they hold no memory
                # and would otherwise collide in the storage map
                if s.nbytes() > 0 and extent is not None:
                    spans.setdefault((dev.type, dev.index, s.data_ptr()), []).append(extent)
        # .grad is a separate allocation that is live as well; only leaves have one (reading
        # .grad of a non-leaf warns)
        if t.is_leaf and t.grad is not None:
            add_tensor(t.grad)

    def visit(obj: Any) -> None:
        if obj is None or isinstance(obj, (bool, int, float, complex, str, bytes)):
            return
        if isinstance(obj, torch.Tensor):
            add_tensor(obj)
        elif isinstance(obj, torch.nn.Module):
            for t in obj.parameters():
                add_tensor(t)
            for t in obj.buffers():
                add_tensor(t)
        elif isinstance(obj, torch.optim.Optimizer):
            visit(list(obj.state.values()))
        elif isinstance(obj, dict):
            visit(list(obj.values()))
        elif isinstance(obj, (list, tuple, set, frozenset)):
            for o in obj:
                visit(o)
        else:
            # refuse rather than silently count zero for something that may hold tensors
            raise TypeError(
                f"live_tensor_bytes: don't know how to find tensors in {type(obj)}"
            )

    for obj in objs:
        visit(obj)
    return sum(_union_bytes(s) for s in spans.values())


# -----------------------------------------------------------------------------
# profiler plumbing


def _profiler_active() -> bool:
    return profiler_enabled()


def allocation_deltas(prof: profile, device: torch.device) -> list[tuple[int, int]]:
    """(start_time_ns, signed bytes) for each allocation (+) / free (-) the profiler saw on device."""
    out: list[tuple[int, int]] = []
    for start_ns, nbytes, d in allocation_events(prof):
        if d.type == device.type and (
            device.index is None or d.index == device.index
        ):
            out.append((start_ns, nbytes))
    return out


def max_running_sum(deltas: list[tuple[int, int]]) -> int:
    # an alloc and a free can share a timestamp; putting frees first keeps the peak honest
    # rather than inflated by one block. The region starts at delta 0, so the max is >= 0.
    running = peak = 0
    for _, nbytes in sorted(deltas, key=lambda d: (d[0], d[1])):
        running += nbytes
        peak = max(peak, running)
    return peak


# -----------------------------------------------------------------------------
# the meter


class PeakMeter:
    """
    Context manager that measures the peak memory of its body; the result is in .result
    after exit. One meter measures one region; profilers can't nest, so a profiler-based meter
    refuses to start while any other torch profiler is active.

    device: "cpu" or a CUDA device. method: None picks the profiler on CPU and the allocator's
    counters on CUDA; "profiler" forces the profiler (on CUDA too).
    Baseline (profiler method only): baseline_bytes if given, else live_tensor_bytes of
    baseline_objs on that device (for CUDA with neither given: torch.cuda.memory_allocated()).
    With the CUDA counters the baseline is the allocator's memory_allocated() and the baseline
    arguments are ignored, since the allocator's own count is authoritative.
    """

    def __init__(
        self,
        *,
        device: str | torch.device = "cpu",
        baseline_bytes: int | None = None,
        baseline_objs: tuple = (),
        method: str | None = None,
    ) -> None:
        dev = torch.device(device)
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        if dev.type not in ("cpu", "cuda"):
            raise ValueError(f"unsupported device {dev}, expected cpu or cuda")
        if method is None:
            method = METHOD_CUDA if dev.type == "cuda" else METHOD_PROFILER
        if method not in (METHOD_PROFILER, METHOD_CUDA):
            raise ValueError(f"unknown method {method!r}")
        if method == METHOD_CUDA and dev.type != "cuda":
            raise ValueError(f"method {METHOD_CUDA!r} needs a cuda device, got {dev}")
        self.device = dev
        self.method = method
        self.baseline_bytes = baseline_bytes
        self.baseline_objs = baseline_objs
        self.result: PeakMeasurement | None = None
        self._prof: profile | None = None
        self._baseline = 0

    def __enter__(self) -> Self:
        if self._prof is not None:
            raise RuntimeError("PeakMeter is already running; it is not reentrant")
        self.result = None
        if self.device.type == "cuda":
            # finish queued work first, so that neither the baseline nor the peak reset sees
            # allocations that belong to code before the region
            torch.cuda.synchronize(self.device)
        if self.method == METHOD_CUDA:
            # note: this clobbers the process-wide peak stat that others might be reading
            torch.cuda.reset_peak_memory_stats(self.device)
            self._baseline = torch.cuda.memory_allocated(self.device)
            return self

        if self.baseline_bytes is not None:
            self._baseline = int(self.baseline_bytes)
        elif self.baseline_objs or self.device.type == "cpu":
            self._baseline = live_tensor_bytes(*self.baseline_objs, device=self.device)
        else:
            self._baseline = torch.cuda.memory_allocated(self.device)
        if _profiler_active():
            # a second profiler would not raise but silently break the outer one's results
            raise RuntimeError(
                "PeakMeter: a torch profiler is already active; profilers can't nest, "
                "so measure outside of it (or use device='cuda' with the allocator counters)"
            )
        # kineto prints stage/USDT banners to stderr on every start/stop; level 6 is above all
        # of its levels. setdefault keeps a user's explicit choice, and the variable only takes
        # effect if kineto has not been initialised yet in this process.
        os.environ.setdefault("KINETO_LOG_LEVEL", "6")
        prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            prof.start()
        self._prof = prof
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        prof, self._prof = self._prof, None
        if exc_type is not None:
            # the caller's exception wins: just stop measuring, without syncing a device that
            # may be in an error state and without a result
            if prof is not None:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    prof.stop()
            return
        if self.device.type == "cuda":
            # kernels (and the frees the caching allocator defers to stream order) must land
            # inside the region
            torch.cuda.synchronize(self.device)
        if self.method == METHOD_CUDA:
            peak = torch.cuda.max_memory_allocated(self.device)
            delta = max(0, peak - self._baseline)
        else:
            assert prof is not None
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                prof.stop()
            delta = max_running_sum(allocation_deltas(prof, self.device))
            peak = self._baseline + delta
        self.result = PeakMeasurement(
            peak_bytes=int(peak),
            baseline_bytes=int(self._baseline),
            delta_peak_bytes=int(delta),
            device=str(self.device),
            method=self.method,
        )


def measure_peak(
    fn: Callable[[], Any],
    *,
    device: str | torch.device = "cpu",
    baseline_bytes: int | None = None,
    baseline_objs: tuple = (),
    method: str | None = None,
) -> tuple[Any, PeakMeasurement]:
    """
    Run fn() once while measuring peak memory on device; return (fn's result, measurement).
    See PeakMeter for the meaning of the arguments. For compiled code, call fn once before
    measuring: compilation itself allocates, and that is not the step's memory.
    """
    meter = PeakMeter(
        device=device,
        baseline_bytes=baseline_bytes,
        baseline_objs=baseline_objs,
        method=method,
    )
    with meter:
        out = fn()
    assert meter.result is not None
    return out, meter.result


# --------------------------------------------------------------------------------------------
# gradient error

# A parameter whose gradient is zero in exact arithmetic (an attention key bias: softmax ignores a constant
# added to every key) is computed as rounding noise, ~1e-9 where others are ~0.3, and two roundings of zero
# differ by O(1) relative: a per-parameter ratio against its own norm reads that noise as a large error.
# Per parameter, each gradient is therefore measured against at least this share of the largest parameter
# gradient's norm: sqrt(fp32 eps) ~ 3.5e-4, far above the rounding of the sums involved, far below any
# real error in a parameter that matters.
GRAD_NOISE_FLOOR = torch.finfo(torch.float32).eps ** 0.5


def _grad_pairs(g, ref) -> list[tuple[str, torch.Tensor, torch.Tensor]] | None:
    """(name, g, ref) for each parameter, or None if the two name or count different parameters. Accepts
    {name: tensor} mappings, sequences of tensors (in the same order), or single tensors."""
    if isinstance(g, torch.Tensor) and isinstance(ref, torch.Tensor):
        g, ref = {"": g}, {"": ref}
    if not isinstance(g, dict):
        g = {str(i): t for i, t in enumerate(g)}
    if not isinstance(ref, dict):
        ref = {str(i): t for i, t in enumerate(ref)}
    if set(g) != set(ref) or any((g[n] is None) != (r is None) or (r is not None and g[n].shape != r.shape)
                                 for n, r in ref.items()):
        return None
    return [(n, g[n].detach(), r.detach()) for n, r in ref.items() if r is not None]


def _norms(a: torch.Tensor, r: torch.Tensor) -> tuple[float, float]:
    """(||a - r||, ||r||) in float64, one parameter converted at a time."""
    a, r = a.double(), r.to(a.device).double()
    return (a - r).norm().item(), r.norm().item()


def grad_rel_err(g, ref) -> float:
    """||g - ref|| / ||ref|| over all the gradients together, as one concatenated vector (in float64).

    `g` and `ref` are {name: gradient} (or sequences of gradients in one order, or two tensors). A parameter
    whose true gradient is zero adds only its rounding noise to the numerator, next to every other
    gradient's norm in the denominator, so it cannot dominate; an error in any parameter that carries a
    share of the gradient shows in proportion to that share. inf if the parameter sets differ; 0 for two
    all-zero sets, inf if only the reference is all zero."""
    pairs = _grad_pairs(g, ref)
    if pairs is None:
        return float("inf")
    num = den = 0.0
    for _, a, r in pairs:
        d, s = _norms(a, r)
        num, den = num + d * d, den + s * s
    num, den = num ** 0.5, den ** 0.5
    return num / den if den else (0.0 if num == 0 else float("inf"))


def param_rel_errs(g, ref, floor: float = GRAD_NOISE_FLOOR) -> dict[str, float]:
    """Per parameter, ||g_p - ref_p|| / max(||ref_p||, floor * max_q ||ref_q||): each parameter's own
    relative error, except that a gradient smaller than `floor` times the largest one is measured against
    that floor (GRAD_NOISE_FLOOR says why). Names a parameter that went wrong, where `grad_rel_err` gives
    one number. {"parameter sets differ": inf} if the two name, count or shape different parameters (a
    None gradient on one side only counts as different)."""
    pairs = _grad_pairs(g, ref)
    if pairs is None:
        return {"parameter sets differ": float("inf")}
    norms = {n: _norms(a, r) for n, a, r in pairs}
    least = floor * max((s for _, s in norms.values()), default=0.0)
    out = {}
    for n, (d, s) in norms.items():
        s = max(s, least)
        out[n] = d / s if s else (0.0 if d == 0 else float("inf"))
    return out
