"""Measure a training step that someone else's code runs: from its first graph call to the end of its backward.

The torch.compile backend (step_planner.py) cannot call the step itself. It opens a `StepWindow` when
the step's first graph runs; `close_after_backward()` (from a hook that fires during the backward)
asks the autograd engine to call back when the whole backward is done. `on_done` then receives the
activation bytes: the peak above what was allocated when the window opened, less the `.grad` buffers
that appeared inside it (a first micro-step's gradients, which a ledger counts as fixed memory).

- CUDA: the caching allocator's counters (`measure.PeakMeter`), read in the engine's callback.
- CPU: the profiler's allocation events (the record `autoremat.measure` reads). A profiler cannot be
  stopped from inside the autograd engine: the engine restores its thread-local profiler state after
  its callbacks, leaving a half-stopped profiler enabled. So the callback only marks the end of the
  backward (a `record_function` event, on the profiler's own clock) and sets a one-shot
  `sys.setprofile` hook on its thread that stops the profiler (`finish`) when the Python function the
  engine was entered from (torch.autograd.graph._engine_run_backward) returns: the first moment
  outside the engine, before the user's `.backward()` call returns. Allocations after the mark do
  not count. Where that hook cannot be set (another Python profiler such as cProfile holds the
  thread's hook, or the callback runs on another thread), the profiler runs until the backend's next
  graph call stops it (`pending`), and a profiler of the user's own cannot start in between. When a
  profiler is running as the window would open, the step is not measured (profilers can't nest).
"""

from __future__ import annotations

import os
import sys
import threading
import warnings
from collections.abc import Callable
from types import FrameType

import torch
from torch.profiler import ProfilerActivity, profile

from autoremat.measure import PeakMeter, allocation_deltas, max_running_sum
from autoremat.torch_internals import backward_entry_code, in_backward, profiler_enabled, queue_callback

MARK = "autoremat::backward_done"


class StepWindow:
    """One step measured from now to the end of its backward (module docstring)."""

    def __init__(self, device: torch.device, params: list[torch.Tensor], on_done: Callable[[int], None]) -> None:
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"StepWindow measures on cpu or cuda; got {device}")
        self.device, self.on_done = device, on_done
        self.gradless = [p for p in params if p.grad is None]
        self.queued = self.marked = False
        self.thread = threading.get_ident()
        self.meter: PeakMeter | None = None
        self.prof: profile | None = None
        if device.type == "cuda":
            self.meter = PeakMeter(device=device)
            self.meter.__enter__()
            return
        if profiler_enabled():
            raise RuntimeError("a torch profiler is already active; profilers can't nest")
        os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # as measure.PeakMeter: no kineto banners
        self.prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.prof.start()

    def close_after_backward(self) -> None:
        if not self.queued:
            self.queued = True
            queue_callback(self._done)

    @property
    def pending(self) -> bool:
        """A CPU window whose backward has ended: `finish()` it outside the autograd engine."""
        return self.marked and self.prof is not None

    def cancel(self) -> None:
        """The step never reached the end of a backward (an exception, a forward without one)."""
        if self.meter is not None:
            self.meter.__exit__(RuntimeError, RuntimeError("cancelled"), None)
        elif self.prof is not None:
            if sys.getprofile() == self._on_event:
                sys.setprofile(None)
            self._stop()

    def finish(self) -> None:
        """CPU: stop the profiler (never inside the engine) and hand over the peak up to the backward's end."""
        if sys.getprofile() == self._on_event:  # finished at the next graph call: the hook never fired
            sys.setprofile(None)
        if self.prof is None:
            return
        prof = self._stop()
        end = _mark_time(prof)
        if end is None:  # the mark was not recorded: nothing to say about the step
            return
        deltas = [(t, b) for t, b in allocation_deltas(prof, self.device) if t <= end]
        self._report(max_running_sum(deltas))

    def _stop(self) -> profile:
        prof, self.prof = self.prof, None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            prof.stop()
        return prof

    def _done(self) -> None:
        if self.meter is not None:
            self.meter.__exit__(None, None, None)
            self._report(self.meter.result.delta_peak_bytes)
            return
        with torch.profiler.record_function(MARK):
            self.marked = True
        if threading.get_ident() == self.thread and sys.getprofile() is None:
            sys.setprofile(self._on_event)

    def _on_event(self, frame: FrameType, event: str, arg: object) -> None:
        """The one-shot profile hook: at the return from the engine's entry, stop measuring and report."""
        if event != "return" or frame.f_code is not backward_entry_code() or in_backward():
            return
        self.finish()

    def _report(self, delta: int) -> None:
        fresh = sum(p.grad.untyped_storage().nbytes() for p in self.gradless if p.grad is not None)
        self.on_done(max(0, delta - fresh))


def _mark_time(prof: profile) -> int | None:
    results = prof.profiler.kineto_results if prof.profiler is not None else None
    stack = list(results.experimental_event_tree()) if results is not None else []
    while stack:
        node = stack.pop()
        if node.name == MARK:
            return node.start_time_ns
        stack.extend(node.children)
    return None
