"""Tiny random models built in code (no downloads): transformers' own classes, saved as
Hugging Face folders, so our loader and decoder are checked against the reference."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from speculant.models.model import Model

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


CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "the quick brown fox jumps over the lazy dog",
    "copy this list: red, green, blue, red, green, blue",
]


def tiny_chat_model(path: Path, seed: int, layers: int) -> Model:
    """A tiny random llama with a small trained BPE tokenizer and a ChatML template."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    from speculant.models.model import load_model

    save_tiny(
        "llama",
        path,
        seed=seed,
        vocab_size=300,
        num_hidden_layers=layers,
        max_position_embeddings=1024,  # room for layer-skip's calibration text
    )
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=290,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 5, trainer)
    tok.save(str(path / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>",
        "chat_template": CHATML,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    model = load_model(path, dtype="float32", progress=False)
    assert model.tokenizer is not None and model.tokenizer.chat_template
    return model
