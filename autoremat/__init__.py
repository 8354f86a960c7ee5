"""autoremat: fit a model's training step into a byte budget by choosing what to recompute.

The pipeline, one folder per stage; each imports only the stages above it (tests/test_layout.py):

    capture/   the step as AOTAutograd joint graphs, a graph per repeated block   (aot, regions, blocks, tracing)
    model/     bytes, FLOPs and time per node; the exact memory schedule of a plan; the ledger
    solve/     save or recompute (and dtypes): the ILP, its heuristics, the simulator's checks
    planning/  the pipeline the faces call: capture -> model -> solve -> passes -> compile -> verify -> Plan
    faces      api (optimize), remat_module, fit, backend, lightning, cli, plots, progress: at the top of the package

passes/ holds the graph rewrites, a library every stage may call (it imports no stage but a few helpers
of model/); measure, units, switches (an optimisation turned off, to compare) and torch_internals (every
private torch API) sit at the top, used by all.
docs/architecture.md follows the data, and the budget, from a face to the ILP and back.

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
    "BudgetError": "autoremat.planning.plan",
    "Plan": "autoremat.planning.plan",
    "PlanOptions": "autoremat.planning.options",
    "CaptureError": "autoremat.planning.planner",
    "RematModule": "autoremat.remat_module",
    "optimize": "autoremat.api",
    "PlanMismatch": "autoremat.planning.planner",
    "backend": "autoremat.backend",
    "FitConfig": "autoremat.fit",
    "fit": "autoremat.fit",
    "measure_peak": "autoremat.measure",
    "PeakMeasurement": "autoremat.measure",
}

__all__ = ["BudgetError", "CaptureError", "FitConfig", "PeakMeasurement", "Plan", "PlanMismatch", "PlanOptions", "RematModule",
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
