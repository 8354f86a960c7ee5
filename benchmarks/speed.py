"""autoremat with Inductor vs torch.compile with Inductor, side by side in one process.

Rows, per model (a transformer stack and a small HF GPT-2), with dropout on and with dropout off:
  eager                        plain PyTorch: the reference for time and gradients
  inductor amb=b               torch.compile(backend="inductor") under
                               torch._functorch.config.activation_memory_budget = b, b in 1.0 / 0.5 / 0.1
  autoremat-inductor @ peer    autoremat.optimize(compiler="inductor") with budget = that row's measured peak
  autoremat-inductor grid i    autoremat.optimize(compiler="inductor") on evenly spaced budgets from the
                               smallest feasible one to the no-recompute total
  ablation: ... regions=True   (--with-cut) each at-peer row planned again with regions=True: one graph
                               per repeated block always, where the default (regions="auto") may run one
                               graph (pipeline.one_graph_if_free); not part of the goal check
  autoremat-inductor, no limit (--with-cut) at 4x the no-recompute total, where "auto" may take one
                               graph, and its regions=True ablation

GPT-2's autoremat rows pass outputs="loss": the step below reads only the loss and drops the logits
(for Inductor's rows they die when the forward returns), which is what that option tells the planner
(docs/python-api.md); with the default outputs="all" the plan would hold them through the backward.

Each row: measured peak of one training step (forward + backward, no optimizer, gradients already
allocated by a warm-up step), step time relative to eager (median of N steps, each paired with an
eager step right before it: benchmarks/paired.py), and the largest relative gradient error vs eager
(the same seed before each forward). With dropout on, Inductor draws its own random numbers, so
the error column says how far the compiled step's gradients are from eager's, not a bug; with dropout
off the error is rounding only and the time comparison is like for like.

Goal checked: at every memory level autoremat's step time is at most that of every Inductor row whose
measured peak is at or below it (per model and dropout setting).

    python benchmarks/speed.py            # ~30 min on a 2-core CPU (Inductor compiles every row)
    python benchmarks/speed.py --quick    # smaller models

Writes benchmarks/results/speed_cpu[_quick].md and .json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.append(str(REPO))  # for `examples`

from remat_vs_peers import (  # noqa: E402  # benchmarks/ is this script's folder, on sys.path
    Bench,
    MiB,
    eager_build,
    git_state,
    goal_check,
    loss_of,
    table,
    timing_noise,
)

import autoremat  # noqa: E402
from autoremat.ledger import Ledger  # noqa: E402
from examples.models import gpt2, transformer_stack  # noqa: E402

AMB = (1.0, 0.5, 0.1)


def configs(quick: bool, dropout: float) -> list[dict]:
    if quick:
        return [
            dict(name="stack", factory=transformer_stack,
                 kwargs=dict(n_layer=2, d=128, n_head=4, seq=64, batch=4, dropout=dropout)),
            dict(name="gpt2", factory=gpt2, outputs="loss",
                 kwargs=dict(n_layer=2, n_embd=32, n_head=4, seq=8, batch=2, vocab=256, dropout=dropout)),
        ]
    return [
        # the stack (6 layers, d=256, seq 128, batch 4) and its launch-bound GPT-2 (4 layers, d=32, 8 tokens)
        dict(name="stack", factory=transformer_stack,
             kwargs=dict(n_layer=6, d=256, n_head=4, seq=128, batch=4, dropout=dropout)),
        dict(name="gpt2", factory=gpt2, outputs="loss",
             kwargs=dict(n_layer=4, n_embd=32, n_head=4, seq=8, batch=2, vocab=256, dropout=dropout)),
    ]


def model_line(cfg: dict) -> str:
    extra = f", autoremat outputs={cfg['outputs']!r}" if "outputs" in cfg else ""
    return f"{cfg['name']}: {cfg['kwargs']}{extra}"


def inductor_build(b: float, args: tuple, kwargs: dict):
    def build(model):
        torch._dynamo.reset()
        t0 = time.perf_counter()
        with torch._functorch.config.patch(activation_memory_budget=b):
            cm = torch.compile(model, backend="inductor")
            loss_of(cm(*args, **kwargs)).backward()  # the first call compiles and partitions inside the patch
        return cm, {"compile_s": time.perf_counter() - t0}
    return build


def ar_build(budget: int, ex, regions: bool | str = "auto", outputs: str = "all"):
    def build(model):
        torch._dynamo.reset()
        om = autoremat.optimize(model, budget=int(budget), example_inputs=ex, optimizer=None, compiler="inductor",
                                progress=False, regions=regions, outputs=outputs)
        p = om.plan
        info = dict(budget=int(budget), predicted_peak=p.predicted_peak, activation_peak=p.activation_peak,
                    predicted_overhead=p.overhead, num_graphs=om.num_graphs, regions=p.regions,
                    solver_status=p.solver.get("status"),
                    planning_s=p.compiler.get("planning_s"), compile_s=p.compiler.get("inductor_compile_s"),
                    verify_notes=[n for n in p.notes if "verified" in n or "re-planned" in n])
        return om, info
    build.budget = int(budget)
    return build


def limits(bench: Bench, outputs: str) -> tuple[int, int, int]:
    """(smallest feasible budget, no-recompute total, fixed bytes) under compiler="inductor"."""
    torch._dynamo.reset()
    big = autoremat.optimize(bench.fresh(), budget=1 << 50, example_inputs=bench.ex, optimizer=None,
                             compiler="inductor", verify=False, progress=False, outputs=outputs)
    fixed = Ledger.from_dict(big.plan.ledger).fixed
    hi = fixed + big.plan.baseline_peak
    torch._dynamo.reset()
    try:
        autoremat.optimize(bench.fresh(), budget=fixed + 1, example_inputs=bench.ex, optimizer=None,
                           compiler="inductor", verify=False, progress=False, outputs=outputs)
        lo = fixed + 1
    except autoremat.BudgetError as e:
        lo = e.smallest_budget
    torch._dynamo.reset()
    return lo, hi, fixed


CUT = "ablation: autoremat-inductor @ peer, regions=True"  # always one graph per block; not in the goal
CUT_ROOMY = "ablation: autoremat-inductor, no limit, regions=True"


def bench_model(cfg: dict, tag: str, n_steps: int, n_grid: int, log, with_cut: bool = False
                ) -> tuple[list[dict], dict]:
    log(f"== {cfg['name']} ({tag}): {cfg['kwargs']}")
    bench = Bench(cfg, torch.device("cpu"), n_steps, log)
    extra = {"dropout": tag}
    rows = [bench.run_row("eager", "-", eager_build, extra)]
    for b in AMB:
        rows.append(bench.run_row("inductor", f"amb={b}", inductor_build(b, bench.args, bench.kwargs), extra))
    out = cfg.get("outputs", "all")
    lo, hi, fixed = limits(bench, out)
    log(f"  autoremat-inductor limits: smallest {lo / MiB:.2f} MiB, no-recompute {hi / MiB:.2f} MiB")
    for p in list(rows):
        if p["method"] == "inductor" and p["status"] == "ok":
            budget = p["measured_peak"]
            rows.append(bench.run_row("autoremat-inductor @ peer", f"{p['setting']}: {budget / MiB:.2f} MiB",
                                      ar_build(budget, bench.ex, outputs=out), extra))
            if with_cut:
                rows.append(bench.run_row(CUT, f"{p['setting']}: {budget / MiB:.2f} MiB",
                                          ar_build(budget, bench.ex, regions=True, outputs=out), extra))
    if with_cut:  # where nothing is recomputed either way: regions="auto" runs one graph
        roomy = 4 * hi
        rows.append(bench.run_row("autoremat-inductor, no limit", f"{roomy / MiB:.2f} MiB (4x the no-recompute total)",
                                  ar_build(roomy, bench.ex, outputs=out), extra))
        rows.append(bench.run_row(CUT_ROOMY, f"{roomy / MiB:.2f} MiB (4x the no-recompute total)",
                                  ar_build(roomy, bench.ex, regions=True, outputs=out), extra))
    for i in range(n_grid):
        budget = int(lo + (hi - lo) * i / (n_grid - 1)) if n_grid > 1 else hi
        retry = (lambda b: ar_build(b, bench.ex, outputs=out)) if i == 0 else None
        rows.append(bench.run_row("autoremat-inductor grid", f"{i}: {budget / MiB:.2f} MiB",
                                  ar_build(budget, bench.ex, outputs=out), extra, retry=retry))
    for r in rows:  # the goal compares within one model and dropout setting
        r["model"] = f"{cfg['name']} ({tag})"
    return rows, {"smallest": lo, "no_recompute": hi, "fixed": fixed}


def ratio_spread(a: dict, b: dict) -> tuple[float, float]:
    """Time of row a over row b, from the medians of their eager-paired ratios, and its noise: the half
    p10-p90 spread of a's per-pair ratios plus b's, relative to their medians."""
    ra = [x / y for x, y in zip(a["step_samples_s"], a["eager_samples_s"], strict=True)]
    rb = [x / y for x, y in zip(b["step_samples_s"], b["eager_samples_s"], strict=True)]

    def half_spread(r: list[float]) -> float:
        q = statistics.quantiles(r, n=10)
        return (q[-1] - q[0]) / statistics.median(r) / 2

    return statistics.median(ra) / statistics.median(rb), half_spread(ra) + half_spread(rb)


def equal_memory_lines(rows: list[dict]) -> str:
    """Each autoremat row planned at an Inductor row's measured peak, against that row."""
    out = ["| model | Inductor row | its peak (MiB) | its time vs eager | autoremat row | graphs | autoremat peak (MiB) | "
           "autoremat time vs eager | autoremat / Inductor time (paired) | noise |", "|---" * 10 + "|"]
    ok = {(r["model"], r["setting"]): r for r in rows if r["method"] == "inductor" and r["status"] == "ok"}
    for r in rows:
        if r["method"] not in ("autoremat-inductor @ peer", CUT):
            continue
        form = "regions=True" if r["method"] == CUT else "default"
        peer = ok.get((r["model"], r["setting"].split(":")[0]))
        if peer is None:
            continue
        if r["status"] != "ok":
            out.append(f"| {r['model']} | {peer['setting']} | {peer['measured_peak'] / MiB:.2f} | "
                       f"{peer['step_vs_eager']:.3f} | {form} | | {r['status']} | | | |")
            continue
        ratio, noise = ratio_spread(r, peer)
        out.append(f"| {r['model']} | {peer['setting']} | {peer['measured_peak'] / MiB:.2f} | {peer['step_vs_eager']:.3f}"
                   f" | {form} | {r.get('num_graphs')} | {r['measured_peak'] / MiB:.2f} | {r['step_vs_eager']:.3f} | {ratio:.3f} | +-{100 * noise:.0f}% |")
    return "\n".join(out)


def prediction_lines(rows: list[dict]) -> str:
    out = []
    for r in rows:
        if r["status"] == "ok" and r.get("predicted_peak") is not None:
            err = (r["predicted_peak"] - r["measured_peak"]) / r["measured_peak"]
            used = r["measured_peak"] / r["budget"]
            out.append(f"| {r['model']} | {r['method']} {r['setting']} | {r['budget'] / MiB:.2f} | "
                       f"{r['predicted_peak'] / MiB:.2f} | {r['measured_peak'] / MiB:.2f} | {100 * err:+.1f}% | "
                       f"{100 * used:.1f}% | {r.get('planning_s') or 0:.1f} ({r.get('compile_s') or 0:.1f}) | "
                       f"{'re-planned' if any('re-planned' in n for n in r.get('verify_notes', [])) else 'verified'} |")
    head = ("| model | row | budget (MiB) | predicted peak | measured peak | prediction error | budget used | "
            "planning s (Inductor s) | verify |\n" + "|---" * 9 + "|")
    return head + "\n" + "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--steps", type=int, default=21, help="timed steps per row (median), >= 5")
    ap.add_argument("--grid", type=int, default=3)
    ap.add_argument("--models", default="stack,gpt2")
    ap.add_argument("--dropout", default="0.1,0.0", help="dropout settings, comma list")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    ap.add_argument("--stem", default=None, help="file name of the results (default speed_cpu[_quick])")
    ap.add_argument("--with-cut", action="store_true",
                    help="also plan each at-peer row with regions=True (one graph per block always): an ablation")
    a = ap.parse_args()
    torch.set_num_threads(1)
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")

    def log(s: str) -> None:
        print(s, flush=True)

    t0 = time.perf_counter()
    meta = dict(date=datetime.datetime.now().isoformat(timespec="seconds"), command=" ".join(sys.argv), quick=a.quick,
                steps=a.steps, torch=torch.__version__, python=platform.python_version(),
                machine=platform.processor() or platform.machine(), repo_git=git_state())
    rows, lims = [], {}
    for d in (float(x) for x in a.dropout.split(",")):
        tag = f"dropout {d}"
        for cfg in (c for c in configs(a.quick, d) if c["name"] in a.models.split(",")):
            r, lim = bench_model(cfg, tag, max(5, a.steps), a.grid, log, with_cut=a.with_cut)
            rows += r
            lims[f"{cfg['name']} ({tag})"] = lim
    noise = timing_noise(rows)
    # Inductor rows are the peers; the ablation rows are neither peers nor the default autoremat
    goal, counts = goal_check([r for r in rows if r["method"] != "eager" and not r["method"].startswith("ablation")],
                              noise)
    wall = time.perf_counter() - t0
    text = (f"# autoremat with Inductor vs torch.compile with Inductor, CPU{' (--quick)' if a.quick else ''}\n\n"
            f"Command: `python benchmarks/speed.py {' '.join(sys.argv[1:])}`, {meta['date']}, torch {torch.__version__}, "
            f"1 thread, repo {meta['repo_git']}, wall {wall:.0f} s.\n\n"
            + "Models: " + "; ".join(model_line(c) for c in configs(a.quick, 0.0)) + ".\n\n"
            f"Step = forward + backward, no optimizer, gradients allocated by a warm-up step. Step time: median of "
            f"{max(5, a.steps)} steps, each paired with an eager step just before it. Timing noise (eager p10-p90 "
            f"half-spread): " + ", ".join(f"{k[0]} {100 * v:.1f}%" for k, v in sorted(noise.items())) + ".\n\n"
            + table(rows) + "\n\n## At equal memory: autoremat at each Inductor row's measured peak\n\n"
            + equal_memory_lines(rows) + "\n\n## autoremat's prediction under Inductor\n\n" + prediction_lines(rows)
            + "\n\n## Goal\n\n" + goal.replace("every peer", "every Inductor row") + "\n")
    log("\n" + text)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = a.stem or f"speed_cpu{'_quick' if a.quick else ''}"
    (out / f"{stem}.md").write_text(text)
    (out / f"{stem}.json").write_text(json.dumps(dict(meta=meta, wall_s=wall, limits=lims, goal=counts, rows=rows,
                                                      noise={k[0]: v for k, v in noise.items()}), indent=1,
                                                 default=str))
    log(f"wrote {out / stem}.md and .json")


if __name__ == "__main__":
    main()
