"""The command-line face: plan a model's training step, size a ledger, read a saved plan.

    autoremat plan examples/models.py:gpt2_small --budget 6GB --batch 8 --seq 1024
    autoremat plan my_project/model.py:build --budget 20GiB --json plan.json --plot timeline.png --pareto pareto.svg
    autoremat ledger --params 7B --param-dtype bf16 --optimizer adamw
    autoremat show plan.json

`plan` builds the model on the meta device, so planning a model far larger than this machine's
memory takes no real memory and no GPU. Exit codes: 0 ok, 1 the budget is infeasible (or an
unexpected failure), 2 bad usage or input.
"""

from __future__ import annotations

import argparse
import logging
import math
import re
import sys
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from autoremat.cli_support import (
    REAL_FALLBACK_MAX_PARAM_BYTES,
    Progress,
    UsageError,
    build,
    call_args,
    factory_kwargs,
    load_target,
    quiet_meta_warnings,
)

if TYPE_CHECKING:
    from autoremat.planning.options import PlanOptions

EXIT_INFEASIBLE = 1
EXIT_USAGE = 2



class Parser(argparse.ArgumentParser):
    """argparse whose errors are one `autoremat: error:` line, like every other bad input (exit code 2)."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see {self.prog} --help)")


# Small helpers --------------------------------------------------------------------------------

_COUNT_RE = re.compile(r"(\d+(?:\.\d*)?|\.\d+)([kmbt]?)")
_COUNT_SCALE = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "t": 10**12}


def parse_count(text: str) -> int:
    """A parameter count: "7B", "1.3B", "125M", "350k" or a plain integer."""
    match = _COUNT_RE.fullmatch(text.strip().lower().replace("_", "").replace(",", ""))
    wanted = f'--params must be a positive count like "7B", "1.3B", "125M" or 7000000000; got {text!r}'
    if match is None:
        raise UsageError(wanted)
    number, suffix = match.groups()
    scale = _COUNT_SCALE[suffix]
    # Integer arithmetic where possible so that "7B" is exactly 7 * 10**9.
    count = round(float(number) * scale) if "." in number else int(number) * scale
    if count < 1:
        raise UsageError(wanted)
    return count


def positive_int(text: str) -> int:
    """argparse type of --batch, --seq, --world-size: 0 or less would plan a step that cannot exist."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number of at least 1, e.g. 8; got {text!r}")
    return value


def positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, e.g. 30; got {text!r}")
    return value


def parse_value(text: str) -> int | float | str:
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def parse_options(pairs: list[str]) -> dict[str, Any]:
    options: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.isidentifier():
            raise UsageError(f"--opt takes key=value with a Python identifier as key; got {pair!r}")
        options[key] = parse_value(value)
    return options


def cmd_plan(args: argparse.Namespace) -> int:
    import autoremat
    from autoremat.units import format_bytes

    try:
        budget = autoremat.parse_budget(args.budget)
    except ValueError as e:
        raise UsageError(str(e)) from e
    device = args.device or "cpu"
    _check_device(device)
    options = parse_options(args.opt)
    for key in ("batch", "seq"):
        if getattr(args, key) is not None:
            options[key] = getattr(args, key)
    check_outputs(args)
    factory = load_target(args.target)
    name = args.target.rpartition(":")[2]
    kwargs = factory_kwargs(factory, name, options)

    model, inputs = build(factory, name, kwargs, "meta")
    n_params = sum(p.numel() for p in model.parameters())
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    print(f"autoremat: {args.target}({call_args(kwargs)}): {n_params:,} parameters "
          f"({format_bytes(param_bytes)}), planning on meta tensors", file=sys.stderr)
    note = "planned on meta tensors: no real memory was used, op times are roofline estimates"
    try:
        with Progress("capturing the step and solving"), quiet_meta_warnings():
            opt_model = _optimize(model, budget, inputs, args, device)
    except (autoremat.BudgetError, UsageError):
        raise
    except Exception as e:
        if args.debug:
            traceback.print_exc()
        if param_bytes > REAL_FALLBACK_MAX_PARAM_BYTES:
            raise
        print(f"autoremat: planning on meta tensors failed ({type(e).__name__}: {_first_line(e)}); "
              "planning again with real CPU tensors", file=sys.stderr)
        from autoremat.torch_internals import dynamo_reset

        dynamo_reset()
        model, inputs = build(factory, name, kwargs, "cpu")
        with Progress("capturing the step and solving (real CPU tensors)"):
            opt_model = _optimize(model, budget, inputs, args, device)
        note = f"planned with real CPU tensors: meta tracing failed ({type(e).__name__}: {_first_line(e)})"
    plan = opt_model.plan
    plan.notes.append(note)
    print(plan.summary())
    if "auto" in plan.precision:
        print(format_auto(plan.precision["auto"]))

    if args.json:
        plan.save(args.json)
        print(f"autoremat: wrote {args.json}", file=sys.stderr)
    if args.plot:
        from autoremat.plots import plot_timeline

        plot_timeline(plan, args.plot)
        print(f"autoremat: wrote {args.plot}", file=sys.stderr)
    if args.pareto:
        from autoremat.plots import plot_pareto

        with Progress("solving at other budgets"):
            from autoremat.planning.pipeline import pareto_points

            points = pareto_points(opt_model._planner.profiles, plan, args.device or "cpu", _options(args))
        print()
        print(format_pareto(points, plan))
        plot_pareto(points, (plan.budget, plan.overhead), args.pareto)
        print(f"autoremat: wrote {args.pareto}", file=sys.stderr)
    return 0


def _options(args: argparse.Namespace) -> PlanOptions:
    """The planning options the command line asked for, as the one object every face hands down."""
    from autoremat.planning.options import PlanOptions

    return PlanOptions(solver=args.solver, time_limit=args.time_limit, precision=args.precision,
                       outputs=args.outputs, compiler=args.compiler)


def _optimize(model: Any, budget: int, inputs: Any, args: argparse.Namespace, device: str) -> Any:
    import autoremat

    try:
        return autoremat.optimize(model, budget, inputs, optimizer=args.optimizer, device=device,
                                  world_size=args.world_size, sharding=args.sharding, options=_options(args))
    except ValueError as e:
        if "world_size" in str(e) or "sharding" in str(e):
            raise UsageError(str(e)) from e
        raise


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [""])[0]


def check_outputs(args: argparse.Namespace) -> None:
    """Find an unwritable output or a missing matplotlib before planning, not after it."""
    from autoremat import plots

    for kind in ("json", "plot", "pareto"):
        path = getattr(args, kind, None)
        if path is None:
            continue
        if kind == "json":
            if not Path(path).parent.is_dir():
                raise UsageError(f"directory {str(Path(path).parent)!r} does not exist (for --json {path})")
            continue
        try:
            plots.check_path(path)
        except ValueError as e:
            raise UsageError(str(e)) from e
        plots.require_matplotlib()


def _check_device(name: str) -> None:
    from autoremat.model.devices import get_device, known_devices

    try:
        get_device(name)
    except (ValueError, TypeError) as e:
        raise UsageError(f"unknown --device {name!r}; known devices: {', '.join(known_devices())}") from e


def format_auto(auto: dict) -> str:
    """What precision='auto' chose, each candidate's predicted step time, and why the others were not taken."""
    names = {"fp32": "fp32", "ilp": "joint ILP's per-call dtypes", "bf16": "every castable call in bf16"}
    times = auto["predicted_step_s"]
    lines = ["", f"precision auto chose {auto['chosen']} ({names.get(auto['chosen'], auto['chosen'])}): "
             "the least predicted step time of the candidates that fit", f"{'candidate':>10}  {'predicted step':>14}"]
    lines += [f"{name:>10}  {t * 1e3:>11.2f} ms{'  (chosen)' if name == auto['chosen'] else ''}"
              for name, t in sorted(times.items(), key=lambda kv: kv[1])]
    lines += [f"not taken: {name}: {why}" for name, why in auto.get("not_taken", {}).items()]
    return "\n".join(lines)


def format_pareto(points: list[tuple[int, float]], plan: Any) -> str:
    from autoremat.units import format_bytes

    rows = sorted([(b, o, "") for b, o in points] + [(plan.budget, plan.overhead, "  (chosen)")])
    lines = [f"{'budget':>12}  {'predicted overhead':>18}"]
    lines += [f"{format_bytes(b):>12}  {100 * o:>17.1f}%{mark}" for b, o, mark in rows]
    return "\n".join(lines)


def cmd_show(args: argparse.Namespace) -> int:
    from autoremat.planning.plan import Plan

    try:
        plan = Plan.load(args.file)
    except FileNotFoundError as e:
        raise UsageError(f"no such file: {args.file}") from e
    except (ValueError, TypeError, KeyError) as e:
        raise UsageError(f"{args.file} is not an autoremat plan: {e}") from e
    check_outputs(args)
    print(plan.summary())
    if args.plot:
        from autoremat.plots import plot_timeline

        plot_timeline(plan, args.plot)
        print(f"autoremat: wrote {args.plot}", file=sys.stderr)
    return 0


def cmd_ledger(args: argparse.Namespace) -> int:
    from autoremat.model.ledger import ledger_for_count
    from autoremat.units import parse_budget

    n = parse_count(args.params)
    try:
        ledger = ledger_for_count(n, param_dtype=args.param_dtype, grad_dtype=args.grad_dtype,
                                  optimizer=args.optimizer, master_weights=args.master_weights,
                                  world_size=args.world_size, sharding=args.sharding,
                                  trainable_fraction=args.trainable_fraction)
        if args.budget is not None:
            ledger.budget = parse_budget(args.budget)
    except ValueError as e:
        raise UsageError(str(e)) from e
    print(f"{n:,} parameters, {args.param_dtype}, {args.optimizer}: fixed memory of one training step")
    print(ledger.format())
    return 0


# Argument parsing ---------------------------------------------------------------------------

# Copies of names defined next to torch-importing code (ledger.py, devices.py), so that --help does
# not import torch; tests/test_cli.py checks that they still match.
DTYPES = ("fp32", "bf16", "fp16", "float32", "bfloat16", "float16")
OPTIMIZER_NAMES = ("none", "sgd", "sgd_momentum", "momentum", "lion", "adam", "adamw", "adafactor", "adam8bit",
                   "adamw8bit")
SHARDINGS = ("none", "zero1", "zero2", "zero3", "fsdp")
DEVICE_NAMES = ("cpu", "v100", "a100", "l4", "rtx3090", "rtx4090", "h100", "h200")


def make_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="autoremat", description=(
        "Plan activation recomputation for a PyTorch training step under a byte budget."))
    sub = parser.add_subparsers(dest="command", required=True, metavar="{plan,ledger,show}")

    p = sub.add_parser("plan", help="plan a model's training step under a budget",
                       description="Build the model on the meta device, capture its step and solve.")
    p.add_argument("target", help="path/to/file.py:factory or package.module:factory; "
                                  "the factory returns (model, example_inputs)")
    p.add_argument("--budget", required=True, help='bytes for the whole step, e.g. "6GB" (10^9) or "20GiB" (2^30)')
    p.add_argument("--batch", type=positive_int, help="passed to the factory as batch=")
    p.add_argument("--seq", type=positive_int, help="passed to the factory as seq=")
    p.add_argument("--opt", action="append", default=[], metavar="KEY=VALUE",
                   help="another factory keyword argument (int, float or string); repeatable")
    p.add_argument("--optimizer", default="adamw", choices=OPTIMIZER_NAMES, help="sizes the optimizer state")
    p.add_argument("--device", metavar="NAME",
                   help=f"roofline device for op times: {', '.join(DEVICE_NAMES)} (default cpu)")
    p.add_argument("--world-size", type=positive_int, default=1, help="ranks the step is sharded over (per-rank plan)")
    p.add_argument("--sharding", default="none", choices=SHARDINGS)
    p.add_argument("--solver", default="auto", choices=("auto", "highs"), help="the ILP solver: HiGHS either way")
    p.add_argument("--time-limit", type=positive_seconds, default=30.0, metavar="S", help="ILP time limit per solve")
    p.add_argument("--precision", default="fp32", choices=("fp32", "bf16", "auto"),
                   help="bf16: every matmul-class call in bf16; auto: the fastest predicted of fp32, the joint "
                        "ILP's per-call dtypes and all-bf16 that fits (fp16 measures a real batch: use the "
                        "Python API, docs/precision.md)")
    p.add_argument("--outputs", default="all", choices=("all", "loss"),
                   help="loss: only the loss is used, so the logits are never materialised whole (the model's "
                        "logits output becomes None); all (default): the logits output is kept")
    p.add_argument("--compiler", default="auto", choices=("auto", "inductor", "eager"),
                   help="auto (default): Inductor where it runs (CUDA with Triton, CPU with a C++ compiler), else "
                        "eager; eager: the FX graphs run as Python (no compile time)")
    p.add_argument("--json", metavar="FILE", help="save the plan (re-apply it with autoremat.Plan.load)")
    p.add_argument("--plot", metavar="FILE", help="draw live memory over the step (.png or .svg)")
    p.add_argument("--pareto", metavar="FILE", help="re-solve at 8 budgets and draw overhead vs budget")
    p.add_argument("--debug", action="store_true", help="tracebacks and autoremat's log")
    p.set_defaults(run=cmd_plan)

    s = sub.add_parser("show", help="print a saved plan")
    s.add_argument("file")
    s.add_argument("--plot", metavar="FILE", help="draw live memory over the step (.png or .svg)")
    s.add_argument("--debug", action="store_true")
    s.set_defaults(run=cmd_show)

    g = sub.add_parser("ledger", help="fixed memory of a training step from a parameter count")
    g.add_argument("--params", required=True, help='"7B", "1.3B", "125M" or an integer')
    g.add_argument("--param-dtype", default="fp32", choices=DTYPES)
    g.add_argument("--grad-dtype", choices=DTYPES, help="default: the parameter dtype")
    g.add_argument("--optimizer", default="adamw", choices=OPTIMIZER_NAMES)
    g.add_argument("--master-weights", action=argparse.BooleanOptionalAction, default=None,
                   help="fp32 master copy (default: yes for a named optimizer on 16-bit parameters)")
    g.add_argument("--world-size", type=positive_int, default=1)
    g.add_argument("--sharding", default="none", choices=SHARDINGS)
    g.add_argument("--trainable-fraction", type=float, default=1.0)
    g.add_argument("--budget", help="also print the headroom under this budget")
    g.add_argument("--debug", action="store_true")
    g.set_defaults(run=cmd_ledger)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        args = make_parser().parse_args(argv)
    except UsageError as e:
        print(f"autoremat: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    if args.debug:
        logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    from autoremat.planning.plan import BudgetError

    try:
        return args.run(args)
    except UsageError as e:
        return _fail(args, e, str(e), EXIT_USAGE)
    except BudgetError as e:
        return _fail(args, e, str(e), EXIT_INFEASIBLE)
    except ImportError as e:
        from autoremat.plots import MISSING

        if str(e) == MISSING:
            return _fail(args, e, MISSING, EXIT_USAGE)
        return _fail(args, e, f"{type(e).__name__}: {e}", EXIT_INFEASIBLE)
    except KeyboardInterrupt:
        return 130
    except Exception as e:
        return _fail(args, e, f"{type(e).__name__}: {e}\n(run with --debug for the traceback)", EXIT_INFEASIBLE)


def _fail(args: argparse.Namespace, error: BaseException, message: str, code: int) -> int:
    if args.debug:
        traceback.print_exception(error)
    print(f"autoremat: error: {message}", file=sys.stderr)
    return code
