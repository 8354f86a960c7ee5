"""Mixed precision: per-call dtypes chosen with save/recompute, safe by construction.

Models stay tiny: bf16/fp16 matmuls are 10x slower than fp32 on these CPUs.
"""

import json
import warnings

import pytest
import torch
import torch.nn as nn

import autoremat
from autoremat.measure import grad_rel_err, measure_peak
from autoremat.planning.plan import Ledger, Plan
from examples import models
from tests.tolerances import as_accurate, as_accurate_with_extra_roundings, tol


def _step_grads(model, ex, fn, autocast=False, seed=1):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    amp = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else torch.autocast("cpu", enabled=False)
    with amp:
        loss = models.loss_of(fn(*ex))
    loss.backward()
    return loss.detach().double(), torch.cat([p.grad.double().flatten() for p in model.parameters()])


def _rel(a, b):
    return grad_rel_err(a, b)


def _llama_bf16_depth(model) -> int:
    """bf16 roundings along the longest chain of an HF Llama step: each layer's nine matmuls (q, k, v, o,
    gate, up, down and attention's two) round their inputs once in the forward and once in the backward,
    the LM head twice, and the first weight gradient once more; accumulation stays fp32."""
    return 2 * 9 * model.config.num_hidden_layers + 2 + 1


def _bf16_depth(model) -> int:
    """bf16 roundings along the longest chain of a TransformerStack step (tests/tolerances.py): each
    block's six matmuls round their inputs once in the forward and once more in the backward, and the
    first layer's weight gradient rounds once more. Accumulation stays fp32, so these dominate."""
    return 2 * 6 * len(model.blocks) + 1


def _smallest(model, ex, **kw):
    with pytest.raises(autoremat.BudgetError) as err:
        autoremat.optimize(model, budget=1024, example_inputs=ex, verify=False, **{"compiler": "eager", **kw})
    return err.value.smallest_budget


@pytest.fixture(scope="module")
def stack():
    torch.manual_seed(0)
    return models.transformer_stack(batch=2, seq=32, n_layer=2, d=32, dropout=0.1)


def test_bf16_gradients_match_autocast_and_stay_fp32(stack):
    model, ex = stack
    ref_loss, ref = _step_grads(model, ex, model)
    ac_loss, ac = _step_grads(model, ex, model, autocast=True)
    torch.manual_seed(1)  # optimize leaves the random stream as it found it: its error check sees seed 1 too
    om = autoremat.optimize(model, budget=10**9, example_inputs=ex, precision="bf16", compiler="eager")
    picked = om.plan.precision["dtypes"][0]
    assert picked and set(picked.values()) == {"bf16"}
    assert not om.plan.needs_grad_scaler
    loss, grads = _step_grads(model, ex, om)
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in model.parameters())
    # Within bf16 tolerance of both fp32 and autocast, and no worse than autocast by more than 2x.
    rtol, _ = tol(torch.bfloat16, _bf16_depth(model))
    assert _rel(grads, ref) <= rtol and _rel(grads, ac) <= rtol
    assert as_accurate(_rel(grads, ref), 2 * _rel(ac, ref))
    assert abs(loss - ref_loss) / ref_loss.abs() <= rtol
    # The reported numbers are the ones measured here: the same computation (same batch, same random
    # stream, same kernels), so the same bits.
    assert om.plan.precision["grad_rel_err"] == _rel(grads, ref)
    assert om.plan.precision["autocast_grad_rel_err"] == _rel(ac, ref)


class Huge(nn.Module):
    """A linear layer whose outputs reach ~1e5: fp16 (max 65504) would overflow there."""

    def __init__(self):
        super().__init__()
        self.small = nn.Linear(16, 16)
        self.huge = nn.Linear(16, 16)
        self.out = nn.Linear(16, 1)
        with torch.no_grad():
            self.huge.weight.mul_(3e4)

    def forward(self, x):
        h = torch.relu(self.small(x))
        return self.out(torch.tanh(self.huge(h) * 1e-5)).square().mean()


def test_planted_huge_activation_is_kept_out_of_fp16():
    torch.manual_seed(0)
    model, x = Huge(), torch.randn(8, 16)
    om = autoremat.optimize(model, budget=10**9, example_inputs=(x,), precision="fp16", compiler="eager")
    calls = om.plan.precision["calls"]
    huge = [c for c, s in calls.items() if s["max_abs"] > 65504 / 8]
    assert huge, calls
    picked = om.plan.precision["dtypes"][0]
    assert all(c not in picked for c in huge), picked  # stays fp32
    assert all(not calls[c]["fp16_safe"] for c in huge)
    assert any(d == "fp16" for d in picked.values())  # the small ones do run in fp16
    assert om.plan.needs_grad_scaler
    auto = autoremat.optimize(model, budget=10**9, example_inputs=(x,), precision="auto", device="h100", compiler="eager")
    assert all(auto.plan.precision["dtypes"] == [] or auto.plan.precision["dtypes"][0].get(c) != "fp16"
               for c in huge)
    loss = models.loss_of(om(x))
    loss.backward()
    assert torch.isfinite(loss) and all(torch.isfinite(p.grad).all() for p in model.parameters())


def test_auto_never_peaks_above_fp32_at_the_same_budget(stack):
    model, ex = stack
    lo32 = _smallest(model, ex)
    budget = lo32 + 200_000
    peaks = {}
    for mode in ("fp32", "auto"):
        om = autoremat.optimize(model, budget=budget, example_inputs=ex, precision=mode, device="h100", compiler="eager")

        def step(om=om):
            torch.manual_seed(1)
            models.loss_of(om(*ex)).backward()

        step()
        _, m = measure_peak(step, baseline_objs=(model, ex))
        peaks[mode] = (om.plan.predicted_peak, Ledger.from_dict(om.plan.ledger).fixed + m.delta_peak_bytes, om)
    # Auto keeps the fastest of its candidates (fp32 among them), so it is never predicted slower than fp32
    # at the same budget; on this 32-wide stack the casts make fp32 the fastest (the ILP's estimate favours
    # bf16, the traced plans do not, so which dtype auto chose is not asserted).
    auto_plan, fp32_plan = peaks["auto"][2].plan, peaks["fp32"][2].plan
    assert (auto_plan.forward_time_s + auto_plan.recompute_time_s
            <= fp32_plan.forward_time_s + fp32_plan.recompute_time_s + 1e-12)
    assert peaks["auto"][0] <= peaks["fp32"][0]
    assert peaks["auto"][1] <= peaks["fp32"][1]
    assert peaks["auto"][1] <= budget


def test_tight_budget_fp32_cannot_meet_is_met_with_auto():
    torch.manual_seed(0)
    model, ex = models.transformer_stack(batch=4, seq=64, n_layer=2, d=64, dropout=0.1)
    lo32, lo16 = _smallest(model, ex), _smallest(model, ex, precision="bf16")
    assert lo16 < lo32
    budget = (lo16 + lo32) // 2
    with pytest.raises(autoremat.BudgetError):
        autoremat.optimize(model, budget=budget, example_inputs=ex, compiler="eager")
    om = autoremat.optimize(model, budget=budget, example_inputs=ex, precision="auto", compiler="eager")
    assert any(om.plan.precision["dtypes"][0].values())
    assert om.plan.predicted_peak <= budget

    def step():
        models.loss_of(om(*ex)).backward()

    step()
    _, m = measure_peak(step, baseline_objs=(model, ex))
    assert Ledger.from_dict(om.plan.ledger).fixed + m.delta_peak_bytes <= budget
    p = om.plan.precision
    assert as_accurate(p["loss_rel_err"], p["autocast_loss_rel_err"])
    assert as_accurate(p["grad_rel_err"], p["autocast_grad_rel_err"])


def test_auto_with_default_tolerance_is_as_accurate_as_autocast(stack):
    model, ex = stack
    om = autoremat.optimize(model, budget=10**9, example_inputs=ex, precision="auto", device="h100", compiler="eager")
    ref_loss, ref = _step_grads(model, ex, model)
    _, ac = _step_grads(model, ex, model, autocast=True)
    loss, grads = _step_grads(model, ex, om)
    assert as_accurate(_rel(grads, ref), _rel(ac, ref))
    p = om.plan.precision
    assert p["error_estimate"] <= p["tolerance"] + 1e-12
    # The summary shows the measured errors of a mixed plan, and says when auto kept fp32 (auto takes the
    # fastest candidate, fp32 on this tiny stack).
    shown = "error vs fp32" if p["dtypes"] else "precision='auto' chose fp32"
    assert shown in om.plan.summary()


def test_tolerance_bounds_the_summed_error_estimate(stack):
    model, ex = stack
    full = autoremat.optimize(model, budget=10**9, example_inputs=ex, precision="auto", device="h100", compiler="eager")
    tol = full.plan.precision["error_estimate"] / 3
    om = autoremat.optimize(model, budget=10**9, example_inputs=ex, precision="auto", device="h100", tolerance=tol, compiler="eager")
    assert om.plan.precision["error_estimate"] <= tol + 1e-12
    assert om.plan.precision["tolerance"] == tol


def test_fp16_steps_with_grad_scaler_stay_finite(stack):
    model, ex = stack
    model = type(model)(2, 32, 4, 0.1)
    om = autoremat.optimize(model, budget=10**9, example_inputs=ex, precision="fp16", compiler="eager")
    assert om.plan.needs_grad_scaler
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", enabled=om.plan.needs_grad_scaler)
    for _ in range(4):
        opt.zero_grad(set_to_none=True)
        scaler.scale(models.loss_of(om(*ex))).backward()
        scaler.step(opt)
        scaler.update()
        assert all(torch.isfinite(p).all() for p in model.parameters())


def test_plan_json_reapplies_the_dtypes(stack, tmp_path):
    model, ex = stack
    om = autoremat.optimize(model, budget=10**9, example_inputs=ex, precision="bf16", compiler="eager")
    path = tmp_path / "plan.json"
    om.plan.save(path)
    again = autoremat.optimize(model, budget=10**9, example_inputs=ex, plan=Plan.load(path), compiler="eager")
    assert json.loads(path.read_text())["precision"]["dtypes"] == again.plan.precision["dtypes"]
    _, a = _step_grads(model, ex, om)
    _, b = _step_grads(model, ex, again)
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_convnet_bf16_keeps_batchnorm_in_fp32_and_updates_stats_once():
    torch.manual_seed(0)
    model, ex = models.convnet(batch=4, size=8, channels=8, blocks=1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    om = autoremat.optimize(model, budget=10**9, example_inputs=ex, precision="bf16", compiler="eager")
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, before[k], rtol=0, atol=0)  # planning and the error check left no trace
    _, ref = _step_grads(model, ex, model)
    model.load_state_dict(before)
    _, ac = _step_grads(model, ex, model, autocast=True)
    model.load_state_dict(before)
    _, grads = _step_grads(model, ex, om)
    assert _rel(grads, ref) <= 1.5 * _rel(ac, ref), (_rel(grads, ref), _rel(ac, ref))  # bf16's error, like autocast
    counters = [k for k in before if k.endswith("num_batches_tracked")]
    assert counters and all(model.state_dict()[k].item() == before[k].item() + 1 for k in counters)


@pytest.mark.parametrize("kw, match", [
    ({"precision": "fp8"}, "precision must be one of"),
    ({"precision": "auto", "tolerance": -1.0}, "tolerance must be"),
    ({"precision": "auto", "tolerance": float("nan")}, "tolerance must be"),
])
def test_bad_precision_options(stack, kw, match):
    model, ex = stack
    with pytest.raises(ValueError, match=match):
        autoremat.optimize(model, budget=10**9, example_inputs=ex, **kw, compiler="eager")


def test_fp16_on_meta_asks_for_real_inputs_and_auto_plans_with_estimated_errors():
    # "auto" plans on meta (large shapes are planned there) with each call's bf16
    # error estimated as bf16's unit roundoff and fp16 never offered; only fp16 needs measured ranges.
    model = models.TransformerStack(2, 32, 4, 0.1).to("meta")
    ex = torch.empty(2, 8, 32, device="meta")
    with pytest.raises(ValueError, match="real example inputs"):
        autoremat.optimize(model, budget=10**9, example_inputs=ex, precision="fp16", compiler="eager")
    om = autoremat.optimize(model, budget=10**9, example_inputs=ex, precision="auto", device="h100", compiler="eager")
    assert om.plan.precision["auto"]["chosen"] in ("fp32", "ilp", "bf16")
    assert not om.plan.needs_grad_scaler
    assert all(d == "bf16" for pick in om.plan.precision.get("dtypes", []) for d in pick.values())
    assert any("precision='auto' chose" in n for n in om.plan.notes)


def test_fp32_ops_override_makes_softmax_castable(stack):
    from autoremat.passes.op_kinds import FP32_KEPT

    model, ex = stack
    default = autoremat.optimize(model, budget=10**9, example_inputs=ex, precision="bf16", verify=False, compiler="eager")
    kept = [op for op in FP32_KEPT if op != "softmax"]
    unlocked = autoremat.optimize(model, budget=10**9, example_inputs=ex, precision="bf16", verify=False,
                                  fp32_ops=kept, compiler="eager")
    assert not any("softmax" in c for c in default.plan.precision["dtypes"][0])
    assert any("softmax" in c for c in unlocked.plan.precision["dtypes"][0])
    assert unlocked.plan.precision["fp32_ops"] == kept


def test_fit_says_which_precisions_it_takes(stack):
    model, ex = stack
    with pytest.raises(ValueError, match="precision 'fp32' or 'bf16'"):
        autoremat.fit(model, budget=10**9, global_batch=4, sample=ex[0][0], precision="auto", compiler="eager")
    cfg = autoremat.fit(model, budget=10**9, global_batch=4, sample=ex[0][0], precision="bf16", optimizer=None, compiler="eager")
    assert set(cfg.plan.precision["dtypes"][0].values()) == {"bf16"}


def test_a_new_input_shape_keeps_the_dtypes(stack):
    model, ex = stack
    om = autoremat.optimize(model, budget=10**9, example_inputs=ex, precision="bf16", verify=False, compiler="eager")
    x = ex[0]
    models.loss_of(om(x[:1])).backward()  # another batch size: traced and planned once more
    new = om._planners[-1].profiles
    assert len(om.plans) == 2
    assert any(p.dtype == "bfloat16" for g in new for p in g.nodes.values()), "the new shape lost its bf16 casts"


@pytest.mark.slow
def test_bf16_lowers_the_floor_of_an_hf_gpt2_and_auto_says_what_it_chose(monkeypatch):
    # A 2-layer HF GPT-2 (scaled-dot-product attention, the path passes/attention.py runs in 16
    # bits) at a budget between the bf16 and the fp32 floors: fp32 does not fit, bf16 does and holds the
    # budget on a real step, and "auto" states what it chose.
    # Narrow (d=32) and long (256 tokens), so that attention and the activations set the floor, not the
    # weights: activation parts fp32 2,365,384 B, bf16 1,514,320 B (0.64 x). The loss region is planned
    # whole only (its chunk counts are test_loss_chunks.py's). Measured on a loaded 2-core CPU: this test
    # 140 s; the 4-layer d=64 model at 128 tokens with every chunk count spent 500 s in its two floor queries
    # and the bf16 plan alone (bf16 floor 0.76 x fp32's; at 64 tokens, with values recomputed twice,
    # cut_search.py, fp32's fell below bf16's: 620,948 vs 632,196 B).
    from autoremat.passes import loss_chunks

    monkeypatch.setattr(loss_chunks, "CANDIDATES", (1,))
    torch.manual_seed(0)
    model, ex = models.gpt2(batch=1, seq=256, n_layer=2, n_embd=32, n_head=2, vocab=256)
    lo32, lo16 = _smallest(model, ex), _smallest(model, ex, precision="bf16")
    assert lo16 < lo32
    budget = (lo16 + lo32) // 2
    om = autoremat.optimize(model, budget=budget, example_inputs=ex, precision="bf16", compiler="eager")

    def step(om=om):
        torch.manual_seed(1)
        models.loss_of(om(**ex)).backward()

    step()
    _, m = measure_peak(step, baseline_objs=(model, ex))
    assert Ledger.from_dict(om.plan.ledger).fixed + m.delta_peak_bytes <= budget
    p = om.plan.precision
    # CPU autocast runs attention through the math kernel, which upcasts to fp32 inside; the 16-bit
    # attention (as GPU kernels) also rounds the scores and the probabilities, forward and backward: 4 more
    # bf16 roundings per layer on a chain of 2 x 6 matmul roundings per layer plus the head's.
    layers = len(model.transformer.h)
    assert as_accurate_with_extra_roundings(p["grad_rel_err"], p["autocast_grad_rel_err"], depth=12 * layers + 1,
                                            extra=4 * layers), p
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        auto = autoremat.optimize(model, budget=budget, example_inputs=ex, precision="auto", compiler="eager")
    a = auto.plan.precision
    chosen = a["auto"]["chosen"]
    assert chosen in ("ilp", "bf16") and "fp32" not in a["auto"]["predicted_step_s"]  # fp32 does not fit
    assert any(f"precision='auto' chose {chosen}" in n for n in auto.plan.notes)
    accurate = as_accurate(a["loss_rel_err"], a["autocast_loss_rel_err"]) and as_accurate(
        a["grad_rel_err"], a["autocast_grad_rel_err"])
    warned = any("no plan within it was as accurate" in str(w.message) for w in seen)
    assert warned == (not accurate)  # never a silent fallback to a plan less accurate than autocast


@pytest.mark.slow
def test_bf16_attention_and_casts_are_stored_and_recomputed_in_16_bits():
    # The bf16 rewrite must not raise the floor: the math attention traced on CPU/meta must keep its seq x seq
    # scores and probabilities in 16 bits, and each cast it inserts must sit in the block of the calls it feeds
    # (a cast with no module path is saved by checkpointing). Planned on meta (no values needed), a 2-layer
    # HF GPT-2.
    from autoremat.capture.regions import block_of
    from autoremat.solve.heuristics import checkpoint_blocks

    with torch.device("meta"):
        model, ex = models.gpt2(batch=2, seq=64, n_layer=2, n_embd=64, n_head=4, vocab=256)
    square = {}
    for precision in ("fp32", "bf16"):
        om = autoremat.optimize(model, budget=10**10, example_inputs=ex, precision=precision, device="h100", compiler="eager")
        profiles = om._planner.profiles
        square[precision] = {p.dtype for g in profiles for p in g.nodes.values()
                             if p.kind == "forward" and p.shape == (2, 4, 64, 64) and "float" in p.dtype}
        if precision == "bf16":
            casts = [(g, p) for g in profiles for p in g.nodes.values()
                     if p.kind == "forward" and p.target == "aten._to_copy.default"]
            assert casts
            for g, p in casts:  # each cast sits in the block of the calls it feeds
                users = [q for q in g.nodes.values() if q.kind == "forward" and p.name in q.inputs]
                assert {block_of(q.module) for q in users} == {block_of(p.module)}, (p.name, p.module)
            saved = checkpoint_blocks(profiles)
            assert not [p.name for g, p in casts if p.name in saved[profiles.index(g)]]
    assert square["fp32"] == {"float32"}
    assert "float32" not in square["bf16"] and "bfloat16" in square["bf16"]


@pytest.mark.slow
def test_weight_copies_are_cast_again_for_the_backward_same_gradients_lower_floor(monkeypatch):
    # A recomputed block recomputes each weight's bf16 copy for the forward matmul; without a cast of its own
    # for the backward it holds that copy to its backward use (on a 7B Llama layer, a copy of every weight at
    # the floor's peak: benchmarks/precision_live_at_peak.py lists what is live there). passes/weight_casts.py
    # gives the backward its own cast: a floor not above the one without it, gradients as accurate as the
    # plan that recomputes nothing, and the measured peak within the budget.
    from autoremat.capture import aot as capture
    from tests.models import tiny_llama

    model, ex = tiny_llama()
    with monkeypatch.context() as m:
        m.setattr(capture, "split_weight_casts", lambda joint: 0)
        held = _smallest(model, ex, precision="bf16")
    floor = _smallest(model, ex, precision="bf16")
    # On this small Llama, values recomputed twice (cut_search.py) recompute the single cast again before its
    # backward use too, so the split's floor is now within 0.1% of the one without it (2,166,724 vs
    # 2,166,468 B; before the cuts it was lower): it must not be higher than that.
    assert floor <= held * 1.001, (floor, held)
    # verify=False: the step's peak is measured here, after a warm step (the planner's own check at exactly
    # the floor sees 1,924 B of scratch the model does not, and re-plans).
    om = autoremat.optimize(model, budget=floor, example_inputs=ex, precision="bf16", compiler="eager",
                            verify=False)

    def forward_readers(g, name):  # the forward ops that read `name`, through its views
        out = []
        for q in g.nodes.values():
            if q.kind == "forward" and name in q.inputs:
                out += forward_readers(g, q.name) if q.storage and q.storage != q.name else [q.name]
        return out

    weight_casts = [(g, p) for g in om._planner.profiles for p in g.nodes.values() if p.kind == "forward"
                    and p.target == "aten._to_copy.default" and g.nodes[p.inputs[0]].kind == "param"]
    backward_only = [p.name for g, p in weight_casts if not forward_readers(g, p.name)]
    assert weight_casts and len(backward_only) == len(weight_casts) // 2, (backward_only, len(weight_casts))
    assert om.plan.recompute_time_s > 0

    def grads(fn):
        model.zero_grad(set_to_none=True)
        fn(**ex).loss.backward()
        return torch.cat([p.grad.double().flatten() for p in model.parameters()])

    tight = grads(om)
    _, measured = measure_peak(lambda: om(**ex).loss.backward(), baseline_objs=(model, ex))
    assert Ledger.from_dict(om.plan.ledger).fixed + measured.delta_peak_bytes <= floor
    roomy = autoremat.optimize(model, budget=10**9, example_inputs=ex, precision="bf16", compiler="eager")
    assert roomy.plan.recompute_time_s == 0
    # The two plans run the same bf16 mathematics; on this project's CPUs their gradients were
    # bit-identical, but the CI host twice printed a difference (not reproduced here: other solvers,
    # budgets, ISA caps and scratch budgets all gave equal bits). A kernel may round differently for a
    # recomputed value laid out in another buffer, so what is asserted is what holds on every CPU: the
    # tight plan is as accurate against fp32 as the roomy one, and both agree within the bf16 roundings
    # along the step's longest chain (tests/tolerances.py). A wrong or dropped recomputation is O(1).
    loose, fp32 = grads(roomy), grads(model)
    err_tight, err_roomy = _rel(tight, fp32), _rel(loose, fp32)
    assert as_accurate(err_tight, err_roomy, torch.bfloat16), (err_tight, err_roomy)
    apart, (rtol, _) = _rel(tight, loose), tol(torch.bfloat16, _llama_bf16_depth(model))
    assert apart <= rtol, (apart, rtol)
