"""Train a small byte-level masked-token model with a Lightning Trainer under a budget its plain step exceeds.

    python examples/lightning_budget.py                        # about a minute on a 2-core CPU
    python examples/lightning_budget.py --budget-fraction 0.5 --steps 60

The LightningModule holds the network as `self.model` and computes the loss in `training_step`, outside it.
First a plain Trainer runs two steps and the second is measured with autoremat's PeakMeter (forward,
backward and the AdamW step, with the model, its AdamW state and the batch); then a Trainer with
`autoremat.lightning.Budget(budget)` trains at `--budget-fraction` of that peak, plans `self.model` on the
first batch, and its second step is measured the same way.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import autoremat  # noqa: E402
from autoremat.lightning import Budget  # noqa: E402
from autoremat.measure import PeakMeter  # noqa: E402
from examples.models import Block  # noqa: E402

MASK = 0  # the byte that stands for a hidden one (NUL: absent from source text)


class Net(nn.Module):
    """Byte embedding + learned positions, transformer blocks, a byte classifier: logits per position."""

    def __init__(self, layers: int, width: int, seq: int) -> None:
        super().__init__()
        self.embed, self.position = nn.Embedding(256, width), nn.Parameter(torch.zeros(seq, width))
        self.blocks = nn.Sequential(*[Block(width, 4, dropout=0.1) for _ in range(layers)])
        self.head = nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 256))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(ids) + self.position))


class MaskedBytes(L.LightningModule):
    """Predict the bytes hidden in a chunk of text: attention sees the whole chunk, as in BERT. The masking
    and the loss are in training_step, outside the planned `self.model`."""

    def __init__(self, layers: int, width: int, seq: int, lr: float) -> None:
        super().__init__()
        self.model = Net(layers, width, seq)
        self.lr = lr

    def _loss(self, ids: torch.Tensor) -> torch.Tensor:
        hidden = torch.rand(ids.shape, device=ids.device) < 0.15
        logits = self.model(ids.masked_fill(hidden, MASK))
        return F.cross_entropy(logits[hidden], ids[hidden])

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


class MeasureStep(L.Callback):
    """The peak of one training step (global step `at`), from on_train_batch_start to on_train_batch_end."""

    def __init__(self, at: int = 2) -> None:
        self.at, self.meter, self.result = at, None, None
        self.val_losses: list[tuple[int, float]] = []

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == self.at - 1:
            # Lightning frees the gradients inside the step, but the profiler cannot see frees of blocks
            # allocated before it started (autoremat.measure): free them first, as the step would.
            trainer.optimizers[0].zero_grad(set_to_none=True)
            self.meter = PeakMeter(baseline_objs=(pl_module, trainer.optimizers[0], batch)).__enter__()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.meter is not None:
            self.meter.__exit__(None, None, None)
            self.result, self.meter = self.meter.result, None

    def on_validation_end(self, trainer: L.Trainer, pl_module: Any) -> None:
        self.val_losses.append((trainer.global_step, float(trainer.callback_metrics["val_loss"])))


def chunks(seq: int, count: int, offset: int = 0) -> torch.Tensor:
    """`count` chunks of `seq` bytes of the standard library's source (no download, the same on every run)."""
    data = b"".join(p.read_bytes() for p in sorted(Path(os.__file__).parent.glob("*.py"))[:60])
    ids = torch.frombuffer(bytearray(data.replace(b"\0", b" ")), dtype=torch.uint8).long()
    return ids[offset * seq:(offset + count) * seq].view(count, seq)


def run(args: argparse.Namespace, callbacks: list, steps: int) -> tuple[MeasureStep, MaskedBytes]:
    torch.manual_seed(0)
    lit = MaskedBytes(args.layers, args.width, args.seq, args.lr)
    measure = MeasureStep()
    train = torch.utils.data.DataLoader(chunks(args.seq, args.batch * steps), batch_size=args.batch, shuffle=True)
    val = torch.utils.data.DataLoader(chunks(args.seq, 4 * args.batch, offset=args.batch * steps),
                                      batch_size=args.batch)
    trainer = L.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        val_check_interval=max(1, steps // 2), limit_val_batches=4, callbacks=[*callbacks, measure])
    trainer.fit(lit, train, val)
    return measure, lit


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--budget-fraction", type=float, default=0.6, help="the budget, as a fraction of the plain step's peak")
    p.add_argument("--compiler", default="eager", choices=("auto", "inductor", "eager"),
                   help="what runs the planned graphs (default eager: no Inductor compile on a CPU)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    fmt = autoremat.format_bytes
    plain, _ = run(args, [], 2)
    budget = int(args.budget_fraction * plain.result.peak_bytes)
    print(f"plain step measured {fmt(plain.result.peak_bytes)}; budget {fmt(budget)} ({args.budget_fraction:.0%})\n")

    callback = Budget(budget, compiler=args.compiler)
    started = time.perf_counter()
    planned, lit = run(args, [callback], args.steps)
    print(f"\n{args.steps} steps in {time.perf_counter() - started:.1f} s, planning included")
    print("validation loss by step: " + ", ".join(f"{s}: {v:.3f}" for s, v in planned.val_losses))
    print(f"after fit, lit.model is a {type(lit.model).__name__} again; callback.plan keeps the plan")
    print(f"\nbudget {fmt(budget)}; one training step (forward, backward, AdamW step):")
    print(f"  predicted by autoremat  {fmt(callback.plan.predicted_peak + callback.reserved)} "
          f"(the plan's {fmt(callback.plan.predicted_peak)} + {fmt(callback.reserved)} reserved)")
    for name, m in (("measured, with Budget", planned.result), ("measured, plain", plain.result)):
        verdict = "within the budget" if m.peak_bytes <= budget else "OVER the budget"
        print(f"  {name:<23} {fmt(m.peak_bytes)} ({verdict})")
    return {"budget": budget, "plain": plain.result, "planned": planned.result, "plan": callback.plan,
            "val_losses": planned.val_losses}


if __name__ == "__main__":
    main()
