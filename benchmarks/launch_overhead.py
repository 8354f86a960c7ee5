"""The per-op launch overhead of the CPU device table (autoremat.devices, `launch_overhead_s`), and the
cost of one more graph call per step (`region_call_s`), measured.

Two figures, each the slope of step time over op count, so that fixed per-call costs cancel:
  eager     an FX graph of N tiny aten ops (1-element tensors) run as Python, as compiler="eager" runs
            the planned graphs: seconds per op
  inductor  a function of N matmuls of 2x2 matrices compiled by Inductor (each one a library call
            Inductor cannot fuse), as compiler="inductor" runs: seconds per kernel
And per compiler, the step time (forward + backward) of a stack of REGION_BLOCKS tiny blocks planned by
autoremat.optimize with nothing recomputed, one graph per block (regions=True) against one graph
(regions=False): the difference over the number of extra graphs is the cost of one AOTAutograd call
(its forward and its backward), the same ops either way.

    python benchmarks/launch_overhead.py      # ~2 min on a 2-core CPU

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
REGION_BLOCKS = 16


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


class TinyStack(torch.nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return x


def region_call_seconds(compiler: str) -> dict:
    """Step time of TinyStack cut per block and as one graph; the cost of one more graph call."""
    import autoremat

    torch.manual_seed(0)
    x = torch.randn(2, 4)
    times, graphs = {}, {}
    for regions in (True, False):
        torch._dynamo.reset()
        model = TinyStack(REGION_BLOCKS)
        om = autoremat.optimize(model, budget="1GB", example_inputs=(x,), optimizer=None, compiler=compiler,
                                regions=regions, progress=False)
        graphs[regions] = om.num_graphs
        times[regions] = _seconds(lambda f=om: f(x).sum().backward(), reps=100)
    return {"step_s_per_block": times[True], "step_s_one_graph": times[False], "graphs_per_block": graphs[True],
            "graphs_one": graphs[False],
            "s_per_graph_call": (times[True] - times[False]) / (graphs[True] - graphs[False])}


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
           "eager_fx_call_s": eager, "inductor_call_s": compiled,
           "region_call": {c: region_call_seconds(c) for c in ("inductor", "eager")}}
    print(json.dumps(out, indent=1))
    dest = REPO / "benchmarks" / "results" / "launch_overhead_cpu.json"
    dest.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {dest}", file=sys.stderr)


if __name__ == "__main__":
    main()
