"""Capture: the dropout decomposition draws what eager draws, and joint graphs come out whole."""

import pytest
import torch
import torch.nn.functional as F

from autoremat.capture import _native_dropout, capture
from examples import models


@pytest.mark.parametrize("shape,transpose", [((64, 257), None), ((4, 16, 32), (1, 2)), ((2, 3, 8, 8), (1, 3))])
@pytest.mark.parametrize("p", [0.1, 0.3, 0.5])
def test_dropout_decomposition_is_bit_exact_with_eager(shape, transpose, p):
    x = torch.randn(*shape)
    if transpose:
        x = x.transpose(*transpose)
    torch.manual_seed(3)
    eager = F.dropout(x, p, training=True)
    torch.manual_seed(3)
    out, mask = _native_dropout(x, p, True)
    assert torch.equal(out, eager)
    assert mask.dtype == torch.bool and torch.equal(mask, eager != 0)


def test_dropout_mask_is_saved_not_the_output():
    model, ex = models.transformer_stack(n_layer=1, d=32, seq=8, dropout=0.2)
    (g,) = capture(model, ex)
    ops = [str(n.target) for n in g.joint.graph.nodes if n.op == "call_function"]
    assert "aten.bernoulli.p" in ops and "aten.native_dropout.default" not in ops


def test_meta_models_trace_their_loss_backward():
    with torch.device("meta"):
        model, batch = models.gpt2(n_layer=1, n_embd=32, n_head=2, seq=16)
    real_model, real_batch = models.gpt2(n_layer=1, n_embd=32, n_head=2, seq=16)
    from autoremat.capture import aot_backend, compile_fresh, default_split

    sizes = []
    for m, b in ((model, batch), (real_model, real_batch)):
        graphs = []

        def record(cg, graphs=graphs):
            graphs.append(len(cg.joint.graph.nodes))
            return default_split(cg)

        compile_fresh(m, aot_backend(record))(**b)
        sizes.append(graphs)
    assert sizes[0] == sizes[1]  # the meta trace has the same joint graph, cross-entropy backward included
