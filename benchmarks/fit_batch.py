"""Time per global batch under a byte budget: no recompute, checkpoint-every-block, autoremat.fit.

For each budget (two, as fractions of one no-recompute step on the whole global batch), on HF GPT-2
(`examples.models.gpt2`), AdamW state counted in every budget:
  no-recompute   eager model at the largest micro-batch (a divisor of the global batch) whose measured
                 step fits
  checkpoint     model.gradient_checkpointing_enable(use_reentrant=False), largest micro-batch that fits
  autoremat.fit  the micro-batch and plan fit chooses (its step measured too)
Peaks are measured with autoremat.measure.measure_peak (one forward+backward after a warm-up, so the
gradients exist) plus the AdamW state bytes; time per global batch is the median of N runs of
k micro-steps + one optimizer step.

    python benchmarks/fit_batch.py            # ~6 min on a 2-core CPU
    python benchmarks/fit_batch.py --quick    # ~2 min

Writes benchmarks/results/fit_batch_cpu[_quick].md.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.append(str(REPO))

import autoremat  # noqa: E402
from autoremat.fit import fit  # noqa: E402
from autoremat.measure import measure_peak  # noqa: E402
from autoremat.model.ledger import optimizer_state_bytes  # noqa: E402
from examples.models import gpt2  # noqa: E402

FRACTIONS = (0.6, 0.35)


def batch(m: int, seq: int, vocab: int, seed: int = 0) -> dict:
    ids = torch.randint(0, vocab, (m, seq), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids}


def measured_total(model, m: int, seq: int, vocab: int, state_bytes: int) -> int:
    ex = batch(m, seq, vocab)

    def step() -> None:
        model(**ex).loss.backward()

    step()  # warm-up: gradients exist, as in an accumulation loop
    _, meas = measure_peak(step, baseline_objs=(model, ex))
    model.zero_grad(set_to_none=True)
    return meas.peak_bytes + state_bytes


def largest_fitting(model, sizes: list[int], seq: int, vocab: int, state_bytes: int, budget: int,
                    peaks: dict) -> int | None:
    best = None
    for m in sizes:  # ascending: stop at the first that does not fit
        if m not in peaks:
            peaks[m] = measured_total(model, m, seq, vocab, state_bytes)
        if peaks[m] > budget:
            break
        best = m
    return best


def time_global(model, call, m: int, k: int, seq: int, vocab: int, reps: int) -> float:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batches = [batch(m, seq, vocab, seed=i) for i in range(k)]

    def run() -> None:
        for ex in batches:
            (call(**ex).loss / k).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    run()  # warm-up (optimizer state, compiled code)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        run()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    p.add_argument("--reps", type=int, default=None)
    args = p.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", category=UserWarning)
    if args.quick:
        shape = dict(n_layer=2, n_embd=128, n_head=4, vocab=512, seq=128)
        global_batch, reps = 16, args.reps or 3
    else:
        shape = dict(n_layer=4, n_embd=128, n_head=4, vocab=1024, seq=256)
        global_batch, reps = 32, args.reps or 5
    seq, vocab = shape["seq"], shape["vocab"]
    torch.manual_seed(0)
    base, _ = gpt2(batch=1, dropout=0.0, **shape)
    state_bytes = optimizer_state_bytes("adamw", [p for p in base.parameters() if p.requires_grad])
    sizes = [d for d in range(1, global_batch + 1) if global_batch % d == 0]

    eager = copy.deepcopy(base)
    ckpt = copy.deepcopy(base)
    ckpt.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    eager_peaks: dict[int, int] = {}
    ckpt_peaks: dict[int, int] = {}
    full = measured_total(eager, global_batch, seq, vocab, state_bytes)
    eager_peaks[global_batch] = full
    print(f"HF GPT-2 {shape}, global batch {global_batch}; one no-recompute step on it measures "
          f"{autoremat.format_bytes(full)} (incl. {autoremat.format_bytes(state_bytes)} AdamW state)", flush=True)

    rows = []
    for frac in FRACTIONS:
        budget = int(frac * full)
        row: dict = {"budget": budget, "frac": frac}
        for name, model in (("no-recompute", eager), ("checkpoint", ckpt)):
            peaks = eager_peaks if name == "no-recompute" else ckpt_peaks
            m = largest_fitting(model, sizes, seq, vocab, state_bytes, budget, peaks)
            t = time_global(model, model, m, global_batch // m, seq, vocab, reps) if m else None
            row[name] = (m, peaks.get(m), t)
            print(f"  budget {autoremat.format_bytes(budget)}: {name} micro-batch {m}, "
                  f"{t and f'{t:.3f} s'} per global batch", flush=True)
        t0 = time.perf_counter()
        model = copy.deepcopy(base)
        sample = {k: v[0] for k, v in batch(1, seq, vocab).items()}  # one example, no batch dimension
        cfg = fit(model, budget, global_batch, sample, optimizer="adamw", compiler="eager")
        fit_s = time.perf_counter() - t0
        m = cfg.micro_batch
        measured = measured_total(cfg.model, m, seq, vocab, state_bytes)
        t = time_global(model, cfg.model, m, cfg.accumulation_steps, seq, vocab, reps)
        row["autoremat.fit"] = (m, measured, t)
        row["fit_s"] = fit_s
        row["report"] = cfg.report()
        print(f"  budget {autoremat.format_bytes(budget)}: autoremat.fit micro-batch {m} (planned in {fit_s:.0f} s), "
              f"measured {autoremat.format_bytes(measured)}, {t:.3f} s per global batch", flush=True)
        rows.append(row)

    lines = [f"# autoremat.fit vs fixed strategies, CPU{' (quick)' if args.quick else ''}", "",
             f"HF GPT-2 {shape}, dropout 0, fp32, AdamW, global batch {global_batch}, torch {torch.__version__}, "
             f"1 thread. One no-recompute step on the whole global batch measures {autoremat.format_bytes(full)}. "
             f"Time per global batch: median of {reps} runs (k micro-steps + AdamW step). "
             "Ratios: time / autoremat.fit's time at the same budget.", "",
             "| budget | method | micro-batch x steps | measured peak | fits | time / global batch | ratio |",
             "|---|---|---|---|---|---|---|"]
    for row in rows:
        ref = row["autoremat.fit"][2]
        for name in ("no-recompute", "checkpoint", "autoremat.fit"):
            m, peak, t = row[name]
            if m is None:
                lines.append(f"| {autoremat.format_bytes(row['budget'])} ({row['frac']:.0%}) | {name} | none fits | | | | |")
                continue
            lines.append(f"| {autoremat.format_bytes(row['budget'])} ({row['frac']:.0%}) | {name} | {m} x "
                         f"{global_batch // m} | {autoremat.format_bytes(peak)} | "
                         f"{'yes' if peak <= row['budget'] else 'NO'} | {t:.3f} s | {t / ref:.2f} |")
    for row in rows:
        lines += ["", f"fit report at {autoremat.format_bytes(row['budget'])} (planning took {row['fit_s']:.0f} s):",
                  "", "```", row["report"], "```"]
    text = "\n".join(lines) + "\n"
    print("\n" + text)
    out = REPO / "benchmarks" / "results" / f"fit_batch_cpu{'_quick' if args.quick else ''}.md"
    out.write_text(text)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
