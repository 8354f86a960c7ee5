"""autoremat: fit a model's training step into a byte budget by choosing what to recompute.

Pipeline, each stage importing only earlier ones:
capture (+ regions) -> profile -> memory (+ lifetimes, ledger, optimizers) -> decision -> heuristics -> ilp -> solver -> plan
-> planner -> pipeline -> faces: api / fit / backend / cli
The graph passes (passes/) and torch_internals import no stage (passes/dtypes.py reads precision's
call helpers), so any stage may use them: capture applies the decompositions, the planner the split.

The public names below are imported on first use (PEP 562), so that `import autoremat` and
`autoremat --help` do not pay for importing torch.
"""

import importlib
import sys
import types

# public name -> the module that defines it, in pipeline order
_EXPORTS = {
    "format_bytes": "autoremat.units",
    "parse_budget": "autoremat.units",
    "BudgetError": "autoremat.plan",
    "Plan": "autoremat.plan",
    "CaptureError": "autoremat.planner",
    "RematModule": "autoremat.remat_module",
    "optimize": "autoremat.api",
    "PlanMismatch": "autoremat.planner",
    "backend": "autoremat.backend",
    "FitConfig": "autoremat.fit",
    "fit": "autoremat.fit",
    "measure_peak": "autoremat.measure",
    "PeakMeasurement": "autoremat.measure",
}

__all__ = ["BudgetError", "CaptureError", "FitConfig", "PeakMeasurement", "Plan", "PlanMismatch", "RematModule",
           "backend", "fit", "format_bytes", "measure_peak", "optimize", "parse_budget"]


def __getattr__(name: str) -> object:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'autoremat' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


class _Package(types.ModuleType):
    """The import system binds every loaded submodule on its package (autoremat.backend = <module>).
    `backend` and `fit` are both submodules and the public functions exported here; the functions
    must win, whichever is imported first, as they did when this file imported them eagerly."""

    def __setattr__(self, name: str, value: object) -> None:
        if isinstance(value, types.ModuleType) and name in _EXPORTS:
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
