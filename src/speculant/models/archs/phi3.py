"""Phi-3 and Phi-4-mini: Llama with the q / k / v projections stored as one tensor and
the gate / up projections as one, heads that may rotate only part of their dimensions
(Phi-4-mini: 3/4), and LongRoPE's short and long frequency factors.

The sliding window of a config (Phi-3-mini: 2047) is applied to every layer, as
transformers applies it; llama.cpp ignores it (its Phi-3 graph turns the window off), so
after that many tokens its text may differ from the authors'.
"""

from __future__ import annotations

from typing import Any

from speculant.models.archs.base import Arch, Fields, gguf_rope, hf_rope, window_on_every_layer


def _rotary(out: dict[str, Any], rope_dim: int) -> None:
    out["rope_dim"] = 0 if rope_dim == out["head_dim"] else rope_dim


def hf(f: Fields, out: dict[str, Any]) -> None:
    if f.get("attention_bias"):
        raise f.refuse("attention_bias", True, "false (no projection biases)")
    params = f.get("rope_parameters")
    nested = params.get("partial_rotary_factor") if isinstance(params, dict) else None
    factor = float(nested or f.get("partial_rotary_factor", 1.0))
    rope_dim = int(out["head_dim"] * factor)
    if rope_dim % 2 or not 0 < rope_dim <= out["head_dim"]:
        raise f.refuse("partial_rotary_factor", factor, "a share of the head of an even size")
    _rotary(out, rope_dim)
    f.get("original_max_position_embeddings")  # read by a LongRoPE scaling
    out.update(hf_rope(f, rope_dim).fields())
    window_on_every_layer(f, out, "sliding_window")


def gguf(f: Fields, out: dict[str, Any], index: Any) -> None:
    rope_dim = out["rope_dim"] or out["head_dim"]
    out.update(gguf_rope(f, index, rope_dim).fields())
    window_on_every_layer(f, out, "attention.sliding_window")  # 0: none


ARCH = Arch(
    "phi3",
    ("phi3",),
    hf,
    gguf,
    partial_rotary=True,
    hf_names={
        "qkv": "model.layers.{i}.self_attn.qkv_proj.weight",
        "gate_up": "model.layers.{i}.mlp.gate_up_proj.weight",
    },
    gguf_names={"qkv": "blk.{i}.attn_qkv.weight", "gate_up": "blk.{i}.ffn_up.weight"},
)
