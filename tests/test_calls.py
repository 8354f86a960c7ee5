"""A graph break inside a loop: dynamo compiles the loop body once and calls it per block (autoremat/planning/graph_calls.py)."""

import pytest
import torch

import autoremat
from autoremat.measure import measure_peak
from autoremat.planning.compilers import inductor_problem


class _Block(torch.nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln = torch.nn.LayerNorm(d)
        self.fc, self.out = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.out(torch.nn.functional.gelu(self.fc(self.ln(x))))


class _BrokenLoop(torch.nn.Module):
    """docs/backend.md's stack, small: the break in the loop makes dynamo compile `_Block.forward` on its own."""

    def __init__(self, d: int = 32, n: int = 4) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(_Block(d) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            x = block(x)
            if i == 1:
                torch._dynamo.graph_break()
        return x.square().mean()


def _floor(model: torch.nn.Module, x: torch.Tensor, compiler: str) -> int:
    with pytest.raises(autoremat.BudgetError) as e:
        autoremat.optimize(model, budget=10**5, example_inputs=(x,), optimizer=None, compiler=compiler, verify=False,
                           progress=False)
    return e.value.smallest_budget


@pytest.mark.parametrize("compiler", ["eager", "inductor"])
def test_a_graph_called_once_per_block_is_planned_per_call_and_predicts_the_measured_step(compiler):
    if compiler == "inductor" and (problem := inductor_problem("cpu")) is not None:
        pytest.skip(f"this machine cannot run Inductor on CPU: {problem}")
    # Dynamo counts the compiles of `_Block.forward` (not a copy: compile_fresh copies only the top-level forward)
    # against its recompile limit across every optimize call in the process; past it the frame runs eagerly.
    torch._dynamo.reset()
    torch.manual_seed(0)
    model, x = _BrokenLoop(), torch.randn(8, 64, 32)
    floor = _floor(model, x, compiler)
    om = autoremat.optimize(model, budget=floor, example_inputs=(x,), optimizer=None, compiler=compiler,
                            verify=False, progress=False)
    calls = om._planner.sequence()
    assert len(calls) > len({id(g) for g in calls})  # one compiled graph ran for several blocks
    for block in [g for g in calls if calls.count(g) > 1]:  # every call of it saves the same values
        assert len({frozenset(p.saved) for p, g in zip(om.plan.graphs, calls) if g is block}) == 1
    for p in model.parameters():
        p.grad = torch.zeros_like(p)

    def step():
        om(x).backward()

    step()
    _, m = measure_peak(step, baseline_objs=(model, x))
    predicted, measured = om.plan.activation_peak, m.delta_peak_bytes
    # Planned as the graphs compiled (one block, not four), the prediction was 30-33% under the measured peak
    # (983,040 vs 1,396,872 B eager, 1,052,800 vs 1,572,872 B Inductor).
    assert measured <= predicted, (predicted, measured)
    # The model holds each value one graph hands the next across a break to the end of the step (it knows no
    # hand-offs between dynamo graphs, region_crossings.py), the real step until the next call's backward: at most
    # one block output per call over.
    assert predicted - measured <= (len(calls) - 1) * x.nelement() * x.element_size(), (predicted, measured)
