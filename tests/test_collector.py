"""While a step is planned, the garbage collector's collections skip the objects that existed before
(planning/gc_set_aside.py): they are handed back afterwards, a program's own frozen objects stay frozen, and
the garbage planning makes is still collected."""

import gc
import logging
import weakref

import pytest
import torch

import autoremat
from autoremat import progress
from autoremat.planning.gc_set_aside import INTERPRETER_FROZEN, older_objects_set_aside


class _Cycle:
    def __init__(self) -> None:
        self.me = self


def _handed_back() -> bool:
    """Nothing frozen but the interpreter's own objects (Python 3.12 moves its immortal ones back on a collection)."""
    return gc.get_freeze_count() <= INTERPRETER_FROZEN


def test_objects_are_set_aside_inside_and_handed_back_after() -> None:
    assert _handed_back()
    with older_objects_set_aside():
        assert gc.get_freeze_count() > INTERPRETER_FROZEN
        made = _Cycle()  # garbage made while planning is still collected
        gone = weakref.ref(made)
        del made
        gc.collect()
        assert gone() is None
    assert _handed_back()
    with pytest.raises(RuntimeError), older_objects_set_aside():
        raise RuntimeError("a plan that fails")
    assert _handed_back()


def _frozen(obj: object) -> bool:
    """Whether a tracked object is in the permanent generation (in none of the three `gc.get_objects` lists)."""
    return gc.is_tracked(obj) and not any(o is obj for o in gc.get_objects())


def test_a_program_that_manages_the_collector_itself_is_left_alone() -> None:
    kept = [object()]  # one of the program's objects
    gc.freeze()  # a forking server's own freeze
    try:
        assert _frozen(kept)
        with older_objects_set_aside():
            pass
        assert _frozen(kept)  # not handed back to the collector
    finally:
        gc.unfreeze()
    assert not _frozen(kept)
    gc.disable()
    try:
        with older_objects_set_aside():
            assert _handed_back()
    finally:
        gc.enable()


class _FreezeSeen(logging.Handler):
    """The freeze count when each planning stage starts."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.seen: list[tuple[str, int]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.seen.append((record.getMessage(), gc.get_freeze_count()))


def test_optimize_and_a_new_shape_plan_with_older_objects_set_aside() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16))
    seen = _FreezeSeen()
    logger = logging.getLogger(progress.LOGGER)
    logger.addHandler(seen)
    level, logger.level = logger.level, logging.INFO
    try:
        om = autoremat.optimize(model, budget="1GB", example_inputs=(torch.randn(4, 16),), compiler="eager",
                                progress=False, cache=False)
        assert _handed_back()
        planned = len(seen.seen)
        om(torch.randn(6, 16)).sum().backward()  # a new input shape: planned again
    finally:
        logger.removeHandler(seen)
        logger.setLevel(level)
    assert _handed_back()
    # a stage's start, not the pulse a stage that runs for seconds repeats ("...: still running, ...")
    captures = [frozen for message, frozen in seen.seen if message == "capturing the training step"]
    assert planned and len(seen.seen) > planned and len(captures) == 2, seen.seen
    assert all(frozen > INTERPRETER_FROZEN for frozen in captures), seen.seen
