"""The loss region benchmark: the chunked projection + cross-entropy, side by side with eager and
checkpointing.

Part 1, a real CPU run of a GPT-2-shaped HF model with a 32k vocabulary (rows as in benchmarks/floor.py, each on
its own deep copy of one initial model; steady-state and first-micro-step peaks, paired step time vs eager,
gradient error vs eager):
  eager                          plain PyTorch
  checkpoint                     HF's own non-reentrant checkpointing of every block
  autoremat, chunking off        autoremat.optimize at its floor with the loss rewrite disabled (one chunk,
                                 loss_chunks.CANDIDATES = (1,))
  autoremat outputs=all          at its floor (BudgetError.smallest_budget of budget=1), logits output kept
  autoremat outputs=loss         at its floor, only the loss used (logits output None)
  autoremat outputs=... @ ckpt   at checkpoint's measured steady-state peak

Part 2, GPT-2 small at 8 x 1024 planned on the meta device for an H100 roofline (what
`autoremat plan examples/models.py:gpt2_small --batch 8 --seq 1024 --device h100 [--outputs loss]` reports):
the smallest feasible budget without the rewrite, with it (outputs=all) and with outputs=loss, each then planned
at that budget to show that it is feasible (common.meta_part: floor.py adds these rows to its results too).

    python benchmarks/loss_region.py            # both parts
    python benchmarks/loss_region.py --quick    # smaller CPU model, part 2 skipped

Writes benchmarks/results/loss_region_cpu[_quick].md and .json.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import re
import sys
from pathlib import Path

import torch
from common import (
    Bench,
    checkpoint_every_block,
    chunking_off,
    eager_build,
    git_state,
    load_average,
    meta_part,
    meta_table,
    run_row,
)

import autoremat
from examples.models import gpt2

MiB = 2**20


def ar_build(budget: int, ex, outputs: str, off: bool = False):
    def build(model):
        torch._dynamo.reset()
        with chunking_off() if off else contextlib.nullcontext():
            om = autoremat.optimize(model, budget=int(budget), example_inputs=ex, optimizer=None, outputs=outputs, compiler="eager")
        p = om.plan
        info = dict(budget=int(budget), predicted_peak=p.predicted_peak, activation_peak=p.activation_peak,
                    chunks=p.loss.get("chunks", 1), outputs=outputs, predicted_overhead=p.overhead)
        # optimize's own check: one step with the outputs held through the backward, as the plan assumes
        # (common.run_row's step drops the logits before its backward, so its peak can sit below the plan's)
        found = [re.search(r"measured activation peak (\d+) B, predicted (\d+) B", n) for n in p.notes]
        found = [m for m in found if m]
        if found:
            info["verify_activation_pred_vs_meas"] = int(found[-1].group(2)) / int(found[-1].group(1))
        return om, info
    build.budget = int(budget)
    return build


def floor_budget(bench, outputs: str, off: bool = False) -> int:
    torch._dynamo.reset()
    with chunking_off() if off else contextlib.nullcontext():
        try:
            autoremat.optimize(bench.fresh(), budget=1, example_inputs=bench.ex, optimizer=None, outputs=outputs, compiler="eager")
        except autoremat.BudgetError as e:
            return e.smallest_budget
    raise RuntimeError("budget=1 did not raise BudgetError")


def floor_row(bench, outputs: str, setting: str, off: bool = False) -> dict:
    first = floor_budget(bench, outputs, off)
    row = run_row(bench, "autoremat", setting, ar_build(first, bench.ex, outputs, off))
    if row["status"] == "infeasible" and row.get("smallest_budget"):  # verification moved the floor: once more
        row = run_row(bench, "autoremat", setting + " (retried)",
                      ar_build(row["smallest_budget"], bench.ex, outputs, off))
    return row


def cpu_part(quick: bool, n_steps: int) -> tuple[dict, list[dict]]:
    kw = dict(batch=2, seq=64, n_layer=2, n_embd=64, n_head=4, vocab=32768) if quick else \
        dict(batch=4, seq=128, n_layer=2, n_embd=128, n_head=4, vocab=32768)
    cfg = dict(name="gpt2-32k", factory=gpt2, kwargs=kw)
    print(f"== {cfg['name']}: {kw}", flush=True)
    bench = Bench(cfg, torch.device("cpu"), n_steps, lambda s: print(s, flush=True))
    rows = [run_row(bench, "eager", "-", eager_build),
            run_row(bench, "checkpoint", "every block", lambda m: (checkpoint_every_block(m), {})),
            floor_row(bench, "all", "floor, chunking off", off=True),
            floor_row(bench, "all", "floor, outputs=all"),
            floor_row(bench, "loss", "floor, outputs=loss")]
    ckpt = rows[1]
    for outputs in ("all", "loss"):
        if ckpt["status"] == "ok":
            rows.append(run_row(bench, "autoremat", f"@ checkpoint, outputs={outputs}",
                                ar_build(ckpt["steady_peak"], bench.ex, outputs)))
    return cfg, rows


def cpu_table(rows: list[dict]) -> str:
    lines = ["| method | setting | status | steady peak (MiB) | first-step peak (MiB) | predicted (MiB) | pred/meas "
             "| verify: activations pred/meas | chunks | time vs eager | grad rel err |", "|" + "---|" * 11]
    for r in rows:
        def f(k, scale=MiB, fmt="{:.1f}", r=r):
            return fmt.format(r[k] / scale) if r.get(k) is not None else "-"
        lines.append(f"| {r['method']} | {r['setting']} | {r['status'][:60]} | {f('steady_peak')} | "
                     f"{f('first_step_peak')} | {f('predicted_peak')} | {f('predicted_vs_measured', 1, '{:.4f}')} | "
                     f"{f('verify_activation_pred_vs_meas', 1, '{:.6f}')} | "
                     f"{r.get('chunks', '-')} | {f('time_vs_eager', 1, '{:.2f}')} | "
                     f"{f('grad_rel_err', 1, '{:.2e}')} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--steps", type=int, default=5, help="paired timing steps per row")
    ap.add_argument("--time-limit", type=float, default=30.0, help="ILP time limit per solve (meta part)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    started = datetime.datetime.now(datetime.timezone.utc)
    git = git_state().as_dict()  # the code the rows run, before anything can change it
    cfg, rows = cpu_part(args.quick, args.steps)
    meta = [] if args.quick else meta_part(args.time_limit)
    out = Path(__file__).parent / "results" / f"loss_region_cpu{'_quick' if args.quick else ''}"
    info = dict(started=started.isoformat(timespec="seconds"), torch=torch.__version__, git=git,
                load=load_average(), cpu_model=cfg["kwargs"], command=" ".join(["python", *sys.argv]),
                threads=torch.get_num_threads(), omp=os.environ.get("OMP_NUM_THREADS"))
    text = "\n".join([
        "# Loss region", "", f"`{info['command']}` on {info['started']}, torch {info['torch']}, "
        f"git {info['git']}, load {info['load']}, 1 thread.", "",
        f"## Real CPU run: HF GPT-2 {cfg['kwargs']} (fp32, dropout 0.1, optimizer state not in the peaks)", "",
        "Peaks are measured (profiler allocator events, autoremat.measure.measure_peak), with the model and its "
        "inputs. `pred/meas`: autoremat's predicted step peak over the measured steady-state peak of this "
        "benchmark's step, which drops the model's outputs before its backward, while a plan holds them through "
        "it (as a loop that keeps `outputs` does): with outputs=all the logits make the prediction higher. "
        "`verify`: optimize's own measurement at planning time, with the outputs held: predicted over measured "
        "activation peak.", "",
        cpu_table(rows), "",
        *(["## GPT-2 small, 8 x 1024, planned on meta for an H100 (fp32, AdamW)", "", meta_table(meta), ""]
          if meta else []),
    ])
    out.with_suffix(".md").write_text(text + "\n")
    out.with_suffix(".json").write_text(json.dumps(dict(info=info, cpu=rows, meta=meta), indent=1, default=str))
    print(text)


if __name__ == "__main__":
    main()
