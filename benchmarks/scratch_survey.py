"""Kernel scratch measured against the estimate used when it cannot be measured (scratch.py).

Each model of `floor.py` (its --quick sizes) is planned at a roomy budget in fp32, and the ones with a
16-bit path in bf16 and fp16 too; every op whose scratch calibration measured is compared with
`scratch.scratch_estimate` (a contiguous copy of each input and output). The table lists each op whose
measured scratch exceeds its estimate, by how much, and how long calibration took against the whole
planning: the evidence behind measuring every op with no time limit, and behind the estimate being
called an estimate, not a bound.

    python benchmarks/scratch_survey.py

Writes benchmarks/results/scratch_survey_cpu.md.
"""

from __future__ import annotations

import datetime
import time
from pathlib import Path

import torch
from common import FLOOR_SIZES, SEED

import autoremat
import autoremat.planning.planner as planner
from autoremat.model import scratch

SIXTEEN_BIT = ("stack", "gpt2", "llama", "resnet")  # the models whose 16-bit step runs in seconds on this CPU


def survey(factory, kwargs: dict, precision: str) -> tuple[list[tuple], float, float]:
    """(op rows, calibration seconds, planning seconds) for one model and precision. Every calibration
    starts with nothing kept from earlier ones, so its time is that of measuring every op."""
    rows: list[tuple] = []
    spent = [0.0]

    def calibrate(cg, gp):
        before = {k: p.transient_bytes for k, p in gp.nodes.items()}
        scratch._MEASURED.clear()
        t = time.perf_counter()
        count = scratch.calibrate_scratch(cg, gp)
        spent[0] += time.perf_counter() - t
        for n in cg.joint.graph.nodes:
            if n.name in gp.nodes and n.op == "call_function" and gp.nodes[n.name].transient_bytes > before[n.name]:
                rows.append((str(n.target), gp.nodes[n.name].transient_bytes - before[n.name],
                             scratch.scratch_estimate(n)))
        return count

    model, example = factory(**kwargs)
    original, planner.calibrate_scratch = planner.calibrate_scratch, calibrate
    try:
        t = time.perf_counter()
        autoremat.optimize(model, budget=10**12, example_inputs=example, verify=False, compiler="eager",
                           precision=precision, outputs="loss")
        return rows, spent[0], time.perf_counter() - t
    finally:
        planner.calibrate_scratch = original


def main() -> None:
    torch.set_num_threads(1)
    torch.manual_seed(SEED)
    lines = ["# Kernel scratch: measured against the estimate", "",
             f"`python benchmarks/scratch_survey.py`, {datetime.date.today()}, torch {torch.__version__}, 1 thread, "
             "CPU. Models: floor.py's --quick sizes, planned at a roomy budget, outputs=\"loss\".", "",
             "| model | precision | nodes with measured scratch | of them over the estimate | calibration s | planning s |",
             "|---|---|---|---|---|---|"]
    over: dict[tuple[str, str], tuple[float, int, int]] = {}
    for name, (factory, small, _) in FLOOR_SIZES.items():
        for precision in ("fp32", "bf16", "fp16"):
            if precision != "fp32" and name not in SIXTEEN_BIT:
                continue
            rows, calibration_s, planning_s = survey(factory, small, precision)
            exceeding = [(op, m, e) for op, m, e in rows if m > e]
            for op, m, e in exceeding:
                key = (op, precision)
                if key not in over or m / e > over[key][0]:
                    over[key] = (m / e, m, e)
            lines.append(f"| {name} | {precision} | {len(rows)} | {len(exceeding)} | {calibration_s:.1f} | "
                         f"{planning_s:.1f} |")
            print(lines[-1], flush=True)
    lines += ["", "Ops whose measured scratch exceeds the estimate (the largest ratio over the models above):", "",
              "| op | precision | measured B | estimate B | measured / estimate |", "|---|---|---|---|---|"]
    for (op, precision), (ratio, m, e) in sorted(over.items(), key=lambda kv: -kv[1][0]):
        lines.append(f"| `{op}` | {precision} | {m} | {e} | {ratio:.2f} |")
    out = Path(__file__).parent / "results" / "scratch_survey_cpu.md"
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines[-len(over) - 2:]))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
