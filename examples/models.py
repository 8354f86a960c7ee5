"""Small real models for the demo, the tests, the benchmarks and the CLI.

Each factory returns `(model, example_inputs)` where example_inputs is a tuple of positional
arguments or a dict of keyword arguments, and the model returns a scalar loss (or, for
`dict_output`, a dict holding one). Sizes are options so the CLI can plan large shapes:

    autoremat plan examples/models.py:gpt2 --budget 6GB --batch 8 --seq 1024
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class MLP(nn.Module):
    def __init__(self, width: int = 256, depth: int = 6) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = F.gelu(layer(x))
        return self.head(x).square().mean()

class Block(nn.Module):
    """Pre-LN transformer block with dropout, written with plain ops."""

    def __init__(self, d: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.n_head = n_head
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / (k.size(-1) ** 0.5)
        att = self.drop(att.softmax(dim=-1))
        y = (att @ v).transpose(1, 2).reshape(B, T, C)
        x = x + self.drop(self.proj(y))
        return x + self.drop(self.out(F.gelu(self.fc(self.ln2(x)))))

class TransformerStack(nn.Module):
    def __init__(self, n_layer: int = 4, d: int = 128, n_head: int = 4, dropout: float = 0.1) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(d, n_head, dropout) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.ln_f(x).square().mean()

class ConvNet(nn.Module):
    """Conv + BatchNorm + residual blocks, the shape of a small ResNet."""

    def __init__(self, channels: int = 16, blocks: int = 3, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, channels, 3, padding=1), nn.BatchNorm2d(channels), nn.ReLU())
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Conv2d(channels, channels, 3, padding=1), nn.BatchNorm2d(channels), nn.ReLU(inplace=True),
                          nn.Conv2d(channels, channels, 3, padding=1), nn.BatchNorm2d(channels))
            for _ in range(blocks)
        )
        self.head = nn.Linear(channels, classes)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = F.relu(x + block(x))
        return F.cross_entropy(self.head(x.mean(dim=(2, 3))), y)

class DictOutput(nn.Module):
    """Returns a dict and a tuple inside it, like many HF models."""

    def __init__(self, width: int = 128) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(width, width), nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> dict:
        h = torch.tanh(self.a(x))
        out = self.b(h)
        return {"loss": out.square().mean(), "hidden": (h, out)}

def mlp(batch: int = 64, width: int = 256, depth: int = 6):
    return MLP(width, depth), (torch.randn(batch, width),)

def transformer_stack(batch: int = 4, seq: int = 64, n_layer: int = 4, d: int = 128, n_head: int = 4,
                      dropout: float = 0.1):
    return TransformerStack(n_layer, d, n_head, dropout), (torch.randn(batch, seq, d),)

def convnet(batch: int = 8, size: int = 16, channels: int = 16, blocks: int = 3):
    return ConvNet(channels, blocks), (torch.randn(batch, 3, size, size), torch.randint(0, 10, (batch,)))

def dict_output(batch: int = 16, width: int = 128):
    return DictOutput(width), (torch.randn(batch, width),)

def gpt2(batch: int = 2, seq: int = 64, n_layer: int = 2, n_embd: int = 64, n_head: int = 4, vocab: int = 256,
         dropout: float = 0.1):
    """HF transformers GPT-2 built from a config (no download)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=n_head, vocab_size=vocab, n_positions=max(seq, 64),
                     resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout, use_cache=False,
                     bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(cfg)
    model.loss_type = "ForCausalLM"  # else a logging call in the loss breaks the graph
    ids = torch.randint(0, vocab, (batch, seq))
    return model, {"input_ids": ids, "labels": ids}

def gpt2_small(batch: int = 8, seq: int = 1024):
    """GPT-2 small's shape (12 layers, 768 wide, vocab 50257)."""
    return gpt2(batch=batch, seq=seq, n_layer=12, n_embd=768, n_head=12, vocab=50257)

def llama(batch: int = 2, seq: int = 64, n_layer: int = 2, hidden: int = 64, heads: int = 4, vocab: int = 256):
    """HF transformers Llama built from a config (no download)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=int(hidden * 8 / 3) // 8 * 8,
                      num_hidden_layers=n_layer, num_attention_heads=heads, num_key_value_heads=max(1, heads // 2),
                      max_position_embeddings=max(seq, 64), use_cache=False)
    model = LlamaForCausalLM(cfg)
    ids = torch.randint(0, vocab, (batch, seq))
    return model, {"input_ids": ids, "labels": ids}

def loss_of(output) -> torch.Tensor:
    """The scalar loss from any of these models' outputs (tensor, dict, or HF ModelOutput)."""
    if isinstance(output, torch.Tensor):
        return output
    return output["loss"]
