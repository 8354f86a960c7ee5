"""Capture: the training step as AOTAutograd joint graphs.

`aot` runs dynamo + AOTAutograd and hands each joint forward+backward graph to the planner (the
decompositions of `passes/decompositions.py` applied); `regions` cuts one dynamo graph into a graph
per repeated block; `tracing` runs the step once while planning it and leaves no trace behind.
Imports only `passes/` and the shared modules (`torch_internals`, `units`, `measure`).
"""
