"""Which compiler runs the planned graphs: `compiler="auto"` picks Inductor where it works.

    "eager"     the partitioned FX graphs run as Python (every aten op one call; no C compiler needed)
    "inductor"  torch's Inductor lowers and fuses them (Triton kernels on CUDA, C++ on CPU)
    "auto"      Inductor when this machine can run it for the model's device, else "eager", with
                one warning per reason saying why

Inductor needs, on CUDA, Triton importable; on CPU, a C++ compiler that builds a shared library (the
one Inductor would call: `$CXX`, else g++) and Inductor's own generated C++ building with it. Each
probe runs once per process and device kind and is cached, and the fallback is logged once (a
warning on the `autoremat` logger). The CPU probe first builds a one-line library with that compiler
(a clear reason when there is none), then compiles and runs one small Inductor kernel through the
compilers autoremat uses (torch_internals.inductor_kernel_probe; its seconds are in
`PROBE_SECONDS`, and in the plan's planning time).

If Inductor still fails on the model's own graphs at plan time, "auto" plans again with "eager" and
warns once with Inductor's error (`inductor_failure`); an explicit "inductor" raises
`InductorFailed` saying what failed and what would work. If no plan fits the budget under Inductor
(a plan cannot save a value Inductor fuses, so its smallest budget can be higher), "auto" plans again
with "eager", says so in one warning and in the plan's compiler line, and raises BudgetError only if
neither fits; an explicit "inductor" raises it.
"""

from __future__ import annotations

import functools
import logging
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch

from autoremat.planning.plan import BudgetError
from autoremat.torch_internals import (
    BackendCompilerFailed,
    has_triton,
    inductor_cpp_compiler,
    inductor_kernel_probe,
    is_inductor_error,
)
from autoremat.units import format_bytes

COMPILERS = ("auto", "eager", "inductor")
log = logging.getLogger("autoremat")
PROBE_TIMEOUT_S = 60.0
_PROBE_SOURCE = 'extern "C" int autoremat_probe(int x) { return x + 1; }\n'
T = TypeVar("T")
PROBE_SECONDS: dict[str, float] = {}  # device kind -> wall time of its probe in this process


class InductorFailed(RuntimeError):
    """compiler="inductor" was asked for and Inductor could not compile the model's graphs."""


@dataclass(frozen=True)
class CompilerChoice:
    requested: str
    used: str  # "eager" or "inductor"
    reason: str  # why this one (for "auto"), or "requested"

    def to_dict(self) -> dict:
        return {"requested": self.requested, "used": self.used, "reason": self.reason}


def check_compiler(compiler: object) -> str:
    if compiler not in COMPILERS:
        raise ValueError(f"compiler must be 'auto' (Inductor where it runs, else eager), 'inductor' or 'eager' "
                         f"(FX graphs run as Python), got {compiler!r}")
    return str(compiler)


def choose_compiler(compiler: str, device: torch.device | str) -> CompilerChoice:
    """The compiler to use for a model on `device`: `compiler` itself unless it is "auto"."""
    check_compiler(compiler)
    if compiler != "auto":
        return CompilerChoice(compiler, compiler, "requested")
    kind = torch.device(device).type
    if kind == "meta":  # planned, never run: nothing to compile for
        return CompilerChoice("auto", "eager", "meta tensors are planned, not run")
    problem = inductor_problem(kind)
    if problem is None:
        return CompilerChoice("auto", "inductor", f"Inductor runs on {kind} here")
    return fall_back(problem)


def fall_back(problem: str) -> CompilerChoice:
    """compiler="auto" runs eager because of `problem`: said once per reason."""
    _warn_once(f"autoremat: compiler='auto' uses the eager FX compiler, not Inductor: {problem}. Pass "
               "compiler='eager' to choose it explicitly (and silence this warning).")
    return CompilerChoice("auto", "eager", problem)


def run_with_fallback(choice: CompilerChoice, run: Callable[[str], T]) -> tuple[T, CompilerChoice]:
    """run(choice.used); if Inductor fails to compile, "auto" runs again with "eager" (warned once),
    and an explicit "inductor" raises InductorFailed. If no plan fits the budget under Inductor, "auto"
    plans again with "eager" (`fits_without_inductor`); an explicit "inductor" raises the BudgetError.
    Any other error passes through."""
    refused: BudgetError | None = None
    try:
        return run(choice.used), choice
    except BackendCompilerFailed as e:
        failure = inductor_failure(e) if choice.used == "inductor" else None
        if failure is None:
            raise
        if choice.requested != "auto":
            raise explicit_inductor_failed(failure) from e
    except BudgetError as e:
        if choice.requested != "auto" or choice.used != "inductor":
            raise
        refused = e
    if refused is None:
        choice = fall_back(failure)
        return run("eager"), choice
    try:
        out = run("eager")
    except BudgetError as e:
        raise neither_fits(refused, e) from None
    return out, fits_without_inductor(refused)


def _bytes(n: int | None) -> str:
    return f"{format_bytes(n)}, {n} bytes" if n else "unknown"


def fits_without_inductor(refused: BudgetError) -> CompilerChoice:
    """compiler="auto" runs eager because no plan fits under Inductor and one does under eager: said each time."""
    reason = (f"no plan fits the budget under Inductor (its smallest budget is {_bytes(refused.smallest_budget)}), "
              "one does under eager: Inductor fuses pointwise values into their readers, so a plan cannot save "
              "them, and eager can")
    log.warning("autoremat: compiler='auto' uses the eager FX compiler, not Inductor: %s. Pass compiler='eager' to "
                "choose it explicitly, or compiler='inductor' to get the BudgetError instead.", reason)
    return CompilerChoice("auto", "eager", reason)


def neither_fits(under_inductor: BudgetError, under_eager: BudgetError) -> BudgetError:
    """The BudgetError of compiler="auto" when neither compiler's plan fits: the smaller smallest budget,
    since "auto" at that budget would run (eager's where it is smaller)."""
    a, b = under_inductor.smallest_budget, under_eager.smallest_budget
    best = under_eager if a is None or (b is not None and b < a) else under_inductor
    budget = getattr(best.ledger, "budget", None)
    asked = f"budget {_bytes(budget)}" if budget else "the budget"
    head = (f"{asked} fits under neither compiler compiler='auto' may use: the smallest budget is {_bytes(a)} "
            f"under Inductor, {_bytes(b)} under eager.\n")
    return BudgetError(head + str(best), best.ledger, best.smallest_budget, best.peak_step, measured=best.measured,
                       at_peak=best.at_peak)


def inductor_failure(e: BaseException) -> str | None:
    """Inductor's own compile error in one line (its first C++ `error:` line where there is one), or
    None when `e` is not Inductor failing (dynamo wraps our errors and the user's as well)."""
    inner = getattr(e, "inner_exception", None) if isinstance(e, BackendCompilerFailed) else e
    if inner is None or not is_inductor_error(inner):
        return None
    return f"Inductor failed to compile ({type(inner).__name__}: {_first_error(str(inner))})"


def _first_error(text: str) -> str:
    lines = [x.strip() for x in text.splitlines() if x.strip()]
    errors = [x for x in lines if "error:" in x]
    line = errors[0][errors[0].index("error:"):] if errors else (lines[-1] if lines else "no message")
    return line if len(line) <= 300 else line[:297] + "..."


def explicit_inductor_failed(failure: str) -> InductorFailed:
    return InductorFailed(f"compiler='inductor': {failure}. Pass compiler='auto' (Inductor where it compiles, "
                          "else eager with a warning) or compiler='eager' (no C++ compiler needed).")


@functools.cache
def _warn_once(message: str) -> None:
    log.warning("%s", message)


@functools.cache
def inductor_problem(kind: str) -> str | None:
    """Why Inductor cannot run on device kind `kind` in this process, or None if it can (cached)."""
    if kind == "cuda":
        if not torch.cuda.is_available():
            return "CUDA is not available"
        return None if has_triton() else "Triton is not importable (Inductor's CUDA backend generates Triton kernels)"
    if kind == "cpu":
        started = time.perf_counter()
        try:
            return _cpp_problem() or _kernel_problem()
        finally:
            PROBE_SECONDS[kind] = time.perf_counter() - started
    return f"Inductor is not used on the {kind!r} device (autoremat runs it on cpu and cuda only)"


def _cpp_problem() -> str | None:
    try:
        cxx = inductor_cpp_compiler()
    except Exception as e:  # torch raises its own InvalidCxxCompiler, or OSError from the search
        return f"no working C++ compiler for Inductor's CPU backend ({type(e).__name__}: {e}; set $CXX to one)"
    with tempfile.TemporaryDirectory(prefix="autoremat-cxx-") as tmp:
        src, out = Path(tmp) / "probe.cpp", Path(tmp) / "probe.so"
        src.write_text(_PROBE_SOURCE)
        try:
            run = subprocess.run([cxx, "-shared", "-fPIC", str(src), "-o", str(out)], capture_output=True, text=True,
                                 timeout=PROBE_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired) as e:
            return f"the C++ compiler {cxx!r} did not run ({type(e).__name__}: {e}; set $CXX to a working one)"
        if run.returncode != 0 or not out.exists():
            tail = (run.stderr or run.stdout).strip().splitlines()[-1:] or ["no output"]
            return f"the C++ compiler {cxx!r} failed to build a shared library ({tail[0]}; set $CXX to a working one)"
    return None


def _kernel_problem() -> str | None:
    """Why Inductor's generated C++ does not build or run here, or None (one small kernel compiled)."""
    try:
        inductor_kernel_probe()
    except Exception as e:  # Inductor raises its own CppCompileError, or BackendCompilerFailed wrapping it
        inner = getattr(e, "inner_exception", None) or e
        return (f"Inductor's generated C++ for a small kernel did not build or run here ({type(inner).__name__}: "
                f"{_first_error(str(inner))})")
    return None
