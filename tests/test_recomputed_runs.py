"""Below checkpointing: recomputed forward values written into dying recomputed inputs.

A recomputed forward pointwise op writes its result into a recomputed input that dies at it
(`autoremat.model.recomputed_writes`). Checked on a real CPU step at the floor: gradients are eager's
(dropout on), the plan predicts the measured peak, and the writes lower the floor plan's simulated
peak (against the same plan without them).
"""

import torch

import autoremat
import autoremat.model.schedule as schedule_mod
from autoremat import switches
from autoremat.solve.decision import evaluate
from examples import models
from tests.test_twice_and_reuse import SEED_BYTES, _floor, _grads_and_peak
from tests.tolerances import assert_grads_close


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
    # the same values: each op's out= variant
    assert_grads_close([(g, r) for g, r in zip(got, want, strict=True)], depth=ex[0][..., 0].numel())
    assert abs(om.plan.predicted_peak - peak) <= SEED_BYTES
    # the same plan without the writes peaks higher in the simulator (schedules made afresh, not remembered)
    monkeypatch.setattr(schedule_mod, "write_recomputed", _no_writes)
    with switches.off("remember"):
        assert evaluate(profiles, saved)[1].peak > tl.peak


def test_recomputed_writes_predict_the_peak_at_seq_128():
    """At 128 tokens the floor plan's peak falls at the attention dropout's backward, `grad * mask`, which
    `passes/reuse.py` writes into the dying gradient: its out= kernel still casts the bool mask to a float
    temporary the size of the gradient. The profile measured no scratch for such a writer (it skipped every
    node whose buffer is another's, as if a view): 3,405,004 B measured against 3,016,840 predicted."""
    model, ex, om = _at_floor(seq=128)
    _, peak = _grads_and_peak(model, ex, om)
    assert abs(om.plan.predicted_peak - peak) <= SEED_BYTES


def test_a_buffer_writers_kernel_scratch_is_measured():
    """A backward op written into a dying input (passes/reuse.py) allocates no output, but its kernel may
    still allocate: dropout's backward `grad * mask` casts the bool mask to a float copy the size of the
    gradient (CPU). The profile counts that scratch for the writer as for any op."""
    torch.manual_seed(0)
    model, ex = models.transformer_stack(n_layer=1, d=32, n_head=4, seq=16, batch=2, dropout=0.1)
    om = autoremat.optimize(model, budget=10**9, example_inputs=ex, optimizer=None, verify=False, compiler="eager")
    writers = [(g, p) for g in om._planners[0].profiles for p in g.nodes.values() if p.writes_into
               and any(g.nodes[i].dtype == "bool" for i in p.inputs if i in g.nodes)]
    assert writers, "no backward op writing into a dying input reads a bool mask"
    for _, p in writers:
        elements = 1
        for s in p.shape:
            elements *= s
        assert p.nbytes == 0 and p.transient_bytes >= 4 * elements, (p.name, p.transient_bytes, p.shape)


def test_an_out_overload_that_copies_its_result_is_not_written_through():
    # mul.Scalar_out is PyTorch's generated wrapper (the functional mul, then a copy into `out`): a GELU
    # backward's `mul(pow, 3.0)` written through it would allocate its whole result while the memory model
    # books none for a writer.
    from autoremat.passes.reuse import out_variant

    assert out_variant(torch.ops.aten.mul.Scalar) is None
    assert out_variant(torch.ops.aten.mul.Tensor) == (torch.ops.aten.mul.out, "out")
    assert out_variant(torch.ops.aten.pow.Tensor_Scalar) == (torch.ops.aten.pow.Tensor_Scalar_out, "out")
