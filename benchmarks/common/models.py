"""The models and sizes that several benchmark scripts run (part of the shared module `common`; this file
imports no script). The stack, GPT-2, Llama and GPT-2 small builders live in examples/models.py.

  bert, vit, resnet, gqa_decoder    the models floor.py adds to examples/models.py's (HF configs, no download)
  FLOOR_SIZES, floor_configs        floor.py's eight models at its --quick and default sizes (also run by
                                    drift.py, fx_overhead.py, live_at_peak.py, scratch_survey.py, ...)
  speed_configs                     speed.py's stack and launch-bound GPT-2 (also dropout_gap.py's and the
                                    inductor_*.py scripts')
  SCALE_MODELS                      precision_at_scale.py's GPT-2 small and 7B Llama shape, built on meta
  LORA_SIZES, LORA_BATCH, lora_step lora.py's LoRA GPT-2 with its batch and AdamW (also inductor_buffers.py's and
                                    floor_search.py's)
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from examples.models import gpt2, llama, transformer_stack

# --------------------------------------------------------------------------------------------
# floor.py's models


def bert(batch: int, seq: int, n_layer: int, hidden: int, heads: int, vocab: int, dropout: float = 0.1):
    """HF BERT masked-LM encoder from a config (no download), dropout on, labels = the input ids."""
    from transformers import BertConfig, BertForMaskedLM

    cfg = BertConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=n_layer, num_attention_heads=heads,
                     intermediate_size=4 * hidden, max_position_embeddings=max(seq, 64),
                     hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout, use_cache=False)
    ids = torch.randint(0, vocab, (batch, seq))
    return BertForMaskedLM(cfg), {"input_ids": ids, "labels": ids}


def vit(batch: int, image: int, patch: int, n_layer: int, hidden: int, heads: int, classes: int = 10,
        dropout: float = 0.1):
    """HF ViT image classifier from a config (no download), dropout on."""
    from transformers import ViTConfig, ViTForImageClassification

    cfg = ViTConfig(image_size=image, patch_size=patch, num_channels=3, hidden_size=hidden,
                    num_hidden_layers=n_layer, num_attention_heads=heads, intermediate_size=4 * hidden,
                    hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout, num_labels=classes)
    return ViTForImageClassification(cfg), {"pixel_values": torch.randn(batch, 3, image, image),
                                            "labels": torch.randint(0, classes, (batch,))}


class ResidualBlock(nn.Module):
    """conv-BN-ReLU-dropout-conv-BN, added to its input."""

    def __init__(self, channels: int, dropout: float) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(channels, channels, 3, padding=1), nn.BatchNorm2d(channels), nn.ReLU(),
                                  nn.Dropout(dropout), nn.Conv2d(channels, channels, 3, padding=1),
                                  nn.BatchNorm2d(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(x + self.body(x))


class ResNetDropout(nn.Module):
    """A ResNet-shaped conv net: stem, residual blocks (module paths `blocks.3`), pooled linear head."""

    def __init__(self, channels: int, n_block: int, classes: int, dropout: float) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, channels, 3, padding=1), nn.BatchNorm2d(channels), nn.ReLU())
        self.blocks = nn.ModuleList(ResidualBlock(channels, dropout) for _ in range(n_block))
        self.head = nn.Linear(channels, classes)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return F.cross_entropy(self.head(x.mean(dim=(2, 3))), y)


def resnet(batch: int, size: int, channels: int, n_block: int, classes: int = 10, dropout: float = 0.1):
    return ResNetDropout(channels, n_block, classes, dropout), (torch.randn(batch, 3, size, size),
                                                               torch.randint(0, classes, (batch,)))


def gqa_decoder(batch: int, seq: int, n_layer: int, hidden: int, heads: int, kv_heads: int, vocab: int):
    """HF Llama causal LM from a config (no download) with grouped-query attention: `kv_heads` K/V heads, each
    repeated to heads // kv_heads query heads (HF's repeat_kv), RoPE, RMSNorm; a held-out shape the planner was not tuned on.
    The MLP width follows examples/models.llama (8/3 x hidden, rounded down to a multiple of 8)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=int(hidden * 8 / 3) // 8 * 8,
                      num_hidden_layers=n_layer, num_attention_heads=heads, num_key_value_heads=kv_heads,
                      max_position_embeddings=max(seq, 64), use_cache=False)
    ids = torch.randint(0, vocab, (batch, seq))
    return LlamaForCausalLM(cfg), {"input_ids": ids, "labels": ids}


FLOOR_SIZES = {  # name: (factory, --quick sizes, default sizes)
    "stack": (transformer_stack, dict(n_layer=4, d=128, n_head=4, seq=64, batch=4, dropout=0.1),
              dict(n_layer=12, d=256, n_head=4, seq=128, batch=4, dropout=0.1)),
    "gpt2": (gpt2, dict(n_layer=2, n_embd=128, n_head=4, seq=64, batch=4, vocab=1024, dropout=0.1),
             dict(n_layer=4, n_embd=256, n_head=4, seq=128, batch=8, vocab=4096, dropout=0.1)),
    "llama": (llama, dict(n_layer=2, hidden=128, heads=4, seq=64, batch=4, vocab=1024),
              dict(n_layer=4, hidden=256, heads=4, seq=128, batch=4, vocab=4096)),
    "bert": (bert, dict(n_layer=2, hidden=128, heads=4, seq=64, batch=4, vocab=1024),
             dict(n_layer=4, hidden=256, heads=4, seq=128, batch=4, vocab=4096)),
    "vit": (vit, dict(n_layer=2, hidden=128, heads=4, image=32, patch=8, batch=4),
            dict(n_layer=6, hidden=256, heads=4, image=64, patch=8, batch=8)),
    "resnet": (resnet, dict(channels=16, n_block=4, size=16, batch=4), dict(channels=32, n_block=8, size=32, batch=8)),
    # a GPT-2 whose loss region (a 32k vocabulary) outweighs its blocks
    "gpt2-32k": (gpt2, dict(n_layer=2, n_embd=64, n_head=4, seq=64, batch=2, vocab=32768, dropout=0.1),
                 dict(n_layer=2, n_embd=128, n_head=4, seq=128, batch=4, vocab=32768, dropout=0.1)),
    # held out: a deeper decoder with grouped-query attention (4 query heads sharing 2 K/V heads), 4 x 128 tokens
    "gqa-decoder": (gqa_decoder, dict(n_layer=2, hidden=64, heads=4, kv_heads=2, seq=64, batch=2, vocab=1024),
                    dict(n_layer=6, hidden=128, heads=4, kv_heads=2, seq=128, batch=4, vocab=1024)),
}


def floor_configs(quick: bool) -> list[dict]:
    return [dict(name=name, factory=factory, kwargs=small if quick else default)
            for name, (factory, small, default) in FLOOR_SIZES.items()]


# --------------------------------------------------------------------------------------------
# speed.py's models


def speed_configs(quick: bool, dropout: float) -> list[dict]:
    if quick:
        return [
            dict(name="stack", factory=transformer_stack,
                 kwargs=dict(n_layer=2, d=128, n_head=4, seq=64, batch=4, dropout=dropout)),
            dict(name="gpt2", factory=gpt2, outputs="loss",
                 kwargs=dict(n_layer=2, n_embd=32, n_head=4, seq=8, batch=2, vocab=256, dropout=dropout)),
        ]
    return [
        # a stack (6 layers, d=256, seq 128, batch 4) and a launch-bound GPT-2 (4 layers, d=32, 8 tokens)
        dict(name="stack", factory=transformer_stack,
             kwargs=dict(n_layer=6, d=256, n_head=4, seq=128, batch=4, dropout=dropout)),
        dict(name="gpt2", factory=gpt2, outputs="loss",
             kwargs=dict(n_layer=4, n_embd=32, n_head=4, seq=8, batch=2, vocab=256, dropout=dropout)),
    ]


# --------------------------------------------------------------------------------------------
# precision_at_scale.py's models, on meta: (model, inputs, label)


def gpt2_small_meta():
    from examples.models import gpt2_small as factory

    with torch.device("meta"):
        model, inputs = factory(batch=8, seq=1024)
    return model, inputs, "GPT-2 small (124M), batch 8 x 1024"


def llama_7b():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=2048, use_cache=False)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
        ids = torch.randint(0, cfg.vocab_size, (1, 2048))
    return model, {"input_ids": ids, "labels": ids}, "Llama 7B shape (6.74B), batch 1 x 2048"


SCALE_MODELS = {"gpt2-small": gpt2_small_meta, "llama-7b": llama_7b}


# --------------------------------------------------------------------------------------------
# lora.py's model

LORA_SIZES = dict(n_layer=4, d=128, n_head=4, vocab=4096, seq=128, r=8, dropout=0.1)
LORA_BATCH = 8


def lora_step():
    """examples/lora.py's GPT-2 with its LoRA adapter, the same every time (seeded), its batch (the labels are
    the input ids), and AdamW over its trainable parameters."""
    from examples.lora import lora_gpt2

    model = lora_gpt2(**LORA_SIZES, seed=0)
    ids = torch.randint(0, LORA_SIZES["vocab"], (LORA_BATCH, LORA_SIZES["seq"]), generator=torch.Generator().manual_seed(1))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    return model, {"input_ids": ids, "labels": ids.clone()}, opt


# --------------------------------------------------------------------------------------------
# plan_time.py --cliff's small heads (what planning does after a real step measures a miss)


def head_lm(batch: int, seq: int, vocab: int, d: int, bias: bool, gate: bool):
    """tests/models.py's HeadLM (the model tests/test_chunk_count.py plans at its floor) and its batch."""
    from tests.models import HeadLM

    ids = torch.randint(0, vocab, (batch, seq))
    return HeadLM(vocab, d, bias, gate), {"ids": ids, "labels": ids}
