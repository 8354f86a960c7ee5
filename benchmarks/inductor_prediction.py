"""autoremat's predicted peak against the measured one under compiler="inductor", at three budgets.

For each model of `speed.py --quick` (the transformer stack and the small HF GPT-2), and `floor.py --quick`'s
ResNet-shaped conv net (conv-BN-ReLU-dropout blocks, `conv`), and each dropout setting:
the smallest feasible budget and the least that recomputes nothing under Inductor (common.inductor_limits,
as speed.py finds them), then a plan at the smallest, the middle and the top of that range (speed.py's grid with 3 points), each planned
with verification on (a plan whose measured peak exceeds its budget is planned again, or refused), and
one steady-state step measured (`measure_peak`, gradients present from two warm-up steps). A smallest
budget that verification refuses (it measured more than predicted and the re-plan no longer fits) is
retried at the budget the refusal names, as speed.py does; the row says so. Columns:
predicted / measured peak, prediction error, budget used (measured / budget), each measured twice: with the
model's outputs held through the backward (what the memory model assumes, as optimize's verification
does) and with only the loss kept; the activation bytes the plan leaves unused against the least rise of
its simulated peak when one recomputed value is saved back (`saving_back`); verification's note.

    python benchmarks/inductor_prediction.py [--models stack,gpt2,conv] [--dropout 0.1,0.0] [--out PATH]

Writes benchmarks/results/inductor_prediction_cpu.md.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import re
import time
from pathlib import Path

import torch
from common import FLOOR_SIZES, REPO, SEED, git_state, inductor_limits, make_step, resnet, speed_configs, split

import autoremat
from autoremat.measure import measure_peak
from autoremat.model.devices import get_device
from autoremat.model.ledger import SLACK, Ledger
from autoremat.planning.verify import loss_of
from autoremat.solve.solver import evaluate

MiB = 2**20


class _Bench:
    """What common.inductor_limits needs: a fresh copy of the model and its example inputs."""

    def __init__(self, cfg: dict) -> None:
        torch.manual_seed(SEED)
        self.pristine, self.ex = cfg["factory"](**cfg["kwargs"])
        self.pristine.train()

    def fresh(self) -> torch.nn.Module:
        return copy.deepcopy(self.pristine)


def saving_back(om) -> str:
    """Whether the budget a plan leaves unused could buy back any recomputation: the activation bytes
    it leaves unused against the least that the simulated peak rises when one recomputed value is saved
    back instead, among those whose saving back lowers the predicted recompute time ("-" when none
    does: the plan recomputes nothing, or only values a compiler fuses into their readers anyway).
    Values come in sizes, so a plan can leave less than one of them unused and still be the fastest
    that fits."""
    graphs, plan = om._planner.sequence(), om.plan
    saved = [set(g.saved) | set(g.again) for g in plan.graphs]
    granularity = get_device("cpu").alloc_granularity
    schedules, timeline, cost = evaluate(graphs, saved, granularity)
    if timeline.peak != plan.activation_peak:
        return f"replay peaks at {timeline.peak} B, not the plan's {plan.activation_peak} B"
    # a plan that verification re-planned was solved with the measured gap reserved (pipeline.py's note)
    reserved = sum(int(m.group(1)) for n in plan.notes if (m := re.match(r"re-planned with (\d+) B reserved", n)))
    unused = plan.budget - SLACK - reserved - Ledger.from_dict(plan.ledger).fixed - plan.activation_peak
    rises = []
    for gi, (g, schedule) in enumerate(zip(graphs, schedules)):
        for v in schedule.recomputed:
            if g.nodes[v].time_s > 0:
                trial = [set(s) for s in saved]
                trial[gi].add(v)
                try:
                    _, trial_timeline, trial_cost = evaluate(graphs, trial, granularity)
                except ValueError:  # a set no schedule runs
                    continue
                if trial_cost < cost:
                    rises.append(trial_timeline.peak - timeline.peak)
    return f"{unused:,} B / {min(rises):,} B ({len(rises)} values)" if rises else "-"


def row(bench: _Bench, budget: int) -> dict:
    torch._dynamo.reset()
    model = bench.fresh()
    t0 = time.perf_counter()
    om = autoremat.optimize(model, budget=budget, example_inputs=bench.ex, optimizer=None, compiler="inductor",
                            progress=False)
    plan_s = time.perf_counter() - t0
    args, kwargs = split(bench.ex)

    def held() -> None:  # the outputs (GPT-2's logits) live through the backward, as the memory model assumes
        out = om(*args, **kwargs)
        loss_of(out).backward()
    dropped = make_step(om, args, kwargs)  # only the loss outlives the forward
    measured = {}
    for step in (held, dropped):
        step()
        step()
        measured[step] = measure_peak(step, device=torch.device("cpu"), baseline_objs=(model, bench.ex))[1].peak_bytes
    p = om.plan
    back = saving_back(om)
    notes = [n for n in p.notes if "verified" in n or "re-planned" in n]
    return dict(budget=budget, predicted=p.predicted_peak, measured=measured[held], dropped=measured[dropped],
                plan_s=plan_s, back=back, verify=(notes[0][:90] if notes else "-"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="stack,gpt2,conv")
    ap.add_argument("--dropout", default="0.1,0.0")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "inductor_prediction_cpu.md"))
    a = ap.parse_args()
    torch.set_num_threads(1)
    started = time.perf_counter()
    lines = ["| model | budget point | budget (MiB) | predicted (MiB) | measured (MiB) | prediction error | budget used "
             "| outputs dropped: measured (MiB) | error | budget used | unused / least rise saving one value back "
             "| plan s | verification |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for drop in (float(x) for x in a.dropout.split(",")):
        conv = dict(name="conv", factory=resnet, kwargs={**FLOOR_SIZES["resnet"][1], "dropout": drop})
        for cfg in [*speed_configs(True, drop), conv]:
            if cfg["name"] not in a.models.split(","):
                continue
            bench = _Bench(cfg)
            lo, hi, _ = inductor_limits(bench, "all")  # row() plans with optimize's default outputs="all"
            for point, budget in (("smallest", lo), ("middle", (lo + hi) // 2), ("top", hi)):
                try:
                    r = row(bench, int(budget))
                except autoremat.BudgetError as e:  # verification found more than predicted at the floor
                    if point != "smallest" or not e.smallest_budget:
                        raise
                    print(f"{cfg['name']}: BudgetError at {budget} B; retried at {e.smallest_budget} B", flush=True)
                    budget, point = e.smallest_budget, f"smallest (refused at {budget / MiB:.3f}: retried)"
                    r = row(bench, int(budget))
                err = r["predicted"] / r["measured"] - 1
                line = (f"| {cfg['name']} (dropout {drop}) | {point} | {budget / MiB:.3f} | {r['predicted'] / MiB:.3f} | "
                        f"{r['measured'] / MiB:.3f} | {err:+.1%} | {r['measured'] / budget:.1%} | "
                        f"{r['dropped'] / MiB:.3f} | {r['predicted'] / r['dropped'] - 1:+.1%} | "
                        f"{r['dropped'] / budget:.1%} | {r['back']} | {r['plan_s']:.0f} | "
                        f"{r['verify']} |")
                print(line, flush=True)
                lines.append(line)
    head = ["# autoremat's prediction under Inductor, CPU", "",
            f"Command: `python benchmarks/inductor_prediction.py --models {a.models} --dropout {a.dropout}`, "
            f"{datetime.datetime.now().isoformat(timespec='seconds')}, torch {torch.__version__}, 1 thread, repo "
            f"{git_state().line()}, wall {time.perf_counter() - started:.0f} s.", "",
            "Models: `speed.py --quick`'s (stack, gpt2) and `floor.py --quick`'s resnet (conv). Budgets: the smallest feasible, the middle and the top (the least budget "
            "that recomputes nothing, Plan.no_recompute_budget) of autoremat's range under Inductor. Measured: one steady-state step, `measure_peak`, with "
            "the model's outputs held through the backward (`out = model(...); loss_of(out).backward()`: what the memory "
            "model assumes, as optimize's verification and a training loop that keeps `out` do), and with only the loss "
            "kept (`loss_of(model(...)).backward()`: the logits die after the forward; `outputs=\"loss\"` tells the "
            "planner so). Unused / least rise: the activation bytes the plan leaves unused (less what verification "
            "reserved, where it re-planned), against the least its "
            "simulated peak rises when one recomputed value is saved back, among those whose saving back lowers the predicted "
            "recompute time (every recomputed value tried): "
            "where the rise is larger, no single value's recomputation can be bought back with what is left.", ""]
    Path(a.out).write_text("\n".join(head + lines) + "\n")
    print("wrote", a.out)


if __name__ == "__main__":
    main()
