"""The save/recompute ILP of one training step, written the way its formulation reads.

The step runs graphs 1..G (dynamo graphs or regions): their forwards in order, then their backwards
in reverse. `solver.py` decides which models to build and solves them; this module is the model, in the
order below: its data, its variables, its rows, its objective, then solving it and reading the answer.

Data, per graph (computed here, by lifetimes.py and by memory.py):
  F            forward-side nodes, in joint order; N in F those a backward node reads directly
  in(v)        v's forward-side inputs (parameters and step inputs are always there)
  size_v       bytes v owns, rounded up to the allocator's granularity (0 for a view or an output)
  t_v          v's predicted compute time
  fw_t, bw_t   live bytes at forward / backward step t when nothing is saved or recomputed
               (`static_profile`); the forward runs only the core the outputs need
  die(v)       the last core-forward step that reads any alias of v's storage
  first(v)     the earliest backward step a recomputed v can be computed at (Lifetimes.start;
               with block drag, a chain of recomputed users in the same block pulls it earlier)
  last(v)      the last backward step that reads v (Lifetimes.last_read)
  out_g        bytes of graph g's forward outputs (held by the caller, or by later regions)
  wait_g       bytes of later regions' gradients of a shared input (region_crossings.tied_waits) held during g's backward

Variables:
  s_v, r_v in {0,1}   v is saved for the backward / recomputed in it
  b_c, f_c in {0,1}   castable call c runs in bf16 / fp16 (only with dtype choices: precision="auto")
  pi_O in [0,1]       every call of owner set O is 16-bit (a value is 16-bit when all its owners are)
  sig_v, rho_v        in [0,1]: the products s_v * pi_O(v) and r_v * pi_O(v)
  m_k                 running sums: one per point where the set of live values changes
  cap >= 0            the activations' room (fixed) or the peak (minimised)

Bytes of v when saved and when recomputed (h_v = floor(size_v / 2), what 16 bits halves):
  S_v = size_v s_v - h_v sig_v            R_v = size_v r_v - h_v rho_v

Rows, one method of `IlpModel` per family:
  choice            (`_choice_exclusive`, `_choice_needed`)
                    s_v + r_v <= 1 for v in F;  s_v + r_v >= 1 for v in N;
                    r_v = 0 where v may not be recomputed; s_v = 0 where v is a view of a base that
                    owns bytes (saving it would hold the base: recompute the view instead);
                    the user's MUST_SAVE / MUST_RECOMPUTE marks fix s_v, r_v (`_bound_marks`)
  recompute inputs  (`_recompute_inputs`)  r_v <= s_u + r_u for u in in(v) cap F
  locality          (`_recompute_inputs`)  r_u + r_v <= 1 where a recomputed v would need u before
                    first(u) accounts for (first(v) < first(u) and v is not one of u's drag users)
  forward memory    (`_forward_memory`)   for each forward step t of graph g:
                    fw_t + sum_{die(v) < t} S_v + sum_{h<g} S^h + sum_{h<g} out_h <= cap
  backward memory   (`_backward_memory`)  for each backward step t of graph g:
                    bw_t + sum_{last(v) >= t} S_v + sum_{first(v) <= t <= last(v)} R_v
                         + sum_{h<g} S^h + sum_{h != g, still held} out_h + wait_g <= cap
                    where S^h = sum_v S_v over graph h (what an earlier graph saved stays alive)
  dtype             (`_dtype`)  b_c + f_c <= 1;  pi_O <= b_c + f_c for c in O;
                    sig_v <= s_v, sig_v <= pi_O(v);  rho_v <= r_v, rho_v <= pi_O(v)
                    (the rows only gain from larger sig/rho, so these upper bounds are the product)
  error             (`_error`)  sum_c (err^bf16_c b_c + err^fp16_c f_c) <= tolerance

Each memory sum is a chain of equalities m_k = m_{k-1} + delta_k (`_running`), so a decision
variable sits in O(1) rows; consecutive steps that share a chain keep only their largest static
part (`_step_rows`); rows with no variable at all give `floor`, the least any plan peaks at.

Objective (`_set_objective`), with T = sum_v t_v r_v + sum_c cast_c (b_c + f_c) - sum_v speedup_v pi_O(v),
T_all the step's compute time and B_all its bytes:
  within the room (cap = room): min T / T_all + TIE_BYTES * sum_v S_v / B_all + FP16_PENALTY * sum_c f_c
  smallest peak (cap free):       min cap + MIN_PEAK_TIME_WEIGHT * (B_all / T_all) * T

With `shared_blocks`, the nodes of identical repeated blocks share the first block's s_v and r_v
(a smaller model for deep stacks; dtype choices are then not offered). first(v) is a lower and
last(v) an upper bound of the real lifetime, so the rows are conservative; solver.py replays each
solution in the exact simulator and calibrates the room against it.

The user's checkpoint marks (model/marks.py) enter as bounds and as a tie-break:
  must_save v        r_v = 0, and s_v = 1 where the backward reads v
  must_recompute v   s_v = 0 (the choice row s_v + r_v >= 1 then recomputes it where the backward reads it)
  prefer_*           no row: in the objective's tie-break on saved bytes (TIE_BYTES, far below any recompute
                     time) a PREFER_RECOMPUTE value's bytes count twice and a PREFER_SAVE value's not at all,
                     so a hint decides only among plans of the same predicted time
`schedule.make_schedule` forces the MUST marks onto every saved set, whichever planner chose it; these
bounds make the ILP optimise over exactly those plans, and its smallest peak (BudgetError's floor) too.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import pulp

from autoremat.capture.regions import block_of
from autoremat.model.graph_profile import GraphProfile
from autoremat.model.lifetimes import Lifetimes, lifetimes, output_spans, waiting_bytes
from autoremat.model.marks import PREFER_RECOMPUTE, PREFER_SAVE, must_marks
from autoremat.model.memory import INF, TANGENTS_HELD, Timeline, _Heap, _run
from autoremat.model.schedule import forward_slots
from autoremat.solve import lp
from autoremat.solve.precision_choices import DtypeChoices

# The objective's weights (docstring, Objective).
# Weight of saved bytes in the budgeted objective: small enough never to outweigh recompute time,
# large enough to break its ties toward saving less (keeps the plan's peak monotonic in the room).
TIE_BYTES = 1e-4
# Weight of each fp16 call in the budgeted objective: fp16 needs loss scaling, so on a tie prefer bf16.
FP16_PENALTY = 1e-3
# Weight of recompute time (scaled to bytes) when minimising the peak: among plans with the same
# peak, the cheapest one, without letting time move the peak by more than a rounding.
MIN_PEAK_TIME_WEIGHT = 1e-3


# -- data: fw_t and bw_t, size_v, and the identical blocks whose decisions may be shared -----------

def static_profile(g: GraphProfile, granularity: int) -> tuple[list[int], list[int], list[str], dict[str, int]]:
    """fw_t and bw_t: live bytes at each forward and backward step when nothing is saved or
    recomputed; also the core forward that runs then, and each forward-side node's slot in it
    (schedule.forward_slots)."""
    heap = _Heap(granularity)
    forward, backward = Timeline(), Timeline()
    core, slot = forward_slots(g)
    bw = [n for n, p in g.nodes.items() if p.kind == "backward"]
    _run(g, core, heap, set(g.fw_outputs), [], "forward", forward)
    tangents = [n for n, p in g.nodes.items() if p.kind == "tangent" and p.nbytes]
    for t in tangents:
        heap.add(g.nodes[t].storage, g.nodes[t].nbytes)
    held = set(g.grad_outputs) | set(g.fw_outputs) | (set(tangents) if TANGENTS_HELD else set())
    _run(g, bw, heap, held, tangents, "backward", backward)
    return forward.during, backward.during, core, slot


def owned_size(g: GraphProfile, v: str, granularity: int) -> int:
    """size_v: the bytes v owns, rounded up to `granularity`."""
    p = g.nodes[v]
    if p.storage != v or v in g.fw_outputs:  # aliases own nothing; outputs are alive anyway
        return 0
    return -(-p.nbytes // granularity) * granularity if granularity > 1 else p.nbytes


def base_size(g: GraphProfile, v: str) -> int:
    """Bytes of the storage v is a view of (v's own, if it is no view)."""
    root = g.nodes[v].storage
    return g.nodes[root].nbytes if root in g.nodes else 0


def block_twins(g: GraphProfile, life: Lifetimes) -> dict[str, str]:
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


# -- the model: variables, rows, objective, solve ------------------------------------------------

class IlpModel:
    """The ILP for a list of graphs that run one after another in one step (see the module docstring)."""

    def __init__(self, graphs: list[GraphProfile], granularity: int, block_drag: bool, shared_blocks: bool = False,
                 choices: list[DtypeChoices | None] | None = None, tolerance: float | None = None) -> None:
        self.block_drag = block_drag
        self.shared_blocks = shared_blocks
        self.choices = choices  # per graph: the compute dtypes the ILP may choose (precision="auto")
        self.tolerance = tolerance
        # Set by solver.py's calibration loop: the latest solve's status, and the objective of the best plan
        # it kept (what a later model's MIP must beat).
        self.last_status = "infeasible"
        self.best_objective: float | None = None
        # Set by solver.py: the model's min-peak solution and the seconds it was given, which a later search reuses.
        self.min_peak: tuple[IlpResult, float] | None = None
        started = time.perf_counter()
        self._build(graphs, granularity)
        self.build_s = time.perf_counter() - started

    def _build(self, graphs: list[GraphProfile], granularity: int) -> None:
        self.graphs = graphs
        self.prob = lp.problem("autoremat")
        self._chained = 0
        self.s: list[dict[str, lp.Variable]] = []
        self.r: list[dict[str, lp.Variable]] = []
        self.rows: list[tuple[int, lp.Expression]] = []  # (static bytes, variable bytes)
        self.time_expr = lp.zero()  # T
        self.bytes_expr = lp.zero()  # sum_v S_v over the step
        self.err_expr = lp.zero()  # the error row's left side
        self.fp16_expr = lp.zero()  # sum_c f_c: each fp16 call needs loss scaling
        self.low: list[dict[str, tuple]] = []  # per graph: castable call -> (b_c, f_c, b_c + f_c)
        self.lifetimes: list[Lifetimes] = []  # per graph, as this model's rows read them
        saved_total = []  # per graph: S^g as a running-sum expression
        per_graph_rows = []
        # The rows are added in a fixed order (graph by graph; per node: choice, then its inputs):
        # the solver's search, and so its answer among equal plans, follows the order of the rows.
        for gi, g in enumerate(graphs):
            life = lifetimes(g, self.block_drag)
            self.lifetimes.append(life)
            fw_static, bw_static, core, slot = static_profile(g, granularity)
            s, r = self._decisions(gi, g, life)
            self.s.append(s)
            self.r.append(r)
            size = {v: owned_size(g, v, granularity) for v in life.fw_pos}
            saved_bytes = {v: size[v] * s[v] for v in s if size[v]}  # S_v
            recomputed_bytes = {v: size[v] * r[v] for v in r if size[v]}  # R_v
            choice = self.choices[gi] if self.choices and not self.shared_blocks else None
            self.low.append(self._dtype(gi, choice, size, s, r, saved_bytes, recomputed_bytes) if choice else {})
            graph_saved = pulp.lpSum(saved_bytes.values())
            saved_total.append(self._running(lp.zero(), graph_saved))
            self.bytes_expr += graph_saved + self._hinted_bytes(g, saved_bytes)  # PREFER_* marks: ties only
            fw_rows = self._forward_memory(g, life, saved_bytes, fw_static, core, slot)
            bw_rows = self._backward_memory(life, saved_bytes, recomputed_bytes, bw_static)
            per_graph_rows.append((fw_rows, bw_rows))
        self._step_rows(per_graph_rows, saved_total, output_spans(graphs, granularity),
                        waiting_bytes(graphs, granularity))
        self._capacity()
        self._error()
        self.total_bytes = max(1, sum(owned_size(g, v, 1) for g in graphs for v in g.nodes))  # B_all
        self.total_time = max(1e-12, sum(p.time_s for g in graphs for p in g.nodes.values()))  # T_all

    # -- variables, with the choice and recompute-input rows of each --------------------------

    def _decisions(self, gi: int, g: GraphProfile, life: Lifetimes):
        """s_v and r_v for every forward-side node, with the choice and recompute-input rows."""
        s: dict[str, lp.Variable] = {}
        r: dict[str, lp.Variable] = {}
        nodes = g.nodes
        twin = block_twins(g, life) if self.shared_blocks else {}
        for v in life.fw_pos:
            p = nodes[v]
            if v in twin:  # an identical block decides for it: its variables come below
                continue
            r[v] = lp.binary(self.prob, f"r{gi}_{v}")
            if p.recompute_ban:
                r[v].upBound = 0
            if p.is_tuple:
                continue
            s[v] = lp.binary(self.prob, f"s{gi}_{v}")
            if (p.storage != v and base_size(g, v)) or p.fused or nodes.get(p.storage, p).fused:
                # saving a view would hold its base, saving a fused value (or a view of one) would make
                # Inductor write it out (fusion.py): recompute it instead
                s[v].upBound = 0
            self._choice_exclusive(s[v], r[v])
        for v, t in twin.items():  # share the first identical block's decisions
            r[v] = r[t]
            if t in s:
                s[v] = s[t]
        self._bound_marks(g, life, s, r)  # the user's MUST marks
        for v in life.fw_pos:
            if v in life.needed:
                self._choice_needed(s.get(v), r[v])
            self._recompute_inputs(v, nodes[v].inputs, life, s, r)
            self.time_expr += nodes[v].time_s * r[v]
        return s, r

    @staticmethod
    def _bound_marks(g: GraphProfile, life: Lifetimes, s: dict, r: dict) -> None:
        """The user's MUST marks as bounds of one graph's s_v / r_v (module docstring)."""
        marks = must_marks(g)
        for v in sorted(marks.save & r.keys()):
            r[v].upBound = 0
            if v in life.needed and v in s and s[v].upBound != 0:
                s[v].lowBound = 1
        for v in sorted(marks.recompute & s.keys()):
            s[v].upBound = 0

    def _choice_exclusive(self, s_v: lp.Variable, r_v: lp.Variable) -> None:
        """choice: s_v + r_v <= 1 (a value is saved, recomputed, or neither)."""
        self.prob += s_v + r_v <= 1

    def _choice_needed(self, s_v: lp.Variable | None, r_v: lp.Variable) -> None:
        """choice: s_v + r_v >= 1 for a value the backward reads (a tuple has no s_v)."""
        self.prob += (s_v if s_v is not None else 0) + r_v >= 1

    def _recompute_inputs(self, v: str, inputs, life: Lifetimes, s: dict, r: dict) -> None:
        """recompute inputs: r_v <= s_u + r_u; locality: r_u + r_v <= 1 where v would drag u earlier
        than first(u) accounts for."""
        for u in inputs:
            if u not in life.fw_pos:
                continue  # parameters, inputs: always there
            self.prob += r[v] <= (s[u] if u in s else 0) + r[u]
            if v not in life.follows[u] and life.start[v] < life.start[u]:
                self.prob += r[u] + r[v] <= 1

    # -- the dtype family ----------------------------------------------------------------------

    def _dtype(self, gi, choice: DtypeChoices, size, s, r, saved_bytes, recomputed_bytes) -> dict[str, tuple]:
        """b_c / f_c per castable call and pi_O per owner set; sig_v / rho_v take h_v off S_v / R_v.
        Also builds the error row's left side and the dtype terms of T."""
        low: dict[str, tuple] = {}
        for c, opts in sorted(choice.options.items()):
            b = lp.binary(self.prob, f"b{gi}_{c}") if "bf16" in opts else None
            f = lp.binary(self.prob, f"f{gi}_{c}") if "fp16" in opts else None
            is_low = (b if b is not None else 0) + (f if f is not None else 0)
            if b is not None and f is not None:
                self.prob += is_low <= 1
            low[c] = (b, f, is_low)
            self.err_expr += opts.get("bf16", 0.0) * (b if b is not None else 0)
            self.err_expr += opts.get("fp16", 0.0) * (f if f is not None else 0)
            self.time_expr += choice.cast_time.get(c, 0.0) * is_low
            if f is not None:
                self.fp16_expr += f
        both: dict[frozenset, lp.Expression] = {}
        for v, own in sorted(choice.owners.items()):
            if not own <= low.keys():
                continue
            if own not in both:
                if len(own) == 1:
                    both[own] = low[next(iter(own))][2]
                else:
                    pi = lp.continuous(self.prob, f"pi{gi}_{len(both)}", 0, 1)
                    for c in sorted(own):
                        self.prob += pi <= low[c][2]
                    both[own] = pi
            pi = both[own]
            self.time_expr -= choice.speedup.get(v, 0.0) * pi
            half = size.get(v, 0) // 2
            for var, out, tag in ((s.get(v), saved_bytes, "sg"), (r.get(v), recomputed_bytes, "rh")):
                if half and var is not None and v in out:
                    prod = lp.continuous(self.prob, f"{tag}{gi}_{v}", 0, 1)
                    self.prob += prod <= var
                    self.prob += prod <= pi
                    out[v] = out[v] - half * prod
        return low

    # -- the memory families -------------------------------------------------------------------

    def _forward_memory(self, g, life, saved_bytes, fw_static, fw_core, slot):
        """forward memory: (fw_t, sum_{die(v) < t} S_v) per forward step t of one graph.

        The static profile frees a storage after the last core step that reads any alias of it, so a
        saved value is counted from then on (from its own last use, it would count twice while a
        view lives). A value outside the core is counted from the slot it is computed in.
        """
        last_core_read = dict(slot)
        for u in fw_core:
            for w in g.nodes[u].inputs:
                if w in last_core_read:
                    last_core_read[w] = max(last_core_read[w], slot[u])
        die: dict[str, int] = {}
        for w in life.fw_pos:
            root = g.nodes[w].storage
            die[root] = max(die.get(root, -1), last_core_read[w])
        dies_at: dict[int, list[str]] = {}
        for v in saved_bytes:
            dies_at.setdefault(die[v], []).append(v)
        rows = []
        acc = lp.zero()
        for t, static in enumerate(fw_static):
            if t - 1 in dies_at:
                acc = self._running(acc, pulp.lpSum(saved_bytes[v] for v in dies_at[t - 1]))
            rows.append((static, acc))
        return rows

    def _backward_memory(self, life, saved_bytes, recomputed_bytes, bw_static):
        """backward memory: (bw_t, sum_{last(v) >= t} S_v + sum_{first(v) <= t <= last(v)} R_v) per
        backward step t of one graph. A value the backward never reads costs only forward memory."""
        starts: dict[int, list[str]] = {}
        ends: dict[int, list[str]] = {}
        held = lp.zero()
        for v in life.fw_pos:
            if v not in recomputed_bytes:
                continue  # owns no bytes
            last, first = life.last_read[v], life.start[v]
            if last == -INF:
                continue  # never read in the backward: a save only costs forward memory
            last_step = min(int(last), len(bw_static) - 1)
            held += saved_bytes.get(v, 0)
            ends.setdefault(last_step, []).append(v)
            if first != INF:
                starts.setdefault(max(0, min(int(first), len(bw_static) - 1)), []).append(v)
            else:
                recomputed_bytes.pop(v)  # never recomputed on its own: nothing to add, nothing to take away
        rows = []
        acc = self._running(lp.zero(), held)
        for t, static in enumerate(bw_static):
            if t in starts:
                acc = self._running(acc, pulp.lpSum(recomputed_bytes[v] for v in starts[t]))
            rows.append((static, acc))
            if t in ends:
                acc = self._running(acc, -pulp.lpSum(saved_bytes.get(v, 0) + recomputed_bytes.get(v, 0)
                                                     for v in ends[t]))
        return rows

    def _step_rows(self, per_graph_rows, saved_total, spans, waiting) -> None:
        """The step's rows: each graph's memory rows plus what the other graphs hold then.

        Graph g's forward runs after the forwards of graphs h < g, and its backward before theirs:
        what they saved (S^h) is alive in both. Their forward outputs are constants here: the caller
        holds a user's output to the end of the step; a region's output that only later regions read
        lives until the last of them has run its backward, at most (memory.handed_over frees it
        sooner if nothing saves it). A later region's tied-weight gradient waits through this backward
        if the region that reads the weight too comes at or before it (`waiting`, a constant as well).
        """
        for gi, (fw_rows, bw_rows) in enumerate(per_graph_rows):
            before_out = sum(b for k in range(gi) for b, _ in spans[k])
            others_out = sum(b for k, span in enumerate(spans) if k != gi for b, last in span
                             if last is None or gi >= last)
            fw_rows = [(static + before_out, expr) for static, expr in fw_rows]
            bw_rows = [(static + others_out + waiting[gi], expr) for static, expr in bw_rows]
            # Consecutive steps share one expression until a value starts or ends: only the
            # largest static part among them can bind, so keep one row per expression.
            best: dict[int, tuple[int, lp.Expression]] = {}
            for static, expr in fw_rows + bw_rows:
                if id(expr) not in best or static > best[id(expr)][0]:
                    best[id(expr)] = (static, expr)
            before = pulp.lpSum(saved_total[:gi])
            self.rows += [(static, expr + before) for static, expr in best.values()]

    def _capacity(self) -> None:
        """Every row <= cap. One capacity variable carries the room, so the model is built once and
        re-solved with other budgets (or minimised, for the smallest peak) by changing its bounds."""
        self.cap = lp.continuous(self.prob, "cap", 0)
        self.floor = 0  # rows without decision variables: the least any plan can peak at
        for static, expr in self.rows:
            fixed = not isinstance(expr, lp.Expression) or not expr.keys()
            if fixed:
                static, expr = static + pulp.value(expr), lp.zero()
                self.floor = max(self.floor, static)
            if not fixed:
                self.prob += expr + static <= self.cap

    def _running(self, acc: lp.Expression, delta: lp.Expression) -> lp.Expression:
        """acc + delta, as one new continuous variable m_k tied to the previous one by an equality.

        Written out, every row would repeat all the values alive at its step (millions of nonzeros
        on a deep stack); chained, each decision variable appears in O(1) rows.
        """
        if not delta.keys():
            return acc + delta.constant if delta.constant else acc
        m = lp.continuous(self.prob, f"m{self._chained}")
        self._chained += 1
        self.prob += m == acc + delta
        return lp.of(m)

    # -- the error row -------------------------------------------------------------------------

    def _error(self) -> None:
        """error: the measured errors of the chosen 16-bit calls sum to at most the tolerance. Built with
        the model: the tolerance is fixed for its life, only the room changes between solves."""
        if self.tolerance is not None and self.err_expr.keys():
            self.prob += self.err_expr <= self.tolerance

    # -- the objective -------------------------------------------------------------------------

    def _set_objective(self, min_peak: bool) -> None:
        """The objective: within the room (`solve` has fixed `cap` to it), the least time, ties toward fewer saved
        bytes and bf16 over fp16; with `min_peak` (`cap` free), the least cap, ties toward the least time."""
        if min_peak:
            self.prob.setObjective(self.cap + MIN_PEAK_TIME_WEIGHT * self.total_bytes / self.total_time
                                   * self.time_expr)
        else:
            self.prob.setObjective(self.time_expr / self.total_time + TIE_BYTES * self.bytes_expr / self.total_bytes
                                   + FP16_PENALTY * self.fp16_expr)

    @staticmethod
    def _hinted_bytes(g: GraphProfile, saved_bytes: dict) -> lp.Expression:
        """What the PREFER marks add to the tie-break's saved bytes: +S_v for PREFER_RECOMPUTE, -S_v for PREFER_SAVE."""
        sign = {PREFER_RECOMPUTE: 1, PREFER_SAVE: -1}
        return pulp.lpSum(sign[g.nodes[v].mark] * b for v, b in saved_bytes.items() if g.nodes[v].mark in sign)

    # -- solve and read the answer back --------------------------------------------------------

    def solve(self, room: int | None, solver: lp.Solver, min_peak: bool = False) -> IlpResult:
        """Solve under `room` bytes, or (`min_peak`) for the smallest peak the rows allow."""
        if not min_peak and self.floor > room:
            return IlpResult("infeasible")
        # The room is the bound of `cap`, the right-hand side of every memory row (`_capacity`).
        self.cap.lowBound, self.cap.upBound = (0, None) if min_peak else (room, room)
        self._set_objective(min_peak)
        status = lp.solve(self.prob, solver)
        if lp.has_solution(status):
            saved = [{v for v, var in s.items() if (var.value() or 0) > 0.5} for s in self.s]
            predicted = max((static + (pulp.value(expr) or 0) for static, expr in self.rows), default=0)
            return IlpResult(status, saved, predicted, pulp.value(self.prob.objective))
        return IlpResult(status)

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


@dataclass
class IlpResult:
    """One solve of the model."""

    status: str  # "optimal", "time_limit" (an incumbent at the limit), or PuLP's status ("infeasible", ...)
    saved: list[set[str]] | None = None  # per graph, the values the solution saves; None without a solution
    predicted_peak: float | None = None  # the largest row at the solution: the ILP's own (conservative) peak
    objective: float | None = None  # the objective at the solution (`_set_objective`)
