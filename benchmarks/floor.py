"""The floor benchmark ("Below checkpointing"): how little memory each method reaches, side by side.

Models: a transformer stack, HF GPT-2, HF Llama, a BERT-style encoder with dropout (HF BertForMaskedLM), a
ViT-style model (HF ViTForImageClassification), a ResNet-shaped conv net with BatchNorm and dropout, HF GPT-2
with a 32k vocabulary (its loss region outweighs its blocks), and a 6-layer HF Llama with grouped-query
attention, 4 query heads sharing 2 K/V heads (a shape the planner was not tuned on).
Rows per model, each on its own deep copy of the same initial model:
  eager                  plain PyTorch, not compiled: the reference for time and gradients
  checkpoint             torch.utils.checkpoint (non-reentrant) on every block
  pt-budget b            torch.compile(backend="aot_eager") under activation_memory_budget = 0.5, 0.1, 0.0
  autoremat floor        autoremat.optimize at BudgetError.smallest_budget of budget=1 (retried once at a new
                         smallest_budget if that raises BudgetError again)
  autoremat @ checkpoint autoremat.optimize at checkpoint's measured steady-state peak
  Inductor @ checkpoint  (--inductor) the same with compiler='auto': Inductor where it compiles, as users get it
                         (eager where no plan fits under Inductor; the row names the compiler used)
  Inductor @ its floor   (--inductor) compiler='inductor' at its own smallest feasible budget

Per row: steady-state and first-micro-step peaks, step time vs eager with its noise, gradient error vs eager,
predicted/measured (autoremat); the three goals (floor, prediction, time) are computed from the rows. See benchmarks/README.md.

    python benchmarks/floor.py --quick                # tiny sizes
    python benchmarks/floor.py                        # small but meaningful sizes
    python benchmarks/floor.py --models stack,gpt2 --merge   # rerun two models, keep the others' rows
    python benchmarks/floor.py --models none --merge         # only the GPT-2 small meta rows

    python benchmarks/floor.py --models gqa-decoder --tag gqa --no-lm-meta   # one model, in a file of its own

Writes benchmarks/results/floor_cpu[_quick][_TAG].md and .json (rewritten after each model).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import sys
import time
from pathlib import Path

import torch
from common import (
    FLOOR_PT_BUDGETS,
    FLOOR_SIZES,
    OUTPUTS,
    REPO,
    SEED,
    Bench,
    ar_build,
    checkpoint_every_block,
    eager_build,
    error_fields,
    floor_configs,
    floor_row,
    git_state,
    grad_rel_err,
    grads_of,
    head_to_head,
    load_average,
    make_step,
    meta_part,
    meta_table,
    mib,
    pt_build,
    run_row,
    smallest_budget,
    split,
    sync,
)

import autoremat

FLOOR_VS_CHECKPOINT = {"stack": 0.9, "gpt2": 0.9}  # the floor goal: floor <= this x checkpoint's peak; others 1.0
PREDICTION_TOLERANCE = 0.05  # the prediction goal: predicted peak within 5% of measured at the floor


# --------------------------------------------------------------------------------------------
# the time goal head-to-head, and one model's rows


def time_against_checkpoint(bench: Bench, budget: int, n: int) -> dict:
    """The time goal measured directly: autoremat at checkpoint's peak against checkpoint-every-block, in
    `n` alternating pairs (common.head_to_head). Returns a row of method "head-to-head" (not a table row:
    goals() reads it)."""
    row = dict(model=bench.cfg["name"], method="head-to-head", setting="autoremat @ checkpoint / checkpoint")
    t0 = time.perf_counter()
    try:
        ckpt_model = checkpoint_every_block(bench.fresh())
        ar, _ = ar_build(budget, bench.ex, OUTPUTS)(bench.fresh())
        ckpt_step = make_step(ckpt_model, bench.args, bench.kwargs)
        ar_step = make_step(ar, bench.args, bench.kwargs)
        ckpt_step(), ar_step()  # warm-up: every .grad exists from now on
        row.update(status="ok", **head_to_head(ar_step, ckpt_step, n, lambda: sync(bench.device)))
    except Exception as e:  # noqa: BLE001 - reported in the goal line
        row.update(error_fields(e))
    finally:
        gc.collect()
        torch._dynamo.reset()
    row["row_wall_s"] = time.perf_counter() - t0
    if row["status"] == "ok":
        print(f"  head-to-head: autoremat / checkpoint = {row['ratio']:.3f} ± {row['noise']:.3f}, 90% interval of "
              f"the median {row['interval'][0]:.3f}-{row['interval'][1]:.3f} ({row['row_wall_s']:.0f}s)", flush=True)
    return row


def fp64_rounding(bench: Bench) -> float | None:
    """The eager reference's own gradient error against the same model run in fp64 (same seed, so the same
    dropout masks): the size of fp32 rounding in this model's gradients. A row whose error vs eager is of this
    order differs by rounding (another reduction order: Inductor's kernels, a recomputation); a wrong plan
    differs by O(1). None if the model does not run in fp64."""
    try:
        model = bench.fresh().double()
        args, kwargs = split(tuple(t.double() if t.is_floating_point() else t for t in bench.ex)
                                   if not isinstance(bench.ex, dict) else
                                   {k: v.double() if v.is_floating_point() else v for k, v in bench.ex.items()})
        torch.manual_seed(SEED)
        make_step(model, args, kwargs)()
        return grad_rel_err(bench.ref_grads, {n: g.float() for n, g in grads_of(model).items()})
    except Exception as e:  # noqa: BLE001 - a model without fp64 kernels has no such reference
        print(f"  fp64 reference failed: {type(e).__name__}: {e}", flush=True)
        return None


def bench_model(cfg: dict, device: torch.device, n_steps: int, inductor: bool = False) -> list[dict]:
    print(f"== {cfg['name']}: {cfg['kwargs']}", flush=True)
    try:
        bench = Bench(cfg, device, n_steps, lambda s: print(s, flush=True))
    except Exception as e:  # noqa: BLE001 - the model itself failed: one error row, the others go on
        return [dict(model=cfg["name"], method="eager", setting="-", **error_fields(e))]
    rows = [run_row(bench, "eager", "-", eager_build),
            run_row(bench, "checkpoint", "every block", lambda m: (checkpoint_every_block(m), {}))]
    rows[0]["fp64_rounding_err"] = fp64_rounding(bench)
    rows += [run_row(bench, "pt-budget", f"amb={b}", pt_build(b, bench.args, bench.kwargs)) for b in FLOOR_PT_BUDGETS]
    rows.append(floor_row(bench))
    ckpt = rows[1]
    if ckpt["status"] == "ok":
        rows.append(run_row(bench, "autoremat", "@ checkpoint", ar_build(ckpt["steady_peak"], bench.ex, OUTPUTS)))
        if inductor:  # the default compiler where Inductor runs (compiler="auto"): what a user gets
            rows.append(run_row(bench, "autoremat", "Inductor @ checkpoint",
                                ar_build(ckpt["steady_peak"], bench.ex, OUTPUTS, compiler="auto")))
        if rows[-1]["status"] == "ok":
            rows.append(time_against_checkpoint(bench, ckpt["steady_peak"], 2 * n_steps + 1))
    else:
        rows.append(dict(model=cfg["name"], method="autoremat", setting="@ checkpoint",
                         status="not run: the checkpoint row failed"))
    if inductor:  # Inductor itself at its own floor (the row above may have planned with eager: compilers.py)
        try:
            floor = smallest_budget(bench, "inductor")
            rows.append(run_row(bench, "autoremat", "Inductor @ its floor",
                                ar_build(floor, bench.ex, OUTPUTS, compiler="inductor")))
        except Exception as e:  # noqa: BLE001 - reported in the row
            rows.append(dict(model=cfg["name"], method="autoremat", setting="Inductor @ its floor", **error_fields(e)))
    return rows


# --------------------------------------------------------------------------------------------
# goals and output


def find(rows: list[dict], model: str, method: str, prefix: str) -> dict | None:
    return next((r for r in rows if r["model"] == model and r["method"] == method
                 and r["setting"].startswith(prefix)), None)


def goals(rows: list[dict], model: str) -> dict:
    """The three goals (floor, prediction, time) for one model, computed from its rows."""
    ckpt, fl, at = (find(rows, model, "checkpoint", ""), find(rows, model, "autoremat", "floor"),
                    find(rows, model, "autoremat", "@ checkpoint"))
    ran = [r is not None and r["status"] == "ok" for r in (ckpt, fl, at)]
    factor = FLOOR_VS_CHECKPOINT.get(model, 1.0)
    g: dict = dict(floor=dict(holds=False, why="the floor or the checkpoint row did not run"),
                   prediction=dict(holds=False, why="the floor row did not run"))
    if ran[1]:
        g["prediction"] = dict(holds=abs(fl["predicted_vs_measured"] - 1) <= PREDICTION_TOLERANCE,
                               predicted_vs_measured=fl["predicted_vs_measured"])
    if ran[0] and ran[1]:
        ratio = fl["budget"] / ckpt["steady_peak"]
        g["floor"] = dict(holds=ratio <= factor and fl["steady_peak"] <= fl["budget"], floor_budget=fl["budget"],
                          floor_measured=fl["steady_peak"], checkpoint_peak=ckpt["steady_peak"], ratio=ratio,
                          required=factor)
        g["floor_time_vs_checkpoint"] = time_ratio(fl, ckpt)  # not a goal: the floor's speed, for context
    direct = find(rows, model, "head-to-head", "")
    if direct is not None and direct["status"] == "ok":
        # judged on the direct pairing; the ratio of the two rows' ratios to eager is kept for context
        g["time"] = dict(holds=direct["ratio"] <= 1.0, ratio=direct["ratio"], noise=direct["noise"],
                         within_noise=abs(direct["ratio"] - 1) <= direct["noise"], interval=direct["interval"],
                         pairs=len(direct["ratios"]), measured="head-to-head")
        if ran[0] and ran[2]:
            g["time_through_eager"] = time_ratio(at, ckpt)
    elif ran[0] and ran[2]:
        tr = time_ratio(at, ckpt)
        g["time"] = dict(holds=tr["ratio"] <= 1.0, measured="through eager", **tr)
    else:
        g["time"] = dict(holds=False, why=f"autoremat @ checkpoint: {at['status'] if at else 'missing'}")
    ind = find(rows, model, "autoremat", "Inductor @ checkpoint")
    if ran[0] and ind is not None and ind["status"] == "ok":
        g["inductor_time_vs_checkpoint"] = time_ratio(ind, ckpt)  # not a goal: the default compiler's time
        g["inductor_time_vs_checkpoint"]["compiler_used"] = ind.get("compiler_used")
    return g


def time_ratio(a: dict, b: dict) -> dict:
    """Row a's step time over row b's (both paired with eager), with the two rows' relative noises combined."""
    ratio = a["time_vs_eager"] / b["time_vs_eager"]
    noise = ((a["time_noise"] / a["time_vs_eager"]) ** 2 + (b["time_noise"] / b["time_vs_eager"]) ** 2) ** 0.5
    return dict(ratio=ratio, noise=noise, within_noise=abs(ratio - 1) <= noise)


def goal_text(model: str, g: dict) -> str:
    f, p, t = g["floor"], g["prediction"], g["time"]
    verdict = {True: "holds", False: "FAILS"}
    floor = (f"floor budget {mib(f['floor_budget'])} MiB = {f['ratio']:.3f} x checkpoint's {mib(f['checkpoint_peak'])}"
             f" MiB (needs <= {f['required']}; measured {mib(f['floor_measured'])} MiB): {verdict[f['holds']]}"
             if "ratio" in f else f"floor: FAILS ({f['why']})")
    pred = (f"predicted/measured at the floor {p['predicted_vs_measured']:.3f} (needs within "
            f"{PREDICTION_TOLERANCE:.0%}): {verdict[p['holds']]}" if "predicted_vs_measured" in p
            else f"prediction: FAILS ({p['why']})")
    how = (f" (head-to-head, {t['pairs']} pairs; 90% interval of the median {t['interval'][0]:.3f}-"
           f"{t['interval'][1]:.3f})" if t.get("measured") == "head-to-head" else "")
    tm = (f"time at checkpoint's peak: autoremat / checkpoint = {t['ratio']:.3f} ± {t['noise']:.3f}{how}: "
          f"{verdict[t['holds']]}{' (within the noise)' if t['within_noise'] else ''}"
          if "ratio" in t else f"time: FAILS ({t['why']})")
    te = g.get("time_through_eager")
    if te:
        tm += f"; through the rows' ratios to eager {te['ratio']:.3f} ± {te['noise']:.3f}"
    ft = g.get("floor_time_vs_checkpoint")
    context = (f" (Not a goal: at its floor autoremat / checkpoint time = {ft['ratio']:.3f} ± {ft['noise']:.3f}.)"
               if ft else "")
    it = g.get("inductor_time_vs_checkpoint")
    if it:
        context += (f" (With compiler='auto', which planned with {it.get('compiler_used') or 'Inductor'} here, at "
                    f"checkpoint's peak: autoremat / checkpoint time = {it['ratio']:.3f} ± {it['noise']:.3f}.)")
    return f"- **{model}**: {floor}; {pred}; {tm}.{context}"


def rounding_text(rows: list[dict]) -> str:
    """What size of gradient error is rounding in this model: the eager row's own error against fp64, and
    checkpointing's against eager (the same mathematics recomputed: this device's noise floor)."""
    err = rows[0].get("fp64_rounding_err") if rows and rows[0]["method"] == "eager" else None
    ckpt = find(rows, rows[0]["model"], "checkpoint", "") if rows else None
    ckpt_err = ckpt.get("grad_rel_err") if ckpt and ckpt["status"] == "ok" else None
    if err is None and ckpt_err is None:
        return ""
    fp64 = (f"eager's own fp32 gradients against the same step in fp64 (same seed and masks) differ by {err:.1e}"
            if err is not None else "")
    peer = f"checkpointing's against eager by {ckpt_err:.1e}" if ckpt_err is not None else ""
    return (f"- Grad error scale (||g - g_ref|| / ||g_ref|| over all parameters): "
            f"{'; '.join(x for x in (fp64, peer) if x)}: errors up to that order are rounding (another reduction order: Inductor's kernels, a "
            f"recomputation), a wrong plan or mask gives O(1).\n")


def table(rows: list[dict]) -> str:
    head = ("| method | setting | budget (MiB) | steady peak (MiB) | vs checkpoint | first-step peak (MiB) | "
            "time vs eager ± noise | grad rel err | predicted (MiB) | predicted / measured |")
    lines = [head, "|" + "---|" * 10]
    ckpt = find(rows, rows[0]["model"], "checkpoint", "") if rows else None
    ref = ckpt["steady_peak"] if ckpt and ckpt["status"] == "ok" else None
    for r in rows:
        if r["method"] == "head-to-head":  # a goal measurement, in the goal line below the table
            continue
        setting = r["setting"] + (f" (first tried {mib(r['retried_from']['budget'])} MiB)" if "retried_from" in r
                                  else "")
        if r.get("num_graphs"):
            compiled = f", compiler {r['compiler_used']}" if r.get("compiler_used") else ""
            setting += f" [{r['num_graphs']} graphs, solver {r.get('solver_status')}{compiled}]"
        if r["status"] != "ok":
            sb = f"; smallest budget {mib(r['smallest_budget'])} MiB" if r.get("smallest_budget") else ""
            lines.append(f"| {r['method']} | {setting} | {mib(r.get('budget'))} | {r['status']}{sb} |" + " |" * 6)
            continue
        pvm = f"{r['predicted_vs_measured']:.3f}" if "predicted_vs_measured" in r else ""
        vs_ckpt = f"{r['steady_peak'] / ref:.3f}" if ref else ""
        lines.append(f"| {r['method']} | {setting} | {mib(r.get('budget'))} | {mib(r['steady_peak'])} | {vs_ckpt} | "
                     f"{mib(r['first_step_peak'])} | {r['time_vs_eager']:.3f} ± {r['time_noise']:.3f} | "
                     f"{r['grad_rel_err']:.1e} | {mib(r.get('predicted_peak'))} | {pvm} |")
    return "\n".join(lines)


def report(meta: dict, cfgs: list[dict], rows: list[dict], all_goals: dict) -> str:
    parts = [f"# Floor benchmark on cpu{' (--quick)' if meta['quick'] else ''}\n",
             f"Command: `{meta['command']}`, {meta['date']}, torch {meta['torch']}, transformers "
             f"{meta['transformers']}, {meta['threads']} thread, repo {meta['git']['head']} with uncommitted "
             f"changes: `{meta['git']['diff_stat'] or 'none'}`; wall {meta['wall_s']:.0f} s; load average "
             f"{meta['load_start']} at the start, {meta['load_end']} at the end (2 cores, shared with others' jobs).\n",
             *([f"Rows of models not rerun come from earlier runs; every command, in order: "
                f"{'; '.join(f'`{c}`' for c in meta['commands'])}.\n"] if len(meta.get("commands", [])) > 1 else []),
             "One step = forward + backward of one micro-batch, no optimizer (autoremat: `optimizer=None`, so every "
             "row's total is parameters + gradients + inputs + the step's running peak; `outputs='loss'`: the step "
             "uses only the loss, in every row). Peaks: "
             "`autoremat.measure.measure_peak` (profiler), absolute, baseline = the row's model + inputs. "
             "*Steady*: a step after a warm-up step, every `.grad` already allocated. *First step*: `.grad` set to "
             f"None before it. Time: median over {meta['steps']} pairs of (row step / the eager step just before "
             "it); noise = half the interquartile range of those ratios (the eager row's is eager vs eager). "
             "The time goal is measured head-to-head: autoremat @ checkpoint and checkpoint-every-block timed in "
             "pairs, their order alternating, each timed step right after an untimed step of the same model (as in "
             "a training loop), with the median of the per-pair ratios, the same noise, and a 90% bootstrap "
             "interval of that median. Grad "
             f"error: max over parameters of ||g - g_eager|| / max(||g_eager||, sqrt(eps) x the whole model's ||g_eager||) (a key bias's gradient is zero in exact arithmetic: rounding noise on both sides), first step, torch.manual_seed({SEED}) "
             "before it, dropout on. *vs checkpoint*: steady peak / checkpoint-every-block's steady peak.\n"]
    for cfg in cfgs:
        mine = [r for r in rows if r["model"] == cfg["name"]]
        if mine:
            goal = goal_text(cfg["name"], all_goals[cfg["name"]])
            parts.append(f"## {cfg['name']}: {cfg['kwargs']}\n\n{table(mine)}\n\n{goal}\n{rounding_text(mine)}")
    held = {k: sum(g[k]["holds"] for g in all_goals.values()) for k in ("floor", "time", "prediction")}
    n = len(all_goals)
    parts.append("## Goals (computed from the rows above)\n\n"
                 f"- floor <= checkpoint-every-block's measured peak (<= 0.9x on the stack and GPT-2): "
                 f"{held['floor']}/{n} models\n"
                 f"- at checkpoint's measured peak, autoremat's step time <= checkpoint's: {held['time']}/{n} models\n"
                 f"- predicted peak within {PREDICTION_TOLERANCE:.0%} of measured at the floor: "
                 f"{held['prediction']}/{n} models\n")
    return "\n".join(parts)


def lm_meta_section(rows: list[dict]) -> str:
    """GPT-2 small at 8 x 1024 planned on meta for an H100: the loss region's floors."""
    if not rows:
        return ""
    return ("\n## gpt2-small 8 x 1024, planned on meta for an H100 (fp32, AdamW; the loss region)\n\n"
            "No real step runs on meta: these are the planner's smallest feasible budgets (BudgetError.smallest_budget "
            "of budget=1), each then planned at that budget. *chunking off*: the loss rewrite disabled "
            "(loss_chunks.CANDIDATES = (1,)); *outputs=all*: the logits output kept; *outputs=loss*: only the loss "
            "used. Rows from `benchmarks/common/plans.py`'s `meta_part` (loss_region.py's part 2), run by this script.\n\n"
            + meta_table(rows) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny sizes")
    ap.add_argument("--steps", type=int, default=7, help="timed pairs per row (>= 4)")
    ap.add_argument("--models", default=",".join(FLOOR_SIZES))
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    ap.add_argument("--merge", action="store_true",
                    help="keep the rows of models not run now (and the GPT-2 small meta rows, unless run now) from "
                         "the results file; the file lists every command its rows came from")
    ap.add_argument("--no-lm-meta", action="store_true",
                    help="skip GPT-2 small 8 x 1024 planned on meta for an H100 (the loss region's floors)")
    ap.add_argument("--inductor", action="store_true",
                    help="add a row: autoremat with compiler='auto' (Inductor where it compiles) at checkpoint's peak")
    ap.add_argument("--tag", default="",
                    help="write floor_cpu[_quick]_TAG.md/.json instead: a run of some models kept apart from the "
                         "results file of all of them (and from report.py's tables, which read that one)")
    ap.add_argument("--time-limit", type=float, default=30.0, help="ILP time limit per solve (the meta rows)")
    a = ap.parse_args()
    torch.set_num_threads(1)
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    wanted = [] if a.models == "none" else a.models.split(",")
    cfgs = [c for c in floor_configs(a.quick) if c["name"] in wanted]
    unknown = set(wanted) - {c["name"] for c in cfgs}
    if unknown:
        ap.error(f"unknown models {sorted(unknown)}; pick from {','.join(FLOOR_SIZES)}")
    import transformers

    t0 = time.perf_counter()
    meta = dict(date=datetime.datetime.now().isoformat(timespec="seconds"), command=" ".join(["python"] + sys.argv),
                quick=a.quick, steps=max(4, a.steps), torch=torch.__version__, transformers=transformers.__version__,
                threads=torch.get_num_threads(), git=git_state().as_dict(), seed=SEED, load_start=load_average(),
                configs={c["name"]: c["kwargs"] for c in cfgs})
    print(f"autoremat from {autoremat.__file__}, repo {meta['git']}", flush=True)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"floor_cpu{'_quick' if a.quick else ''}{'_' + a.tag if a.tag else ''}"
    rows: list[dict] = []
    all_goals: dict = {}
    lm_meta: list[dict] = []
    earlier = json.loads(stem.with_suffix(".json").read_text()) if a.merge and stem.with_suffix(".json").exists() \
        else {}
    before = earlier.get("meta", {})
    before_commands = before.get("commands") or ([f"{before['command']} ({before['date']}, repo "
                                                   f"{before['git']['head']})"] if before else [])
    meta["commands"] = before_commands + [f"{meta['command']} ({meta['date']}, repo "
                                                                        f"{meta['git']['head']})"]
    kept = [c for c in floor_configs(a.quick) if c["name"] not in wanted and c["name"] in earlier.get("goals", {})]
    for c in kept:
        rows += [r for r in earlier["rows"] if r["model"] == c["name"]]
        all_goals[c["name"]] = earlier["goals"][c["name"]]

    def write() -> str:
        meta.update(wall_s=time.perf_counter() - t0, load_end=load_average())
        # the models in FLOOR_SIZES's order, merged or not
        rows.sort(key=lambda r: list(FLOOR_SIZES).index(r["model"]))
        ordered = {name: all_goals[name] for name in FLOOR_SIZES if name in all_goals}
        all_goals.clear()
        all_goals.update(ordered)
        ran = [c for c in floor_configs(a.quick) if c["name"] in all_goals]
        text = report(meta, ran, rows, all_goals) + lm_meta_section(lm_meta)
        stem.with_suffix(".md").write_text(text)
        stem.with_suffix(".json").write_text(json.dumps(dict(meta=meta, goals=all_goals, rows=rows, lm_meta=lm_meta),
                                                        indent=1, default=str))
        return text

    for cfg in cfgs:
        rows += bench_model(cfg, torch.device("cpu"), meta["steps"], a.inductor)
        all_goals[cfg["name"]] = goals(rows, cfg["name"])
        text = write()
    if a.quick or a.no_lm_meta:
        lm_meta = earlier.get("lm_meta", [])
    else:
        lm_meta = meta_part(a.time_limit)
    text = write()
    print("\n" + text, flush=True)
    print(f"wrote {stem}.md and .json", flush=True)


if __name__ == "__main__":
    main()
