"""Planning progress for Python users: the stages on stderr once planning has taken a while.

The library reports each stage at INFO on the `autoremat.progress` logger ("capturing the training
step", "solving for ... nodes", "verifying the plan on a real step"). The command line shows them
with its spinner (`cli_support.Progress`). In Python, `optimize(..., progress=True)` (the default)
shows them on stderr, but only once planning has run for `AFTER_S` seconds, so quick plans print
nothing, and only when the user has not configured logging: a logging setup of their own (a
handler anywhere up the logger tree, e.g. `logging.basicConfig`) decides what they see instead.

No stage stays silent for long (a long silence on a deep model reads as a hang): while anyone
listens, `pulse()` repeats the current stage every `PULSE_S` seconds without a new one, with the
seconds spent in it and how far along it is (`along`: what the running stage last said of its
progress through `planner.along`, e.g. the graphs traced so far).
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import time
from collections.abc import Iterator

from autoremat.planning import planner

LOGGER = "autoremat.progress"
AFTER_S = 2.0  # planning shorter than this prints nothing
PULSE_S = 3.0  # a stage silent this long is repeated: below 5 s between lines even when a loaded CPU delays the pulse
_muted = 0  # > 0 inside `muted()`: the stages of inner planning runs are not shown


class StageLines(logging.Handler):
    """Writes `autoremat: <stage> ... (<elapsed> s)` to stderr for each stage, from `after_s` on.

    Stages logged before `after_s` are held; when `after_s` passes, a timer writes the current
    one, so a long first stage is shown while it runs, not when the next one starts.
    """

    def __init__(self, after_s: float = AFTER_S) -> None:
        super().__init__(logging.INFO)
        self.after_s = after_s
        self.t0 = time.perf_counter()
        self.lock_ = threading.Lock()
        self.current: str | None = None
        self.shown = False
        self.timer = threading.Timer(after_s, self._reveal)
        self.timer.daemon = True
        self.timer.start()

    def _write(self, text: str) -> None:
        stream = sys.stderr  # looked up at write time: a redirected stderr (capture, notebooks) gets it
        stream.write(f"autoremat: {text} ({time.perf_counter() - self.t0:.1f} s)\n")
        stream.flush()

    def _reveal(self) -> None:
        with self.lock_:
            self.shown = True
            if self.current is not None:
                self._write(f"{self.current} ...")

    def emit(self, record: logging.LogRecord) -> None:
        if _muted:
            return
        with self.lock_:
            self.current = record.getMessage()
            if self.shown:
                self._write(f"{self.current} ...")

    def finish(self) -> None:
        self.timer.cancel()
        with self.lock_:
            if self.shown:
                self._write("planned")


@contextlib.contextmanager
def stages_on_stderr(enabled: bool, after_s: float | None = None) -> Iterator[None]:
    """Show the planning stages inside this block (see the module docstring). Nested blocks, the
    CLI's spinner and a user's own logging set-up each leave it to what is already there."""
    logger = logging.getLogger(LOGGER)
    if not enabled or logger.hasHandlers() or logger.filters:
        yield
        return
    handler = StageLines(AFTER_S if after_s is None else after_s)
    saved_level = logger.level
    logger.setLevel(logging.INFO)  # INFO records are not even made at the default WARNING
    logger.addHandler(handler)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(saved_level)
        handler.finish()


@contextlib.contextmanager
def muted() -> Iterator[None]:
    """Inner planning runs whose stages would only be noise (fit's meta candidates): the outer run
    reports one line per candidate instead."""
    global _muted
    _muted += 1
    try:
        yield
    finally:
        _muted -= 1


class _Pulse(logging.Filter):
    """Repeats the current stage while no new one comes (see `pulse`)."""

    def __init__(self, every_s: float) -> None:
        super().__init__()
        self.every_s = every_s
        self.stage: str | None = None
        self.since = self.last = time.perf_counter()
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def filter(self, record: logging.LogRecord) -> bool:
        # A logger filter sees every record of the logger, whoever handles it (the CLI's spinner, our
        # stderr lines, the user's logging), so the pulse follows the stages without printing itself.
        if record.levelno == logging.INFO:
            now = time.perf_counter()
            if not getattr(record, "pulse", False):
                self.stage, self.since = record.getMessage(), now
                planner.along(None)
            self.last = now
        return True

    def _run(self) -> None:
        logger = logging.getLogger(LOGGER)
        while not self.done.wait(0.25):
            now = time.perf_counter()
            if self.stage is None or now - self.last < self.every_s:
                continue
            where = planner.along_now()
            detail = f"; {where}" if where else ""
            logger.info("%s: still running, %.0f s in this stage%s", self.stage, now - self.since, detail,
                        extra={"pulse": True})


@contextlib.contextmanager
def pulse(every_s: float | None = None) -> Iterator[None]:
    """While planning runs, repeat a stage silent for `every_s` (default PULSE_S) seconds, if anyone
    listens to the progress logger at INFO (our stderr lines, the CLI's spinner, the user's logging)."""
    logger = logging.getLogger(LOGGER)
    if not logger.isEnabledFor(logging.INFO) or any(isinstance(f, _Pulse) for f in logger.filters):
        yield  # nobody would see it, or an outer planning run pulses already
        return
    beat = _Pulse(PULSE_S if every_s is None else every_s)
    logger.addFilter(beat)
    beat.thread.start()
    try:
        yield
    finally:
        beat.done.set()
        beat.thread.join()
        logger.removeFilter(beat)
        planner.along(None)
