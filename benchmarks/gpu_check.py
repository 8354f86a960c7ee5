r"""One prepared check of autoremat on a lent GPU: does the budget hold, how fast, how exact.

Models (built from configs, no download), each trained by the user's own loop in steady state:
  qwen2  HF Qwen2ForCausalLM, 6 layers, hidden 1024, intermediate 2816, 16 heads / 8 KV heads, vocab 32000,
         batch 4 x 2048, fp32, no dropout
  bert   HF BertForMaskedLM from BertConfig() (BERT-base), batch 16 x 512, fp32, dropout 0.1
  gpt2   HF GPT-2 small (12 x 768, vocab 50257), batch 8 x 1024, dropout 0.1, bf16
Baselines per model: eager, HF gradient checkpointing on every block (non-reentrant), torch.compile
(Inductor defaults); GPT-2's checkpoint and compile baselines run under torch.autocast(bf16).
autoremat rows: qwen2 and bert at checkpointing's measured peak and at 0.8 x it, with compiler="auto"
and "eager"; gpt2 with precision="bf16" at autocast(bf16) + checkpointing's measured peak.

The measured step is `out = model(**batch); out.loss.backward()` with `out` held through the backward,
after a warm-up step (every .grad exists). Per row: allocated = torch.cuda.max_memory_allocated over that
step (stats reset just before it; on CPU autoremat.measure's allocator-event peak), reserved =
max_memory_reserved (empty_cache before that step), step time (median of --steps) and its ratio to eager,
checkpointing and torch.compile, gradient error = ||g - g_eager|| / ||g_eager|| over all parameters together
(common.grad_rel_err; same seed before each step) beside the checkpoint row's own (the device's noise floor),
planning seconds. A row whose allocated peak
exceeds its budget gets the largest blocks live at the measured peak (CUDA memory history; on CPU the
profiler's allocation events) set against the memory model's live set at its predicted peak
(live_at_peak.py), so one run names the culprit.

Rows run most important first (the budget-holding rows before the speed baselines); each prints as it
ends and the results file is rewritten after every row, so a killed run still leaves its table. A row
that would start after the deadline (--deadline s from process start, default 480) is skipped and says
so; a row still running at the deadline is stopped (SIGALRM) and says so. Each autoremat plan took
55-122 s on the GPU host. First, a sanity check (a few seconds): torch, pulp, highspy and autoremat import,
CUDA is there, and autoremat's own solver path solves a tiny ILP with HiGHS.

Writes gpu_check_<device>[_quick].md/.json into $OUT if set, else benchmarks/results/.

    python benchmarks/gpu_check.py                       # CUDA, the sizes above
    python benchmarks/gpu_check.py --device cpu --quick  # smoke test of this script: tiny shapes, every path,
                                                         # budgets from eager's peak, loss chunks 1,4, 240 s
    python benchmarks/gpu_check.py --rows bert:ar-auto@1.0,gpt2:compile   # chosen rows (their baselines added)

On the lent GPU machine (Python 3.12, torch 2.11+cu130, transformers 5.17; no PuLP, no highspy and no
network there), carry these wheels. Download here (repo root; .whl/ is git-ignored):

    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
      -d .whl pulp==4.2.0 highspy orloge cpsat-logutils pydantic pydantic-core annotated-types \
      typing-inspection typing_extensions

which resolved on 2026-12-04 to (Requires-Dist checked: the list is closed; pulp 4.2's HiGHS interface and
highspy import numpy, which the machine has):
    pulp-4.2.0-cp312-cp312-manylinux_2_17_x86_64.manylinux2014_x86_64.whl        (needs orloge)
    orloge-1.0.0-py3-none-any.whl                                                  (needs cpsat-logutils)
    cpsat_logutils-1.0.0-py3-none-any.whl                                          (needs pydantic>=2.10)
    pydantic-2.14.4-py3-none-any.whl      (needs pydantic-core==2.50.5, annotated-types, typing-inspection,
                                           typing-extensions>=4.16)
    pydantic_core-2.50.5-cp312-cp312-manylinux2014_x86_64.manylinux_2_17_x86_64.whl
    annotated_types-0.8.0-py3-none-any.whl
    typing_inspection-0.4.5-py3-none-any.whl
    typing_extensions-4.16.0-py3-none-any.whl
    highspy-1.16.0-cp312-cp312-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl  (needs numpy)
autoremat speaks both PuLP 3 and PuLP 4 (autoremat/solve/lp.py), so this set, which is what pip gives Python
3.12, is what the machine's Python runs; `.ci/run` runs the solver and end-to-end planning tests on
Python 3.12 with it. The sanity check tells within seconds if a wheel is missing.

The device tool's `run` call (repo root is the cwd; carry: [".whl"]; timeout_s 600):

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=$PWD:/tmp/site && PYTHONUNBUFFERED=1 timeout 540 python benchmarks/gpu_check.py 2>&1 | tee $OUT/gpu_check.log
"""

from __future__ import annotations

import time

T0 = time.monotonic()  # the deadline counts from here: imports are part of the 8 minutes

import argparse  # noqa: E402
import copy  # noqa: E402
import datetime  # noqa: E402
import gc  # noqa: E402
import importlib  # noqa: E402
import importlib.metadata  # noqa: E402
import json  # noqa: E402
import linecache  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
MiB = 2**20
SEED = 1234
TOP = 12  # blocks listed per side in an over-budget dump
# Least seconds left for a row to start: a plan took 55-122 s on the GPU host, an Inductor compile of
# these models tens of seconds; a row stopped at the deadline measures nothing, so it is not started.
NEEDS_S = {"autoremat": 55.0, "compile": 25.0}
NEEDS_S_QUICK = {"autoremat": 10.0, "compile": 5.0}

# autoremat and the benchmarks' helper modules are imported by sanity(), after its own checks, so that a missing
# wheel is named in one line instead of surfacing as an import traceback.
autoremat = common = live_at_peak = get_device = measure_peak = loss_of = None


class Deadline(BaseException):
    """Raised by SIGALRM at the deadline; a BaseException so that no `except Exception` on the way swallows it."""


def elapsed() -> float:
    return time.monotonic() - T0


# --------------------------------------------------------------------------------------------
# sanity


def sanity(dev: torch.device) -> dict:
    """Fail within seconds, naming the wheel, if anything the rows need is missing."""
    global autoremat, common, live_at_peak, get_device, measure_peak, loss_of
    t = time.monotonic()
    versions = {"torch": torch.__version__}
    for mod, wheel in (("pulp", "pulp (and for PuLP 4: orloge, cpsat-logutils, pydantic, pydantic-core, "
                                "annotated-types, typing-inspection, typing_extensions)"),
                       ("highspy", "highspy"), ("transformers", "transformers"), ("autoremat", "this repo")):
        try:
            m = importlib.import_module(mod)
        except ImportError as e:
            sys.exit(f"SANITY FAILED: import {mod}: {e} -- carry the wheel {wheel} (missing module {e.name!r}); "
                     "see this script's docstring for the download and install lines")
        try:
            versions[mod] = importlib.metadata.version(mod)
        except importlib.metadata.PackageNotFoundError:
            versions[mod] = getattr(m, "__version__", "?")
    versions["autoremat"] += f" from {Path(m.__file__).parent}"
    if dev.type == "cuda" and not torch.cuda.is_available():
        sys.exit("SANITY FAILED: torch.cuda.is_available() is False on a --device cuda run")
    import pulp

    try:
        solvers = pulp.listSolvers(onlyAvailable=True)
    except Exception as e:  # noqa: BLE001
        sys.exit(f"SANITY FAILED: pulp.listSolvers raised {type(e).__name__}: {e} (PuLP {pulp.__version__})")
    if "HiGHS" not in solvers:
        sys.exit(f"SANITY FAILED: PuLP {pulp.__version__} does not see HiGHS (highspy {versions['highspy']}); "
                 "carry a highspy wheel that matches this Python")
    sys.path.append(str(REPO))  # for `examples`; appended so that PYTHONPATH can pick another autoremat
    sys.path.insert(0, str(REPO / "benchmarks"))  # the shared helpers (benchmarks/common/)
    common = importlib.import_module("common")
    live_at_peak = importlib.import_module("common").live_at_peak
    autoremat = importlib.import_module("autoremat")
    get_device = importlib.import_module("autoremat.model.devices").get_device
    measure_peak = importlib.import_module("autoremat.measure").measure_peak
    loss_of = importlib.import_module("examples.models").loss_of
    # autoremat's own solver path on a 2-block stack traced on meta: the ILP (PuLP model, HiGHS) must
    # produce the plan; PuLP 4's changed API failed exactly here on the last GPU run
    try:
        from autoremat.capture.aot import capture
        from autoremat.model.profile import profile_graph
        from autoremat.solve import solver
        from autoremat.solve.decision import Route
        from examples.models import transformer_stack

        model, ex = transformer_stack(n_layer=2, d=16, seq=8, batch=2)
        (cg,) = capture(model.to("meta"), (ex[0].to("meta"),))
        gp = profile_graph(cg, "cpu")
        _, everything, _ = solver.evaluate([gp], solver.save_all([gp]))
        d = solver.solve([gp], everything.peak - 1, options=solver.SolverOptions(time_limit=5.0))
    except Exception as e:  # noqa: BLE001
        traceback.print_exc()
        sys.exit(f"SANITY FAILED: autoremat's solver path raised {type(e).__name__}: {e} (PuLP {pulp.__version__}); "
                 "if this autoremat predates PuLP 4 support, carry pulp==3.3.2 + highspy instead")
    if d.path.route not in (Route.ILP, Route.ILP_MIN_PEAK) or "highs" not in str(d.solver).lower():
        sys.exit(f"SANITY FAILED: the tiny ILP was not solved by HiGHS (path {str(d.path)!r}, solver {d.solver!r}, "
                 f"status {d.status!r})")
    torch._dynamo.reset()
    versions["sanity_s"] = round(time.monotonic() - t, 1)
    print(f"sanity ok in {versions['sanity_s']} s: {versions}; tiny ILP {d.status} by {d.solver} ({d.path})",
          flush=True)
    return versions


# --------------------------------------------------------------------------------------------
# models


def qwen2(quick: bool):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    if quick:
        size = dict(vocab_size=256, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2)
        batch, seq = 2, 64
    else:
        size = dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=6,
                    num_attention_heads=16, num_key_value_heads=8)
        batch, seq = 4, 2048
    cfg = Qwen2Config(**size, max_position_embeddings=max(seq, 64), attention_dropout=0.0, use_cache=False)
    model = Qwen2ForCausalLM(cfg)
    model.loss_type = "ForCausalLM"  # as examples.models.gpt2: without it a logging call breaks the graph
    ids = torch.randint(0, cfg.vocab_size, (batch, seq))
    return model, {"input_ids": ids, "labels": ids}, f"HF Qwen2 {size}, batch {batch} x {seq}, fp32, no dropout"


def bert(quick: bool):
    from transformers import BertConfig, BertForMaskedLM

    if quick:
        cfg = BertConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         intermediate_size=128, max_position_embeddings=64)
        batch, seq = 2, 64
    else:
        cfg = BertConfig()  # BERT-base: 12 x 768, vocab 30522, dropout 0.1
        batch, seq = 16, 512
    ids = torch.randint(0, cfg.vocab_size, (batch, seq))
    return (BertForMaskedLM(cfg), {"input_ids": ids, "labels": ids},
            f"HF BertForMaskedLM({'tiny BertConfig' if quick else 'BertConfig()'}), batch {batch} x {seq}, "
            "fp32, dropout 0.1")


def gpt2(quick: bool):
    from examples.models import gpt2 as build

    size = (dict(batch=2, seq=64, n_layer=2, n_embd=64, n_head=4, vocab=256) if quick else
            dict(batch=8, seq=1024, n_layer=12, n_embd=768, n_head=12, vocab=50257))
    model, ex = build(**size, dropout=0.1)
    return model, ex, f"HF GPT-2 {size}, dropout 0.1; autocast/autoremat rows bf16, eager fp32"


MODELS = {"qwen2": qwen2, "bert": bert, "gpt2": gpt2}


def row_specs(quick: bool) -> dict[str, dict]:
    """Every row this script knows, by id (model:method[@budget factor]). With --quick the autoremat rows'
    budgets are fractions of eager's peak instead: at these tiny shapes checkpointing's peak is below
    autoremat's smallest budget, and finding that out (BudgetError) plans every loss chunk count in full,
    minutes on this CPU."""
    specs = {}
    for m in ("qwen2", "bert"):
        specs[f"{m}:eager"] = dict(model=m, method="eager")
        specs[f"{m}:ckpt"] = dict(model=m, method="checkpoint")
        specs[f"{m}:compile"] = dict(model=m, method="compile")
        for compiler in ("auto", "eager"):
            for f in (1.0, 0.8):
                specs[f"{m}:ar-{compiler}@{f}"] = dict(model=m, method="autoremat", compiler=compiler, factor=f,
                                                       peer=f"{m}:eager" if quick else f"{m}:ckpt",
                                                       precision="fp32")
    specs["gpt2:eager"] = dict(model="gpt2", method="eager")
    specs["gpt2:autocast-ckpt"] = dict(model="gpt2", method="checkpoint", autocast=True)
    specs["gpt2:compile"] = dict(model="gpt2", method="compile", autocast=True)
    specs["gpt2:ar-auto-bf16@1.0"] = dict(model="gpt2", method="autoremat", compiler="auto", factor=1.0,
                                          peer="gpt2:eager" if quick else "gpt2:autocast-ckpt", precision="bf16")
    for rid, s in specs.items():
        s["id"] = rid
    return specs


# most important first: the budget rows (each after the baselines it needs), then the speed baselines
DEFAULT_ORDER = ["qwen2:ar-auto@1.0", "bert:ar-auto@1.0", "qwen2:ar-auto@0.8", "bert:ar-auto@0.8",
                 "gpt2:ar-auto-bf16@1.0", "qwen2:compile", "bert:compile", "gpt2:compile",
                 "qwen2:ar-eager@1.0", "bert:ar-eager@1.0", "qwen2:ar-eager@0.8", "bert:ar-eager@0.8"]


# --quick: one row of each kind first (compiler auto and eager, torch.compile, bf16), then the rest, which
# its shorter deadline stops or skips (those paths run too)
QUICK_FIRST = ["qwen2:ar-auto@1.0", "bert:ar-eager@0.8", "qwen2:compile", "gpt2:ar-auto-bf16@1.0"]
QUICK_DEADLINE_S = 240.0
CKPT = {"qwen2": "qwen2:ckpt", "bert": "bert:ckpt", "gpt2": "gpt2:autocast-ckpt"}  # the "vs checkpoint" row


def ordered(wanted: list[str], specs: dict[str, dict]) -> list[str]:
    """`wanted` in order, each preceded by what it needs and has not had yet: its model's eager row (the
    gradient reference), its checkpoint row (a few seconds, and the time ratio's reference) and the row
    whose measured peak is its budget."""
    out: list[str] = []
    for rid in wanted:
        s = specs[rid]
        for need in (f"{s['model']}:eager", CKPT[s["model"]], s.get("peer"), rid):
            if need and need not in out:
                out.append(need)
    return out


# --------------------------------------------------------------------------------------------
# measuring one row


def sync(dev):
    common.sync(dev)


def empty_cache(dev):
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def free(dev):
    """Between rows: also drop dynamo's caches (compiled code holds the row's model). Never inside a row,
    whose compiled step would then compile again."""
    gc.collect()
    torch._dynamo.reset()
    empty_cache(dev)


def frame_where(frames: list[dict]) -> str:
    """The innermost frame in generated code (FX, Inductor) or outside torch, with its source line."""
    def interesting(fn: str) -> bool:
        return ("<eval_with_key" in fn or "torchinductor" in fn
                or ("/torch/" not in fn and not fn.startswith("<frozen") and fn != "??"))
    pick = next((f for f in frames if interesting(f.get("filename", ""))), frames[0] if frames else None)
    if pick is None:
        return "(no Python frame: allocated by the autograd engine's C++)"
    src = linecache.getline(pick["filename"], pick["line"]).strip()
    name = Path(pick["filename"]).name if "/" in pick["filename"] else pick["filename"]
    return f"{name}:{pick['line']} {pick.get('name', '')}" + (f": `{src[:110]}`" if src else "")


def replay(events: list[tuple[int, int, object]]) -> tuple[int, list[tuple[int, object]]]:
    """Allocations (+bytes) and frees (-bytes) of blocks, by key, in time order: the highest running sum and
    the blocks live there that were allocated within the events, largest first."""
    def run(stop: int | None):
        live: dict = {}
        running = best = 0
        best_i = -1
        for i, (size, key, info) in enumerate(events):
            if stop is not None and i > stop:
                break
            running += size
            if size > 0:
                live[key] = (size, info)
            else:
                live.pop(key, None)
            if running > best:
                best, best_i = running, i
        return best, best_i, live
    best, best_i, _ = run(None)
    _, _, live = run(best_i)  # a second pass to the peak: copying the live set at every new high is quadratic
    return best, sorted(live.values(), key=lambda b: -b[0])


def cuda_live_at_peak(step, dev) -> dict:
    """Run one step under the caching allocator's history; replay its events to the allocated peak and list
    the blocks live there that the step allocated (what was live before it is the baseline)."""
    sync(dev)
    base = torch.cuda.memory_allocated(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    # only arguments torch 2.11 and 2.13 share; dev is the current device (main() sets it)
    torch.cuda.memory._record_memory_history(enabled="all", context="alloc", stacks="python", max_entries=2_000_000)
    try:
        out = step()
        sync(dev)
        del out
        snap = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    peak_counter = torch.cuda.max_memory_allocated(dev)
    # the allocated counter drops when a free is requested (free_completed follows it later for a block
    # used on another stream, and is not counted again)
    events = [(ev["size"] if ev["action"] == "alloc" else -ev["size"], ev["addr"], ev.get("frames", []))
              for ev in snap["device_traces"][dev.index] if ev["action"] in ("alloc", "free_requested")]
    best, live = replay(events)
    blocks = [(s, frame_where(fr)) for s, fr in live]
    return dict(baseline=base, delta=best, peak=base + best, peak_counter=peak_counter, n_live=len(blocks),
                blocks=blocks, source="torch.cuda.memory history (python stacks)")


def cpu_live_at_peak(step, baseline: int) -> dict:
    """The same on CPU from the profiler's allocation events (autoremat.measure's method), paired by address;
    each block named by the op that allocated it."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = step()
        del out
    tag = torch._C._profiler._EventType.Allocation
    events, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if node.tag == tag and node.extra_fields.device.type == "cpu":
            op = node.parent.name if node.parent is not None else "(no op)"
            events.append((node.start_time_ns, int(node.extra_fields.alloc_size), node.extra_fields.ptr, op))
        stack.extend(node.children)
    # frees first at one time stamp, as autoremat.measure counts the peak
    best, blocks = replay([(size, ptr, op) for _, size, ptr, op in sorted(events, key=lambda e: (e[0], e[1]))])
    return dict(baseline=baseline, delta=best, peak=baseline + best, n_live=len(blocks), blocks=blocks,
                source="profiler allocation events")


def simulated_live_at_peak(om) -> dict:
    """The memory model's heap at its predicted peak (common.live_at_peak), largest storages first."""
    plan, profiles = om.plan, om._planners[0].profiles
    best = live_at_peak(profiles, [set(g.saved) | set(g.again) for g in plan.graphs],
                        get_device(plan.device).alloc_granularity)
    from autoremat.passes.recompute_names import base

    live = []
    for (scope, name), size in sorted(best["live"].items(), key=lambda kv: -kv[1]):
        p = profiles[scope].nodes[base(name)]
        live.append((size, f"graph {scope} `{name}` {p.target} {p.dtype} {tuple(p.shape) if p.shape else ''} "
                           f"{p.module or ''} ({p.kind})"))
    where = profiles[best["graph"]].nodes[base(best["node"])]
    return dict(during=best["during"], live_bytes=sum(s for s, _ in live), blocks=live,
                at=f"graph {best['graph']} {best['phase'] or '(phase not named)'} `{best['node']}` ({where.target}, {where.module})",
                fixed=plan.predicted_peak - plan.activation_peak, activation_peak=plan.activation_peak)


def culprits(measured: list, simulated: list, granularity: int = 512) -> list:
    """Measured blocks live at the measured peak with no simulated storage of the same (rounded) size live at
    the predicted peak: memory the model did not place there. Matched greedily, largest first."""
    def rnd(b):
        return -(-b // granularity) * granularity
    pool: dict[int, int] = {}
    for s, _ in simulated:
        pool[rnd(s)] = pool.get(rnd(s), 0) + 1
    out = []
    for s, where in measured:
        if pool.get(rnd(s), 0):
            pool[rnd(s)] -= 1
        else:
            out.append((s, where))
    return out


def dump_text(row: dict) -> list[str]:
    d = row["dump"]
    if "error" in d:
        return [f"### {row['id']}: dump failed: {d['error']}", ""]
    m, s = d["measured"], d.get("simulated")
    budget = row.get("budget") or 0
    lines = [f"### {row['id']}: allocated {row['allocated'] / MiB:.1f} MiB vs budget {budget / MiB:.1f} MiB "
             f"({row['allocated'] / budget:.3f}x)" if budget else f"### {row['id']}", "",
             f"Measured ({m['source']}): baseline before the step {m['baseline'] / MiB:.1f} MiB + the step's peak rise "
             f"{m['delta'] / MiB:.1f} MiB = {m['peak'] / MiB:.1f} MiB" +
             (f" (allocator counter {m['peak_counter'] / MiB:.1f} MiB)" if "peak_counter" in m else "") +
             f"; {m['n_live']} blocks allocated by the step are live there."]
    if s:
        lines.append(f"Simulated: fixed part {s['fixed'] / MiB:.1f} MiB (vs measured baseline {m['baseline'] / MiB:.1f}"
                     f", {(m['baseline'] - s['fixed']) / MiB:+.1f}) + activation peak {s['activation_peak'] / MiB:.1f}"
                     f" MiB (vs measured rise {m['delta'] / MiB:.1f}, {(m['delta'] - s['activation_peak']) / MiB:+.1f})"
                     f"; the peak at {s['at']}, live storages {s['live_bytes'] / MiB:.1f} MiB of "
                     f"{s['during'] / MiB:.1f} MiB.")
        extra = d.get("culprits", [])
        lines.append(f"Blocks live at the measured peak with no same-sized storage in the simulated live set: "
                     f"{len(extra)}, {sum(b for b, _ in extra) / MiB:.1f} MiB" +
                     ("; largest: " + "; ".join(f"{b / MiB:.1f} MiB {w}" for b, w in extra[:5]) if extra else "") + ".")
    lines += ["", "| # | measured block (MiB) | allocated at | simulated storage (MiB) | value |", "|---|---|---|---|---|"]
    sim = s["blocks"] if s else []
    for i in range(min(TOP, max(len(m["blocks"]), len(sim)))):
        mb = m["blocks"][i] if i < len(m["blocks"]) else None
        sb = sim[i] if i < len(sim) else None
        lines.append(f"| {i + 1} | {mb[0] / MiB:.2f} | {mb[1]} | " if mb else f"| {i + 1} | | | ")
        lines[-1] += f"{sb[0] / MiB:.2f} | {sb[1]} |" if sb else " | |"
    return lines + [""]


class Run:
    """The rows of one process: models built once (CPU pristine copies), the eager reference gradients,
    each row measured on its own device copy, the results file rewritten after every row."""

    def __init__(self, a, dev: torch.device, versions: dict, out_dir: Path) -> None:
        self.a, self.dev, self.versions, self.out_dir = a, dev, versions, out_dir
        self.specs = row_specs(a.quick)
        self.models: dict[str, tuple] = {}
        self.ref: dict[str, dict] = {}
        self.rows: list[dict] = []
        self.pending: list[str] = []
        self.needs = NEEDS_S_QUICK if a.quick else NEEDS_S
        self.repo = common.git_state().line() or "unknown (no git metadata here)"

    def model(self, key: str):
        if key not in self.models:
            torch.manual_seed(0)
            model, ex, label = MODELS[key](self.a.quick)
            self.models[key] = (model.train(), ex, label)
        return self.models[key]

    def by_id(self, rid: str) -> dict | None:
        return next((r for r in self.rows if r["id"] == rid), None)

    def budget_of(self, spec) -> tuple[int | None, str]:
        peer = self.by_id(spec["peer"])
        if peer is None or peer.get("status") != "ok":
            return None, f"skipped: its budget's row {spec['peer']} has no measurement"
        return int(peer["allocated"] * spec["factor"]), ""

    def build(self, spec, model, batch):
        dev, method = self.dev, spec["method"]
        info: dict = {}
        if method == "eager":
            fn = model
        elif method == "checkpoint":
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            fn = model
        elif method == "compile":
            fn = torch.compile(model)  # Inductor defaults
        else:
            kw = dict(budget=spec["budget"], example_inputs=batch, optimizer=None, compiler=spec["compiler"],
                      precision=spec["precision"])
            if self.a.time_limit:
                kw["time_limit"] = self.a.time_limit
            t = time.monotonic()
            fn = autoremat.optimize(model, **kw)
            p = fn.plan
            info = dict(plan_s=time.monotonic() - t, predicted_peak=p.predicted_peak,
                        activation_peak=p.activation_peak, peak_at=p.peak_at, no_recompute_budget=p.no_recompute_budget,
                        predicted_overhead=p.overhead, solver=p.solver, compiler_used=p.compiler, loss=p.loss,
                        num_graphs=fn.num_graphs, notes=p.notes, plan_device=p.device)
        if spec.get("autocast"):
            inner = fn

            def fn(**kw):
                with torch.autocast(dev.type, dtype=torch.bfloat16):
                    return inner(**kw)
        return fn, info

    def measure(self, spec, row: dict) -> None:
        dev, a = self.dev, self.a
        pristine, ex, _ = self.model(spec["model"])
        model = copy.deepcopy(pristine).to(dev)
        batch = {k: v.to(dev) for k, v in ex.items()}
        fn = None
        try:
            fn, info = self.build(spec, model, batch)
            row.update(info)

            def step():
                out = fn(**batch)  # the user's loop: the output is held through the backward
                loss_of(out).backward()
                return out

            t = time.monotonic()
            del_out = step()  # warm-up: compiles, and allocates every .grad
            sync(dev)
            del del_out
            row["first_step_s"] = time.monotonic() - t
            empty_cache(dev)
            out, m = measure_peak(step, device=dev, baseline_objs=(model, batch))
            del out
            row.update(allocated=m.peak_bytes, baseline=m.baseline_bytes, measure_method=m.method)
            if dev.type == "cuda":
                row["reserved"] = torch.cuda.max_memory_reserved(dev)
            times = []
            for _ in range(a.steps):
                sync(dev)
                t = time.perf_counter()
                out = step()
                sync(dev)
                times.append(time.perf_counter() - t)
                del out
            row.update(step_s=statistics.median(times), step_samples_s=times)
            common.zero(model)
            torch.manual_seed(SEED)
            out = step()
            del out
            g = {n: p.grad.detach().float().cpu() for n, p in model.named_parameters() if p.grad is not None}
            if spec["method"] == "eager":
                self.ref[spec["model"]] = g
            row.update(common.grad_errors(g, self.ref.get(spec["model"], {})))
            row["status"] = "ok"
            over = row.get("budget") is not None and row["allocated"] > row["budget"]
            if spec["method"] == "autoremat" and (over or a.dump == "all"):
                self.dump(row, step, fn, model, batch)
        except autoremat.BudgetError as e:
            row["status"] = (f"infeasible (BudgetError: smallest budget {e.smallest_budget / MiB:.1f} MiB)"
                             if e.smallest_budget else "infeasible (BudgetError)")
            row["smallest_budget"] = e.smallest_budget
        finally:
            fn = model = batch = None  # noqa: F841
            free(dev)

    def dump(self, row, step, om, model, batch) -> None:
        try:
            if self.dev.type == "cuda":
                measured = cuda_live_at_peak(step, self.dev)
            else:
                measured = cpu_live_at_peak(step, row["baseline"])
            simulated = simulated_live_at_peak(om)
            row["dump"] = dict(measured=measured, simulated=simulated,
                               culprits=culprits(measured["blocks"], simulated["blocks"],
                                                 get_device(om.plan.device).alloc_granularity or 512))
            for part in (measured, simulated):  # the table lists TOP; the JSON keeps a few more
                part["blocks"] = part["blocks"][:4 * TOP]
        except Exception as e:  # noqa: BLE001  (a failed dump must not lose the row)
            row["dump"] = dict(error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc())

    def run_row(self, rid: str) -> None:
        spec = dict(self.specs[rid])
        row = dict(id=rid, model=spec["model"], method=spec["method"],
                   setting=(f"compiler={spec['compiler']}, precision={spec['precision']}, "
                            f"{spec['factor']} x {spec['peer']}'s peak" if spec["method"] == "autoremat"
                            else "autocast(bf16)" if spec.get("autocast") else ""))
        left = self.a.deadline - elapsed()
        need = self.needs.get(spec["method"], 0.0)
        if spec["method"] == "autoremat":
            budget, why = self.budget_of(spec)
            row["budget"] = spec["budget"] = budget
            if budget is None:
                row["status"] = why
        if "status" not in row and left <= need:
            row["status"] = (f"skipped: past the deadline ({self.a.deadline:.0f} s)" if left <= 0 else
                             f"skipped: {left:.0f} s before the deadline, a {spec['method']} row needs ~{need:.0f} s")
        if "status" not in row:
            t0 = time.monotonic()
            signal.alarm(max(1, int(left)))
            try:
                self.measure(spec, row)
            except Deadline:
                row["status"] = f"stopped at the deadline ({self.a.deadline:.0f} s) after {time.monotonic() - t0:.0f} s"
                free(self.dev)
            except Exception as e:  # noqa: BLE001
                row["status"] = f"error: {type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"
                row["traceback"] = traceback.format_exc()
                print(row["traceback"], flush=True)
            finally:
                signal.alarm(0)
            row["row_s"] = time.monotonic() - t0
        self.rows.append(row)
        self.pending.remove(rid)
        print(f"[{elapsed():5.0f} s] {self.line(row)}", flush=True)
        self.write()

    # ---- output

    def baseline_time(self, model: str, method: str) -> float | None:
        rid = {"eager": f"{model}:eager", "compile": f"{model}:compile", "checkpoint": CKPT[model]}[method]
        r = self.by_id(rid)
        return r["step_s"] if r and r.get("status") == "ok" else None

    def cells(self, r: dict) -> list[str]:
        def f(x, spec, scale=1.0):
            return format(x / scale, spec) if x is not None else ""
        b = r.get("budget")
        if r.get("status") != "ok":
            return [f(b, ".1f", MiB), r.get("status", "pending"), *[""] * 9, f(r.get("plan_s"), ".0f")]
        ratios = [f(r["step_s"] / t, ".3f") if t else "" for t in
                  (self.baseline_time(r["model"], k) for k in ("eager", "checkpoint", "compile"))]
        return [f(b, ".1f", MiB), f(r["allocated"], ".1f", MiB), f(b and r["allocated"] / b, ".3f"),
                f(r.get("predicted_peak"), ".1f", MiB), f(r.get("reserved"), ".1f", MiB),
                f(r["step_s"] * 1e3, ".1f"), *ratios, f"{r['grad_rel_err']:.1e}",
                f(self.noise_floor(r["model"]), ".1e"), f(r.get("plan_s"), ".0f")]

    def noise_floor(self, model: str) -> float | None:
        """The model's checkpoint row's own gradient error against eager: it recomputes the same mathematics,
        so its error is the rounding noise any exact method shows on this device."""
        r = self.by_id(CKPT[model])
        return r["grad_rel_err"] if r and r.get("status") == "ok" else None

    def line(self, r: dict) -> str:
        c = self.cells(r)
        if r.get("status") != "ok":
            return f"{r['id']}: {c[1]}" + (f" (budget {c[0]} MiB)" if c[0] else "")
        return (f"{r['id']}: budget {c[0] or '-'} MiB, allocated {c[1]} MiB ({c[2] or '-'}), predicted {c[3] or '-'}, "
                f"reserved {c[4] or '-'}, step {c[5]} ms (x{c[6]} eager, x{c[7] or '-'} ckpt, x{c[8] or '-'} compile), "
                f"grad err {c[9]} (checkpoint's {c[10] or '-'}), plan {c[11] or '-'} s")

    def write(self) -> None:
        a, dev = self.a, self.dev
        head = ("| row | setting | budget (MiB) | allocated (MiB) | allocated / budget | predicted (MiB) | "
                "reserved (MiB) | step (ms) | vs eager | vs checkpoint | vs torch.compile | grad err | checkpoint's "
                "grad err | plan (s) |")
        lines = [head, "|" + "---|" * 14]
        for r in self.rows + [dict(id=p, setting="", status="pending (not reached: the process ended first)")
                              for p in self.pending]:
            lines.append(f"| {r['id']} | {r.get('setting', '')} | " + " | ".join(self.cells(r)) + " |")
        over = [r for r in self.rows if r.get("status") == "ok" and r.get("budget") and r["allocated"] > r["budget"]]
        held = [r for r in self.rows if r.get("status") == "ok" and r.get("budget") and r["allocated"] <= r["budget"]]
        name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
        models = "\n".join(f"- {k}: {v[2]}" for k, v in self.models.items())
        text = [f"# autoremat GPU check on {name}", "",
                f"Command: `python benchmarks/gpu_check.py {' '.join(sys.argv[1:])}`, "
                f"{datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}, repo "
                f"{self.repo}, {', '.join(f'{k} {v}' for k, v in self.versions.items())}, "
                f"wall {elapsed():.0f} s of a {a.deadline:.0f} s deadline.", "",
                "Step = `out = model(**batch); out.loss.backward()`, output held through the backward, after a "
                "warm-up step (every .grad exists). allocated: " +
                ("torch.cuda.max_memory_allocated over the step (stats reset just before it); reserved: "
                 "max_memory_reserved over it (empty_cache before it)" if dev.type == "cuda" else
                 "autoremat.measure's allocator-event peak (profiler) + what the model, grads and batch hold") +
                f". Step time: median of {a.steps}; ratios to the same model's eager, checkpoint (GPT-2: "
                "autocast(bf16) + checkpoint) and torch.compile rows. grad err: ||g - g_eager|| / ||g_eager|| "
                "over all parameters together against fp32 eager, same seed before each step "
                "(common.grad_rel_err); checkpoint's grad err: the same model's checkpoint row's, the noise "
                "floor of this device (GPT-2's under autocast); torch.compile's Inductor draws dropout masks with its own generator, so "
                "its error on the dropout models (BERT, GPT-2) is expected. plan: seconds of autoremat.optimize "
                "(capture, solve, compile, verify).",
                "", "Models:", models, "", *lines, "",
                f"Budget held by {len(held)} autoremat row(s), exceeded by {len(over)}" +
                (": " + ", ".join(f"{r['id']} ({r['allocated'] / r['budget']:.3f}x)" for r in over) if over else "")
                + ".", ""]
        dumps = [r for r in self.rows if "dump" in r]
        if dumps:
            text += ["## Live at the peak: measured against the memory model", "",
                     "Left: the largest blocks the measured step allocated that are live at its allocated peak, "
                     "with where they were allocated. Right: the memory model's live storages at its predicted "
                     "peak (benchmarks/live_at_peak.py). " +
                     ("Every autoremat row is dumped (--dump all)." if a.dump == "all" else
                      "Rows over their budget only."), ""]
            for r in dumps:
                text += dump_text(r)
        md = "\n".join(text) + "\n"
        stem = f"gpu_check_{dev.type}{'_quick' if a.quick else ''}"
        (self.out_dir / f"{stem}.md").write_text(md)
        (self.out_dir / f"{stem}.json").write_text(json.dumps(
            dict(device=name, versions=self.versions, argv=sys.argv, deadline_s=a.deadline, wall_s=elapsed(),
                 models={k: v[2] for k, v in self.models.items()}, rows=self.rows, pending=self.pending),
            indent=1, default=str))
        self.md = md


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--quick", action="store_true", help="tiny shapes: a smoke test of the script itself")
    ap.add_argument("--rows", default="", help=f"comma-separated row ids, in order (default {','.join(DEFAULT_ORDER)})")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--deadline", type=float, default=None,
                    help=f"seconds from process start after which no row starts (default 480; --quick {QUICK_DEADLINE_S:.0f})")
    ap.add_argument("--time-limit", type=float, default=None, help="autoremat's solver time limit per solve")
    ap.add_argument("--loss-chunks", default=None,
                    help="loss-region chunk counts autoremat tries, e.g. 1,4 (default the library's; --quick 1,4)")
    ap.add_argument("--dump", choices=("over", "all", "none"), default=None,
                    help="which autoremat rows get the live-at-peak dump (default over; --quick all)")
    a = ap.parse_args()
    a.deadline = a.deadline if a.deadline is not None else (QUICK_DEADLINE_S if a.quick else 480.0)
    a.loss_chunks = a.loss_chunks if a.loss_chunks is not None else ("1,4" if a.quick else "")
    a.dump = a.dump or ("all" if a.quick else "over")
    dev = torch.device(a.device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", 0)
    specs = row_specs(a.quick)
    wanted = [r for r in a.rows.split(",") if r] or (
        QUICK_FIRST + [r for r in DEFAULT_ORDER if r not in QUICK_FIRST] if a.quick else DEFAULT_ORDER)
    unknown = [r for r in wanted if r not in specs]
    if unknown:
        ap.error(f"unknown rows {unknown}; known: {', '.join(specs)}")
    torch.set_num_threads(1 if dev.type == "cpu" else min(8, os.cpu_count() or 1))
    versions = sanity(dev)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)  # the memory history records the current device
    if a.loss_chunks:
        from autoremat.passes import loss_chunks

        loss_chunks.CANDIDATES = tuple(int(k) for k in a.loss_chunks.split(","))
        versions["loss_chunks.CANDIDATES"] = loss_chunks.CANDIDATES
    out_dir = Path(os.environ["OUT"]) if os.environ.get("OUT") else REPO / "benchmarks" / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    run = Run(a, dev, versions, out_dir)
    run.pending = ordered(wanted, specs)
    print(f"rows, in order: {', '.join(run.pending)}; deadline {a.deadline:.0f} s ({elapsed():.0f} s gone)",
          flush=True)

    def on_alarm(signum, frame):
        raise Deadline()
    signal.signal(signal.SIGALRM, on_alarm)
    run.write()
    for rid in list(run.pending):
        run.run_row(rid)
    print("\n" + run.md, flush=True)
    print(f"wrote {out_dir}/gpu_check_{dev.type}{'_quick' if a.quick else ''}.md and .json ({elapsed():.0f} s)",
          flush=True)


if __name__ == "__main__":
    main()
