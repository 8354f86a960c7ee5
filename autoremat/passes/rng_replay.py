"""Random draws that the backward can replay: a dropout mask costs its generator state, not its bytes.

Dropout reaches the joint graph as a bool mask drawn by `autoremat::bool_bernoulli` (CPU) or by the device's
fused kernel (`autoremat::dropout_mask`, CUDA), and a masked scale (`decompositions._native_dropout`). The mask is a random value: recomputed as it is, it would be a fresh
draw, so the plan had to save it, 1 byte per element. `torch.utils.checkpoint` saves the random
generator's state instead and replays the draw; at the smallest budget the saved masks are a large share
of the activations, more than the gap to checkpointing (benchmarks/floor.py's BERT and ResNet rows use dropout).

`replay_random_draws` rewrites each forward draw `m = bernoulli(x, p)` of a joint graph into

    h = draw_saving_state(bernoulli, x, p)  # the draw, and the generator state before it
    state = h[0]                                   # a random value: saved (5,056 B on CPU, 16 B on CUDA)
    m = replay_draw(state, bernoulli, x, p)  # the same draw again from that state: pure

so `m` is an ordinary value of the graph that the planner may save or recompute. The forward must
draw only once and leave the generator where eager mode leaves it: `forward_draws_once` turns the
forward graph's `m` back into `h[1]`, the draw itself (the same bytes), after the split. In the
backward, a recomputed `m` replays the draw from the saved state, bit for bit (the generator is
restored afterwards). PyTorch's partitioner replays random ops under activation checkpointing the
same way (its `run_and_save_rng_state` / `run_with_rng_state`); those have no meta-device kernel, and
plans are also traced on meta, hence functions of our own.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

from autoremat.passes.decompositions import bool_bernoulli, dropout_mask  # noqa: F401 - registers the draw ops
from autoremat.passes.joint import backward_side

# Random ops whose draws we replay: the bool mask of autoremat's dropout decomposition, drawn by bernoulli
# (`decompositions.bool_bernoulli`: CPU) or by the device's fused dropout kernel (`decompositions.dropout_mask`:
# CUDA), and a model's own `torch.bernoulli(x, p)`.
REPLAYED = (torch.ops.autoremat.bool_bernoulli.default, torch.ops.autoremat.dropout_mask.default,
            torch.ops.aten.bernoulli.p)
# Bytes of the generator state saved per draw: torch.get_rng_state() (the CPU Mersenne Twister) or
# torch.cuda.get_rng_state() (Philox seed and offset).
STATE_BYTES = {"cuda": 16}
CPU_STATE_BYTES = 5056


def _state_bytes(device: torch.device) -> int:
    return STATE_BYTES.get(device.type, CPU_STATE_BYTES)


def _device(args: tuple) -> torch.device:
    """The device a draw runs on: its first tensor argument's, or its device argument (`bool_bernoulli`)."""
    return next(a.device if isinstance(a, torch.Tensor) else a for a in args if isinstance(a, (torch.Tensor, torch.device)))


def _get_state(device: torch.device) -> torch.Tensor:
    if device.type == "cuda":
        return torch.cuda.get_rng_state(device)
    if device.type == "meta":  # a plan traced on meta runs no kernel: a state of the right size will do
        return torch.empty(CPU_STATE_BYTES, dtype=torch.uint8, device="meta")
    return torch.get_rng_state()


def _set_state(device: torch.device, state: torch.Tensor) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    elif device.type != "meta":
        torch.set_rng_state(state)


def draw_saving_state(op: Any, *args: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """`op(*args)`, and the generator state it started from (what `torch.utils.checkpoint` saves too)."""
    state = _get_state(_device(args))
    return state, op(*args)


def replay_draw(state: torch.Tensor, op: Any, *args: Any) -> torch.Tensor:
    """`op(*args)` drawn from `state`; the generator is left as it was, so replaying draws nothing new."""
    device = _device(args)
    current = _get_state(device)
    _set_state(device, state)
    try:
        return op(*args)
    finally:
        _set_state(device, current)


def replay_random_draws(joint: fx.GraphModule) -> int:
    """Rewrite the forward draws of `joint` as described in the module docstring; returns how many."""
    graph = joint.graph
    backward = backward_side(graph)
    draws = [n for n in graph.nodes if n.op == "call_function" and n.target in REPLAYED and n not in backward]
    for n in draws:
        val = n.meta.get("val")
        fake_mode = getattr(val, "fake_mode", None)
        if fake_mode is None or n.kwargs:  # not traced by AOTAutograd, or its own generator: saved, as before
            continue
        with fake_mode:
            drawn = torch.empty_like(val)
            state = torch.empty(_state_bytes(val.device), dtype=torch.uint8)
        carried = {k: v for k, v in n.meta.items() if k != "val"}
        with graph.inserting_before(n):
            h = graph.call_function(draw_saving_state, (n.target, *n.args))
            state_node = graph.call_function(operator.getitem, (h, 0))
            replay = graph.call_function(replay_draw, (state_node, n.target, *n.args))
        for node, v in ((h, (state, drawn)), (state_node, state), (replay, val)):
            node.meta.update(carried)
            node.meta["val"] = v
        n.replace_all_uses_with(replay)
        graph.erase_node(n)
    if draws:
        graph.lint()
        joint.recompile()
    return len(draws)


def forward_draws_once(fw: fx.GraphModule) -> None:
    """In the forward module, use the draw itself (`h[1]`) where the graph replays it: the forward
    must advance the generator exactly once per draw, as eager mode does, and gains nothing from
    drawing again."""
    replays = [n for n in fw.graph.nodes if n.op == "call_function" and n.target is replay_draw]
    for r in replays:
        state = r.args[0]
        h = state.args[0] if state.op == "call_function" and state.target is operator.getitem else None
        if h is None or h.target is not draw_saving_state:
            raise RuntimeError(f"autoremat internal error: {r.name} does not replay a draw of this forward")
        with fw.graph.inserting_after(r):
            drawn = fw.graph.call_function(operator.getitem, (h, 1))
        drawn.meta = dict(r.meta)
        r.replace_all_uses_with(drawn)
        fw.graph.erase_node(r)
    if replays:
        fw.graph.lint()
        fw.recompile()


def draw_scratch(node: fx.Node) -> int:
    """Bytes a draw or replay allocates and frees while it runs: the fused dropout kernel's output,
    which `dropout_mask` drops (bernoulli allocates only its mask)."""
    if node.target in (draw_saving_state, replay_draw) and torch.ops.autoremat.dropout_mask.default in node.args:
        x = node.args[node.args.index(torch.ops.autoremat.dropout_mask.default) + 1]
        val = x.meta.get("val") if isinstance(x, fx.Node) else None
        if isinstance(val, torch.Tensor):
            return val.numel() * val.element_size()
    return 0


def is_draw(target: object) -> bool:
    return target is draw_saving_state


def is_replay(target: object) -> bool:
    return target is replay_draw
