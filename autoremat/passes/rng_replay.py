"""Random draws that the backward can replay: a dropout mask costs its generator state, not its bytes.

Dropout reaches the joint graph as a bool mask drawn by `autoremat::bool_bernoulli` (CPU) or by the device's
fused kernel (`autoremat::dropout_mask`, CUDA), and a masked scale (`decompositions._native_dropout`). The mask is a random value: recomputed as it is, it would be a fresh
draw, so the plan had to save it, 1 byte per element. `torch.utils.checkpoint` saves the random
generator's state instead and replays the draw; at the smallest budget the saved masks are a large share
of the activations, more than the gap to checkpointing (benchmarks/floor.py's BERT and ResNet rows use dropout).

`replay_random_draws` rewrites each forward draw `m = bernoulli(x, p)` of a joint graph into

    state = draw_saving_state("bernoulli", x, None, p, None)  # draws (and drops), returns the state before:
                                                              # a random value, saved (5,056 B on CPU, 16 B on CUDA)
    m = replay_draw(state, "bernoulli", x, None, p, None)    # the draw made from that state: pure

so `m` is an ordinary value of the graph that the planner may save or recompute. The forward must
draw only once and leave the generator where eager mode leaves it: `forward_draws_once` turns the
forward graph's pair into `state = rng_state(device)` and `m = draw(state, ...)`, one draw (the same bytes),
after the split. In the
backward, a recomputed `m` replays the draw from the saved state, bit for bit (the generator is
restored afterwards). PyTorch's partitioner replays random ops under activation checkpointing the
same way (its `run_and_save_rng_state` / `run_with_rng_state`); those have no meta-device kernel, and
plans are also traced on meta, hence ops of our own. Both compilers run them: Inductor calls them as it
calls a library kernel.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from autoremat.passes.decompositions import bool_bernoulli, dropout_mask  # noqa: F401 - registers the draw ops
from autoremat.passes.joint import backward_side

# Random ops whose draws we replay: the bool mask of autoremat's dropout decomposition, drawn by bernoulli
# (`decompositions.bool_bernoulli`: CPU) or by the device's fused dropout kernel (`decompositions.dropout_mask`:
# CUDA), and a model's own `torch.bernoulli(x, p)`; each by the name the two ops below take.
REPLAYED = {torch.ops.autoremat.bool_bernoulli.default: "bool_bernoulli",
            torch.ops.autoremat.dropout_mask.default: "dropout_mask",
            torch.ops.aten.bernoulli.p: "bernoulli"}
# Bytes of the generator state saved per draw: torch.get_rng_state() (the CPU Mersenne Twister) or
# torch.cuda.get_rng_state() (Philox seed and offset).
STATE_BYTES = {"cuda": 16}
CPU_STATE_BYTES = 5056


def _state_bytes(device: torch.device) -> int:
    return STATE_BYTES.get(device.type, CPU_STATE_BYTES)


def _get_state(device: torch.device) -> torch.Tensor:
    if device.type == "cuda":
        return torch.cuda.get_rng_state(device)
    return torch.get_rng_state()


def _set_state(device: torch.device, state: torch.Tensor) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


def _draw(op: str, x: torch.Tensor | None, size: list[int] | None, p: float,
          device: torch.device | None) -> torch.Tensor:
    if op == "bool_bernoulli":
        return torch.ops.autoremat.bool_bernoulli(size, p, device)
    if op == "dropout_mask":
        return torch.ops.autoremat.dropout_mask(x, p)
    return torch.ops.aten.bernoulli.p(x, p)


def _drawn_like(op: str, x: torch.Tensor | None, size: list[int] | None, device: torch.device | None) -> torch.Tensor:
    if op == "bool_bernoulli":
        return torch.empty(size, dtype=torch.bool, device=device)
    return torch.empty_like(x, dtype=torch.bool if op == "dropout_mask" else None)


# Ops of their own, not Python functions in the graph, so that Inductor calls them as it calls any library
# kernel and a plan compiled by Inductor replays draws too. Their fake kernels serve traces on meta. Each
# returns one tensor (Inductor chains random ops, `nondeterministic_seeded`, in program order, one output each).
@torch.library.custom_op("autoremat::draw_saving_state", mutates_args=(),
                         tags=(torch.Tag.nondeterministic_seeded,))
def draw_saving_state(op: str, x: torch.Tensor | None, size: list[int] | None, p: float,
                      device: torch.device | None) -> torch.Tensor:
    """The generator state before the draw `op` (a name of REPLAYED) makes, the draw made and dropped: the
    generator advances as eager's does, whoever reads the draw (what `torch.utils.checkpoint` saves too)."""
    state = _get_state(x.device if x is not None else device)
    _draw(op, x, size, p, device)
    return state


@draw_saving_state.register_fake
def _(op: str, x: torch.Tensor | None, size: list[int] | None, p: float,
      device: torch.device | None) -> torch.Tensor:
    return _state_like(x.device if x is not None else device)


def _state_like(device: torch.device) -> torch.Tensor:
    # the generator state is a CPU tensor on every device (torch.cuda.get_rng_state's too)
    where = "meta" if device.type == "meta" else "cpu"
    return torch.empty(_state_bytes(device), dtype=torch.uint8, device=where)


@torch.library.custom_op("autoremat::rng_state", mutates_args=(), tags=(torch.Tag.nondeterministic_seeded,))
def rng_state(device: torch.device) -> torch.Tensor:
    """The generator state of `device` now: a CPU byte tensor."""
    return _get_state(device)


@rng_state.register_fake
def _(device: torch.device) -> torch.Tensor:
    return _state_like(device)


@torch.library.custom_op("autoremat::draw", mutates_args=(), tags=(torch.Tag.nondeterministic_seeded,))
def draw(state: torch.Tensor, op: str, x: torch.Tensor | None, size: list[int] | None, p: float,
         device: torch.device | None) -> torch.Tensor:
    """The draw `op` makes now; `state`, read by `rng_state` just before, is taken only to order the two."""
    return _draw(op, x, size, p, device)


@draw.register_fake
def _(state: torch.Tensor, op: str, x: torch.Tensor | None, size: list[int] | None, p: float,
      device: torch.device | None) -> torch.Tensor:
    return _drawn_like(op, x, size, device)


@torch.library.custom_op("autoremat::replay_draw", mutates_args=())
def replay_draw(state: torch.Tensor, op: str, x: torch.Tensor | None, size: list[int] | None, p: float,
                device: torch.device | None) -> torch.Tensor:
    """The draw `op` makes from `state`; the generator is left as it was, so replaying draws nothing new:
    a function of its inputs."""
    dev = x.device if x is not None else device
    current = _get_state(dev)
    _set_state(dev, state)
    try:
        return _draw(op, x, size, p, device)
    finally:
        _set_state(dev, current)


@replay_draw.register_fake
def _(state: torch.Tensor, op: str, x: torch.Tensor | None, size: list[int] | None, p: float,
      device: torch.device | None) -> torch.Tensor:
    return _drawn_like(op, x, size, device)


_SAVING = torch.ops.autoremat.draw_saving_state.default
_STATE = torch.ops.autoremat.rng_state.default
_DRAW = torch.ops.autoremat.draw.default
_REPLAY = torch.ops.autoremat.replay_draw.default


def _draw_args(n: fx.Node) -> tuple:
    """A draw node's arguments in the ops' form: (op name, x, size, p, device)."""
    op = REPLAYED[n.target]
    if op == "bool_bernoulli":
        size, p, device = n.args
        return op, None, size, p, device
    x, p = n.args[0], (n.args[1] if len(n.args) > 1 else 0.5)
    return op, x, None, p, None


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
            state = torch.empty(_state_bytes(val.device), dtype=torch.uint8)
        # where the node was traced from, not what it was called with: Inductor checks a call against its
        # "eager_input_vals", which are the draw's arguments, not these ops'
        carried = {k: v for k, v in n.meta.items() if k not in ("val", "eager_input_vals")}
        args = _draw_args(n)
        with graph.inserting_before(n):
            state_node = graph.call_function(_SAVING, args)
            replay = graph.call_function(_REPLAY, (state_node, *args))
        for node, v in ((state_node, state), (replay, val)):
            node.meta.update(carried)
            node.meta["val"] = v
        n.replace_all_uses_with(replay)
        graph.erase_node(n)
    if draws:
        graph.lint()
        joint.recompile()
    return len(draws)


def forward_draws_once(fw: fx.GraphModule) -> None:
    """In the forward module, draw once where the joint graph draws, drops and replays: the state read
    (`rng_state`), then the draw itself (`draw`), the same bytes and the same generator advance as eager's."""
    replays = [n for n in fw.graph.nodes if n.op == "call_function" and n.target is _REPLAY]
    for r in replays:
        saving = r.args[0]
        if not (isinstance(saving, fx.Node) and saving.target is _SAVING):
            raise RuntimeError(f"autoremat internal error: {r.name} does not replay a draw of this forward")
        with fw.graph.inserting_before(saving):
            state = fw.graph.call_function(_STATE, (r.meta["val"].device,))
        state.meta = {k: v for k, v in saving.meta.items() if k != "eager_input_vals"}
        saving.replace_all_uses_with(state)
        fw.graph.erase_node(saving)
        with fw.graph.inserting_after(r):
            drawn = fw.graph.call_function(_DRAW, r.args)
        drawn.meta = {k: v for k, v in r.meta.items() if k != "eager_input_vals"}
        r.replace_all_uses_with(drawn)
        fw.graph.erase_node(r)
    if replays:
        fw.graph.lint()
        fw.recompile()


def draw_scratch(node: fx.Node) -> int:
    """Bytes a draw or replay allocates and frees while it runs: the fused dropout kernel's output,
    which `dropout_mask` drops (bernoulli allocates only its mask)."""
    if node.target in (_SAVING, _REPLAY) and "dropout_mask" in node.args:
        x = node.args[node.args.index("dropout_mask") + 1]
        val = x.meta.get("val") if isinstance(x, fx.Node) else None
        if isinstance(val, torch.Tensor):
            return val.numel() * val.element_size()
    return 0


def is_draw(target: object) -> bool:
    """A node whose value is random: the state a replayed draw starts from, or a draw."""
    return target in (_SAVING, _STATE, _DRAW)


def is_replay(target: object) -> bool:
    return target is _REPLAY
