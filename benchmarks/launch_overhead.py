"""The per-op launch overhead of the CPU device table (autoremat.model.devices, `launch_overhead_s`), and the
cost of one more graph call per step (`region_call_s`) and of one gradient hand-off, measured.

Two figures, each the slope of step time over op count, so that fixed per-call costs cancel:
  eager     an FX graph of N tiny aten ops (1-element tensors) run as Python, as compiler="eager" runs
            the planned graphs: seconds per op
  inductor  a function of N matmuls of 2x2 matrices compiled by Inductor (each one a library call
            Inductor cannot fuse), as compiler="inductor" runs: seconds per kernel
And per compiler, the step time (forward + backward) of a stack of REGION_BLOCKS tiny blocks planned by
autoremat.optimize with nothing recomputed, in three forms, the same ops in each: one graph per block
with each weight gradient handed to .grad as soon as it exists (regions=True, the default), one graph per
block with the gradients returned at each region's end (release_grads=False, as one graph returns them),
and one graph (regions=False). The second against the third, over the number of extra graphs, is the
cost of one AOTAutograd call (its forward and its backward); the first against the second, over the
number of parameters, is the cost of one hand-off. The forms are timed against each other in
alternating pairs (benchmarks/common/), so that the machine's drift between them cancels.

    PYTHONPATH=.:benchmarks python benchmarks/launch_overhead.py      # ~2 min on a 2-core CPU

Writes benchmarks/results/launch_overhead_cpu.json and prints the figures.
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import torch
import torch.fx as fx
from common import REPO, head_to_head

COUNTS = (16, 256)
REGION_BLOCKS = 16
PAIRS = 401  # head-to-head pairs per comparison of two forms (odd: the median is one pair's)


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
    """Step time of TinyStack cut per block (gradients handed to .grad one by one, and returned at each
    region's end) and as one graph, the forms timed against each other in alternating pairs
    (common.head_to_head): the cost of one more graph call, and of one gradient hand-off."""
    import autoremat

    torch.manual_seed(0)
    x = torch.randn(2, 4)
    forms = {"per_block": dict(regions=True), "per_block_returned": dict(regions=True, release_grads=False),
             "one_graph": dict(regions=False)}
    steps, graphs = {}, {}
    torch._dynamo.reset()
    for name, kw in forms.items():  # autoremat compiles a fresh code object per model: no reset between
        om = autoremat.optimize(TinyStack(REGION_BLOCKS), budget="1GB", example_inputs=(x,), optimizer=None,
                                compiler=compiler, progress=False, **kw)
        graphs[name] = om.num_graphs
        steps[name] = lambda f=om: f(x).sum().backward()
        for _ in range(20):
            steps[name]()

    def extra_s(a: str, b: str) -> float:  # median seconds a step of `a` takes beyond one of `b`
        h = head_to_head(steps[a], steps[b], PAIRS, lambda: None)
        return (h["ratio"] - 1) * h["b_s"]

    extra = graphs["per_block"] - graphs["one_graph"]
    handed = sum(1 for _ in TinyStack(REGION_BLOCKS).parameters())
    with_handoffs, returned, handoffs = (extra_s("per_block", "one_graph"), extra_s("per_block_returned", "one_graph"),
                                         extra_s("per_block", "per_block_returned"))
    return {"graphs_per_block": graphs["per_block"], "graphs_one": graphs["one_graph"], "parameters_handed": handed,
            "pairs": PAIRS,
            # both with the hand-offs: what region_call_s stands for (release_grads=True is the default)
            "s_per_graph_call_with_handoffs": with_handoffs / extra,
            # gradients returned at each region's end, as one graph returns them: the graph call alone
            "s_per_graph_call": returned / extra,
            "s_per_handoff": handoffs / handed}


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
