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
import contextlib
import importlib
import importlib.util
import inspect
import logging
import math
import os
import re
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NoReturn

EXIT_INFEASIBLE = 1
EXIT_USAGE = 2

# The library reports its stages here at INFO level; Progress shows them, `logging` users see them too.
PROGRESS_LOGGER = "autoremat.progress"

# Real CPU tensors are used only when meta tracing fails; above this many parameter bytes that
# would take real memory the user did not ask for, so we stop with the meta error instead.
REAL_FALLBACK_MAX_PARAM_BYTES = 2**30


class UsageError(Exception):
    """Bad input from the user: exit code 2, message without a traceback."""


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


class Progress:
    """A spinner with elapsed seconds on stderr while a slow step runs.

    The label follows the library's own progress: each INFO record on the `autoremat.progress`
    logger (e.g. "solving the ILP") replaces it, so Python users and the CLI read the same stages. On a
    terminal it redraws one line and erases it at the end. Elsewhere (logs, CI) a spinner would be
    noise, so lines are written only once the step has run for `quiet_s`: the label, then each new stage.
    """

    FRAMES = "|/-\\"

    def __init__(self, label: str, stream: Any = None, quiet_s: float = 1.0) -> None:
        self.label = label
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.quiet_s = quiet_s
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.logger = logging.getLogger(PROGRESS_LOGGER)
        self.saved_level = logging.NOTSET

    def _run(self) -> None:
        t0, frame, written = time.perf_counter(), 0, ""
        if not self.tty and self.done.wait(self.quiet_s):
            return
        while True:
            label = self.label
            if self.tty:
                self.stream.write(f"\r\033[K{self.FRAMES[frame % 4]} {label} {time.perf_counter() - t0:.1f} s")
            elif label != written:
                self.stream.write(f"autoremat: {label} ...\n")
            self.stream.flush()
            frame, written = frame + 1, label
            if self.done.wait(0.1):
                break
        if self.tty:
            self.stream.write("\r\033[K")  # erase the spinner line
            self.stream.flush()

    def filter(self, record: logging.LogRecord) -> bool:
        # A logger filter, not a handler: adding a handler would stop logging's last resort from
        # printing the library's warnings to stderr, as it does without one.
        if record.levelno == logging.INFO:
            self.label = record.getMessage()
        return True

    def __enter__(self) -> Progress:
        self.saved_level = self.logger.level
        if self.logger.getEffectiveLevel() > logging.INFO:
            self.logger.setLevel(logging.INFO)  # INFO records are not even made below that
        self.logger.addFilter(self)
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.done.set()
        self.thread.join()
        self.logger.removeFilter(self)
        self.logger.setLevel(self.saved_level)


# Loading the model --------------------------------------------------------------------------

def load_target(target: str) -> Callable:
    """`path/to/file.py:factory` or `package.module:factory` -> the factory."""
    where, sep, attr = target.rpartition(":")
    if not sep or not where or not attr:
        raise UsageError(f"target must be path/to/file.py:factory or package.module:factory; got {target!r}")
    if where.endswith(".py") or os.sep in where or "/" in where:
        path = Path(where)
        if not path.is_file():
            raise UsageError(f"no such file: {where}")
        # Let the file import its neighbours, as it could when run as a script.
        sys.path.insert(0, str(path.resolve().parent))
        name = f"_autoremat_target_{path.stem}"
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses and pickling look the module up by name
        try:
            spec.loader.exec_module(module)
        except Exception as e:
            raise UsageError(f"importing {where} failed: {type(e).__name__}: {e}") from e
    else:
        # A console script does not have the working directory on sys.path; `python -m` does.
        sys.path.insert(0, os.getcwd())
        try:
            module = importlib.import_module(where)
        except ModuleNotFoundError as e:
            raise UsageError(f"cannot import module {where!r}: {e}") from e
        except Exception as e:
            raise UsageError(f"importing {where} failed: {type(e).__name__}: {e}") from e
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise UsageError(f"{where} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise UsageError(f"{where}:{attr} is a {type(obj).__name__}, not a callable factory")
    return obj


def factory_kwargs(factory: Callable, name: str, options: dict[str, Any]) -> dict[str, Any]:
    """Keep only what the user asked for, and refuse what the factory cannot take."""
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return options  # builtins without a signature: let the call itself complain
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return options
    accepted = [n for n, p in params.items()
                if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)]
    unknown = [k for k in options if k not in accepted]
    if unknown:
        flags = ", ".join(f"--{k}" if k in ("batch", "seq") else f"--opt {k}=..." for k in unknown)
        raise UsageError(f"{name}() does not accept {flags}; it accepts: {', '.join(accepted) or 'nothing'}")
    return options


def build(factory: Callable, name: str, kwargs: dict[str, Any], device: str) -> tuple[Any, Any]:
    import torch

    try:
        with torch.device(device):
            result = factory(**kwargs)
    except Exception as e:
        raise UsageError(f"{name}({_call_args(kwargs)}) raised {type(e).__name__}: {e}") from e
    if not (isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], torch.nn.Module)):
        raise UsageError(f"{name}() must return (model, example_inputs) with an nn.Module first; "
                         f"got {type(result).__name__}")
    inputs = result[1]
    values = inputs.values() if isinstance(inputs, dict) else inputs if isinstance(inputs, (tuple, list)) else [inputs]
    empty = [tuple(v.shape) for v in values if isinstance(v, torch.Tensor) and v.numel() == 0]
    if empty:  # a step over nothing would get a plan for 0-byte inputs: a wrong answer, not an error
        raise UsageError(f"{name}({_call_args(kwargs)}) returned an example input with no elements (shape "
                         f"{empty[0]}); every input needs at least one element: check the batch and length options")
    return result


def _call_args(kwargs: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in kwargs.items())


@contextlib.contextmanager
def quiet_meta_warnings() -> Iterator[None]:
    # Tracing the backward of meta tensors makes torch warn that some ops (nll_loss) have no
    # autograd kernel for the meta key; the joint graph is still right, so this says nothing useful.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*autograd kernel was not registered.*")
        yield


# Commands -----------------------------------------------------------------------------------

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
    print(f"autoremat: {args.target}({_call_args(kwargs)}): {n_params:,} parameters "
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
        import torch

        torch._dynamo.reset()
        model, inputs = build(factory, name, kwargs, "cpu")
        with Progress("capturing the step and solving (real CPU tensors)"):
            opt_model = _optimize(model, budget, inputs, args, device)
        note = f"planned with real CPU tensors: meta tracing failed ({type(e).__name__}: {_first_line(e)})"
    plan = opt_model.plan
    plan.notes.append(note)
    print(plan.summary())

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
            points = pareto_points(opt_model, plan, args)
        print()
        print(format_pareto(points, plan))
        plot_pareto(points, (plan.budget, plan.overhead), args.pareto)
        print(f"autoremat: wrote {args.pareto}", file=sys.stderr)
    return 0


def _optimize(model: Any, budget: int, inputs: Any, args: argparse.Namespace, device: str) -> Any:
    import autoremat

    try:
        return autoremat.optimize(model, budget, inputs, optimizer=args.optimizer, device=device,
                                  solver=args.solver, time_limit=args.time_limit, world_size=args.world_size,
                                  sharding=args.sharding, precision=args.precision)
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
    from autoremat.devices import get_device, known_devices

    try:
        get_device(name)
    except (ValueError, TypeError) as e:
        raise UsageError(f"unknown --device {name!r}; known devices: {', '.join(known_devices())}") from e


def pareto_points(opt_model: Any, plan: Any, args: argparse.Namespace, count: int = 8) -> list[tuple[int, float]]:
    """(budget, predicted overhead) at `count` budgets from the smallest that fits to no recomputation."""
    from autoremat.backend import plan_graphs
    from autoremat.devices import get_device
    from autoremat.ledger import Ledger
    from autoremat.plan import BudgetError
    from autoremat.solver import smallest_peak

    profiles = opt_model._planner.profiles
    dev = get_device(args.device or "cpu")
    fixed = Ledger.from_dict(plan.ledger).fixed
    smallest = smallest_peak(profiles, granularity=dev.alloc_granularity, solver=args.solver,
                             time_limit=args.time_limit)
    low = fixed + smallest.peak
    high = fixed + max(plan.baseline_peak, plan.activation_peak)
    budgets = sorted({round(low + (high - low) * i / (count - 1)) for i in range(count)})
    forward = plan.forward_time_s or 1.0
    points = []
    for b in budgets:
        try:
            # A fresh ledger each time: plan_graphs records the budget it was given in it.
            decision = plan_graphs(profiles, b, Ledger.from_dict(plan.ledger), dev, solver=args.solver,
                                   time_limit=args.time_limit)
        except BudgetError:
            if b != low:
                continue
            decision = smallest  # at the very edge the search can miss what the min-peak plan reached
        points.append((b, decision.recompute_time_s / forward))
    return points


def format_pareto(points: list[tuple[int, float]], plan: Any) -> str:
    from autoremat.units import format_bytes

    rows = sorted([(b, o, "") for b, o in points] + [(plan.budget, plan.overhead, "  (chosen)")])
    lines = [f"{'budget':>12}  {'predicted overhead':>18}"]
    lines += [f"{format_bytes(b):>12}  {100 * o:>17.1f}%{mark}" for b, o, mark in rows]
    return "\n".join(lines)


def cmd_show(args: argparse.Namespace) -> int:
    from autoremat.plan import Plan

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
    from autoremat.ledger import ledger_for_count
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
    p.add_argument("--solver", default="auto", choices=("auto", "cbc", "highs"))
    p.add_argument("--time-limit", type=positive_seconds, default=30.0, metavar="S", help="ILP time limit per solve")
    p.add_argument("--precision", default="fp32", choices=("fp32", "bf16"),
                   help="bf16: every matmul-class call in bf16 (auto and fp16 measure a real batch: use the "
                        "Python API, docs/precision.md)")
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
    from autoremat.plan import BudgetError

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
