"""Llama (2, 3, 3.1+ with its rope scaling), Mistral, and the many models built on them.

GGUF files of this architecture hold Q / K rows interleaved for llama.cpp's rope, and a
Llama 3.1-style scaling as a `rope_freqs.weight` tensor of per-frequency divisors.
"""

from __future__ import annotations

from typing import Any

from speculant.models.archs.base import Arch, Fields, gguf_rope, hf_rope, window_on_every_layer


def hf(f: Fields, out: dict[str, Any]) -> None:
    if f.get("attention_bias"):
        raise f.refuse("attention_bias", True, "false (no projection biases)")
    if f.get("mlp_bias"):
        raise f.refuse("mlp_bias", True, "false (no projection biases)")
    out.update(hf_rope(f, out["head_dim"]).fields())
    window_on_every_layer(f, out, "sliding_window")


def gguf(f: Fields, out: dict[str, Any], index: Any) -> None:
    out.update(gguf_rope(f, index, out["head_dim"]).fields())
    window_on_every_layer(f, out, "attention.sliding_window")


ARCH = Arch(
    "llama",
    ("llama", "mistral"),
    hf,
    gguf,
    gguf_qk_interleaved=True,
    eagle_class="LlamaForCausalLMEagle",
)
