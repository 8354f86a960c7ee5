"""The gradient error every comparison in the project uses (autoremat.measure.grad_rel_err, and its
per-parameter form with a floor), pinned on the case that fooled a per-parameter maximum: a parameter
whose true gradient is zero holds rounding noise in both runs."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from autoremat.measure import GRAD_NOISE_FLOOR, grad_rel_err, param_rel_errs
from tests.tolerances import assert_grads_close

torch.set_num_threads(1)


class Attention(nn.Module):
    """Softmax attention without rotary embeddings: adding k.bias to every key adds the same q . k.bias
    to every score of a query, which softmax ignores, so k.bias's true gradient is zero."""

    def __init__(self, d: int = 32):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x):
        s = self.q(x) @ self.k(x).transpose(-1, -2) / x.shape[-1] ** 0.5
        return self.o(s.softmax(-1) @ self.v(x))


def _grads(model: nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    model(x).square().mean().backward()
    return {n: p.grad.detach().float().clone() for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def grads():
    torch.manual_seed(0)
    model, x = Attention(), torch.randn(4, 16, 32)
    ref = _grads(model, x)  # fp32: k.bias is fp32 rounding noise
    exact = _grads(model.double(), x.double())  # fp64: the same step with far less noise
    return ref, exact


def test_a_zero_gradient_holds_noise_that_a_per_parameter_ratio_reads_as_an_error(grads):
    ref, exact = grads
    largest = max(r.norm() for r in ref.values())
    assert ref["k.bias"].norm() < 1e-5 * largest  # zero in exact arithmetic: only rounding is left
    # the unfloored per-parameter ratio, which this metric replaces: O(1) from two roundings of zero
    assert (exact["k.bias"] - ref["k.bias"]).norm() / ref["k.bias"].norm() > 0.1


def test_rounding_noise_gives_a_small_error(grads):
    ref, exact = grads
    assert grad_rel_err(exact, ref) < 1e-5
    per = param_rel_errs(exact, ref)
    assert set(per) == set(ref) and max(per.values()) < 1e-3, per
    assert_grads_close([(exact[n], ref[n], n) for n in ref], depth=64)


def test_a_one_percent_error_in_one_large_parameter_is_detected(grads):
    ref, exact = grads
    name = max(ref, key=lambda n: ref[n].norm())
    wrong = {**exact, name: exact[name] * 1.01}
    share = (ref[name].norm() / torch.cat([r.flatten() for r in ref.values()]).norm()).item()
    assert grad_rel_err(wrong, ref) == pytest.approx(0.01 * share, rel=1e-2)
    assert grad_rel_err(wrong, ref) > 1e-3  # a hundred times the noise above
    per = param_rel_errs(wrong, ref)
    assert max(per, key=per.get) == name and per[name] == pytest.approx(0.01, rel=1e-2)
    with pytest.raises(AssertionError):
        assert_grads_close([(wrong[n], ref[n], n) for n in ref], depth=64)


def test_the_floor_and_the_edge_cases():
    ref = {"big": torch.ones(4), "zero": torch.zeros(4)}
    noisy = {"big": torch.ones(4), "zero": torch.full((4,), 1e-9)}
    # the zero-gradient parameter is measured against GRAD_NOISE_FLOOR x the largest gradient's norm
    assert param_rel_errs(noisy, ref)["zero"] == pytest.approx(2e-9 / (GRAD_NOISE_FLOOR * 2))
    assert grad_rel_err(noisy, ref) == pytest.approx(2e-9 / 2)
    assert grad_rel_err({"big": ref["big"]}, ref) == float("inf")  # a parameter missing: not comparable
    assert param_rel_errs({"big": ref["big"]}, ref) == {"parameter sets differ": float("inf")}
    assert grad_rel_err([torch.zeros(2)], [torch.zeros(2)]) == 0.0
    assert grad_rel_err(torch.ones(3), torch.ones(3)) == 0.0
