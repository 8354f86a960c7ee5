"""Which compiler runs the planned graphs: `compiler="auto"` picks Inductor where it works.

    "eager"     the partitioned FX graphs run as Python (every aten op one call; no C compiler needed)
    "inductor"  torch's Inductor lowers and fuses them (Triton kernels on CUDA, C++ on CPU)
    "auto"      Inductor when this machine can run it for the model's device, else "eager", with
                one warning per reason saying why

Inductor needs, on CUDA, Triton importable; on CPU, a C++ compiler that builds a shared library (the
one Inductor would call: `$CXX`, else g++). Each probe runs once per process and device kind and is
cached, and the fallback is logged once (a warning on the `autoremat` logger); the CPU probe compiles a one-line library with that compiler (a fraction of a second).
"""

from __future__ import annotations

import functools
import logging
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from autoremat.torch_internals import has_triton, inductor_cpp_compiler

COMPILERS = ("auto", "eager", "inductor")
log = logging.getLogger("autoremat")
PROBE_TIMEOUT_S = 60.0
_PROBE_SOURCE = 'extern "C" int autoremat_probe(int x) { return x + 1; }\n'


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
    _warn_once(f"autoremat: compiler='auto' uses the eager FX compiler, not Inductor: {problem}. Pass "
               "compiler='eager' to choose it explicitly (and silence this warning).")
    return CompilerChoice("auto", "eager", problem)


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
        return _cpp_problem()
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
