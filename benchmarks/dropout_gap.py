"""Where the time goes on speed.py's launch-bound GPT-2 at equal memory with Inductor: the cut into graphs,
and dropout drawn as eager draws it.

speed.py measures autoremat (compiler="inductor") at Inductor's measured peak on GPT-2 (4 layers, d=32,
8 tokens): head-to-head at stop 32, 1.26-1.40x torch.compile's time there with dropout, 0.93-1.09x without
(at stop 33, after the two fixes this script found, 0.96-1.01x and 0.89-0.97x: results/speed_cpu.md). This
script takes the gap apart, per dropout setting (0.1, 0.0), all in one process and each ratio head-to-head
(common.head_to_head: alternating pairs, each timed step after an untimed step of the same model):

  inductor            torch.compile(backend="inductor") at activation_memory_budget 1.0 (the peer)
  autoremat default   autoremat.optimize(compiler="inductor", outputs="loss") at that row's measured peak:
                      what speed.py's equal-memory row runs (regions="auto" decides how many graphs)
  autoremat one graph the same with regions=False, at the smallest budget where one graph fits if the
                      peer's peak is too small for it (the budget is printed, and why it did not fit)

Ratios: default / one graph is what the cut into graphs costs; one graph / inductor, with dropout against
without, is what dropout costs autoremat beyond what it costs Inductor (autoremat's gradients equal
eager's, dropout masks included; Inductor draws its own random numbers inside its kernels, so its masks
differ from eager's: speed.py's gradient error column). Last, each form planned with nothing recomputed
(a roomy budget, verify=False), its predicted peak against the measured one: how exact the memory model
is for each form under Inductor.

    PYTHONPATH=.:benchmarks python benchmarks/dropout_gap.py     # ~3 min on a 2-core CPU

Writes benchmarks/results/dropout_gap_cpu.md.
"""

from __future__ import annotations

import datetime
import gc
import os
import sys
import time
from pathlib import Path

import torch
from common import Bench, MiB, compiled_graphs, git_state, head_to_head, inductor_build, make_step, speed_configs, sync

import autoremat
from autoremat.measure import measure_peak

PAIRS = 41
AMB = 1.0


def autoremat_model(bench: Bench, budget: int, regions: bool | str) -> tuple[autoremat.RematModule, int, str]:
    """autoremat at `budget`, or at the smallest budget that fits if `budget` does not; (module, budget used,
    why the budget asked for did not fit: the BudgetError's reserve notes, or "")."""
    def build(b: int) -> autoremat.RematModule:
        return autoremat.optimize(bench.fresh(), budget=b, example_inputs=bench.ex, optimizer=None,
                                  compiler="inductor", progress=False, regions=regions, outputs="loss")
    try:
        return build(budget), budget, ""
    except autoremat.BudgetError as e:
        reserved = [n for n in e.ledger.notes if "reserved" in n]
        why = "; ".join(reserved) or "infeasible as predicted"
        try:
            return build(e.smallest_budget), e.smallest_budget, why
        except autoremat.BudgetError as again:  # smallest_budget can move a little on a second plan (speed.py)
            return build(again.smallest_budget), again.smallest_budget, why


def prediction(bench: Bench, regions: bool) -> str:
    """Predicted and measured peak with nothing recomputed (a roomy budget, no verification): how exact the
    memory model is for each form under Inductor."""
    model = bench.fresh()
    om = autoremat.optimize(model, budget=4 * 2**20, example_inputs=bench.ex, optimizer=None, compiler="inductor",
                            progress=False, regions=regions, outputs="loss", verify=False)
    step = make_step(om, bench.args, bench.kwargs)
    step()
    _, m = measure_peak(step, baseline_objs=(model, bench.ex))
    return (f"{om.num_graphs} | {1e3 * om.plan.recompute_time_s:.3f} | {om.plan.predicted_peak:,} | {m.peak_bytes:,} | "
            f"{m.peak_bytes - om.plan.predicted_peak:+,}")


def measure(dropout: float, log) -> tuple[list[str], list[str], list[str]]:
    """Table lines for one dropout setting: the models, the head-to-head ratios, the memory model's error."""
    cfg = next(c for c in speed_configs(False, dropout) if c["name"] == "gpt2")
    bench = Bench(cfg, torch.device("cpu"), 5, log)
    torch._dynamo.reset()
    peer, _ = inductor_build(AMB, bench.args, bench.kwargs)(bench.fresh())
    peer_step = make_step(peer, bench.args, bench.kwargs)
    peer_step()
    _, m = measure_peak(peer_step, baseline_objs=(peer, bench.ex))
    peak = m.peak_bytes
    default, b_default, _ = autoremat_model(bench, peak, "auto")
    one, b_one, why_not = autoremat_model(bench, peak, False)
    steps = {"inductor": peer_step, "default": make_step(default, bench.args, bench.kwargs),
             "one graph": make_step(one, bench.args, bench.kwargs)}
    steps["default"](), steps["one graph"]()  # warm-up: every .grad exists from now on
    # autoremat compiled fresh code objects, so the peer keeps the code compiled under its budget: nothing may
    # compile from here on (the peer's next step included)
    before = compiled_graphs()
    peer_step()
    lines = [f"| {dropout} | inductor amb={AMB} | {peak / MiB:.3f} | | | |",
             f"| {dropout} | autoremat default | {b_default / MiB:.3f} | {default.num_graphs} | "
             f"{1e3 * default.plan.recompute_time_s:.3f} | |",
             f"| {dropout} | autoremat one graph | {b_one / MiB:.3f} | {one.num_graphs} | "
             f"{1e3 * one.plan.recompute_time_s:.3f} | {why_not} |"]
    ratios = []
    for a, b in (("default", "inductor"), ("default", "one graph"), ("one graph", "inductor")):
        h = head_to_head(steps[a], steps[b], PAIRS, lambda: sync(bench.device))
        log(f"  dropout {dropout}: {a} / {b} = {h['ratio']:.3f} (90% {h['interval'][0]:.3f}-{h['interval'][1]:.3f})")
        ratios.append(f"| {dropout} | autoremat {a} / {b} | {h['ratio']:.3f} | "
                      f"{h['interval'][0]:.3f}-{h['interval'][1]:.3f} | {100 * h['noise']:.1f}% | "
                      f"{1e3 * h['a_s']:.3f} / {1e3 * h['b_s']:.3f} |")
    if compiled_graphs() != before:
        raise RuntimeError("a graph was compiled while the pairs were timed: not the programs built above")
    del peer, peer_step, default, one, steps
    gc.collect()
    torch._dynamo.reset()
    exact = [f"| {dropout} | {form} | {prediction(bench, regions)} |"
             for form, regions in (("one graph", False), ("one graph per block", True))]
    torch._dynamo.reset()
    return lines, ratios, exact


def main() -> None:
    torch.set_num_threads(1)
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    t0 = time.perf_counter()
    date = datetime.datetime.now().isoformat(timespec="seconds")
    rows, ratios, exact = [], [], []
    for dropout in (0.1, 0.0):
        r, h, e = measure(dropout, lambda s: print(s, flush=True))
        rows, ratios, exact = rows + r, ratios + h, exact + e
    cfg = next(c for c in speed_configs(False, 0.0) if c["name"] == "gpt2")
    text = (f"# speed.py's launch-bound GPT-2 at Inductor's peak: the cut and dropout, measured apart (CPU)\n\n"
            f"Command: `PYTHONPATH=.:benchmarks python benchmarks/dropout_gap.py`, {date}, torch {torch.__version__}, "
            f"1 thread, repo {git_state().line()}, wall {time.perf_counter() - t0:.0f} s.\n\n"
            f"Model: GPT-2 {cfg['kwargs']} (dropout per row), autoremat outputs='loss'. Step = forward + backward, "
            f"no optimizer, every `.grad` allocated by a warm-up step. Each ratio: median of {PAIRS} head-to-head "
            f"pairs (benchmarks/common/), a 90% bootstrap interval of that median, and half the interquartile "
            f"range of the pairs (noise).\n\n"
            "| dropout | model | budget (MiB; the peer: its measured peak) | autoremat graphs | predicted recompute (ms) | "
            "why not at the peer's peak |\n|---|---|---|---|---|---|\n" + "\n".join(rows) + "\n\n"
            "| dropout | ratio | median | 90% interval | noise | median step (ms), first / second |\n"
            "|---|---|---|---|---|---|\n" + "\n".join(ratios) + "\n\n"
            "The memory model under Inductor with nothing recomputed (a 4 MiB budget, verify=False), bytes of the "
            "whole step (parameters, gradients, inputs, activations):\n\n"
            "| dropout | form | graphs | predicted recompute (ms) | predicted peak | measured peak | measured - "
            "predicted |\n|---|---|---|---|---|---|---|\n" + "\n".join(exact) + "\n")
    print("\n" + text)
    dest = Path(__file__).resolve().parent / "results" / "dropout_gap_cpu.md"
    dest.write_text(text)
    print(f"wrote {dest}")


if __name__ == "__main__":
    sys.exit(main())
