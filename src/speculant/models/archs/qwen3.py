"""Qwen3: Llama with an RMSNorm of each query and key head before the rotary embedding,
no projection biases."""

from __future__ import annotations

from typing import Any

from speculant.models.archs.base import Arch, Fields, gguf_rope, hf_rope


def hf(f: Fields, out: dict[str, Any]) -> None:
    if f.get("attention_bias"):
        raise f.refuse("attention_bias", True, "false (no projection biases)")
    if f.get("use_sliding_window"):
        raise f.refuse("use_sliding_window", True, "false (no sliding-window layers)")
    f.get("sliding_window")  # unused while use_sliding_window is false
    f.get("max_window_layers")
    f.get("layer_types")  # every layer "full_attention" without a sliding window
    out.update(hf_rope(f, out["head_dim"]).fields(), qk_norm=True)


def gguf(f: Fields, out: dict[str, Any], index: Any) -> None:
    out.update(gguf_rope(f, index, out["head_dim"]).fields(), qk_norm=True)


ARCH = Arch("qwen3", ("qwen3",), hf, gguf)
