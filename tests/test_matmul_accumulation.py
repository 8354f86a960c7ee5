"""A weight's gradient summed over the matmuls that read it is accumulated by those matmuls
(autoremat.passes.matmul_accumulation): the chunked loss's vocabulary projection, read once per chunk, holds
one running sum of its gradient in the backward, not one product per chunk, under both compilers."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from autoremat.capture.aot import aot_backend, capture, compile_fresh, default_split
from autoremat.measure import measure_peak
from autoremat.passes.loss_chunks import chunked_cross_entropy
from autoremat.planning.compilers import inductor_problem
from tests.tolerances import assert_grads_close

ROWS, HIDDEN, VOCAB = 256, 256, 1024  # one product of the weight gradient: VOCAB x HIDDEN fp32, 1 MiB


class ChunkedHead(nn.Module):
    def __init__(self, chunks: int, transposed: bool = False, bias: bool = False) -> None:
        super().__init__()
        self.chunks, self.transposed = chunks, transposed
        shape = (HIDDEN, VOCAB) if transposed else (VOCAB, HIDDEN)
        gen = torch.Generator().manual_seed(0)
        self.weight = nn.Parameter(torch.randn(*shape, generator=gen) / HIDDEN**0.5)
        self.bias = nn.Parameter(torch.randn(VOCAB, generator=gen)) if bias else None

    def forward(self, h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return chunked_cross_entropy(h, self.weight, self.bias, y, proj="matmul" if self.transposed else "linear",
                                     chunks=self.chunks, ignore_index=-100, reduction="mean", label_smoothing=0.0,
                                     dtype=None)


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return torch.randn(ROWS, HIDDEN, generator=gen), torch.randint(0, VOCAB, (ROWS,), generator=gen)


@pytest.mark.parametrize("form", ["linear", "transposed", "bias"])
def test_the_weight_gradient_is_accumulated_by_the_matmuls_and_matches_eager(form):
    """Four chunks: three products accumulated into the running sum (a bias's column sums are left to adds)."""
    model = ChunkedHead(chunks=4, transposed=form == "transposed", bias=form == "bias")
    h, y = batch()
    graph = capture(model, (h, y))[0].joint.graph
    targets = [n.target for n in graph.nodes]
    forward = 4 if form == "bias" else 0  # each chunk's biased projection
    assert targets.count(torch.ops.aten.addmm.default) == forward + 3, graph

    model(h, y).backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    compiled = compile_fresh(model, aot_backend(default_split))
    compiled(h, y).backward()
    assert_grads_close([(p.grad, e) for p, e in zip(model.parameters(), expected, strict=True)], depth=ROWS)


def _inductor_peak(chunks: int) -> int:
    model = ChunkedHead(chunks)
    h, y = batch()
    compiled = compile_fresh(model, aot_backend(default_split, compiler="inductor"))

    def step() -> None:
        compiled(h, y).backward()

    step()
    _, m = measure_peak(step, baseline_objs=(model, h, y))
    return m.peak_bytes


def test_under_inductor_more_chunks_do_not_hold_more_products():
    """Inductor fuses a chain of adds into one loop over all its inputs: summed by adds, the 8-chunk
    backward holds 8 weight-gradient products (1 MiB each) where the 2-chunk one holds 2. Accumulated by the
    matmuls, what more chunks add (each chunk's small saved values) is under one product."""
    problem = inductor_problem("cpu")
    if problem is not None:
        pytest.skip(f"this machine cannot run Inductor on CPU: {problem}")
    two, eight = _inductor_peak(2), _inductor_peak(8)
    product = VOCAB * HIDDEN * 4
    assert eight - two < product, (two, eight, product)
