"""Choose, for every forward value the backward reads, save or recompute: an ILP under a byte budget.

Variables, per forward-side node v of each graph: s_v (saved for the backward) and r_v (recomputed
in the backward), both binary. The objective is the predicted time of all recomputation.

Memory is written as running sums (design note: shared/notes/design-memory-ilp.md): one continuous
variable per point where the set of live values changes, tied to the previous one by an equality,
so every decision variable sits in O(1) rows and the model stays sparse:
- forward step t: the static live bytes of the core forward (what the outputs need) with nothing
  saved, plus the saved values that would already have died by t;
- backward step t: the static live bytes of the backward's own values, plus each saved value until
  its last backward use LN(v), plus each recomputed value from its first need FN(v) to LN(v).

The JIT schedule (memory.py) computes a recomputed value when its first consumer runs, so a
recomputed consumer w needed before u (FN(w) < FN(u)) drags u forward in time. Inside one repeated
block (e.g. "transformer.h.3", the natural checkpoint segment) we allow the drag and allocate u from
the earliest time a chain of recomputed consumers could need it (START); across blocks we forbid the
pair (r_u + r_w <= 1), since a drag there would keep whole layers alive. START is a lower and LN an
upper bound of the real lifetime, so the rows are conservative. Each solution is replayed by the
exact simulator and the ILP's budget calibrated against it (tightened on overshoot, loosened on
slack). The plans of heuristics.py (per-block modes, checkpointing, greedy) compete with it, and are
the answer when the ILP runs out of time.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
import warnings

import pulp

from autoremat.dtypes import DtypeChoices
from autoremat.heuristics import Decision, block_mode_plans, checkpoint_blocks, evaluate, greedy, save_all
from autoremat.memory import (
    INF,
    TANGENTS_HELD,
    Lifetimes,
    _Heap,
    _run,
    block_of,
    forward_slots,
    lifetimes,
    output_spans,
)
from autoremat.profile import GraphProfile

# Relative optimality gap of each MIP: 1% solved a 48-block stack in 2 s where 0.1% took 43 s, for
# the same objective (benchmarks/solver_scale.py).
DEFAULT_GAP = 0.01


def _block_twins(g: GraphProfile, life: Lifetimes) -> dict[str, str]:
    """Map each node of a repeated block to the same node of the first identical block.

    Two blocks are identical when their forward nodes, in order, have the same ops, shapes,
    dtypes, recompute bans and wiring (inputs named by position inside the block). Sharing their
    decisions shrinks the ILP by the number of repeats: the transformer-stack case.
    """
    blocks: dict[str, list[str]] = {}
    for v in life.fw_pos:
        key = block_of(g.nodes[v].module)
        if key:
            blocks.setdefault(key, []).append(v)
    first: dict[tuple, list[str]] = {}
    twins: dict[str, str] = {}
    for members in blocks.values():
        where = {v: i for i, v in enumerate(members)}
        sig = tuple(
            (g.nodes[v].target, g.nodes[v].shape, g.nodes[v].dtype, bool(g.nodes[v].recompute_ban),
             g.nodes[v].is_tuple, tuple(where.get(u, -1) for u in g.nodes[v].inputs))
            for v in members
        )
        if sig in first:
            twins.update(zip(members, first[sig]))
        else:
            first[sig] = members
    return twins


def _static_profile(g: GraphProfile, granularity: int) -> tuple[list[int], list[int], list[str], dict[str, int]]:
    """Live bytes at each forward and backward step when nothing is saved or recomputed, the core
    forward that runs then, and each forward-side node's slot in it (memory.forward_slots)."""
    heap = _Heap(granularity)
    steps: list = []
    core, slot = forward_slots(g)
    bw = [n for n, p in g.nodes.items() if p.kind == "backward"]
    _run(g, core, heap, set(g.fw_outputs), [], "forward", steps)
    fw_during = [s.during for s in steps]
    tangents = [n for n, p in g.nodes.items() if p.kind == "tangent" and p.nbytes]
    for t in tangents:
        heap.add(g.nodes[t].storage, g.nodes[t].nbytes)
    steps = []
    held = set(g.grad_outputs) | set(g.fw_outputs) | (set(tangents) if TANGENTS_HELD else set())
    _run(g, bw, heap, held, tangents, "backward", steps)
    return fw_during, [s.during for s in steps], core, slot


def _size(g: GraphProfile, v: str, granularity: int) -> int:
    p = g.nodes[v]
    if p.storage != v or v in g.fw_outputs:  # aliases own nothing; outputs are alive anyway
        return 0
    return -(-p.nbytes // granularity) * granularity if granularity > 1 else p.nbytes


def _pick_solver(name: str, time_limit: float, gap: float) -> pulp.LpSolver:
    if name == "auto":
        name = "highs" if "HiGHS" in pulp.listSolvers(onlyAvailable=True) else "cbc"
    if name == "highs":
        return pulp.HiGHS(msg=False, timeLimit=time_limit, gapRel=gap, threads=1)
    if name == "cbc":
        return pulp.PULP_CBC_CMD(msg=False, timeLimit=time_limit, gapRel=gap, threads=1)
    raise ValueError(f"solver must be 'auto', 'cbc' or 'highs', got {name!r}")


class _Model:
    """The ILP for a list of graphs that run one after another in one step."""

    def __init__(self, graphs: list[GraphProfile], granularity: int, drag: bool, tie: bool = False,
                 choices: list[DtypeChoices | None] | None = None, tolerance: float | None = None) -> None:
        self.drag = drag
        self.tie = tie
        self.choices = choices  # per graph: the compute dtypes the ILP may choose (precision="auto")
        self.tolerance = tolerance
        started = time.perf_counter()
        with warnings.catch_warnings():  # PuLP 3 deprecates LpVariable(...) ahead of its 4.0 API
            warnings.simplefilter("ignore", DeprecationWarning)
            self._build(graphs, granularity)
        self.build_s = time.perf_counter() - started

    def _build(self, graphs: list[GraphProfile], granularity: int) -> None:
        self.graphs = graphs
        self.prob = pulp.LpProblem("autoremat", pulp.LpMinimize)
        self._chained = 0
        self.s: list[dict[str, pulp.LpVariable]] = []
        self.r: list[dict[str, pulp.LpVariable]] = []
        self.rows: list[tuple[int, pulp.LpAffineExpression]] = []  # (static bytes, variable bytes)
        self.time_expr = pulp.LpAffineExpression()
        self.bytes_expr = pulp.LpAffineExpression()
        self.err_expr = pulp.LpAffineExpression()
        self.fp16_expr = pulp.LpAffineExpression()  # fp16 calls: each needs loss scaling; prefer bf16
        self.low: list[dict[str, tuple]] = []  # per graph: castable call -> (bf16 var, fp16 var)
        saved_total = []
        per_graph_rows = []
        for gi, g in enumerate(graphs):
            life = lifetimes(g, self.drag)
            fw_static, bw_static, core, slot = _static_profile(g, granularity)
            s, r = self._variables(gi, g, life)
            self.s.append(s)
            self.r.append(r)
            size = {v: _size(g, v, granularity) for v in life.fw_pos}
            # Bytes a value holds when saved (sb) and when recomputed (rb): its size, less half of
            # it for every value the chosen dtypes make 16-bit.
            sb = {v: size[v] * s[v] for v in s if size[v]}
            rb = {v: size[v] * r[v] for v in r if size[v]}
            choice = self.choices[gi] if self.choices and not self.tie else None
            self.low.append(self._dtype_terms(gi, choice, size, s, r, sb, rb) if choice else {})
            saved_bytes = pulp.lpSum(sb.values())
            saved_total.append(self._running(pulp.LpAffineExpression(), saved_bytes))
            self.bytes_expr += saved_bytes
            per_graph_rows.append(self._memory_rows(life, sb, rb, fw_static, bw_static, core, slot, g))
        # Graph i's saved values stay alive through the forward of later graphs and their
        # backward (which runs first): add them to those rows.
        # Their forward outputs are constants here: the caller holds a user's output to the end of
        # the step; a region's output that only later regions read lives until the last of them has
        # run its backward, at most (memory.handed_over frees it sooner if nothing saves it).
        spans = output_spans(graphs, granularity)
        for gi, (fw_rows, bw_rows) in enumerate(per_graph_rows):
            before_out = sum(b for k in range(gi) for b, _ in spans[k])
            others_out = sum(b for k, span in enumerate(spans) if k != gi for b, last in span
                             if last is None or gi >= last)
            fw_rows = [(static + before_out, expr) for static, expr in fw_rows]
            bw_rows = [(static + others_out, expr) for static, expr in bw_rows]
            # Consecutive steps share one expression until a value starts or ends: only the
            # largest static part among them can bind, so keep one row per expression.
            best: dict[int, tuple[int, pulp.LpAffineExpression]] = {}
            for static, expr in fw_rows + bw_rows:
                if id(expr) not in best or static > best[id(expr)][0]:
                    best[id(expr)] = (static, expr)
            before = pulp.lpSum(saved_total[:gi])
            self.rows += [(static, expr + before) for static, expr in best.values()]
        # One capacity variable carries the budget, so the model is built once and re-solved with
        # other budgets (or minimised, for the smallest peak) by changing its bounds.
        self.cap = pulp.LpVariable("cap", lowBound=0)
        self.floor = 0  # rows without decision variables: the least any plan can peak at
        for static, expr in self.rows:
            if isinstance(expr, pulp.LpAffineExpression) and not expr.keys():
                self.floor = max(self.floor, static + expr.constant)
            else:
                self.prob += expr + static <= self.cap
        self.total_bytes = max(1, sum(_size(g, v, 1) for g in graphs for v in g.nodes))
        self.total_time = max(1e-12, sum(p.time_s for g in graphs for p in g.nodes.values()))

    def _variables(self, gi: int, g: GraphProfile, life: Lifetimes):
        s: dict[str, pulp.LpVariable] = {}
        r: dict[str, pulp.LpVariable] = {}
        nodes = g.nodes
        twin = _block_twins(g, life) if self.tie else {}
        for v in life.fw_pos:
            p = nodes[v]
            if v in twin:  # an identical block decides for it: its variables come below
                continue
            r[v] = pulp.LpVariable(f"r{gi}_{v}", cat="Binary")
            if p.recompute_ban:
                r[v].upBound = 0
            if p.is_tuple:
                continue
            s[v] = pulp.LpVariable(f"s{gi}_{v}", cat="Binary")
            if p.storage != v and _size_root(g, v):
                s[v].upBound = 0  # saving a view would hold its base: recompute the view instead
            self.prob += s[v] + r[v] <= 1
        for v, t in twin.items():  # share the first identical block's decisions
            r[v] = r[t]
            if t in s:
                s[v] = s[t]
        for v in life.fw_pos:
            p = nodes[v]
            if v in life.needed:
                self.prob += (s[v] if v in s else 0) + r[v] >= 1
            for u in p.inputs:
                if u not in life.fw_pos:
                    continue  # parameters, inputs: always there
                avail = (s[u] if u in s else 0) + r[u]
                self.prob += r[v] <= avail
                # Locality: u must not be dragged earlier than `start` accounts for.
                if v not in life.follows[u] and life.start[v] < life.start[u]:
                    self.prob += r[u] + r[v] <= 1
            self.time_expr += p.time_s * r[v]
        return s, r

    def _dtype_terms(self, gi, choice: DtypeChoices, size, s, r, sb, rb) -> dict[str, tuple]:
        """Binary b_c / f_c per castable call (bf16 / fp16); a value is 16-bit when all its owners
        are. Bytes saved: s_v * low_v, linearised as sigma_v <= s_v, sigma_v <= low_v (and rho_v for
        r_v): the rows only ever gain from a larger sigma, so upper bounds make it the product."""
        low: dict[str, tuple] = {}
        for c, opts in sorted(choice.options.items()):
            b = pulp.LpVariable(f"b{gi}_{c}", cat="Binary") if "bf16" in opts else None
            f = pulp.LpVariable(f"f{gi}_{c}", cat="Binary") if "fp16" in opts else None
            is_low = (b if b is not None else 0) + (f if f is not None else 0)
            if b is not None and f is not None:
                self.prob += is_low <= 1
            low[c] = (b, f, is_low)
            self.err_expr += opts.get("bf16", 0.0) * (b if b is not None else 0)
            self.err_expr += opts.get("fp16", 0.0) * (f if f is not None else 0)
            self.time_expr += choice.cast_time.get(c, 0.0) * is_low
            if f is not None:
                self.fp16_expr += f
        both: dict[frozenset, pulp.LpAffineExpression] = {}
        for v, own in sorted(choice.owners.items()):
            if not own <= low.keys():
                continue
            if own not in both:
                if len(own) == 1:
                    both[own] = low[next(iter(own))][2]
                else:
                    pi = pulp.LpVariable(f"pi{gi}_{len(both)}", lowBound=0, upBound=1)
                    for c in sorted(own):
                        self.prob += pi <= low[c][2]
                    both[own] = pi
            pi = both[own]
            self.time_expr -= choice.speedup.get(v, 0.0) * pi
            half = size.get(v, 0) // 2
            for var, out, tag in ((s.get(v), sb, "sg"), (r.get(v), rb, "rh")):
                if half and var is not None and v in out:
                    prod = pulp.LpVariable(f"{tag}{gi}_{v}", lowBound=0, upBound=1)
                    self.prob += prod <= var
                    self.prob += prod <= pi
                    out[v] = out[v] - half * prod
        return low

    def chosen_dtypes(self) -> list[dict[str, str]]:
        """Per graph, the castable calls the current solution runs in bf16 or fp16."""
        out = []
        for low in self.low:
            pick = {}
            for c, (b, f, _) in low.items():
                if b is not None and (b.value() or 0) > 0.5:
                    pick[c] = "bf16"
                elif f is not None and (f.value() or 0) > 0.5:
                    pick[c] = "fp16"
            out.append(pick)
        return out

    def _memory_rows(self, life, sb, rb, fw_static, bw_static, fw_core, slot, g):
        fw_rows, bw_rows = [], []
        # Forward: a saved value keeps living after its last forward use.
        # The static profile frees a storage after the last core step that reads any alias of it, so
        # a saved value is counted from then on (from its own last use, it would count twice while a
        # view lives). A value outside the core is counted from the slot it is computed in.
        last_read = dict(slot)
        for u in fw_core:
            for w in g.nodes[u].inputs:
                if w in last_read:
                    last_read[w] = max(last_read[w], slot[u])
        core_end: dict[str, int] = {}
        for w in life.fw_pos:
            root = g.nodes[w].storage
            core_end[root] = max(core_end.get(root, -1), last_read[w])
        dies_at: dict[int, list[str]] = {}
        for v in sb:
            dies_at.setdefault(core_end[v], []).append(v)
        acc = pulp.LpAffineExpression()
        for t, static in enumerate(fw_static):
            if t - 1 in dies_at:
                acc = self._running(acc, pulp.lpSum(sb[v] for v in dies_at[t - 1]))
            fw_rows.append((static, acc))
        # Backward: saved values until LN; recomputed values from FN to LN.
        starts: dict[int, list[str]] = {}
        ends: dict[int, list[str]] = {}
        held = pulp.LpAffineExpression()
        for v in life.fw_pos:
            if v not in rb:
                continue  # owns no bytes
            ln, fn = life.ln[v], life.start[v]
            if ln == -INF:
                continue  # never read in the backward: a save only costs forward memory
            ln_i = min(int(ln), len(bw_static) - 1)
            held += sb.get(v, 0)
            ends.setdefault(ln_i, []).append(v)
            if fn != INF:
                starts.setdefault(max(0, min(int(fn), len(bw_static) - 1)), []).append(v)
            else:
                rb.pop(v)  # never recomputed on its own: nothing to add, nothing to take away
        acc = self._running(pulp.LpAffineExpression(), held)
        for t, static in enumerate(bw_static):
            if t in starts:
                acc = self._running(acc, pulp.lpSum(rb[v] for v in starts[t]))
            bw_rows.append((static, acc))
            if t in ends:
                acc = self._running(acc, -pulp.lpSum(sb.get(v, 0) + rb.get(v, 0) for v in ends[t]))
        return fw_rows, bw_rows

    def _running(self, acc: pulp.LpAffineExpression, delta: pulp.LpAffineExpression) -> pulp.LpAffineExpression:
        """acc + delta, as one new continuous variable tied to the previous one by an equality.

        Written out, every row would repeat all the values alive at its step (millions of nonzeros
        on a deep stack); chained, each decision variable appears in O(1) rows.
        """
        if not delta.keys():
            return acc + delta.constant if delta.constant else acc
        m = pulp.LpVariable(f"m{self._chained}")
        self._chained += 1
        self.prob += m == acc + delta
        return pulp.LpAffineExpression(m)

    def solve(self, budget: int | None, solver: pulp.LpSolver, min_peak: bool = False):
        prob = self.prob
        if min_peak:
            self.cap.lowBound, self.cap.upBound = 0, None
            prob.setObjective(self.cap + 1e-3 * self.total_bytes / self.total_time * self.time_expr)
        else:
            if self.floor > budget:
                return "infeasible", None, None
            self.cap.lowBound = self.cap.upBound = budget
            # Recompute time first; bytes only break ties (keeps peaks monotonic in the budget).
            prob.setObjective(self.time_expr / self.total_time + 1e-4 * self.bytes_expr / self.total_bytes
                              + 1e-3 * self.fp16_expr)
        if self.tolerance is not None and self.err_expr.keys():
            prob.constraints["tolerance"] = self.err_expr <= self.tolerance
        with _quiet_stdout():
            prob.solve(solver)
        if prob.sol_status in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
            status = "optimal" if prob.sol_status == pulp.LpSolutionOptimal else "time_limit"
            saved = [{v for v, var in s.items() if (var.value() or 0) > 0.5} for s in self.s]
            predicted = max((static + (pulp.value(expr) or 0) for static, expr in self.rows), default=0)
            return status, saved, predicted
        return pulp.LpStatus[prob.status].lower(), None, None


@contextlib.contextmanager
def _quiet_stdout():
    """HiGHS prints a banner from C++ whatever msg says; keep the user's stdout clean."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # no real stdout (pytest capture, notebooks)
        yield
        return
    sys.stdout.flush()
    saved = os.dup(fd)
    with open(os.devnull, "w") as null:
        os.dup2(null.fileno(), fd)
        try:
            yield
        finally:
            os.dup2(saved, fd)
            os.close(saved)


def _size_root(g: GraphProfile, v: str) -> int:
    root = g.nodes[v].storage
    return g.nodes[root].nbytes if root in g.nodes else 0


def _solve_model(model: _Model, graphs, budget, solver, gap, granularity, max_rounds, deadline) -> Decision | None:
    """Solve one ILP model, calibrating its (conservative) rows against the exact simulator.

    If the simulated plan overshoots, ask the ILP for that much less. If it undershoots, the rows
    were pessimistic: ask for the slack back and keep the cheapest plan that fits. If the ILP finds
    nothing, learn how pessimistic its rows are from its own smallest-peak plan and retry once.
    """
    target, best, learned, overshoots = budget, None, False, 0
    model.last_status = "infeasible"
    for rounds in range(1, max_rounds + 1):
        remaining = deadline - time.perf_counter()
        if remaining < 0.5:
            break
        # Each MIP gets most of what is left, less the time PuLP takes to hand the model to the
        # solver (outside the solver's own limit; about the model's build time).
        backend = _pick_solver(solver, 0.7 * max(0.5, remaining - model.build_s), gap)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            status, saved, _ = model.solve(target, backend)
            model.last_status = status
            if saved is None:
                if learned or best is not None:
                    break
                learned = True
                _, low, low_rows = model.solve(None, backend, min_peak=True)
                if low is None:
                    break
                offset = low_rows - evaluate(graphs, low, granularity)[1].peak
                if offset <= 0:
                    break
                target = budget + offset
                continue
        schedules, tl, cost = evaluate(graphs, saved, granularity)
        if tl.peak <= budget:
            if best is None or cost < best.recompute_time_s:
                path = (("ilp" if rounds == 1 else "ilp+calibrated") + ("/block-drag" if model.drag else "")
                        + ("/shared-blocks" if model.tie else ""))
                best = Decision(saved, schedules, tl, cost, status, path, rounds=rounds,
                                solver=type(backend).__name__)
            overshoots = 0
            slack = budget - tl.peak
            if cost == 0 or slack <= 0.01 * budget or time.perf_counter() > deadline:
                break
            target += slack  # memory the rows could not see: offer it to the ILP
        else:
            if time.perf_counter() > deadline:
                break
            # The ILP was optimistic by this much: ask for less, and for more each time in a row it
            # still overshoots (a plan near the limit tends to move by less than the step asked).
            overshoots += 1
            target -= (tl.peak - budget) * 2 ** (overshoots - 1)
    return best


def solve(
    graphs: list[GraphProfile],
    budget: int,
    *,
    granularity: int = 1,
    solver: str = "auto",
    time_limit: float = 10.0,
    gap: float = DEFAULT_GAP,
    max_rounds: int = 5,
) -> Decision:
    """Fastest plan whose simulated activation peak fits `budget` bytes; see the module docstring.

    Two ILP models are solved: one that keeps recomputation local (exact start times) and one that
    lets it span a repeated block (checkpoint-like segments, start times bounded). The cheaper
    plan the simulator accepts wins; then the greedy plan, then the smallest-peak plan.
    Raises `Infeasible` carrying the smallest activation peak any plan reached.
    """
    t0 = time.perf_counter()
    backend = _pick_solver(solver, time_limit, gap)
    solver_name = type(backend).__name__
    everything = save_all(graphs)
    schedules, tl, _ = evaluate(graphs, everything, granularity)
    if tl.peak <= budget:  # no recomputation needed: nothing to solve
        return Decision(everything, schedules, tl, 0.0, "optimal", "save-all", solver="none",
                        solve_time_s=time.perf_counter() - t0, granularity=granularity)
    # Building a model and handing it to the MIP solver cost time of their own (about a fifth of a
    # solve on a GPT-2-small graph): stop starting new work early enough to end near the limit.
    deadline = t0 + 0.85 * time_limit
    # Per-block modes (save / selective / checkpoint): cheap to search, a plan for the ILP to beat,
    # and the answer when the ILP runs out of time on a large graph.
    found = block_mode_plans(graphs, budget, granularity, t0 + time_limit / 8)
    models = []
    # The full model first (with chained running sums it solves a 48-block stack in seconds), then
    # identical blocks sharing decisions (smaller: the answer when the full one runs out of time on
    # a huge graph), then the block-drag ones.
    for tie, drag in ((False, False), (True, False), (False, True), (True, True)):
        if time.perf_counter() > deadline - 1.0 - 2 * (models[-1].build_s if models else 0.0):
            break
        models.append(_Model(graphs, granularity, drag, tie))
        d = _solve_model(models[-1], graphs, budget, solver, gap, granularity, max_rounds, deadline)
        if d is not None:
            found.append(d)
    best = min(found, key=lambda d: (d.recompute_time_s, d.peak), default=None)
    status = best.status if best else (getattr(models[0], "last_status", "infeasible") if models else "time_limit")
    if best is None:
        saved = greedy(graphs, budget, granularity, deadline=t0 + time_limit)
        schedules, tl, cost = evaluate(graphs, saved, granularity)
        if tl.peak <= budget:
            best = Decision(saved, schedules, tl, cost, "greedy", "greedy", solver=solver_name,
                            notes=[f"ILP gave no plan that fits ({status}); used the greedy plan"])
    if best is None:
        smallest = smallest_peak(graphs, granularity=granularity, solver=solver, time_limit=time_limit,
                                 models=models)
        if smallest.peak > budget:
            raise Infeasible(smallest, status)
        best = smallest
        best.notes.append("the ILP found no plan under this budget; used the smallest-peak plan, which fits")
    best.solve_time_s = time.perf_counter() - t0
    best.granularity = granularity
    return best


def smallest_peak(graphs, *, granularity=1, solver="auto", time_limit=30.0, models=None) -> Decision:
    """The plan with the smallest simulated activation peak we can find.

    Candidates: each ILP model's min-peak solution, checkpointing every repeated block, and greedy.
    """
    start = time.perf_counter()
    models = models or [_Model(graphs, granularity, drag, tie=True) for drag in (False, True)]
    backend = _pick_solver(solver, max(2.0, time_limit / 4), 1e-3)
    options = []
    status = "infeasible"
    for model in models:
        if options and time.perf_counter() - start > time_limit / 2:
            break  # one min-peak plan in hand; the rest of the time goes to the plans below
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            status, saved, _ = model.solve(None, backend, min_peak=True)
        if saved is not None:
            options.append((saved, "ilp-min-peak" + ("/block-drag" if model.drag else "")))
    options.append((checkpoint_blocks(graphs), "checkpoint-blocks"))
    options.append((greedy(graphs, 0, granularity, max_tries=100, deadline=start + time_limit), "greedy"))
    best = None
    for cand, path in options:
        try:
            schedules, tl, cost = evaluate(graphs, cand, granularity)
        except ValueError:  # a candidate the schedule cannot run (a needed value nobody may recompute)
            continue
        if best is None or (tl.peak, cost) < (best.peak, best.recompute_time_s):
            best = Decision(cand, schedules, tl, cost, status, path, solver=type(backend).__name__,
                            granularity=granularity)
    return best


class Infeasible(Exception):
    def __init__(self, smallest: Decision, status: str) -> None:
        super().__init__(f"no plan fits (solver status {status}); smallest peak found {smallest.peak} B")
        self.smallest = smallest
        self.status = status


def choose_dtypes(
    graphs: list[GraphProfile],
    choices: list[DtypeChoices | None],
    budget: int,
    tolerance: float | None,
    *,
    granularity: int = 1,
    solver: str = "auto",
    time_limit: float = 10.0,
    gap: float = DEFAULT_GAP,
) -> list[dict[str, str]] | None:
    """Compute dtypes and save/recompute chosen together, on fp32-traced graphs: the first stage of
    precision="auto". Returns, per graph, the calls to run in bf16/fp16, or None if nothing fits.

    The memory rows see each value at 2 or 4 bytes per element as its owners decide; the objective
    is the recomputation time plus the dtype-dependent time of the step (faster 16-bit kernels,
    the casts they need); the measured errors of the chosen calls sum to at most `tolerance`. The
    caller traces the graphs again with these dtypes and solves save/recompute exactly on them
    (the second stage), since the rows here only approximate a mixed graph.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        model = _Model(graphs, granularity, drag=False, choices=choices, tolerance=tolerance)
        status, saved, _ = model.solve(budget, _pick_solver(solver, time_limit, gap))
    if saved is None:
        return None
    return model.chosen_dtypes()
