"""Kernel scratch, measured: the temporary memory each op allocates beyond its outputs.

`calibrate_scratch` runs each distinct op of a profiled graph once on real tensors of the traced
shapes and strides and records the scratch in the graph's profile; `scratch_estimate` is what an op
that cannot be measured is counted at instead.

Every distinct op is measured, however long that takes: the cost is bounded by one run of each
distinct op (at most one forward and backward, the verification step runs a whole one), and a
wall-clock limit would make the planned peak, and the smallest budget `BudgetError` reports, depend
on how loaded the machine was. Measurements are kept for the process (`_MEASURED`), so the graphs
planned again for loss-chunk candidates, precision checks, a re-plan at the reported floor or a
graph break with known shapes run no kernel twice.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from autoremat.capture.captured import CapturedGraph
from autoremat.model.graph_profile import GraphProfile
from autoremat.model.profile import (  # the bytes of a traced value, as profiled
    _dense_bytes,
    _nbytes,
    _tensors,
)
from autoremat.passes import fused_attention, fused_linear_loss
from autoremat.torch_internals import (
    OpOverload,
    tree_map,
    unset_fake_temporarily,
)


def _materialize(val, device: torch.device):
    """A real tensor shaped like the fake `val` (random floats, zero integers: always valid indices)."""
    if not isinstance(val, torch.Tensor):
        return val
    t = torch.empty_strided(tuple(val.shape), tuple(val.stride()), dtype=val.dtype, device=device)
    flat = torch.empty(0, dtype=val.dtype, device=device).set_(t.untyped_storage())  # fill every byte once
    if flat.is_floating_point() or flat.is_complex():
        flat.normal_()
    else:
        flat.zero_()
    return t


# (device, threads, op and argument signature) -> (scratch bytes, whether the real output strides differ
# from the traced ones). Only successful measurements are kept: a failure may be passing (a profiler
# that was running). Thread count is part of the key: SDPA's CPU blocks are allocated per thread.
_MEASURED: dict[tuple[str, int, str], tuple[int, bool]] = {}
_MEASURED_MAX = 100_000  # entries; a process that plans that many distinct ops starts afresh


def calibrate_scratch(cg: CapturedGraph, gp: GraphProfile) -> int:
    """Measure each op's temporary memory once on real tensors of the traced shapes.

    Some kernels allocate beyond their outputs (a CPU convolution's column buffer, a GELU
    backward on an expanded gradient, SDPA's per-thread blocks); the memory model needs that to
    predict the true peak. Each distinct (op, shapes, arguments) runs once under the profiler; the
    scratch is its allocation peak minus the bytes of its outputs. An op that cannot be measured
    (it fails on made-up inputs, or a profiler was already running) is never counted as 0: it gets
    `scratch_estimate`, and `gp.notes` says which ops and why. The run also checks that each
    kernel lays out its output as the fake tensor did; a view of an output laid out otherwise would
    copy unseen or fail, so `gp.notes` names such ops too. Returns how many distinct ops have
    measured scratch, run now or earlier in this process. Graphs traced on the meta device have no
    real memory: only the scratch a fused attention's or a fused linear + loss's GPU kernel is known
    to allocate (their `meta_scratch`) is booked there.
    """
    if cg.device == "meta":
        for n in cg.joint.graph.nodes:
            if n.name in gp.nodes:
                gp.nodes[n.name].transient_bytes += fused_attention.meta_scratch(n) + fused_linear_loss.meta_scratch(n)
        return 0
    device = torch.device(cg.device)
    scratch: dict[str, int] = {}  # by (op, argument signature)
    unmeasured: dict[str, str] = {}  # op -> why its scratch was estimated
    relaid: set[str] = set()  # ops whose real output strides differ from the traced ones
    count = 0
    # We are inside AOTAutograd's tracing: step out of its fake-tensor mode to run real kernels. Random kernels
    # among them (an attention with dropout draws inside CUDA's kernel) would advance the generators; planning
    # may run inside the user's own call (a recompile, the torch.compile backend), so the random stream the
    # model draws from next must be the one it would have been without us: the generators are put back.
    cuda = [device.index if device.index is not None else torch.cuda.current_device()] if device.type == "cuda" else []
    with unset_fake_temporarily(), torch.random.fork_rng(devices=cuda):
        for n in cg.joint.graph.nodes:
            prof = gp.nodes.get(n.name)
            if n.op != "call_function" or prof is None or not isinstance(n.target, OpOverload):
                continue
            if prof.storage and prof.storage != n.name and not prof.writes_into:  # views allocate nothing
                continue
            key = repr((str(n.target), fx.node.map_arg((n.args, n.kwargs), lambda a: _sig(a.meta.get("val")))))
            if key not in scratch:
                measured = _measured(n, device, key)
                if isinstance(measured, str):
                    unmeasured.setdefault(str(n.target), measured)
                    scratch[key] = scratch_estimate(n)
                else:
                    count += 1
                    scratch[key], was_relaid = measured
                    if was_relaid:
                        relaid.add(str(n.target))
            prof.transient_bytes += scratch[key]
    if unmeasured:
        by_reason: dict[str, list[str]] = {}
        for op, reason in sorted(unmeasured.items()):
            by_reason.setdefault(reason, []).append(op)
        ops = "; ".join(f"{', '.join(names)} ({reason})" for reason, names in by_reason.items())
        gp.notes.append(f"kernel scratch not measured for {len(unmeasured)} op(s), estimated as a copy of each "
                        f"input and output instead: {ops}")
    if relaid:
        gp.notes.append(f"the real output strides of {', '.join(sorted(relaid))} differ from the traced ones: a "
                        "view of such an output copies memory the plan does not predict, or fails. Please report "
                        "this model")
    return count


def _measured(n: fx.Node, device: torch.device, key: str) -> tuple[int, bool] | str:
    """(scratch bytes, output relaid) for the op `key` names, from this process's earlier
    measurement or by running it now; or why it could not be measured."""
    cache_key = (str(device), torch.get_num_threads(), key)
    if cache_key not in _MEASURED:
        measured = _measure_op(n, device)
        if isinstance(measured, str):
            return measured
        if len(_MEASURED) >= _MEASURED_MAX:
            _MEASURED.clear()
        _MEASURED[cache_key] = measured
    return _MEASURED[cache_key]


def scratch_estimate(n: fx.Node) -> int:
    """Scratch assumed for an op that could not be measured: room for a contiguous copy of each of
    its tensor inputs and outputs. An estimate, said to be one in the plan's notes, never a silent
    0, and not a bound: some measured CPU kernels exceed it (benchmarks/scratch_survey.py lists
    which, and by how much: results/scratch_survey_cpu.md). The verification step measures the real
    peak and plans again when it is over."""
    tensors = [t for a in n.all_input_nodes for t in _tensors(a.meta.get("val"))] + _tensors(n.meta.get("val"))
    return sum(_dense_bytes(t) for t in tensors)


def _sig(val) -> object:
    if isinstance(val, torch.Tensor):
        return (tuple(val.shape), tuple(val.stride()), str(val.dtype))
    return repr(val)


def _layout(tensors: list[torch.Tensor]) -> list[tuple]:
    return [tuple((size, stride) for size, stride in zip(t.shape, t.stride()) if size > 1) for t in tensors]


def _measure_op(n: fx.Node, device: torch.device) -> tuple[int, bool] | str:
    """(the op's scratch in bytes, whether its real output strides differ from the traced ones), or
    why it could not be measured."""
    from autoremat.measure import measure_peak  # a measuring tool, not a pipeline stage

    out_bytes, relaid = [0], [False]
    try:
        args, kwargs = tree_map(
            lambda a: _materialize(a.meta.get("val"), device) if isinstance(a, fx.Node) else a, (n.args, n.kwargs)
        )

        def run() -> None:
            out = n.target(*args, **kwargs)
            relaid[0] = _layout(_tensors(out)) != _layout(_tensors(n.meta.get("val")))
            storages = {t.untyped_storage().data_ptr(): _nbytes(t) for t in _tensors(out)}
            out_bytes[0] = sum(storages.values())
            del out

        _, m = measure_peak(run, device=device, baseline_bytes=0)
    except Exception as e:  # e.g. an op that rejects made-up data (bernoulli of p outside [0, 1])
        return f"{type(e).__name__}: {str(e).splitlines()[0][:80] if str(e) else 'no message'}"
    return max(0, m.delta_peak_bytes - out_bytes[0]), relaid[0]
