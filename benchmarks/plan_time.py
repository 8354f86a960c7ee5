"""Where autoremat's planning time goes, stage by stage, against torch.compile's compile time.

For each model at two sizes, in one process and side by side (the machine is shared: only ratios
measured in the same run mean anything):

  torch.compile (Inductor defaults) and torch.compile(backend="aot_eager"): the first forward +
      backward call after `torch._dynamo.reset()` (what a user waits for before training starts);
  autoremat.optimize cold (no plan cache) with compiler="eager" and with compiler="inductor", with
      precision="auto" (eager), and once more from the plan cache (a hit);
  --variants eager-traced, inductor-traced: with every region traced by AOTAutograd (the `reuse`
      switch off, autoremat/switches.py), for the side-by-side table of what tracing identical blocks once saves (and whether the plan is
      the same). Run after the variant they compare with: kernels Inductor compiled for that one are reused
      by them (the in-process and on-disk caches), which errs against reuse.

The budget is parameters + gradients + inputs + 0.6 x eager's measured activation peak
(optimizer=None, so nothing else is fixed). Each autoremat run is split into stages by `StageClock`,
one timing hook: the `autoremat.progress` records the planner already emits set the outer stage
(capture, loss-region tracing, solving, compile, verification, re-planning, ...), and a few wrapped
functions (profiling a graph, building and solving an ILP, Inductor's compilers, measuring a real
step) take their time out of whichever stage they run in, so every second lands in exactly one
stage. The longest gap between two progress records is reported too (the goal: none over 5 s).

    PYTHONPATH=.:benchmarks python benchmarks/plan_time.py [--quick] [--models stack,gpt2,...] [--out NAME]
    PYTHONPATH=.:benchmarks python benchmarks/plan_time.py --depths 12,24,48 --models stack,gpt2 --variants eager
    PYTHONPATH=.:benchmarks python benchmarks/plan_time.py --depths 12,24 --models gpt2,llama --variants eager,eager-traced --out plan_time_cpu_reuse
    PYTHONPATH=.:benchmarks python benchmarks/plan_time.py --cold --depths 12,24 --models gpt2,llama --variants inductor,inductor-traced --out plan_time_cpu_reuse_inductor

--cold runs every autoremat run and both torch.compile references in a process of its own, with an
Inductor cache of its own (a user's first run): without it, kernels one run compiled are reused by the
runs after it in the process.
    PYTHONPATH=.:benchmarks python benchmarks/plan_time.py --cliff --quick --sizes 0 --models gpt2,llama,bert --variants eager,inductor
    PYTHONPATH=.:benchmarks python benchmarks/plan_time.py --cliff --sizes 0 --models gated --variants eager
    PYTHONPATH=.:benchmarks python benchmarks/plan_time.py --cliff --sizes 0 --models biased --variants inductor

--gc ROUNDS plans each model at the loose budget and at its floor, with planning/gc_set_aside.py's set-aside and
without, alternating, and reports the times and the collector's seconds side by side.
    PYTHONPATH=.:benchmarks python benchmarks/plan_time.py --gc 3 --quick --sizes 0,1 --models gpt2,llama,bert

Results: benchmarks/results/plan_time_cpu[_quick].{md,json}.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import logging
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

# A fresh Inductor cache per process: every run compiles cold, as a user's first run does (kernels
# compiled earlier in this process are still reused: see the report's header).
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="plan_time_inductor_"))

import torch  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402

import autoremat
from autoremat import switches
from autoremat.capture import aot as capture
from autoremat.measure import measure_peak
from autoremat.planning import planner, verify
from autoremat.planning.compilers import inductor_problem
from autoremat.solve import ilp, solver
from examples import models as ex

RESULTS = Path(__file__).parent / "results"
LOGGER = logging.getLogger("autoremat.progress")
BUDGET_SHARE = 0.6  # the benchmark's budget: fixed bytes + this share of eager's activation peak


# --------------------------------------------------------------------------------------------
# the timing hook


def _outer(message: str) -> str:
    """The stage a progress record starts (its first words name it)."""
    for head, stage in (("capturing", "capture"), ("tracing the loss region", "loss-region tracing"),
                        ("the ILP chose", "loss-region choice"), ("no chunk count traced", "loss-region choice"),
                        ("the loss region in", "loss-region choice"),
                        ("solving the ILP for the loss region", "loss-region choice"),
                        ("planning the loss region", "loss-region full plans"),
                        ("tracing the step again", "capture (one graph)"), ("solving for", "solve (heuristics, sim)"),
                        ("compiling the planned", "compile"), ("verifying", "verification"),
                        ("re-planning", "re-planning"), ("measuring the precision", "precision measure")):
        if message.startswith(head):
            return stage
    return message.split(" (")[0][:40]


class StageClock(logging.Handler):
    """Exclusive wall time per stage, and the longest silence between progress records."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.seconds: dict[str, float] = defaultdict(float)
        self.counts: dict[str, int] = defaultdict(int)
        self.stack = ["setup"]
        self.t = self.last_record = self.t0 = time.perf_counter()
        self.gap = (0.0, "setup")  # the longest time without any progress record (pulses included)
        self.stage_start = self.t0
        self.longest = (0.0, "setup")  # the longest stage, from its record to the next stage's

    def _switch(self) -> float:
        now = time.perf_counter()
        self.seconds[self.stack[-1]] += now - self.t
        self.t = now
        return now

    def emit(self, record: logging.LogRecord) -> None:
        now = self._switch()
        message = record.getMessage()
        if now - self.last_record > self.gap[0]:
            self.gap = (now - self.last_record, self.stack[0])
        self.last_record = now
        if getattr(record, "pulse", False):  # the stage repeated with its progress: no new stage
            return
        if now - self.stage_start > self.longest[0]:
            self.longest = (now - self.stage_start, self.stack[0])
        self.stage_start = now
        self.stack[0] = _outer(message)
        self.counts[self.stack[0]] += 1

    def inner(self, name: str, fn):
        def run(*args, **kwargs):
            self._switch()
            self.stack.append(name)
            self.counts[name] += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._switch()
                self.stack.pop()
        return run

    def finish(self) -> float:
        now = self._switch()
        if now - self.last_record > self.gap[0]:
            self.gap = (now - self.last_record, self.stack[0])
        if now - self.stage_start > self.longest[0]:
            self.longest = (now - self.stage_start, self.stack[0])
        return now - self.t0


CLOCK: StageClock | None = None


def _hooked(name: str, fn):
    """`fn`, its time charged to stage `name` while a StageClock runs."""
    def run(*args, **kwargs):
        return fn(*args, **kwargs) if CLOCK is None else CLOCK.inner(name, fn)(*args, **kwargs)
    return run


def install_hooks() -> None:
    planner.profile_graph = _hooked("profile", planner.profile_graph)
    planner.calibrate_scratch = _hooked("profile", planner.calibrate_scratch)
    ilp.IlpModel.__init__ = _hooked("ILP build", ilp.IlpModel.__init__)
    ilp.IlpModel.solve = _hooked("ILP solve", ilp.IlpModel.solve)
    verify.measure_step = _hooked("verification", verify.measure_step)
    timed = capture.CompileClock.timed
    capture.CompileClock.timed = lambda self, fn: timed(self, _hooked("inductor compile", fn))


def timed_optimize(model, inputs, budget: int, **kw) -> dict:
    """One autoremat.optimize, cold unless `cache` is given: wall time, stages, longest silence."""
    global CLOCK
    torch._dynamo.reset()
    solver.forget_floors()  # a floor remembered from an earlier run would make this one warm
    traces, frames = counters["aot_autograd"]["total"], counters["stats"]["unique_graphs"]
    CLOCK = clock = StageClock()
    LOGGER.addHandler(clock)
    LOGGER.setLevel(logging.INFO)
    try:
        om = autoremat.optimize(model, budget, inputs, optimizer=None, progress=False, **kw)
        error = None
    except autoremat.BudgetError as e:
        om, error, smallest = None, str(e).splitlines()[0], e.smallest_budget
    finally:
        total = clock.finish()
        LOGGER.removeHandler(clock)
        CLOCK = None
    row = {"total_s": total, "stages": {k: round(v, 3) for k, v in clock.seconds.items() if v >= 5e-3},
           "counts": dict(clock.counts), "silent_s": round(clock.gap[0], 2), "silent_in": clock.gap[1],
           "longest_stage_s": round(clock.longest[0], 2), "longest_stage": clock.longest[1],
           "aot_traces": counters["aot_autograd"]["total"] - traces,
           "dynamo_graphs": counters["stats"]["unique_graphs"] - frames}
    if om is not None:
        p = om.plan
        row.update(predicted_peak=p.predicted_peak, recompute_s=p.recompute_time_s, chunks=(p.loss or {}).get("chunks"),
                   compiler=p.compiler.get("used"), path=p.solver.get("path"))
    else:
        row["error"], row["smallest_budget"] = error, smallest
    return row


CLIFF_LOOSE = 0.8  # --cliff: the loose budget's share of eager's activation peak


def run_cliff(name: str, size: str, factory, variants: list[str]) -> dict:
    """The cliff near the floor: per compiler, planning at a loose budget (fixed + CLIFF_LOOSE x eager's
    activations), at checkpointing's peak (fixed + the activations of every block checkpointed, measured), the
    floor query (budget=1), a plan at that floor, and a budget 5% below it (refused)."""
    torch.manual_seed(0)
    model, inputs = factory()
    loose = issue_budget(model, inputs, CLIFF_LOOSE)
    ckpt = checkpointing_budget(model, inputs)
    row: dict = {"model": name, "size": size, "loose_budget": loose, "checkpointing_budget": ckpt}
    for v in variants:
        kw = {"compiler": v}
        runs = {"loose": timed_optimize(copy.deepcopy(model), inputs, loose, **kw),
                "at checkpointing's peak": timed_optimize(copy.deepcopy(model), inputs, ckpt, **kw),
                "floor query": timed_optimize(copy.deepcopy(model), inputs, 1, **kw)}
        floor = runs["floor query"].get("smallest_budget")
        if floor:
            runs["at the floor"] = timed_optimize(copy.deepcopy(model), inputs, floor, **kw)
            runs["5% below"] = timed_optimize(copy.deepcopy(model), inputs, int(0.95 * floor), **kw)
        row[v] = {"floor": floor, **runs}
        print(f"  {name} {size} {v}: " + ", ".join(f"{k} {r['total_s']:.1f} s" + (" (refused)" if "error" in r else "")
                                                   for k, r in runs.items()), flush=True)
    return row


def cliff_report(rows: list[dict], variants: list[str], command: str) -> str:
    lines = ["# Planning time near the floor\n", f"`{command}`  ",
             f"{platform.processor() or 'cpu'}, torch {torch.__version__}, 1 thread, on a shared machine.\n",
             f"Loose: fixed bytes + {CLIFF_LOOSE} x eager's activation peak. Floor query: budget=1 (refused; "
             "BudgetError.smallest_budget is the floor). Each run cold (dynamo reset, no remembered floor).\n",
             "At checkpointing's peak: fixed bytes + the measured activation peak of the model with every block "
             "checkpointed (HF's own non-reentrant checkpointing), the budget column.\n",
             "| model | size | compiler | checkpointing | floor | loose s | at ckpt s | floor query s | at the floor s "
             "| 5% below s | ckpt / loose | floor query / loose | at floor / loose | below / loose |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    kinds = ("loose", "at checkpointing's peak", "floor query", "at the floor", "5% below")
    for r in rows:
        for v in variants:
            runs = r[v]
            t = {k: runs[k]["total_s"] for k in kinds if k in runs}
            cells = [f"{t[k]:.1f}" + (" (refused)" if "error" in runs[k] else "") if k in t else "-" for k in kinds]
            ratios = [f"{t[k] / t['loose']:.2f}x" if k in t else "-" for k in kinds[1:]]
            lines.append(f"| {r['model']} | {r['size']} | {v} | {r.get('checkpointing_budget', '-')} | {runs['floor']} | "
                         + " | ".join(cells + ratios) + " |")
    return "\n".join(lines) + "\n"


class CollectorClock:
    """gc.callbacks: the seconds the garbage collector ran, and its full collections, while installed."""

    def __init__(self) -> None:
        self.seconds, self.full, self.started = 0.0, 0, 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self.started = time.perf_counter()
            return
        self.seconds += time.perf_counter() - self.started
        self.full += info["generation"] == 2


def run_gc(name: str, size: str, factory, rounds: int) -> dict:
    """planning/gc_set_aside.py's effect: plans at a loose budget and at the floor (compiler="eager"), with the
    older objects set aside and without, alternating which goes first each round, in one process."""
    torch.manual_seed(0)
    model, inputs = factory()
    budgets = {"loose": issue_budget(model, inputs, CLIFF_LOOSE)}
    budgets["floor"] = timed_optimize(copy.deepcopy(model), inputs, 1, compiler="eager")["smallest_budget"]
    row: dict = {"model": name, "size": size, "budgets": budgets, "runs": []}
    for r in range(rounds):
        for on in (True, False) if r % 2 == 0 else (False, True):
            for label, budget in budgets.items():
                clock = CollectorClock()
                gc.callbacks.append(clock)
                try:
                    with switches.using(set_aside=on):
                        run = timed_optimize(copy.deepcopy(model), inputs, budget, compiler="eager")
                finally:
                    gc.callbacks.remove(clock)
                row["runs"].append({"round": r, "set_aside": on, "budget": label, "total_s": run["total_s"],
                                    "gc_s": round(clock.seconds, 3), "full": clock.full,
                                    "peak": run.get("predicted_peak"), "recompute_s": run.get("recompute_s")})
        print(f"  {name} {size} round {r}: " + ", ".join(
            f"{x['budget']} {'on' if x['set_aside'] else 'off'} {x['total_s']:.2f} s (gc {x['gc_s']:.2f} s)"
            for x in row["runs"] if x["round"] == r), flush=True)
    return row


def gc_report(rows: list[dict], command: str) -> str:
    lines = ["# Planning with older objects set aside from the garbage collector\n", f"`{command}`  ",
             f"{platform.processor() or 'cpu'}, torch {torch.__version__}, Python {platform.python_version()}, "
             "1 thread, on a shared machine.\n",
             f"compiler=\"eager\". Loose: fixed bytes + {CLIFF_LOOSE} x eager's activation peak; floor: the floor "
             "query's smallest budget. Medians over the rounds; on = planning/gc_set_aside.py's set-aside (the default), "
             "off = without it, alternating which runs first. gc s: seconds inside the collector per plan; full: "
             "full collections over all rounds. Same plan: the predicted peak and recompute time agree on and off.\n",
             "| model | size | budget | on s | off s | off / on | gc s on | gc s off | full on | full off "
             "| same plan |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    ratios: dict[bool, list[float]] = {True: [], False: []}
    for r in rows:
        for label in r["budgets"]:
            runs = {on: [x for x in r["runs"] if x["budget"] == label and x["set_aside"] == on] for on in (True, False)}
            med = {on: statistics.median(x["total_s"] for x in runs[on]) for on in runs}
            gcs = {on: statistics.median(x["gc_s"] for x in runs[on]) for on in runs}
            full = {on: sum(x["full"] for x in runs[on]) for on in runs}
            same = len({(x["peak"], x["recompute_s"]) for on in runs for x in runs[on]}) == 1
            lines.append(f"| {r['model']} | {r['size']} | {label} | {med[True]:.2f} | {med[False]:.2f} | "
                         f"{med[False] / med[True]:.2f}x | {gcs[True]:.2f} | {gcs[False]:.2f} | {full[True]} | "
                         f"{full[False]} | {'yes' if same else 'NO'} |")
        for on in (True, False):
            per_round = [f["total_s"] / lo["total_s"] for lo in r["runs"] for f in r["runs"]
                         if lo["budget"] == "loose" and f["budget"] == "floor" and lo["round"] == f["round"]
                         and lo["set_aside"] == f["set_aside"] == on]
            ratios[on].append((f"{r['model']} {r['size']}", statistics.median(per_round)))
    lines += ["", "At the floor against the loose budget (median over rounds of the ratio within a round):", "",
              "| model | on | off |", "|---|---|---|"]
    lines += [f"| {m} | {a:.2f}x | {b:.2f}x |" for (m, a), (_, b) in zip(ratios[True], ratios[False])]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------
# torch.compile, the reference


def loss_of(out):
    return ex.loss_of(out) if not isinstance(out, torch.Tensor) else out.float().sum()


def step(fn, inputs) -> None:
    out = fn(**inputs) if isinstance(inputs, dict) else fn(*inputs)
    loss_of(out).backward()


def first_call(model, inputs, backend: str) -> float:
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend)
    t = time.perf_counter()
    step(compiled, inputs)
    return time.perf_counter() - t


def checkpointing_budget(model, inputs) -> int:
    """Parameters + gradients + inputs + the activation peak (steady state) of `model` with every block
    checkpointed: the budget at checkpointing's peak."""
    from common import checkpoint_every_block
    return issue_budget(checkpoint_every_block(copy.deepcopy(model)), inputs, 1.0)


def issue_budget(model, inputs, share: float = BUDGET_SHARE) -> int:
    """Parameters + gradients + inputs + `share` x eager's activation peak (steady state)."""
    step(model, inputs)  # .grad buffers exist, as in every micro-step after the first
    _, m = measure_peak(lambda: step(model, inputs), baseline_bytes=0)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    leaves = inputs.values() if isinstance(inputs, dict) else inputs
    ins = sum(t.numel() * t.element_size() for t in leaves if isinstance(t, torch.Tensor))
    model.zero_grad(set_to_none=True)
    return 2 * params + ins + int(share * m.delta_peak_bytes)


# --------------------------------------------------------------------------------------------
# models


def bert(batch, seq, n_layer, hidden, heads, vocab):
    from common import bert as make
    return make(batch, seq, n_layer, hidden, heads, vocab)


def head_lm(batch, seq, vocab, d, bias, gate):
    from common import head_lm as make
    return make(batch, seq, vocab, d, bias, gate)


def models(quick: bool, depths: list[int] | None = None) -> dict:
    """name -> [(size label, factory)] at two sizes (depth doubled; --quick halves everything), or at `depths`
    (--depths: how planning time grows with depth)."""
    if depths:
        return {
            "stack": [(f"{n}L d128 4x64", lambda n=n: ex.transformer_stack(4, 64, n, 128, 4, 0.1)) for n in depths],
            "gpt2": [(f"{n}L d64 2x64 V1024", lambda n=n: ex.gpt2(2, 64, n, 64, 4, 1024)) for n in depths],
            "llama": [(f"{n}L d64 2x64 V1024", lambda n=n: ex.llama(2, 64, n, 64, 4, 1024)) for n in depths],
            "bert": [(f"{n}L d64 4x64 V1024", lambda n=n: bert(4, 64, n, 64, 4, 1024)) for n in depths],
        }
    d = (1, 2) if quick else (2, 4)
    # --cliff's small heads, one size each (--sizes 0): eager code between the trunk and the loss region that
    # no plan sees (every plan near the floor measures over), and a biased projection under Inductor
    heads = {
        "gated": [("d32 4x64 V2048 eager gate", lambda: head_lm(4, 64, 2048, 32, bias=False, gate=True))],
        "biased": [("d32 4x64 V4096 biased head", lambda: head_lm(4, 64, 4096, 32, bias=True, gate=False))],
    }
    # Held-out shapes, one size each, never tuned on: a 6-layer encoder (hidden 128, dropout, 4 x 96 tokens),
    # slow to plan at checkpointing's peak (`--cliff --sizes 0 --models encoder6` measures it), and a small
    # decoder (6 layers, hidden 256, 2 x 256 tokens), here as the Llama shape
    heads["encoder6"] = [("6L d128 4x96 V2048", lambda: bert(4, 96, 6, 128, 4, 2048))]
    heads["decoder6"] = [("6L d256 2x256 V4096", lambda: ex.llama(2, 256, 6, 256, 4, 4096))]
    return {**heads,
        "stack": [(f"{2 * n}L d128 4x64", lambda n=n: ex.transformer_stack(4, 64, 2 * n, 128, 4, 0.1)) for n in d],
        "gpt2": [(f"{n}L d64 2x64 V1024", lambda n=n: ex.gpt2(2, 64, n, 64, 4, 1024)) for n in d],
        "llama": [(f"{n}L d64 2x64 V1024", lambda n=n: ex.llama(2, 64, n, 64, 4, 1024)) for n in d],
        "bert": [(f"{n}L d64 4x64 V1024", lambda n=n: bert(4, 64, n, 64, 4, 1024)) for n in d],
    }


def run_variant(v: str, model, inputs, budget: int) -> dict:
    """One autoremat run of `v` (or a torch.compile reference: "torch-inductor", "torch-aot_eager")."""
    if v.startswith("torch-"):
        return {"total_s": first_call(copy.deepcopy(model), inputs, v.removeprefix("torch-"))}
    kw = {"eager": {"compiler": "eager"}, "inductor": {"compiler": "inductor"},
          "auto-precision": {"compiler": "eager", "precision": "auto"}, "eager-traced": {"compiler": "eager"},
          "inductor-traced": {"compiler": "inductor"}}.get(v)
    if v.endswith("-traced"):  # every region traced by AOTAutograd
        with switches.off("reuse"):
            return timed_optimize(copy.deepcopy(model), inputs, budget, **kw)
    if v == "cache-hit":
        with tempfile.TemporaryDirectory() as tmp:
            timed_optimize(copy.deepcopy(model), inputs, budget, compiler="eager", cache=tmp)
            return timed_optimize(copy.deepcopy(model), inputs, budget, compiler="eager", cache=tmp)
    return timed_optimize(copy.deepcopy(model), inputs, budget, **kw)


def run_cold(argv: list[str], name: str, index: int, v: str, budget: int) -> dict:
    """`run_variant` in a process of its own, with an Inductor cache of its own: nothing compiled by an
    earlier run is reused (--cold; a user's first run)."""
    env = {k: val for k, val in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(RESULTS.parent.parent), str(RESULTS.parent),
                                                      env.get("PYTHONPATH")]))
    out = subprocess.run([sys.executable, __file__, *argv, "--one", f"{name}:{index}:{v}:{budget}"], env=env,
                         capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def run_model(name: str, size: str, factory, variants: list[str], cold: tuple[list[str], int] | None = None) -> dict:
    torch.manual_seed(0)
    model, inputs = factory()
    budget = issue_budget(model, inputs)
    row: dict = {"model": name, "size": size, "budget": budget}
    if cold is not None:
        for v in [*variants, "torch-inductor", "torch-aot_eager"]:
            row[v] = run_cold(cold[0], name, cold[1], v, budget)
            print(f"  {name} {size} {v} (own process): {row[v]['total_s']:.1f} s", flush=True)
        row["inductor_s"], row["aot_eager_s"] = row.pop("torch-inductor")["total_s"], row.pop("torch-aot_eager")["total_s"]
        row["cold"] = True
        return row
    for v in variants:
        row[v] = run_variant(v, model, inputs, budget)
        r = row[v]
        print(f"  {name} {size} {v}: {r['total_s']:.1f} s, longest silence {r['silent_s']} s "
              f"({r['silent_in']}); {r.get('error') or ''}", flush=True)
    # torch.compile last: kernels autoremat's Inductor runs compiled are reused by it, not the reverse,
    # so the ratios err against autoremat.
    row["inductor_s"] = first_call(copy.deepcopy(model), inputs, "inductor")
    row["aot_eager_s"] = first_call(copy.deepcopy(model), inputs, "aot_eager")
    print(f"  {name} {size} torch.compile: Inductor {row['inductor_s']:.1f} s, aot_eager {row['aot_eager_s']:.1f} s",
          flush=True)
    return row


# --------------------------------------------------------------------------------------------
# report

STAGES = ["setup", "capture", "profile", "loss-region tracing", "loss-region choice", "loss-region full plans",
          "capture (one graph)",
          "solve (heuristics, sim)", "ILP build", "ILP solve", "compile", "inductor compile", "verification",
          "re-planning", "precision measure"]


def report(rows: list[dict], variants: list[str], command: str) -> str:
    lines = ["# Planning time, stage by stage\n", f"`{command}`  ", f"{platform.processor() or 'cpu'}, "
             f"torch {torch.__version__}, 1 thread, on a shared machine: compare ratios within this run only.\n",
             "Budget: parameters + gradients + inputs + 0.6 x eager's activation peak, optimizer=None. "
             "torch.compile columns: first forward+backward call after `torch._dynamo.reset()`, "
             + ("each run (autoremat's and torch.compile's) in a process and Inductor cache directory of its own "
                "(--cold: nothing compiled by one run is reused by another).\n" if rows and rows[0].get("cold") else
                "measured after autoremat's runs of that model (one fresh Inductor cache directory per process; a "
                "kernel compiled for autoremat's Inductor run is reused by torch.compile's, which errs against "
                "autoremat).\n"),
             "## Totals and ratios\n",
             "| model | size | Inductor s | aot_eager s | " + " | ".join(f"{v} s" for v in variants)
             + " | eager / Inductor | eager / aot_eager | inductor / Inductor | auto-prec / eager | longest silence s "
             "| longest stage s |",
             "|---|---|---|---|" + "---|" * len(variants) + "---|---|---|---|---|---|"]
    for r in rows:
        t = {v: r[v]["total_s"] for v in variants if v in r}

        def ratio(a, b):
            return f"{a / b:.1f}x" if a is not None and b else "-"
        silence = max((r[v]["silent_s"], r[v]["silent_in"]) for v in variants if v in r)
        longest = max((r[v].get("longest_stage_s", 0.0), r[v].get("longest_stage", "")) for v in variants if v in r)
        lines.append(f"| {r['model']} | {r['size']} | {r['inductor_s']:.1f} | {r['aot_eager_s']:.1f} | "
                     + " | ".join(f"{t[v]:.1f}" + (" (refused)" if "error" in r[v] else "") for v in variants)
                     + f" | {ratio(t.get('eager'), r['inductor_s'])} | {ratio(t.get('eager'), r['aot_eager_s'])} | "
                     f"{ratio(t.get('inductor'), r['inductor_s'])} | {ratio(t.get('auto-precision'), t.get('eager'))} "
                     f"| {silence[0]} ({silence[1]}) | {longest[0]} ({longest[1]}) |")
    lines += ["\n## Traces per plan (graphs dynamo compiled / AOTAutograd traces)\n",
              "| model | size | " + " | ".join(variants) + " |", "|---|---|" + "---|" * len(variants)]
    for r in rows:
        lines.append(f"| {r['model']} | {r['size']} | " + " | ".join(
            f"{r[v].get('dynamo_graphs', '-')} / {r[v].get('aot_traces', '-')}" if v in r else "" for v in variants) + " |")
    for base in ("eager", "inductor"):
        if f"{base}-traced" not in variants or base not in variants:
            continue
        lines += [f"\n## Identical regions traced once ({base}; {base}-traced: the `reuse` switch off)\n",
                  "| model | size | AOTAutograd traces, every region / reused | seconds | reused / every region "
                  "| same predicted peak and time |", "|---|---|---|---|---|---|"]
        for r in rows:
            a, b = r.get(f"{base}-traced"), r.get(base)
            if a and b:
                same = (a.get("predicted_peak"), a.get("recompute_s")) == (b.get("predicted_peak"), b.get("recompute_s"))
                lines.append(f"| {r['model']} | {r['size']} | {a['aot_traces']} / {b['aot_traces']} | "
                             f"{a['total_s']:.1f} / {b['total_s']:.1f} | {b['total_s'] / a['total_s']:.2f}x | "
                             f"{'yes' if same else 'no'} |")
    lines += ["\n## Stages (seconds, each second in exactly one stage; xN: times entered)\n"]
    for v in variants:
        present = [s for s in STAGES if any(s in r.get(v, {}).get("stages", {}) for r in rows)]
        present += sorted({s for r in rows for s in r.get(v, {}).get("stages", {})} - set(present))
        lines += [f"### {v}\n", "| model | size | total | " + " | ".join(present) + " |",
                  "|---|---|---|" + "---|" * len(present)]
        for r in rows:
            if v not in r:
                continue
            st, n = r[v]["stages"], r[v]["counts"]
            cells = [f"{st[s]:.1f}" + (f" x{n[s]}" if n.get(s, 1) > 1 else "") if s in st else "" for s in present]
            lines.append(f"| {r['model']} | {r['size']} | {r[v]['total_s']:.1f} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines + per_layer(rows, variants))


def per_layer(rows: list[dict], variants: list[str]) -> list[str]:
    """Seconds per layer of each variant and of torch.compile, for models run at three or more depths:
    linear growth keeps them flat."""
    lines = []
    for name in dict.fromkeys(r["model"] for r in rows):
        mine = [r for r in rows if r["model"] == name]
        if len(mine) < 3:
            continue
        if not lines:
            lines = ["## Growth with depth (seconds per layer)\n",
                     "| model | size | " + " | ".join(f"{v} s/layer" for v in variants) + " | Inductor s/layer |",
                     "|---|---|" + "---|" * (len(variants) + 1)]
        for r in mine:
            n = int(r["size"].split("L")[0])
            cells = [f"{r[v]['total_s'] / n:.2f}" if v in r else "" for v in variants]
            lines.append(f"| {name} | {r['size']} | " + " | ".join(cells) + f" | {r['inductor_s'] / n:.2f} |")
    return lines + [""] if lines else []


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--models", default="stack,gpt2,llama,bert")
    ap.add_argument("--variants", default="eager,inductor,auto-precision,cache-hit")
    ap.add_argument("--sizes", default="0,1", help="which of each model's two sizes")
    ap.add_argument("--depths", default=None, help="instead of the two sizes, these depths (e.g. 12,24,48)")
    ap.add_argument("--cliff", action="store_true", help="time a loose budget, the floor query, the floor and below "
                    "it; --variants names the compilers (eager, inductor)")
    ap.add_argument("--gc", type=int, default=0, metavar="ROUNDS", help="plan at a loose budget and at the floor "
                    "with the older objects set aside from the collector and without (planning/gc_set_aside.py)")
    ap.add_argument("--out", default=None, help="results file stem (default plan_time_cpu[_quick])")
    ap.add_argument("--cold", action="store_true", help="every run, torch.compile's too, in a process and "
                    "Inductor cache of its own")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # NAME:INDEX:VARIANT:BUDGET, for --cold
    a = ap.parse_args()
    torch.set_num_threads(1)
    install_hooks()
    variants = a.variants.split(",")
    inductor_problem("cpu")  # the probe and Inductor's imports, once per process, outside every timing
    first_call(torch.nn.Linear(4, 4), (torch.randn(2, 4),), "inductor")
    depths = [int(n) for n in a.depths.split(",")] if a.depths else None
    table = models(a.quick, depths)
    if a.one:  # --cold's child: one run, its row as the last line
        name, index, v, budget = a.one.split(":")
        torch.manual_seed(0)
        model, inputs = table[name][int(index)][1]()
        print(json.dumps(run_variant(v, model, inputs, int(budget))))
        return
    sizes = list(range(len(depths))) if depths else [int(i) for i in a.sizes.split(",")]
    rows = []
    command = "PYTHONPATH=.:benchmarks python benchmarks/plan_time.py " + " ".join(sys.argv[1:])
    stem = a.out or ("plan_time_cpu_depth" if depths else "plan_time_cpu_quick" if a.quick else "plan_time_cpu")
    if a.gc:
        stem = a.out or "plan_time_cpu_gc"
        for name in a.models.split(","):
            for i in sizes:
                rows.append(run_gc(name, *table[name][i], a.gc))
                text = gc_report(rows, command)
                (RESULTS / f"{stem}.md").write_text(text)
                (RESULTS / f"{stem}.json").write_text(json.dumps(rows, indent=1) + "\n")
        print(text)
        return
    if a.cliff:
        stem = a.out or "plan_time_cpu_cliff"
        for name in a.models.split(","):
            for i in sizes:
                size, factory = table[name][i]
                rows.append(run_cliff(name, size, factory, variants))
                text = cliff_report(rows, variants, command)
                (RESULTS / f"{stem}.md").write_text(text)
                (RESULTS / f"{stem}.json").write_text(json.dumps(rows, indent=1) + "\n")
        print(text)
        return
    for name in a.models.split(","):
        for i in sizes:
            size, factory = table[name][i]
            argv = [x for x in sys.argv[1:] if x != "--cold"]
            rows.append(run_model(name, size, factory, variants, (argv, i) if a.cold else None))
            text = report(rows, variants, command)  # written after each model: a long run keeps what it measured
            (RESULTS / f"{stem}.md").write_text(text + "\n")
            (RESULTS / f"{stem}.json").write_text(json.dumps(rows, indent=1) + "\n")
    print(text)


if __name__ == "__main__":
    main()
