"""The benchmarks' shared steps: a training step and its gradients, paired timing with its noise, the peer
rows' builders (build(model) -> (callable, info)), and the facts of a run (git_state, load_average). Part of
the shared module `common` (see its __init__).
"""

from __future__ import annotations

import functools
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.append(str(REPO))  # for `examples`; appended so that PYTHONPATH can pick another autoremat

import autoremat  # noqa: E402
from autoremat.measure import GRAD_NOISE_FLOOR, grad_rel_err, param_rel_errs  # noqa: E402, F401
from examples.models import loss_of  # noqa: E402

MiB = 2**20
SEED = 1234  # torch.manual_seed before every gradient step, so that each row draws eager's dropout masks
# Every row's step reads only the loss and drops the model's other outputs before the backward, so autoremat is
# told so, as a user would tell it. With the default outputs="all" the plan would count GPT-2's logits as held by
# the caller through the backward: 16 MiB in remat_vs_peers.py that its measured step never holds (the run at
# ab9bac2, and one at 38c540a, showed that gap on every GPT-2 row).
OUTPUTS = "loss"
FLOOR_PT_BUDGETS = (0.5, 0.1, 0.0)  # floor.py's pt-budget rows (drift.py replays them in floor.py's order)

Build = Callable[[torch.nn.Module], tuple[object, dict]]  # a row's model -> (what its step calls, row fields)


# --------------------------------------------------------------------------------------------
# steps and gradients


def split(ex) -> tuple[tuple, dict]:
    return ((), dict(ex)) if isinstance(ex, dict) else (tuple(ex), {})


def to_device(ex, device: torch.device):
    if isinstance(ex, dict):
        return {k: v.to(device) for k, v in ex.items()}
    return tuple(t.to(device) for t in ex)


def make_step(fn, args: tuple, kwargs: dict) -> Callable[[], None]:
    """Forward + backward of the loss alone; the model's other outputs die before the backward."""
    def step() -> None:
        loss = loss_of(fn(*args, **kwargs))
        loss.backward()
        return None
    return step


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def grads_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def zero(model: torch.nn.Module) -> None:
    for p in model.parameters():
        p.grad = None


def grad_errors(g: dict, ref: dict) -> dict:
    """The gradient error fields of a row against the reference `ref` (autoremat.measure says why these):
    grad_rel_err, ||g - ref|| / ||ref|| over all parameters together; worst_param_rel_err and worst_param,
    the largest per-parameter error with its denominator floored at GRAD_NOISE_FLOOR x the largest gradient's
    norm, and where it is reached."""
    per = param_rel_errs(g, ref)
    worst = max(per, key=per.get)
    return dict(grad_rel_err=grad_rel_err(g, ref), worst_param_rel_err=per[worst], worst_param=worst)


# --------------------------------------------------------------------------------------------
# paired timing: machines drift, so each measured step runs right after a reference step, and a row is judged
# by the ratio of the two medians (or the median ratio). Two rows' ratios to eager, timed minutes apart, are
# biased by that drift (drift.py); where a goal compares two methods, head_to_head times them against each other.


def paired_times(ref_step: Callable[[], object], step: Callable[[], object], n: int,
                 sync: Callable[[], object]) -> tuple[list[float], list[float]]:
    """Seconds of `n` runs of `step` and of the `ref_step` run just before each (`sync` waits for
    the device). Returns (step times, reference times)."""
    rt, et = [], []
    for _ in range(n):
        sync()
        a = time.perf_counter()
        ref_step()
        sync()
        b = time.perf_counter()
        step()
        sync()
        c = time.perf_counter()
        et.append(b - a)
        rt.append(c - b)
    return rt, et


def head_to_head(step_a: Callable[[], object], step_b: Callable[[], object], n: int,
                 sync: Callable[[], object]) -> dict:
    """Time of `step_a` over `step_b`, measured in `n` pairs whose order alternates from pair to pair. Each
    timed step runs right after an untimed step of the same model, as in a training loop (the allocator and
    caches in the state that model's own step leaves), and no third model's step runs between them: unlike
    two ratios to eager, this ratio carries no reference step's noise. Both steps must have run once already.

    Returns ratios (per pair), ratio (their median), noise (half their interquartile range), interval
    (a 90% bootstrap interval of the median), and a_s, b_s: the median seconds of each step. With odd n
    the order b-then-a runs once more than a-then-b."""
    def timed(step: Callable[[], object]) -> float:  # one step, right after an untimed one of the same model
        return paired_times(step, step, 1, sync)[0][0]

    ratios, a_s, b_s = [], [], []
    for i in range(n):
        if i % 2 == 0:
            t_b = timed(step_b)
            t_a = timed(step_a)
        else:
            t_a = timed(step_a)
            t_b = timed(step_b)
        ratios.append(t_a / t_b)
        a_s.append(t_a)
        b_s.append(t_b)
    q1, _, q3 = statistics.quantiles(ratios, n=4)
    return dict(ratios=ratios, ratio=statistics.median(ratios), noise=(q3 - q1) / 2,
                interval=bootstrap_median_interval(ratios), a_s=statistics.median(a_s), b_s=statistics.median(b_s))


def bootstrap_median_interval(ratios: list[float], draws: int = 2000, seed: int = 0) -> tuple[float, float]:
    """The 5th and 95th percentiles of the median over resamples of `ratios` (with replacement): how far the
    median itself could move on another run of as many pairs, unlike the spread of single pairs."""
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(draws))
    return medians[int(0.05 * draws)], medians[int(0.95 * draws) - 1]


# --------------------------------------------------------------------------------------------
# row builders: build(model) -> (callable, info dict); the first call (compilation) happens in build or in the
# row's warm-up step


def eager_build(model):
    return model, {}


def checkpoint_every_block(model: torch.nn.Module) -> torch.nn.Module:
    """HF models: their own non-reentrant gradient checkpointing; ours: each block's forward wrapped."""
    if getattr(model, "supports_gradient_checkpointing", False):
        # activation_checkpointing_enable: transformers 5's name for the deprecated gradient_checkpointing_enable
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        from torch.utils.checkpoint import checkpoint
        for block in model.blocks:
            block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)
    return model


def pt_build(b: float, args: tuple, kwargs: dict) -> Build:
    """torch.compile(backend="aot_eager") under activation_memory_budget = b (the min-cut partitioner)."""
    def build(model):
        torch._dynamo.reset()
        with torch._functorch.config.patch(activation_memory_budget=b):
            cm = torch.compile(model, backend="aot_eager")
            loss_of(cm(*args, **kwargs)).backward()  # first call (compile + partition) inside the patch
        return cm, {}
    return build


def inductor_build(b: float, args: tuple, kwargs: dict) -> Build:
    """torch.compile(backend="inductor") under activation_memory_budget = b, with its compile time."""
    def build(model):
        torch._dynamo.reset()
        t0 = time.perf_counter()
        with torch._functorch.config.patch(activation_memory_budget=b):
            cm = torch.compile(model, backend="inductor")
            loss_of(cm(*args, **kwargs)).backward()  # the first call compiles and partitions inside the patch
        return cm, {"compile_s": time.perf_counter() - t0}
    return build


def compiled_graphs() -> int:
    """Graphs dynamo has compiled in this process: unchanged across a timing, nothing recompiled in it."""
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def ar_build(budget, ex, outputs: str = OUTPUTS, compiler: str = "eager") -> Build:
    """autoremat.optimize at `budget` with no optimizer, and the plan's figures as the row's fields."""
    def build(model):
        torch._dynamo.reset()
        om = autoremat.optimize(model, budget=int(budget), example_inputs=ex, optimizer=None, outputs=outputs,
                                compiler=compiler)
        p = om.plan
        info = dict(budget=int(budget), predicted_peak=p.predicted_peak, activation_peak=p.activation_peak,
                    baseline_peak=p.baseline_peak, predicted_overhead=p.overhead, num_graphs=om.num_graphs,
                    solver_status=p.solver.get("status"), compiler_used=p.compiler.get("used"))
        return om, info
    build.budget = int(budget)
    return build


def error_status(e: BaseException) -> str:
    """A failed row's status: the exception's type and the first line of its message."""
    first_line = str(e).splitlines()[0][:200] if str(e) else ""
    return f"error: {type(e).__name__}: {first_line}"


# --------------------------------------------------------------------------------------------
# the run: which code, on how busy a machine


@dataclass(frozen=True)
class GitState:
    """The commit a run ran from, and whether its code differed from it."""

    head: str  # short hash of HEAD ("" outside a git checkout, "unknown" where git could not run)
    diff_stat: str  # the summary line of `git diff --stat` over the whole tree ("" when nothing tracked changed)
    dirty: bool  # autoremat/ or benchmarks/ (its results aside, which a run rewrites) differ, untracked files too

    def line(self) -> str:
        """The hash, and a note when the library or the benchmarks had uncommitted changes: for a header."""
        return self.head + (" (autoremat/ or benchmarks/ has uncommitted changes)" if self.dirty else "")

    def as_dict(self) -> dict[str, str]:
        """{"head", "diff_stat"}: what floor.py's and lora.py's results hold (floor.py --merge reads it back)."""
        return {"head": self.head, "diff_stat": self.diff_stat}


def git_state() -> GitState:
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True).stdout.strip()
    try:
        diff_stat = git("diff", "--stat").splitlines()
        dirty = git("status", "--porcelain", "--", "autoremat", "benchmarks", ":!benchmarks/results")
        return GitState(head=git("rev-parse", "--short", "HEAD"),
                        diff_stat=diff_stat[-1].strip() if diff_stat else "", dirty=bool(dirty))
    except Exception:  # noqa: BLE001 - no git here: the results say so instead of failing the run
        return GitState(head="unknown", diff_stat="", dirty=False)


def load_average() -> str:
    return " / ".join(f"{x:.1f}" for x in os.getloadavg()) + " (1 / 5 / 15 min)"


