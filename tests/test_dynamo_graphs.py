"""A loss-region candidate traced from the dynamo graph the first trace kept (autoremat.planning.dynamo_graphs):
AOTAutograd alone, no dynamo run of the model, and the same profiles a full trace gives."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from torch._dynamo.utils import counters

import autoremat
from autoremat.passes.loss_chunks import LossOption
from autoremat.planning.options import PlanOptions
from autoremat.planning.planner import CapturePlanner
from autoremat.planning.step_tracing import compile_and_trace, trace_again
from examples.models import gpt2
from tests.tolerances import assert_grads_close, batch_depth


def _planner(k: int | None, keep: bool = False) -> CapturePlanner:
    planner = CapturePlanner(None, device="cpu", optimizer=None, regions=True, keep_graphs=keep,
                             options=PlanOptions())
    planner.loss = LossOption("loss", k)
    planner.pre_pass = planner.loss.pre_pass()
    return planner


def _dynamo_frames() -> int:
    return counters["stats"]["unique_graphs"]


@pytest.mark.parametrize("n_layer", [1, 2])
def test_a_count_traced_from_the_kept_graph_profiles_as_a_full_trace_does(n_layer):
    # 1 layer: the step is one region, traced whole; 2 layers: a region per block, the blocks reused.
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model, ex = gpt2(batch=2, seq=32, n_layer=n_layer, n_embd=32, vocab=512, dropout=0.0)
    first = _planner(None, keep=True)
    graph = compile_and_trace(model, first, "eager", (), ex).source  # the kept graph the step's later traces start from
    assert graph is not None
    full, again = _planner(4), _planner(4)
    compile_and_trace(copy.deepcopy(model), full, "eager", (), ex)
    frames = _dynamo_frames()
    trace_again(model, "eager", again, graph)
    assert _dynamo_frames() == frames, "dynamo ran the model again"
    assert len(again.profiles) == len(full.profiles) == (1 if n_layer == 1 else n_layer + 2)
    for a, b in zip(again.sequence(), full.sequence()):
        assert dataclasses.asdict(a) == dataclasses.asdict(b), f"graph {a.index} differs"
    # the rewrite reached the copy: its loss region is chunked, more nodes than the first trace's
    assert again.loss.reports[0].rewritten == 1, again.loss.reports
    assert len(again.profiles[-1].nodes) > len(first.profiles[-1].nodes)


def test_the_kept_graph_is_not_used_where_dynamo_broke_the_step_in_two():
    class Broken(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

        def forward(self, x):
            y = self.a(x).relu()
            torch._dynamo.graph_break()
            return self.b(y).sum()

    model = Broken()
    planner = CapturePlanner(None, device="cpu", optimizer=None, keep_graphs=True)
    trace = compile_and_trace(model, planner, "eager", (torch.randn(4, 8),), {})
    assert len(planner.dynamo_graphs) == 2
    assert trace.source is None


@pytest.mark.slow
def test_planning_the_chunk_counts_and_compiling_the_plan_run_dynamo_once():
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model, ex = gpt2(batch=2, seq=32, n_layer=1, n_embd=32, vocab=2048, dropout=0.0)
    with pytest.raises(autoremat.BudgetError) as info:
        autoremat.optimize(copy.deepcopy(model), 1, ex, optimizer=None, outputs="loss", compiler="eager")
    frames = _dynamo_frames()
    om = autoremat.optimize(copy.deepcopy(model), int(1.3 * info.value.smallest_budget), ex, optimizer=None,
                            outputs="loss", compiler="eager")
    traced = [k for k, v in om.plan.loss["candidates"].items() if not v.startswith("not traced")]
    assert len(traced) >= 2, om.plan.loss
    assert any("verified on one real step" in n for n in om.plan.notes), om.plan.notes
    # the capture: each count, the plan's compile and the real step of verification reuse its graph and frame
    assert _dynamo_frames() - frames == 1
    # and the step the user runs is that frame, with the plan's code: eager's gradients
    twin = copy.deepcopy(model)
    om(**ex).loss.backward()
    twin(**ex).loss.backward()
    assert_grads_close([(a.grad, b.grad, name) for (name, a), b in zip(om.model.named_parameters(), twin.parameters())],
                       depth=batch_depth(ex))
