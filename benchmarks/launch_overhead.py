"""The per-op launch overhead of the CPU device table (autoremat.devices, `launch_overhead_s`), measured.

Two figures, each the slope of step time over op count, so that fixed per-call costs cancel:
  eager     an FX graph of N tiny aten ops (1-element tensors) run as Python, as compiler="eager" runs
            the planned graphs: seconds per op
  inductor  a function of N matmuls of 2x2 matrices compiled by Inductor (each one a library call
            Inductor cannot fuse), as compiler="inductor" runs: seconds per kernel

    python benchmarks/launch_overhead.py      # ~1 min on a 2-core CPU

Writes benchmarks/results/launch_overhead_cpu.json and prints the figures.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.fx as fx

REPO = Path(__file__).resolve().parent.parent
COUNTS = (16, 256)


def _seconds(fn, *args, reps: int = 200) -> float:
    for _ in range(10):
        fn(*args)
    times = []
    for _ in range(7):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn(*args)
        times.append((time.perf_counter() - t0) / reps)
    return statistics.median(times)


def eager_graph(n: int) -> fx.GraphModule:
    g = fx.Graph()
    x = g.placeholder("x")
    v = x
    for i in range(n):
        v = g.call_function(torch.ops.aten.mul.Tensor if i % 2 else torch.ops.aten.add.Tensor, (v, x))
    g.output(v)
    return fx.GraphModule(torch.nn.Module(), g)


def matmul_chain(n: int):
    def f(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        for _ in range(n):
            a = a @ b
        return a
    return f


def slope(times: dict[int, float]) -> float:
    lo, hi = COUNTS
    return (times[hi] - times[lo]) / (hi - lo)


def main() -> None:
    torch.set_num_threads(1)
    x = torch.ones(1)
    eager = {n: _seconds(eager_graph(n), x) for n in COUNTS}
    a, b = torch.eye(2), torch.eye(2)
    compiled = {}
    for n in COUNTS:
        torch._dynamo.reset()
        compiled[n] = _seconds(torch.compile(matmul_chain(n), backend="inductor"), a, b, reps=50)
    out = {"torch": torch.__version__, "threads": 1, "counts": list(COUNTS),
           "eager_fx_s_per_op": slope(eager), "inductor_s_per_kernel": slope(compiled),
           "eager_fx_call_s": eager, "inductor_call_s": compiled}
    print(json.dumps(out, indent=1))
    dest = REPO / "benchmarks" / "results" / "launch_overhead_cpu.json"
    dest.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {dest}", file=sys.stderr)


if __name__ == "__main__":
    main()
