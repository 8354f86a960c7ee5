"""How a value recomputed a second time is named: `<value>__again<k>`, and `base` gives the value's own
name back. The schedule (model/cuts.py, model/schedule.py) makes such names, the split (passes/remat.py)
and every stage that reads a schedule or a plan read them."""

from __future__ import annotations

import functools

MARK = "__again"


@functools.lru_cache(maxsize=1 << 16)  # called for every entry of every simulated schedule
def base(name: str) -> str:
    """The node a (possibly re-emitted) schedule entry computes."""
    return name.partition(MARK)[0]
