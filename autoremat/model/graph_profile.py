"""A joint graph described by node name: the `NodeProfile` of each node and the `GraphProfile` of the graph.

`profile.profile_graph` fills them in from FX; the memory model, the schedules, the ILP and the planner read
them without touching FX again. A module of its own that imports nothing of autoremat, so that every module
that reads a profile (inductor_code.py and marks.py, which profile.py calls, among them) can name these
types without importing the profiler.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class NodeProfile:
    name: str
    kind: str  # "param" | "input" | "tangent" | "constant" | "forward" | "backward"
    target: str
    inputs: tuple[str, ...]  # names of the graph nodes this node reads
    storage: str  # name of the node whose allocation holds this value ("" for non-tensors)
    nbytes: int  # bytes this node allocates (0 for aliases and tuple containers)
    transient_bytes: int = 0  # allocated and freed inside this node's step (unused tuple parts)
    flops: float = 0.0
    bytes_moved: float = 0.0
    time_s: float = 0.0
    recompute_ban: str = ""  # why this node may not be recomputed ("" = it may)
    # a custom op with no FLOP formula: time_s is the roofline of the bytes it moves, a stated estimate (_price)
    time_from_bytes: bool = False
    module: str = ""  # nn.Module path, from nn_module_stack
    dtype: str = ""
    shape: tuple[int, ...] = ()
    is_tuple: bool = False  # a multi-output op; its getitem users own the storages
    tuple_out_bytes: int = 0  # for a multi-output op: its used outputs, which exist while it runs
    tuple_parent: str = ""  # for getitem nodes: the multi-output node
    fused: bool = False  # Inductor inlines it into its readers: owns no bytes, never saved (fusion.py)
    inplace: bool = False  # Inductor's own kernel computes it: it may write into an input that dies there (inplace.py)
    writes_into: str = ""  # eager: the dying input whose buffer its out= variant writes (passes/reuse.py)
    writable: tuple[str, ...] = ()  # inputs a recomputed copy may write into if they die at it (recomputed_writes.py)
    # eager: (its output, an input) that a variant of this backward op writes the output over, where the
    # input dies at it (recomputed_writes.write_over_dying_input; the fused LM head's dh over h)
    overwrites: tuple[str, str] = ()
    # Inductor computes it straight into its slice of this backward cat's buffer, which exists from the
    # first such write on (fusion.concat_writes): it owns no buffer of its own (memory._run)
    into: str = ""
    mark: str = ""  # the user's checkpoint policy for it, "must_save", "prefer_recompute", ... (marks.py)
    loss_region: bool = False  # traced from the chunked loss (passes/loss_chunks.py; torch_internals.LOSS_REGION_TAG)
    loss_chunk: int = 0  # which of its chunks, numbered from 1; 0: none (torch_internals.LOSS_CHUNK_TAG)


@dataclass
class GraphProfile:
    nodes: dict[str, NodeProfile]  # in the joint graph's order
    fw_outputs: list[str]  # what the forward returns to the user (incl. buffer updates)
    grad_outputs: list[str]  # gradient outputs of the backward (None entries dropped)
    # backward nodes that hand a parameter's gradient to autograd as soon as it exists (regions.accumulate_grad)
    released: list[str] = field(default_factory=list)
    index: int = 0  # position among the graphs of one step (graph breaks)
    fingerprint: str = ""
    device: str = "cpu"
    notes: list[str] = field(default_factory=list)
    # A region (autoremat.capture.regions): its inputs that an earlier region returned, as primal name ->
    # (that region's index, its output number); its outputs by number; those the user sees.
    sources: dict[str, tuple[int, int]] = field(default_factory=dict)
    user_outputs: list[str | None] = field(default_factory=list)
    exported: list[str] = field(default_factory=list)
    # Gradients of inputs another region of the same step reads too (a tied embedding / LM head, or an
    # earlier region's output two regions read): gradient output -> a key naming the input, the same in
    # every region that reads it. Autograd sums such gradients in the input's one buffer (AccumulateGrad,
    # or the producing region's backward), so the one computed first waits for the others.
    tied: dict[str, str] = field(default_factory=dict)

    def forward_side(self) -> list[str]:
        return [n for n, p in self.nodes.items() if p.kind == "forward"]
