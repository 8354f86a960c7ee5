"""The loss region: the vocabulary projection and its cross-entropy, computed over chunks of token rows.

For a language model the step's memory floor is set by the output layer: the logits, their
log-softmax and the gradients of both are each tokens x vocabulary, and each is needed whole at one
moment, so no choice of what to save or recompute removes them. Chunked, they are not:

    loss = cross_entropy(linear(h, W).float().view(-1, V), y)       # what the model wrote
    loss = sum_i  sum_rows(logsumexp(z_i) - z_i[y_i]),  z_i = linear(h_i, W).float()   # k pieces

This module finds that pattern in a dynamo graph (before AOTAutograd traces it) and rewrites it into
the second form, unrolled over k static chunks of rows, written with plain torch ops. AOTAutograd
then derives a backward that is chunk-local too (per chunk: exp(z_i - lse_i), the target's one-hot,
grad_h_i = g_i @ W, grad_W += g_i^T @ h_i), and the save/recompute ILP decides whether each z_i is
kept or recomputed just before its backward: no tokens x vocabulary tensor is ever needed whole.

Recognised: `F.cross_entropy(X, y, ignore_index=..., reduction="mean" | "sum", label_smoothing=...)`
whose input X is a linear (weight [V, d], optional bias) or a matmul by a [d, V] matrix, followed by ops
found by what they compute, not how they are spelled:
- row steps, which keep every row's vocabulary whole and so apply to the hidden states' rows instead: casts,
  `.contiguous()`, views/reshapes that keep the vocabulary dimension last, slices of the token dimensions
  (HF's `ForCausalLM` loss, the plain `logits.view(-1, V)` form, the older `logits[..., :-1, :]` shift);
- pointwise ops whose other operands are the same for every row (every ATen op they run is tagged pointwise
  by its schema, none is random): a scale, a softcap, a vocabulary bias or mask (Gemma-2, Cohere, Granite).
  They give a chunk of rows what they give those rows of the whole logits, so each chunk's logits go
  through them (`chunked_cross_entropy`'s `head`).
A form of the logits that something else also reads (the returned logits, OPT's `.contiguous()`) stays
for that reader, computed whole after the chunks. A class weight, reduction="none", probability targets, an
op that mixes rows, or any other shape is left exactly as it was: a pattern not recognised is never rewritten.

One chunk with outputs="all" leaves the loss as the model wrote it, except over 16-bit logits: there
it becomes one fused op (passes/fused_loss.py, no tokens x vocabulary fp32 value stored). With
outputs="loss", a 16-bit bias-free linear site becomes one fused projection + loss over the fp32
master weight whatever the chunk count (passes/fused_linear_loss.py: no logits, no 16-bit weight copy).

`outputs`: "all" keeps the model's logits output (the projection is computed whole once more for it,
after the chunked loss so that its backward runs first and its tangent dies early, and the caller holds it); "loss" declares that only the loss is used, and the logits output becomes
None, so the full logits are never allocated.

This module imports nothing from later pipeline stages; `choose` takes the planning step as a
function, so that the planner decides the chunk count (autoremat.planning.pipeline).
"""

from __future__ import annotations

import inspect
import operator
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.fx as fx
import torch.nn.functional as F

from autoremat.passes.fused_linear_loss import fused_linear_cross_entropy
from autoremat.passes.fused_loss import fused_cross_entropy
from autoremat.torch_internals import (
    C_NN_LINEAR,
    LOSS_CHUNK_TAG,
    LOSS_REGION_TAG,
    OpOverload,
    annotate,
    aten_ops_of,
    is_mutable_op,
)

OUTPUTS = ("all", "loss")
CANDIDATES = (1, 4, 16, 64)  # chunk counts the planner tries; 1 leaves the loss whole (outputs="all")
_CE = (F.cross_entropy,)
_LINEAR = (C_NN_LINEAR, F.linear)
_MATMUL = (torch.matmul, operator.matmul)
_CASTS = ("float", "to", "type_as", "half", "bfloat16", "double")
_RESHAPES = ("view", "reshape")
_CE_SIGNATURE = inspect.signature(F.cross_entropy)


def chunked_cross_entropy(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, target: torch.Tensor,
                          *, proj: str, chunks: int, ignore_index: int, reduction: str, label_smoothing: float,
                          dtype: torch.dtype | None, head: Callable | None = None,
                          head_args: tuple = ()) -> torch.Tensor:
    """cross_entropy(head(proj(h)).to(dtype), target) for h [N, d], computed over `chunks` pieces of rows.

    Per chunk: z = h_i W^T (+ bias), or h_i @ weight for proj="matmul", then `head(z, *head_args)`: the
    model's row-local ops between its projection and its loss (a scale, a softcap, casts), which act on
    each row alone and so give the same rows whether applied to the whole logits or to a chunk; its rows' loss is
    logsumexp(z) - (1 - s) z[y] - s mean(z) (s: label smoothing), zero where y == ignore_index. The
    pieces are summed in order, and for reduction="mean" divided by the number of rows not ignored,
    as nll_loss does.
    """
    rows = h.shape[0]
    size = -(-rows // chunks)
    total = None
    for i, (h_i, y_i) in enumerate(zip(h.split(size), target.split(size))):
        with annotate({LOSS_CHUNK_TAG: i + 1}):  # the planner tells a chunk's nodes from the shared ones
            z = F.linear(h_i, weight, bias) if proj == "linear" else torch.matmul(h_i, weight)
            z = z if head is None else head(z, *head_args)
            z = z if dtype is None else z.to(dtype)
            valid = y_i != ignore_index
            picked = z.gather(1, torch.where(valid, y_i, 0).unsqueeze(1)).squeeze(1)
            term = torch.logsumexp(z, dim=-1)
            term = term - picked if label_smoothing == 0 else (
                term - (1 - label_smoothing) * picked - label_smoothing * z.mean(dim=-1))
            part = torch.where(valid, term, 0).sum()
            total = part if total is None else total + part
    if reduction == "mean":
        total = total / (target != ignore_index).sum()
    return total


@dataclass
class Site:
    """One recognised projection -> cross-entropy pattern in a dynamo graph."""

    loss: fx.Node  # the cross_entropy call
    proj: fx.Node  # the linear / matmul producing the logits
    kind: str  # "linear" | "matmul"
    chain: list[fx.Node]  # the nodes between proj and the loss, in order
    target: fx.Node
    ignore_index: int
    reduction: str
    label_smoothing: float
    rows: int
    vocab: int
    pointwise: dict[fx.Node, fx.Node] = field(default_factory=dict)  # the chain's pointwise ops -> logits operand


@dataclass
class Report:
    """What the pass saw and did in each graph, for the plan's summary and notes."""

    sites: int = 0  # patterns recognised (rewritten when chunks > 1)
    rewritten: int = 0
    rows: int = 0  # token rows of the largest site
    vocab: int = 0
    logits_kept: int = 0  # sites whose logits stayed materialised for another use
    fused: int = 0  # 16-bit sites left whole, their loss one fused kernel (passes/fused_loss.py)
    skipped: list[str] = field(default_factory=list)  # cross_entropy calls left alone, and why


def _value(node: object) -> torch.Tensor | None:
    """The traced value of a dynamo graph node; for a cast inserted by an earlier pre-pass (the
    precision rewrite adds `.to(dtype)` nodes without metadata), its input's, whose shape it has."""
    if not isinstance(node, fx.Node):
        return None
    val = node.meta.get("example_value", node.meta.get("val"))
    if val is None and _cast_dtype(node) is not None:
        return _value(node.args[0])
    return val if isinstance(val, torch.Tensor) else None


def _cast_dtype(n: fx.Node) -> torch.dtype | None:
    """The dtype a dtype-only cast node converts to, or None if `n` is not one."""
    if n.op != "call_method" or n.target not in _CASTS or not n.args:
        return None
    fixed = {"float": torch.float32, "half": torch.float16, "bfloat16": torch.bfloat16, "double": torch.float64}
    if n.target in fixed:
        return fixed[n.target] if len(n.args) == 1 and not n.kwargs else None
    if n.target == "type_as":
        other = _value(n.args[1]) if len(n.args) == 2 else None
        return other.dtype if other is not None else None
    dtypes = [a for a in (*n.args[1:], *n.kwargs.values()) if isinstance(a, torch.dtype)]
    others = [a for a in (*n.args[1:], *n.kwargs.values()) if not isinstance(a, (torch.dtype, bool))]
    return dtypes[0] if len(dtypes) == 1 and not others else None  # `.to(dtype)` only, no device move


def _row_slice(index: object, ndim: int) -> bool:
    """A getitem index that keeps the last dimension whole: slices (and one Ellipsis) only."""
    parts = index if isinstance(index, tuple) else (index,)
    if not all(p is Ellipsis or isinstance(p, slice) for p in parts) or sum(p is Ellipsis for p in parts) > 1:
        return False
    if any(isinstance(p, slice) and any(isinstance(v, fx.Node) for v in (p.start, p.stop, p.step)) for p in parts):
        return False
    if Ellipsis in parts:
        return parts[-1] is Ellipsis or parts[-1] == slice(None)
    return len(parts) < ndim or parts[-1] == slice(None)


def _linear_args(n: fx.Node) -> tuple[object, object]:
    """(weight, bias) of a linear call however they were passed (torch._C._nn.linear has no signature)."""
    weight = n.args[1] if len(n.args) > 1 else n.kwargs.get("weight")
    bias = n.args[2] if len(n.args) > 2 else n.kwargs.get("bias")
    return weight, bias


def _proj_kind(n: fx.Node) -> str | None:
    if n.op != "call_function":
        return None
    if n.target in _LINEAR:
        w = _value(_linear_args(n)[0])
        return "linear" if w is not None and w.dim() == 2 else None
    if n.target in _MATMUL and len(n.args) == 2:
        w = _value(n.args[1])
        return "matmul" if w is not None and w.dim() == 2 else None
    return None


def find(gm: fx.GraphModule, report: Report | None = None) -> list[Site]:
    """The projection -> cross-entropy patterns of `gm` that the rewrite handles exactly."""
    sites = []
    for ce in [n for n in gm.graph.nodes if n.op == "call_function" and n.target in _CE]:
        why = _match(ce, sites)
        if why and report is not None:
            report.skipped.append(f"{ce.name}: {why}")
    return sites


def _match(ce: fx.Node, sites: list[Site]) -> str:
    try:
        bound = _CE_SIGNATURE.bind(*ce.args, **ce.kwargs)
    except TypeError:
        return "arguments not understood"
    a = {**{k: p.default for k, p in _CE_SIGNATURE.parameters.items()}, **bound.arguments}
    if a["weight"] is not None or a["size_average"] is not None or a["reduce"] is not None:
        return "a class weight or the legacy size_average/reduce arguments"
    if a["reduction"] not in ("mean", "sum"):
        return f"reduction={a['reduction']!r} (only 'mean' and 'sum' are chunked)"
    if any(isinstance(a[k], fx.Node) for k in ("ignore_index", "label_smoothing")):
        return "ignore_index or label_smoothing computed in the graph"
    x, y = _value(a["input"]), _value(a["target"])
    if x is None or y is None or x.dim() != 2 or y.dim() != 1 or y.dtype != torch.int64 \
            or not x.is_floating_point():
        return "not a [tokens, classes] input with integer class targets"
    chain, cur = [], a["input"]
    pointwise: dict[fx.Node, fx.Node] = {}  # each pointwise op of the chain -> its logits operand
    while isinstance(cur, fx.Node) and _proj_kind(cur) is None:
        if not cur.args:
            return f"no linear or matmul producing the logits ({cur.name} has no input)"
        if _row_step(cur):
            src = cur.args[0]
        elif (src := _pointwise_source(cur)) is not None:
            pointwise[cur] = src
        if src is None:
            return (f"the logits pass through {cur.name} ({cur.target}), which is neither a cast, a row view or "
                    f"slice, nor a pointwise op with column-constant operands")
        chain.insert(0, cur)
        cur = src
    if not isinstance(cur, fx.Node):
        return "no linear or matmul producing the logits"
    if _value(cur.args[0]) is None or _value(cur.args[0]).shape[:-1] != _value(cur).shape[:-1]:
        return "the projection's input is not [..., d]"
    writer = next((u for n in [cur, *chain] for u in n.users if _writes_in_place(u)), None)
    if writer is not None:
        return f"{writer.name} ({writer.target}) writes into the logits in place"
    if any(_reads_node(e, cur) for n in pointwise for e in _operands(n)[1]):
        return "a pointwise op after the projection reads the logits through another path"
    sites.append(Site(ce, cur, _proj_kind(cur), chain, a["target"], int(a["ignore_index"]), a["reduction"],
                      float(a["label_smoothing"]), x.shape[0], x.shape[1], pointwise=pointwise))
    return ""


def _row_step(n: fx.Node) -> bool:
    """A cast, `.contiguous()`, a view that keeps the last dimension, or a slice of the token dimensions:
    each keeps every row's vocabulary whole, so it applies to the hidden states' rows instead."""
    ok = (_cast_dtype(n) is not None or (n.op == "call_method" and n.target in ("contiguous", *_RESHAPES))
          or (n.op == "call_function" and n.target is torch.reshape)
          or (n.op == "call_function" and n.target is operator.getitem and _value(n.args[0]) is not None
              and _row_slice(n.args[1], _value(n.args[0]).dim())))
    src, out = _value(n.args[0]), _value(n)
    return ok and src is not None and out is not None and src.dim() >= 1 and src.shape[-1] == out.shape[-1]


_IN_PLACE_OPERATORS = (operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv,
                       operator.imod, operator.ipow, operator.iand, operator.ior, operator.ixor, operator.imatmul)


def _writes_in_place(n: fx.Node) -> bool:
    """Whether a dynamo graph's node may write into its first operand: an in-place method or function (its
    name ends in one underscore: `mul_`, `masked_fill_`), an augmented assignment, `out=` or `inplace=True`.
    The rewrite moves or drops the logits' forms, so a site with such a reader is left whole."""
    name = n.target if isinstance(n.target, str) else getattr(n.target, "__name__", "")
    return ((name.endswith("_") and not name.endswith("__")) or n.target in _IN_PLACE_OPERATORS
            or "out" in n.kwargs or n.kwargs.get("inplace") is True)


def _operands(n: fx.Node) -> tuple[list[fx.Node], list[fx.Node]]:
    """A node's tensor operands split into those shaped like its output and the others."""
    out = _value(n)
    nodes = n.all_input_nodes
    same = [a for a in nodes if _value(a) is not None and out is not None and _value(a).shape == out.shape]
    return same, [a for a in nodes if a not in same]


def _pointwise_source(n: fx.Node) -> fx.Node | None:
    """The logits operand of `n` when `n` acts on each element of the logits alone: every ATen op it runs is
    tagged pointwise by its schema and none draws random numbers, and every other tensor operand is the same
    for every row (shaped [..., 1, V] or [..., 1, 1], or a scalar tensor). Such an op gives a chunk of rows
    the values it gives those rows of the whole logits: a scale, a softcap, a bias or a vocabulary mask.
    None for anything else."""
    out = _value(n)
    if n.op not in ("call_function", "call_method") or out is None or not out.is_floating_point():
        return None
    same, others = _operands(n)
    if len(same) != 1 or any(not isinstance(d, int) for d in out.shape):
        return None
    for e in others:
        v = _value(e)
        if v is None or any(d != 1 for d in v.shape[:-1]) or (v.dim() and v.shape[-1] not in (1, out.shape[-1])):
            return None
    nodes = same + others
    ops = aten_ops_of(lambda *ts: _call(n, dict(zip(nodes, ts))), [_value(a) for a in nodes])
    if not ops or not all(isinstance(op, OpOverload) and torch.Tag.pointwise in op.tags and not is_mutable_op(op)
                          and torch.Tag.nondeterministic_seeded not in op.tags for op in ops):
        return None
    return same[0]


def _call(n: fx.Node, env: dict[fx.Node, object]) -> object:
    """Run a dynamo graph's node on the values `env` gives its operands."""
    args, kwargs = fx.node.map_arg((n.args, n.kwargs), lambda a: env[a])
    if n.op == "call_method":
        return getattr(args[0], n.target)(*args[1:], **kwargs)
    return n.target(*args, **kwargs)


def _reads_node(n: fx.Node, target: fx.Node) -> bool:
    """Whether `target` is among `n`'s inputs, at any depth."""
    seen, todo = set(), [n]
    while todo:
        m = todo.pop()
        if m is target:
            return True
        if m not in seen:
            seen.add(m)
            todo.extend(m.all_input_nodes)
    return False


def rewrite(gm: fx.GraphModule, chunks: int, outputs: str = "all", report: Report | None = None) -> int:
    """Replace every recognised pattern of `gm` by `chunked_cross_entropy` over `chunks` pieces.

    outputs="loss": a logits tensor the graph returns is returned as None instead, and the loss is
    rewritten even for chunks == 1 (one piece), so that the logits output is None whatever the count.
    With outputs="all" and chunks == 1 the projection and its casts stay as they were (the sites are
    still counted in `report`); the loss of a site with 16-bit logits becomes one fused kernel
    (passes/fused_loss.py), the others are left alone.
    Returns the number of sites rewritten.
    """
    if outputs not in OUTPUTS:
        raise ValueError(f"outputs must be one of {OUTPUTS}, got {outputs!r}")
    report = report if report is not None else Report()
    sites = find(gm, report)
    report.sites += len(sites)
    for s in sites:
        report.rows, report.vocab = max(report.rows, s.rows), max(report.vocab, s.vocab)
    if chunks <= 1 and outputs == "all":
        return sum(_fuse(gm.graph, s, report) for s in sites if _low_logits(s) and not s.pointwise)
    if not sites:
        return 0
    graph = gm.graph
    for s in sites:
        with graph.inserting_before(s.loss):
            h = s.proj.args[0]
            d = _value(h).shape[-1]
            for n in s.chain:  # the same row selection, applied to the hidden states
                if n.target is operator.getitem:
                    h = graph.call_function(operator.getitem, (h, n.args[1]))
                elif n.target in _RESHAPES or n.target is torch.reshape:
                    h = graph.call_method("reshape", (h, (*_value(n).shape[:-1], d)))
            h = graph.call_method("reshape", (h, (-1, d)))
            if s.kind == "linear":
                weight, bias = _linear_args(s.proj)
            else:
                weight, bias = s.proj.args[1], None
            casts = [_cast_dtype(n) for n in s.chain if _cast_dtype(n) is not None]
            cast = casts[-1] if casts else None  # the logits' dtype as the loss saw them
            kw = {"ignore_index": s.ignore_index, "reduction": s.reduction, "label_smoothing": s.label_smoothing}
            if s.pointwise:  # the casts and pointwise ops, in the model's order, applied to each chunk's logits
                head, head_args = _head_module(gm, s)
                kw |= {"head": head, "head_args": head_args}
                cast = None
            others = [u for n in [s.proj, *s.chain] for u in n.users
                      if u.op != "output" and u not in s.chain and u is not s.loss]
            if (outputs == "loss" and s.kind == "linear" and bias is None and _low_logits(s) and not others
                    and not s.pointwise):
                # one fused op over the master weight (passes/fused_linear_loss.py)
                master = weight.args[0] if isinstance(weight, fx.Node) and _cast_dtype(weight) is not None else weight
                new = graph.call_function(fused_linear_cross_entropy, (h, master, s.target), kw)
                report.fused += 1
            else:
                new = graph.call_function(chunked_cross_entropy, (h, weight, bias, s.target), {
                    **kw, "proj": s.kind, "chunks": min(chunks, s.rows), "dtype": cast})
        logits = [s.proj, *s.chain]  # every form of the logits: the model may return any of them
        if outputs == "loss":
            out = graph.find_nodes(op="output")[0]
            out.args = fx.node.map_arg(out.args, lambda a, forms=logits: None if a in forms else a)
        _replace_loss(graph, s, new)
        if s.proj.users:
            report.logits_kept += 1
            alive = set(graph.nodes)
            _project_after(graph, [n for n in logits if n in alive], new)
        else:
            weight = _linear_args(s.proj)[0] if s.kind == "linear" else None
            graph.erase_node(s.proj)
            if isinstance(weight, fx.Node) and _cast_dtype(weight) is not None and not weight.users:
                graph.erase_node(weight)  # the weight's 16-bit copy, read by no one now
        report.rewritten += 1
    graph.lint()
    gm.recompile()
    return len(sites)


def _project_after(graph: fx.Graph, kept: list[fx.Node], loss: fx.Node) -> None:
    """Move the kept logits (the projection and the forms of it still read, in order) from before the
    chunked loss to just after it (outputs="all").

    Why: autograd runs the ready backward node created last first, so the logits output's backward (its
    tangent, tokens x vocabulary, read by two matmuls into grad h and grad W) then runs before the chunks'
    backward and its tangent dies there. Left before the loss, that backward would run after all the chunks
    and the tangent would stay live through them: a whole tokens x vocabulary tensor at the loss region's
    peak, though a loop that only calls loss.backward() hands the logits no gradient (the tangent is
    autograd's zeros). Left where they are when one of their readers comes before the loss."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    readers = [u for n in kept for u in n.users if u not in kept]
    if all(order[u] > order[loss] for u in readers):
        at = loss
        for n in kept:
            at.append(n)
            at = n


def _head_module(gm: fx.GraphModule, s: Site) -> tuple[fx.Node, tuple[fx.Node, ...]]:
    """The site's casts and pointwise ops as a module of their own, `head(z, *operands)`, held by `gm`, for
    `chunked_cross_entropy` to apply to each chunk's logits; returns its node and its other operands.

    An operand shaped [..., 1, V] is read as [V]: the same for every row, it broadcasts over a chunk's
    [rows, V] as it did over the whole logits (a [1] or scalar operand is left as it is)."""
    graph = fx.Graph()
    z = graph.placeholder("z")
    steps = [n for n in s.chain if n in s.pointwise or _cast_dtype(n) is not None]
    operands = list(dict.fromkeys(e for n in s.pointwise for e in _operands(n)[1]))
    env: dict[fx.Node, fx.Node] = {}
    for i, e in enumerate(operands):
        p = graph.placeholder(f"operand_{i}")
        env[e] = graph.call_method("reshape", (p, (-1,))) if _value(e).dim() > 1 else p
    current = z
    for n in steps:
        if n not in s.pointwise:
            current = graph.call_method("to", (current, _cast_dtype(n)))
            continue
        current = graph.node_copy(n, lambda a, src=s.pointwise[n], cur=current: cur if a is src else env[a])
        current.meta = {}
    graph.output(current)
    index = 0
    while hasattr(gm, f"autoremat_loss_head_{index}"):
        index += 1
    name = f"autoremat_loss_head_{index}"
    gm.add_submodule(name, fx.GraphModule(torch.nn.Module(), graph))
    return gm.graph.get_attr(name), tuple(operands)


def _replace_loss(graph: fx.Graph, s: Site, new: fx.Node) -> None:
    """The site's loss replaced by `new`, and the casts and views only it read removed."""
    new.meta.update({k: v for k, v in s.loss.meta.items() if k != "example_value"})
    new.meta["custom"] = {**new.meta.get("custom", {}), LOSS_REGION_TAG: True}  # on every node traced from it
    s.loss.replace_all_uses_with(new)
    graph.erase_node(s.loss)
    for n in reversed(s.chain):
        if not n.users:
            graph.erase_node(n)


def _low_logits(s: Site) -> bool:
    """16-bit logits (the precision rewrite cast the projection's input) that the loss casts to fp32."""
    casts = [_cast_dtype(n) for n in s.chain if _cast_dtype(n) is not None]
    x = s.proj.args[0]
    return isinstance(x, fx.Node) and _cast_dtype(x) in (torch.bfloat16, torch.float16) and \
        bool(casts) and casts[-1] == torch.float32


def _fuse(graph: fx.Graph, s: Site, report: Report) -> int:
    """Replace the site's loss by `fused_loss.fused_cross_entropy` over its 16-bit logits, whole."""
    with graph.inserting_before(s.loss):
        x = s.proj
        for n in s.chain:  # the same row selection and views, without the casts
            if n.target is operator.getitem:
                x = graph.call_function(operator.getitem, (x, n.args[1]))
            elif n.target in _RESHAPES or n.target is torch.reshape:
                x = graph.call_method("reshape", (x, (*_value(n).shape[:-1], s.vocab)))
        x = graph.call_method("reshape", (x, (-1, s.vocab)))
        new = graph.call_function(fused_cross_entropy, (x, s.target), {
            "ignore_index": s.ignore_index, "reduction": s.reduction, "label_smoothing": s.label_smoothing})
    _replace_loss(graph, s, new)
    graph.lint()
    graph.owning_module.recompile()
    report.fused += 1
    return 1


@dataclass
class LossOption:
    """What `optimize(..., outputs=...)` asks of the loss region, and what the pass reported."""

    outputs: str = "all"
    chunks: int | None = None  # None: the planner chooses
    reports: list[Report] = field(default_factory=list)  # one per dynamo graph seen

    def pre_pass(self) -> Callable[[int, fx.GraphModule, list], None]:
        """A capture pre-pass that rewrites each dynamo graph with this chunk count (1 before a choice)."""
        self.reports = []

        def apply(index: int, gm: fx.GraphModule, inputs: list) -> None:
            report = Report()
            self.reports.append(report)
            rewrite(gm, self.chunks or 1, self.outputs, report)

        return apply

    @property
    def found(self) -> bool:
        return any(r.sites for r in self.reports)

    def rows(self) -> int:
        return max([r.rows for r in self.reports], default=0)


def compose(*passes: Callable | None) -> Callable | None:
    """One pre-pass running `passes` in order (None entries skipped); None if there are none."""
    real = [p for p in passes if p is not None]
    if not real:
        return None
    if len(real) == 1:
        return real[0]

    def run(index: int, gm: fx.GraphModule, inputs: list) -> None:
        for p in real:
            p(index, gm, inputs)

    return run


def candidates(rows: int) -> list[int]:
    """The chunk counts worth planning for `rows` token rows (1 = not rewritten)."""
    return [k for k in CANDIDATES if k == 1 or k <= rows]


def describe(chunks: int, outputs: str, rows: int, fused: int = 0) -> str:
    """The plan summary's line about the loss region."""
    kept = "logits not returned (outputs='loss')" if outputs == "loss" else "logits output kept whole"
    if outputs == "loss" and fused:
        return (f"loss over {rows} token rows as one fused projection + cross-entropy in 16 bits "
                f"(autoremat::linear_cross_entropy, no logits stored); {kept}")
    if chunks <= 1:
        how = "; one fused cross-entropy over its 16-bit logits (autoremat::cross_entropy)" if fused else ""
        return f"loss not chunked (1 piece over {rows} token rows){how}; {kept}"
    size = -(-rows // chunks)
    return f"loss chunked into {chunks} pieces of {size} token rows; {kept}"
