"""The loss region (autoremat.passes.loss_chunks): the chunked projection + cross-entropy rewrite.

Exactness against eager for the forms it recognises, patterns it must leave alone, and, through
`optimize`, that outputs="loss" never allocates the full logits, that the memory model predicts the
chunked step, and that the chunk count the planner chose is recorded, printed and re-applied.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

import autoremat
from autoremat.capture.aot import aot_backend, capture, compile_fresh, default_split
from autoremat.measure import allocation_deltas, measure_peak
from autoremat.passes import loss_chunks as LC
from autoremat.planning.plan import Plan
from examples.models import gpt2
from tests.tolerances import assert_close_for, assert_grads_close


class Head(nn.Module):
    """A small trunk, a vocabulary projection and cross-entropy written in one of the recognised forms."""

    def __init__(self, form: str, reduction: str = "mean", smoothing: float = 0.0, d: int = 16, vocab: int = 96,
                 **ce) -> None:
        super().__init__()
        self.form, self.reduction, self.smoothing, self.ce = form, reduction, smoothing, ce
        self.trunk = nn.Linear(d, d)
        self.head = nn.Linear(d, vocab, bias=form != "matmul")
        self.vocab = vocab

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.trunk(x))  # [B, T, d]
        if self.form == "matmul":
            logits = h @ self.head.weight.t()
        else:
            logits = self.head(h)
        if self.form == "shift":  # the older HF causal-LM form: shift the logits, not the labels
            logits, y = logits[..., :-1, :].contiguous(), y[..., 1:].contiguous()
        if self.form == "ncl":  # classes in dim 1: not recognised
            return F.cross_entropy(logits.transpose(1, 2), y, reduction=self.reduction, **self.ce)
        return F.cross_entropy(logits.float().view(-1, self.vocab), y.reshape(-1), reduction=self.reduction,
                               label_smoothing=self.smoothing, **self.ce)


def inputs(vocab: int = 96, d: int = 16, batch: int = 3, seq: int = 10) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(batch, seq, d, generator=gen)
    y = torch.randint(0, vocab, (batch, seq), generator=gen)
    y[0, :4] = -100  # ignored rows, one whole chunk of them included
    return x, y


def compiled_with(model: nn.Module, chunks: int, outputs: str = "all") -> tuple:
    report = LC.Report()
    backend = aot_backend(default_split, pre_pass=lambda i, gm, ex: LC.rewrite(gm, chunks, outputs, report))
    return compile_fresh(model, backend), report


def loss_and_grads(fn, model: nn.Module, *args, **kwargs) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    out = fn(*args, **kwargs)
    loss = out if isinstance(out, torch.Tensor) else out.loss
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def depth(rows: int, vocab: int, d: int) -> int:
    """Roundings between the two computations: the log-sum over the vocabulary, the sum over token rows
    (reordered by chunking), and the d-term dot products the gradient flows back through."""
    return vocab + rows + 4 * d


@pytest.mark.parametrize(("form", "reduction", "smoothing"), [
    ("view", "mean", 0.0), ("view", "sum", 0.0), ("view", "mean", 0.1), ("view", "sum", 0.2),
    ("matmul", "mean", 0.0), ("shift", "mean", 0.0), ("shift", "sum", 0.1)])
def test_chunked_loss_matches_eager(form: str, reduction: str, smoothing: float) -> None:
    torch.manual_seed(0)
    model = Head(form, reduction, smoothing)
    x, y = inputs()
    ref_loss, ref_grads = loss_and_grads(model, model, x, y)
    fn, report = compiled_with(model, chunks=4)
    loss, grads = loss_and_grads(fn, model, x, y)
    assert report.rewritten == 1, report
    d = depth(x.shape[0] * x.shape[1], model.vocab, x.shape[-1])
    assert_close_for(loss, ref_loss, depth=d)
    assert_grads_close([(g, r) for g, r in zip(grads, ref_grads)], depth=d)


class Between(nn.Module):
    """A vocabulary projection, then row-local ops the way HF families write them, then the loss; the logits
    (in their last form) are returned beside it, as a causal LM returns them."""

    def __init__(self, form: str, d: int = 16, vocab: int = 96) -> None:
        super().__init__()
        self.form, self.vocab = form, vocab
        self.trunk = nn.Linear(d, d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.column = nn.Parameter(torch.randn(vocab) * 0.1)  # a learned per-vocabulary bias
        self.register_buffer("banned", (torch.arange(vocab) % 7 == 0).view(1, 1, vocab))  # a vocabulary mask

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.head(torch.tanh(self.trunk(x)))
        if self.form == "softcap":  # Gemma-2's final_logit_softcapping
            logits = torch.tanh(logits / 3.0) * 3.0
        elif self.form == "scale":  # Cohere's logit_scale
            logits = logits * 0.25
        elif self.form == "divide":  # Granite's logits_scaling
            logits = logits / 4.0
        elif self.form == "contiguous":  # OPT: the returned logits and the loss share one .contiguous()
            logits = logits.contiguous()
        elif self.form == "bias and mask":
            logits = (logits + self.column).masked_fill(self.banned, -1e4)
        elif self.form == "scale after the cast":
            logits = logits.float() * 2.0
        loss = F.cross_entropy(logits.float().view(-1, self.vocab), y.view(-1))
        return loss, logits


@pytest.mark.parametrize("outputs", ["all", "loss"])
@pytest.mark.parametrize("form", ["softcap", "scale", "divide", "contiguous", "bias and mask", "scale after the cast"])
def test_row_local_ops_between_projection_and_loss_are_chunked(form: str, outputs: str) -> None:
    """The loss region is found by what the ops between the projection and the loss compute: each acts on
    every row alone (pointwise, with operands that are the same for every row), so it is applied to each
    chunk's logits and the loss and gradients are eager's; the returned logits are eager's too."""
    torch.manual_seed(0)
    model = Between(form)
    x, y = inputs()
    model.zero_grad(set_to_none=True)
    ref_loss, ref_logits = model(x, y)
    ref_loss.backward()
    ref_grads = [p.grad for p in model.parameters()]
    fn, report = compiled_with(model, chunks=4, outputs=outputs)
    model.zero_grad(set_to_none=True)
    loss, logits = fn(x, y)
    loss.backward()
    assert report.rewritten == 1 and not report.skipped, report
    assert report.logits_kept == (outputs == "all"), report
    d = depth(x.shape[0] * x.shape[1], model.vocab, x.shape[-1])
    assert_close_for(loss.detach(), ref_loss.detach(), depth=d)
    if outputs == "all":
        assert_close_for(logits.detach(), ref_logits.detach(), depth=d)
    else:
        assert logits is None
    for p, r in zip(model.parameters(), ref_grads):
        assert (p.grad is None) == (r is None)
        if r is not None:
            assert_close_for(p.grad, r, depth=d)


def test_logits_read_by_a_second_term_are_kept_and_the_loss_chunked() -> None:
    """A view of the logits that also feeds another term of the loss: the cross-entropy is chunked, and the
    other reader gets the whole logits, computed once more after the chunks."""
    class Twice(Head):
        def forward(self, x, y):
            logits = self.head(torch.tanh(self.trunk(x))).view(-1, self.vocab)
            return F.cross_entropy(logits, y.view(-1)) + logits.square().mean()

    torch.manual_seed(0)
    model = Twice("view")
    x, y = inputs()
    ref_loss, ref_grads = loss_and_grads(model, model, x, y)
    fn, report = compiled_with(model, chunks=4)
    loss, grads = loss_and_grads(fn, model, x, y)
    assert report.rewritten == 1 and report.logits_kept == 1, report
    d = depth(x.shape[0] * x.shape[1], model.vocab, x.shape[-1])
    assert_close_for(loss, ref_loss, depth=d)
    for g, r in zip(grads, ref_grads):
        assert_close_for(g, r, depth=d)


@pytest.mark.parametrize("case", ["per-row scale", "dropout", "softmax"])
def test_ops_that_are_not_row_local_pointwise_leave_the_loss_whole(case: str) -> None:
    """An op between the projection and the loss that reads other rows' values, draws random numbers or is not
    pointwise by its schema is not applied per chunk: the loss is left as the model wrote it, with the reason."""
    class Other(Head):
        def forward(self, x, y):
            h = torch.tanh(self.trunk(x))
            logits = self.head(h)
            if case == "per-row scale":  # an operand that differs from row to row
                logits = logits * h.sum(-1, keepdim=True).sigmoid()
            elif case == "dropout":
                logits = F.dropout(logits, 0.1)
            else:
                logits = logits.softmax(-1)
            return F.cross_entropy(logits.view(-1, self.vocab), y.view(-1))

    torch.manual_seed(0)
    model = Other("view")
    x, y = inputs()
    fn, report = compiled_with(model, chunks=4)
    torch.manual_seed(1)
    got = fn(x, y).detach()
    torch.manual_seed(1)
    ref = model(x, y).detach()
    assert report.rewritten == 0 and report.sites == 0, report
    assert "pointwise" in report.skipped[0], report.skipped
    if case != "dropout":  # dropout's mask is drawn by the compiled graph's own order of draws
        assert_close_for(got, ref, depth=2)


@pytest.mark.parametrize("case", ["scaled in place and returned", "a cast scaled in place", "the projection in place"])
def test_logits_written_in_place_leave_the_loss_whole(case: str) -> None:
    """A form of the logits that some op writes into in place: moving or dropping the forms would lose the
    write, so the site is left as the model wrote it, with the reason, and loss and logits are eager's."""
    class InPlace(Head):
        def forward(self, x, y):
            logits = self.head(torch.tanh(self.trunk(x)))
            if case == "scaled in place and returned":
                scaled = logits.mul_(3.0)
                return F.cross_entropy(scaled.view(-1, self.vocab), y.view(-1)), logits
            if case == "a cast scaled in place":
                cast = logits.float()
                cast.mul_(3.0)
                return F.cross_entropy(cast.view(-1, self.vocab), y.view(-1)), logits
            logits.mul_(3.0)
            return F.cross_entropy(logits.view(-1, self.vocab), y.view(-1)), logits

    torch.manual_seed(0)
    model = InPlace("view")
    x, y = inputs()
    ref_loss, ref_logits = (t.detach() for t in model(x, y))
    fn, report = compiled_with(model, chunks=4)
    loss, logits = (t.detach() for t in fn(x, y))
    assert report.rewritten == 0 and report.skipped, report
    assert_close_for(loss, ref_loss, depth=2)
    assert_close_for(logits, ref_logits, depth=2)


@pytest.mark.parametrize("case", ["class weight", "reduction none", "classes in dim 1"])
def test_unrecognised_patterns_are_left_alone(case: str) -> None:
    torch.manual_seed(0)
    x, y = inputs()
    if case == "class weight":
        model = Head("view", weight=torch.rand(96))
    elif case == "reduction none":
        model = Head("view", reduction="none")
    else:
        model = Head("ncl")

    def run(fn):
        out = fn(x, y)
        return (out.sum() if out.dim() else out).detach()

    ref = run(model)
    fn, report = compiled_with(model, chunks=4)
    got = run(fn)
    assert report.rewritten == 0 and report.sites == 0, report
    assert report.skipped, "the cross_entropy call should be reported as not chunked, with the reason"
    assert_close_for(got, ref, depth=2)  # the same graph, compiled: no reordering beyond the compiler's


@pytest.mark.parametrize("outputs", ["all", "loss"])
@pytest.mark.parametrize("sum_reduction", [False, True])
def test_hf_gpt2_loss_and_gradients_exact(outputs: str, sum_reduction: bool) -> None:
    """HF's ForCausalLM loss (labels padded with -100 and shifted; reduction "sum" over num_items_in_batch)."""
    torch.manual_seed(0)
    model, ex = gpt2(batch=2, seq=16, n_layer=2, n_embd=32, vocab=300, dropout=0.0)
    ex["labels"] = ex["labels"].clone()
    ex["labels"][0, :5] = -100
    if sum_reduction:
        ex["num_items_in_batch"] = (ex["labels"][:, 1:] != -100).sum()
    ref_loss, ref_grads = loss_and_grads(model, model, **ex)
    ref_logits = model(**ex).logits.detach()
    fn, report = compiled_with(model, chunks=4, outputs=outputs)
    loss, grads = loss_and_grads(fn, model, **ex)
    assert report.rewritten == 1, report
    d = depth(32, 300, 32 * 4 * 2)
    assert_close_for(loss, ref_loss, depth=d)
    assert_grads_close([(g, r) for g, r in zip(grads, ref_grads)], depth=d)
    logits = fn(**ex).logits
    if outputs == "loss":
        assert logits is None
    else:
        assert_close_for(logits.detach(), ref_logits, depth=2)


# Through optimize ----------------------------------------------------------------------------

VOCAB, BATCH, SEQ, D = 8192, 2, 128, 32  # logits 8 MiB: well above the weight gradient (1 MiB) and a chunk


def small_lm() -> tuple[nn.Module, dict]:
    torch.manual_seed(0)
    return gpt2(batch=BATCH, seq=SEQ, n_layer=2, n_embd=D, vocab=VOCAB, dropout=0.0)


def logits_bytes() -> int:
    return BATCH * SEQ * VOCAB * 4


def largest_allocation(step) -> int:
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    return max(n for _, n in allocation_deltas(prof, torch.device("cpu")))


def floor_of(model: nn.Module, ex: dict, outputs: str) -> int:
    with pytest.raises(autoremat.BudgetError) as info:
        autoremat.optimize(copy.deepcopy(model), 1, ex, optimizer=None, outputs=outputs, compiler="eager")
    return info.value.smallest_budget


@pytest.fixture(scope="module")
def at_floor():
    """outputs="loss" planned at its smallest feasible budget, where chunking is what makes it fit."""
    torch.set_num_threads(1)
    model, ex = small_lm()
    budget = floor_of(model, ex, "loss")
    opt = autoremat.optimize(model, budget, ex, optimizer=None, outputs="loss", compiler="eager")
    return model, ex, opt, budget


def step_of(fn, ex):
    def step():
        out = fn(**ex)
        out.loss.backward()
    return step


def test_outputs_loss_never_allocates_the_logits(at_floor) -> None:
    model, ex, opt, _ = at_floor
    assert opt.plan.loss["chunks"] > 1, opt.plan.loss
    step = step_of(opt, ex)
    step()  # .grad buffers exist from here on, as on every later micro-step
    assert largest_allocation(step) < logits_bytes() / 4
    # The control: eager allocates the logits (and their log-softmax) whole, so the check above can fail.
    eager = step_of(model, ex)
    eager()
    assert largest_allocation(eager) >= logits_bytes()


def test_memory_model_predicts_the_chunked_step(at_floor) -> None:
    model, ex, opt, budget = at_floor
    step = step_of(opt, ex)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)  # the accumulation steady state the plan is made for
    _, m = measure_peak(step, baseline_bytes=0)
    predicted = opt.plan.activation_peak
    assert abs(predicted - m.delta_peak_bytes) <= 0.05 * m.delta_peak_bytes, (predicted, m.delta_peak_bytes)
    # Far below what the unchunked step needs: the planner's floor without the rewrite.
    kept = LC.CANDIDATES
    try:
        LC.CANDIDATES = (1,)
        unchunked = floor_of(model, ex, "all")  # the loss region as the model wrote it
    finally:
        LC.CANDIDATES = kept
    assert budget < unchunked - 2 * logits_bytes()


def test_plan_records_prints_and_reapplies_the_chunks(at_floor) -> None:
    model, ex, opt, budget = at_floor
    plan = opt.plan
    k = plan.loss["chunks"]
    assert f"loss chunked into {k} pieces" in plan.summary()
    assert set(plan.loss["candidates"]) == {str(c) for c in LC.candidates(BATCH * SEQ)}
    again = Plan.from_json(plan.to_json())
    assert again == plan
    re = autoremat.optimize(copy.deepcopy(model), budget, ex, optimizer=None, plan=again, compiler="eager")
    assert re(**ex).logits is None  # outputs="loss" came with the plan
    torch.testing.assert_close(re(**ex).loss, opt(**ex).loss, rtol=0, atol=0)


def test_bad_outputs_value() -> None:
    model, ex = gpt2(batch=1, seq=8, n_layer=1, n_embd=16, vocab=64)
    with pytest.raises(ValueError, match="outputs must be 'all'.*or 'loss'"):
        autoremat.optimize(model, "1GB", ex, outputs="logits", compiler="eager")


def test_chunked_after_the_bf16_rewrite() -> None:
    """precision="bf16" casts the projection's inputs first (nodes without dynamo metadata): the pattern is
    still found, the chunks' matmuls run in bf16 and the loss in fp32, as the unchunked bf16 graph does."""
    from autoremat.model.precision_measure import castable
    from autoremat.passes.dtypes import apply_dtypes

    torch.manual_seed(0)
    model = Head("view")
    x, y = inputs()

    def run(chunks: int) -> tuple[torch.Tensor, LC.Report]:
        report = LC.Report()

        def pre(i, gm, ex):
            apply_dtypes(gm, {n: "bf16" for n in castable(gm)})
            LC.rewrite(gm, chunks, "all", report)
            for n in gm.graph.find_nodes(op="call_function", target=LC.chunked_cross_entropy):
                weight = n.args[1]  # the projection's weight as the chunks read it: cast to bf16
                assert weight.op == "call_method" and torch.bfloat16 in weight.args, weight.format_node()
                assert n.kwargs["dtype"] == torch.float32  # the loss itself in fp32, as the model's .float()

        torch._dynamo.reset()
        fn = compile_fresh(model, aot_backend(default_split, pre_pass=pre))
        return fn(x, y).detach(), report

    ref, _ = run(1)
    got, report = run(4)
    assert report.rewritten == 1, report
    assert got.dtype == torch.float32
    assert_close_for(got, ref, depth=2, dtype=torch.bfloat16)


@pytest.mark.slow
def test_cli_outputs_loss_prints_the_chunks(tmp_path) -> None:
    """`autoremat plan ... --outputs loss` at the smallest budget that fits says how the loss was chunked."""
    import contextlib
    import io
    import re
    from pathlib import Path

    from autoremat.cli import main

    target = f"{Path(__file__).resolve().parent.parent / 'examples' / 'models.py'}:gpt2"
    common = [target, "--batch", str(BATCH), "--seq", str(SEQ), "--opt", f"vocab={VOCAB}", "--opt", f"n_embd={D}",
              "--opt", "dropout=0.0", "--outputs", "loss", "--time-limit", "10"]
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        assert main(["plan", *common, "--budget", "1KB"]) == 1
    floor = int(re.search(r"smallest budget that fits is .*? \((\d+) bytes\)", err.getvalue()).group(1))
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        assert main(["plan", *common, "--budget", str(floor), "--json", str(tmp_path / "plan.json")]) == 0
    plan = Plan.load(tmp_path / "plan.json")
    k = plan.loss["chunks"]
    assert k > 1 and plan.loss["outputs"] == "loss"
    assert f"loss chunked into {k} pieces of {-(-BATCH * SEQ // k)} token rows; logits not returned" in out.getvalue()


class HeadAndLogits(Head):
    """Head's "view" form returning (loss, logits), as an HF causal LM does under outputs="all"."""

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.head(torch.tanh(self.trunk(x)))
        return F.cross_entropy(logits.float().view(-1, self.vocab), y.reshape(-1)), logits


def test_kept_logits_tangent_dies_before_the_chunks_backward() -> None:
    """outputs="all" keeps the logits output, so the joint graph has a tangent for it, tokens x vocabulary
    (autograd's zeros in a loop that calls only loss.backward()). Its backward is one view and two matmuls
    (into grad h and grad W); run after every chunk's backward, they would keep the tangent live through
    all of them. Expected by hand: with the projection moved after the chunked loss, autograd runs that
    backward first, so every reader of the tangent comes before the first tokens x vocabulary gradient that
    the loss's own tangent produces (a chunk's softmax gradient)."""
    torch.manual_seed(0)
    model = HeadAndLogits("view")
    x, y = inputs()
    report = LC.Report()
    joint = capture(model, (x, y), pre_pass=lambda i, gm, ex: LC.rewrite(gm, 4, "all", report))
    assert report.rewritten == 1 and report.logits_kept == 1, report
    graph = joint[0].joint.graph
    pos = {n: i for i, n in enumerate(graph.nodes)}
    tangents = [n for n in graph.nodes if n.op == "placeholder" and n.name.startswith("tangents")]
    by_rank = {n.meta["val"].dim(): n for n in tangents}
    loss_tangent, logits_tangent = by_rank[0], by_rank[3]
    assert tuple(logits_tangent.meta["val"].shape) == (3, 10, model.vocab)
    from_loss: set[fx.Node] = {loss_tangent}
    for n in graph.nodes:  # graph order is topological: one pass finds everything the loss's tangent reaches
        if any(a in from_loss for a in n.all_input_nodes):
            from_loss.add(n)
    chunk_grads = [pos[n] for n in from_loss if isinstance(n.meta.get("val"), torch.Tensor)
                   and n.meta["val"].dim() == 2 and n.meta["val"].shape[-1] == model.vocab]
    assert chunk_grads, "no tokens x vocabulary gradient reached from the loss's tangent"
    assert len(logits_tangent.users) >= 1
    assert max(pos[u] for u in logits_tangent.users) < min(chunk_grads)


@pytest.mark.parametrize("family", ["gemma2", "cohere", "granite", "opt"])
def test_hf_families_with_ops_between_projection_and_loss_are_chunked_exactly(family: str) -> None:
    """Gemma-2's softcap, Cohere's and Granite's logit scales, OPT's returned `.contiguous()` logits (with its
    dropout on), as transformers writes them: the loss region is found and chunked, and the loss, the returned
    logits and the gradients are eager's (same seed)."""
    from examples import zoo

    model, batch = zoo.build(family, zoo.TINY)

    def run(fn):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(3)
        out = fn(**batch)
        out.loss.backward()
        return out.loss.detach(), out.logits.detach(), [(n, p.grad.clone()) for n, p in model.named_parameters()]

    ref_loss, ref_logits, ref_grads = run(model)
    fn, report = compiled_with(model, chunks=4)
    loss, logits, grads = run(fn)
    assert report.rewritten == 1 and not report.skipped, report
    d = depth(zoo.TINY.batch * zoo.TINY.tokens, zoo.TINY.vocab, zoo.TINY.hidden) * zoo.TINY.layers
    assert_close_for(loss, ref_loss, depth=d)
    assert_close_for(logits, ref_logits, depth=d)
    assert_grads_close([(g, r, n) for (n, g), (_, r) in zip(grads, ref_grads, strict=True)], depth=d)
