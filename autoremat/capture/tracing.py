"""Running a model's step once while planning it: no trace left, inputs checked, shards put back, and what
autograd saved for the eager code between its graphs.

`Restore` puts buffers (BatchNorm statistics), gradients and the RNG back as they were;
`inputs_must_fit` turns dynamo's error for example inputs the model cannot take into one that says
so (`describe` names the inputs), and one eager PyTorch runs into autoremat's own capture error; `reshard` puts FSDP2's shards back after a forward without backward;
`eager_saved_bytes` weighs what the forward's eager code (a graph break, a dynamo-disabled function) left
saved for its backward.
"""

from __future__ import annotations

import contextlib
import logging
import re
from typing import Any

import torch

from autoremat.capture.blocks import CaptureError
from autoremat.torch_internals import (
    FAKE_TENSOR_LOGGER,
    TorchRuntimeError,
    fake_run_failure,
    is_dynamo_error,
    saved_tensors_by_origin,
    tree_leaves,
)
from autoremat.units import round_up, storage_key


class Restore:
    """Leave no trace of a planning step: buffers (BatchNorm stats), gradients and RNG as they were."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def __enter__(self) -> None:
        self.buffers = [b.detach().clone() for b in self.model.buffers()]
        self.grads = [p.grad for p in self.model.parameters()]
        self.rng = torch.get_rng_state()
        self.cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None

    def __exit__(self, *exc: object) -> None:
        with torch.no_grad():
            for b, saved in zip(self.model.buffers(), self.buffers):
                b.copy_(saved)
        for p, g in zip(self.model.parameters(), self.grads):
            p.grad = g
        torch.set_rng_state(self.rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)


def describe(args: tuple, kwargs: dict) -> str:
    def one(a: Any) -> str:
        return f"Tensor{list(a.shape)}" if isinstance(a, torch.Tensor) else type(a).__name__

    return ", ".join([one(a) for a in args] + [f"{k}={one(v)}" for k, v in kwargs.items()])


def _original_error(e: BaseException) -> BaseException | None:
    """The user-level exception dynamo wrapped (e.g. a shape mismatch in a matmul), if any."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if not is_dynamo_error(e):
            return e
        e = e.__cause__ or e.__context__
    return None


class _DropFakeTensorLog(logging.Filter):
    """Fake-tensor propagation logs a full traceback before re-raising; we report the error ourselves."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("failed while attempting to run meta")


@contextlib.contextmanager
def inputs_must_fit(model: torch.nn.Module, args: tuple, kwargs: dict):
    """Dynamo's fake-tensor run failing on the example inputs is the inputs' fault only if eager PyTorch
    fails on them too; where eager runs them, the trace is what failed (an op whose fake kernel declares
    another shape than its real one computes, an op with no fake kernel), and the error says so and
    names the op."""
    logger = logging.getLogger(FAKE_TENSOR_LOGGER)
    quiet = _DropFakeTensorLog()
    logger.addFilter(quiet)
    try:
        yield
    except TorchRuntimeError as e:
        cause = _original_error(e)
        why = f"{type(cause).__name__}: {cause}" if cause else str(e).splitlines()[0]
        if cause is None:
            m = re.search(r"got (\w+)\('(.*?)'\)", str(e))
            why = f"{m.group(1)}: {m.group(2)}" if m else why
        if _eager_runs(model, args, kwargs):
            op, where = fake_run_failure(e)
            raise CaptureError(
                f"autoremat could not capture {type(model).__name__} on ({describe(args, kwargs)}), which eager "
                f"PyTorch runs: torch.compile's trace with fake tensors failed on {op or 'an op'}"
                + (f" (at {where})" if where else "") + f": {why.rstrip('.')}. This is a failure of the capture, "
                "not of the inputs: the fake (meta) kernel of that op, or of one whose output it reads, declares "
                "another shape than the op computes, or there is none (a custom op needs register_fake).") from None
        raise ValueError(f"example_inputs do not fit the model: {type(model).__name__} cannot run on "
                         f"({describe(args, kwargs)}): {why}") from None
    finally:
        logger.removeFilter(quiet)


def _eager_runs(model: torch.nn.Module, args: tuple, kwargs: dict) -> bool:
    """Whether the model's forward runs eagerly on these inputs (compiled code it holds runs eagerly too).
    Its buffers and RNG are put back by the `Restore` around the trace; FSDP2's shards here."""
    try:  # without autograd's graph: only whether it runs is asked, and a whole forward's activations are not
        with torch.compiler.set_stance("force_eager"), torch.no_grad():
            model(*args, **kwargs)
    except Exception:
        return False
    finally:
        reshard(model)
    return True


def reshard(model: torch.nn.Module) -> None:
    """A forward with no backward leaves FSDP2's gathered parameters in place; put the shards back."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch built without distributed
        return
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def eager_saved_bytes(out: Any, model: torch.nn.Module, args: tuple, kwargs: dict, granularity: int) -> int:
    """Bytes autograd holds, after the forward, for the backward of eager code between a step's graphs (code
    whose output a later graph reads: a graph break, a dynamo-disabled function).

    No graph's profile sees them: they are saved when that code runs in the forward and freed when its
    backward runs, after the backward of every graph after it: they are held across those graphs, the
    forward/backward turn included. Not counted again: parameters and buffers, the user's inputs (the
    ledger holds them), and what a compiled graph saved itself (its plan holds that). A graph's output the
    eager code saves is counted: the memory model lets such an output go when its graph returns it. Each
    storage on the step's device counts once, rounded as the allocator hands it out.

    Not counted: what eager code after the last graph saves (a loss computed eagerly on the logits). It is
    alive at the turn only, while the graphs' peak is often in a backward, after it is freed: counted over
    the whole step, it would raise the floor by its whole size where the measured step never holds it beside
    the backward's peak. The real step's verification measures it.
    """
    roots = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    if not roots:
        return 0
    saved = saved_tensors_by_origin(roots)
    if not saved.before_a_graph:  # a step captured as one graph, or no eager code before one: on every trace
        return 0
    counted = {storage_key(t)[0] for t in (*model.parameters(), *model.buffers(), *tree_leaves((args, kwargs)),
                                           *saved.by_graphs) if isinstance(t, torch.Tensor)}
    held = {key: round_up(nbytes, granularity) for t in saved.before_a_graph if t.device == roots[0].device
            for key, nbytes in [storage_key(t)] if key not in counted}
    return sum(held.values())
