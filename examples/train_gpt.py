"""Train a small byte-level GPT on the Python standard library's source, under a byte budget.

    python examples/train_gpt.py                       # ~3 min on a 2-core CPU
    python examples/train_gpt.py --steps 50 --budget 60MB

`autoremat.fit` picks the micro-batch and accumulation steps for the global batch: it plans every
divisor of the global batch on a meta-device twin of the model, keeps the fastest that fits the
budget, and plans that one for real. By default the budget is 70% of what one no-recompute step on
the whole global batch needs, so fitting it takes either recomputation or accumulation.
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
from autoremat.fit import fit, plan_candidates  # noqa: E402

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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=150, help="optimizer steps (global batches)")
    p.add_argument("--global-batch", type=int, default=32)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--d", type=int, default=128)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--budget", default=None, help='absolute budget, e.g. "60MB" (default: see --budget-fraction)')
    p.add_argument("--budget-fraction", type=float, default=0.7,
                   help="budget as a fraction of one no-recompute step on the whole global batch")
    p.add_argument("--corpus-mb", type=float, default=4.0)
    p.add_argument("--eval-every", type=int, default=25)
    p.add_argument("--no-progress", action="store_true", help="no progress bar (for logs)")
    args = p.parse_args()

    torch.set_num_threads(1)
    torch.manual_seed(0)
    data = stdlib_corpus(int(args.corpus_mb * 1e6))
    split = int(0.9 * len(data))
    train, val = data[:split], data[split:]
    print(f"corpus: {len(data) / 1e6:.2f} MB of standard-library source ({Path(os.__file__).parent}), "
          f"{len(train) / 1e6:.2f} MB train / {len(val) / 1e6:.2f} MB validation")

    model = GPT(args.n_layer, args.d, args.n_head, args.seq)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    n_params = sum(p.numel() for p in model.parameters())
    sample = (train[:args.seq], train[1:args.seq + 1])  # one example: (input bytes, next bytes)

    # What one step on the whole global batch needs when nothing is recomputed (a meta plan: cheap).
    whole = plan_candidates(model, 10**15, args.global_batch, sample, optimizer=opt,
                            micro_batches=[args.global_batch])[0]
    if args.budget is None:
        budget = int(args.budget_fraction * whole.no_recompute_peak)
    else:
        budget = autoremat.parse_budget(args.budget)
    print(f"model: {n_params / 1e6:.2f} M parameters, {args.n_layer} layers, {args.d} wide, seq {args.seq}")
    print(f"one no-recompute step on the global batch of {args.global_batch} needs "
          f"{autoremat.format_bytes(whole.no_recompute_peak)}; budget {autoremat.format_bytes(budget)} "
          f"({100 * budget / whole.no_recompute_peak:.0f}%)\n")

    t0 = time.perf_counter()
    cfg = fit(model, budget, args.global_batch, sample, optimizer=opt)
    print(cfg.report())
    print(f"(fit took {time.perf_counter() - t0:.1f} s)\n")
    print("\n".join(cfg.plan.summary().splitlines()[:4]), "\n")
    chosen = next(c for c in cfg.candidates if c.micro_batch == cfg.micro_batch)
    print(f"chosen micro-batch {cfg.micro_batch}: no-recompute total {autoremat.format_bytes(chosen.no_recompute_peak)}, "
          f"planned peak {autoremat.format_bytes(cfg.plan.predicted_peak)}, budget {autoremat.format_bytes(budget)}\n")

    gen = torch.Generator().manual_seed(0)
    tokens_per_step = args.global_batch * args.seq
    print(f"step {0:>4}: val loss {val_loss(model, val, cfg.micro_batch, args.seq):.4f}")
    bar = None
    if not args.no_progress:
        from tqdm import tqdm

        bar = tqdm(total=args.steps, unit="step", dynamic_ncols=True)
    t_start = time.perf_counter()
    for step in range(1, args.steps + 1):
        lr = args.lr * min(1.0, step / 20) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / args.steps)))
        for g in opt.param_groups:
            g["lr"] = lr
        loss_sum = 0.0
        for _ in range(cfg.accumulation_steps):
            x, y = get_batch(train, cfg.micro_batch, args.seq, gen)
            loss = cfg.model(x, y) / cfg.accumulation_steps  # mean over the global batch
            loss.backward()
            loss_sum += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        tok_s = step * tokens_per_step / (time.perf_counter() - t_start)
        if bar is not None:
            bar.set_postfix(loss=f"{loss_sum:.3f}", tok_s=f"{tok_s:,.0f}")
            bar.update()
        if step % args.eval_every == 0 or step == args.steps:
            msg = f"step {step:>4}: train loss {loss_sum:.4f}, val loss {val_loss(model, val, cfg.micro_batch, args.seq):.4f}, {tok_s:,.0f} tok/s"
            if bar is not None:
                bar.write(msg)
            else:
                print(msg, flush=True)
    if bar is not None:
        bar.close()
    print(f"\n{args.steps} steps in {time.perf_counter() - t_start:.1f} s; planned graphs: "
          f"{len(cfg.model._planner.profiles)} (one per input shape, never re-planned per step)")


if __name__ == "__main__":
    main()
