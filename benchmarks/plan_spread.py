"""The same plan request made several times in one process: how far apart the plans' predicted times are.

    python benchmarks/plan_spread.py                    # 7B Llama, bf16, outputs="loss", 102.98 GiB, 3 repeats
    python benchmarks/plan_spread.py --repeats 5 --budget 111712037893

Planning at a 7B Llama's scale stops the ILP at wall-clock limits (solver.py: `time_limit`); the heuristics'
searches (`heuristics.block_mode_plans`, `heuristics.spend_slack`) are bounded by counts of simulations, so
where the ILP finds no plan the answer is the same on every request. This measures the spread of identical
requests, the noise under which precision_at_scale.py's rows are compared. Each request is one of those rows'
(`common.scale_step`: meta device, H100 roofline, AdamW, the loss in 16 chunks, compiler="eager").
Writes benchmarks/results/plan_spread_llama.md.
"""

from __future__ import annotations

import argparse
import time

import torch
from common import REPO, llama_7b, scale_step

from autoremat.passes import loss_chunks

DEFAULT_BUDGET = 110570796456  # precision_at_scale_llama_loss.md's lowest budget (102.98 GiB)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--budget", type=int, default=DEFAULT_BUDGET)
    ap.add_argument("--precision", default="bf16", choices=("fp32", "bf16", "auto"))
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    torch.set_num_threads(1)
    loss_chunks.CANDIDATES = (16,)
    model, inputs, label = llama_7b()
    rows = []
    for k in range(a.repeats):
        t0 = time.perf_counter()
        r, om = scale_step(model, inputs, a.budget, a.precision, outputs="loss")
        s = om.plan.solver
        rows.append((k + 1, r["time_s"] * 1e3, r["recompute_s"] * 1e3, r["peak"], s["status"], s["path"],
                     s["solve_time_s"], time.perf_counter() - t0))
        print(f"{k + 1}: {rows[-1][1]:.2f} ms, {s['status']} ({s['path']}, {s['solve_time_s']:.1f} s)", flush=True)
    times = [r[1] for r in rows]
    spread = (max(times) - min(times)) / min(times)
    lines = [f"# The same plan request {a.repeats} times in one process: {label}", "",
             f"`python benchmarks/plan_spread.py --budget {a.budget} --precision {a.precision} --repeats {a.repeats}` "
             f"(torch {torch.__version__}; meta, H100 roofline, outputs='loss', 16 loss chunks)", "",
             "| run | predicted step (ms) | recompute (ms) | predicted peak (B) | solver status | path | solve (s) | wall (s) |",
             "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {k} | {t:.2f} | {rc:.2f} | {pk:,} | {st} | {path} | {sv:.1f} | {w:.0f} |"
              for k, t, rc, pk, st, path, sv, w in rows]
    lines += ["", f"Spread of the predicted step time: {spread * 100:.2f}% of the fastest ({min(times):.2f} to "
              f"{max(times):.2f} ms)."]
    out = REPO / "benchmarks" / "results" / "plan_spread_llama.md"
    out.write_text("\n".join(lines) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
