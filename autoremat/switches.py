"""The switches that turn one of autoremat's optimisations off, all in one place.

Each optimisation below is meant to change how long planning takes, not what is planned or computed: a
plan made with one switched off is the same plan, reached the slow way. The switch exists so that a benchmark can time
both ways in one process and a test can check that both ways agree. Every switch is on by default, and a
user has no reason to turn one off.

    remember   The simulator's memos (model/memory.py, `GraphMemo`): what it worked out for a graph (its
               schedule for a saved set, Inductor's kernel order, its last uses) is reused while the graph
               and the question are the same. Off: every answer is worked out afresh.
               benchmarks/floor_search.py times the smallest-peak search both ways.
    swap       The planned step compiled from the trace it was planned on (planning/planned_in_place.py):
               each graph's joint graph is partitioned with the plan and put behind the captured code.
               Off: the step is traced again with the plan, a large share of a plan's time
               (benchmarks/plan_time.py --quick times the stages); tests/test_planned_in_place.py
               compares the two ways' traces, gradients and peaks.
    reuse      Identical regions traced once (planning/same_regions.py): a repeated block takes the first
               identical block's compiled code and a copy of its profile. Off: every region is traced.
               benchmarks/plan_time.py --variants eager,eager-traced (inductor, inductor-traced) times both.
    set_aside  The garbage collector skips the objects that existed before planning (planning/gc_set_aside.py,
               `gc.freeze`). Off: planning runs with the collector as the program left it.
               benchmarks/plan_time.py --gc times both.

Each module reads its switch where it acts (`current().reuse`), so a change takes effect at once:

    with switches.off("reuse"):          # these switched off, the others as they were
        ...
    with switches.using(reuse=flag):     # set to the given values
        ...

This module imports nothing of autoremat: every stage may import it.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator


@dataclasses.dataclass(frozen=True)
class Switches:
    """Which optimisations are on (module docstring: what each one does)."""

    remember: bool = True
    swap: bool = True
    reuse: bool = True
    set_aside: bool = True


_current = Switches()


def current() -> Switches:
    """The switches as they are now."""
    return _current


@contextlib.contextmanager
def using(**values: bool) -> Iterator[Switches]:
    """The body runs with the named switches set to `values`, the others as they were; on leaving, every
    switch is as it was on entry. A name that is not a switch raises TypeError."""
    global _current
    before = _current
    _current = dataclasses.replace(before, **values)
    try:
        yield _current
    finally:
        _current = before


def off(*names: str) -> contextlib.AbstractContextManager[Switches]:
    """The body runs with the named switches off (`using` with each of them False)."""
    return using(**dict.fromkeys(names, False))
