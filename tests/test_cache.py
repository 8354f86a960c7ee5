"""The on-disk plan cache: a second optimize skips the solver; nothing read from disk is trusted."""

import contextlib
import importlib
import json
import logging

import pytest
import torch
from torch._dynamo.utils import counters

import autoremat
from autoremat import progress
from autoremat.model.ledger import Ledger
from autoremat.planning.cache import PlanCache
from autoremat.planning.compilers import inductor_problem
from autoremat.solve.decision import PlanPath, Route
from examples import models
from tests.tolerances import assert_grads_close, batch_depth


def _model():
    torch.manual_seed(0)
    return models.transformer_stack(n_layer=1, d=16, seq=8, batch=2)


# The stages a plan goes through, as the progress log names them to the user (`logging.INFO` on
# autoremat.progress): a cache hit captures the step and applies the plan, and names no stage that solves,
# chooses a chunk count or traces one.
SOLVING = ("solving", "planning the loss region", "tracing the loss region", "the ILP chose", "re-planning",
           "no chunk count traced")


@contextlib.contextmanager
def _stages():
    """The progress log's stage messages while the block runs (a long stage's repeated pulse left out)."""
    seen: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: seen.append(record.getMessage())
    logger = logging.getLogger(progress.LOGGER)
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield seen
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        seen[:] = [m for m in seen if ": still running" not in m]


def _solved(stages: list[str]) -> list[str]:
    return [m for m in stages if m.startswith(SOLVING)]


def _assert_eager_gradients(model, step, ex):
    torch.manual_seed(1)  # dropout: same draws in both
    ref = torch.autograd.grad(model(*ex), list(model.parameters()))
    torch.manual_seed(1)
    got = torch.autograd.grad(step(*ex), list(model.parameters()))
    assert_grads_close([(g, r) for g, r in zip(got, ref, strict=True)], depth=batch_depth(ex))


def test_second_optimize_skips_the_solver(tmp_path):
    model, ex = _model()
    first = autoremat.optimize(model, budget="1GB", example_inputs=ex, cache=tmp_path, compiler="eager")
    assert first.plan.solver_path.route is not Route.CACHE
    assert len(list(tmp_path.glob("*.json"))) == 1
    with _stages() as stages:
        second = autoremat.optimize(model, budget="1GB", example_inputs=ex, cache=tmp_path, compiler="eager")
    assert second.plan.solver_path.route is Route.CACHE
    assert stages and not _solved(stages), stages
    assert PlanPath.parse(second.plan.solver["solved_by"]) == first.plan.solver_path
    assert second.plan.graphs[0].saved == first.plan.graphs[0].saved
    assert second.plan.activation_peak == first.plan.activation_peak
    _assert_eager_gradients(model, second, ex)


def test_key_covers_budget_and_options(tmp_path):
    model, ex = _model()
    autoremat.optimize(model, budget="1GB", example_inputs=ex, cache=tmp_path, verify=False, compiler="eager")
    other = autoremat.optimize(model, budget="2GB", example_inputs=ex, cache=tmp_path, verify=False, compiler="eager")
    assert other.plan.solver_path.route is not Route.CACHE
    sgd = autoremat.optimize(model, budget="1GB", example_inputs=ex, cache=tmp_path, verify=False, optimizer="sgd", compiler="eager")
    assert sgd.plan.solver_path.route is not Route.CACHE
    assert len(list(tmp_path.glob("*.json"))) == 3


def test_env_var_sets_the_default_location(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOREMAT_CACHE_DIR", str(tmp_path / "c"))
    model, ex = _model()
    autoremat.optimize(model, budget="1GB", example_inputs=ex, cache=True, verify=False, compiler="eager")
    assert len(list((tmp_path / "c").glob("*.json"))) == 1
    autoremat.optimize(model, budget="1GB", example_inputs=ex, cache=False, verify=False, compiler="eager")
    assert len(list((tmp_path / "c").glob("*.json"))) == 1


def _entry(tmp_path):
    (path,) = tmp_path.glob("*.json")
    return path


@pytest.mark.parametrize("damage", ["garbage", "empty", "wrong_key", "other_schema", "bad_names", "too_big",
                                    "other_torch"])
def test_damaged_entries_are_ignored_and_rewritten(tmp_path, damage):
    model, ex = _model()
    good = autoremat.optimize(model, budget="1GB", example_inputs=ex, cache=tmp_path, verify=False, compiler="eager").plan
    path = _entry(tmp_path)
    entry = json.loads(path.read_text())
    plan = entry["plan"]
    if damage == "garbage":
        path.write_bytes(b"\x00garbage{")
    elif damage == "empty":
        path.write_text("")
    else:
        if damage == "wrong_key":
            entry["key"] = "0" * 32
        elif damage == "other_schema":
            plan["schema"] = 999
        elif damage == "bad_names":
            plan["graphs"][0]["saved"] = ["no_such_node"]
        elif damage == "too_big":  # claims to fit, but saves everything: the simulator says it does not
            plan["graphs"][0]["saved"] = [n for g in good.graphs for n in g.saved + g.recomputed]
        elif damage == "other_torch":
            plan["versions"]["torch"] = "0.0.1"
        path.write_text(json.dumps(entry))
    if damage == "too_big":  # make the lie matter: a budget the all-saved plan cannot meet
        return _too_big(tmp_path, model, ex, good)
    again = autoremat.optimize(model, budget="1GB", example_inputs=ex, cache=tmp_path, verify=False, compiler="eager")
    assert again.plan.solver_path.route is not Route.CACHE
    assert again.plan.graphs[0].saved == good.graphs[0].saved
    fresh = json.loads(_entry(tmp_path).read_text())  # rewritten with a good plan
    assert fresh["plan"]["graphs"][0]["saved"] == good.graphs[0].saved
    assert autoremat.optimize(model, budget="1GB", example_inputs=ex, cache=tmp_path,
                              verify=False, compiler="eager").plan.solver_path.route is Route.CACHE


def _too_big(tmp_path, model, ex, good):
    ledger = autoremat.planning.plan.Ledger.from_dict(good.ledger)
    with pytest.raises(autoremat.BudgetError) as err:
        autoremat.optimize(model, budget=ledger.fixed + 1, example_inputs=ex, verify=False, compiler="eager")
    budget = (err.value.smallest_budget + ledger.fixed + good.baseline_peak) // 2  # forces recomputation
    tight = autoremat.optimize(model, budget=budget, example_inputs=ex, cache=tmp_path, verify=False, compiler="eager").plan
    assert tight.graphs[0].recomputed
    path = max(tmp_path.glob("*.json"), key=lambda p: p.stat().st_mtime)
    entry = json.loads(path.read_text())
    entry["plan"]["graphs"][0]["saved"] = sorted(set(tight.graphs[0].saved) | set(tight.graphs[0].recomputed))
    entry["plan"]["graphs"][0]["recomputed"] = []
    path.write_text(json.dumps(entry))
    again = autoremat.optimize(model, budget=budget, example_inputs=ex, cache=tmp_path, verify=False, compiler="eager")
    assert again.plan.solver_path.route is not Route.CACHE  # re-simulated: it would overshoot, so not trusted
    assert again.plan.graphs[0].saved == tight.graphs[0].saved


def test_graph_breaks_are_cached_as_one_joint_plan(tmp_path):
    class DataDependent(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)

        def forward(self, x):
            h = torch.tanh(self.a(x))
            if h.sum() > 0:  # a graph break
                h = h * 2
            return torch.tanh(self.b(h)).sum()

    torch.manual_seed(0)
    model, x = DataDependent(), torch.randn(8, 16)
    first = autoremat.optimize(model, budget="1GB", example_inputs=(x,), cache=tmp_path, compiler="eager")
    with _stages() as stages:
        second = autoremat.optimize(model, budget="1GB", example_inputs=(x,), cache=tmp_path, compiler="eager")
    assert stages and not _solved(stages), stages
    assert second.num_graphs == 2 and second.plan.solver_path.route is Route.CACHE
    assert [g.saved for g in second.plan.graphs] == [g.saved for g in first.plan.graphs]


def test_a_chunked_loss_region_is_found_without_tracing_every_count_again(tmp_path):
    """A plan whose loss region the ILP chunked is stored under the chunked trace's key, known only once that
    count is traced; the count is remembered under a key of the model's and batch's shapes, so the second
    run traces that count alone, once, instead of retracing and planning every candidate (plan_time.py's
    cache-hit variant times a hit)."""
    torch.manual_seed(0)
    model, batch = models.gpt2(batch=2, seq=32, n_layer=1, n_embd=32, n_head=2, vocab=1024, dropout=0.0)
    roomy = autoremat.optimize(model, budget="1GB", example_inputs=batch, optimizer=None, compiler="eager",
                               outputs="loss", verify=False, progress=False)
    # the fixed bytes and 60% of the unchunked step's activations with everything saved: it must recompute or chunk
    budget = Ledger.from_dict(roomy.plan.ledger).needs(int(0.6 * roomy.plan.activation_peak))
    first = autoremat.optimize(model, budget=budget, example_inputs=batch, optimizer=None, compiler="eager",
                               outputs="loss", cache=tmp_path, progress=False)
    assert first.plan.loss["chunks"] > 1 and len(first.plan.loss["candidates"]) > 2, first.plan.loss
    assert len(list(tmp_path.glob("*.json"))) == 2  # the plan, and the count under the step's key

    with _stages() as stages:
        second, traces = _aot_traces(lambda: autoremat.optimize(
            model, budget=budget, example_inputs=batch, optimizer=None, compiler="eager", outputs="loss",
            cache=tmp_path, progress=False))
    # the remembered count, captured once (one AOTAutograd trace per graph of the step); the cached plan is
    # swapped into its code: no count traced, nothing solved
    assert not _solved(stages) and traces == len({g.fingerprint for g in first.plan.graphs}), (stages, traces)
    assert second.plan.solver_path.route is Route.CACHE
    assert second.plan.loss["chunks"] == first.plan.loss["chunks"]
    assert [g.saved for g in second.plan.graphs] == [g.saved for g in first.plan.graphs]


def _aot_traces(run):
    before = counters["aot_autograd"]["total"]
    out = run()
    return out, counters["aot_autograd"]["total"] - before


def test_a_hit_traces_identical_blocks_once_even_where_their_plans_differ(tmp_path):
    """A 3-block stack is cut into 4 graphs: the embedding with block 0, blocks 1 and 2 (the same joint graph,
    so one AOTAutograd trace), and the head. At 60% of its activations the plan saves different values in
    blocks 1 and 2. A cache hit captures the step as a cold plan does (3 traces), then swaps the plan into
    the captured code: no block is traced again for its own saved set."""
    torch.manual_seed(0)
    model, ex = models.transformer_stack(n_layer=3, d=16, seq=8, batch=2)
    roomy = autoremat.optimize(model, budget="1GB", example_inputs=ex, optimizer=None, compiler="eager", verify=False,
                               progress=False)
    budget = Ledger.from_dict(roomy.plan.ledger).needs(int(0.6 * roomy.plan.activation_peak))
    first = autoremat.optimize(model, budget=budget, example_inputs=ex, optimizer=None, compiler="eager",
                               cache=tmp_path, progress=False)
    graphs = first.plan.graphs
    assert len(graphs) == 4 and graphs[1].fingerprint == graphs[2].fingerprint
    assert set(graphs[1].saved) != set(graphs[2].saved)  # the case this covers: one code, two saved sets
    with _stages() as stages:
        second, traces = _aot_traces(lambda: autoremat.optimize(model, budget=budget, example_inputs=ex,
                                                                optimizer=None, compiler="eager", cache=tmp_path,
                                                                progress=False))
    assert stages and not _solved(stages), stages
    assert second.plan.solver_path.route is Route.CACHE
    assert traces == len({g.fingerprint for g in graphs}) == 3
    assert [g.saved for g in second.plan.graphs] == [g.saved for g in graphs]
    grads = []
    for step in (model, second):  # regions hand gradients to .grad as they are made: read them there
        model.zero_grad(set_to_none=True)
        torch.manual_seed(1)  # dropout: same draws in both
        step(*ex).backward()
        grads.append([p.grad for p in model.parameters()])
    assert_grads_close([(g, r) for g, r in zip(grads[1], grads[0], strict=True)], depth=batch_depth(ex))


def test_a_one_graph_plan_is_found_in_the_cache(tmp_path, caplog):
    """regions="auto" plans a roomy 2-block stack as one graph, and stores the plan under that graph's key, and
    beside it that this step was planned as one graph. A second run traces that form alone (one AOTAutograd
    trace), whose plan is the hit: not the cut step first, whose key is not in the cache. Taken for a stale
    entry, the plan found there would be discarded and planned again on every run."""
    torch.manual_seed(0)
    model, ex = models.transformer_stack(n_layer=2, d=16, seq=8, batch=2)
    first, cold = _aot_traces(lambda: autoremat.optimize(model, budget="1GB", example_inputs=ex, cache=tmp_path,
                                                         compiler="eager", progress=False))
    assert first.num_graphs == 1 and any("one graph for the step" in n for n in first.plan.notes), first.plan.notes
    with _stages() as stages:
        second, hit = _aot_traces(lambda: autoremat.optimize(model, budget="1GB", example_inputs=ex, cache=tmp_path,
                                                             compiler="eager", progress=False))
    assert stages and not _solved(stages), stages
    assert second.plan.solver_path.route is Route.CACHE and second.num_graphs == 1
    assert hit == 1 < cold, (hit, cold)
    assert not [r for r in caplog.records if "cached plan" in r.getMessage()]
    _assert_eager_gradients(model, second, ex)


def test_a_remembered_one_graph_form_whose_plan_is_gone_is_captured_per_block(tmp_path):
    """The step's form is only a hint: where the one graph's plan is no longer in the cache, the step is
    captured per block and planned as a cold run plans it, to the same plan."""
    torch.manual_seed(0)
    model, ex = models.transformer_stack(n_layer=2, d=16, seq=8, batch=2)
    first = autoremat.optimize(model, budget="1GB", example_inputs=ex, cache=tmp_path, compiler="eager",
                               progress=False)
    plans = [p for p in tmp_path.glob("*.json") if "plan" in json.loads(p.read_text())]
    assert len(plans) == 1 and first.num_graphs == 1
    plans[0].unlink()
    again = autoremat.optimize(model, budget="1GB", example_inputs=ex, cache=tmp_path, compiler="eager",
                               progress=False)
    assert again.plan.solver_path.route is not Route.CACHE and again.num_graphs == 1
    assert [g.saved for g in again.plan.graphs] == [g.saved for g in first.plan.graphs]


@pytest.mark.parametrize("compiler", ["eager", "inductor"])
def test_a_stale_entry_is_planned_again(tmp_path, compiler, caplog):
    """A cached plan naming a value the graph does not have is discarded with a warning, and the step planned
    afresh. Under eager the step was captured without the plan: that capture is planned, with no trace more
    than a cold plan makes. Under Inductor the plan was applied while tracing: the step is traced again."""
    if compiler == "inductor" and (why := inductor_problem("cpu")):
        pytest.skip(f"this machine cannot run Inductor on CPU: {why}")
    model, ex = _model()
    good, cold = _aot_traces(lambda: autoremat.optimize(model, budget="1GB", example_inputs=ex, cache=tmp_path,
                                                        verify=False, compiler=compiler, progress=False))
    path = _entry(tmp_path)
    entry = json.loads(path.read_text())
    entry["plan"]["graphs"][0]["saved"] = ["no_such_node"]
    path.write_text(json.dumps(entry))
    again, traces = _aot_traces(lambda: autoremat.optimize(model, budget="1GB", example_inputs=ex, cache=tmp_path,
                                                           verify=False, compiler=compiler, progress=False))
    assert again.plan.solver_path.route is not Route.CACHE
    assert [g.saved for g in again.plan.graphs] == [g.saved for g in good.plan.graphs]
    assert any("no longer fits" in r.getMessage() for r in caplog.records)
    assert traces == cold + (compiler == "inductor")


def test_a_hit_that_cannot_be_swapped_in_is_planned_again(tmp_path, monkeypatch, caplog):
    """Under eager a hit is compiled by swapping the plan into the captured code. If that raises, the capture
    may be half changed: the entry is discarded, the step traced again without it and planned afresh."""
    model, ex = _model()
    good = autoremat.optimize(model, budget="1GB", example_inputs=ex, cache=tmp_path, verify=False, compiler="eager",
                              progress=False)
    pipeline = importlib.import_module("autoremat.planning.pipeline")

    def broken(*a, **k):
        raise RuntimeError("swap failed")
    monkeypatch.setattr(pipeline, "compile_with", broken)
    again = autoremat.optimize(model, budget="1GB", example_inputs=ex, cache=tmp_path, verify=False,
                               compiler="eager", progress=False)
    assert again.plan.solver_path.route is not Route.CACHE
    assert [g.saved for g in again.plan.graphs] == [g.saved for g in good.plan.graphs]
    assert any("could not be applied (RuntimeError: swap failed)" in r.getMessage() for r in caplog.records)
    _assert_eager_gradients(model, again, ex)


def test_cache_argument_is_checked():
    with pytest.raises(TypeError, match="cache must be"):
        PlanCache.open(3)
    assert PlanCache.open(False) is None
