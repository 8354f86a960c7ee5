"""The value the capture hands to planning for each graph: a joint forward+backward graph and what
AOTAutograd said about it. A module of its own, so that the capture's code (aot.py, graph_code.py) and every
later stage can name it without importing one another."""

from __future__ import annotations

from dataclasses import dataclass

import torch.fx as fx

from autoremat.capture.regions import RegionLinks


@dataclass
class CapturedGraph:
    """One joint forward+backward graph and what AOTAutograd told us about it."""

    joint: fx.GraphModule
    num_fwd_outputs: int
    static_input_indices: list[int]  # primals that live across steps: parameters and buffers
    index: int  # order of this graph within the step (several when the model has graph breaks)
    device: str  # device of the traced tensors ("cpu", "cuda", "meta")
    links: RegionLinks | None = None  # for a region: how it connects to its neighbours (autoremat.capture.regions)
    compiler: str = "eager"  # what will run the partitioned graphs: "inductor" fuses pointwise ops (fusion.py)
    region_key: tuple | None = None  # for a region that `SameRegions` may reuse: what its trace depends on
