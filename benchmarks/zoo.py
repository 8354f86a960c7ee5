"""The model zoo: every family of examples/zoo.py, as a new user would try it, against HF gradient checkpointing.

One row per model (and per decoder again with a PEFT LoRA adapter, `--lora`). The step is the loop users write,
`out = model(**batch); out.loss.backward()`, in the accumulation steady state (`.grad` present), no optimizer.
`out` is held through the backward (the default, outputs="all"); checkpointing's peak is also measured with it
dropped (`model(**batch).loss.backward()`), the convention outputs="loss" matches.

Each row reports:
- eager's peak, and HF checkpointing's (`gradient_checkpointing_enable(use_reentrant=False)`) held and dropped;
  a family without it (ResNet, ConvNeXt) gets `torch.utils.checkpoint` around each block of its block loop
  instead, marked "(hand ckpt)";
- the floor: `BudgetError.smallest_budget` of `autoremat.optimize(model, budget=1)` under eager and Inductor,
  over checkpointing's held peak;
- at checkpointing's held peak, under the default compiler: the measured peak over the budget, the gradient
  error against eager (over all parameters together; checkpointing's own beside it, the noise floor), the
  compiler used, the step time over checkpointing's (head to head, alternating pairs, with half the
  interquartile range of the pair ratios), and the planning seconds.

    python benchmarks/zoo.py                         # every family, the zoo's size
    python benchmarks/zoo.py --families gemma2 opt --lora
    python benchmarks/zoo.py --quick                 # examples.zoo.TINY sizes, fewer timing pairs

Writes results/zoo_cpu.json and .md (results/zoo_cpu_quick.* with --quick; --out to name another).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import functools
import gc
import json
import re
import sys
import time
import traceback
from pathlib import Path

import torch
from common import SEED, MiB, git_state, grad_errors, head_to_head, load_average, zero
from torch.utils.checkpoint import checkpoint

import autoremat
from autoremat.capture.blocks import repeated_blocks
from autoremat.measure import measure_peak
from examples import zoo

HERE = Path(__file__).resolve().parent
FLOOR_GOAL = 0.9  # the floor over checkpointing's peak that every row must reach


def step_of(fn, batch: dict, held: bool):
    """One training step as users write it; `held`: the output lives through the backward."""
    def step() -> None:
        if held:
            out = fn(**batch)
            out.loss.backward()
            del out
        else:
            fn(**batch).loss.backward()
    return step


def trainable_grads(model: torch.nn.Module) -> dict:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad and p.grad is not None}


def steady_peak(step, model, batch) -> int:
    """The steady-state peak: after a step that made every .grad, the whole next step's."""
    step()
    _, m = measure_peak(step, baseline_objs=(model, batch))
    return m.peak_bytes


def grads_from_zero(step, model) -> dict:
    zero(model)
    torch.manual_seed(SEED)
    step()
    return trainable_grads(model)


def fresh(family: str, size: zoo.Size, lora: bool) -> tuple[torch.nn.Module, dict]:
    model, batch = zoo.build(family, size)
    return (zoo.lora(model) if lora else model), batch


def checkpointed(model: torch.nn.Module) -> tuple[torch.nn.Module, str]:
    """`model` with HF's own non-reentrant gradient checkpointing on, and "HF"; where the family has none,
    `torch.utils.checkpoint` (non-reentrant) around each block of its block loop (the ModuleList or Sequential
    of identical blocks holding the most parameters), and what that was."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if getattr(base, "supports_gradient_checkpointing", False):
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return model, "HF"
    blocks = repeated_blocks(base)
    for block in blocks:
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)
    return model, f"torch.utils.checkpoint on each of {len(blocks)} {type(blocks[0]).__name__} blocks"


def floor(model, batch, compiler: str) -> tuple[int | str, dict]:
    """The smallest budget a floor query names (or why there is none), and what sets it: the fixed parts
    (parameters, gradients, ...) and the largest tensors live at the floor plan's peak."""
    torch._dynamo.reset()
    try:
        autoremat.optimize(model, budget=1, example_inputs=batch, optimizer=None, compiler=compiler)
    except autoremat.BudgetError as e:
        step = e.peak_step
        where = dict(fixed=e.ledger.fixed, peak=f"graph {step.graph}'s {step.phase} at {step.node}" if step else "",
                     live=[str(t) for t in e.at_peak[:3]])
        return (e.smallest_budget if e.smallest_budget is not None else f"BudgetError: {e}".splitlines()[0]), where
    except Exception as e:  # noqa: BLE001 - a failing row is reported, not fatal
        return f"{type(e).__name__}: {str(e).splitlines()[0][:300]}", {}
    finally:
        torch._dynamo.reset()
    return "planned at 1 byte", {}


def run_row(family: str, size: zoo.Size, lora: bool, pairs: int, inductor_floor: bool) -> dict:
    name = family + (" + LoRA" if lora else "")
    row: dict = dict(model=name, family=family, lora=lora, git=git_state().head)
    t0 = time.perf_counter()
    try:
        pristine, batch = fresh(family, size, lora)
        eager = copy.deepcopy(pristine)
        eager_step = step_of(eager, batch, held=True)
        row["eager_peak"] = steady_peak(eager_step, eager, batch)
        ref = grads_from_zero(eager_step, eager)

        ckpt, row["ckpt_kind"] = checkpointed(copy.deepcopy(pristine))
        ckpt_step = step_of(ckpt, batch, held=True)
        row["ckpt_held_peak"] = steady_peak(ckpt_step, ckpt, batch)
        row["ckpt_dropped_peak"] = steady_peak(step_of(ckpt, batch, held=False), ckpt, batch)
        row["ckpt_grad_rel_err"] = grad_errors(grads_from_zero(ckpt_step, ckpt), ref)["grad_rel_err"]
        budget = row["ckpt_held_peak"]

        row["floor_eager"], row["floor_eager_at"] = floor(copy.deepcopy(pristine), batch, "eager")
        if inductor_floor:
            row["floor_inductor"], row["floor_inductor_at"] = floor(copy.deepcopy(pristine), batch, "inductor")

        model = copy.deepcopy(pristine)
        torch._dynamo.reset()
        p0 = time.perf_counter()
        try:
            om = autoremat.optimize(model, budget=budget, example_inputs=batch, optimizer=None)
        except autoremat.BudgetError as e:
            row.update(status="BudgetError at checkpointing's peak", smallest_budget=e.smallest_budget)
            return row
        row["plan_s"] = time.perf_counter() - p0
        row["compiler_used"] = om.plan.compiler.get("used")
        row["loss_chunks"] = om.plan.loss.get("chunks") if om.plan.loss else None
        row["predicted_peak"] = om.plan.predicted_peak
        ours = step_of(om, batch, held=True)
        row["peak"] = steady_peak(ours, model, batch)
        row["peak_over_budget"] = row["peak"] / budget
        row.update(grad_errors(grads_from_zero(ours, model), ref))
        ours()
        ckpt_step()
        h2h = head_to_head(ours, ckpt_step, pairs, lambda: None)
        row.update(time_vs_ckpt=h2h["ratio"], time_noise=h2h["noise"], time_interval=h2h["interval"],
                   step_s=h2h["a_s"], ckpt_step_s=h2h["b_s"])
        row["status"] = "ok"
    except Exception as e:  # noqa: BLE001 - a failing row is reported, not fatal
        row.update(status=f"{type(e).__name__}: {str(e).splitlines()[0][:300]}", traceback=traceback.format_exc())
    finally:
        row["row_s"] = time.perf_counter() - t0
        gc.collect()
        torch._dynamo.reset()
    return row


def mib(b) -> str:
    return f"{b / MiB:.2f}" if isinstance(b, int) else ""


def ratio(b, ref) -> str:
    if isinstance(b, int) and isinstance(ref, int):
        return f"{b / ref:.3f}"
    return str(b)[:60] if b is not None else ""


def table(rows: list[dict]) -> str:
    head = ("| model | eager MiB | ckpt held / dropped MiB | floor eager / ckpt | floor Inductor / ckpt | "
            "at ckpt's peak: peak / budget | grad err (ckpt's) | compiler | time / ckpt (± noise) | plan s |")
    lines = [head, "|" + "---|" * 10]
    for r in rows:
        held = r.get("ckpt_held_peak")
        if r.get("status") == "ok":
            at = (f"{r['peak_over_budget']:.3f} | {r['grad_rel_err']:.1e} ({r['ckpt_grad_rel_err']:.1e}) | "
                  f"{r['compiler_used']} | {r['time_vs_ckpt']:.2f} (± {r['time_noise']:.2f}) | {r['plan_s']:.0f}")
        else:
            at = f"{r.get('status')} | | | |"
        name = r["model"] + (" (hand ckpt)" if r.get("ckpt_kind", "HF") != "HF" else "")
        lines.append(f"| {name} | {mib(r.get('eager_peak'))} | {mib(held)} / {mib(r.get('ckpt_dropped_peak'))} | "
                     f"{ratio(r.get('floor_eager'), held)} | {ratio(r.get('floor_inductor'), held)} | {at} |")
    return "\n".join(lines)


def goal(rows: list[dict]) -> list[str]:
    """The rows that miss the zoo's goals (the floor at most FLOOR_GOAL x checkpointing's held peak, the measured
    peak within its budget), each with what it missed."""
    missed = []
    for r in rows:
        held = r.get("ckpt_held_peak")
        why = []
        for key in ("floor_eager", "floor_inductor"):
            f = r.get(key)
            if key in r and not (isinstance(f, int) and isinstance(held, int) and f <= FLOOR_GOAL * held):
                why.append(f"{key} {ratio(f, held)}{floor_reason(r.get(key + '_at'), held)}")
        if r.get("status") != "ok":
            why.append(str(r.get("status")))
        elif r["peak_over_budget"] > 1:
            why.append(f"peak over budget {r['peak_over_budget']:.4f}")
        if why:
            missed.append(f"- {r['model']}: {'; '.join(why)}")
    return missed


def floor_reason(at: dict | None, held) -> str:
    """What sets a floor, in words: the fixed parts' share of checkpointing's peak, where the floor plan peaks,
    and its largest live tensors."""
    if not at or not isinstance(held, int):
        return ""
    live = [re.sub(r" \(\d+ bytes\)|, node \w+", "", t) for t in at["live"]]
    return (f" (fixed parts {at['fixed'] / held:.2f} of checkpointing's peak; the floor plan peaks at "
            f"{at['peak']}, holding {', '.join(live)})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", nargs="*", default=list(zoo.FAMILIES))
    ap.add_argument("--lora", action="store_true", help="also every decoder family with a PEFT LoRA adapter")
    ap.add_argument("--lora-only", action="store_true", help="only the LoRA rows")
    ap.add_argument("--quick", action="store_true", help="examples.zoo.TINY sizes and 5 timing pairs")
    ap.add_argument("--pairs", type=int, default=None, help="head-to-head timing pairs (default 11, quick 5)")
    ap.add_argument("--no-inductor-floor", action="store_true", help="skip the floor under Inductor")
    ap.add_argument("--out", default=None, help="results file stem under benchmarks/results")
    ap.add_argument("--merge", action="store_true", help="keep the file's other rows, replace the ones run again")
    a = ap.parse_args()
    torch.set_num_threads(1)
    size = zoo.TINY if a.quick else zoo.ZOO_SIZE
    pairs = a.pairs or (5 if a.quick else 11)
    stem = a.out or ("zoo_cpu_quick" if a.quick else "zoo_cpu")
    plan = [] if a.lora_only else [(f, False) for f in a.families]
    if a.lora or a.lora_only:
        plan += [(f, True) for f in a.families if f in zoo.CAUSAL]
    meta = dict(command="python benchmarks/zoo.py " + " ".join(sys.argv[1:]), size=dataclasses.asdict(size),
                torch=torch.__version__, git=dataclasses.asdict(git_state()), load=load_average(),
                threads=torch.get_num_threads())
    rows: list[dict] = []
    if a.merge and (HERE / "results" / f"{stem}.json").exists():
        old = json.loads((HERE / "results" / f"{stem}.json").read_text())
        rows = old["rows"]
        meta["command"] = f"{old['meta']['command']}; then {meta['command']}"
    text = ""
    for family, lora in plan:
        r = run_row(family, size, lora, pairs, not a.no_inductor_floor)
        at = next((i for i, o in enumerate(rows) if o["model"] == r["model"]), None)
        if at is None:
            rows.append(r)
        else:
            rows[at] = r
        print(table([r]).splitlines()[-1], f"({r['row_s']:.0f} s)", flush=True)
        text = write(stem, meta, rows, a.quick, size)  # after every row: a long run stopped early keeps its rows
    print(text)


def write(stem: str, meta: dict, rows: list[dict], quick: bool, size: zoo.Size) -> str:
    out = HERE / "results"
    (out / f"{stem}.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1, default=str))
    missed = goal(rows)
    text = [f"# The model zoo against HF gradient checkpointing ({'quick' if quick else 'zoo'} size)", "",
            f"Command: `{meta['command']}`", "", f"torch {meta['torch']}, git {meta['git']['head']}, load at the start "
            f"{meta['load']}, one thread; size {size}.", "", table(rows), "",
            f"Goal check: floor <= {FLOOR_GOAL} x checkpointing's held peak under eager (and Inductor, where "
            f"measured), and the "
            f"default compiler plans at checkpointing's peak and holds it: "
            f"{len(rows) - len(missed)} of {len(rows)} rows meet it.", *missed, ""]
    (out / f"{stem}.md").write_text("\n".join(text))
    return "\n".join(text)


if __name__ == "__main__":
    main()
