"""OLMo 2: no norms before attention and the MLP but one after each (before the residual
add), and RMSNorms of the whole query and key projections (all heads at once) before
they are split into heads and rotated."""

from __future__ import annotations

from typing import Any

from speculant.models.archs.base import Arch, Fields, gguf_rope, hf_rope

_SHARED = dict(pre_norm=False, sandwich_norm=True, qk_norm=True, qk_norm_all_heads=True)


def hf(f: Fields, out: dict[str, Any]) -> None:
    if f.get("attention_bias"):
        raise f.refuse("attention_bias", True, "false (no projection biases)")
    out.update(hf_rope(f, out["head_dim"]).fields(), **_SHARED)


def gguf(f: Fields, out: dict[str, Any], index: Any) -> None:
    out.update(gguf_rope(f, index, out["head_dim"]).fields(), **_SHARED)


ARCH = Arch(
    "olmo2",
    ("olmo2",),
    hf,
    gguf,
    hf_names={
        "post_attn_norm": "model.layers.{i}.post_attention_layernorm.weight",
        "post_ffn_norm": "model.layers.{i}.post_feedforward_layernorm.weight",
    },
)
