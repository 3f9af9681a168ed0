"""Tiny random models built in code (no downloads): transformers' own classes, saved as
Hugging Face folders, so our loader and decoder are checked against the reference."""

from __future__ import annotations

from pathlib import Path

import torch

TINY = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
)


def hf_model(arch: str, seed: int = 0, **overrides):  # type: ignore[no-untyped-def]
    import transformers as tf

    torch.manual_seed(seed)
    kw = {**TINY, **overrides}
    if arch == "llama":
        cfg = tf.LlamaConfig(**kw, head_dim=16, tie_word_embeddings=True)
        model = tf.LlamaForCausalLM(cfg)
    elif arch == "qwen2":
        cfg = tf.Qwen2Config(**kw, tie_word_embeddings=False)
        model = tf.Qwen2ForCausalLM(cfg)
    elif arch == "gemma3":
        cfg = tf.Gemma3TextConfig(
            **kw,
            head_dim=16,
            query_pre_attn_scalar=16,
            sliding_window=8,
            layer_types=[
                "full_attention" if i % 2 else "sliding_attention"
                for i in range(kw["num_hidden_layers"])
            ],
        )
        model = tf.Gemma3ForCausalLM(cfg)
        # Gemma's norms start at zero (multiplier 1): make them non-trivial.
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.normal_(0.0, 0.3)
    else:
        raise ValueError(arch)
    with torch.no_grad():  # larger weights: sharper, more varied distributions
        for name, p in model.named_parameters():
            if "norm" not in name and p.dim() == 2:
                p.mul_(2.5)
    return model.eval()


def save_tiny(arch: str, path: Path, seed: int = 0, **overrides) -> Path:  # type: ignore[no-untyped-def]
    model = hf_model(arch, seed, **overrides)
    model.save_pretrained(path)
    return path
