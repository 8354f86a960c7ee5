"""What is live at the floor's peak (what keeps the floor from going lower): the largest tensors when the step peaks.

For each model, autoremat is planned at its smallest feasible budget (`BudgetError.smallest_budget` of
budget=1, outputs="loss" (or --outputs all), no optimizer, verify off so the first plan is the one measured), one
steady-state step is measured (`measure_peak`, every `.grad` present; the step drops the model's outputs but the
loss before its backward, so with --outputs all the measured peak lies below the predicted one by what the plan
holds for the caller), and the plan is replayed in the memory model with its heap observed: at the step where the
simulated peak falls, every live storage, largest first.

    python benchmarks/live_at_peak.py --models stack,gpt2 [--quick] [--top 5]   # --top 0 lists every storage

Writes benchmarks/results/live_at_peak_cpu[_quick].md.
"""

from __future__ import annotations

import argparse
import datetime
import sys
import time
from pathlib import Path

import torch
from common import REPO, floor_configs, git_state, live_at_peak, make_step, split

import autoremat
from autoremat.measure import measure_peak
from autoremat.model.devices import get_device
from autoremat.passes.recompute_names import base

MiB = 2**20


def one(cfg: dict, top: int, outputs: str = "loss") -> str:
    torch.manual_seed(0)
    model, ex = cfg["factory"](**cfg["kwargs"])
    model.train()
    args, kwargs = split(ex)
    torch._dynamo.reset()
    try:
        autoremat.optimize(model, budget=1, example_inputs=ex, optimizer=None, outputs=outputs, verify=False,
                           compiler="eager")
        raise RuntimeError("budget=1 did not raise BudgetError")
    except autoremat.BudgetError as e:
        budget = e.smallest_budget
    torch._dynamo.reset()
    om = autoremat.optimize(model, budget=budget, example_inputs=ex, optimizer=None, outputs=outputs, verify=False,
                           compiler="eager")
    step = make_step(om, args, kwargs)
    step()
    _, m = measure_peak(step, device=torch.device("cpu"), baseline_objs=(model, ex))
    plan = om.plan
    profiles = om._planners[0].profiles
    # a cut (recompute again from here, autoremat/model/cuts.py) is named among the saved values
    best = live_at_peak(profiles, [set(g.saved) | set(g.again) for g in plan.graphs], get_device("cpu").alloc_granularity)
    g = profiles[best["graph"]]
    where = g.nodes[base(best["node"])]
    live = sorted(best["live"].items(), key=lambda kv: -kv[1])
    lines = [f"## {cfg['name']}: {cfg['kwargs']}" + (f", outputs={outputs!r}" if outputs != "loss" else ""), "",
             f"floor budget {budget / MiB:.2f} MiB; predicted peak {plan.predicted_peak / MiB:.2f} MiB, measured "
             f"{m.peak_bytes / MiB:.2f} MiB (predicted / measured {plan.predicted_peak / m.peak_bytes:.4f}); "
             f"activations at the peak {best['during'] / MiB:.2f} MiB, of which live storages "
             f"{sum(best['live'].values()) / MiB:.2f} MiB and the running op's scratch "
             f"{(best['during'] - sum(best['live'].values())) / MiB:.2f} MiB.",
             f"The peak: graph {best['graph']} ({where.module or 'no module'}), {best['phase']} op `{best['node']}` "
             f"({where.target}).", "",
             "| # | graph | tensor | op | shape | module | kind | MiB |", "|---|---|---|---|---|---|---|---|"]
    top = top or len(live)  # 0: every live storage
    for i, ((scope, name), size) in enumerate(live[:top], 1):
        p = profiles[scope].nodes[base(name)]
        lines.append(f"| {i} | {scope} | `{name}` | {p.target} | {p.shape} | {p.module} | {p.kind} | {size / MiB:.3f} |")
    rest = live[top:]
    lines += ["", f"The other {len(rest)} live storages: {sum(s for _, s in rest) / MiB:.2f} MiB.", ""]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="stack,gpt2")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--outputs", default="loss", choices=("loss", "all"),
                    help="autoremat's outputs=: 'all' keeps the logits output whole, as a loop that holds it needs")
    ap.add_argument("--top", type=int, default=5, help="how many live storages to list (0: all of them)")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    ap.add_argument("--name", default="live_at_peak_cpu", help="the results file's stem")
    ap.add_argument("--note", default="", help="a sentence for the header (e.g. which autoremat was imported)")
    a = ap.parse_args()
    torch.set_num_threads(1)
    cfgs = {c["name"]: c for c in floor_configs(a.quick)}
    unknown = [m for m in a.models.split(",") if m not in cfgs]
    if unknown:
        ap.error(f"unknown models {unknown}; pick from {','.join(cfgs)}")
    t0 = time.perf_counter()
    parts = [one(cfgs[m], a.top, a.outputs) for m in a.models.split(",")]
    head = ["# Live at the floor's peak on cpu", "",
            f"Command: `python {' '.join(sys.argv)}`, {datetime.datetime.now().isoformat(timespec='seconds')}, "
            f"torch {torch.__version__}, repo {git_state().as_dict()}, wall {time.perf_counter() - t0:.0f} s. The heap "
            "is the memory model's (autoremat.model.memory.simulate) replaying the plan; the measured peak says it is "
            f"the real one. Sizes of the benchmark's rows (benchmarks/floor.py). autoremat from {autoremat.__file__}. "
            f"{a.note}", ""]
    text = "\n".join(head + parts)
    out = Path(a.out) / f"{a.name}{'_quick' if a.quick else ''}.md"
    out.write_text(text)
    print(text)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
