"""How close the op-by-op bound of a larger chunk count comes to the real trace (loss_region.bounds.least_ops_time).

The planner skips tracing the loss region at k chunks when a lower bound of that trace's time with nothing
recomputed, taken from the trace at b < k chunks, is already no faster than a plan it has. This script
traces each model's step at 1, 4, 16 and 64 chunks and prints, for each pair (b, k), the bound, the real
trace's time with nothing recomputed, and the share of the real increase the bound predicts. These are the
model's roofline times (milliseconds), not timings, so one run is the answer; a bound above the real trace
is printed as OVER (the planner could then skip a count that would have been faster).

    PYTHONPATH=.:benchmarks python benchmarks/chunk_bound.py [--compiler eager|inductor] [--outputs all|loss]
"""

from __future__ import annotations

import argparse
import copy
from pathlib import Path

import torch
from common import bert, head_lm

from autoremat.model.devices import get_device
from autoremat.passes.loss_chunks import LossOption
from autoremat.planning.loss_region.bounds import least_ops_time
from autoremat.planning.planner import CapturePlanner
from autoremat.planning.step_tracing import compile_and_trace
from autoremat.solve.solver import ops_once_time
from examples import models as ex

RESULTS = Path(__file__).parent / "results"
COUNTS = (1, 4, 16, 64)
PAIRS = ((4, 16), (4, 64), (16, 64))


def models() -> dict:
    """The loss-region models of plan_time.py --quick, at the sizes its tables show."""
    return {
        "gpt2 1L d64 2x64 V1024": lambda: ex.gpt2(2, 64, 1, 64, 4, 1024),
        "llama 2L d64 2x64 V1024": lambda: ex.llama(2, 64, 2, 64, 4, 1024),
        "bert 2L d64 4x64 V1024": lambda: bert(4, 64, 2, 64, 4, 1024),
        "gated head d32 4x64 V2048": lambda: head_lm(4, 64, 2048, 32, bias=False, gate=True),
        "biased head d32 4x64 V4096": lambda: head_lm(4, 64, 4096, 32, bias=True, gate=False),
    }


def traces(factory, compiler: str, outputs: str) -> tuple[dict[int, list], int]:
    """The step's profiles at each chunk count, and the loss region's token rows."""
    torch.manual_seed(0)
    model, inputs = factory()
    args, kwargs = ((), inputs) if isinstance(inputs, dict) else (tuple(inputs), {})
    out, rows = {}, 0
    for k in COUNTS:
        option = LossOption(outputs, k)
        planner = CapturePlanner(None, device="cpu", optimizer=None, pre_pass=option.pre_pass())
        compile_and_trace(copy.deepcopy(model), planner, compiler, args, kwargs)
        out[k] = planner.profiles
        rows = option.rows() if option.reports else rows
    return out, rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--compiler", default="eager", choices=("eager", "inductor"))
    ap.add_argument("--outputs", default="all", choices=("all", "loss"))
    ap.add_argument("--out", default=None, help="results file stem (default chunk_bound_cpu_<compiler>_<outputs>)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    dev = get_device("cpu")
    command = f"PYTHONPATH=.:benchmarks python benchmarks/chunk_bound.py --compiler {args.compiler} --outputs {args.outputs}"
    lines = ["# The op-by-op bound of a larger chunk count against the real trace\n", f"`{command}`  ",
             f"torch {torch.__version__}; times are the memory model's roofline with nothing recomputed (ms), "
             "not timings.\n", "| model | b -> k | time at b | bound for k | time at k | share of the increase | |",
             "|---|---|---|---|---|---|---|"]
    for name, factory in models().items():
        profiles, rows = traces(factory, args.compiler, args.outputs)
        base = {k: ops_once_time(g) for k, g in profiles.items()}
        for b, k in PAIRS:
            if rows % k:
                continue
            bound = least_ops_time(profiles[b], base[b], rows, b, k, dev)
            if bound is None:
                lines.append(f"| {name} | {b} -> {k} | {1e3 * base[b]:.3f} | no chunk tags | {1e3 * base[k]:.3f} | - | |")
                continue
            share = (bound - base[b]) / (base[k] - base[b]) if base[k] > base[b] else float("nan")
            verdict = "OVER" if bound > base[k] else ""
            lines.append(f"| {name} | {b} -> {k} | {1e3 * base[b]:.3f} | {1e3 * bound:.3f} | {1e3 * base[k]:.3f} "
                         f"| {share:.2f} | {verdict} |")
        print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    print(text)
    out = RESULTS / f"{args.out or f'chunk_bound_cpu_{args.compiler}_{args.outputs}'}.md"
    out.write_text(text)
    print(f"written to {out}")


if __name__ == "__main__":
    main()
