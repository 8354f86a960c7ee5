"""The user's own checkpoint marks are respected (docs/user_checkpoints.md).

The model: three blocks `l2(sin(x @ w1))`, batch 128, width 64, hidden 256. Per block the forward makes
h = x @ w1 (aten.mm, 128 x 256 fp32: 131,072 B), sin(h) (131,072 B) and the block output (addmm,
32,768 B); the backward reads sin(h) (for w2's gradient) and cos(h) (sin's derivative: a forward-side
value, 131,072 B). With nothing marked the ILP saves h and recomputes sin and cos from it: sin and cos
are elementwise, h is a matmul. The selective-checkpoint policy below says the opposite: h MUST_RECOMPUTE,
sin MUST_SAVE (and every other op of the block PREFER_RECOMPUTE, a hint).
"""

from __future__ import annotations

import functools
import re

import pytest
import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

import autoremat
from autoremat.capture.aot import capture
from autoremat.measure import measure_peak
from autoremat.model.ledger import Ledger
from autoremat.model.marks import must_marks
from autoremat.model.profile import profile_graph
from autoremat.solve import lp
from autoremat.solve.heuristics import save_all_peak
from autoremat.solve.ilp import IlpModel
from autoremat.solve.solver import solve
from tests.tolerances import assert_close_for, batch_depth

BATCH, WIDTH, HIDDEN, BLOCKS = 128, 64, 256, 3
H_BYTES = BATCH * HIDDEN * 4  # h, sin(h), cos(h): 131,072 B each
MM = re.compile(r"mm(_\d+)?")  # the forward's x @ w1 (the backward's mm nodes are never saved)
SIN = re.compile(r"sin(_\d+)?")


def _policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    if op is torch.ops.aten.mm.default:
        return CheckpointPolicy.MUST_RECOMPUTE
    if op is torch.ops.aten.sin.default:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = torch.nn.Parameter(torch.randn(WIDTH, HIDDEN) / WIDTH ** 0.5)
        self.l2 = torch.nn.Linear(HIDDEN, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(torch.sin(x @ self.w1))


class Stack(torch.nn.Module):
    """`how`: "none" (no checkpoint), "policy" (the selective policy above), "plain" or "reentrant"."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.blocks = torch.nn.ModuleList(Block() for _ in range(BLOCKS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            if self.how == "policy":
                x = checkpoint(block, x, use_reentrant=False,
                               context_fn=functools.partial(create_selective_checkpoint_contexts, _policy))
            elif self.how in ("plain", "reentrant"):
                x = checkpoint(block, x, use_reentrant=self.how == "reentrant")
            else:
                x = block(x)
        return x.square().mean()


def _model(how: str) -> Stack:
    torch.manual_seed(0)
    return Stack(how)


def _input() -> torch.Tensor:
    torch.manual_seed(1)
    return torch.randn(BATCH, WIDTH)


@pytest.fixture(scope="module")
def graphs():
    """The profiled joint graph of the unmarked and the marked model (the same ops, names and bytes)."""
    return {how: profile_graph(capture(_model(how), (_input(),))[0]) for how in ("none", "policy")}


def test_marks_reach_the_profile(graphs):
    g = graphs["policy"]
    marks = {n: p.mark for n, p in g.nodes.items() if p.kind == "forward" and p.target.startswith("aten.")}
    assert [marks[n] for n in ("mm", "mm_1", "mm_2")] == ["must_recompute"] * 3
    assert [marks[n] for n in ("sin", "sin_1", "sin_2")] == ["must_save"] * 3
    assert marks["addmm"] == "prefer_recompute" and marks["pow_1"] == ""  # the loss is outside any checkpoint
    assert g.nodes["mm"].nbytes == g.nodes["sin"].nbytes == H_BYTES
    assert must_marks(g).save == {"sin", "sin_1", "sin_2"} and must_marks(g).recompute == {"mm", "mm_1", "mm_2"}
    # the marks are part of the graph's fingerprint, so a cached plan never outlives a changed policy
    assert g.fingerprint != graphs["none"].fingerprint


def test_ilp_alone_saves_h_and_the_marks_turn_it_round(graphs):
    """At 90% of the save-all peak the unmarked ILP saves h and recomputes sin (the cheap op); with the
    marks every sin is saved and no h is, whichever planner wins, and the simulated peak fits."""
    budget = int(0.9 * save_all_peak([graphs["none"]]))
    assert save_all_peak([graphs["policy"]]) > budget  # the marked step must be planned too
    free = IlpModel([graphs["none"]], 1, block_drag=False).solve(budget, lp.highs(10, 0.01))
    assert "mm" in free.saved[0] and "sin" not in free.saved[0]
    unmarked = solve([graphs["none"]], budget).schedules[0]
    assert "mm" in unmarked.saved and "sin" in unmarked.recomputed

    decision = solve([graphs["policy"]], budget)
    sched = decision.schedules[0]
    assert decision.peak <= budget
    assert {"sin", "sin_1", "sin_2"} <= set(sched.saved) and not {"sin", "sin_1", "sin_2"} & set(sched.recomputed)
    assert not {"mm", "mm_1", "mm_2"} & set(sched.saved) and "mm" in sched.recomputed


def test_ilp_bounds_follow_the_marks(graphs):
    """The ILP's own answer (its smallest-peak solution: always feasible) obeys the marks, not only the
    schedule that forces them."""
    model = IlpModel([graphs["policy"]], 1, block_drag=False)
    result = model.solve(None, lp.highs(10, 0.01), min_peak=True)
    assert {"sin", "sin_1", "sin_2"} <= result.saved[0]
    assert not {"mm", "mm_1", "mm_2"} & result.saved[0]


def _optimize_and_run(how: str, fraction: float):
    """optimize() the model at `fraction` of the activations it needs with everything saved; one measured
    step; the gradients against eager's (the same model, its checkpoints run by torch)."""
    model, x = _model(how), _input()
    first = autoremat.optimize(model, budget="1GB", example_inputs=(x,), optimizer=None, compiler="eager")
    ledger = Ledger.from_dict(first.plan.ledger)
    budget = ledger.needs(int(fraction * first.plan.baseline_peak))
    om = autoremat.optimize(model, budget=budget, example_inputs=(x,), optimizer=None, compiler="eager")
    # eager's reentrant checkpoint gives the parameters no gradient when no input requires one (torch warns
    # "None of the inputs have requires_grad=True"); compiled, it is traced non-reentrant: compare with that
    reference = _model("plain" if how == "reentrant" else how)
    reference(x).backward()

    def step() -> None:
        model.zero_grad(set_to_none=False)
        om(x).backward()

    step()
    _, measured = measure_peak(step, baseline_objs=(model, x))
    assert ledger.fixed + measured.delta_peak_bytes <= budget, (measured.delta_peak_bytes, budget)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert_close_for(p.grad, q.grad, depth=batch_depth((x,)), msg=name)
    return om


def test_optimize_respects_the_policy_end_to_end():
    om = _optimize_and_run("policy", 0.8)
    assert om.plan.baseline_peak > om.plan.activation_peak  # something had to be recomputed
    saved = [n for g in om.plan.graphs for n in g.saved]
    recomputed = [n for g in om.plan.graphs for n in g.recomputed]
    assert not any(MM.fullmatch(n) for n in saved), saved
    assert not any(SIN.fullmatch(n) for n in recomputed), recomputed
    assert any(SIN.fullmatch(n) for n in saved)
    assert any("MUST_SAVE" in note and "MUST_RECOMPUTE" in note for note in om.plan.notes)


@pytest.mark.parametrize("how", ["plain", "reentrant"])
def test_plain_checkpoint_is_a_hint(how, graphs):
    """checkpoint() without a policy tags every op of the block PREFER_RECOMPUTE: no constraint. Under
    torch.compile use_reentrant=True is traced exactly like use_reentrant=False (the same marks, the
    same graph); autoremat plans it, and the gradients are eager's."""
    g = profile_graph(capture(_model(how), (_input(),))[0])
    assert {g.nodes[n].mark for n in ("mm", "sin", "addmm", "mm_2", "sin_2", "addmm_2")} == {"prefer_recompute"}
    # forward-side values the backward made (cos: sin's derivative) were not traced inside the checkpoint
    assert {p.mark for p in g.nodes.values() if p.kind == "forward"} == {"", "prefer_recompute"}
    assert must_marks(g).save == must_marks(g).recompute == frozenset()
    if how == "reentrant":
        assert g.fingerprint == profile_graph(capture(_model("plain"), (_input(),))[0]).fingerprint
    om = _optimize_and_run(how, 0.8)
    assert om.plan.baseline_peak > om.plan.activation_peak


def test_a_graph_break_inside_a_checkpointed_loop_body_is_a_clear_error():
    """dynamo cannot put a graph break inside the checkpoint op; in a loop over blocks it then skips the
    whole forward frame, and optimize says so instead of planning nothing."""

    class Breaking(Block):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = torch.sin(x @ self.w1)
            torch._dynamo.graph_break()
            return self.l2(h)

    model = _model("reentrant")
    model.blocks = torch.nn.ModuleList(Breaking() for _ in range(BLOCKS))
    with pytest.raises(autoremat.CaptureError, match="captured no graph"):
        autoremat.optimize(model, budget="1GB", example_inputs=(_input().requires_grad_(),), optimizer=None,
                           compiler="eager")
