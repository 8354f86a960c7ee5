import os
import shutil
import sys
import tempfile

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Inductor keeps compiled kernels on disk, by default in /tmp/torchinductor_<user>, and that outlives
# the run: a kernel built by another torch (.ci/run's torch 2.11 pass shares /tmp) or under another CPU
# capability is then loaded by this one. Seen: after a run with the machine's own capability,
# ATEN_CPU_CAPABILITY=default failed to build against the cached headers ("'at::vec' has not been
# declared"), and a CI run aborted inside a cached kernel in test_measure.py. So each test session
# compiles into a directory of its own (pytest-xdist's workers inherit the controller's, which the
# controller removes at the end); a directory the caller names is used as it is.
_OWN_INDUCTOR_CACHE = None
if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    _OWN_INDUCTOR_CACHE = tempfile.mkdtemp(prefix="autoremat-tests-inductor-")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = _OWN_INDUCTOR_CACHE

import torch  # noqa: E402  (after the cache directory is set)

torch.set_num_threads(1)
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # examples/ importable

# What a failing test may print of what it captured (stdout, stderr, log), all sections together.
# pyproject.toml already keeps DEBUG/INFO records out of the log capture (log_level); this bounds
# the rest, so the traceback stays on screen.
MAX_CAPTURED_LINES = 50


@pytest.fixture
def no_floors_remembered():
    """The test's smallest-peak searches start from no floor an earlier test found, and leave none for a later
    one: a remembered floor is a starting plan, so it would make a search's result depend on the tests run before."""
    from autoremat.solve import solver

    solver.forget_floors()
    yield
    solver.forget_floors()


def _trimmed(sections: list[tuple[str, str]], budget: int = MAX_CAPTURED_LINES) -> list[tuple[str, str]]:
    """Keep the last lines of the captured sections, latest section first, `budget` lines in all."""
    kept = []
    for title, text in reversed(sections):
        if not title.startswith("Captured "):
            kept.append((title, text))
            continue
        lines = text.splitlines()
        tail = lines[max(0, len(lines) - budget):] if budget > 0 else []
        budget -= len(tail)
        if len(tail) < len(lines):
            tail.insert(0, f"... {len(lines) - len(tail)} earlier line(s) left out "
                           f"(tests/conftest.py shows {MAX_CAPTURED_LINES} captured lines in all)")
        kept.append((title, "\n".join(tail) + "\n"))
    return kept[::-1]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        report.sections = _trimmed(report.sections)


def pytest_unconfigure(config) -> None:
    # Only the process that made the directory removes it; xdist's workers end before the controller.
    if _OWN_INDUCTOR_CACHE is not None and not hasattr(config, "workerinput"):
        shutil.rmtree(_OWN_INDUCTOR_CACHE, ignore_errors=True)
