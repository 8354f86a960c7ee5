"""LoRA (PEFT) fine-tuning: HF gradient checkpointing + LoRA against autoremat's floor, in one run.

The model is examples/lora.py's: an HF GPT-2 from config with a LoRA adapter (rank 8) on every attention and
MLP projection, the base frozen, dropout 0.1 in the base and the adapter; AdamW over the adapter only. One
step = forward, backward and the AdamW step (the adapter's AdamW state exists: the steady state), the loss
the only output read (autoremat: `outputs="loss"`). Rows:

  LoRA                       plain, nothing recomputed
  checkpointing + LoRA       HF's non-reentrant gradient checkpointing on every block (common.checkpoint_every_block)
  autoremat floor (eager)    autoremat.optimize at BudgetError.smallest_budget of budget=1, compiler="eager"
                             (tried again at the budget a refusal names, up to 4 tries: FLOOR_TRIES)
  autoremat floor (Inductor) the same with compiler="inductor": Inductor's own floor (its fused kernels free and
                             reuse buffers in other places than eager, so its floor is its own)
  autoremat @ checkpointing  compiler="eager" at checkpointing's measured peak: step time at equal memory,
                             timed head-to-head against checkpointing (common.head_to_head)

Peaks: `autoremat.measure_peak` of the third step, baseline = model + optimizer + batch. Gradient error: the
adapters' gradients after one forward + backward from no .grad, same seed as eager LoRA's, the relative norm
over all adapter tensors together (common.grad_rel_err); checkpointing's own error is the noise floor.

    PYTHONPATH=.:benchmarks python benchmarks/lora.py                # about 25 minutes on a shared 2-core CPU
    PYTHONPATH=.:benchmarks python benchmarks/lora.py --no-inductor  # about 10: Inductor's compiles are the long part

Writes benchmarks/results/lora_cpu.md (and with --json PATH, the rows as JSON).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
from common import (
    LORA_BATCH,
    LORA_SIZES,
    REPO,
    SEED,
    checkpoint_every_block,
    floor_of,
    git_state,
    grad_errors,
    head_to_head,
    load_average,
    lora_step,
    paired_times,
)

import autoremat
from autoremat.measure import measure_peak

MiB = 2**20
OUTPUTS = "loss"


def mib(x) -> str:
    return "" if x is None else f"{x / MiB:.2f}"


def make_step(fn, opt, batch):
    def step():
        fn(**batch).loss.backward()  # only the loss is read: the outputs object is dropped before the backward
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def adapter_grads(model, fn, batch) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(SEED)
    fn(**batch).loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def optimize(model, opt, batch, budget: int, compiler: str):
    torch._dynamo.reset()
    return autoremat.optimize(model, budget=int(budget), example_inputs=batch, optimizer=opt, outputs=OUTPUTS,
                              compiler=compiler, progress=False)


def smallest_budget(compiler: str) -> int:
    """BudgetError.smallest_budget of budget=1 (common.smallest_budget's method, with the AdamW optimizer)."""
    model, batch, opt = lora_step()
    return floor_of(lambda: optimize(model, opt, batch, 1, compiler))


def row(name: str, build, ref_grads: dict | None, n_time: int, eager_step=None) -> tuple[dict, object]:
    """build() -> (model, callable, optimizer, batch, info). Measures the steady-state peak, step time paired with
    eager LoRA's step, and the adapters' gradient error. Returns the row and its step (kept for head-to-head)."""
    r = dict(method=name)
    t0 = time.perf_counter()
    try:
        model, fn, opt, batch, info = build()
        r.update(info)
        if ref_grads is not None:
            r.update(grad_errors(adapter_grads(model, fn, batch), ref_grads))
        step = make_step(fn, opt, batch)
        step(), step()
        _, m = measure_peak(step, baseline_objs=(model, opt, batch))
        r.update(steady_peak=m.peak_bytes, status="ok")
        if r.get("predicted_peak"):
            r["predicted_vs_measured"] = r["predicted_peak"] / m.peak_bytes
        if eager_step is not None:
            rt, et = paired_times(eager_step, step, n_time, lambda: None)
            ratios = [a / b for a, b in zip(rt, et)]
            q1, _, q3 = statistics.quantiles(ratios, n=4)
            r.update(time_vs_lora=statistics.median(ratios), time_noise=(q3 - q1) / 2, step_s=statistics.median(rt))
    except autoremat.BudgetError as e:
        r.update(status="infeasible", smallest_budget=e.smallest_budget)
        step = None
    r["row_wall_s"] = time.perf_counter() - t0
    print(f"  {name}: " + ", ".join(f"{k}={v}" for k, v in r.items() if k not in ("method",)), flush=True)
    return r, step


def ar_build(budget: int, compiler: str):
    def build():
        model, batch, opt = lora_step()
        om = optimize(model, opt, batch, budget, compiler)
        p = om.plan
        info = dict(budget=int(budget), compiler_asked=compiler, predicted_peak=p.predicted_peak, predicted_overhead=p.overhead,
                    compiler_used=p.compiler.get("used"), loss_chunks=p.loss.get("chunks"),
                    planning_s=p.compiler.get("planning_s"))
        return model, om, opt, batch, info
    return build


# Tries at the budget the last refusal named: a floor row is a plan that held on a real step. The floor
# query predicts the smallest budget; under Inductor near the floor the real step can need more (a fused
# kernel holding more of the block's buffers at once than the memory model's one-node-at-a-time order), and
# verification then refuses with the budget its re-planned step measured.
FLOOR_TRIES = 4


def floor_row(name: str, compiler: str, ref_grads: dict, n_time: int, eager_step) -> dict:
    t0 = time.perf_counter()
    budgets = [smallest_budget(compiler)]
    r, _ = row(name, ar_build(budgets[0], compiler), ref_grads, n_time, eager_step)
    while r["status"] == "infeasible" and r.get("smallest_budget") and len(budgets) < FLOOR_TRIES:
        budgets.append(r["smallest_budget"])
        r, _ = row(f"{name} (try {len(budgets)})", ar_build(budgets[-1], compiler), ref_grads, n_time, eager_step)
    if len(budgets) > 1:
        r["retried_from"] = dict(budgets=budgets[:-1])
    r["floor_search_s"] = time.perf_counter() - t0
    gc.collect()
    return r


def table(rows: list[dict], ckpt_peak: int | None) -> str:
    lines = ["| method | budget (MiB) | steady peak (MiB) | / checkpointing | time / LoRA's ± noise | "
             "predicted / measured | adapter grad rel err | notes |", "|" + "---|" * 8]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"| {r['method']} | {mib(r.get('budget'))} | {r['status']}, smallest budget "
                         f"{mib(r.get('smallest_budget'))} | | | | | |")
            continue
        notes = []
        if r.get("compiler_used"):
            notes.append(f"compiler {r['compiler_used']}, loss in {r.get('loss_chunks')} chunk(s), predicted "
                         f"recompute {100 * r['predicted_overhead']:.1f}%, planned in {r.get('planning_s', 0):.0f} s")
        if r.get("compiler_asked") and r["compiler_asked"] != r.get("compiler_used"):
            notes.append(f"compiler={r['compiler_asked']!r} planned with {r.get('compiler_used')}: no plan fits this "
                         "budget under Inductor")
        if r.get("retried_from"):
            notes.append("refused by verification at " + ", ".join(f"{mib(b)}" for b in r["retried_from"]["budgets"])
                         + " MiB first")
        ratio = f"{r['steady_peak'] / ckpt_peak:.3f}" if ckpt_peak else ""
        tm = f"{r['time_vs_lora']:.2f} ± {r['time_noise']:.2f}" if "time_vs_lora" in r else ""
        pvm = f"{r['predicted_vs_measured']:.3f}" if "predicted_vs_measured" in r else ""
        err = f"{r['grad_rel_err']:.1e}" if "grad_rel_err" in r else ""
        lines.append(f"| {r['method']} | {mib(r.get('budget'))} | {mib(r['steady_peak'])} | {ratio} | {tm} | {pvm} | "
                     f"{err} | {'; '.join(notes)} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=9, help="timed pairs per row")
    ap.add_argument("--no-inductor", action="store_true", help="skip the compiler='inductor' floor row")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    ap.add_argument("--json", default=None, help="also write every row, timings included, to this file")
    a = ap.parse_args()
    torch.set_num_threads(1)
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated")  # peft on transformers 5
    import peft
    import transformers

    t_all = time.perf_counter()
    meta = dict(date=datetime.datetime.now().isoformat(timespec="seconds"), command=" ".join(["python"] + sys.argv),
                torch=torch.__version__, transformers=transformers.__version__, peft=peft.__version__,
                threads=torch.get_num_threads(), git=git_state().as_dict(), load_start=load_average(),
                sizes=LORA_SIZES, batch=LORA_BATCH)

    # eager LoRA: the reference for gradients and the paired partner for time
    lora, batch, lora_opt = lora_step()
    ref = adapter_grads(lora, lora, batch)
    eager_step = make_step(lora, lora_opt, batch)
    eager_step()
    rows = []
    r, _ = row("LoRA", lambda: (lora, lora, lora_opt, batch, {}), None, a.steps, eager_step)
    rows.append(r)

    def ckpt_build():
        model, b, opt = lora_step()
        return checkpoint_every_block(model), model, opt, b, {}

    ckpt, ckpt_step = row("checkpointing + LoRA", ckpt_build, ref, a.steps, eager_step)
    rows.append(ckpt)
    ckpt_peak = ckpt["steady_peak"]
    rows.append(floor_row("autoremat floor (compiler eager)", "eager", ref, a.steps, eager_step))
    if not a.no_inductor:
        rows.append(floor_row("autoremat floor (compiler inductor)", "inductor", ref, a.steps, eager_step))
    at, at_step = row("autoremat @ checkpointing's peak (eager)", ar_build(ckpt_peak, "eager"), ref, a.steps,
                      eager_step)
    rows.append(at)
    h2h = None
    if at_step is not None:
        h2h = head_to_head(at_step, ckpt_step, max(4, 2 * a.steps), lambda: None)
        print(f"  head-to-head autoremat @ checkpointing / checkpointing: {h2h['ratio']:.3f} ± {h2h['noise']:.3f}",
              flush=True)

    meta.update(wall_s=time.perf_counter() - t_all, load_end=load_average())
    floors = [r for r in rows if r["method"].startswith("autoremat floor") and r["status"] == "ok"]
    lines = [f"- {r['method']}: smallest budget {mib(r['budget'])} MiB, measured {mib(r['steady_peak'])} MiB = "
             f"{r['steady_peak'] / ckpt_peak:.3f} x checkpointing + LoRA's {mib(ckpt_peak)} MiB (budget / checkpointing "
             f"{r['budget'] / ckpt_peak:.3f})" for r in floors]
    if h2h:
        lines.append(f"- step time at equal memory (autoremat planned at checkpointing + LoRA's measured peak, compiler "
                     f"eager), head-to-head over {len(h2h['ratios'])} pairs: autoremat / checkpointing = "
                     f"{h2h['ratio']:.3f} ± {h2h['noise']:.3f} (90% interval of the median {h2h['interval'][0]:.3f}-"
                     f"{h2h['interval'][1]:.3f}; {h2h['a_s'] * 1e3:.0f} ms vs {h2h['b_s'] * 1e3:.0f} ms a step)")
    text = "\n".join([
        "# LoRA (PEFT) under a budget: checkpointing + LoRA against autoremat's floor, cpu\n",
        f"Command: `{meta['command']}`, {meta['date']}, torch {meta['torch']}, transformers {meta['transformers']}, "
        f"peft {meta['peft']}, {meta['threads']} thread, repo {meta['git']['head']} (uncommitted: "
        f"`{meta['git']['diff_stat'] or 'none'}`); wall {meta['wall_s']:.0f} s; load average {meta['load_start']} "
        f"at the start, {meta['load_end']} at the end (2 cores, shared with others' jobs).\n",
        f"Model: examples/lora.py's GPT-2 from config {LORA_SIZES}, batch {LORA_BATCH} x {LORA_SIZES['seq']}; LoRA on c_attn, c_proj, "
        "c_fc, base frozen; AdamW over the adapter. One step = forward, backward, AdamW step; only the loss read "
        "(autoremat: outputs='loss'). Steady peak: `autoremat.measure_peak` of the third step, baseline = model + "
        "optimizer + batch. Time: median over pairs of (row step / the plain LoRA step just before it), noise = half "
        "the interquartile range. Grad error: adapters only, one step from no .grad, same seed as plain LoRA "
        "(dropout 0.1 on), ||g - g_ref|| / ||g_ref|| over all adapter tensors together (common.grad_rel_err); "
        "checkpointing + LoRA's own error is the noise floor of this machine.\n",
        table(rows, ckpt_peak), "", *lines, ""])
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "lora_cpu.md").write_text(text)
    if a.json:
        Path(a.json).write_text(json.dumps(dict(meta=meta, rows=rows, head_to_head=h2h), indent=1, default=str))
    print("\n" + text, flush=True)


if __name__ == "__main__":
    main()
