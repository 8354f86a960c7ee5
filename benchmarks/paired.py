"""Paired step timing for the benchmarks: machines drift, so each measured step runs right after a
reference step, and a row is judged by the ratio of the two medians (or the median ratio).

Two rows' ratios to eager, timed minutes apart, are biased by that drift (benchmarks/drift.py); where a
goal compares two methods, `head_to_head` times them against each other instead."""

from __future__ import annotations

import random
import statistics
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


def head_to_head(step_a: Callable[[], object], step_b: Callable[[], object], n: int,
                 sync: Callable[[], object]) -> dict:
    """Time of `step_a` over `step_b`, measured in `n` pairs whose order alternates from pair to pair. Each
    timed step runs right after an untimed step of the same model, as in a training loop (the allocator and
    caches in the state that model's own step leaves), and no third model's step runs between them: unlike
    two ratios to eager, this ratio carries no reference step's noise. Both steps must have run once already.

    Returns ratios (per pair), ratio (their median), noise (half their interquartile range), interval
    (a 90% bootstrap interval of the median), and a_s, b_s: the median seconds of each step. With odd n
    the order b-then-a runs once more than a-then-b."""
    def timed(step: Callable[[], object]) -> float:  # one step, right after an untimed one of the same model
        return paired_times(step, step, 1, sync)[0][0]

    ratios, a_s, b_s = [], [], []
    for i in range(n):
        if i % 2 == 0:
            t_b = timed(step_b)
            t_a = timed(step_a)
        else:
            t_a = timed(step_a)
            t_b = timed(step_b)
        ratios.append(t_a / t_b)
        a_s.append(t_a)
        b_s.append(t_b)
    q1, _, q3 = statistics.quantiles(ratios, n=4)
    return dict(ratios=ratios, ratio=statistics.median(ratios), noise=(q3 - q1) / 2,
                interval=bootstrap_median_interval(ratios), a_s=statistics.median(a_s), b_s=statistics.median(b_s))


def bootstrap_median_interval(ratios: list[float], draws: int = 2000, seed: int = 0) -> tuple[float, float]:
    """The 5th and 95th percentiles of the median over resamples of `ratios` (with replacement): how far the
    median itself could move on another run of as many pairs, unlike the spread of single pairs."""
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(draws))
    return medians[int(0.05 * draws)], medians[int(0.95 * draws) - 1]
