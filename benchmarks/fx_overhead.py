"""What the eager-FX path costs by itself (issue #11's time goal at checkpoint's peak).

At a budget equal to checkpoint-every-block's measured peak, autoremat's plan recomputes less than
checkpointing does, yet its step can be slower. This separates the two causes, in one process, each row
paired with the eager step run just before it:

    eager                      plain PyTorch (the reference)
    checkpoint                 torch.utils.checkpoint on every block (floor.py's)
    autoremat @ checkpoint     budget = checkpoint's measured steady peak, compiler="eager"
    autoremat, no recompute    a budget nothing has to be recomputed under, compiler="eager": what
                               running the captured aten graphs as Python costs against eager's modules
    same, Inductor             compiler="inductor" (where this machine's C++ compiler runs it)

    python benchmarks/fx_overhead.py [--models stack,gpt2] [--steps 9]

Writes benchmarks/results/fx_overhead_cpu.md. Sizes are floor.py's default ones.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time
from pathlib import Path

import floor
import remat_vs_peers as peers
import torch
from paired import paired_times

import autoremat
from autoremat.measure import measure_peak

MiB = 2**20
NO_RECOMPUTE = 64 * 2**30  # far above any of these models' no-recompute totals


def checkpointed(model):
    return floor.checkpoint_every_block(model), {}


def planned(example_inputs, budget: int, compiler: str):
    def build(model):
        torch._dynamo.reset()
        om = autoremat.optimize(model, budget=budget, example_inputs=example_inputs, optimizer=None, outputs="loss",
                                compiler=compiler)
        return om, dict(predicted_recompute=om.plan.overhead, compiler=om.plan.compiler.get("used"))
    return build


def timed(bench: peers.Bench, build, n: int) -> dict:
    model = bench.fresh()
    fn, info = build(model)
    step = peers.make_step(fn, bench.args, bench.kwargs)
    step()
    step()  # warm: compiled, every .grad allocated
    _, m = measure_peak(step, device=bench.device, baseline_objs=(model, bench.ex))
    rt, et = paired_times(bench.eager_step, step, n, lambda: None)
    ratios = [r / e for r, e in zip(rt, et)]
    q1, _, q3 = statistics.quantiles(ratios, n=4)
    return dict(info, peak=m.peak_bytes, ratio=statistics.median(ratios), noise=(q3 - q1) / 2)


def one(cfg: dict, n: int) -> list[str]:
    bench = peers.Bench(cfg, torch.device("cpu"), n, print)
    rows = {"eager": timed(bench, lambda m: (m, {}), n), "checkpoint": timed(bench, checkpointed, n)}
    budget = rows["checkpoint"]["peak"]
    rows["autoremat @ checkpoint"] = timed(bench, planned(bench.ex, budget, "eager"), n)
    rows["autoremat, no recompute"] = timed(bench, planned(bench.ex, NO_RECOMPUTE, "eager"), n)
    rows["autoremat, no recompute, Inductor"] = timed(bench, planned(bench.ex, NO_RECOMPUTE, "inductor"), n)
    lines = [f"## {cfg['name']}: {cfg['kwargs']}", "",
             "| row | steady peak (MiB) | predicted recompute (`plan.overhead`) | compiler | time vs eager ± noise |",
             "|---|---|---|---|---|"]
    for name, r in rows.items():
        share = f"{r['predicted_recompute']:.3f}" if "predicted_recompute" in r else ""
        lines.append(f"| {name} | {r['peak'] / MiB:.2f} | {share} | {r.get('compiler', '')} | "
                     f"{r['ratio']:.3f} ± {r['noise']:.3f} |")
    at, ck, fx = rows["autoremat @ checkpoint"], rows["checkpoint"], rows["autoremat, no recompute"]
    lines += ["", f"autoremat @ checkpoint / checkpoint: {at['ratio'] / ck['ratio']:.3f}; the eager-FX path with "
              f"nothing recomputed / eager: {fx['ratio']:.3f}. The eager row is eager against eager: the machine's noise. Noise: half the interquartile range of the {n} paired "
              "ratios of each row.", ""]
    print("\n".join(lines), flush=True)
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="stack")
    ap.add_argument("--steps", type=int, default=9)
    a = ap.parse_args()
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    cfgs = [c for c in floor.configs(False) if c["name"] in a.models.split(",")]
    body = [line for cfg in cfgs for line in one(cfg, a.steps)]
    head = ["# The eager-FX path's own cost (issue #11) on cpu", "",
            f"Command: `python benchmarks/fx_overhead.py {' '.join(sys.argv[1:])}`, "
            f"{datetime.datetime.now().isoformat(timespec='seconds')}, torch {torch.__version__}, 1 thread, repo "
            f"{floor.git_state()}, wall {time.perf_counter() - t0:.0f} s, load average {floor.load_average()} at "
            "the end. Each row: median over the paired ratios (row step / the eager step just before it).", ""]
    out = Path(__file__).resolve().parent / "results" / "fx_overhead_cpu.md"
    out.write_text("\n".join(head + body))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
