"""Custom ops (torch.library) are judged by their schema: a functional one is recomputed like an ATen op,
its bytes from its fake kernel; one that mutates, aliases or draws random numbers stays saved and the
plan's notes say why."""

import pytest
import torch
import torch.fx as fx
import torch.nn as nn

import autoremat
from autoremat.measure import measure_peak
from autoremat.model.profile import recompute_ban
from autoremat.planning.plan import Ledger
from tests.budgets import budget_range
from tests.tolerances import assert_close_for, batch_depth


@torch.library.custom_op("autoremat_co::wave", mutates_args=())
def wave(x: torch.Tensor) -> torch.Tensor:
    return x.sin() * x


@wave.register_fake
def _(x):
    return torch.empty_like(x)


def _wave_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])


def _wave_backward(ctx, g):
    (x,) = ctx.saved_tensors
    return g * (x.cos() * x + x.sin())


wave.register_autograd(_wave_backward, setup_context=_wave_setup)


@torch.library.custom_op("autoremat_co::bump", mutates_args=("count",))
def bump(x: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    count.add_(1)
    return x * 2


@bump.register_fake
def _(x, count):
    return torch.empty_like(x)


@torch.library.custom_op("autoremat_co::jitter", mutates_args=(), tags=(torch.Tag.nondeterministic_seeded,))
def jitter(x: torch.Tensor) -> torch.Tensor:
    return x + 0.1 * torch.randn_like(x)


@jitter.register_fake
def _(x):
    return torch.empty_like(x)


jitter.register_autograd(lambda ctx, g: g, setup_context=lambda ctx, inputs, output: None)


class WaveBlock(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.up, self.down = nn.Linear(width, width), nn.Linear(width, width)

    def forward(self, x):
        return self.down(wave(self.up(x)))  # down's weight gradient reads wave's output


class WaveStack(nn.Module):
    def __init__(self, width=64, depth=3):
        super().__init__()
        self.blocks = nn.ModuleList(WaveBlock(width) for _ in range(depth))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x.sum()


class Effects(nn.Module):
    """A mutating custom op on the input (no autograd: it needs none), a random one, a functional one."""

    def __init__(self, width=64):
        super().__init__()
        self.a, self.b, self.c = (nn.Linear(width, width) for _ in range(3))
        self.register_buffer("count", torch.zeros(width))

    def forward(self, x):
        h = self.a(bump(x, self.count))
        h = self.b(jitter(torch.tanh(h)))
        return self.c(wave(h)).sum()


def _grads(model, fn, x):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    fn(x).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return grads


def _assert_same_grads(model, om, x):
    for g, r in zip(_grads(model, om, x), _grads(model, model, x), strict=True):
        assert_close_for(g, r, depth=batch_depth(x))


def _custom(gp, prefix="autoremat_co"):
    return {n for n, p in gp.nodes.items() if p.kind == "forward" and prefix in p.target}


def test_a_functional_custom_op_is_recomputed_under_a_tight_budget():
    torch.manual_seed(0)
    model, x = WaveStack(), torch.randn(256, 64)
    lo, hi = budget_range(model, (x,))
    assert lo < hi
    om = autoremat.optimize(model, budget=lo, example_inputs=(x,), compiler="eager")
    gp = om._planner.profiles[0]
    waves = _custom(gp, "wave")
    assert waves and not any(gp.nodes[n].recompute_ban for n in waves)
    assert all(gp.nodes[n].nbytes == 256 * 64 * 4 for n in waves)  # from the fake kernel
    assert set(om.plan.graphs[0].recomputed) & waves, (om.plan.graphs[0].recomputed, om.plan.summary())
    assert not any("never recomputed" in n for n in om.plan.notes), om.plan.notes
    assert any("may be recomputed, timed by the bytes" in n and "autoremat_co.wave.default" in n
               for n in om.plan.notes), om.plan.notes

    def step():
        torch.manual_seed(1)
        om(x).backward()

    _assert_same_grads(model, om, x)  # leaves grads in place: the steady state measured below
    model(x).backward()
    _, m = measure_peak(step, baseline_objs=(model, x))
    assert Ledger.from_dict(om.plan.ledger).fixed + m.delta_peak_bytes <= lo, m


def test_mutating_and_random_custom_ops_stay_saved_and_the_note_says_why():
    torch.manual_seed(0)
    model, x = Effects(), torch.randn(256, 64)
    fixed = Ledger.from_dict(autoremat.optimize(model, 10**12, (x,), verify=False, compiler="eager").plan.ledger).fixed
    with pytest.raises(autoremat.BudgetError) as err:
        autoremat.optimize(model, budget=fixed + 1, example_inputs=(x,), verify=False, compiler="eager")
    om = autoremat.optimize(model, budget=err.value.smallest_budget, example_inputs=(x,), compiler="eager")
    gp = om._planner.profiles[0]
    bans = {gp.nodes[n].recompute_ban for n in _custom(gp)} | {
        p.recompute_ban for p in gp.nodes.values() if p.kind == "forward" and "auto_functionalized" in p.target}
    recomputed = set(om.plan.graphs[0].recomputed)
    banned = {n for n, p in gp.nodes.items() if p.recompute_ban}
    assert not banned & recomputed
    assert "custom op autoremat_co.bump.default mutates count: recomputing it would write again" in bans, bans
    assert any(b.startswith("custom op autoremat_co.jitter.default is random (tagged nondeterministic_seeded)")
               for b in bans), bans
    note = next(n for n in om.plan.notes if "never recomputed" in n)
    assert note.startswith("2 custom or unsupported op(s)") and "bump" in note and "jitter" in note, note
    assert "wave" not in note, note  # functional: it may be recomputed
    _assert_same_grads(model, om, x)


def _node(op, val, *args):
    g = fx.Graph()
    n = g.call_function(op, args)
    n.meta["val"] = val
    return n


def test_recompute_ban_reads_the_schema_not_the_name():
    lib = torch.library.Library("autoremat_co_schema", "FRAGMENT")  # ops with a schema and no kernel
    lib.define("alias_of(Tensor(a) x) -> Tensor(a)")
    lib.define("seeded(Tensor x, Generator? generator=None) -> Tensor")
    ops = torch.ops.autoremat_co_schema
    t = torch.empty(4)
    assert recompute_ban(_node(torch.ops.autoremat_co.wave.default, t)) == ""
    assert "aliases x" in recompute_ban(_node(ops.alias_of.default, t))
    assert "is random (takes a Generator)" in recompute_ban(_node(ops.seeded.default, t))
    assert "no fake kernel" in recompute_ban(_node(torch.ops.autoremat_co.wave.default, None))
    lib.define("bump_(Tensor(a!) x) -> Tensor")  # a mutation functionalization has not rewritten
    assert recompute_ban(_node(ops.bump_.default, t)).endswith("mutates x: recomputing it would write again")
    assert recompute_ban(_node(torch.ops.aten.view.default, t)) == ""  # ATen views: recomputed as views
