"""The garbage collector while a step is planned: the objects that existed before are set aside.

Planning makes a great many short-lived objects (dynamo's and AOTAutograd's traces, FX graphs, the
simulator's timelines), so CPython's collector runs often, and now and then it runs a full collection,
which walks every object the process tracks: the user's model, torch's and transformers' modules and
classes. In a process holding hundreds of thousands of such objects one full collection is a noticeable
share of a small model's plan, paid or not depending on where the plan happens to cross the collector's
threshold, so the same plan's time varies from run to run (`benchmarks/plan_time.py --gc` times plans with and
without this, side by side).

`gc.freeze` moves every tracked object to a permanent generation that collections skip, and
`gc.unfreeze` hands them back to the oldest generation afterwards. While planning, a collection then walks
only what planning made. What planning frees is freed as before: reference counting frees nearly all of
it, and the cycles it makes are still collected. Cycles among the older objects that become garbage
during the plan wait for the first full collection after it. `gc.unfreeze` hands back every frozen object,
so where the program has frozen objects itself (since autoremat was imported), nothing is done.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

from autoremat import switches

# The objects in the permanent generation that are the interpreter's own: those frozen when autoremat was
# imported. Python 3.12 keeps its immortal objects there (375 tuples on 3.12.1), and moves them back on every
# full collection after an unfreeze; 3.10, 3.11 and 3.13 start with none. More than this means the program
# froze objects itself.
INTERPRETER_FROZEN = gc.get_freeze_count()


@contextlib.contextmanager
def older_objects_set_aside() -> Iterator[None]:
    """Collections inside skip the objects that existed on entry (module docstring). Nothing is done where
    the collector is off, or where the program has frozen objects itself (a forking server freezes its objects
    before it forks): unfreezing afterwards would undo that."""
    if not switches.current().set_aside or not gc.isenabled() or gc.get_freeze_count() > INTERPRETER_FROZEN:
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
