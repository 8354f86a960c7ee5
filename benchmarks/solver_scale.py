"""How the save/recompute ILP grows with depth: transformer stacks of 4 to 48 blocks, traced on the
meta device (no memory, no kernels run), planned at a budget in the middle of the feasible range.

    python benchmarks/solver_scale.py                 # depths 4 8 16 32 48, writes results/solver_scale_cpu.md
    python benchmarks/solver_scale.py --depths 4 8    # a quick look

Per depth it prints the joint graph's nodes, the ILP's variables and constraints (the local model;
the block-drag model is about the same size), the time of `solver.solve` and its objective (the
predicted recompute time). With --full-limit S it also solves the full ILP alone (every node its own
variables, no shared blocks, no heuristics) for up to S seconds and prints its objective beside the
default solve's, for depths where that ILP still finishes.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pulp  # noqa: E402

from autoremat.capture.aot import capture  # noqa: E402
from autoremat.model.profile import profile_graph  # noqa: E402
from autoremat.solve import lp, solver  # noqa: E402
from examples.models import TransformerStack  # noqa: E402


def measure(depth: int, d: int, seq: int, batch: int, time_limit: float, full_limit: float) -> dict:
    model = TransformerStack(n_layer=depth, d=d, n_head=4, dropout=0.1).to("meta")
    t0 = time.perf_counter()
    (cg,) = capture(model, (torch.empty(batch, seq, d, device="meta"),))
    gp = profile_graph(cg, "cpu")
    trace_s = time.perf_counter() - t0
    hi = solver.evaluate([gp], solver.save_all([gp]))[1].peak
    t0 = time.perf_counter()
    lo = solver.smallest_peak([gp], options=solver.SolverOptions(time_limit=time_limit)).peak
    floor_s = time.perf_counter() - t0
    budget = (lo + hi) // 2
    ilp = solver.IlpModel([gp], 1, block_drag=False)
    build_s = ilp.build_s
    variables, constraints = len(ilp.prob.variables()), lp.constraint_count(ilp.prob)
    t0 = time.perf_counter()
    mip_status = ilp.solve(budget, lp.highs(time_limit, solver.DEFAULT_GAP)).status
    mip_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    dec = solver.solve([gp], budget, options=solver.SolverOptions(time_limit=time_limit))
    solve_s = time.perf_counter() - t0
    full_ms, full_s = None, None
    if full_limit > 0:
        t0 = time.perf_counter()
        full = solver._solve_model(ilp, [gp], budget, "auto", 1e-4, 1, 5, time.perf_counter() + full_limit)
        full_s = time.perf_counter() - t0
        full_ms = full.recompute_time_s * 1e3 if full is not None else None
    return {"full_ms": full_ms, "full_s": full_s, "depth": depth, "nodes": len(gp.nodes), "variables": variables, "constraints": constraints,
            "build_s": build_s, "mip_s": mip_s, "mip_status": mip_status,
            "trace_s": trace_s, "floor_s": floor_s, "solve_s": solve_s, "objective_ms": dec.recompute_time_s * 1e3,
            "status": dec.status, "path": str(dec.path), "budget": budget, "peak": dec.peak, "lo": lo, "hi": hi}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--depths", type=int, nargs="+", default=[4, 8, 16, 32, 48])
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--time-limit", type=float, default=10.0)  # the library's default
    ap.add_argument("--full-limit", type=float, default=0.0, help="also solve the full ILP alone for up to this long")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "solver_scale_cpu.md"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    header = ("| depth | nodes | variables | constraints | ILP build s | one MIP s | trace s | floor s | solve s "
              "| objective ms | status | path | activation peak / budget | full ILP alone: ms (s) | objective / full ILP's |")
    rows = [header, "|" + "---|" * 15]
    print(header)
    for depth in args.depths:
        r = measure(depth, args.width, args.seq, args.batch, args.time_limit, args.full_limit)
        full = "-" if r["full_s"] is None else (
            f"none in {r['full_s']:.0f} s" if r["full_ms"] is None else f"{r['full_ms']:.3f} ({r['full_s']:.1f} s)")
        ratio = f"{r['objective_ms'] / r['full_ms']:.3f}" if r["full_ms"] else "-"
        row = (f"| {r['depth']} | {r['nodes']} | {r['variables']} | {r['constraints']} | {r['build_s']:.2f} | "
               f"{r['mip_s']:.2f} ({r['mip_status']}) | {r['trace_s']:.1f} | "
               f"{r['floor_s']:.1f} | {r['solve_s']:.1f} | {r['objective_ms']:.3f} | {r['status']} | {r['path']} | "
               f"{r['peak'] / 2**20:.1f} / {r['budget'] / 2**20:.1f} MiB | {full} | {ratio} |")
        rows.append(row)
        print(row, flush=True)
    note = (f"\nTransformerStack(d={args.width}, 4 heads, dropout 0.1), batch {args.batch}, seq {args.seq}, traced on "
            f"the meta device; budget = middle of [smallest peak found, save-all peak]; solver time limit "
            f"{args.time_limit:.0f} s; torch {torch.__version__}, PuLP {pulp.__version__}, Python "
            f"{sys.version.split()[0]}, {os.cpu_count()} CPUs, 1 thread. 'ILP build s' is building the full model "
            f"(`IlpModel`, PuLP's modelling layer), 'one MIP s' one HiGHS solve of it at the budget (gap 1%, PuLP "
            f"handing the model over included). 'floor s' is "
            f"`smallest_peak` (what BudgetError needs), 'solve s' is `solver.solve` (per-block mode search, then "
            f"the ILP models while the time lasts: the full model first, then identical blocks sharing decisions, "
            f"then the block-drag ones; path '/shared-blocks' means the shared model's plan won; default gap 1%). "
            f"'variables' and 'constraints' count the full (unshared) model, chained running-sum variables "
            f"included. 'full ILP alone' is that model solved on its own with gap 1e-4 and the given limit; "
            f"its ratio is the default solve's objective over it.\n\nCommand: `python benchmarks/solver_scale.py "
            f"{' '.join(sys.argv[1:])}`\n")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("# Solver scale (CPU)\n\n" + "\n".join(rows) + "\n" + note)
    print(note)


if __name__ == "__main__":
    main()
