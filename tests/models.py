"""Small models that several test files share: HF models built from config (no downloads), and a
vocabulary head with eager code before it (also plan_time.py --cliff's `gated` and `biased`)."""

import functools

import torch
import torch.nn as nn
import torch.nn.functional as F


@torch._dynamo.disable
def eager_gate(x: torch.Tensor) -> torch.Tensor:
    """Runs outside every graph: autograd saves x and sigmoid(x), which no graph's plan holds; the ledger counts
    them from the planning trace's forward (capture/tracing.eager_saved_bytes)."""
    return torch.sigmoid(x) * x


class _ScratchInBackward(torch.autograd.Function):
    """The identity, whose backward allocates `elements` floats of scratch (as a kernel's workspace would):
    memory no trace sees, that only a real step measures."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, elements: int) -> torch.Tensor:
        ctx.elements = elements
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        scratch = torch.zeros(ctx.elements, dtype=grad.dtype)
        return grad + scratch[0], None


@torch._dynamo.disable
def scratch_in_backward(x: torch.Tensor, elements: int) -> torch.Tensor:
    return _ScratchInBackward.apply(x, elements)


class HeadLM(nn.Module):
    """An embedding, a tanh trunk, a vocabulary projection and mean cross-entropy; returns the loss only.
    gate: `eager_gate` between the trunk and the head; bias: on the projection; scratch: that many floats
    `scratch_in_backward` allocates there in the backward."""

    def __init__(self, vocab: int, d: int, bias: bool, gate: bool, scratch: int = 0) -> None:
        super().__init__()
        self.vocab, self.gate, self.scratch = vocab, gate, scratch
        self.embed, self.trunk, self.head = nn.Embedding(vocab, d), nn.Linear(d, d), nn.Linear(d, vocab, bias=bias)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.trunk(self.embed(ids)))
        h = eager_gate(h) if self.gate else h
        h = scratch_in_backward(h, self.scratch) if self.scratch else h
        return F.cross_entropy(self.head(h).view(-1, self.vocab), labels.view(-1))


def tiny_llama(vocab: int = 128, d: int = 64, seq: int = 64, layers: int = 2, intermediate: int = 176,
               heads: int = 4, device: str | None = None):
    """A Llama with `layers` layers and a batch of one `seq`-token sequence whose labels are its ids.
    Seeded, so every caller with the same arguments gets the same weights and tokens."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=d, intermediate_size=intermediate, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=seq,
                      use_cache=False)
    with torch.device(device or "cpu"):
        model = LlamaForCausalLM(cfg)
        ids = torch.randint(0, vocab, (1, seq))
    return model, {"input_ids": ids, "labels": ids}


@functools.cache
def bf16_attention_problem() -> str:
    """Why torch's own bf16 scaled_dot_product_attention cannot run on this CPU, or "" where it runs.

    torch 2.13's CPU flash-attention kernel picks its bf16 packing (pack_vnni2) from the hardware (AVX-512
    with bf16) but checks it against the dispatch capability, so with ATEN_CPU_CAPABILITY=default on such a
    CPU eager PyTorch raises on a bf16 attention before autoremat is involved. A bf16 attention test there
    has no eager reference to compare with. The kernel packs only past a few rows: 4 rows ran, 64 did not."""
    q = torch.ones(1, 1, 128, 32, dtype=torch.bfloat16)
    try:
        F.scaled_dot_product_attention(q, q, q)
    except RuntimeError as e:
        return f"eager bf16 scaled_dot_product_attention fails here: {e}"
    return ""
