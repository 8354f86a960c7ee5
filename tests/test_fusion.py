"""Inductor's pointwise fusion in the memory model (autoremat/model/fusion.py): which values own no bytes,
that plans never save them, and that the predicted peak matches what Inductor's code measures."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.nn as nn
from torch.fx.experimental.proxy_tensor import make_fx

import autoremat
from autoremat.capture.aot import capture
from autoremat.measure import measure_peak
from autoremat.model.fusion import concat_writes, epilogue_reductions, fused_nodes
from autoremat.model.memory import simulate
from autoremat.model.profile import profile_graph
from autoremat.model.schedule import make_schedule
from autoremat.planning.compilers import inductor_problem
from autoremat.solve.heuristics import save_all
from autoremat.torch_internals import inductor_realize_reads_threshold
from tests.tolerances import assert_close_for, batch_depth


def _names(gm, targets) -> dict[str, str]:
    """First node of each target packet name, in graph order: {"relu": "relu", "mul": "mul", ...}."""
    out: dict[str, str] = {}
    for n in gm.graph.nodes:
        if n.op == "call_function":
            out.setdefault(n.target.overloadpacket.__name__, n.name)
    return {t: out[t] for t in targets}


def test_a_pointwise_chain_into_a_reduction_is_fused_but_a_matmul_input_is_not():
    def f(x, w):
        h = torch.mm(x, w)
        s = (torch.relu(h) * 2.0).sum()  # relu -> mul -> sum: one loop
        return s, torch.mm(torch.exp(h), w)  # exp is read by a matmul: written out

    gm = make_fx(f)(torch.randn(4, 4), torch.randn(4, 4))
    n = _names(gm, ["mm", "relu", "mul", "exp"])
    fused = fused_nodes(gm, outputs=set(), aliases={}, banned=set())
    assert n["relu"] in fused and n["mul"] in fused
    assert n["exp"] not in fused and n["mm"] not in fused
    assert fused_nodes(gm, outputs={n["mul"]}, aliases={}, banned=set()) == {n["relu"]}  # an output is written
    assert n["relu"] not in fused_nodes(gm, outputs=set(), aliases={}, banned={n["relu"]})  # may not recompute


@pytest.mark.parametrize("readers", [1, 4, 5])
def test_more_readers_than_inductors_threshold_are_written_out(readers):
    def f(x):
        a = x.sin()
        return sum((a + float(i)).sum() for i in range(readers))

    gm = make_fx(f)(torch.randn(8))
    sin = _names(gm, ["sin"])["sin"]
    fused = fused_nodes(gm, outputs=set(), aliases={}, banned=set())
    assert (sin in fused) == (readers <= inductor_realize_reads_threshold())


def test_a_matmul_reading_through_a_view_keeps_the_value():
    def f(x, w):
        return torch.mm(x.sin().view(4, 4), w).sum()

    def g(x, w):
        return x.sin().view(4, 4).sum()  # through the same view into a reduction: one loop

    for fn, kept in ((f, True), (g, False)):
        gm = make_fx(fn)(torch.randn(16), torch.randn(4, 4))
        n = _names(gm, ["sin", "view"])
        assert (n["sin"] not in fused_nodes(gm, outputs=set(), aliases={n["view"]: n["sin"]}, banned=set())) == kept


class QuickGELU(nn.Module):
    """x * sigmoid(1.702 x), written out: a pointwise chain whatever the decomposition table."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(1.702 * x)


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), QuickGELU(), nn.Linear(256, 256), QuickGELU(), nn.Linear(256, 1))


def test_fused_values_own_no_bytes_and_are_never_handed_to_the_backward():
    model, x = _mlp(), torch.randn(128, 64)
    (cg,) = capture(model, (x,))
    eager, ind = profile_graph(cg), profile_graph(dataclasses.replace(cg, compiler="inductor"))
    fused = [n for n, p in ind.nodes.items() if p.fused]
    assert fused and not any(p.fused for p in eager.nodes.values())
    # eager allocates each of them, or writes it into a dying input's buffer (passes/reuse.py)
    assert all(ind.nodes[n].nbytes == 0 and (eager.nodes[n].nbytes > 0 or eager.nodes[n].storage != n)
               for n in fused)
    (everything,) = save_all([ind])
    assert set(fused) & everything  # the backward reads some fused values: the sigmoids
    sched = make_schedule(ind, everything)
    assert not set(fused) & set(sched.saved)
    assert set(fused) & set(sched.recomputed)  # recomputed inside the backward's loops instead
    assert simulate([(ind, sched)]).peak < simulate([(eager, make_schedule(eager, everything))]).peak


def test_the_ilps_lifetimes_hold_a_fused_readers_inputs_until_the_kernels_it_is_inlined_into():
    """A backward pointwise node Inductor fuses (QuickGELU's backward products) has no kernel of its own:
    the forward value it reads (the sigmoid) is read by each kernel it is inlined into, later in the
    backward. The ILP's bound on that value's last read (lifetimes.last_read) must reach those kernels,
    as memory.simulate does; it stopped at the fused node, two backward steps early here."""
    from autoremat.model.lifetimes import lifetimes

    (cg,) = capture(_mlp(), (torch.randn(128, 64),))
    g = profile_graph(dataclasses.replace(cg, compiler="inductor"))
    life = lifetimes(g)
    readers: dict[str, list[str]] = {n: [] for n in g.nodes}
    for n, p in g.nodes.items():
        for i in p.inputs:
            readers[i].append(n)
    checked = 0
    for v, p in g.nodes.items():
        if p.kind != "forward":
            continue
        for b in (b for b in readers[v] if b in life.bw_pos and g.nodes[b].fused):
            for kernel in (c for c in readers[b] if c in life.bw_pos and not g.nodes[c].fused):
                assert life.last_read[v] >= life.bw_pos[kernel], (v, b, kernel)
                checked += 1
    assert checked  # the model has such reads: the sigmoids, read by their fused gradient products


@pytest.mark.parametrize("verify", [False, True])
def test_inductor_peak_is_predicted_within_five_percent(verify):
    """With verify, regions="auto" tries the MLP as one graph, whose prediction under Inductor is low
    here, and goes back to one graph per layer; without, it keeps the layers cut (pipeline.one_graph_if_free)."""
    problem = inductor_problem("cpu")
    if problem is not None:
        pytest.skip(f"this machine cannot run Inductor on CPU: {problem}")
    model, x = _mlp(), torch.randn(512, 64)
    om = autoremat.optimize(model, budget=10**10, example_inputs=(x,), optimizer=None, compiler="inductor",
                            verify=verify, progress=False)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)

    def step():
        om(x).sum().backward()

    step()
    _, m = measure_peak(step, baseline_objs=(model, x))
    predicted = om.plan.activation_peak
    assert abs(predicted - m.delta_peak_bytes) <= 0.05 * m.delta_peak_bytes, (predicted, m.delta_peak_bytes)


def test_a_view_of_a_fused_value_unwinds_to_its_inputs_whatever_the_set_order():
    """The backward reads a view of a fused value and a fused value read through that view (softmax's
    output and its alias, in attention). Neither is handed over: the matmul feeding them is. Eight
    such chains, so a result that depended on the saved set's (hash-seeded) order would show."""
    from autoremat.model.graph_profile import GraphProfile, NodeProfile

    nodes: dict[str, NodeProfile] = {}
    chains = [f"c{i}" for i in range(8)]
    for c in chains:
        nodes[f"x_{c}"] = NodeProfile(f"x_{c}", "input", "x", (), f"x_{c}", 64)
    for c in chains:
        nodes[f"mm_{c}"] = NodeProfile(f"mm_{c}", "forward", "aten.mm", (f"x_{c}",), f"mm_{c}", 64, time_s=1e-5)
        nodes[f"exp_{c}"] = NodeProfile(f"exp_{c}", "forward", "aten.exp", (f"mm_{c}",), f"exp_{c}", 0, fused=True)
        nodes[f"view_{c}"] = NodeProfile(f"view_{c}", "forward", "aten.view", (f"exp_{c}",), f"exp_{c}", 0)
        nodes[f"mul_{c}"] = NodeProfile(f"mul_{c}", "forward", "aten.mul", (f"view_{c}",), f"mul_{c}", 0, fused=True)
    for c in chains:
        nodes[f"g_{c}"] = NodeProfile(f"g_{c}", "backward", "aten.add", (f"view_{c}", f"mul_{c}"), f"g_{c}", 64)
    g = GraphProfile(nodes=nodes, fw_outputs=[], grad_outputs=[f"g_{c}" for c in chains])
    sched = make_schedule(g, {n for c in chains for n in (f"view_{c}", f"mul_{c}")})
    assert sched.saved == [f"mm_{c}" for c in chains]
    assert set(sched.recomputed) == {n for c in chains for n in (f"exp_{c}", f"view_{c}", f"mul_{c}")}
    from autoremat.solve.ilp import IlpModel

    ilp = IlpModel([g], 1, block_drag=False)  # the ILP may not save the view either (it would cost no bytes)
    assert all(ilp.s[0][f"view_{c}"].upBound == 0 for c in chains)


def test_the_exact_start_ilp_accepts_fused_chains():
    """Fused values are always recomputed where they are read, so a fused reader drags its inputs in
    every model (lifetimes.follows): the local ILP, which forbids other drags, must stay feasible."""
    from autoremat.solve.ilp import IlpModel
    from autoremat.solve.solver import evaluate
    from autoremat.solve.solver_options import SolverOptions

    model, x = _mlp(), torch.randn(128, 64)
    (cg,) = capture(model, (x,))
    ind = profile_graph(dataclasses.replace(cg, compiler="inductor"))
    everything = save_all([ind])
    peak = evaluate([ind], everything, 1)[1].peak
    result = IlpModel([ind], 1, block_drag=False).solve(peak, SolverOptions(gap=0.01).backend())
    assert result.status == "optimal" and result.saved is not None, result.status


def test_dropout_under_inductor_draws_eagers_masks_and_replays_them():
    """Inductor lowers random ops to its own generator unless told otherwise: then neither the forward's
    mask is eager's nor does a replayed mask (rng_replay) equal the forward's. Both must hold."""
    problem = inductor_problem("cpu")
    if problem is not None:
        pytest.skip(f"this machine cannot run Inductor on CPU: {problem}")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Dropout(0.3), nn.Linear(256, 256), nn.GELU(),
                          nn.Dropout(0.3), nn.Linear(256, 1))
    x = torch.randn(128, 64)
    ref = copy.deepcopy(model)
    torch.manual_seed(7)
    ref(x).sum().backward()
    floor = None
    try:
        autoremat.optimize(copy.deepcopy(model), budget=1, example_inputs=(x,), optimizer=None, compiler="inductor",
                           verify=False, progress=False)
    except autoremat.BudgetError as e:
        floor = e.smallest_budget
    for budget in (10**10, floor):  # masks saved; masks replayed at the floor
        m = copy.deepcopy(model)
        om = autoremat.optimize(m, budget=budget, example_inputs=(x,), optimizer=None, compiler="inductor",
                                verify=False, progress=False)
        torch.manual_seed(7)
        om(x).sum().backward()
        for (name, a), b in zip(ref.named_parameters(), m.parameters()):
            assert_close_for(b.grad, a.grad, depth=batch_depth((x,)) * 4, msg=f"{name} at budget {budget}")


class _ConvBlock(nn.Module):
    """conv-BN-ReLU-dropout-conv-BN added to its input: the residual block of benchmarks/floor.py's ResNet."""

    def __init__(self, c: int) -> None:
        super().__init__()
        # no conv bias before a BN (its gradient is zero in exact arithmetic, rounding noise in any other)
        self.body = nn.Sequential(nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c), nn.ReLU(),
                                  nn.Dropout(0.3), nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x + self.body(x))


@pytest.mark.parametrize("compiler", ["inductor", "auto"])
def test_a_conv_net_with_batchnorm_and_dropout_under_inductor_has_eagers_gradients_and_stats(compiler):
    """Inductor's layout optimisation lays a conv net's values out channels-last, also the values one
    region's graph hands to the next; a dropout traced on such an input drew its mask in that memory
    order, not eager's (gradient errors of O(1) on the floor benchmark's ResNet). Masks, gradients and
    BatchNorm's running stats must be eager's, with the masks saved and replayed (at the floor)."""
    if inductor_problem("cpu") is not None:
        pytest.skip(f"this machine cannot run Inductor on CPU: {inductor_problem('cpu')}")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(), _ConvBlock(8), _ConvBlock(8),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 3))
    x = torch.randn(4, 3, 8, 8)
    ref = copy.deepcopy(model)
    torch.manual_seed(7)
    ref(x).square().mean().backward()
    try:  # Inductor's own floor ("auto" would name eager's where that is lower, and plan with eager there)
        autoremat.optimize(copy.deepcopy(model), budget=1, example_inputs=(x,), optimizer=None, compiler="inductor",
                           verify=False, progress=False)
        raise AssertionError("a budget of 1 B fitted")
    except autoremat.BudgetError as e:
        floor = e.smallest_budget
    for budget in (10**10, floor):
        m = copy.deepcopy(model)
        om = autoremat.optimize(m, budget=budget, example_inputs=(x,), optimizer=None, compiler=compiler,
                                verify=False, progress=False)
        assert om.plan.compiler["used"] == "inductor", om.plan.compiler
        torch.manual_seed(7)
        om(x).square().mean().backward()
        # a gradient sums over every input element (batch depth) in each of the five conv+BN layers and the head
        for (name, a), b in zip(ref.named_parameters(), m.parameters()):
            assert_close_for(b.grad, a.grad, depth=batch_depth((x,)) * 6, msg=f"{name} at budget {budget}")
        for (name, a), b in zip(ref.named_buffers(), m.buffers()):
            if a.dtype.is_floating_point:
                assert_close_for(b, a, depth=batch_depth((x,)) * 6, msg=f"{name} at budget {budget}")
            else:
                assert torch.equal(a, b), f"{name}: BatchNorm counted its batches {b} times, eager {a}"


class _ResidualConvBN(nn.Module):
    """relu(x + BN(conv(x))): one region, in which the residual add's gradient and BatchNorm's backward
    both read the ReLU's backward, which Inductor inlines into each of them."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(c, c, 3, padding=1), nn.BatchNorm2d(c))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x + self.body(x))


class _PooledLoss(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, c, 3, padding=1), _ResidualConvBN(c))
        self.head = nn.Linear(c, 10)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(self.head(self.body(x).mean(dim=(2, 3))), y)


def test_a_fused_values_inputs_live_until_its_last_reader_under_inductor():
    """Inductor recomputes a fused value in every kernel that reads it, so the value's inputs stay alive
    until its last reader: here the incoming gradient and the ReLU output, read by the ReLU's backward,
    are held past the convolution's backward until the residual add's kernel. The model freed them at
    the ReLU's backward: 5.21 MiB predicted, 7.21 MiB measured."""
    problem = inductor_problem("cpu")
    if problem is not None:
        pytest.skip(f"this machine cannot run Inductor on CPU: {problem}")
    torch.manual_seed(0)
    model = _PooledLoss(32).train()
    ex = (torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,)))
    try:
        autoremat.optimize(model, budget=1, example_inputs=ex, optimizer=None, outputs="loss", compiler="inductor",
                           verify=False, progress=False)
        raise AssertionError("a budget of 1 B fitted")
    except autoremat.BudgetError as e:
        floor = e.smallest_budget
    for budget in (10**10, floor):
        om = autoremat.optimize(model, budget=budget, example_inputs=ex, optimizer=None, outputs="loss",
                                compiler="inductor", verify=False, progress=False)
        def step(om=om):
            om(*ex).backward()

        step()
        _, m = measure_peak(step, baseline_objs=(model, ex))
        predicted = om.plan.predicted_peak
        assert abs(predicted - m.peak_bytes) <= 0.05 * m.peak_bytes, (budget, predicted, m.peak_bytes)


def test_a_cats_inputs_are_computed_into_its_buffer_where_inductor_does_that():
    """Inductor's CPU cat is one buffer its inputs are computed into (ir.ConcatKernel), when their
    layout is still its to choose; others are copied in (what its generated code did, torch 2.13)."""
    def f(x, w, b, a3, b3):
        m = torch.mm(x, w)
        twice = torch.mm(x, w)  # read by the cat and a matmul: copied
        flat = torch.cat([m, torch.addmm(b, x, w), torch.sin(m + 1.0), twice, w, w.t()])
        return flat, torch.mm(twice, w), torch.cat([torch.bmm(a3, b3), torch.bmm(a3, b3)])

    gm = make_fx(f)(torch.randn(4, 4), torch.randn(4, 4), torch.randn(4), torch.randn(2, 4, 4), torch.randn(2, 4, 4))
    calls = [n for n in gm.graph.nodes if n.op == "call_function"]
    flat, cat3 = [n for n in calls if n.target is torch.ops.aten.cat.default]
    m, addmm, sin, twice, w, w_t = flat.args[0]
    aliases = {w_t.name: w.name}
    into, cats = concat_writes(gm, {n.name for n in calls}, aliases, outputs=set())
    assert cats == {flat.name, cat3.name}
    # m has two readers (the cat and the add): copied too
    assert into == {addmm.name: flat.name, sin.name: flat.name}
    # the same cat in the forward: its inputs can be saved apart from it; not followed
    assert concat_writes(gm, {n.name for n in calls} - {flat.name}, aliases, outputs=set())[0] == {}
    assert addmm.name not in concat_writes(gm, {n.name for n in calls}, aliases, outputs={addmm.name})[0]


class _RowChunks(nn.Module):
    """A row split with one wide projection per chunk: the split's backward is a cat of the chunks'
    input-gradient matmuls, each computed into the cat's buffer by Inductor."""

    def __init__(self, d: int = 64, wide: int = 512, chunks: int = 8) -> None:
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.heads = nn.ModuleList(nn.Linear(d, wide, bias=False) for _ in range(chunks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        parts = self.inp(x).chunk(len(self.heads))
        return sum(torch.tanh(head(p)).sum() for head, p in zip(self.heads, parts))


def test_a_backward_cat_under_inductor_is_allocated_at_its_first_input():
    """The cat's 256 KiB buffer exists from the first chunk's gradient on, while every chunk's saved
    activation is still alive. Before the model knew, it counted one 32 KiB chunk there instead:
    4,915,720 B predicted, 5,145,096 B measured (now 5,145,096 B). The bound is that chunk's bytes."""
    problem = inductor_problem("cpu")
    if problem is not None:
        pytest.skip(f"this machine cannot run Inductor on CPU: {problem}")
    torch.manual_seed(0)
    model, x = _RowChunks(), torch.randn(1024, 64)
    om = autoremat.optimize(model, budget=10**10, example_inputs=(x,), optimizer=None, compiler="inductor",
                            regions=False, verify=False, progress=False)
    nodes = om._planners[0].profiles[0].nodes
    assert sum(1 for p in nodes.values() if p.into) == len(model.heads)

    def step():
        om(x).backward()

    step()
    step()
    _, m = measure_peak(step, baseline_objs=(model, x))
    assert abs(om.plan.predicted_peak - m.peak_bytes) < 1024 // 8 * 64 * 4, (om.plan.predicted_peak, m.peak_bytes)


class MaskedAttention(nn.Module):
    """Attention whose additive mask is broadcast to every head before the kernel, as CUDA's SDPA hands it to
    its kernels (attention.cpp preprocess_mask); `efficient` calls CUDA's memory-efficient kernel itself
    (traceable on meta: its fake kernels exist)."""

    B, H, S, D = 2, 8, 128, 16

    def __init__(self, efficient: bool = False) -> None:
        super().__init__()
        self.efficient = efficient
        self.qkv = nn.Linear(self.H * self.D, 3 * self.H * self.D)

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        B, H, S, D = self.B, self.H, self.S, self.D
        q, k, v = (t.view(B, S, H, D).transpose(1, 2) for t in self.qkv(x).split(H * D, -1))
        mask = torch.where(keep, 0.0, float("-inf")).expand(B, H, S, S)
        if self.efficient:
            y = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, mask, True)[0]
        else:
            y = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return y.square().mean()


def _mask_inputs(device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    B, H, S, D = MaskedAttention.B, MaskedAttention.H, MaskedAttention.S, MaskedAttention.D
    keep = torch.ones(S, S, dtype=torch.bool, device=device).tril().expand(B, 1, S, S)
    return torch.randn(B, S, H * D, device=device), keep


def test_inductor_copies_an_expanded_attention_mask_densely_and_the_plan_holds_it():
    """Inductor's sdpa_constraint hands an attention kernel a dense copy of a mask expanded to every
    head. Unmodelled, the step measured 917,508 B over the plan (the (2, 8, 128, 128) fp32 copy, 1 MiB, less
    the (2, 1, 128, 128) mask Inductor computed into the copy instead); at Qwen2's 4 x 16 x 2048 x 2048 on CUDA
    that copy is 1 GiB. Now the copy is the kernel's scratch: the plan is above the measured peak by at most
    that unexpanded mask."""
    problem = inductor_problem("cpu")
    if problem is not None:
        pytest.skip(f"this machine cannot run Inductor on CPU: {problem}")
    torch.manual_seed(0)
    model, (x, keep) = MaskedAttention(), _mask_inputs()
    om = autoremat.optimize(model, budget=10**10, example_inputs=(x, keep), optimizer=None, compiler="inductor",
                            progress=False)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)

    def step():
        om(x, keep).backward()

    step()
    _, m = measure_peak(step, baseline_objs=(model, x, keep))
    unexpanded = model.B * 1 * model.S * model.S * 4
    assert 0 <= om.plan.activation_peak - m.delta_peak_bytes <= unexpanded, (om.plan.activation_peak, m)


def test_on_cuda_inductor_keeps_an_expanded_masks_base_saved_so_no_copy_is_made():
    """On CUDA, the efficient backward gets the mask as a view with strides (no copy) only when its base is a
    buffer the forward handed over; recomputed in the backward, Inductor copies the view densely (1 GiB for Qwen2).
    Traced on meta for an H200 under Inductor, the mask's base (`where`) may not be recomputed; for a CPU it may,
    and the copy is the attention kernels' scratch instead."""
    model, (x, keep) = MaskedAttention(efficient=True).to("meta"), _mask_inputs("meta")
    (cg,) = capture(model, (x, keep))
    cg = dataclasses.replace(cg, compiler="inductor")
    where = next(n.name for n in cg.joint.graph.nodes if n.target is torch.ops.aten.where.self)
    h200, cpu = profile_graph(cg, "h200"), profile_graph(cg, "cpu")
    assert "sdpa_constraint" in h200.nodes[where].recompute_ban
    assert cpu.nodes[where].recompute_ban == ""
    attention = [n.name for n in cg.joint.graph.nodes if "efficient_attention" in str(n.target)]
    expanded = model.B * model.H * model.S * model.S * 4
    assert all(h200.nodes[a].transient_bytes == 0 for a in attention)
    assert all(cpu.nodes[a].transient_bytes >= expanded for a in attention)


def test_reductions_summed_by_fused_adds_run_in_the_kernel_that_adds_them():
    """A bias gradient over two chunks and a tangent: db = t.sum(0) + g1.sum(0) + g2.sum(0). Inductor computes the
    three sums inside the kernel of the last add, after g2 exists, so g1 and t live until then. A sum read
    by a matmul, or by a pointwise op of another size (a LayerNorm's row sums), runs where the graph puts it."""
    def f(t, g1, g2, w, x):
        db = t.sum(0) + g1.sum(0) + g2.sum(0)
        rows = x.sum(1, keepdim=True)  # [8, 1], read by a pointwise op over [8, 16]
        return db, g1 @ w, g2 @ w, x - rows, torch.mm(x.sum(0, keepdim=True), w)

    gm = make_fx(f)(*(torch.randn(8, 16) for _ in range(3)), torch.randn(16, 4), torch.randn(8, 16))
    sums = [n.name for n in gm.graph.nodes if n.op == "call_function" and n.target is torch.ops.aten.sum.dim_IntList]
    out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    outputs = {a.name for a in out}
    backward = {n.name for n in gm.graph.nodes if n.op == "call_function"}
    fused = fused_nodes(gm, outputs=outputs, aliases={}, banned=set())
    first_add = next(n.name for n in gm.graph.nodes if n.op == "call_function" and n.target is torch.ops.aten.add.Tensor)
    assert first_add in fused and out[0].name not in fused  # t.sum + g1.sum is inlined into the last add
    assert epilogue_reductions(gm, fused, backward, {}, outputs) == set(sums[:3])


def _at_the_chunked_floor(model: nn.Module, kwargs: dict, chunks: int, outputs: str) -> tuple[int, int]:
    """(predicted, measured) activations of `model`'s step planned under Inductor with its loss in `chunks`
    pieces, at the floor that count's floor query names; the steady-state step measured as verification does."""
    problem = inductor_problem("cpu")
    if problem is not None:
        pytest.skip(f"this machine cannot run Inductor on CPU: {problem}")
    from autoremat.model.devices import get_device
    from autoremat.model.ledger import ledger_for_model
    from autoremat.planning.options import PlanOptions, TrainingStep
    from autoremat.planning.pipeline import build_with_count
    from autoremat.planning.verify import measure_step

    where, dev = torch.device("cpu"), get_device("cpu")
    ledger = ledger_for_model(model, None, inputs=((), kwargs), device_granularity=dev.alloc_granularity)
    options = PlanOptions(compiler="inductor", verify=False, outputs=outputs)
    step = TrainingStep(model, (), kwargs, where, dev, ledger, options, "inductor")
    with pytest.raises(autoremat.BudgetError) as refused:
        build_with_count(step, 1, [], None, {}, chunks)
    plan, compiled, applier, _ = build_with_count(step, refused.value.smallest_budget, [], None, {}, chunks)
    assert plan.loss["chunks"] == chunks
    return plan.activation_peak, measure_step(model, compiled, applier, (), kwargs, where, warm=True)


def test_a_biased_head_in_chunks_under_inductor_holds_at_its_floor():
    """HF BERT's masked-LM head has a bias, and its logits are returned. With its loss in 4 chunks, each chunk's
    bias gradient is a sum over its rows; Inductor adds them, and the logits tangent's sum, in one kernel after
    the last chunk, so every chunk's logits gradient and the tangent are alive at once. Unmodelled, they put
    the step at the floor it named over its prediction (`benchmarks/inductor_buffers.py --model bert` lists
    them on plan_time.py's 2-layer BERT).

    The prediction may not be under the measurement (the budget would break). It may be over it by at most one
    logits-sized buffer per chunk (64 rows x 1024 x 4 B each): the model takes every chunk's logits-gradient
    kernel, and the buffer it scatters the targets into, into the kernel that adds up the bias gradient
    (inductor_code._producer_reads), and Inductor may run some of those kernels on their own (torch 2.13 took
    all four in here; torch 2.11 ran each on its own, 447,744 B under the prediction)."""
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(0)
    vocab, batch, seq, chunks = 1024, 4, 64, 4
    model = BertForMaskedLM(BertConfig(vocab_size=vocab, hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                                       intermediate_size=256, max_position_embeddings=seq))
    ids = torch.randint(0, vocab, (batch, seq))
    predicted, measured = _at_the_chunked_floor(model, {"input_ids": ids, "labels": ids}, chunks, "all")
    one_chunk = batch * seq // chunks * vocab * 4
    assert 0 <= predicted - measured <= chunks * one_chunk, (predicted, measured)


def test_a_loss_only_biased_head_in_chunks_under_inductor_holds_at_its_floor():
    """A biased head over 4 loss chunks, the loss alone returned (tests.models.HeadLM). Inductor takes three
    chunks' logits-gradient kernels, with the scatter buffers of their targets, into the kernel that adds up
    the bias gradient (inductor_code._producer_reads), so those buffers are alive at once. Unmodelled, they put
    the step at its 4-chunk floor over its prediction (`benchmarks/inductor_buffers.py --model head` lists them
    on plan_time.py --cliff's `biased` head).

    The prediction may not be under the measurement. It may be over it by at most one logits-sized buffer per
    chunk (64 rows x 4096 x 4 B each), for the chunks whose kernels Inductor runs on their own (one here on
    torch 2.13), as in the BERT test above."""
    from tests.models import HeadLM

    torch.manual_seed(0)
    vocab, batch, seq, chunks = 4096, 4, 64, 4
    model = HeadLM(vocab, 32, bias=True, gate=False)
    ids = torch.randint(0, vocab, (batch, seq))
    predicted, measured = _at_the_chunked_floor(model, {"ids": ids, "labels": ids}, chunks, "loss")
    one_chunk = batch * seq // chunks * vocab * 4
    assert 0 <= predicted - measured <= chunks * one_chunk, (predicted, measured)
