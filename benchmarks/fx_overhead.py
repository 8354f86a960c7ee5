"""What the eager-FX path costs by itself (floor.py's time goal at checkpoint's peak).

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
  with --inductor-rows:
    torch.compile (Inductor)   torch.compile's own whole-graph Inductor, no autoremat
    Inductor, release_grads=False / regions=False   the same two splits under Inductor

    python benchmarks/fx_overhead.py [--models stack,gpt2,gpt2-launch] [--steps 9] [--inductor-rows]

Writes benchmarks/results/fx_overhead_cpu.md. Sizes are floor.py's default ones; `gpt2-launch` is
speed.py's launch-bound GPT-2 (4 layers, 32 wide, 8 tokens).
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time
from pathlib import Path

import torch
from common import Bench, checkpoint_every_block, floor_configs, git_state, load_average, make_step, paired_times

import autoremat
from autoremat.measure import measure_peak
from autoremat.torch_internals import accumulate_into_grad
from examples.models import gpt2

MiB = 2**20
NO_RECOMPUTE = 64 * 2**30  # far above any of these models' no-recompute totals
# speed.py's launch-bound GPT-2 (4 layers, 32 wide, 8 tokens), besides floor.py's sizes
LAUNCH_BOUND = [dict(name="gpt2-launch", factory=gpt2,
                     kwargs=dict(n_layer=4, n_embd=32, n_head=4, seq=8, batch=2, vocab=256, dropout=0.0))]


def checkpointed(model):
    return checkpoint_every_block(model), {}


def planned(example_inputs, budget: int, compiler: str, **options):
    def build(model):
        torch._dynamo.reset()
        om = autoremat.optimize(model, budget=budget, example_inputs=example_inputs, optimizer=None, outputs="loss",
                                compiler=compiler, **options)
        return om, dict(predicted_recompute=om.plan.overhead, compiler=om.plan.compiler.get("used"))
    return build


def timed(bench: Bench, build, n: int) -> dict:
    model = bench.fresh()
    fn, info = build(model)
    step = make_step(fn, bench.args, bench.kwargs)
    step()
    step()  # warm: compiled, every .grad allocated
    _, m = measure_peak(step, device=bench.device, baseline_objs=(model, bench.ex))
    rt, et = paired_times(bench.eager_step, step, n, lambda: None)
    ratios = [r / e for r, e in zip(rt, et)]
    q1, _, q3 = statistics.quantiles(ratios, n=4)
    return dict(info, peak=m.peak_bytes, ratio=statistics.median(ratios), noise=(q3 - q1) / 2,
                seconds=statistics.median(rt))


def hand_off_cost(model: torch.nn.Module, repeats: int = 7) -> dict[str, float]:
    """Microseconds per parameter, inside a running backward, of the hand-off `regions.accumulate_grad`
    runs (`torch_internals.accumulate_into_grad`: the engine called directly), of the public
    `torch.autograd.backward(param, grad)` it replaced, and of the in-place add into `.grad` that both
    end in (eager's AccumulateGrad does only that). Medians over `repeats`."""
    params = list(model.parameters())
    grads = [torch.randn_like(p) for p in params]
    for p in params:
        p.grad = torch.zeros_like(p)
    ways = {"engine": accumulate_into_grad, "backward": torch.autograd.backward,
            "add": lambda p, gr: p.grad.add_(gr)}
    times: dict[str, list[float]] = {how: [] for how in ways}

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 1

        @staticmethod
        def backward(ctx, g):
            for how, run in ways.items():
                t0 = time.perf_counter()
                for p, gr in zip(params, grads):
                    run(p, gr)
                times[how].append((time.perf_counter() - t0) / len(params) * 1e6)
            return g

    x = torch.randn(4, requires_grad=True)
    for _ in range(repeats):
        Probe.apply(x).sum().backward()
    return {how: statistics.median(t) for how, t in times.items()}


def compiled_whole(model):
    torch._dynamo.reset()
    return torch.compile(model, backend="inductor"), dict(compiler="inductor (torch.compile)")


def one(cfg: dict, n: int, inductor_rows: bool = False) -> list[str]:
    bench = Bench(cfg, torch.device("cpu"), n, print)
    rows = {"eager": timed(bench, lambda m: (m, {}), n), "checkpoint": timed(bench, checkpointed, n)}
    budget = rows["checkpoint"]["peak"]
    rows["autoremat @ checkpoint"] = timed(bench, planned(bench.ex, budget, "eager"), n)
    rows["autoremat, no recompute"] = timed(bench, planned(bench.ex, NO_RECOMPUTE, "eager"), n)
    rows["autoremat, no recompute, Inductor"] = timed(bench, planned(bench.ex, NO_RECOMPUTE, "inductor"), n)
    rows["autoremat, no recompute, release_grads=False"] = timed(
        bench, planned(bench.ex, NO_RECOMPUTE, "eager", release_grads=False), n)
    rows["autoremat, no recompute, regions=False"] = timed(
        bench, planned(bench.ex, NO_RECOMPUTE, "eager", regions=False), n)
    if inductor_rows:  # the same split under Inductor, against torch.compile's own whole-graph Inductor
        rows["torch.compile (Inductor)"] = timed(bench, compiled_whole, n)
        rows["autoremat, no recompute, Inductor, release_grads=False"] = timed(
            bench, planned(bench.ex, NO_RECOMPUTE, "inductor", release_grads=False), n)
        rows["autoremat, no recompute, Inductor, regions=False"] = timed(
            bench, planned(bench.ex, NO_RECOMPUTE, "inductor", regions=False), n)
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
    cost = hand_off_cost(model)
    eager_step = rows["eager"]["seconds"]
    params = len(list(model.parameters()))
    lines += [f"The hand-off measured alone (`hand_off_cost`), per parameter inside a running backward: the engine "
              f"called directly (what `regions.accumulate_grad` runs) {cost['engine']:.1f} us, the public "
              f"`torch.autograd.backward(param, grad)` {cost['backward']:.1f} us, the in-place add into `.grad` "
              f"both run {cost['add']:.1f} us. The hand-off's own cost: {cost['engine'] - cost['add']:.1f} us x "
              f"{params} parameters = {params * (cost['engine'] - cost['add']) / 1e6 / eager_step:.2%} of the eager "
              f"step ({eager_step * 1e3:.0f} ms).", ""]
    print("\n".join(lines), flush=True)
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="stack")
    ap.add_argument("--steps", type=int, default=9)
    ap.add_argument("--inductor-rows", action="store_true",
                    help="also: torch.compile's Inductor, and autoremat under Inductor with release_grads=False and "
                         "with regions=False (what the regions and the hand-off cost a launch-bound step)")
    a = ap.parse_args()
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    cfgs = [c for c in floor_configs(False) + LAUNCH_BOUND if c["name"] in a.models.split(",")]
    body = [line for cfg in cfgs for line in one(cfg, a.steps, a.inductor_rows)]
    head = ["# The eager-FX path's own cost on cpu", "",
            f"Command: `python benchmarks/fx_overhead.py {' '.join(sys.argv[1:])}`, "
            f"{datetime.datetime.now().isoformat(timespec='seconds')}, torch {torch.__version__}, 1 thread, repo "
            f"{git_state().as_dict()}, wall {time.perf_counter() - t0:.0f} s, load average {load_average()} at "
            "the end. Each row: median over the paired ratios (row step / the eager step just before it).", ""]
    out = Path(__file__).resolve().parent / "results" / "fx_overhead_cpu.md"
    out.write_text("\n".join(head + body))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
