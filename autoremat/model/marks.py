"""The user's own recompute marks: what `torch.utils.checkpoint` already decided, read from the joint graph.

Under torch.compile, dynamo turns `torch.utils.checkpoint.checkpoint(fn, ...)` into the
`tag_activation_checkpoint` higher-order op, whatever `use_reentrant` says (torch/_higher_order_ops/wrap.py
traces it non-reentrant), and AOTAutograd tags every op traced inside it with
``node.meta["recompute"]``, a `torch.utils.checkpoint.CheckpointPolicy`: the policy a `context_fn` made
with `create_selective_checkpoint_contexts` returned for it, or PREFER_RECOMPUTE for every op of a plain
checkpoint (wrap.py's `_always_prefer_recompute`). `user_mark` reads that tag into `NodeProfile.mark`.

What autoremat does with them (docs/user_checkpoints.md):
  must_save          never recomputed; saved whenever the backward (or a recomputation) reads it
  must_recompute     never saved; recomputed where the backward reads it
  prefer_save, prefer_recompute   hints only: they break ties in the ILP's objective (solve/ilp.py)

`must_marks` turns the per-node marks into the two sets every plan is held to; `force_marks` applies them
to a saved set, and `schedule.make_schedule` calls it, so no plan from any source (the ILP, the
heuristics, a cached plan) runs against a MUST mark. The ILP bounds its variables the same way, so it
optimises over the plans that can run.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from autoremat.model.graph_profile import GraphProfile

MUST_SAVE = "must_save"
MUST_RECOMPUTE = "must_recompute"
PREFER_SAVE = "prefer_save"
PREFER_RECOMPUTE = "prefer_recompute"


def user_mark(node: fx.Node) -> str:
    """The checkpoint policy torch tagged `node` with, lower-case ("must_save", ...), or "" for none."""
    policy = node.meta.get("recompute")
    return policy.name.lower() if isinstance(policy, CheckpointPolicy) else ""


@dataclass(frozen=True)
class MustMarks:
    """The MUST marks of one graph as sets of forward values a plan is held to."""

    save: frozenset[str] = frozenset()  # storages: a MUST_SAVE view holds its base, so the base is saved
    recompute: frozenset[str] = frozenset()
    dropped: tuple[str, ...] = field(default=())  # marks that cannot be honoured, and why


NO_MARKS = MustMarks()


def must_marks(g: GraphProfile) -> MustMarks:
    """The MUST_SAVE / MUST_RECOMPUTE values of `g`, as the plan sees them.

    A tuple (a multi-output op) is not a tensor: its mark applies to its outputs that carry none.
    MUST_SAVE on a view applies to the storage it views (autoremat saves storages: schedule._handed_over);
    on a view of a parameter or an input it needs nothing (those are always there). Two marks cannot be
    honoured and are dropped with a reason: MUST_RECOMPUTE on a value autoremat never recomputes (a random
    draw would draw again, a custom op that mutates or aliases, ...: `NodeProfile.recompute_ban`), and
    MUST_SAVE on a value Inductor fuses into its readers (it is never written out). A storage marked both
    ways is saved.
    """
    known = g.__dict__.get(_KNOWN)
    if known is not None:
        return known
    save: set[str] = set()
    recompute: set[str] = set()
    dropped: list[str] = []
    for v, p in g.nodes.items():
        mark = p.mark or (g.nodes[p.tuple_parent].mark if p.tuple_parent else "")
        if p.kind != "forward" or p.is_tuple or mark not in (MUST_SAVE, MUST_RECOMPUTE):
            continue
        root = g.nodes.get(p.storage, p) if p.storage else p
        if mark == MUST_SAVE and (p.fused or root.fused):
            dropped.append(f"{v} is marked MUST_SAVE, but Inductor fuses it into its readers: it is recomputed")
        elif mark == MUST_SAVE and root.kind == "forward":
            save.add(root.name)
        elif mark == MUST_RECOMPUTE and p.recompute_ban:
            dropped.append(f"{v} is marked MUST_RECOMPUTE, but it is saved: {p.recompute_ban}")
        elif mark == MUST_RECOMPUTE:
            recompute.add(v)
    marks = MustMarks(frozenset(save), frozenset(recompute - save), tuple(dropped)) if save or recompute or dropped \
        else NO_MARKS
    g.__dict__[_KNOWN] = marks
    return marks


# must_marks kept on the graph it was computed for (a profiled graph's nodes never change; make_schedule asks
# on every simulation): it lives and dies with the graph, and is not one of GraphProfile's fields (to_dict).
_KNOWN = "_must_marks"


def force_marks(g: GraphProfile, saved: set[str]) -> set[str]:
    """`saved` (storages a plan hands to the backward) with the MUST marks applied: MUST_SAVE values
    added (unused ones are dropped by the schedule), MUST_RECOMPUTE values taken out."""
    marks = must_marks(g)
    if marks is NO_MARKS:
        return saved
    return (saved | marks.save) - marks.recompute


def mark_counts(g: GraphProfile) -> dict[str, int]:
    """How many forward values carry each mark (for the plan's notes)."""
    counts: dict[str, int] = {}
    for p in g.nodes.values():
        if p.mark and p.kind == "forward":
            counts[p.mark] = counts.get(p.mark, 0) + 1
    return counts
