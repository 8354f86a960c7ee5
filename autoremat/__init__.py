"""autoremat: fit a model's training step into a byte budget by choosing what to recompute.

Pipeline, each stage importing only earlier ones:
capture -> profile -> memory (+ ledger) -> heuristics -> solver -> passes -> plan -> api / fit / backend / cli
"""

from autoremat.api import RematModule, optimize
from autoremat.backend import PlanMismatch, backend
from autoremat.fit import FitConfig, fit
from autoremat.plan import BudgetError, Plan
from autoremat.units import format_bytes, parse_budget

__all__ = ["BudgetError", "FitConfig", "Plan", "PlanMismatch", "RematModule", "backend", "fit", "format_bytes",
           "optimize", "parse_budget"]
