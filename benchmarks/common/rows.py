"""The benchmarks' two row runners (part of the shared module `common`, which imports no script).

  Bench, Bench.run_row   a model's pristine copy and eager reference; remat_vs_peers.py's and speed.py's rows
                         (steady peak, median step time over eager's, gradient error), their log line, table
                         and timing noise
  run_row, floor_row     floor.py's rows (steady and first-step peaks, the median and noise of the paired
                         ratios to eager, gradient error), also run by loss_region.py and drift.py
"""

from __future__ import annotations

import copy
import gc
import statistics
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

import autoremat
from autoremat.measure import measure_peak

from .steps import (
    OUTPUTS,
    SEED,
    Build,
    MiB,
    ar_build,
    error_status,
    grad_errors,
    grads_of,
    make_step,
    paired_times,
    split,
    sync,
    to_device,
    zero,
)

# --------------------------------------------------------------------------------------------
# Bench: remat_vs_peers.py's and speed.py's rows


class Bench:
    """One model on one device: a pristine copy that every row deep-copies, and the eager reference (its own
    copy, never compiled: the gradients every row is compared with and the timing partner of every row)."""

    def __init__(self, cfg: dict, device: torch.device, n_steps: int, log: Callable[[str], None]) -> None:
        self.cfg, self.device, self.n, self.log = cfg, device, n_steps, log
        torch.manual_seed(0)
        model, ex = cfg["factory"](**cfg["kwargs"])
        self.pristine = model.to(device).train()
        self.ex = to_device(ex, device)
        self.args, self.kwargs = split(self.ex)
        self.eager = copy.deepcopy(self.pristine)
        self.eager_step = make_step(self.eager, self.args, self.kwargs)
        zero(self.eager)
        torch.manual_seed(SEED)
        self.eager_step()
        self.ref_grads = grads_of(self.eager)
        self.eager_step()  # warm

    def fresh(self) -> torch.nn.Module:
        return copy.deepcopy(self.pristine)

    def run_row(self, method: str, setting: str, build: Build, extra: dict | None = None,
                retry: Callable[[int], Build] | None = None) -> dict:
        """remat_vs_peers.py's row: steady peak, median step time over eager's, gradient error. `retry(budget)`
        builds the row again at a BudgetError's smallest_budget, once."""
        row = dict(model=self.cfg["name"], method=method, setting=setting, device=str(self.device))
        row.update(extra or {})
        row["budget_asked"] = getattr(build, "budget", None)
        t0 = time.perf_counter()
        try:
            model = self.fresh()
            fn, info = build(model)
            row.update(info)
            step = make_step(fn, self.args, self.kwargs)
            # warm-up (compiles where it has not yet), without zeroing: grads exist from now on
            step()
            sync(self.device)
            _, m = measure_peak(step, device=self.device, baseline_objs=(model, self.ex))
            row["measured_peak"] = m.peak_bytes
            row["measure_method"] = m.method
            # timing: each row step right after an eager step
            rt, et = paired_times(self.eager_step, step, self.n, lambda: sync(self.device))
            row["step_s"] = statistics.median(rt)
            row["eager_step_s"] = statistics.median(et)
            row["step_vs_eager"] = row["step_s"] / row["eager_step_s"]
            row["step_samples_s"] = rt
            row["eager_samples_s"] = et
            # gradients of one step from zero, same seed as the eager reference
            zero(model)
            torch.manual_seed(SEED)
            step()
            row.update(grad_errors(grads_of(model), self.ref_grads))
            row["status"] = "ok"
        except autoremat.BudgetError as e:
            row["status"] = "infeasible"
            row["smallest_budget"] = e.smallest_budget
            if retry is not None and e.smallest_budget and e.smallest_budget > row.get("budget_asked", 0):
                # autoremat's smallest_budget is not always feasible on a second try (it moved by ~2 KB
                # here: scratch calibration differs between runs): retry once at the new figure, and say so
                self.log(f"  {fmt_row_line({**row, 'row_wall_s': time.perf_counter() - t0})}; retrying at "
                         f"the BudgetError's smallest_budget {e.smallest_budget}")
                again = self.run_row(method, setting + f" (retried at {e.smallest_budget / MiB:.2f} MiB)",
                                     retry(e.smallest_budget), extra)
                again["retried_from"] = {"budget": row.get("budget_asked"), "smallest_budget": e.smallest_budget}
                return again
        except Exception as e:  # noqa: BLE001 - a failing row is reported, not fatal
            row["status"] = error_status(e)
            row["traceback"] = traceback.format_exc()
            self.log(row["traceback"])
        finally:
            fn = model = step = None  # noqa: F841
            gc.collect()
            torch._dynamo.reset()
        row["row_wall_s"] = time.perf_counter() - t0
        self.log(fmt_row_line(row))
        return row


def fmt_row_line(r: dict) -> str:
    """Bench.run_row's log line."""
    if r["status"] != "ok":
        return f"  {r['model']:6} {r['method']:22} {r['setting']:18} {r['status']} ({r['row_wall_s']:.1f}s)"
    pp = f" pred {r['predicted_peak'] / MiB:8.1f}" if "predicted_peak" in r else ""
    return (f"  {r['model']:6} {r['method']:22} {r['setting']:18} peak {r['measured_peak'] / MiB:8.1f} MiB{pp}"
            f"  time x{r['step_vs_eager']:.3f}  grad err {r['grad_rel_err']:.2e} (worst parameter "
            f"{r['worst_param_rel_err']:.1e})  ({r['row_wall_s']:.1f}s)")


def table(rows: list[dict]) -> str:
    """Bench.run_row's rows as a markdown table, peaks also relative to the eager row of their model. Beside
    each row's gradient error, its model's checkpoint row's: checkpointing recomputes the same mathematics, so
    its error against eager is the rounding noise of this device and model, the floor any row can reach."""
    head = ("| model | method | setting | measured peak (MiB) | peak vs eager | step time vs eager | "
            "grad rel err | checkpoint's grad rel err | predicted peak (MiB) |")
    lines = [head, "|" + "---|" * 9]
    eager_peak = {(r["model"], r["device"]): r["measured_peak"] for r in rows
                  if r["method"] == "eager" and r["status"] == "ok"}
    noise = {(r["model"], r["device"]): r["grad_rel_err"] for r in rows
             if r["method"] == "checkpoint" and r["status"] == "ok"}
    for r in rows:
        pred = f"{r['predicted_peak'] / MiB:.1f}" if r.get("predicted_peak") is not None else ""
        if r["status"] == "ok":
            ep = eager_peak.get((r["model"], r["device"]))
            nf = noise.get((r["model"], r["device"]))
            errs = f"{r['grad_rel_err']:.1e} | {'' if nf is None else f'{nf:.1e}'}"
            lines.append(
                f"| {r['model']} | {r['method']} | {r['setting']} | {r['measured_peak'] / MiB:.1f} | "
                f"{r['measured_peak'] / ep:.3f} | {r['step_vs_eager']:.3f} | {errs} | {pred} |"
                if ep else f"| {r['model']} | {r['method']} | {r['setting']} | {r['measured_peak'] / MiB:.1f} | | "
                f"{r['step_vs_eager']:.3f} | {errs} | {pred} |")
        elif r["status"] == "infeasible":
            sb = r.get("smallest_budget")
            note = f"infeasible (BudgetError: smallest {sb / MiB:.1f} MiB)" if sb else "infeasible (BudgetError)"
            lines.append(f"| {r['model']} | {r['method']} | {r['setting']} | {note} | | | | | |")
        else:
            lines.append(f"| {r['model']} | {r['method']} | {r['setting']} | {r['status']} | | | | | |")
    return "\n".join(lines)


def timing_noise(rows: list[dict]) -> dict:
    """Relative spread of the eager steps paired with every row: (p90 - p10) / median / 2, per model/device."""
    out = {}
    for key in {(r["model"], r["device"]) for r in rows}:
        samples = [s for r in rows if (r["model"], r["device"]) == key and r["status"] == "ok"
                   for s in r["eager_samples_s"]]
        if len(samples) >= 5:
            q = statistics.quantiles(samples, n=10)
            out[key] = (q[-1] - q[0]) / statistics.median(samples) / 2
    return out


# --------------------------------------------------------------------------------------------
# floor.py's rows


def run_row(bench: Bench, method: str, setting: str, build: Build) -> dict:
    """floor.py's row: steady-state and first-micro-step peaks, the median and noise of the paired ratios to
    eager, gradient error. build(model) -> (callable, info); its first call (compilation) happens in build or
    in the warm-up."""
    row = dict(model=bench.cfg["name"], method=method, setting=setting, budget=getattr(build, "budget", None))
    t0 = time.perf_counter()
    model = fn = step = None
    try:
        model = bench.fresh()
        fn, info = build(model)
        row.update(info)
        step = make_step(fn, bench.args, bench.kwargs)
        step()  # warm-up (compiles where not yet): every .grad exists from now on
        sync(bench.device)
        _, steady = measure_peak(step, device=bench.device, baseline_objs=(model, bench.ex))
        row["steady_peak"] = steady.peak_bytes
        rt, et = paired_times(bench.eager_step, step, bench.n, lambda: sync(bench.device))
        ratios = [r / e for r, e in zip(rt, et)]
        q1, _, q3 = statistics.quantiles(ratios, n=4)
        row.update(step_s=rt, eager_step_s=et, time_vs_eager=statistics.median(ratios),
                   time_noise=(q3 - q1) / 2)
        # the first micro-step: no .grad before it; the same seed as the eager reference, for the gradients
        zero(model)
        torch.manual_seed(SEED)
        _, first = measure_peak(step, device=bench.device, baseline_objs=(model, bench.ex))
        row["first_step_peak"] = first.peak_bytes
        row.update(grad_errors(grads_of(model), bench.ref_grads))
        if row.get("predicted_peak"):
            row["predicted_vs_measured"] = row["predicted_peak"] / row["steady_peak"]
        row["status"] = "ok"
    except autoremat.BudgetError as e:
        row.update(status="infeasible", smallest_budget=e.smallest_budget)
    except Exception as e:  # noqa: BLE001 - a failing row is reported, not fatal
        row.update(error_fields(e))
    finally:
        model = fn = step = None  # noqa: F841 - free this row's model before the next one
        gc.collect()
        torch._dynamo.reset()
    row["row_wall_s"] = time.perf_counter() - t0
    print("  " + row_line(row), flush=True)
    return row


def error_fields(e: Exception) -> dict:
    print(traceback.format_exc(), flush=True)
    return dict(status=error_status(e), traceback=traceback.format_exc())


def mib(b) -> str:
    return f"{b / MiB:.2f}" if b is not None else ""


def row_line(r: dict) -> str:
    """run_row's log line."""
    if r["status"] != "ok":
        return f"{r['model']:6} {r['method']:10} {r['setting']:16} {r['status']} ({r.get('row_wall_s', 0):.0f}s)"
    return (f"{r['model']:6} {r['method']:10} {r['setting']:16} steady {mib(r['steady_peak'])} MiB, first "
            f"{mib(r['first_step_peak'])} MiB, time x{r['time_vs_eager']:.3f}±{r['time_noise']:.3f}, "
            f"grad err {r['grad_rel_err']:.1e}, pred {mib(r.get('predicted_peak')) or '-'} ({r['row_wall_s']:.0f}s)")


def smallest_budget(bench: Bench, compiler: str = "eager") -> int:
    """BudgetError.smallest_budget of autoremat.optimize at budget=1."""
    torch._dynamo.reset()
    return floor_of(lambda: autoremat.optimize(bench.fresh(), budget=1, example_inputs=bench.ex, optimizer=None,
                                               outputs=OUTPUTS, compiler=compiler))


def floor_of(plan_at_one_byte: Callable[[], Any]) -> int:
    """The smallest budget the BudgetError of `plan_at_one_byte()` (an optimize call at budget=1) names."""
    try:
        plan_at_one_byte()
    except autoremat.BudgetError as e:
        if e.smallest_budget is None:
            raise
        return e.smallest_budget
    finally:
        torch._dynamo.reset()
    raise RuntimeError("autoremat.optimize at budget=1 did not raise BudgetError")


def floor_row(bench: Bench) -> dict:
    """floor.py's "autoremat floor" row: run_row at smallest_budget, retried once where it moved."""
    try:
        first = smallest_budget(bench)
    except Exception as e:  # noqa: BLE001 - reported in the row
        return dict(model=bench.cfg["name"], method="autoremat", setting="floor", **error_fields(e))
    row = run_row(bench, "autoremat", "floor", ar_build(first, bench.ex, OUTPUTS))
    if row["status"] == "infeasible" and row.get("smallest_budget"):
        # verification at planning time can move the floor up (a measured peak above the prediction): retry
        # once at the figure that BudgetError names, and record both
        again = run_row(bench, "autoremat", "floor (retried)", ar_build(row["smallest_budget"], bench.ex, OUTPUTS))
        again["retried_from"] = dict(budget=first, smallest_budget=row["smallest_budget"])
        return again
    return row
