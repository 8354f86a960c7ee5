"""Fine-tune an HF GPT-2 (built from its config: no download) with `transformers.Trainer` under a byte budget.

    python examples/hf_trainer.py                  # about 5 minutes on a 2-core CPU (Inductor); --compiler eager: about 1
    python examples/hf_trainer.py --steps 20 --budget-fraction 0.3

The route: plan the model's training step with `autoremat.optimize` on a batch shaped like the
Trainer's, then hand the returned module to `Trainer(model=...)` in place of the model. The
`RematModule` stands in for the model: `config`, `save_pretrained`, `generate`, `main_input_name`
are the model's, its `forward` has the model's signature (so the Trainer keeps the dataset's
columns), and its `state_dict` has the model's keys (so checkpoints load into a plain GPT-2). The
Trainer's optimizer is built over the same parameters. Turning on the Trainer's own gradient
checkpointing is refused: the plan already chooses what to recompute.

Why not a `TrainerCallback` alone: a callback cannot change which module the Trainer calls, and a
Trainer subclass that swaps the module in `compute_loss` would duplicate what the stand-in does.
A callback is used for what callbacks can do: `MeasureStep` measures one real training step
(forward, backward, clipping and the AdamW step) with `autoremat.measure_peak`'s meter, from
`on_step_begin` to `on_step_end`.

Saving: `opt_model.save_pretrained(dir)` is the model's own (config, tied weights handled). The
Trainer's `save_model` and its checkpoints (`save_strategy`) are not: for a model that is not a
`PreTrainedModel` the Trainer writes a bare state dict, which safetensors refuses for tied weights
(GPT-2's embedding and head). Hence `save_strategy="no"` here and `save_pretrained` at the end.

Two things to match the Trainer's batches, so no second plan is made at the first step:
- the Trainer passes `num_items_in_batch` (the label count, a float tensor) to models whose forward takes
  `**kwargs`, as GPT-2's does: the example batch carries it too;
- `dataloader_drop_last=True`: a smaller last batch is a new input shape, which is planned (and held
  to the budget) on its own, costing seconds.
Evaluation runs under `torch.no_grad()`, where the module runs the model itself; `label_names=["labels"]`
tells the Trainer the loss is there (it reads label names from the model class's forward).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments, default_data_collator

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import autoremat  # noqa: E402
from autoremat.measure import PeakMeter  # noqa: E402


def corpus_chunks(seq: int, count: int, offset: int = 0) -> list[dict[str, torch.Tensor]]:
    """`count` examples of `seq` bytes of the standard library's source (real text on every Python)."""
    root = Path(os.__file__).parent
    data = b"".join(p.read_bytes() for p in sorted(root.glob("*.py"))[:60])
    ids = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
    start = offset * seq
    return [{"input_ids": ids[start + i * seq:start + (i + 1) * seq].clone(),
             "labels": ids[start + i * seq:start + (i + 1) * seq].clone()} for i in range(count)]


def gpt2(n_layer: int, n_embd: int, seq: int) -> torch.nn.Module:
    config = GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=4, vocab_size=256, n_positions=seq,
                        bos_token_id=0, eos_token_id=0,  # ids in the byte vocabulary (GPT-2's 50256 is not)
                        use_cache=False)  # no KV cache in training: the step captures as one graph per block
    model = GPT2LMHeadModel(config)
    model.loss_type = "ForCausalLM"
    return model


class MeasureStep(TrainerCallback):
    """A TrainerCallback that measures the peak memory of one training step (global step `at`)."""

    def __init__(self, at: int) -> None:
        self.at = at
        self.meter: PeakMeter | None = None
        self.result: autoremat.PeakMeasurement | None = None

    def on_step_begin(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None,
                      **kwargs: Any) -> None:
        if state.global_step == self.at - 1:
            # what is live before the step: parameters, their gradients (none: zero_grad set them to None)
            # and the AdamW state. The batch was fetched before this callback: it is not counted.
            self.meter = PeakMeter(baseline_objs=(model, optimizer))
            self.meter.__enter__()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.meter is not None:
            self.meter.__exit__(None, None, None)
            self.result, self.meter = self.meter.result, None


def budget_between(model: torch.nn.Module, example: dict, fraction: float,
                   compiler: str = "auto") -> tuple[int, int, int]:
    """(budget, smallest budget that fits, step total with nothing recomputed): the budget sits at
    `fraction` of the way from the first to the second."""
    from autoremat.model.ledger import Ledger

    big = autoremat.optimize(model, 10**12, example_inputs=example, verify=False, progress=False,
                             compiler=compiler)
    fixed = Ledger.from_dict(big.plan.ledger).fixed
    everything = fixed + big.plan.baseline_peak
    try:
        autoremat.optimize(model, fixed + 1, example_inputs=example, verify=False, progress=False,
                             compiler=compiler)
        floor = fixed + 1
    except autoremat.BudgetError as e:
        floor = e.smallest_budget
    return int(floor + fraction * (everything - floor)), floor, everything


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--budget-fraction", type=float, default=0.3,
                   help="budget between the smallest that fits (0) and no recomputation (1)")
    p.add_argument("--compiler", default="auto", choices=("auto", "inductor", "eager"),
                   help="what runs the planned graphs (autoremat.optimize's compiler; default auto: Inductor where "
                        "it runs, else eager; eager plans in seconds, Inductor's compiles take minutes on a CPU)")
    p.add_argument("--output-dir", default=None, help="where the Trainer saves (default: a temporary folder)")
    args = p.parse_args(argv)
    if args.steps < 2:
        p.error(f"--steps must be at least 2 (step 2 is measured), got {args.steps}")
    if not 0 <= args.budget_fraction <= 1:
        p.error(f"--budget-fraction must be in [0, 1], got {args.budget_fraction}")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    transformers.utils.logging.disable_progress_bar()  # the save/load bars, for logs
    train = corpus_chunks(args.seq, args.batch * args.steps)
    evals = corpus_chunks(args.seq, 4 * args.batch, offset=args.batch * args.steps)
    model = gpt2(args.n_layer, args.n_embd, args.seq)

    # A batch shaped like the Trainer's: collated the same way, with the label count it passes.
    example = default_data_collator(train[:args.batch])
    # (a float tensor: the Trainer divides the count by the parallel group sizes)
    example["num_items_in_batch"] = example["labels"][..., 1:].ne(-100).sum() / 1
    budget, floor, everything = budget_between(model, example, args.budget_fraction, args.compiler)
    fmt = autoremat.format_bytes
    print(f"GPT-2 from config: {sum(t.numel() for t in model.parameters()) / 1e6:.2f} M parameters, "
          f"{args.n_layer} layers, batch {args.batch} x {args.seq}")
    print(f"smallest budget that fits {fmt(floor)}, nothing recomputed {fmt(everything)}: budget {fmt(budget)}\n")

    t0 = time.perf_counter()
    opt_model = autoremat.optimize(model, budget, example_inputs=example, optimizer="adamw", compiler=args.compiler)
    print("\n".join(opt_model.plan.summary().splitlines()[:4]))
    print(f"(planned in {time.perf_counter() - t0:.1f} s)\n")

    measure = MeasureStep(at=2)
    with tempfile.TemporaryDirectory() as tmp:
        out_dir = args.output_dir or tmp
        targs = TrainingArguments(
            output_dir=out_dir, max_steps=args.steps, per_device_train_batch_size=args.batch,
            per_device_eval_batch_size=args.batch, learning_rate=args.lr, warmup_steps=min(10, args.steps // 5),
            weight_decay=0.1, logging_steps=max(1, args.steps // 6), save_strategy="no", report_to="none",
            use_cpu=True, dataloader_drop_last=True, label_names=["labels"], seed=0, disable_tqdm=True)
        trainer = Trainer(model=opt_model, args=targs, train_dataset=train, eval_dataset=evals,
                          data_collator=default_data_collator, callbacks=[measure])
        before = trainer.evaluate()["eval_loss"]
        t1 = time.perf_counter()
        trainer.train()
        train_s = time.perf_counter() - t1
        after = trainer.evaluate()["eval_loss"]
        opt_model.save_pretrained(out_dir)  # the model's own save_pretrained: config.json + model.safetensors
        saved = sorted(os.listdir(out_dir))
        reloaded = GPT2LMHeadModel.from_pretrained(out_dir)
        same = all(torch.equal(a, b) for a, b in zip(reloaded.state_dict().values(), model.state_dict().values()))
    losses = [(h["step"], h["loss"]) for h in trainer.state.log_history if "loss" in h]
    print("train loss by step: " + ", ".join(f"{s}: {v:.3f}" for s, v in losses))
    print(f"eval loss {before:.4f} before, {after:.4f} after {args.steps} steps ({train_s:.1f} s of training)")
    print(f"saved with save_pretrained: {', '.join(saved)}; reloaded with from_pretrained: "
          f"{'the same weights' if same else 'DIFFERENT weights'}\n")
    measured = measure.result
    assert measured is not None
    print(f"budget {fmt(budget)}; one training step (forward, backward, clip, AdamW step):")
    print(f"  predicted {fmt(opt_model.plan.predicted_peak)}")
    print(f"  measured  {fmt(measured.peak_bytes)} at step 2 "
          f"({'within the budget' if measured.peak_bytes <= budget else 'OVER the budget'})")
    return {"budget": budget, "plan": opt_model.plan, "module": opt_model, "measured": measured,
            "losses": losses, "eval_before": before, "eval_after": after, "saved": saved, "reloaded_same": same}


if __name__ == "__main__":
    main()
