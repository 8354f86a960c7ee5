"""autoremat with Inductor vs torch.compile with Inductor, side by side in one process.

Rows, per model (a transformer stack and a small HF GPT-2), with dropout on and with dropout off:
  eager                        plain PyTorch: the reference for time and gradients
  inductor amb=b               torch.compile(backend="inductor") under
                               torch._functorch.config.activation_memory_budget = b, b in 1.0 / 0.5 / 0.1
  autoremat-inductor @ peer    autoremat.optimize(compiler="inductor") with budget = that row's measured peak
  autoremat-inductor grid i    autoremat.optimize(compiler="inductor") on evenly spaced budgets from the
                               smallest feasible one to the no-recompute total
  ablation: ... regions=True   (--with-cut) each at-peer row planned again with regions=True: one graph
                               per repeated block always, where the default (regions="auto") may run one
                               graph (pipeline.one_graph_if_free); not part of the goal check
  autoremat-inductor, no limit (--with-cut) at 4x the no-recompute total, where "auto" may take one
                               graph, and its regions=True ablation

GPT-2's autoremat rows pass outputs="loss": the step below reads only the loss and drops the logits
(for Inductor's rows they die when the forward returns), which is what that option tells the planner
(docs/python-api.md); with the default outputs="all" the plan would hold them through the backward.

Each row: measured peak of one training step (forward + backward, no optimizer, gradients already
allocated by a warm-up step), step time relative to eager (median of N steps, each paired with an
eager step right before it: benchmarks/common/), and the largest relative gradient error vs eager
(the same seed before each forward). With dropout on, Inductor draws its own random numbers, so
the error column says how far the compiled step's gradients are from eager's, not a bug; with dropout
off the error is rounding only and the time comparison is like for like.

Goal checked: at every memory level autoremat's step time is at most that of every Inductor row whose
measured peak is at or below it (per model and dropout setting). Each such pair, and each at-peer row
with its Inductor row, is timed head-to-head after the rows (common.head_to_head: alternating pairs, no
eager step between, a 90% bootstrap interval of the median ratio); the two rows' ratios to eager were
taken minutes apart and drift (benchmarks/drift.py), so they are context only.

    python benchmarks/speed.py            # ~30 min on a 2-core CPU (Inductor compiles every row)
    python benchmarks/speed.py --quick    # smaller models

Writes benchmarks/results/speed_cpu[_quick].md and .json.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from common import (
    REPO,
    Bench,
    MiB,
    compiled_graphs,
    eager_build,
    error_status,
    git_state,
    head_to_head,
    inductor_build,
    inductor_limits,
    make_step,
    speed_configs,
    sync,
    table,
    timing_noise,
)

import autoremat
from autoremat.measure import measure_peak

AMB = (1.0, 0.5, 0.1)
AT_PEER, GRID, ROOMY = "autoremat-inductor @ peer", "autoremat-inductor grid", "autoremat-inductor, no limit"
JUDGED = (AT_PEER, GRID, ROOMY)  # the default autoremat rows: the goal compares each with the Inductor rows


def model_line(cfg: dict) -> str:
    extra = f", autoremat outputs={cfg['outputs']!r}" if "outputs" in cfg else ""
    return f"{cfg['name']}: {cfg['kwargs']}{extra}"


def ar_build(budget: int, ex, regions: bool | str = "auto", outputs: str = "all", plan=None, reset: bool = True):
    """autoremat with Inductor at `budget`; with `plan`, that plan applied again (no solve). The row's
    "_plan" is the plan it ran: the head-to-head phase rebuilds the same program from it, with reset=False
    so that the Inductor model it is timed against keeps its compiled code."""
    def build(model):
        if reset:
            torch._dynamo.reset()
        om = autoremat.optimize(model, budget=int(budget), example_inputs=ex, optimizer=None, compiler="inductor",
                                progress=False, regions=regions, outputs=outputs, plan=plan)
        p = om.plan
        info = dict(budget=int(budget), predicted_peak=p.predicted_peak, activation_peak=p.activation_peak,
                    predicted_overhead=p.overhead, num_graphs=om.num_graphs, regions=p.regions,
                    solver_status=p.solver.get("status"),
                    planning_s=p.compiler.get("planning_s"), compile_s=p.compiler.get("inductor_compile_s"),
                    verify_notes=[n for n in p.notes if "verified" in n or "re-planned" in n], _plan=p)
        return om, info
    build.budget = int(budget)
    return build


CUT = "ablation: autoremat-inductor @ peer, regions=True"  # always one graph per block; not in the goal
CUT_ROOMY = "ablation: autoremat-inductor, no limit, regions=True"


def bench_model(cfg: dict, tag: str, n_steps: int, n_grid: int, n_pairs: int, log, with_cut: bool = False
                ) -> tuple[list[dict], dict, list[dict]]:
    """The rows of one model and dropout setting, its autoremat limits, and its head-to-head comparisons."""
    log(f"== {cfg['name']} ({tag}): {cfg['kwargs']}")
    bench = Bench(cfg, torch.device("cpu"), n_steps, log)
    extra = {"dropout": tag}
    rows = [bench.run_row("eager", "-", eager_build, extra)]
    for b in AMB:
        rows.append(bench.run_row("inductor", f"amb={b}", inductor_build(b, bench.args, bench.kwargs), extra))
    out = cfg.get("outputs", "all")
    lo, hi, fixed = inductor_limits(bench, out)
    log(f"  autoremat-inductor limits: smallest {lo / MiB:.2f} MiB, no-recompute {hi / MiB:.2f} MiB")
    for p in list(rows):
        if p["method"] == "inductor" and p["status"] == "ok":
            budget = p["measured_peak"]
            rows.append(bench.run_row(AT_PEER, f"{p['setting']}: {budget / MiB:.2f} MiB",
                                      ar_build(budget, bench.ex, outputs=out), extra))
            if with_cut:
                rows.append(bench.run_row(CUT, f"{p['setting']}: {budget / MiB:.2f} MiB",
                                          ar_build(budget, bench.ex, regions=True, outputs=out), extra))
    if with_cut:  # where nothing is recomputed either way: regions="auto" runs one graph
        roomy = 4 * hi
        rows.append(bench.run_row(ROOMY, f"{roomy / MiB:.2f} MiB (4x the no-recompute total)",
                                  ar_build(roomy, bench.ex, outputs=out), extra))
        rows.append(bench.run_row(CUT_ROOMY, f"{roomy / MiB:.2f} MiB (4x the no-recompute total)",
                                  ar_build(roomy, bench.ex, regions=True, outputs=out), extra))
    for i in range(n_grid):
        budget = int(lo + (hi - lo) * i / (n_grid - 1)) if n_grid > 1 else hi
        retry = (lambda b: ar_build(b, bench.ex, outputs=out)) if i == 0 else None
        rows.append(bench.run_row(GRID, f"{i}: {budget / MiB:.2f} MiB",
                                  ar_build(budget, bench.ex, outputs=out), extra, retry=retry))
    for r in rows:  # the goal compares within one model and dropout setting
        r["model"] = f"{cfg['name']} ({tag})"
    plans = {i: r.pop("_plan") for i, r in enumerate(rows) if "_plan" in r}  # a Plan: not for the JSON
    log(f"  head-to-head, {n_pairs} pairs each:")
    pairs = time_head_to_head(bench, rows, plans, out, n_pairs, log)
    return rows, {"smallest": lo, "no_recompute": hi, "fixed": fixed}, pairs


def goal_compares(a: dict, p: dict) -> bool:
    """The goal compares autoremat row `a` with Inductor row `p` (same model) when p's peak is at or below a's."""
    return p["measured_peak"] <= a["measured_peak"]


def comparisons(rows: list[dict]) -> dict[int, list[int]]:
    """Inductor row index -> the autoremat rows to time against it head-to-head: each at-peer row against the
    row whose peak it was planned at (the equal-memory table), and every pair the goal compares (an
    autoremat row and an Inductor row whose measured peak is at or below it)."""
    ok = [i for i, r in enumerate(rows) if r["status"] == "ok"]
    out: dict[int, list[int]] = {}
    for p in (i for i in ok if rows[i]["method"] == "inductor"):
        for a in (i for i in ok if rows[i]["method"] in JUDGED):
            at_peer = rows[a]["method"] == AT_PEER and rows[a]["setting"].split(":")[0] == rows[p]["setting"]
            if at_peer or goal_compares(rows[a], rows[p]):
                out.setdefault(p, []).append(a)
    return out


def same_program(bench: Bench, step, model, row: dict, num_graphs: int | None = None) -> None:
    """The rebuilt model must be the program its row measured: the same peak (within 1%) and, for autoremat,
    as many graphs, or no comparison. `model` is the raw module, the baseline its row was measured on."""
    _, m = measure_peak(step, device=bench.device, baseline_objs=(model, bench.ex))
    if abs(m.peak_bytes - row["measured_peak"]) > 0.01 * row["measured_peak"]:
        raise RuntimeError(f"rebuilt {row['method']} {row['setting']} peaks at {m.peak_bytes / MiB:.2f} MiB, its row "
                           f"at {row['measured_peak'] / MiB:.2f} MiB: not the program the row measured")
    if num_graphs is not None and num_graphs != row.get("num_graphs"):
        raise RuntimeError(f"rebuilt {row['method']} {row['setting']} runs {num_graphs} graphs, its row "
                           f"{row.get('num_graphs')}: not the program the row measured")


def time_head_to_head(bench: Bench, rows: list[dict], plans: dict[int, object], outputs: str, n: int,
                      log) -> list[dict]:
    """Each comparison timed directly (common.head_to_head), not through two ratios to eager taken minutes
    apart (benchmarks/drift.py: such ratios drift). Each Inductor row is compiled again under its budget and
    each autoremat row rebuilt from its plan; both must measure their row's peak again, and nothing may
    compile while they are timed."""
    out = []
    for p, ars in comparisons(rows).items():
        peer = rows[p]
        amb = float(peer["setting"].removeprefix("amb="))
        torch._dynamo.reset()
        p_model = p_step = None
        try:
            p_raw = bench.fresh()
            p_model, _ = inductor_build(amb, bench.args, bench.kwargs)(p_raw)
            p_step = make_step(p_model, bench.args, bench.kwargs)
            same_program(bench, p_step, p_raw, peer)
            peer_error = None
        except Exception as e:  # noqa: BLE001 - reported on each of its comparisons
            peer_error = error_status(e)
        for a in ars:
            r = rows[a]
            res = dict(model=r["model"], autoremat_row=[r["method"], r["setting"]], inductor_row=peer["setting"],
                       status=peer_error)
            t0 = time.perf_counter()
            a_model = a_step = None
            try:
                if peer_error is None:
                    a_raw = bench.fresh()
                    # no dynamo reset: the peer keeps its compiled code (autoremat compiles a fresh code object)
                    a_model, _ = ar_build(r["budget"], bench.ex, outputs=outputs, plan=plans[a], reset=False)(a_raw)
                    a_step = make_step(a_model, bench.args, bench.kwargs)
                    a_step()  # as in its row: measured with every .grad already allocated
                    same_program(bench, a_step, a_raw, r, num_graphs=a_model.num_graphs)
                    before = compiled_graphs()
                    p_step()  # the peer, after the rebuild: nothing may compile from here on
                    timed = head_to_head(a_step, p_step, n, lambda: sync(bench.device))
                    if compiled_graphs() != before:
                        raise RuntimeError("a graph was compiled after the rebuild (the peer's code reset, or a "
                                           "recompile): the pair is not the rows' programs")
                    res.update(timed, status="ok")
            except Exception as e:  # noqa: BLE001 - a failing comparison is reported, not fatal
                res["status"] = error_status(e)
            finally:
                a_model = a_step = None
                gc.collect()
            res["wall_s"] = time.perf_counter() - t0
            if res["status"] == "ok":
                log(f"  head-to-head {r['method']} {r['setting']} / inductor {peer['setting']}: {res['ratio']:.3f} "
                    f"(90% {res['interval'][0]:.3f}-{res['interval'][1]:.3f}, {res['wall_s']:.0f}s)")
            else:
                log(f"  head-to-head {r['method']} {r['setting']} / inductor {peer['setting']}: {res['status']}")
            out.append(res)
        p_model = p_step = None
        gc.collect()
        torch._dynamo.reset()
    return out


def ratio_spread(a: dict, b: dict) -> tuple[float, float]:
    """Time of row a over row b, from the medians of their eager-paired ratios, and its noise: the half
    p10-p90 spread of a's per-pair ratios plus b's, relative to their medians."""
    ra = [x / y for x, y in zip(a["step_samples_s"], a["eager_samples_s"], strict=True)]
    rb = [x / y for x, y in zip(b["step_samples_s"], b["eager_samples_s"], strict=True)]

    def half_spread(r: list[float]) -> float:
        q = statistics.quantiles(r, n=10)
        return (q[-1] - q[0]) / statistics.median(r) / 2

    return statistics.median(ra) / statistics.median(rb), half_spread(ra) + half_spread(rb)


def find_pair(pairs: list[dict], r: dict, peer: dict) -> dict | None:
    return next((c for c in pairs if c["model"] == r["model"] and c["autoremat_row"] == [r["method"], r["setting"]]
                 and c["inductor_row"] == peer["setting"]), None)


def h2h_cells(c: dict | None) -> str:
    """The head-to-head ratio and its 90% interval, as two table cells."""
    if c is None:
        return "not timed | "
    if c["status"] != "ok":
        return f"{c['status']} | "
    return f"{c['ratio']:.3f} ({len(c['ratios'])} pairs) | {c['interval'][0]:.3f}-{c['interval'][1]:.3f}"


def equal_memory_lines(rows: list[dict], pairs: list[dict]) -> str:
    """Each autoremat row planned at an Inductor row's measured peak, against that row."""
    out = ["| model | Inductor row | its peak (MiB) | autoremat row | graphs | autoremat peak (MiB) | "
           "autoremat / Inductor time, head-to-head | 90% interval of the median | through eager (context) |",
           "|---" * 9 + "|"]
    ok = {(r["model"], r["setting"]): r for r in rows if r["method"] == "inductor" and r["status"] == "ok"}
    for r in rows:
        if r["method"] not in (AT_PEER, CUT):
            continue
        form = "regions=True" if r["method"] == CUT else "default"
        peer = ok.get((r["model"], r["setting"].split(":")[0]))
        if peer is None:
            continue
        if r["status"] != "ok":
            out.append(f"| {r['model']} | {peer['setting']} | {peer['measured_peak'] / MiB:.2f} | {form} | | "
                       f"{r['status']} | | | |")
            continue
        ratio, noise = ratio_spread(r, peer)
        cells = h2h_cells(find_pair(pairs, r, peer)) if r["method"] == AT_PEER else "not timed (ablation) | "
        out.append(f"| {r['model']} | {peer['setting']} | {peer['measured_peak'] / MiB:.2f} | {form} | "
                   f"{r.get('num_graphs')} | {r['measured_peak'] / MiB:.2f} | {cells} | {ratio:.3f} +-{100 * noise:.0f}% |")
    return "\n".join(out)


def goal_lines(rows: list[dict], pairs: list[dict]) -> tuple[str, dict]:
    """At every memory level autoremat's step time is at most that of every Inductor row whose measured peak is
    at or below it: each such pair judged on its head-to-head median (through-eager ratios kept as context)."""
    held = failed = in_interval = unmeasured = 0
    lines = []
    ok = [r for r in rows if r["status"] == "ok"]
    for a in (r for r in ok if r["method"] in JUDGED):
        for p in (r for r in ok if r["method"] == "inductor" and r["model"] == a["model"]):
            if not goal_compares(a, p):
                continue
            c = find_pair(pairs, a, p)
            context = f"through eager x{a['step_vs_eager']:.3f} vs x{p['step_vs_eager']:.3f}"
            if c is None or c["status"] != "ok":
                unmeasured += 1
                verdict = f"NOT MEASURED ({c['status'] if c else 'not timed'})"
            elif c["ratio"] <= 1.0:
                held += 1
                verdict = f"holds, {c['ratio']:.3f} (90% {c['interval'][0]:.3f}-{c['interval'][1]:.3f})"
            else:
                failed += 1
                reach = c["interval"][0] <= 1.0
                in_interval += reach
                verdict = (f"FAILS, {c['ratio']:.3f} (90% {c['interval'][0]:.3f}-{c['interval'][1]:.3f}"
                           f"{': the interval reaches 1.0' if reach else ''})")
            lines.append(f"- {a['model']}: {a['method']} {a['setting']} ({a['measured_peak'] / MiB:.1f} MiB) vs "
                         f"inductor {p['setting']} ({p['measured_peak'] / MiB:.1f} MiB): {verdict}; {context}")
    n = held + failed + unmeasured
    missing = [r for r in rows if r["method"] in (*JUDGED, "inductor") and r["status"] != "ok"]
    for r in missing:
        lines.append(f"- {r['model']}: {r['method']} {r['setting']} did not run ({r['status']}): its comparisons "
                     "are missing")
    summary = (f"Goal check, head-to-head: \"at every memory level autoremat's step time is no worse than every "
               f"Inductor row whose measured peak is at or below it\": {held}/{n} comparisons hold, {failed} fail "
               f"({in_interval} of those with a 90% interval that reaches 1.0), {unmeasured} not measured, "
               f"{len(missing)} rows did not run. "
               + ("GOAL MET." if failed == unmeasured == len(missing) == 0 and n > 0 else "GOAL NOT MET."))
    return summary + "\n" + "\n".join(lines), dict(held=held, failed=failed, failed_interval_reaches_1=in_interval,
                                                    not_measured=unmeasured, rows_not_run=len(missing), comparisons=n)


def prediction_lines(rows: list[dict]) -> str:
    out = []
    for r in rows:
        if r["status"] == "ok" and r.get("predicted_peak") is not None:
            err = (r["predicted_peak"] - r["measured_peak"]) / r["measured_peak"]
            used = r["measured_peak"] / r["budget"]
            out.append(f"| {r['model']} | {r['method']} {r['setting']} | {r['budget'] / MiB:.2f} | "
                       f"{r['predicted_peak'] / MiB:.2f} | {r['measured_peak'] / MiB:.2f} | {100 * err:+.1f}% | "
                       f"{100 * used:.1f}% | {r.get('planning_s') or 0:.1f} ({r.get('compile_s') or 0:.1f}) | "
                       f"{'re-planned' if any('re-planned' in n for n in r.get('verify_notes', [])) else 'verified'} |")
    head = ("| model | row | budget (MiB) | predicted peak | measured peak | prediction error | budget used | "
            "planning s (Inductor s) | verify |\n" + "|---" * 9 + "|")
    return head + "\n" + "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--steps", type=int, default=21, help="timed steps per row (median), >= 5")
    ap.add_argument("--grid", type=int, default=3)
    ap.add_argument("--pairs", type=int, default=21, help="head-to-head pairs per comparison (median), >= 5")
    ap.add_argument("--models", default="stack,gpt2")
    ap.add_argument("--dropout", default="0.1,0.0", help="dropout settings, comma list")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    ap.add_argument("--stem", default=None, help="file name of the results (default speed_cpu[_quick])")
    ap.add_argument("--with-cut", action="store_true",
                    help="also plan each at-peer row with regions=True (one graph per block always): an ablation")
    a = ap.parse_args()
    torch.set_num_threads(1)
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")

    def log(s: str) -> None:
        print(s, flush=True)

    t0 = time.perf_counter()
    meta = dict(date=datetime.datetime.now().isoformat(timespec="seconds"), command=" ".join(sys.argv), quick=a.quick,
                steps=a.steps, torch=torch.__version__, python=platform.python_version(),
                machine=platform.processor() or platform.machine(), repo_git=git_state().line())
    rows, lims, pairs = [], {}, []
    for d in (float(x) for x in a.dropout.split(",")):
        tag = f"dropout {d}"
        for cfg in (c for c in speed_configs(a.quick, d) if c["name"] in a.models.split(",")):
            r, lim, h = bench_model(cfg, tag, max(5, a.steps), a.grid, max(5, a.pairs), log, with_cut=a.with_cut)
            rows += r
            pairs += h
            lims[f"{cfg['name']} ({tag})"] = lim
    noise = timing_noise(rows)
    goal, counts = goal_lines(rows, pairs)  # the ablation rows are neither peers nor the default autoremat
    wall = time.perf_counter() - t0
    text = (f"# autoremat with Inductor vs torch.compile with Inductor, CPU{' (--quick)' if a.quick else ''}\n\n"
            f"Command: `python benchmarks/speed.py {' '.join(sys.argv[1:])}`, {meta['date']}, torch {torch.__version__}, "
            f"1 thread, repo {meta['repo_git']}, wall {wall:.0f} s.\n\n"
            + "Models: " + "; ".join(model_line(c) for c in speed_configs(a.quick, 0.0)) + ".\n\n"
            f"Step = forward + backward, no optimizer, gradients allocated by a warm-up step. Step time: median of "
            f"{max(5, a.steps)} steps, each paired with an eager step just before it. Timing noise (eager p10-p90 "
            f"half-spread): " + ", ".join(f"{k[0]} {100 * v:.1f}%" for k, v in sorted(noise.items())) + ".\n\n"
            f"The goal and the equal-memory ratios are measured head-to-head: after the rows, each Inductor row is "
            f"compiled again under its budget and each autoremat row rebuilt from its plan (both must measure their "
            f"row's peak again, within 1%), and the two are timed against each other in {max(5, a.pairs)} pairs whose "
            f"order alternates, each timed step right after an untimed step of the same model (benchmarks/common/). "
            f"The ratio is the median per-pair ratio, with a 90% bootstrap interval of that median. Ratios of two rows' "
            f"times vs eager, taken minutes apart, drift (benchmarks/drift.py) and are shown only as context.\n\n"
            + table(rows) + "\n\n## At equal memory: autoremat at each Inductor row's measured peak\n\n"
            + equal_memory_lines(rows, pairs) + "\n\n## autoremat's prediction under Inductor\n\n" + prediction_lines(rows)
            + "\n\n## Goal\n\n" + goal + "\n")
    log("\n" + text)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = a.stem or f"speed_cpu{'_quick' if a.quick else ''}"
    (out / f"{stem}.md").write_text(text)
    (out / f"{stem}.json").write_text(json.dumps(dict(meta=meta, wall_s=wall, limits=lims, goal=counts, rows=rows, head_to_head=pairs,
                                                      noise={k[0]: v for k, v in noise.items()}), indent=1,
                                                 default=str))
    log(f"wrote {out / stem}.md and .json")


if __name__ == "__main__":
    main()
