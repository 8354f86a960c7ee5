import os
import sys

import pytest
import torch

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch.set_num_threads(1)
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # examples/ importable

# What a failing test may print of what it captured (stdout, stderr, log), all sections together.
# pyproject.toml already keeps DEBUG/INFO records out of the log capture (log_level); this bounds
# the rest, so the traceback stays on screen.
MAX_CAPTURED_LINES = 50


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
