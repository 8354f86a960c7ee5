"""Identical regions traced once: a repeated block's second copy takes the first one's code and profile.

A step cut into regions (capture/regions.py) has one graph per block, and the blocks of a ModuleList
of one class trace to the same joint graph: the same ops on inputs of the same shapes, only their
parameters differ, and those are inputs of the compiled code. Tracing each block with AOTAutograd,
profiling it and partitioning it would be most of the time a capture takes on a deep model, and as much
again to compile it with the plan (benchmarks/plan_time.py --variants eager,eager-traced times both ways).

So the first block of each kind is traced, and every block whose region has the same key
(`regions.region_key`: ops, wiring, input shapes and kinds, links) reuses its compiled code and a
copy of its profile, moved to its own place in the step (`relocated`). The code is reused only where
it would be the same code: while capturing (the default partition), or while applying a plan that
saves the same values in both blocks; Inductor's compiled code only from the block just before
(capture.aot.aot_backend says why). One `RegionReuse` memo lives as long as the step being planned
(`TrainingStep.regions_seen`): the loss region's chunk counts, which rewrite only the tail, trace only
the regions they change: no candidate is traced twice for what it can be derived from.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch.fx as fx

from autoremat import switches
from autoremat.capture.graph_code import GraphCode, code_of
from autoremat.capture.regions import RegionLinks
from autoremat.model.graph_profile import GraphProfile
from autoremat.model.profile import module_path_of


class RegionOwner(Protocol):
    """The partition callback a `RegionReuse` serves (planner.CapturePlanner)."""

    def may_reuse(self) -> bool:
        """Whether a region may take a code traced before now."""
        ...

    def saved_for(self, gp: GraphProfile, index: int) -> frozenset[str] | None:
        """What the graph profiled as `gp` at `index` saves under the plan applied (None while capturing)."""
        ...

    def adopt(self, gp: GraphProfile) -> None:
        """A region's profile, moved from an identical one traced before, is the callback's next profile."""
        ...


@dataclass
class TracedRegion:
    """One region as traced: its profile, the values its compiled code saves, the code, its module paths."""

    profile: GraphProfile
    saved: frozenset[str] | None
    compiled: Callable | None = None
    modules: tuple[str, ...] = ()


class RegionReuse:
    """What `capture.aot.SameRegions` asks for (the Protocol AOTAutograd's backend calls), for one planner, over a memo shared by every trace of the step."""

    def __init__(self, owner: RegionOwner, memo: dict) -> None:
        self.owner = owner
        self.memo = memo  # region key -> [TracedRegion, one per saved set compiled]
        self.pending: dict[tuple, TracedRegion] = {}  # traced by the planner, its code not yet handed back

    def traced(self, key: tuple | None, profile: GraphProfile, saved: set[str] | None) -> None:
        """The planner profiled and partitioned a region (saved: the plan's set; None: a capture)."""
        if key is not None:
            self.pending[key] = TracedRegion(profile, None if saved is None else frozenset(saved))

    def keep(self, key: tuple, compiled: Callable, gm: fx.GraphModule) -> None:
        done = self.pending.pop(key, None)
        if done is not None:
            done.compiled, done.modules = compiled, _module_paths(gm)
            self.memo.setdefault(key, []).append(done)

    def untraced(self) -> None:
        """What `traced` noted without a trace to hand its code back (planned_in_place.py partitions the
        graphs itself): dropped, so that no later `keep` files a code under it."""
        self.pending.clear()

    def forget(self, codes: list[GraphCode]) -> None:
        """Codes a plan was swapped into (planning/planned_in_place.py) no longer run what they were traced
        with: no region takes them from now on."""
        gone = {id(c) for c in codes}
        for key, done in self.memo.items():
            self.memo[key] = [d for d in done if d.compiled is None or id(code_of(d.compiled)) not in gone]

    def reused(self, key: tuple, index: int, links: RegionLinks, gm: fx.GraphModule,
               only: Callable | None = None) -> Callable | None:
        owner = self.owner
        if not switches.current().reuse or not owner.may_reuse():
            return None
        here = _module_paths(gm)
        for done in self.memo.get(key, ()):
            if (only is not None and done.compiled is not only) or done.saved != owner.saved_for(done.profile, index):
                continue
            renames = _renames(done.modules, here)
            if renames is None:
                continue
            owner.adopt(relocated(done.profile, index, links, renames))
            return done.compiled
        return None


def relocated(gp: GraphProfile, index: int, links: RegionLinks, renames: dict[str, str]) -> GraphProfile:
    """The profile of a region that traces to the same joint graph as `gp`'s region, at graph index `index`
    with `links`: gp's nodes with their module paths renamed (the first block's -> this one's), and the
    fields that say where the region sits in the step (its index, where its inputs come from, the keys of
    its tied gradients) as `profile.profile_graph` would have written them."""
    out = copy.deepcopy(gp)
    out.index = index
    for p in out.nodes.values():
        p.module = renames.get(p.module, p.module)
    if out.user_outputs or out.sources:  # profile_graph linked gp to its region (their counts agreed)
        first = index - links.position
        primals = [name for name, p in gp.nodes.items() if p.kind in ("param", "input")]
        out.sources = {name: (first + src[0], src[1]) for name, src in zip(primals, links.sources) if src is not None}
        out.tied = {grad: f"{first}:{key.partition(':')[2]}" for grad, key in gp.tied.items()}
    return out


def _module_paths(gm: fx.GraphModule) -> tuple[str, ...]:
    return tuple(module_path_of(n) for n in gm.graph.nodes)


def _renames(first: tuple[str, ...], this: tuple[str, ...]) -> dict[str, str] | None:
    """Each module path of the first region -> the one at the same node of this region; None if a path
    would be renamed two ways (then the profile cannot be moved by renaming)."""
    if len(first) != len(this):
        return None
    renames: dict[str, str] = {}
    for old, new in zip(first, this):
        if renames.setdefault(old, new) != new:
            return None
    return renames
