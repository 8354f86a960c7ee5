"""PuLP 3 against PuLP 4 on autoremat's own ILP: build time and solve times, side by side in one run.

Python 3.12 and newer get PuLP 4 (a Rust modelling core, a different API, bridged by autoremat/solve/lp.py);
3.10 and 3.11 get PuLP 3. This script decides whether either major costs planning time. It runs in a
Python that has PuLP 4 installed and takes PuLP 3 from a separate folder:

    pip install --no-deps --target /tmp/pulp3 "pulp==3.3.2"
    python benchmarks/pulp_majors.py --pulp3 /tmp/pulp3                 # depths 8 24, 3 rounds
    python benchmarks/pulp_majors.py --pulp3 /tmp/pulp3 --depths 8 24 48

For each depth of a transformer stack (traced on the meta device) and each round, one subprocess per
major traces the stack, builds the save/recompute ILP (`IlpModel`, full and with identical blocks
sharing decisions) and solves it twice: for the smallest peak, then at 1.2x that peak. The majors
alternate within each round, so a busy machine slows both alike; the table gives each major's
median and the ratio PuLP 4 / PuLP 3 per column (below 1: PuLP 4 is faster). Writes
results/pulp_majors_cpu.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
COLUMNS = ("build_s", "min_peak_s", "budget_s")


def worker(depth: int) -> None:
    """One measurement, printed as one JSON line per model variant (full, shared blocks)."""
    import time

    import pulp
    import torch

    sys.path.insert(0, str(REPO))
    from autoremat.capture.aot import capture
    from autoremat.model.profile import profile_graph
    from autoremat.solve import lp, solver
    from examples.models import TransformerStack

    torch.set_num_threads(1)
    model = TransformerStack(n_layer=depth, d=64, n_head=4, dropout=0.1).to("meta")
    (cg,) = capture(model, (torch.empty(4, 128, 64, device="meta"),))
    gp = profile_graph(cg, "cpu")
    for shared in (False, True):
        t0 = time.perf_counter()
        model_ = solver.IlpModel([gp], 1, block_drag=False, shared_blocks=shared)
        build_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        low = model_.solve(None, lp.highs(60, solver.MIN_PEAK_GAP), min_peak=True)
        min_peak_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        at = model_.solve(int(low.predicted_peak * 1.2), lp.highs(60, solver.DEFAULT_GAP))
        budget_s = time.perf_counter() - t0
        print(json.dumps({"pulp": pulp.__version__, "shared": shared, "build_s": build_s, "min_peak_s": min_peak_s,
                          "budget_s": budget_s, "statuses": [low.status, at.status],
                          "variables": len(model_.prob.variables()),
                          "constraints": lp.constraint_count(model_.prob)}), flush=True)


def run_worker(depth: int, pulp3: str | None) -> list[dict]:
    env = dict(os.environ)
    if pulp3:
        env["PYTHONPATH"] = os.pathsep.join([pulp3, env.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, __file__, "--worker", str(depth)], env=env, capture_output=True, text=True,
                         check=True)
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pulp3", help="a folder holding PuLP 3 (pip install --target)")
    ap.add_argument("--depths", type=int, nargs="+", default=[8, 24])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "pulp_majors_cpu.md"))
    args = ap.parse_args()
    if args.worker is not None:
        worker(args.worker)
        return
    if not args.pulp3:
        ap.error("--pulp3 DIR is required: a folder with PuLP 3 installed by pip install --target")
    header = ("| depth | model | variables | constraints | PuLP 3 build s | PuLP 4 build s | 4 / 3 | PuLP 3 min-peak s "
              "| PuLP 4 min-peak s | 4 / 3 | PuLP 3 at-budget s | PuLP 4 at-budget s | 4 / 3 | statuses (3; 4) |")
    rows = [header, "|" + "---|" * 14]
    print(header, flush=True)
    versions = {}
    for depth in args.depths:
        runs: dict[str, list[list[dict]]] = {"3": [], "4": []}
        for _ in range(args.rounds):
            for major, extra in (("3", args.pulp3), ("4", None)):
                result = run_worker(depth, extra)
                versions[major] = result[0]["pulp"]
                runs[major].append(result)
        for i, name in enumerate(("full", "shared blocks")):
            med = {m: {c: statistics.median(r[i][c] for r in runs[m]) for c in COLUMNS} for m in runs}
            spread = {m: {c: (min(r[i][c] for r in runs[m]), max(r[i][c] for r in runs[m])) for c in COLUMNS}
                      for m in runs}
            cells = []
            for c in COLUMNS:
                cells += [f"{med['3'][c]:.2f} ({spread['3'][c][0]:.2f}-{spread['3'][c][1]:.2f})",
                          f"{med['4'][c]:.2f} ({spread['4'][c][0]:.2f}-{spread['4'][c][1]:.2f})",
                          f"{med['4'][c] / max(med['3'][c], 1e-9):.2f}"]
            first3, first4 = runs["3"][0][i], runs["4"][0][i]
            row = (f"| {depth} | {name} | {first4['variables']} | {first4['constraints']} | " + " | ".join(cells)
                   + f" | {', '.join(first3['statuses'])}; {', '.join(first4['statuses'])} |")
            rows.append(row)
            print(row, flush=True)
    import torch

    note = (f"\nMedians of {args.rounds} rounds (min-max in brackets), the majors alternating within each round; "
            f"PuLP 3 = {versions.get('3')}, PuLP 4 = {versions.get('4')}; HiGHS through highspy, 1 thread, gap "
            f"1e-3 for the smallest peak and 1% at the budget (the library's settings); TransformerStack(d=64, "
            f"4 heads, dropout 0.1), batch 4, seq 128, on the meta device; torch {torch.__version__}, Python "
            f"{sys.version.split()[0]}, {os.cpu_count()} CPUs. 'build s' is `IlpModel(...)` (PuLP's modelling "
            f"layer); the solve columns include PuLP handing the model to HiGHS and reading the solution back."
            f"\n\nCommand: `python benchmarks/pulp_majors.py {' '.join(sys.argv[1:])}`\n")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("# PuLP 3 against PuLP 4 on autoremat's ILP (CPU)\n\n" + "\n".join(rows) + "\n" + note)
    print(note)


if __name__ == "__main__":
    main()
