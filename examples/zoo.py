"""The model zoo: real Hugging Face models of many families, each built from a small config of its own (no
download), with a batch that carries its own labels, so `model(**batch).loss` is the training loss.

    model, batch = build("gemma2")                # the zoo's size: 4 layers, hidden 128, 4 x 128 tokens
    model, batch = build("gemma2", size=TINY)     # the quick size the tests plan

Every decoder family has the same shape where its config allows: 4 layers, hidden 128, 4 heads (2 key/value
heads where the family has them), MLP 384, vocabulary 2,048, fp32. `OVERRIDES` says where a family departs
from it and why. Mixture-of-experts families get 4 experts, 2 per token. `lora(model)` wraps a model in a
PEFT LoRA adapter (r=8 on every linear layer but the output layer).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, replace

import torch


@dataclass(frozen=True)
class Size:
    """A zoo model's shape: the decoder's, and the batch the step runs."""

    layers: int = 4
    hidden: int = 128
    heads: int = 4
    kv_heads: int = 2
    mlp: int = 384
    vocab: int = 2048
    batch: int = 4
    tokens: int = 128
    image: int = 64  # vision models: image side, pixels


ZOO_SIZE = Size()
TINY = Size(layers=2, hidden=64, heads=4, kv_heads=2, mlp=128, vocab=512, batch=2, tokens=32, image=32)

DECODERS = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi", "phi3", "olmo", "olmo2",
            "starcoder2", "stablelm", "gpt_neox", "gptj", "falcon", "bloom", "gpt2", "opt", "cohere", "granite",
            "glm", "helium", "smollm3", "codegen", "gpt_bigcode", "ernie4_5", "exaone4", "seed_oss")
MOE = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "granitemoe", "deepseek_v3")
ENCODERS = ("bert", "roberta", "deberta-v2", "electra")
SEQ2SEQ = ("t5", "bart")
VISION = ("vit", "swin", "convnext", "resnet")
CAUSAL = DECODERS + MOE
FAMILIES = CAUSAL + ENCODERS + SEQ2SEQ + VISION


def _moe(s: Size) -> dict:
    """4 experts, 2 per token, each expert a quarter of the dense MLP's width again (so the layer's
    parameters stay near a dense one's)."""
    expert = max(s.mlp // 2, 32)
    return dict(num_local_experts=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=expert,
                shared_expert_intermediate_size=expert, n_routed_experts=4, n_shared_experts=1)


def _decoder_config(family: str, s: Size) -> dict:
    head_dim = s.hidden // s.heads
    kw = dict(num_hidden_layers=s.layers, hidden_size=s.hidden, num_attention_heads=s.heads,
              num_key_value_heads=s.kv_heads, intermediate_size=s.mlp, vocab_size=s.vocab,
              max_position_embeddings=max(2 * s.tokens, 256), pad_token_id=0, bos_token_id=1, eos_token_id=2)
    kw.update(OVERRIDES.get(family, lambda s, d: {})(s, head_dim))
    if family in MOE:
        kw = {**_moe(s), **kw}
    return kw


# Where a family's config needs more than the common shape to build at it, and why.
OVERRIDES = {
    # these set head_dim to a fixed default (256 or 128) rather than hidden / heads
    **{f: (lambda s, d: dict(head_dim=d)) for f in ("gemma", "gemma2", "gemma3_text", "qwen3", "helium", "qwen3_moe",
                                                    "olmoe", "seed_oss", "exaone4", "ernie4_5", "glm", "smollm3")},
    # rotary over part of each head: its default (64) is wider than a head of 32 here
    "gptj": lambda s, d: dict(rotary_dim=d // 2, n_inner=s.mlp),
    "codegen": lambda s, d: dict(rotary_dim=d // 2, n_inner=s.mlp),
    "gpt2": lambda s, d: dict(n_inner=s.mlp),
    "gpt_bigcode": lambda s, d: dict(n_inner=s.mlp),
    "opt": lambda s, d: dict(ffn_dim=s.mlp, word_embed_proj_dim=s.hidden),
    "bloom": lambda s, d: dict(n_head=s.heads),
    "falcon": lambda s, d: dict(new_decoder_architecture=True, num_kv_heads=s.kv_heads),
    # rotary runs over head_dim, which this family takes to be qk_rope_head_dim
    "deepseek_v3": lambda s, d: dict(head_dim=d // 2, q_lora_rank=None, kv_lora_rank=d, qk_rope_head_dim=d // 2,
                                     qk_nope_head_dim=d // 2, v_head_dim=d, first_k_dense_replace=1, n_group=1,
                                     topk_group=1, rope_interleave=False),
}


def build(family: str, size: Size = ZOO_SIZE, seed: int = 0) -> tuple[torch.nn.Module, dict]:
    """A freshly initialised `family` model in training mode, and a batch with labels, on CPU in fp32."""
    import transformers as T

    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed + 1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if family in CAUSAL:
            model = T.AutoModelForCausalLM.from_config(T.AutoConfig.for_model(family, **_decoder_config(family, size)))
            ids = torch.randint(3, size.vocab, (size.batch, size.tokens), generator=gen)
            return model.train(), {"input_ids": ids, "labels": ids.clone()}
        if family in ENCODERS:
            cfg = T.AutoConfig.for_model(family, num_hidden_layers=size.layers, hidden_size=size.hidden,
                                         num_attention_heads=size.heads, intermediate_size=size.mlp,
                                         vocab_size=size.vocab, max_position_embeddings=max(2 * size.tokens, 256),
                                         **({"embedding_size": size.hidden} if family == "electra" else {}))
            model = T.AutoModelForMaskedLM.from_config(cfg)
            ids = torch.randint(5, size.vocab, (size.batch, size.tokens), generator=gen)
            labels = torch.where(torch.rand(ids.shape, generator=gen) < 0.15, ids, -100)
            return model.train(), {"input_ids": ids, "labels": labels}
        if family in SEQ2SEQ:
            if family == "t5":
                cfg = T.T5Config(num_layers=size.layers, num_decoder_layers=size.layers, d_model=size.hidden,
                                 num_heads=size.heads, d_kv=size.hidden // size.heads, d_ff=size.mlp,
                                 vocab_size=size.vocab, decoder_start_token_id=0)
            else:
                cfg = T.BartConfig(encoder_layers=size.layers, decoder_layers=size.layers, d_model=size.hidden,
                                   encoder_attention_heads=size.heads, decoder_attention_heads=size.heads,
                                   encoder_ffn_dim=size.mlp, decoder_ffn_dim=size.mlp, vocab_size=size.vocab,
                                   max_position_embeddings=max(2 * size.tokens, 256))
            model = T.AutoModelForSeq2SeqLM.from_config(cfg)
            ids = torch.randint(5, size.vocab, (size.batch, size.tokens), generator=gen)
            labels = torch.randint(5, size.vocab, (size.batch, size.tokens // 2), generator=gen)
            return model.train(), {"input_ids": ids, "labels": labels}
        if family in VISION:
            model = T.AutoModelForImageClassification.from_config(_vision_config(family, size))
            pixels = torch.randn(size.batch, 3, size.image, size.image, generator=gen)
            labels = torch.randint(0, 10, (size.batch,), generator=gen)
            return model.train(), {"pixel_values": pixels, "labels": labels}
    raise ValueError(f"unknown zoo family {family!r}; the zoo has: {', '.join(FAMILIES)}")


def _vision_config(family: str, s: Size):
    import transformers as T

    if family == "vit":
        return T.ViTConfig(image_size=s.image, patch_size=8, num_hidden_layers=s.layers, hidden_size=s.hidden,
                           num_attention_heads=s.heads, intermediate_size=s.mlp, num_labels=10,
                           hidden_dropout_prob=0.1)
    if family == "swin":
        return T.SwinConfig(image_size=s.image, patch_size=4, embed_dim=32, depths=[2, 2], num_heads=[2, 4],
                            window_size=4, num_labels=10)
    if family == "convnext":
        return T.ConvNextConfig(image_size=s.image, hidden_sizes=[32, 64, 128], depths=[2, 2, 2], num_stages=3,
                                num_labels=10)
    return T.ResNetConfig(embedding_size=32, hidden_sizes=[32, 64, 128], depths=[1, 1, 1], layer_type="basic",
                          num_labels=10)


def lora(model: torch.nn.Module, r: int = 8) -> torch.nn.Module:
    """`model` wrapped in a PEFT LoRA adapter on every linear layer but the output layer, dropout 0.1."""
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(r=r, lora_alpha=2 * r, lora_dropout=0.1, target_modules="all-linear"))


def sized(**changes) -> Size:
    """The zoo's size with some fields changed."""
    return replace(ZOO_SIZE, **changes)
