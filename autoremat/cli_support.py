"""What the command line needs besides its parser: a progress line on the terminal, and loading the
model a `plan` target names ("examples/models.py:gpt2_small", "my_pkg.models:build").

Kept apart from autoremat.cli so that `autoremat --help` stays a parser and nothing else.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import inspect
import logging
import os
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

# The library reports its stages here at INFO level; Progress shows them, `logging` users see them too.
PROGRESS_LOGGER = "autoremat.progress"

# Real CPU tensors are used only when meta tracing fails; above this many parameter bytes that
# would take real memory the user did not ask for, so we stop with the meta error instead.
REAL_FALLBACK_MAX_PARAM_BYTES = 2**30


class UsageError(Exception):
    """Bad input from the user: exit code 2, message without a traceback."""


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
        raise UsageError(f"{name}({call_args(kwargs)}) raised {type(e).__name__}: {e}") from e
    if not (isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], torch.nn.Module)):
        raise UsageError(f"{name}() must return (model, example_inputs) with an nn.Module first; "
                         f"got {type(result).__name__}")
    inputs = result[1]
    values = inputs.values() if isinstance(inputs, dict) else inputs if isinstance(inputs, (tuple, list)) else [inputs]
    empty = [tuple(v.shape) for v in values if isinstance(v, torch.Tensor) and v.numel() == 0]
    if empty:  # a step over nothing would get a plan for 0-byte inputs: a wrong answer, not an error
        raise UsageError(f"{name}({call_args(kwargs)}) returned an example input with no elements (shape "
                         f"{empty[0]}); every input needs at least one element: check the batch and length options")
    return result


def call_args(kwargs: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in kwargs.items())


@contextlib.contextmanager
def quiet_meta_warnings() -> Iterator[None]:
    # Tracing the backward of meta tensors makes torch warn that some ops (nll_loss) have no
    # autograd kernel for the meta key; the joint graph is still right, so this says nothing useful.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*autograd kernel was not registered.*")
        yield


# Commands -----------------------------------------------------------------------------------
