"""The smallest-peak search (what a floor query and a plan near the floor run) with the simulator's memos on
and off, side by side.

A search simulates the whole step once per change it tries, and most changes touch one graph of several.
The `remember` switch (autoremat/switches.py, on by default) lets the simulator reuse what it worked out for the graphs
a change left alone: each graph's schedule for its saved set, Inductor's kernel order for it, and its last
uses. Off, every simulation works everything out afresh. For each model the step is traced once (one graph
per repeated block: `regions=True`, the form the floor is searched in), then `solver.smallest_peak` runs on
those graphs with the memos on and off, alternating, `--rounds` times each; the remembered floors of earlier
calls (`solver.forget_floors`) and the memos are cleared before every run. Reported: the median of each, the
ratio off / on (each round's pair, then the median), and whether both found the same plan (its peak, its
recompute time, its saved sets).

    PYTHONPATH=.:benchmarks python benchmarks/floor_search.py [--rounds 2] [--models lora,llama,stack]

Writes benchmarks/results/floor_search_cpu.md and .json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from common import git_state, load_average, lora_step, speed_configs

import autoremat
from autoremat import switches
from autoremat.model import memory
from autoremat.model.devices import get_device
from autoremat.solve import solver
from examples.models import llama

RESULTS = Path(__file__).parent / "results"


def models() -> dict:
    """name -> () -> (model, example inputs, optimizer, outputs, compiler)."""
    def lora():
        model, batch, opt = lora_step()
        return model, batch, opt, "loss", "inductor"

    def llama_2l():
        model, ids = llama(2, 64, 2, 64, 4, 1024)
        return model, ids, None, "loss", "eager"

    def stack():
        cfg = next(c for c in speed_configs(True, 0.1) if c["name"] == "stack")
        model, ex = cfg["factory"](**cfg["kwargs"])
        return model, ex, None, "all", "inductor"
    return {"lora": lora, "llama": llama_2l, "stack": stack}


def traced(build) -> tuple[list, str]:
    torch.manual_seed(0)
    model, ex, opt, outputs, compiler = build()
    model.train()
    torch._dynamo.reset()
    om = autoremat.optimize(model, budget=10**12, example_inputs=ex, optimizer=opt, outputs=outputs,
                            compiler=compiler, regions=True, verify=False, progress=False)
    return om._planners[0].sequence(), compiler


def search(graphs: list, remember: bool) -> tuple[float, tuple]:
    solver.forget_floors()
    memory.forget()
    start = time.perf_counter()
    with switches.using(remember=remember):
        d = solver.smallest_peak(graphs, granularity=get_device("cpu").alloc_granularity,
                                 options=solver.SolverOptions(time_limit=10.0))
    seconds = time.perf_counter() - start
    return seconds, (d.peak, round(d.recompute_time_s, 12), [sorted(s) for s in d.saved])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--models", default="lora,llama,stack")
    a = ap.parse_args()
    torch.set_num_threads(1)
    meta = dict(date=datetime.datetime.now().isoformat(timespec="seconds"), command=" ".join(["python", *sys.argv]),
                torch=torch.__version__, git=git_state().line(), load_start=load_average())
    rows = []
    for name in a.models.split(","):
        graphs, compiler = traced(models()[name])
        on, off, plans = [], [], set()
        for _ in range(a.rounds):
            for remember, times in ((False, off), (True, on)):
                seconds, plan = search(graphs, remember)
                times.append(seconds)
                plans.add(repr(plan))
        row = dict(model=name, compiler=compiler, graphs=len(graphs), nodes=sum(len(g.nodes) for g in graphs),
                   on_s=on, off_s=off, ratio=statistics.median(b / a for a, b in zip(on, off)),
                   same_plan=len(plans) == 1)
        rows.append(row)
        print(row, flush=True)
    meta["load_end"] = load_average()
    lines = [
        "# The smallest-peak search with the simulator's memos on and off, cpu\n",
        f"Command: `{meta['command']}`, {meta['date']}, torch {meta['torch']}, 1 thread, repo {meta['git']}; load "
        f"average {meta['load_start']} at the start, {meta['load_end']} at the end (2 cores, shared).\n",
        "Each model traced once with one graph per repeated block (`regions=True`); `solver.smallest_peak` on "
        "those graphs, memos off then on, alternating; floors remembered by earlier calls and the memos cleared "
        "before each run. Ratio: the median over rounds of (off / on) of the same round.\n",
        "| model | compiler | graphs | nodes | memos on s | memos off s | off / on | same plan |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['model']} | {r['compiler']} | {r['graphs']} | {r['nodes']} | "
                     f"{', '.join(f'{t:.1f}' for t in r['on_s'])} | {', '.join(f'{t:.1f}' for t in r['off_s'])} | "
                     f"{r['ratio']:.2f}x | {'yes' if r['same_plan'] else 'no'} |")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "floor_search_cpu.md").write_text("\n".join(lines) + "\n")
    (RESULTS / "floor_search_cpu.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
