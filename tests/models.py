"""Small HF models built from config (no downloads) that several test files share."""

import torch


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
