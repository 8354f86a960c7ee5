"""autoremat's mixed precision vs torch.autocast(bf16) + checkpointing, at equal memory budgets.

One model (examples.models.transformer_stack, dropout on), one process, these rows:
  fp32 eager                    plain PyTorch in fp32: the reference for loss, gradients and time
  autocast(bf16) + ckpt         torch.autocast(bf16) around the forward (backward outside it) and
                                torch.utils.checkpoint (non-reentrant) around every block's forward
  autoremat precision=auto      autoremat.optimize(..., precision="auto") at budget B
  autoremat precision=bf16      the same with precision="bf16"
  autoremat precision=fp32      the same with precision="fp32" ("does not fit" if BudgetError)
where B = the measured peak of the autocast + checkpoint row (equal budget).

Per row: measured peak of one training step (forward + backward, optimizer=None) after a warm-up
step; for autoremat rows the plan's predicted peak; loss and gradient relative error vs fp32 eager
(gradients as one vector over all parameters; torch.manual_seed before every forward); how many
calls ran in bf16 / fp16 / fp32; and the *predicted* GPU step time on an H100 and an H200 from
autoremat's roofline table (autoremat.model.devices), as a ratio to fp32 eager's predicted time. On CUDA
the step time is also measured (median of paired steps); on CPU it is not (bf16 is emulated there).

    python benchmarks/precision_vs_autocast.py            # 4 layers, d=64 (~2 min on a 2-core CPU)
    python benchmarks/precision_vs_autocast.py --quick    # 2 layers, d=32

Writes benchmarks/results/precision_vs_autocast_<device>[_quick].md and .json.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

REPO = Path(__file__).resolve().parent.parent
sys.path.append(str(REPO))  # for `examples`; appended so that PYTHONPATH can pick another autoremat

from common import paired_times  # noqa: E402  # benchmarks/common/ (this script's folder is on sys.path)

import autoremat  # noqa: E402
from autoremat.measure import grad_rel_err, live_tensor_bytes, measure_peak  # noqa: E402
from examples.models import loss_of, transformer_stack  # noqa: E402

MiB = 2**20
SEED = 1234
HUGE = 10**12  # a budget nothing reaches: no recomputation
CKPT_FACTOR = 4 / 3  # checkpointing every block runs each forward twice; forward ~ 1/3 of forward + backward
TIME_DEVICES = ("h100", "h200")


def config(quick: bool) -> dict:
    if quick:
        return dict(n_layer=2, d=32, n_head=4, seq=32, batch=2, dropout=0.1)
    return dict(n_layer=4, d=64, n_head=4, seq=64, batch=4, dropout=0.1)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def zero(model: torch.nn.Module) -> None:
    for p in model.parameters():
        p.grad = None


def flat_grads(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).detach().double().flatten()
                      for p in model.parameters() if p.requires_grad])


rel = grad_rel_err  # ||x - ref|| / ||ref||, of the loss as of the concatenated gradients


def make_step(fn, ex: tuple, autocast_on: torch.device | None = None):
    """One training step: forward (under autocast if asked) and backward outside autocast; returns the loss."""
    def step() -> torch.Tensor:
        amp = torch.autocast(autocast_on.type, dtype=torch.bfloat16) if autocast_on is not None \
            else contextlib.nullcontext()
        with amp:
            loss = loss_of(fn(*ex))
        loss.backward()
        return loss.detach()
    return step


MATMUL_OPS = {"mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "addbmm", "addmv", "mv", "dot",
              "convolution", "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention"}


class _CountMatmuls(TorchDispatchMode):
    """Counts matmul-class ATen calls by the dtype they compute in (below autocast, so casts are seen)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts = {"bf16": 0, "fp16": 0, "fp32": 0}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in MATMUL_OPS:
            dts = {a.dtype for a in torch.utils._pytree.tree_leaves((args, kwargs or {}))
                   if isinstance(a, torch.Tensor) and a.is_floating_point()}
            key = "bf16" if torch.bfloat16 in dts else "fp16" if torch.float16 in dts else "fp32"
            self.counts[key] += 1
        return func(*args, **(kwargs or {}))


def eager_call_counts(model, ex, device, autocast_on: bool) -> dict:
    amp = torch.autocast(device.type, dtype=torch.bfloat16) if autocast_on else contextlib.nullcontext()
    counter = _CountMatmuls()
    with torch.no_grad(), amp, counter:
        model(*ex)
    return counter.counts


def plan_call_counts(plan) -> dict | None:
    """bf16 / fp16 / fp32 among autoremat's castable calls (plan.precision['calls'] / ['dtypes'])."""
    p = plan.precision or {}
    picked = [d for pick in p.get("dtypes", []) for d in pick.values()]
    calls = len(p.get("calls", {})) or len(picked)
    if not calls:
        return None
    bf, fp = picked.count("bf16"), picked.count("fp16")
    return {"bf16": bf, "fp16": fp, "fp32": calls - bf - fp}


# --------------------------------------------------------------------------------------------
# predicted times (roofline, autoremat.model.devices), never measured


def predicted_reference_times(pristine, ex, dev_name: str, log) -> dict:
    """fp32 eager: forward_time_s of an fp32 plan with no recomputation. autocast + ckpt: forward_time_s of a
    bf16 plan with no recomputation, times CKPT_FACTOR (an estimate: one extra forward of every block)."""
    out = {}
    torch._dynamo.reset()
    om = autoremat.optimize(copy.deepcopy(pristine), budget=HUGE, example_inputs=ex, optimizer=None,
                            device=dev_name, verify=False, compiler="eager")
    out["fp32_eager_s"] = om.plan.forward_time_s
    out["fp32_recompute_s"] = om.plan.recompute_time_s
    out["fp32_no_recompute_predicted_peak"] = om.plan.predicted_peak
    del om
    torch._dynamo.reset()
    om = autoremat.optimize(copy.deepcopy(pristine), budget=HUGE, example_inputs=ex, optimizer=None,
                            precision="bf16", device=dev_name, verify=False, compiler="eager")
    out["bf16_no_recompute_s"] = om.plan.forward_time_s
    out["bf16_recompute_s"] = om.plan.recompute_time_s
    out["autocast_ckpt_s"] = om.plan.forward_time_s * CKPT_FACTOR
    out["bf16_no_recompute_predicted_peak"] = om.plan.predicted_peak
    del om
    torch._dynamo.reset()
    gc.collect()
    log(f"  predicted on {dev_name}: fp32 eager {out['fp32_eager_s'] * 1e6:.1f} us, bf16 (no recompute) "
        f"{out['bf16_no_recompute_s'] * 1e6:.1f} us, autocast+ckpt estimate {out['autocast_ckpt_s'] * 1e6:.1f} us")
    return out


def autoremat_time_only(pristine, ex, budget: int, precision: str, dev_name: str) -> dict:
    """Plan (no measurement) on `dev_name` for the time column."""
    torch._dynamo.reset()
    try:
        om = autoremat.optimize(copy.deepcopy(pristine), budget=budget, example_inputs=ex, optimizer=None,
                                precision=precision, device=dev_name, compiler="eager")
    except autoremat.BudgetError as e:
        return {"status": "does not fit", "smallest_budget": e.smallest_budget}
    except Exception as e:  # noqa: BLE001 - reported, not fatal
        return {"status": f"error: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}",
                "traceback": traceback.format_exc()}
    p = om.plan
    out = {"status": "ok", "forward_time_s": p.forward_time_s, "recompute_time_s": p.recompute_time_s,
           "step_s": p.forward_time_s + p.recompute_time_s, "predicted_peak": p.predicted_peak,
           "calls": plan_call_counts(p), "dtypes_chosen_by": (p.precision or {}).get("dtypes_chosen_by"),
           "notes": [n for n in p.notes if "precision" in n or "fp32" in n]}
    del om
    torch._dynamo.reset()
    gc.collect()
    return out


# --------------------------------------------------------------------------------------------
# the bench


class Bench:
    def __init__(self, cfg: dict, device: torch.device, plan_device: str, n_steps: int, log) -> None:
        self.device, self.plan_device, self.n, self.log = device, plan_device, n_steps, log
        torch.manual_seed(0)
        model, ex = transformer_stack(**cfg)
        self.pristine = model.to(device).train()
        self.ex = tuple(t.to(device) for t in ex)
        self.ref = copy.deepcopy(self.pristine)
        self.ref_step = make_step(self.ref, self.ex)
        zero(self.ref)
        torch.manual_seed(SEED)
        self.ref_loss = self.ref_step()
        self.ref_grads = flat_grads(self.ref)
        self.param_bytes = live_tensor_bytes(self.pristine)
        self.input_bytes = live_tensor_bytes(self.ex)

    def run_row(self, name: str, build, autocast: bool = False, extra: dict | None = None) -> dict:
        """build(model) -> (callable, info); the model is a fresh deep copy of the pristine one."""
        row = {"row": name, **(extra or {})}
        t0 = time.perf_counter()
        model = fn = step = None
        try:
            model = copy.deepcopy(self.pristine)
            fn, info = build(model)
            row.update(info)
            step = make_step(fn, self.ex, self.device if autocast else None)
            # the error step, from no gradients and the reference's seed; it is also the warm-up
            zero(model)
            torch.manual_seed(SEED)
            loss = step()
            sync(self.device)
            row["loss"] = loss.item()
            row["loss_rel_err"] = rel(loss, self.ref_loss)
            row["grad_rel_err"] = rel(flat_grads(model), self.ref_grads)
            # the measured step: gradients exist from the warm-up, as in every row
            _, m = measure_peak(step, device=self.device, baseline_objs=(model, self.ex))
            live = live_tensor_bytes(model, self.ex, device=self.device)
            row["measured_peak"] = live + m.delta_peak_bytes
            row["measured_baseline"] = live
            row["delta_peak"] = m.delta_peak_bytes
            row["measure_method"] = m.method
            if self.device.type == "cuda":
                row.update(self.time_vs_reference(step))
            row["status"] = "ok"
        except autoremat.BudgetError as e:
            row["status"] = "does not fit"
            row["smallest_budget"] = e.smallest_budget
        except Exception as e:  # noqa: BLE001 - a failing row is reported, not fatal
            row["status"] = f"error: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
            row["traceback"] = traceback.format_exc()
            self.log(row["traceback"])
        finally:
            model = fn = step = None  # noqa: F841
            gc.collect()
            torch._dynamo.reset()
        row["row_wall_s"] = time.perf_counter() - t0
        self.log(fmt_row_line(row))
        return row

    def time_vs_reference(self, step) -> dict:
        """CUDA only: median over n steps of the row's step, each paired with an fp32 eager step before it."""
        for _ in range(2):
            self.ref_step()
            step()
        rt, et = paired_times(self.ref_step, step, self.n, lambda: sync(self.device))
        ratios = [r / e for r, e in zip(rt, et)]
        return {"measured_step_s": statistics.median(rt), "measured_ref_step_s": statistics.median(et),
                "measured_time_vs_fp32": statistics.median(ratios), "step_samples_s": rt, "ref_samples_s": et}


def eager_build(model):
    return model, {}


def autocast_ckpt_build(model):
    from torch.utils.checkpoint import checkpoint

    for block in model.blocks:
        block.forward = (lambda f: (lambda *a, **k: checkpoint(f, *a, use_reentrant=False, **k)))(block.forward)
    return model, {}


def autoremat_build(budget: int, ex: tuple, precision: str, plan_device: str):
    def build(model):
        torch._dynamo.reset()
        om = autoremat.optimize(model, budget=budget, example_inputs=ex, optimizer=None, precision=precision,
                                device=plan_device, compiler="eager")
        p = om.plan
        prec = p.precision or {}
        info = {"budget": budget, "plan_device": plan_device, "predicted_peak": p.predicted_peak,
                "activation_peak": p.activation_peak, "ledger_fixed": p.predicted_peak - p.activation_peak,
                "forward_time_s": p.forward_time_s, "recompute_time_s": p.recompute_time_s,
                "calls": plan_call_counts(p), "needs_grad_scaler": p.needs_grad_scaler,
                "solver_status": p.solver.get("status"), "num_graphs": om.num_graphs,
                "dtypes_chosen_by": prec.get("dtypes_chosen_by"), "tolerance": prec.get("tolerance"),
                "error_estimate": prec.get("error_estimate"),
                "own_check": {k: prec[k] for k in ("loss_rel_err", "grad_rel_err", "autocast_loss_rel_err",
                                                   "autocast_grad_rel_err") if k in prec},
                "notes": list(p.notes)}
        return om, info
    return build


# --------------------------------------------------------------------------------------------
# output


def fmt_calls(c: dict | None) -> str:
    return f"{c['bf16']}/{c['fp16']}/{c['fp32']}" if c else "-"


def fmt_row_line(r: dict) -> str:
    if r["status"] != "ok":
        sb = f" (smallest budget {r['smallest_budget'] / MiB:.3f} MiB)" if r.get("smallest_budget") else ""
        return f"  {r['row']:28} {r['status']}{sb} ({r['row_wall_s']:.1f}s)"
    pp = f" pred {r['predicted_peak'] / MiB:.3f}" if "predicted_peak" in r else ""
    mt = f" time x{r['measured_time_vs_fp32']:.3f}" if "measured_time_vs_fp32" in r else ""
    return (f"  {r['row']:28} peak {r['measured_peak'] / MiB:.3f} MiB{pp}  loss err {r['loss_rel_err']:.2e}  "
            f"grad err {r['grad_rel_err']:.2e}  calls {fmt_calls(r.get('calls'))}{mt}  ({r['row_wall_s']:.1f}s)")


def table(rows: list[dict], cuda: bool) -> str:
    head = ["row", "measured peak (MiB)", "peak vs fp32 eager", "predicted peak (MiB)", "loss rel err",
            "grad rel err", "calls bf16/fp16/fp32"] + [f"predicted {d.upper()} time vs fp32 eager"
                                                        for d in TIME_DEVICES]
    if cuda:
        head.append("measured time vs fp32 eager")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    ref_peak = next((r["measured_peak"] for r in rows if r["row"] == "fp32 eager" and r["status"] == "ok"), None)
    for r in rows:
        times = []
        for d in TIME_DEVICES:
            t = r.get("predicted_time_vs_fp32", {}).get(d)
            times.append(f"{t:.3f}" if isinstance(t, float) else (t or ""))
        if r["status"] == "ok":
            cells = [r["row"], f"{r['measured_peak'] / MiB:.3f}",
                     f"{r['measured_peak'] / ref_peak:.3f}" if ref_peak else "",
                     f"{r['predicted_peak'] / MiB:.3f}" if r.get("predicted_peak") is not None else "",
                     f"{r['loss_rel_err']:.1e}", f"{r['grad_rel_err']:.1e}", fmt_calls(r.get("calls")), *times]
            if cuda:
                cells.append(f"{r['measured_time_vs_fp32']:.3f}" if "measured_time_vs_fp32" in r else "")
        else:
            sb = r.get("smallest_budget")
            what = f"does not fit (BudgetError: smallest budget {sb / MiB:.3f} MiB)" if r["status"] == "does not fit" \
                and sb else r["status"]
            cells = [r["row"], what, "", "", "", "", "", *times] + ([""] if cuda else [])
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def git_state() -> str:
    try:
        head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "autoremat"], capture_output=True,
                               text=True).stdout.strip()
        return head + (" (autoremat/ has uncommitted changes)" if dirty else "")
    except Exception:  # noqa: BLE001
        return "unknown"


# --------------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="2 layers, d=32, seq 32, batch 2")
    ap.add_argument("--device", default=None, help="where the steps run: cpu or cuda (default: cuda if available)")
    ap.add_argument("--plan-device", default="h100",
                    help="autoremat's device for the measured rows (roofline and allocator granularity); "
                         "default h100")
    ap.add_argument("--steps", type=int, default=5, help="CUDA only: timed steps per row (median), >= 5")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    a = ap.parse_args()
    torch.set_num_threads(1)
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    device = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cfg = config(a.quick)

    def log(s: str) -> None:
        print(s, flush=True)

    t_start = time.perf_counter()
    meta = dict(date=datetime.datetime.now().isoformat(timespec="seconds"), command=" ".join(sys.argv),
                quick=a.quick, torch=torch.__version__, threads=torch.get_num_threads(),
                python=platform.python_version(), machine=platform.processor() or platform.machine(),
                device=str(device), gpu=torch.cuda.get_device_name(device) if device.type == "cuda" else None,
                plan_device=a.plan_device, autoremat_file=autoremat.__file__, repo_git=git_state(), seed=SEED,
                config=cfg, ckpt_factor=CKPT_FACTOR)
    log(f"autoremat from {meta['autoremat_file']} (repo {meta['repo_git']}), torch {torch.__version__}, "
        f"{torch.get_num_threads()} thread, steps on {device}, model {cfg}")

    bench = Bench(cfg, device, a.plan_device, max(5, a.steps), log)
    rows = [bench.run_row("fp32 eager", eager_build),
            bench.run_row("autocast(bf16) + ckpt", autocast_ckpt_build, autocast=True)]
    # calls by dtype in eager rows: matmul-class ATen ops of one forward (checkpoint does not change them)
    rows[0]["calls"] = eager_call_counts(bench.ref, bench.ex, device, autocast_on=False)
    rows[1]["calls"] = eager_call_counts(bench.ref, bench.ex, device, autocast_on=True)
    if rows[1]["status"] != "ok":
        raise SystemExit("the autocast + checkpoint row failed: no budget to compare at")
    budget = int(rows[1]["measured_peak"])
    log(f"  budget B = measured peak of autocast(bf16) + ckpt = {budget} B ({budget / MiB:.3f} MiB)")
    precisions = ("auto", "bf16", "fp32")

    def ar_row(prec: str, b: int, label: str) -> dict:
        return bench.run_row(f"autoremat precision={prec}{label}", autoremat_build(b, bench.ex, prec, a.plan_device),
                             extra={"budget": b, "precision_mode": prec})

    for prec in precisions:
        rows.append(ar_row(prec, budget, ""))
    # When a 16-bit autoremat row does not fit at B, the same three rows again at B2: the smallest budget at which
    # both precision="auto" and precision="bf16" fit (from their BudgetErrors; retried once if it moved).
    budget2 = None
    missed = [r for r in rows if r.get("precision_mode") in ("auto", "bf16") and r["status"] == "does not fit"
              and r.get("smallest_budget")]
    if missed:
        budget2 = max(r["smallest_budget"] for r in missed)
        for attempt in range(2):
            log(f"  budget B2 = smallest budget at which autoremat fits in 16-bit = {budget2} B "
                f"({budget2 / MiB:.3f} MiB)")
            extra_rows = [ar_row(prec, budget2, " @ B2") for prec in ("auto", "bf16")]
            again = [r["smallest_budget"] for r in extra_rows if r["status"] == "does not fit"
                     and (r.get("smallest_budget") or 0) > budget2]
            if not again or attempt:
                break
            budget2 = max(again)
        rows += extra_rows + [ar_row("fp32", budget2, " @ B2")]

    # precision="fp32" plans carry no precision info: every castable call is fp32 there
    n_castable = next((sum(r["calls"].values()) for r in rows if r.get("precision_mode") and r.get("calls")), None)
    for r in rows:
        if r.get("precision_mode") == "fp32" and r["status"] == "ok" and not r.get("calls") and n_castable:
            r["calls"] = {"bf16": 0, "fp16": 0, "fp32": n_castable}

    # predicted step times, per device of the table: never measured
    predicted = {}
    time_only = {}
    for dev_name in TIME_DEVICES:
        predicted[dev_name] = predicted_reference_times(bench.pristine, bench.ex, dev_name, log)
        for r in rows:
            if "precision_mode" not in r:
                continue
            if dev_name == a.plan_device and not r["status"].startswith("error"):
                info = {"status": r["status"], "from": "the measured row's own plan"}
                if r["status"] == "ok":
                    info.update(step_s=r["forward_time_s"] + r["recompute_time_s"],
                                forward_time_s=r["forward_time_s"], recompute_time_s=r["recompute_time_s"],
                                predicted_peak=r["predicted_peak"], calls=r.get("calls"))
            else:
                info = autoremat_time_only(bench.pristine, bench.ex, r["budget"], r["precision_mode"], dev_name)
                if info.get("traceback"):
                    log(info["traceback"])
            if r["precision_mode"] == "fp32" and info["status"] == "ok" and not info.get("calls") and n_castable:
                info["calls"] = {"bf16": 0, "fp16": 0, "fp32": n_castable}
            time_only.setdefault(r["row"], {})[dev_name] = info
            log(f"  {r['row']} planned for {dev_name}: {info['status']}"
                + (f", predicted step {info['step_s'] * 1e6:.1f} us" if info["status"] == "ok" else ""))
    for r in rows:
        r["predicted_time_vs_fp32"] = {}
        r["predicted_step_s"] = {}
        for dev_name in TIME_DEVICES:
            ref = predicted[dev_name]["fp32_eager_s"]
            if r["row"] == "fp32 eager":
                t = ref
            elif r["row"].startswith("autocast"):
                t = predicted[dev_name]["autocast_ckpt_s"]
            else:
                info = time_only[r["row"]][dev_name]
                t = info["step_s"] if info["status"] == "ok" else None
                if t is None:
                    r["predicted_time_vs_fp32"][dev_name] = info["status"]
                    continue
            r["predicted_step_s"][dev_name] = t
            r["predicted_time_vs_fp32"][dev_name] = t / ref

    wall = time.perf_counter() - t_start
    md = table(rows, device.type == "cuda")
    fixed = next((r["ledger_fixed"] for r in rows if "ledger_fixed" in r), None)
    notes = []
    for r in rows:
        if "own_check" in r and r["own_check"]:
            oc = r["own_check"]
            notes.append(f"- {r['row']}: autoremat's own check on the example batch (plan.precision): loss "
                         f"{oc.get('loss_rel_err', float('nan')):.1e}, grads {oc.get('grad_rel_err', float('nan')):.1e}"
                         f"; torch.autocast bf16 (no checkpoint) {oc.get('autocast_loss_rel_err', float('nan')):.1e},"
                         f" {oc.get('autocast_grad_rel_err', float('nan')):.1e}"
                         + (f"; dtypes chosen by {r['dtypes_chosen_by']}" if r.get("dtypes_chosen_by") else "")
                         + (f"; tolerance {r['tolerance']:.2e}" if r.get("tolerance") is not None else ""))
        for n in r.get("notes", []):
            if "precision" in n or "fp32" in n or "re-planned" in n:
                notes.append(f"- {r['row']} note: {n}")
    for r in rows:
        for dev_name, info in time_only.get(r["row"], {}).items():
            if info["status"] == "ok" and r["status"] == "ok" and info.get("calls") != r.get("calls"):
                notes.append(f"- {r['row']}: planned for {dev_name} it picks calls {fmt_calls(info.get('calls'))} "
                             f"(vs {fmt_calls(r.get('calls'))} when planned for {a.plan_device})"
                             + "".join(f"; its note: {n}" for n in info.get("notes", [])))
    pp = predicted.get(a.plan_device) or predicted[TIME_DEVICES[0]]
    pred_line = "; ".join(f"{d.upper()}: fp32 eager {p['fp32_eager_s'] * 1e6:.1f} us, bf16 no-recompute "
                          f"{p['bf16_no_recompute_s'] * 1e6:.1f} us" for d, p in predicted.items())
    header = (
        f"# autoremat precision vs torch.autocast + checkpoint on {device}{' (--quick)' if a.quick else ''}\n\n"
        f"Command: `python benchmarks/precision_vs_autocast.py {' '.join(sys.argv[1:])}`, {meta['date']}, "
        f"torch {torch.__version__}, {torch.get_num_threads()} thread, {meta['machine']}, repo {meta['repo_git']}, "
        f"wall {wall:.0f} s.\n\n"
        f"Model: examples.models.transformer_stack {cfg} (dropout on). Step = forward + backward of one "
        f"micro-batch, optimizer=None.\n\n"
        f"**Budget B = {budget} B ({budget / MiB:.3f} MiB) = the measured peak of the autocast(bf16) + ckpt row**; "
        f"every autoremat row is `autoremat.optimize(copy, budget=B, example_inputs=ex, optimizer=None, "
        f"precision=..., device=\"{a.plan_device}\")` (the plan's device sets the roofline that precision='auto' "
        f"trades speed against, and a 512 B allocator granularity in the ledger; the step still runs on {device}). "
        + (f"Rows marked **@ B2** are an addition, run because a 16-bit autoremat row did not fit at B: the same "
           f"rows at B2 = {budget2} B ({budget2 / MiB:.3f} MiB), the smallest budget at which both precision='auto' "
           f"and precision='bf16' fit (from their BudgetError.smallest_budget). " if budget2 else "")
        + (f"autoremat's ledger puts the fixed part (parameters + gradients + inputs, rounded to 512 B blocks) at "
           f"{fixed} B, against {rows[0].get('measured_baseline', 0)} B live here. " if fixed else "")
        + (f"For scale (not a like-for-like check: the traced graph is not eager's autograd graph): autoremat predicts {pp['fp32_no_recompute_predicted_peak'] / MiB:.3f} "
           f"MiB for the fp32 step with no recompute (measured fp32 eager: {rows[0]['measured_peak'] / MiB:.3f} MiB) "
           f"and {pp['bf16_no_recompute_predicted_peak'] / MiB:.3f} MiB for precision='bf16' with no recompute "
           f"(planned for {a.plan_device}).\n\n" if rows[0]["status"] == "ok" else "\n\n")
        + f"**Measured peak** (every row alike) = live bytes of the model's parameters + gradients + the inputs "
        f"before the step + `autoremat.measure.measure_peak(step).delta_peak_bytes` "
        f"({rows[0].get('measure_method', '?')}), for one step after a warm-up step (gradients already allocated). "
        f"Loss / grad rel err: |loss - loss_ref| / |loss_ref| and ||g - g_ref|| / ||g_ref|| with all parameter "
        f"gradients concatenated, vs the fp32 eager row, `torch.manual_seed({SEED})` before each forward, from "
        f"zero gradients. Calls bf16/fp16/fp32: autoremat rows count the castable calls of the traced graphs "
        f"(plan.precision['calls'] and ['dtypes']); the eager rows count matmul-class ATen ops of one forward "
        f"by the dtype they compute in (autocast's own op list decides there).\n\n"
        f"**Predicted times are not measured**: they come from autoremat's roofline table (autoremat.model.devices, "
        f"datasheet peaks). fp32 eager = `plan.forward_time_s` of an fp32 plan at budget 10**12 (no recompute); "
        f"autoremat rows = `forward_time_s + recompute_time_s` of the row planned for that device at budget B "
        f"(the {a.plan_device} column is the measured row's own plan; the other device is planned again at the same "
        f"budget, time only); **autocast + ckpt is an estimate**: `forward_time_s` of a precision='bf16' plan at "
        f"budget 10**12 x {CKPT_FACTOR:.4f} (one extra forward of every block, taking the forward as 1/3 of "
        f"forward + backward); it also ignores that autocast re-casts the weights. Predicted absolute: {pred_line}."
        + (" On CUDA the measured time column is the median over "
           f"{max(5, a.steps)} steps of (row step / the fp32 eager step run just before it)."
           if device.type == "cuda" else " Step time is not measured on CPU (bf16 is emulated there).")
        + "\n")
    text = header + "\n" + md + "\n" + ("\nNotes:\n" + "\n".join(notes) + "\n" if notes else "")
    log("\n" + text)
    out_dir = Path(a.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"precision_vs_autocast_{device.type}{'_quick' if a.quick else ''}"
    (out_dir / f"{stem}.md").write_text(text)
    (out_dir / f"{stem}.json").write_text(json.dumps(
        dict(meta=meta, wall_s=wall, budget=budget, budget2=budget2, predicted_reference=predicted, time_only_plans=time_only,
             rows=rows), indent=1, default=str))
    log(f"wrote {out_dir / stem}.md and .json")


if __name__ == "__main__":
    main()
