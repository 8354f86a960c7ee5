"""Solve: which values to save, which to recompute, and (precision="auto") each call's dtype.

`decision` replays a plan's saved sets in the memory model; `heuristics` and `cut_search` give plans
without an ILP and refine the ILP's; `ilp` builds the PuLP model (its data, variables, rows and
objective; through `lp`, the one module that speaks PuLP); `solver` solves it, checked and calibrated by the simulator,
within `solver_options` (the solver, time limit and gap).
Imports `model/`, `capture/`, `passes/` and the shared modules.
"""
