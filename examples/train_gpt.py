"""Train a small byte-level GPT on the Python standard library's source, under a byte budget.

    python examples/train_gpt.py                       # about 2 min on a 2-core CPU
    python examples/train_gpt.py --steps 50 --budget 80MB
    python examples/train_gpt.py --fit                 # let autoremat.fit pick micro-batch x accumulation

By default the budget is half of what one step needs when nothing is recomputed (every activation
saved), so the step only fits because autoremat recomputes. The script prints the plan, the
predicted peak, the peak of a real training step measured with `autoremat.measure_peak` (forward,
backward, gradient clipping and the AdamW step), the same step without autoremat, and the loss as
training goes.

With `--fit`, `autoremat.fit` plans every divisor of the batch as a micro-batch on a meta-device twin
and keeps the one its roofline predicts fastest; on this CPU model accumulation is predicted cheaper
than recomputation, so it usually picks smaller micro-batches that need no recomputation.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import autoremat  # noqa: E402
from autoremat.fit import plan_candidates  # noqa: E402

# Model -------------------------------------------------------------------------------------------


class CausalSelfAttention(nn.Module):
    # Plain ops rather than F.scaled_dot_product_attention: on the meta device SDPA lowers to its
    # math path while on CPU it runs a fused kernel, and the meta plans would then not be the real ones.
    def __init__(self, d: int, n_head: int, seq: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.register_buffer("mask", torch.ones(seq, seq, dtype=torch.bool).tril(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(~self.mask[:T, :T], float("-inf")).softmax(dim=-1)
        return self.proj((att @ v).transpose(1, 2).reshape(B, T, C))


class Block(nn.Module):
    def __init__(self, d: int, n_head: int, seq: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = CausalSelfAttention(d, n_head, seq)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """nanoGPT's shape over bytes (vocab 256); returns the mean next-byte cross-entropy."""

    def __init__(self, n_layer: int, d: int, n_head: int, seq: int, vocab: int = 256) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, n_head, seq) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.wte.weight  # tied, as in GPT-2
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


# Data --------------------------------------------------------------------------------------------


def stdlib_corpus(max_bytes: int) -> torch.Tensor:
    """The standard library's .py files as one byte stream: real text on every Python install."""
    root = Path(os.__file__).parent
    chunks, total = [], 0
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts:
            continue  # installed packages differ between machines; the standard library does not
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    return torch.frombuffer(bytearray(b"".join(chunks)[:max_bytes]), dtype=torch.uint8).long()


def get_batch(data: torch.Tensor, batch: int, seq: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    ix = torch.randint(len(data) - seq - 1, (batch,), generator=gen)
    x = torch.stack([data[i:i + seq] for i in ix.tolist()])
    y = torch.stack([data[i + 1:i + 1 + seq] for i in ix.tolist()])
    return x, y


@torch.no_grad()
def val_loss(model: nn.Module, data: torch.Tensor, batch: int, seq: int, batches: int = 8) -> float:
    gen = torch.Generator().manual_seed(1234)  # the same validation batches every time
    model.eval()
    losses = [model(*get_batch(data, batch, seq, gen)).item() for _ in range(batches)]
    model.train()
    return sum(losses) / len(losses)


# Main --------------------------------------------------------------------------------------------


def plan_step(args: argparse.Namespace, model: nn.Module, opt: torch.optim.Optimizer, train: torch.Tensor,
              budget: int) -> tuple[nn.Module, int, int]:
    """(module to train, micro-batch, accumulation steps), planned under `budget`."""
    t0 = time.perf_counter()
    if args.fit:
        sample = (train[:args.seq], train[1:args.seq + 1])  # one example: (input bytes, next bytes)
        cfg = autoremat.fit(model, budget, args.batch, sample, optimizer=opt, compiler=args.compiler)
        print(cfg.report(), "\n")
        plan, micro, steps, opt_model = cfg.plan, cfg.micro_batch, cfg.accumulation_steps, cfg.model
    else:
        x, y = get_batch(train, args.batch, args.seq, torch.Generator().manual_seed(0))
        opt_model = autoremat.optimize(model, budget, example_inputs=(x, y), optimizer=opt, compiler=args.compiler)
        plan, micro, steps = opt_model.plan, args.batch, 1
    print("\n".join(plan.summary().splitlines()[:4]))
    print(f"(planned in {time.perf_counter() - t0:.1f} s)\n")
    return opt_model, micro, steps


def measured_line(what: str, peak: int, budget: int) -> str:
    verdict = "within the budget" if peak <= budget else f"OVER the budget by {autoremat.format_bytes(peak - budget)}"
    return f"{what:<48} {autoremat.format_bytes(peak):>10}  {verdict}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=120, help="optimizer steps")
    p.add_argument("--batch", type=int, default=32, help="sequences per optimizer step")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--d", type=int, default=128)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--budget", default=None, help='absolute budget, e.g. "80MB" (default: see --budget-fraction)')
    p.add_argument("--budget-fraction", type=float, default=0.5,
                   help="budget as a fraction of one step on the whole batch with nothing recomputed")
    p.add_argument("--fit", action="store_true",
                   help="let autoremat.fit choose micro-batch and accumulation steps for --batch")
    p.add_argument("--corpus-mb", type=float, default=4.0)
    p.add_argument("--eval-every", type=int, default=25)
    p.add_argument("--compiler", default="auto", choices=("auto", "inductor", "eager"),
                   help="what runs the planned graphs (autoremat.optimize's compiler)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (for logs)")
    args = p.parse_args()
    for name in ("steps", "batch", "seq", "n_layer", "d", "n_head", "eval_every"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be a positive integer, got {getattr(args, name)}")
    if not 0 < args.budget_fraction <= 1:
        p.error(f"--budget-fraction must be in (0, 1], got {args.budget_fraction}")

    t_all = time.perf_counter()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    data = stdlib_corpus(int(args.corpus_mb * 1e6))
    split = int(0.9 * len(data))
    train, val = data[:split], data[split:]
    print(f"corpus: {len(data) / 1e6:.2f} MB of standard-library source ({Path(os.__file__).parent}), "
          f"{len(train) / 1e6:.2f} MB train / {len(val) / 1e6:.2f} MB validation", flush=True)

    model = GPT(args.n_layer, args.d, args.n_head, args.seq)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    n_params = sum(p.numel() for p in model.parameters())
    sample = (train[:args.seq], train[1:args.seq + 1])

    print(f"model: {n_params / 1e6:.2f} M parameters, {args.n_layer} layers, {args.d} wide, seq {args.seq}, "
          f"batch {args.batch}", flush=True)
    # What one step on the whole batch needs when nothing is recomputed (a meta plan: cheap).
    whole = plan_candidates(model, 10**15, args.batch, sample, optimizer=opt, micro_batches=[args.batch])[0]
    budget = int(args.budget_fraction * whole.no_recompute_peak) if args.budget is None else \
        autoremat.parse_budget(args.budget)
    print(f"one step with nothing recomputed needs {autoremat.format_bytes(whole.no_recompute_peak)}; "
          f"budget {autoremat.format_bytes(budget)} ({100 * budget / whole.no_recompute_peak:.0f}%)\n")

    opt_model, micro, accum = plan_step(args, model, opt, train, budget)
    gen = torch.Generator().manual_seed(0)

    def train_step(m: nn.Module, optimizer_step: bool = True) -> float:
        loss_sum = 0.0
        for _ in range(accum):
            x, y = get_batch(train, micro, args.seq, gen)
            loss = m(x, y) / accum  # mean over the whole batch
            loss.backward()
            loss_sum += loss.item()
        if optimizer_step:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
        return loss_sum

    tokens_per_step = args.batch * args.seq
    print(f"step {0:>4}: val loss {val_loss(model, val, micro, args.seq):.4f}")
    bar = None
    if not args.no_progress:
        try:  # a progress bar where tqdm is installed; plain lines where it is not
            from tqdm import tqdm
        except ImportError:
            tqdm = None
        if tqdm is not None:
            bar = tqdm(total=args.steps, unit="step", dynamic_ncols=True)
    out = bar.write if bar is not None else (lambda msg: print(msg, flush=True))
    measured = eager = None
    t_start = time.perf_counter()
    for step in range(1, args.steps + 1):
        lr = args.lr * min(1.0, step / 20) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / args.steps)))
        for g in opt.param_groups:
            g["lr"] = lr
        if step == min(2, args.steps):  # the AdamW state exists from step 2 on: the steady state
            # The batch is drawn inside the step, so what is live before it is the model and the AdamW state.
            loss_sum, measured = autoremat.measure_peak(lambda: train_step(opt_model), baseline_objs=(model, opt))
            # The same forward and backward without autoremat (no optimizer step: the model is unchanged).
            _, eager = autoremat.measure_peak(lambda: train_step(model, optimizer_step=False),
                                              baseline_objs=(model, opt))
            model.zero_grad(set_to_none=True)
        else:
            loss_sum = train_step(opt_model)
        tok_s = step * tokens_per_step / (time.perf_counter() - t_start)
        if bar is not None:
            bar.set_postfix(loss=f"{loss_sum:.3f}", tok_s=f"{tok_s:,.0f}")
            bar.update()
        if step % args.eval_every == 0 or step == args.steps:
            out(f"step {step:>4}: train loss {loss_sum:.4f}, val loss {val_loss(model, val, micro, args.seq):.4f}, "
                f"{tok_s:,.0f} tok/s")
    if bar is not None:
        bar.close()
    print(f"\n{args.steps} steps in {time.perf_counter() - t_start:.1f} s (planning and all: "
          f"{time.perf_counter() - t_all:.1f} s)\n")
    assert measured is not None and eager is not None
    print(f"budget {autoremat.format_bytes(budget)}; peak of one training step (forward, backward, clip, AdamW "
          f"step), with the model, its gradients and the AdamW state:")
    print(measured_line("predicted by autoremat", opt_model.plan.predicted_peak, budget))
    print(measured_line(f"measured, autoremat (step {min(2, args.steps)})", measured.peak_bytes, budget))
    print(measured_line("measured, without autoremat (forward, backward)", eager.peak_bytes, budget))


if __name__ == "__main__":
    main()
