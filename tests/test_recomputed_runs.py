"""Below checkpointing (issue #11): recomputed forward values written into dying recomputed inputs.

A recomputed forward pointwise op writes its result into a recomputed input that dies at it
(`autoremat.recomputed_writes`). Checked on a real CPU step at the floor: gradients are eager's
(dropout on), the plan predicts the measured peak, and the writes lower the floor plan's simulated
peak (against the same plan without them).
"""

import pytest
import torch

import autoremat
import autoremat.memory as memory_mod
from autoremat.decision import evaluate
from examples import models
from tests.test_again import SEED_BYTES, _floor, _grads_and_peak
from tests.tolerances import assert_close_for


def _no_writes(*args, **kwargs) -> dict:
    return {}


def _at_floor(seq: int):
    torch.manual_seed(0)
    model, ex = models.transformer_stack(n_layer=3, d=64, n_head=4, seq=seq, batch=2, dropout=0.1)
    floor = _floor(model, ex)
    torch._dynamo.reset()
    om = autoremat.optimize(model, budget=floor, example_inputs=ex, optimizer=None, outputs="loss", verify=False,
                            compiler="eager")
    return model, ex, om


def test_recomputed_ops_write_into_dying_inputs_with_eagers_gradients_and_the_predicted_peak(monkeypatch):
    model, ex, om = _at_floor(seq=64)
    profiles = om._planners[0].profiles
    saved = [set(g.saved) | set(g.again) for g in om.plan.graphs]
    schedules, tl, _ = evaluate(profiles, saved)
    written = {e: u for s in schedules for e, u in s.written.items()}
    # the attention dropout's masked scale writes into the scaled probabilities it reads
    assert any(e.startswith("where") and u.startswith("mul") for e, u in written.items()), written
    (got, want), peak = _grads_and_peak(model, ex, om)
    for g, r in zip(got, want, strict=True):  # the same values: each op's out= variant
        assert_close_for(g, r, depth=ex[0][..., 0].numel())
    assert abs(om.plan.predicted_peak - peak) <= SEED_BYTES
    # the same plan without the writes peaks higher in the simulator
    monkeypatch.setattr(memory_mod, "write_recomputed", _no_writes)
    assert evaluate(profiles, saved)[1].peak > tl.peak


@pytest.mark.xfail(strict=True, reason="known, not explained: at seq 128 the floor plan (whose gain is the first "
                   "recomputed copy of the attention dropout's `where` written into its `mul`) measured "
                   "3,405,004 B against 3,016,840 predicted, about three [2, 4, 128, 128] bool masks more; without "
                   "that write the plan predicts exactly (3,262,596 vs 3,262,600)")
def test_recomputed_writes_predict_the_peak_at_seq_128():
    model, ex, om = _at_floor(seq=128)
    _, peak = _grads_and_peak(model, ex, om)
    assert abs(om.plan.predicted_peak - peak) <= SEED_BYTES
