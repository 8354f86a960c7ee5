"""Why floor.py measures its time goal head-to-head: step times drift over a benchmark process.

floor.py times each row against an eager step run just before it, row after row. Rows measured minutes apart
are then compared: checkpoint-every-block is timed early, autoremat at checkpoint's peak late, after
torch.compile's rows and the floor search. This script times the same two models (autoremat at checkpoint's
peak, checkpoint every block) against eager at the start of a process and again after floor.py's rows for that
model have run, and also two new copies built then. If both drift by as much, their ratio to each other holds
and only a comparison of rows measured at different times is biased; the head-to-head pairing avoids that.

    PYTHONPATH=.:benchmarks python benchmarks/drift.py [--model stack] [--full]

Writes benchmarks/results/drift_cpu.md.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import time

import torch
from common import (
    FLOOR_PT_BUDGETS,
    FLOOR_SIZES,
    OUTPUTS,
    REPO,
    Bench,
    ar_build,
    checkpoint_every_block,
    floor_configs,
    floor_row,
    make_step,
    paired_times,
    pt_build,
    run_row,
    sync,
)

from autoremat.measure import measure_peak

PAIRS = 21


def ratio_to_eager(bench: Bench, step) -> float:
    """Median over PAIRS of (step / the eager step just before it), as floor.py's rows."""
    rt, et = paired_times(bench.eager_step, step, PAIRS, lambda: sync(bench.device))
    return statistics.median(r / e for r, e in zip(rt, et))


def models(bench: Bench, budget: int) -> tuple[tuple, object, object]:
    """(the models, kept alive), autoremat's step at `budget`, checkpoint's step; each warmed up."""
    ar, _ = ar_build(budget, bench.ex, OUTPUTS)(bench.fresh())
    ckpt = checkpoint_every_block(bench.fresh())
    ar_step = make_step(ar, bench.args, bench.kwargs)
    ckpt_step = make_step(ckpt, bench.args, bench.kwargs)
    ar_step(), ckpt_step()
    return (ar, ckpt), ar_step, ckpt_step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="stack", choices=list(FLOOR_SIZES))
    ap.add_argument("--full", action="store_true", help="floor.py's default sizes (else its --quick ones)")
    a = ap.parse_args()
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    cfg = next(c for c in floor_configs(quick=not a.full) if c["name"] == a.model)
    bench = Bench(cfg, torch.device("cpu"), 7, lambda s: None)
    probe = checkpoint_every_block(bench.fresh())
    step = make_step(probe, bench.args, bench.kwargs)
    step()
    _, m = measure_peak(step, device=bench.device, baseline_objs=(probe, bench.ex))
    budget = m.peak_bytes  # checkpoint's steady-state peak, as floor.py's "@ checkpoint" row
    rows = []

    def measure(when: str, ar_step, ckpt_step) -> None:
        ar, ck = ratio_to_eager(bench, ar_step), ratio_to_eager(bench, ckpt_step)
        rows.append((when, ar, ck, ar / ck))
        print(f"{when}: autoremat {ar:.3f}, checkpoint {ck:.3f}, autoremat / checkpoint {ar / ck:.3f}", flush=True)

    first, ar_step, ckpt_step = models(bench, budget)
    measure("at the start", ar_step, ckpt_step)
    for b in FLOOR_PT_BUDGETS:  # floor.py's rows for this model, in its order
        run_row(bench, "pt-budget", f"amb={b}", pt_build(b, bench.args, bench.kwargs))
    floor_row(bench)
    run_row(bench, "autoremat", "@ checkpoint", ar_build(budget, bench.ex, OUTPUTS))
    measure("after floor.py's rows, the same two models", ar_step, ckpt_step)
    second, ar_step2, ckpt_step2 = models(bench, budget)
    measure("after floor.py's rows, two new models", ar_step2, ckpt_step2)
    text = (f"# Step-time drift over a benchmark process (why floor.py's time goal is head-to-head), cpu\n\n"
            f"Command: `python benchmarks/drift.py --model {a.model}{' --full' if a.full else ''}`, "
            f"{datetime.datetime.now().isoformat(timespec='seconds')}, torch {torch.__version__}, 1 thread, "
            f"wall {time.perf_counter() - t0:.0f} s. Model {a.model}: {cfg['kwargs']}; autoremat at checkpoint's "
            f"steady peak ({budget / 2**20:.2f} MiB). Each figure: median over {PAIRS} pairs of (step / the eager "
            "step just before it).\n\n"
            "| when | autoremat vs eager | checkpoint vs eager | autoremat / checkpoint |\n|---|---|---|---|\n"
            + "".join(f"| {w} | {x:.3f} | {y:.3f} | {z:.3f} |\n" for w, x, y, z in rows))
    out = REPO / "benchmarks" / "results" / "drift_cpu.md"
    out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
