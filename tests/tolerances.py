"""Tolerances for numerical comparisons in the tests, derived from the dtype and the depth of the
computation, never from what one machine printed.

Two computations of the same value differ only by rounding when they run the same mathematics in
a different order or on different kernels (a micro-batched vs a full-batch reduction, a compiled vs
an eager graph, AVX-512 vs AVX2 vs scalar kernels). The bound used here:

- `eps` is the dtype's machine epsilon (torch.finfo: 2**-23 for fp32, 2**-7 for bf16); one rounding
  changes a value by at most u = eps / 2 relative.
- A sum of n terms computed in any order carries at most about n * u * sum|terms| of rounding error
  (Higham, "Accuracy and Stability of Numerical Algorithms", 2nd ed., eq. 4.4); two orders differ by
  at most twice that: n * eps. A chain of steps adds its steps' relative errors to first order, so
  `depth` is the number of roundings behind one compared element along its longest chain, counting a
  reduction over n terms as n (a Linear layer with n inputs, a LayerNorm over n features, a gradient
  summed over n tokens): rtol = depth * eps.
- We take this worst case, linear in depth, and not the random-walk estimate sqrt(depth) * eps: the
  kernels reorder systematically (blocking, vector width), so their errors need not cancel, and a
  tolerance must hold on every CPU, not on average.
- The bound is relative to sum|terms|, not to the element itself: an element whose terms cancel to
  near zero keeps the absolute error of the terms it came from. We stand for that size with the
  largest magnitude of the expected tensor: atol = rtol * max|expected|.

A bug (a wrong recomputation, a dropped term) changes values by O(1) relative, far above these bounds.

Errors against a reference ("is the mixed-precision plan as accurate as autocast?") are themselves
measured from rounded fp32 results: err_x = |x - r| / |r|, with x and r each within one rounding (u)
of their unrounded values, so a measured error is only known to within 2u = eps, and two measured
errors that are equal before rounding can differ by 2 * eps. `as_accurate` allows exactly that.
"""

from __future__ import annotations

import torch


def eps(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps


def tol(dtype: torch.dtype, depth: int, scale: float = 1.0) -> tuple[float, float]:
    """(rtol, atol) for two computations of the same value that round differently along `depth`
    sequential roundings (see the module docstring); `scale` is the magnitude the summed terms have."""
    if depth < 1:
        raise ValueError(f"depth must be a positive count of roundings, got {depth}")
    rtol = depth * eps(dtype)
    return rtol, rtol * scale


def assert_close_for(actual: torch.Tensor, expected: torch.Tensor, *, depth: int,
                     dtype: torch.dtype | None = None, msg: str | None = None) -> None:
    """torch.testing.assert_close with the tolerance of `depth` roundings in `dtype` (default: the
    expected tensor's dtype), scaled by the expected tensor's largest magnitude."""
    scale = expected.detach().abs().max().item() if expected.numel() else 0.0
    rtol, atol = tol(dtype or expected.dtype, depth, scale)
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol, msg=msg)


def as_accurate(err: float, reference_err: float, dtype: torch.dtype = torch.float32) -> bool:
    """True if a measured relative error is no worse than a reference's, up to the 2 * eps that the
    rounding of the compared `dtype` results leaves in any measured error (module docstring)."""
    return err <= reference_err + 2 * eps(dtype)


def batch_depth(inputs) -> int:
    """An upper bound on how many terms any parameter gradient sums over the batch: every element of
    every input tensor. Two correct executions of one model may add those terms in different orders
    (another graph split, another kernel), so this is the depth to compare their gradients at."""
    leaves = torch.utils._pytree.tree_leaves(inputs)
    return max(1, sum(t.numel() for t in leaves if isinstance(t, torch.Tensor)))


def as_accurate_with_extra_roundings(err: float, reference_err: float, depth: int, extra: int,
                                     dtype: torch.dtype = torch.float32) -> bool:
    """A computation that rounds `extra` more times along its longest chain than a reference that rounds
    `depth` times, in the same low dtype: to first order the relative error grows linearly with the
    roundings on the chain (module docstring), so its error may be the reference's times
    (depth + extra) / depth, plus the 2 * eps of measuring any error from rounded results."""
    if depth < 1 or extra < 0:
        raise ValueError(f"depth must be >= 1 and extra >= 0, got {depth}, {extra}")
    return err <= reference_err * (depth + extra) / depth + 2 * eps(dtype)


def assert_grads_close(pairs, *, depth: int, dtype: torch.dtype | None = None) -> None:
    """assert_close_for over a model's gradients, given as (actual, expected) or (actual, expected, name)
    pairs, with atol scaled by the largest magnitude over all the expected gradients, not each tensor's
    own. A parameter whose true gradient is zero (an attention key bias: softmax ignores a constant added
    to every key) is computed as rounding noise of the other gradients' size times eps, and two roundings
    of zero differ by O(1) relative to themselves: against its own scale that noise would read as an
    error. Against the largest gradient it is within the rounding of the sums it came from, as the module
    docstring's bound says; a real error (a wrong or dropped term) is still O(1) of that scale."""
    pairs = [tuple(p) for p in pairs]
    scale = max((e.detach().abs().max().item() for _, e, *_ in pairs if e.numel()), default=0.0)
    for a, e, *name in pairs:
        rtol, atol = tol(dtype or e.dtype, depth, scale)
        torch.testing.assert_close(a, e, rtol=rtol, atol=atol, msg=name[0] if name else None)
