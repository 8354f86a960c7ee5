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
    same, release_grads=False  gradients returned at each region's end instead of handed to .grad one by one
                               (one re-entrant autograd call per parameter): what that hand-off costs
    same, regions=False        one graph for the whole step (and no hand-off): what cutting it costs

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


def planned(example_inputs, budget: int, compiler: str, **options):
    def build(model):
        torch._dynamo.reset()
        om = autoremat.optimize(model, budget=budget, example_inputs=example_inputs, optimizer=None, outputs="loss",
                                compiler=compiler, **options)
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
    return dict(info, peak=m.peak_bytes, ratio=statistics.median(ratios), noise=(q3 - q1) / 2,
                seconds=statistics.median(rt))


def hand_off_cost(model: torch.nn.Module, repeats: int = 7) -> tuple[float, float]:
    """Microseconds per parameter, inside a running backward, of what `regions.accumulate_grad` does
    (a re-entrant `torch.autograd.backward(param, grad)`) and of the in-place add into `.grad` that
    eager's AccumulateGrad does: the difference is the hand-off's own cost. Medians over `repeats`."""
    params = list(model.parameters())
    grads = [torch.randn_like(p) for p in params]
    for p in params:
        p.grad = torch.zeros_like(p)
    times: dict[str, list[float]] = {"backward": [], "add": []}

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 1

        @staticmethod
        def backward(ctx, g):
            for how, run in (("backward", torch.autograd.backward), ("add", lambda p, gr: p.grad.add_(gr))):
                t0 = time.perf_counter()
                for p, gr in zip(params, grads):
                    run(p, gr)
                times[how].append((time.perf_counter() - t0) / len(params) * 1e6)
            return g

    x = torch.randn(4, requires_grad=True)
    for _ in range(repeats):
        Probe.apply(x).sum().backward()
    return statistics.median(times["backward"]), statistics.median(times["add"])


def one(cfg: dict, n: int) -> list[str]:
    bench = peers.Bench(cfg, torch.device("cpu"), n, print)
    rows = {"eager": timed(bench, lambda m: (m, {}), n), "checkpoint": timed(bench, checkpointed, n)}
    budget = rows["checkpoint"]["peak"]
    rows["autoremat @ checkpoint"] = timed(bench, planned(bench.ex, budget, "eager"), n)
    rows["autoremat, no recompute"] = timed(bench, planned(bench.ex, NO_RECOMPUTE, "eager"), n)
    rows["autoremat, no recompute, Inductor"] = timed(bench, planned(bench.ex, NO_RECOMPUTE, "inductor"), n)
    rows["autoremat, no recompute, release_grads=False"] = timed(
        bench, planned(bench.ex, NO_RECOMPUTE, "eager", release_grads=False), n)
    rows["autoremat, no recompute, regions=False"] = timed(
        bench, planned(bench.ex, NO_RECOMPUTE, "eager", regions=False), n)
    lines = [f"## {cfg['name']}: {cfg['kwargs']}", "",
             "| row | steady peak (MiB) | predicted recompute (`plan.overhead`) | compiler | time vs eager ± noise |",
             "|---|---|---|---|---|"]
    for name, r in rows.items():
        share = f"{r['predicted_recompute']:.3f}" if "predicted_recompute" in r else ""
        lines.append(f"| {name} | {r['peak'] / MiB:.2f} | {share} | {r.get('compiler', '')} | "
                     f"{r['ratio']:.3f} ± {r['noise']:.3f} |")
    at, ck, fx = rows["autoremat @ checkpoint"], rows["checkpoint"], rows["autoremat, no recompute"]
    kept = rows["autoremat, no recompute, release_grads=False"]
    lines += ["", f"autoremat @ checkpoint / checkpoint: {at['ratio'] / ck['ratio']:.3f}; the eager-FX path with "
              f"nothing recomputed / eager: {fx['ratio']:.3f}; gradients handed to .grad one by one / returned at "
              f"each region's end: {fx['ratio'] / kept['ratio']:.3f}. The eager row is eager against eager: the "
              f"machine's noise. Noise: half the interquartile range of the {n} paired ratios of each row.", ""]
    model = bench.fresh()
    nested, added = hand_off_cost(model)
    eager_step = rows["eager"]["seconds"]
    params = len(list(model.parameters()))
    lines += [f"The hand-off measured alone (`hand_off_cost`): a re-entrant `torch.autograd.backward(param, grad)` "
              f"inside a backward takes {nested:.1f} us per parameter, the in-place add into `.grad` it runs "
              f"{added:.1f} us: {nested - added:.1f} us of its own, {params} parameters, "
              f"{params * (nested - added) / 1e6 / eager_step:.2%} of the eager step ({eager_step * 1e3:.0f} ms).", ""]
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
