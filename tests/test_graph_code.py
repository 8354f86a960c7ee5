"""A plan's partition swapped in behind the autograd.Function AOTAutograd built while capturing
(capture/graph_code.py), checked on one small joint graph whose saved tensors are counted by hand.

f(x, w) = sin(cos(x * w)), with x and w both requiring gradients. Its backward reads cos(mul) (for
sin's derivative), mul (for cos's) and x and w (for mul's), so PyTorch's default partition saves four
tensors: x, w, mul and cos. A partition that saves only x and w recomputes mul and cos in the backward;
one that also saves mul recomputes only cos. The capture adds spare slots (empty tensors) after its four:
max(SPARE_MIN, a quarter of 4) = 4 of them, so eight in all.
"""

import pytest
import torch
import torch.fx as fx

from autoremat.capture import graph_code
from autoremat.capture.aot import aot_backend, default_split
from autoremat.capture.graph_code import GraphCode
from autoremat.torch_internals import extract_fwd_bwd_modules, tracing_like_dynamo


class SinCos(torch.nn.Module):
    def forward(self, x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor]:
        return (torch.sin(torch.cos(x * w)),)  # AOTAutograd takes a graph whose output is a tuple


def traced() -> tuple[object, GraphCode, torch.Tensor, torch.Tensor]:
    """The function AOTAutograd compiled for SinCos (through our eager backend), its GraphCode and inputs."""
    torch.manual_seed(0)
    x, w = torch.randn(4, 8, requires_grad=True), torch.randn(8, requires_grad=True)
    codes: list = []
    with tracing_like_dynamo():
        compiled = aot_backend(default_split, codes=codes)(fx.symbolic_trace(SinCos()), [x, w])
    [(index, _, code)] = codes
    assert index == 0
    return compiled, code, x, w


def saving(code: GraphCode, names: list[str]) -> tuple[fx.GraphModule, fx.GraphModule]:
    """The forward and backward modules of the captured joint graph that hand over exactly `names`."""
    joint = code.captured(0, None).joint
    nodes = {n.name: n for n in joint.graph.nodes}
    return extract_fwd_bwd_modules(joint, [nodes[n] for n in names], [], num_fwd_outputs=1,
                                   static_lifetime_input_nodes=set())


def gradients(run, x: torch.Tensor, w: torch.Tensor) -> list[torch.Tensor]:
    x.grad = w.grad = None
    run(x, w).sum().backward()
    return [x.grad, w.grad]


def eager(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.sin(torch.cos(x * w))


def test_the_capture_saves_what_the_backward_reads_and_spare_slots():
    _, code, _, _ = traced()
    assert graph_code.SPARE_MIN == 4 and graph_code.SPARE_SHARE == 0.25  # the docstring's count assumes these
    assert code.capture.outputs == 1 and code.capture.saved == 4 + 4  # x, w, mul, cos and four spare
    assert code.capture.rest == ("tangents_1",)


def test_the_spare_slots_take_what_the_capture_had_no_room_for():
    # Four saved beside another partition need five slots (the last names the partition that ran): one
    # more than the capture's own four, so without spare slots this is refused (the test below).
    compiled, code, x, w = traced()
    second = code.called_at(compiled.__wrapped__, 1)

    def both(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return second(compiled(a, b)[0], b)[0]

    expected = gradients(lambda a, b: eager(eager(a, b), b), x, w)
    partitions = [saving(code, ["primals_1", "primals_2", "mul", "cos"]), saving(code, ["primals_1", "primals_2"])]
    assert code.fits(partitions) is None
    code.run(code.prepare(partitions), {0: 0, 1: 1})
    assert [runner.saved for runner in code.runners] == [4, 2]
    assert all(torch.equal(g, e) for g, e in zip(gradients(both, x, w), expected))


def test_a_partition_saving_fewer_tensors_runs_behind_the_captured_function():
    compiled, code, x, w = traced()
    captured = gradients(lambda a, b: compiled(a, b)[0], x, w)
    assert all(torch.equal(g, e) for g, e in zip(captured, gradients(eager, x, w)))

    recompute_both = saving(code, ["primals_1", "primals_2"])
    assert code.fits([recompute_both]) is None
    code.run(code.prepare([recompute_both]), {0: 0})
    assert [runner.saved for runner in code.runners] == [2]
    # The same function, now running the plan: the same ops in the same order, so the same bits.
    assert all(torch.equal(g, e) for g, e in zip(gradients(lambda a, b: compiled(a, b)[0], x, w), captured))


def test_places_sharing_a_code_each_run_their_own_partition():
    compiled, code, x, w = traced()
    second = code.called_at(compiled.__wrapped__, 1)  # the same function called from graph 1

    def both(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return second(compiled(a, b)[0], b)[0]

    expected = gradients(lambda a, b: eager(eager(a, b), b), x, w)
    partitions = [saving(code, ["primals_1", "primals_2"]), saving(code, ["primals_1", "primals_2", "mul"])]
    assert code.fits(partitions) is None  # 2 and 3 saved, room for 3: the fourth slot says which ran
    runners = code.prepare(partitions)
    code.run(runners, {0: 0, 1: 1})
    assert all(torch.equal(g, e) for g, e in zip(gradients(both, x, w), expected))
    code.run(runners, {0: 1, 1: 0})  # each place's backward follows its own forward, in either order
    assert all(torch.equal(g, e) for g, e in zip(gradients(both, x, w), expected))


def test_a_partition_saving_more_than_the_capture_has_room_for_is_refused(monkeypatch):
    monkeypatch.setattr(graph_code, "SPARE_MIN", 0)  # no spare slots: the capture's own four
    monkeypatch.setattr(graph_code, "SPARE_SHARE", 0)
    _, code, _, _ = traced()
    four = saving(code, ["primals_1", "primals_2", "mul", "cos"])
    assert code.fits([four]) is None  # alone, four fit the capture's four slots
    # Beside another partition, one of the four slots must name the partition that ran: room for three.
    both = [four, saving(code, ["primals_1", "primals_2"])]
    assert code.fits(both) == "a plan saves 4 tensors where the capture has 3 slots for them"
    with pytest.raises(ValueError, match="cannot replace the captured one"):
        code.prepare(both)
    assert code.runners == []  # nothing was swapped: the capture's partition still runs


def test_a_swapped_function_refuses_to_run_under_compiled_autograd():
    # Compiled autograd traces the backward graph AOTAutograd kept (the capture's), not the plan's backward:
    # its gradients would be those of another partition. The swapped forward says so instead of running.
    compiled, code, x, w = traced()
    code.run(code.prepare([saving(code, ["primals_1", "primals_2"])]), {0: 0})
    with torch._dynamo.config.patch(compiled_autograd=True), \
            pytest.raises(RuntimeError, match="does not run under compiled autograd"):
        compiled(x, w)
