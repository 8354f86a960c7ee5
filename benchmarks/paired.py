"""Paired step timing for the benchmarks: machines drift, so each measured step runs right after a
reference step, and a row is judged by the ratio of the two medians (or the median ratio)."""

from __future__ import annotations

import time
from collections.abc import Callable


def paired_times(ref_step: Callable[[], object], step: Callable[[], object], n: int,
                 sync: Callable[[], object]) -> tuple[list[float], list[float]]:
    """Seconds of `n` runs of `step` and of the `ref_step` run just before each (`sync` waits for
    the device). Returns (step times, reference times)."""
    rt, et = [], []
    for _ in range(n):
        sync()
        a = time.perf_counter()
        ref_step()
        sync()
        b = time.perf_counter()
        step()
        sync()
        c = time.perf_counter()
        et.append(b - a)
        rt.append(c - b)
    return rt, et
