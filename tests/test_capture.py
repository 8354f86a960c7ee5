"""Capture: the dropout decomposition draws what eager draws, traced strides are the kernels' own, and joint
graphs come out whole."""

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

import autoremat.capture.aot
from autoremat.capture.aot import capture
from autoremat.model.profile import profile_graph
from autoremat.model.scratch import calibrate_scratch
from autoremat.passes import rng_replay
from autoremat.passes.decompositions import LAYOUT_DECOMPOSITIONS, _native_dropout
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


def test_dropout_is_a_replayable_mask_not_the_fused_op():
    """Dropout is a bool mask drawn by bernoulli (with the generator state saved before the draw) and a
    replay of that draw from the state (autoremat.rng_replay), never the fused native_dropout."""
    model, ex = models.transformer_stack(n_layer=1, d=32, seq=8, dropout=0.2)
    (g,) = capture(model, ex)
    calls = [n for n in g.joint.graph.nodes if n.op == "call_function"]
    assert not any(n.target is torch.ops.aten.native_dropout.default for n in calls)
    draws = [n for n in calls if rng_replay.is_draw(n.target)]
    replays = [n for n in calls if rng_replay.is_replay(n.target)]
    assert len(draws) == len(replays) == 3  # attention probabilities and both residual branches
    assert all(n.args[0] is torch.ops.autoremat.bool_bernoulli.default for n in draws)
    assert all(r.args[0].args[0] in draws for r in replays)  # each replays a saved state


def test_meta_models_trace_their_loss_backward():
    with torch.device("meta"):
        model, batch = models.gpt2(n_layer=1, n_embd=32, n_head=2, seq=16)
    real_model, real_batch = models.gpt2(n_layer=1, n_embd=32, n_head=2, seq=16)
    from autoremat.capture.aot import aot_backend, compile_fresh, default_split

    sizes = []
    for m, b in ((model, batch), (real_model, real_batch)):
        graphs = []

        def record(cg, graphs=graphs):
            graphs.append(len(cg.joint.graph.nodes))
            return default_split(cg)

        compile_fresh(m, aot_backend(record))(**b)
        sizes.append(graphs)
    assert sizes[0] == sizes[1]  # the meta trace has the same joint graph, cross-entropy backward included


class NormOverChannels(torch.nn.Module):
    """BatchNorm1d over the width of a (batch, seq, width) activation: a transposed input."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.f, self.norm = torch.nn.Linear(d, d), torch.nn.BatchNorm1d(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(F.gelu(self.f(x)).transpose(1, 2)).transpose(1, 2).square().mean()


def _relaid_notes(monkeypatch, layout_decompositions: dict) -> list[str]:
    monkeypatch.setattr(autoremat.capture.aot, "LAYOUT_DECOMPOSITIONS", layout_decompositions)
    torch.manual_seed(0)
    (cg,) = capture(NormOverChannels(16), (torch.randn(2, 8, 16),))
    gp = profile_graph(cg)
    calibrate_scratch(cg, gp)  # runs every kernel on real tensors of the traced strides
    return [n for n in gp.notes if "strides" in n]


def test_batch_norm_traces_the_strides_its_kernel_returns(monkeypatch):
    # With capture's layout decompositions the traced strides are the real ones.
    assert _relaid_notes(monkeypatch, LAYOUT_DECOMPOSITIONS) == []
    # Traced as is, batch norm keeps a transposed input's strides where its kernels return a
    # contiguous output; calibration notices and says so.
    (note,) = _relaid_notes(monkeypatch, {})
    assert "_native_batch_norm_legit_functional" in note and "native_batch_norm_backward" in note, note


def _laid_out(shape: tuple[int, ...], order: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A dense tensor of `shape` whose dimensions lie in memory in `order` (outermost first)."""
    t = torch.randn([shape[d] for d in order]).to(dtype)
    return t.permute([order.index(d) for d in range(len(shape))])


def _bn_args(op, shape, x_order, grad_order=None) -> tuple:
    x, c = _laid_out(shape, x_order), shape[1]
    ones, zeros = torch.ones(c), torch.zeros(c)
    if op is AT._native_batch_norm_legit_functional.default:
        return x, ones, zeros, zeros, ones, True, 0.1, 1e-5
    if op is AT._native_batch_norm_legit_no_training.default:
        return x, ones, zeros, zeros, ones, 0.1, 1e-5
    if op is AT._native_batch_norm_legit.no_stats:
        return x, ones, zeros, True, 0.1, 1e-5
    return _laid_out(shape, grad_order), x, ones, zeros, ones, zeros, ones, True, 1e-5, [True, True, True]


def _ln_backward_args(x_order, grad_order) -> tuple:
    x, d = _laid_out((2, 5, 6), x_order), 6
    mean, rstd = torch.zeros(2, 5, 1), torch.ones(2, 5, 1)
    return _laid_out((2, 5, 6), grad_order), x, [d], mean, rstd, torch.ones(d), torch.zeros(d), [True, True, True]


AT = torch.ops.aten
T3, C3 = (0, 2, 1), (0, 1, 2)  # a transposed and a contiguous (N, C, L)
BN_FORWARD = (AT._native_batch_norm_legit_functional.default, AT._native_batch_norm_legit_no_training.default,
              AT._native_batch_norm_legit.no_stats)
LAYOUT_CASES = {  # op -> input layouts, as functions that build the arguments
    **{op: [lambda op=op, o=o: _bn_args(op, (2, 6, 5), o) for o in (T3, C3)] for op in BN_FORWARD[1:]},
    BN_FORWARD[0]: [lambda s=s, o=o: _bn_args(BN_FORWARD[0], s, o) for s, o in [
        ((2, 6, 5), T3), ((2, 6, 5), C3), ((3, 6), (1, 0)), ((2, 6, 3, 5), (0, 2, 3, 1)), ((2, 6, 3, 5), (1, 0, 2, 3)),
        ((2, 4, 3, 5, 2), (0, 2, 3, 4, 1))]],
    AT.native_batch_norm_backward.default: [
        lambda s=s, xo=xo, go=go: _bn_args(AT.native_batch_norm_backward.default, s, xo, go)
        for s, xo, go in [((2, 6, 5), T3, T3), ((2, 6, 5), T3, C3), ((2, 6, 5), C3, T3),
                          ((2, 6, 3, 5), (0, 2, 3, 1), (0, 1, 2, 3))]],
    AT.native_layer_norm_backward.default: [lambda xo=xo, go=go: _ln_backward_args(xo, go)
                                             for xo, go in [(C3, T3), (T3, C3), (T3, T3)]],
    AT.native_dropout_backward.default: [
        lambda go=go, mo=mo: (_laid_out((2, 5, 6), go), _laid_out((2, 5, 6), mo, torch.bool), 2.0)
        for go, mo in [(T3, C3), (T3, T3), (C3, T3)]],
}


def _out_strides(op, make_args, fake: bool, decompose: bool) -> list[tuple[int, ...]]:
    torch.manual_seed(0)
    with FakeTensorMode() if fake else contextlib.nullcontext():
        args = make_args()
        out = LAYOUT_DECOMPOSITIONS[op](*args) if decompose else NotImplemented
        out = op(*args) if out is NotImplemented else out
        return [tuple(t.stride()) for t in (out if isinstance(out, (tuple, list)) else [out])
                if isinstance(t, torch.Tensor) and t.numel() > 1]


@pytest.mark.parametrize("op", list(LAYOUT_CASES), ids=str)
def test_layout_decompositions_trace_the_real_strides(op):
    """Traced (fake) output strides equal the kernel's real ones under capture's layout decompositions;
    without them some layout disagrees (if PyTorch fixes its fake rule, this tells us the
    decomposition can go)."""
    assert set(LAYOUT_CASES) == set(LAYOUT_DECOMPOSITIONS)
    disagreed = 0
    for make_args in LAYOUT_CASES[op]:
        real = _out_strides(op, make_args, fake=False, decompose=False)
        assert _out_strides(op, make_args, fake=True, decompose=True) == real
        assert _out_strides(op, make_args, fake=False, decompose=True) == real  # same layout, only traced right
        disagreed += _out_strides(op, make_args, fake=True, decompose=False) != real
    assert disagreed, f"{op}: the fake-tensor rule now matches the kernel"
