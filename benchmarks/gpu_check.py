"""One prepared GPU check for autoremat: a GPT-2-small-like HF model on one CUDA device.

For eager, checkpoint-every-block (HF gradient checkpointing, non-reentrant) and autoremat at a
few absolute budgets (the smallest feasible one, the midpoint, the no-recompute total, and the
checkpoint row's measured peak), then autocast(bf16) + checkpoint-every-block and autoremat
precision="auto" and precision="bf16" at that row's measured peak, and precision="bf16" at its own smallest budget, it measures one training step (forward + backward, no optimizer,
gradients already allocated by a warm-up step):
  - torch.cuda.max_memory_allocated (absolute, only this row's model, grads and inputs on the device),
    against the budget and against autoremat's predicted peak,
  - the step time (median of --steps) relative to eager and to checkpoint-every-block,
  - the largest relative gradient error vs eager (same seed before the forward, dropout on).
Prints one markdown table; writes gpu_check_<device>.md/.json to $OUT if set, else benchmarks/results/.

    python benchmarks/gpu_check.py                       # cuda, GPT-2 small shape, batch 8 x 1024, fp32
    python benchmarks/gpu_check.py --device cpu --quick  # a tiny smoke test of the script itself

Meant to finish in < 5 minutes on an H200; rows that would start after --max-seconds are skipped
(and say so). Needs PuLP importable (autoremat's solver).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import gc
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.append(str(REPO))

import autoremat  # noqa: E402
from autoremat.measure import measure_peak  # noqa: E402
from examples.models import gpt2, loss_of  # noqa: E402

MiB = 2**20
SEED = 1234


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def free(dev):
    gc.collect()
    torch._dynamo.reset()
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--quick", action="store_true", help="tiny model, for a smoke test on CPU")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--time-limit", type=float, default=20.0, help="autoremat solver time limit per plan (s)")
    ap.add_argument("--max-seconds", type=float, default=240.0, help="skip rows that would start after this")
    a = ap.parse_args()
    t_start = time.perf_counter()
    torch.set_num_threads(1 if a.device == "cpu" else min(8, os.cpu_count() or 1))
    dev = torch.device(a.device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    if a.quick:
        cfg = dict(batch=2, seq=64, n_layer=2, n_embd=64, n_head=4, vocab=256, dropout=0.1)
    else:
        cfg = dict(batch=a.batch, seq=a.seq, n_layer=a.layers, n_embd=768, n_head=12, vocab=50257, dropout=0.1)
    torch.manual_seed(0)
    pristine, ex_cpu = gpt2(**cfg)
    pristine.train()
    ex = {k: v.to(dev) for k, v in ex_cpu.items()}
    out_dir = Path(os.environ["OUT"]) if os.environ.get("OUT") else REPO / "benchmarks" / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    print(f"gpu_check: {name}, torch {torch.__version__}, autoremat {autoremat.__file__}, model gpt2 {cfg}",
          flush=True)

    rows: list[dict] = []
    ref_grads: dict[str, torch.Tensor] = {}

    def run_row(method: str, setting: str, build, budget: int | None = None) -> dict:
        row = dict(method=method, setting=setting)
        if budget is not None:
            row["budget"] = int(budget)
        if time.perf_counter() - t_start > a.max_seconds:
            row["status"] = f"skipped (past --max-seconds {a.max_seconds:.0f})"
            rows.append(row)
            print(f"  {method} {setting}: {row['status']}", flush=True)
            return row
        t0 = time.perf_counter()
        model = fn = None
        try:
            free(dev)
            model = copy.deepcopy(pristine).to(dev)
            fn, info = build(model)
            row.update(info)

            def step():
                loss_of(fn(**ex)).backward()

            step()  # warm-up (and compilation for autoremat), grads allocated from here on
            sync(dev)
            _, m = measure_peak(step, device=dev, baseline_objs=(model, ex))
            row["measured_peak"] = m.peak_bytes
            row["baseline_bytes"] = m.baseline_bytes
            row["measure_method"] = m.method
            times = []
            for _ in range(a.steps):
                sync(dev)
                t = time.perf_counter()
                step()
                sync(dev)
                times.append(time.perf_counter() - t)
            row["step_s"] = statistics.median(times)
            row["step_samples_s"] = times
            for p in model.parameters():
                p.grad = None
            torch.manual_seed(SEED)
            step()
            g = {n: p.grad.detach().float().cpu() for n, p in model.named_parameters() if p.grad is not None}
            if method == "eager":
                ref_grads.update(g)
            worst = 0.0
            for n, r in ref_grads.items():
                if n not in g:
                    worst = float("inf")
                    continue
                s = r.double().norm().item()
                d = (g[n].double() - r.double()).norm().item()
                worst = max(worst, d / s if s else (0.0 if d == 0 else float("inf")))
            row["max_grad_rel_err"] = worst
            row["status"] = "ok"
        except autoremat.BudgetError as e:
            row["status"] = "infeasible"
            row["smallest_budget"] = e.smallest_budget
        except Exception as e:  # noqa: BLE001
            row["status"] = f"error: {type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"
            row["traceback"] = traceback.format_exc()
            print(row["traceback"], flush=True)
        finally:
            model = fn = None  # noqa: F841
            free(dev)
        row["row_wall_s"] = time.perf_counter() - t0
        rows.append(row)
        print(f"  {method} {setting}: {row.get('status')} budget {row.get('budget', 0) / MiB:.1f} MiB peak {row.get('measured_peak', 0) / MiB:.1f} MiB "
              f"pred {row.get('predicted_peak', 0) / MiB:.1f} MiB time {row.get('step_s', 0) * 1e3:.1f} ms "
              f"err {row.get('max_grad_rel_err', float('nan')):.1e} ({row['row_wall_s']:.1f} s)", flush=True)
        return row

    def eager(model):
        return model, {}

    def ckpt(model):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return model, {}

    def ckpt_autocast(model):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

        def fn(**kw):
            with torch.autocast(dev.type, dtype=torch.bfloat16):
                return model(**kw)
        return fn, {}

    def ar(budget, precision="fp32"):
        def build(model):
            torch._dynamo.reset()
            t = time.perf_counter()
            om = autoremat.optimize(model, budget=int(budget), example_inputs=ex, optimizer=None,
                                    time_limit=a.time_limit, precision=precision, compiler="eager")
            p = om.plan
            picked = [d for pick in p.precision.get("dtypes", []) for d in pick.values()]
            return om, dict(budget=int(budget), predicted_peak=p.predicted_peak, no_recompute_budget=p.no_recompute_budget,
                            fixed=p.predicted_peak - p.activation_peak, predicted_overhead=p.overhead,
                            solver_status=p.solver.get("status"), num_graphs=om.num_graphs,
                            plan_s=time.perf_counter() - t, bf16_calls=picked.count("bf16"),
                            fp16_calls=picked.count("fp16"),
                            precision={k: v for k, v in p.precision.items() if k != "calls"})
        return build

    run_row("eager", "-", eager)
    ck = run_row("checkpoint", "every block", ckpt)

    def floor_of(precision: str) -> int | None:
        """The smallest feasible budget, from the BudgetError of budget=1."""
        if time.perf_counter() - t_start > a.max_seconds:
            return None
        found = None
        t = time.perf_counter()
        try:
            free(dev)
            autoremat.optimize(copy.deepcopy(pristine).to(dev), budget=1, example_inputs=ex, optimizer=None,
                               time_limit=a.time_limit, precision=precision, compiler="eager")
        except autoremat.BudgetError as e:
            found = e.smallest_budget
        except Exception:  # noqa: BLE001
            print(traceback.format_exc(), flush=True)
        free(dev)
        print(f"  smallest feasible budget ({precision}): {found} ({time.perf_counter() - t:.1f} s)", flush=True)
        return found

    smallest = floor_of("fp32")

    if smallest:
        first = run_row("autoremat", "smallest", ar(smallest), smallest)
        if first.get("status") == "ok":
            no_recompute = first["no_recompute_budget"]
            mid = (smallest + no_recompute) // 2
            run_row("autoremat", "midpoint", ar(mid), mid)
            run_row("autoremat", "no-recompute total", ar(no_recompute), no_recompute)
        if ck.get("status") == "ok":
            run_row("autoremat", "@ checkpoint's peak", ar(ck["measured_peak"]), ck["measured_peak"])

    # mixed precision (issue 3): autocast(bf16) + checkpoint every block vs precision="auto" at its peak
    ca = run_row("autocast bf16 + checkpoint", "every block", ckpt_autocast)
    if ca.get("status") == "ok":
        run_row("autoremat", "precision=auto @ autocast+ckpt's peak", ar(ca["measured_peak"], "auto"),
                ca["measured_peak"])
        # issue 14: every matmul-class call in bf16, at autocast + checkpoint's peak and at its own floor
        run_row("autoremat", "precision=bf16 @ autocast+ckpt's peak", ar(ca["measured_peak"], "bf16"),
                ca["measured_peak"])
        bf16_floor = floor_of("bf16")
        if bf16_floor is not None:
            run_row("autoremat", "precision=bf16 @ its smallest budget", ar(bf16_floor, "bf16"), bf16_floor)

    # table
    by = {r["method"]: r for r in rows if r.get("status") == "ok" and r["method"] in ("eager", "checkpoint")}
    e_t = by.get("eager", {}).get("step_s")
    c_t = by.get("checkpoint", {}).get("step_s")
    e_p = by.get("eager", {}).get("measured_peak")
    lines = ["| method | setting | budget (MiB) | measured peak (MiB) | peak / budget | predicted (MiB) | "
             "measured / predicted | peak vs eager | step (ms) | vs eager | vs checkpoint | max grad rel err |",
             "|" + "---|" * 12]

    def f(x, spec):
        return format(x, spec) if x is not None else ""

    for r in rows:
        if r.get("status") != "ok":
            extra = f" (smallest {r['smallest_budget'] / MiB:.1f} MiB)" if r.get("smallest_budget") else ""
            lines.append(f"| {r['method']} | {r['setting']} | {f(r.get('budget') and r['budget'] / MiB, '.1f')} | "
                         f"{r['status']}{extra} |||||||||")
            continue
        mp, b, pp = r["measured_peak"], r.get("budget"), r.get("predicted_peak")
        lines.append(
            f"| {r['method']} | {r['setting']} | {f(b and b / MiB, '.1f')} | {mp / MiB:.1f} | "
            f"{f(b and mp / b, '.3f')} | {f(pp and pp / MiB, '.1f')} | {f(pp and mp / pp, '.3f')} | "
            f"{f(e_p and mp / e_p, '.3f')} | {r['step_s'] * 1e3:.1f} | {f(e_t and r['step_s'] / e_t, '.3f')} | "
            f"{f(c_t and r['step_s'] / c_t, '.3f')} | {r['max_grad_rel_err']:.1e} |")
    over = [r for r in rows if r.get("status") == "ok" and r.get("budget") and r["measured_peak"] > r["budget"]]
    wall = time.perf_counter() - t_start
    text = (f"# autoremat GPU check on {name}\n\n"
            f"Command: `python benchmarks/gpu_check.py {' '.join(sys.argv[1:])}`, "
            f"{datetime.datetime.now().isoformat(timespec='seconds')}, torch {torch.__version__}, wall {wall:.0f} s. "
            f"Model: HF GPT-2 {cfg}, fp32. Peak: {rows[0].get('measure_method', '?')}; step = forward + backward, "
            f"no optimizer, grads allocated by a warm-up step; step time median of {a.steps}. Grad error: max over "
            f"parameters of ||g - g_eager|| / ||g_eager||, same seed before the forward.\n\n"
            + "\n".join(lines) + "\n\n"
            + (f"Budget exceeded by the measured peak in {len(over)} autoremat row(s): "
               + ", ".join(f"{r['setting']} ({r['measured_peak'] / r['budget']:.3f}x)" for r in over)
               if over else "No autoremat row exceeded its budget.") + "\n")
    print("\n" + text, flush=True)
    stem = f"gpu_check_{dev.type}{'_quick' if a.quick else ''}"
    (out_dir / f"{stem}.md").write_text(text)
    (out_dir / f"{stem}.json").write_text(json.dumps(dict(device=name, torch=torch.__version__, cfg=cfg,
                                                          wall_s=wall, rows=rows), indent=1, default=str))
    print(f"wrote {out_dir / stem}.md and .json", flush=True)


if __name__ == "__main__":
    main()
