"""Qwen2 and Qwen2.5: Llama with biases on the q, k and v projections."""

from __future__ import annotations

from typing import Any

from speculant.models.archs.base import Arch, Fields, gguf_rope, hf_rope


def hf(f: Fields, out: dict[str, Any]) -> None:
    if f.get("use_sliding_window"):
        raise f.refuse("use_sliding_window", True, "false (no sliding-window layers)")
    f.get("sliding_window")  # unused while use_sliding_window is false
    f.get("max_window_layers")
    out.update(hf_rope(f, out["head_dim"]).fields(), qkv_bias=True)


def gguf(f: Fields, out: dict[str, Any], index: Any) -> None:
    out.update(gguf_rope(f, index, out["head_dim"]).fields(), qkv_bias=True)


ARCH = Arch("qwen2", ("qwen2",), hf, gguf, eagle_class="Qwen2ForCausalLMEagle")
