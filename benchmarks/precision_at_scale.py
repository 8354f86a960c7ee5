"""Mixed precision at the scale people train: floors and predicted step times, planned on the meta device.

    python benchmarks/precision_at_scale.py                       # GPT-2 small 8 x 1024 and the 7B Llama shape
    python benchmarks/precision_at_scale.py --models gpt2-small   # one model

Nothing runs on a GPU: each step is captured on the meta device and timed by autoremat's H100 roofline
(autoremat/model/devices.py), AdamW, fp32 master weights and gradients in every row. Rows:

  fp32              autoremat.optimize(precision="fp32")
  bf16              autoremat.optimize(precision="bf16"): every matmul-class call in bf16
  auto              autoremat.optimize(precision="auto"): fastest of fp32 / the joint ILP's dtypes / all-bf16
                    (on meta each call's error is bf16's unit roundoff; the tolerance is autocast's)
  autocast + ckpt   the graph precision="bf16" captures (autocast's policy: matmul-class calls in bf16, the
                    calls autocast keeps in fp32 in fp32, attention as a GPU flash kernel runs it in bf16), one
                    graph per block (regions=True: each gradient leaves as autograd computes it), planned
                    as checkpoint-every-block: heuristics.checkpoint_blocks saves each block's inputs (and
                    what may not be recomputed), every value inside a block is recomputed in its backward;
                    peak from the same simulator (memory.simulate), time = every op once + the recomputation.

Per model: the smallest budget each row fits in (total, and the activation part beyond the fixed ledger),
and the predicted step time at three budgets derived from those floors. The loss region's chunk count is
fixed for every row (--chunks, default 16: what the planner picks at GPT-2 small's fp32 floor), so the rows
differ only in precision and plan; one candidate instead of four also keeps the run short.

--outputs loss plans every row with optimize(outputs="loss") (no logits returned; a 16-bit head is then
one fused projection + cross-entropy). Writes benchmarks/results/precision_at_scale.md and .json (--out NAME:
NAME.md and NAME.json). The models and the planning calls are common.SCALE_MODELS and common's
scale_* helpers, which plan_spread.py and precision_live_at_peak.py make the same requests with.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
from common import REPO, SCALE_DEVICE, SCALE_MODELS, SCALE_MODES, scale_floor, scale_step

from autoremat.model.devices import get_device
from autoremat.model.ledger import Ledger
from autoremat.passes import loss_chunks
from autoremat.solve.decision import evaluate
from autoremat.solve.heuristics import checkpoint_blocks

GiB = 2**30
HUGE = 10**13  # nothing recomputed


def autocast_checkpoint(om) -> dict:
    """Checkpoint-every-block on the graphs `om` (a bf16 plan) captured, through the same simulator."""
    profiles = om._planner.profiles
    dev = get_device(SCALE_DEVICE)
    saved = checkpoint_blocks(profiles)
    _, timeline, recompute = evaluate(profiles, saved, dev.alloc_granularity)
    fixed = Ledger.from_dict(om.plan.ledger).fixed
    every_op = sum(p.time_s for g in profiles for p in g.nodes.values())
    return {"total": fixed + timeline.peak, "fixed": fixed, "activations": timeline.peak,
            "time_s": every_op + recompute, "recompute_s": recompute}


def run_model(name: str, log, outputs: str, floors_only: bool = False) -> dict:
    model, inputs, label = SCALE_MODELS[name]()
    t0 = time.perf_counter()
    floors = {m: scale_floor(model, inputs, m, outputs) for m in SCALE_MODES}
    log(f"{name}: floors " + ", ".join(f"{m} {f['total'] / GiB:.2f} GiB" for m, f in floors.items()))
    # One graph per block (regions=True), as the autocast row's eager autograd hands each gradient to
    # AccumulateGrad as it is computed; regions="auto" keeps one graph where everything saved fits, and one
    # graph returns every gradient at its end (a 7B Llama's 25 GiB of fp32 gradients held at once).
    bf16_all = scale_step(model, inputs, HUGE, "bf16", outputs, regions=True)
    ac = autocast_checkpoint(bf16_all[1])
    floors["autocast + ckpt"] = {k: ac[k] for k in ("total", "fixed", "activations")}
    log(f"{name}: autocast + ckpt {ac['total'] / GiB:.2f} GiB, {ac['time_s'] * 1e3:.1f} ms")
    # Three budgets, each with 1% room (the slack and allocator rounding a floor leaves no room for): the lowest
    # floor of all rows, autocast + ckpt's peak, and fp32's floor; duplicates (closer than 1%) merged, topped
    # up with 1.25 x the largest.
    points = sorted({int(x * 1.01) for x in (min(f["total"] for f in floors.values()), ac["total"],
                                             floors["fp32"]["total"])})
    budgets: list[int] = []
    for b in points:
        if not budgets or b > budgets[-1] * 1.01:
            budgets.append(b)
    while len(budgets) < 3:
        budgets.append(int(budgets[-1] * 1.25))
    rows = {}
    for b in ([] if floors_only else budgets):
        row = {m: scale_step(model, inputs, b, m, outputs) for m in SCALE_MODES}
        row = {m: (r[0] if isinstance(r, tuple) else r) for m, r in row.items()}
        row["autocast + ckpt"] = ({"fits": True, "time_s": ac["time_s"], "peak": ac["total"]}
                                  if ac["total"] <= b else {"fits": False})
        rows[str(b)] = row
        log(f"{name}: at {b / GiB:.2f} GiB " + ", ".join(
            f"{m} {r['time_s'] * 1e3:.1f} ms" if r["fits"] else f"{m} -" for m, r in row.items()))
    return {"label": label, "floors": floors, "budgets": rows, "no_recompute_bf16": bf16_all[0],
            "wall_s": time.perf_counter() - t0}


def goals(res: dict) -> dict:
    f = res["floors"]
    ratio = f["bf16"]["activations"] / f["fp32"]["activations"]
    auto_ok = True
    for row in res["budgets"].values():
        if not row["auto"]["fits"]:
            auto_ok = auto_ok and not any(row[m]["fits"] for m in ("bf16", "autocast + ckpt"))
            continue
        for other in ("bf16", "autocast + ckpt"):
            if row[other]["fits"] and row["auto"]["time_s"] > row[other]["time_s"] * (1 + 1e-9):
                auto_ok = False
    return {"bf16_activation_ratio": ratio, "ratio_goal_met": ratio <= 0.6,
            "auto_fastest_everywhere": auto_ok if res["budgets"] else None}


def markdown(results: dict) -> str:
    lines = [f"# Mixed precision at scale, planned on the meta device ({SCALE_DEVICE} roofline)", "",
             f"torch {torch.__version__}; outputs={results.get('outputs', 'all')!r} for every row; the loss region "
             f"is planned whole and in {results['chunks']} chunks for every row (a floor is the lower of the two; "
             "whole, 16-bit logits get one fused cross-entropy; with outputs='loss' a 16-bit head is one fused "
             "projection + cross-entropy, no logits). "
             "How each row is made: see the docstring of benchmarks/precision_at_scale.py. The autocast + "
             "checkpoint row is the graph precision='bf16' captures (matmul-class calls in bf16, autocast's fp32 "
             "calls in fp32, attention as one fused op that keeps its output and logsumexp and recomputes the "
             "scores in its backward, as GPU flash kernels do), one graph per block (each gradient leaves as it is "
             "computed, as eager autograd's do), with "
             "heuristics.checkpoint_blocks's saved set (each block's inputs; every value inside a block recomputed "
             "in its backward), simulated by memory.simulate; its time is every op once plus that recomputation.",
             ""]
    for res in results["models"].values():
        g = res["goals"]
        lines += [f"## {res['label']}", "", f"`{res['command']}`", "", "| row | smallest budget | fixed | activation part | x fp32's activations |",
                  "|---|---|---|---|---|"]
        fp32_act = res["floors"]["fp32"]["activations"]
        for m, f in res["floors"].items():
            lines.append(f"| {m} | {f['total'] / GiB:.2f} GiB | {f['fixed'] / GiB:.2f} GiB | "
                         f"{f['activations'] / GiB:.2f} GiB | {f['activations'] / fp32_act:.3f} |")
        budgets = list(res["budgets"])
        if not budgets:
            lines += ["", f"Step times not run (--floors-only). bf16's activation part / fp32's = "
                      f"{g['bf16_activation_ratio']:.3f} (goal <= 0.6: {'met' if g['ratio_goal_met'] else 'NOT met'}). "
                      f"Wall time {res['wall_s']:.0f} s.", ""]
            continue
        lines += ["", "Predicted step time (ms) at each budget (- : does not fit):", "",
                  "| row | " + " | ".join(f"{int(b) / GiB:.2f} GiB" for b in budgets) + " |",
                  "|---|" + "---|" * len(budgets)]
        for m in (*SCALE_MODES, "autocast + ckpt"):
            cells = []
            for b in budgets:
                r = res["budgets"][b][m]
                cell = f"{r['time_s'] * 1e3:.2f}" if r["fits"] else "-"
                if m == "auto" and r["fits"] and r.get("chosen"):
                    cell += f" ({r['chosen']})"
                cells.append(cell)
            lines.append(f"| {m} | " + " | ".join(cells) + " |")
        lines += ["", f"Goals: bf16's activation part / fp32's = {g['bf16_activation_ratio']:.3f} (goal <= 0.6: "
                  f"{'met' if g['ratio_goal_met'] else 'NOT met'}); auto's time <= bf16's and autocast + ckpt's at "
                  f"every budget: {'met' if g['auto_fastest_everywhere'] else 'NOT met'}. Wall time "
                  f"{res['wall_s']:.0f} s.", ""]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", choices=list(SCALE_MODELS), default=list(SCALE_MODELS))
    ap.add_argument("--floors-only", action="store_true", help="the smallest budgets and autocast + ckpt only")
    ap.add_argument("--chunks", type=int, default=16, help="the loss region's chunk count, the same for every row")
    ap.add_argument("--outputs", choices=loss_chunks.OUTPUTS, default="all",
                    help="optimize's outputs= for every row: 'loss' returns no logits (a 16-bit head is then one "
                         "fused projection + loss, passes/fused_linear_loss.py)")
    ap.add_argument("--out", default="precision_at_scale", help="file name under benchmarks/results (no suffix)")
    a = ap.parse_args()
    torch.set_num_threads(1)
    loss_chunks.CANDIDATES = (a.chunks,)

    def log(s: str) -> None:
        print(s, flush=True)

    results = {"device": SCALE_DEVICE, "chunks": a.chunks, "outputs": a.outputs, "torch": torch.__version__, "models": {}}
    for name in a.models:
        res = run_model(name, log, a.outputs, a.floors_only)
        res["goals"] = goals(res)
        results["models"][name] = res
    out = REPO / "benchmarks" / "results" / a.out
    argv = ("python benchmarks/precision_at_scale.py " + " ".join(sys.argv[1:])).strip()
    for res in results["models"].values():
        res["command"] = argv
    if out.with_suffix(".json").exists():  # one model at a time: keep the other models' latest results
        before = json.loads(out.with_suffix(".json").read_text())
        if before.get("chunks") == a.chunks and before.get("outputs", "all") == a.outputs:
            results["models"] = {**before.get("models", {}), **results["models"]}
    out.with_suffix(".json").write_text(json.dumps(results, indent=1))
    out.with_suffix(".md").write_text(markdown(results) + "\n")
    print(f"wrote {out}.md")


if __name__ == "__main__":
    main()
