"""Identical regions traced once (planning/same_regions.py): a repeated block takes the first one's code.

The answer a reused region must give is the one tracing it gives: each test traces the same step
with reuse off and on and compares every profile field, and counts AOTAutograd's traces.
"""

import dataclasses

import pytest
import torch
from torch._dynamo.utils import counters

import autoremat
from autoremat import switches
from autoremat.capture.regions import RegionLinks
from autoremat.model.graph_profile import GraphProfile, NodeProfile
from autoremat.planning.planner import CapturePlanner
from autoremat.planning.same_regions import relocated
from autoremat.planning.step_tracing import compile_and_trace
from examples import models
from tests.budgets import seeded_grads
from tests.tolerances import assert_grads_close

LAYERS = 4


def _trace(model, inputs, reuse: bool, **planner_kw) -> tuple[CapturePlanner, int]:
    """The step traced into regions, and how many graphs AOTAutograd traced for it."""
    torch._dynamo.reset()
    planner = CapturePlanner(planner_kw.pop("budget", None), device="cpu", regions=True, **planner_kw)
    before = counters["aot_autograd"]["total"]
    args, kwargs = ((), inputs) if isinstance(inputs, dict) else (inputs, {})
    with switches.using(reuse=reuse):
        compile_and_trace(model, planner, "eager", args, kwargs)
    return planner, counters["aot_autograd"]["total"] - before


def _same_profiles(a: CapturePlanner, b: CapturePlanner) -> None:
    pa, pb = a.sequence(), b.sequence()
    assert len(pa) == len(pb)
    for x, y in zip(pa, pb):
        assert dataclasses.asdict(x) == dataclasses.asdict(y), f"graph {x.index} differs"


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_a_capture_traces_one_block_and_profiles_every_block_as_tracing_would(name):
    # GPT-2: blocks read the previous block only; Llama: every block also reads the rotary tables the
    # prelude computed (inputs several regions share, whose gradients are tied).
    torch.manual_seed(0)
    make = models.gpt2 if name == "gpt2" else models.llama
    model, inputs = make(2, 32, LAYERS, 32, 4, 256)  # batch, tokens, layers, width, heads, vocabulary
    traced, traced_n = _trace(model, inputs, False)
    reused, reused_n = _trace(model, inputs, True)
    assert len(traced.profiles) == LAYERS + 2  # the prelude (embeddings), one region per block, the tail
    assert traced_n == LAYERS + 2
    assert reused_n == 3  # the prelude, the first block, the tail
    first, second = ({p.module for p in g.nodes.values()} for g in traced.sequence()[1:3])
    assert first != second, "each block's nodes name its own modules (so the copies must be renamed)"
    _same_profiles(traced, reused)


@pytest.fixture(scope="module")
def stack_planned():
    """A 4-block stack planned (reuse on) at 60% of the way from its floor to the budget that recomputes
    nothing: there two of its three identical blocks save the same values and the third does not (the test
    checks that this still holds)."""
    torch.manual_seed(0)
    model, ex = models.transformer_stack(n_layer=LAYERS, d=64, n_head=4, seq=32, batch=2, dropout=0.1)

    def plan(budget):
        return autoremat.optimize(model, budget, ex, optimizer=None, regions=True, compiler="eager", progress=False)
    with pytest.raises(autoremat.BudgetError) as e:
        plan(1)
    floor, none_recomputed = e.value.smallest_budget, plan(10**10).plan.no_recompute_budget
    return model, ex, plan(int(floor + 0.6 * (none_recomputed - floor)))


def test_a_plan_reuses_a_block_only_where_it_saves_the_same_values(stack_planned):
    model, ex, om = stack_planned
    plan = om.plan
    # The first block reads the step's input, the others the block before: one kind of region for blocks
    # 2 to 4 (graphs 1 to 3; graph 4 is the tail), traced once per saved set the plan gives them.
    blocks = [g for g in plan.graphs if g.fingerprint == plan.graphs[1].fingerprint]
    assert [g.index for g in blocks] == [1, 2, 3]
    assert len({frozenset(g.saved) | frozenset(g.again) for g in blocks}) > 1, \
        "the blocks save different values at this budget (else this checks less than it says)"
    kinds = {(g.fingerprint, frozenset(g.saved) | frozenset(g.again)) for g in plan.graphs}
    traced, traced_n = _trace(model, ex, False, budget=plan.budget, plan=plan)
    reused, reused_n = _trace(model, ex, True, budget=plan.budget, plan=plan)
    assert traced_n == len(plan.graphs) == LAYERS + 1
    assert reused_n == len(kinds) < len(plan.graphs)
    _same_profiles(traced, reused)


def test_a_planned_step_with_reused_blocks_matches_eager(stack_planned):
    model, ex, om = stack_planned
    assert any(n.startswith("verified on one real step") for n in om.plan.notes)
    # as tests/test_regions.py: the residual stream's gradient, fed by two graphs, is summed by
    # autograd in its own order: reduction-order tolerance over the tokens a weight sums
    assert_grads_close([(g, r) for g, r in zip(*seeded_grads(model, (model, om), ex), strict=True)],
                       depth=ex[0][..., 0].numel())


def test_relocated_moves_a_profile_to_its_own_place_in_the_step():
    # A block region at position 2 of its dynamo graph (graph index 3: the graph before it had one
    # region), whose first input comes from position 1's output 0 and whose weight's gradient is tied
    # under the key "w". Moved to position 4 (graph index 5), reading position 3's output 0.
    def node(name, kind, module=""):
        return NodeProfile(name=name, kind=kind, target="", inputs=(), storage=name, nbytes=4, module=module)
    gp = GraphProfile(
        nodes={"primals_1": node("primals_1", "input"), "primals_2": node("primals_2", "param"),
               "tangents_1": node("tangents_1", "tangent"), "mm": node("mm", "forward", "h.0.mlp"),
               "mm_1": node("mm_1", "backward", "h.0.mlp")},
        fw_outputs=["mm"], grad_outputs=["mm_1"], index=3, sources={"primals_1": (2, 0)},
        user_outputs=["mm"], tied={"mm_1": "1:w"})
    links = RegionLinks(position=4, sources=[(3, 0), None], outputs=1, exported=set(), shared={1: "w"})
    out = relocated(gp, 5, links, {"h.0.mlp": "h.2.mlp"})
    assert out.index == 5
    assert out.sources == {"primals_1": (4, 0)}  # first region of the dynamo graph: 5 - 4 = 1; 1 + 3
    assert out.tied == {"mm_1": "1:w"}
    assert out.nodes["mm"].module == out.nodes["mm_1"].module == "h.2.mlp"
    assert gp.nodes["mm"].module == "h.0.mlp" and gp.index == 3, "the first block's profile is left as it was"


def test_inductor_code_reused_by_the_next_identical_block_computes_what_its_own_code_does():
    # Inductor compiles each region's backward on its first call, matched to its forward by the order the
    # regions were traced: blocks 2 to 4 run block 2's code, so block 4's backward compiles it and blocks
    # 3 and 2 reuse it (a wrong match would compile against another region's metadata, or fail). The same
    # graphs compile to the same kernels: the gradients equal those of the step with every block traced.
    torch.manual_seed(0)
    model, ex = models.transformer_stack(n_layer=LAYERS, d=64, n_head=4, seq=32, batch=2, dropout=0.1)
    steps, traces = [], []
    for reuse in (False, True):
        before = counters["aot_autograd"]["total"]
        with switches.using(reuse=reuse):
            steps.append(autoremat.optimize(model, 10**10, ex, optimizer=None, regions=True, compiler="inductor",
                                            progress=False))
        traces.append(counters["aot_autograd"]["total"] - before)
    assert [om.plan.compiler["used"] for om in steps] == ["inductor", "inductor"]
    graphs = len(steps[0].plan.graphs)
    assert graphs == LAYERS + 1
    # captured, then compiled with the plan: every graph twice, or all but blocks 3 and 4 twice
    assert traces == [2 * graphs, 2 * (graphs - 2)]
    traced, reused = seeded_grads(model, steps, ex)
    for g, r in zip(traced, reused, strict=True):
        assert torch.equal(g, r)
