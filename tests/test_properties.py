"""Property-based: random models from a grammar of real layers, random budgets between the smallest
that fits and the unoptimized peak. For every draw the gradients equal eager's, the measured peak
stays under the budget and the prediction is within 10% of the measurement.

The default profile is small and derandomized (CI-deterministic, about a minute or two);
`-m nightly` runs 60 random (not derandomized) draws: left out of CI, whose runs must repeat.
"""

import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import autoremat
from autoremat.capture.aot import capture
from autoremat.measure import measure_peak
from autoremat.model.profile import profile_graph
from autoremat.planning.plan import Ledger
from tests.budgets import budget_range

# No shrinking in CI: a failure is reported as drawn (shrinking costs minutes); regression cases are below.
settings.register_profile("ci", max_examples=6, deadline=None, derandomize=True, print_blob=True,
                          report_multiple_bugs=False, phases=[Phase.explicit, Phase.generate],
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("nightly", max_examples=60, deadline=None, derandomize=False, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
PROFILE = os.environ.get("AUTOREMAT_HYPOTHESIS_PROFILE", "ci")

LAYERS = ["linear", "conv", "layernorm", "batchnorm", "groupnorm", "residual", "branch_cat", "sdpa",
          "attn_manual", "dropout", "view", "relu_inplace", "tied", "constant"]


class Layer(nn.Module):
    """One production of the grammar, on a (batch, seq, width) activation."""

    def __init__(self, kind: str, d: int, shared: nn.Linear) -> None:
        super().__init__()
        self.kind = kind
        if kind in ("linear", "residual", "view", "relu_inplace", "constant"):
            self.f = nn.Linear(d, d)
        elif kind == "conv":
            self.f = nn.Conv1d(d, d, 3, padding=1)
        elif kind == "layernorm":
            self.f = nn.LayerNorm(d)
        elif kind == "batchnorm":
            self.f = nn.BatchNorm1d(d)
        elif kind == "groupnorm":
            self.f = nn.GroupNorm(2, d)
        elif kind == "branch_cat":
            self.a, self.b, self.f = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(2 * d, d)
        elif kind in ("sdpa", "attn_manual"):
            self.qkv, self.f = nn.Linear(d, 3 * d), nn.Linear(d, d)
        elif kind == "dropout":
            self.f = nn.Dropout(0.3)
        elif kind == "tied":
            self.shared = shared  # the same Linear as another layer: one parameter, two uses

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k, B, T, D = self.kind, *x.shape
        if k == "linear":
            return F.gelu(self.f(x))
        if k == "conv":
            return self.f(x.transpose(1, 2)).transpose(1, 2)
        if k in ("batchnorm", "groupnorm"):
            return self.f(x.transpose(1, 2)).transpose(1, 2)
        if k == "residual":
            return x + torch.tanh(self.f(x))
        if k == "branch_cat":
            return self.f(torch.cat([torch.sigmoid(self.a(x)), self.b(x).square()], dim=-1))
        if k in ("sdpa", "attn_manual"):
            q, kk, v = (t.view(B, T, 2, D // 2).transpose(1, 2) for t in self.qkv(x).split(D, dim=-1))
            if k == "sdpa":
                y = F.scaled_dot_product_attention(q, kk, v, is_causal=True)
            else:
                y = ((q @ kk.transpose(-2, -1)) / (D // 2) ** 0.5).softmax(-1) @ v
            return x + self.f(y.transpose(1, 2).reshape(B, T, D))
        if k == "view":
            return self.f(x.reshape(B * T, D)).view(B, T, D)
        if k == "relu_inplace":
            return F.relu(self.f(x), inplace=True)
        if k == "tied":
            return torch.tanh(self.shared(x))
        if k == "constant":  # torch.tensor in forward: lifted tensor constants (get_attr nodes) in the joint graph
            return torch.tanh(self.f(x)) * torch.tensor([0.5, 2.0]).repeat(D // 2) + torch.tensor(0.1)
        return self.f(x)  # layernorm, dropout


class Grammar(nn.Module):
    def __init__(self, kinds: list[str], d: int, frozen: list[bool]) -> None:
        super().__init__()
        self.shared = nn.Linear(d, d)
        self.layers = nn.ModuleList(Layer(k, d, self.shared) for k in kinds)
        for layer, freeze in zip(self.layers, frozen):
            for p in layer.parameters(recurse=False) if layer.kind == "tied" else layer.parameters():
                p.requires_grad_(not freeze)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.shared(x))
        for layer in self.layers:
            x = layer(x)
        return x.square().mean()


@st.composite
def draws(draw):
    n = draw(st.integers(2, 5))
    kinds = draw(st.lists(st.sampled_from(LAYERS), min_size=n, max_size=n))
    frozen = draw(st.lists(st.booleans(), min_size=n, max_size=n).map(lambda f: [b and i > 0 for i, b in
                                                                                 enumerate(f)]))
    shape = (draw(st.sampled_from([2, 4])), draw(st.sampled_from([16, 32])), draw(st.sampled_from([16, 32])))
    frac = draw(st.sampled_from([0.0, 0.1, 0.5, 1.0]))
    seed = draw(st.integers(0, 2**16))
    return kinds, frozen, shape, frac, seed


def _grads(model, fn, x):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    loss = fn(x)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]


def check(kinds, frozen, shape, frac, seed):
    torch.manual_seed(seed)
    model = Grammar(kinds, shape[2], frozen)
    x = torch.randn(*shape)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    ref_loss, ref = _grads(model, model, x)
    lo, hi = budget_range(model, (x,))
    hi = max(lo, hi)
    budget = int(lo + frac * (hi - lo))
    model.load_state_dict(state)
    om = autoremat.optimize(model, budget=budget, example_inputs=(x,), compiler="eager")
    model.load_state_dict(state)
    loss, grads = _grads(model, om, x)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    for g, r in zip(grads, ref, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6)

    def step():
        torch.manual_seed(1)
        out = om(x)
        out.backward()

    _, m = measure_peak(step, baseline_objs=(model, x))  # grads exist: the accumulation steady state
    fixed = Ledger.from_dict(om.plan.ledger).fixed
    assert fixed + m.delta_peak_bytes <= budget, (fixed + m.delta_peak_bytes, budget, om.plan.summary())
    assert abs(m.delta_peak_bytes - om.plan.activation_peak) <= 0.10 * m.delta_peak_bytes, (
        m.delta_peak_bytes, om.plan.activation_peak, om.plan.summary())


# Failures the property found, kept as regression cases.
KNOWN = [
    # Batch norm's kernels return a contiguous output for a transposed input, where the fake tensor
    # kept the input's strides: a later view copied (prediction 14% low) or failed in the forward.
    pytest.param((["linear", "batchnorm"], [False, False], (2, 16, 16), 0.0, 0), id="bn-view-after-recompute"),
    pytest.param((["batchnorm", "linear"], [False, False], (2, 16, 16), 0.5, 0), id="bn-output-then-view"),
    # torch.tensor in forward lifts get_attr constants, which the schedule took for forward ops.
    pytest.param((["constant", "linear", "constant"], [False, False, False], (2, 16, 16), 0.0, 0),
                 id="lifted-tensor-constant"),
    pytest.param((["linear", "sdpa"], [False, False], (2, 16, 16), 0.0, 0), id="sdpa-split-views"),
    pytest.param((["linear", "conv"], [False, False], (2, 16, 16), 0.0, 0), id="verified-floor-is-a-budget"),
    pytest.param((["conv", "tied", "groupnorm", "conv", "view"], [False, True, False, True, True], (4, 32, 32), 1.0,
                  43358), id="conv-groupnorm-multi-output"),
    pytest.param((["view", "branch_cat", "conv", "dropout"], [False, True, False, False], (2, 16, 16), 0.5, 635),
                 id="dropout-on-transposed-input"),
]


@pytest.mark.parametrize("case", KNOWN)
def test_regressions(case):
    check(*case)


def test_constant_layer_lifts_tensor_constants():
    """The grammar's "constant" production really reaches the planner as get_attr nodes."""
    (cg,) = capture(Grammar(["constant"], 16, [False]), (torch.randn(2, 16, 16),))
    lifted = [n.target for n in cg.joint.graph.nodes if n.op == "get_attr"]
    assert len(lifted) == 2 and all(t.startswith("_tensor_constant") for t in lifted), lifted
    fp32 = 4  # torch.tensor([0.5, 2.0]) and torch.tensor(0.1): their bytes are said, held outside the plan
    assert any(f"hold {3 * fp32} B" in note for note in profile_graph(cg).notes), profile_graph(cg).notes


@settings(settings.get_profile("ci"))
@given(draws())
def test_random_models_fit_and_match_eager(d):
    check(*d)


@pytest.mark.nightly
@settings(settings.get_profile(PROFILE if PROFILE != "ci" else "nightly"))
@given(draws())
def test_random_models_fit_and_match_eager_nightly(d):
    check(*d)
