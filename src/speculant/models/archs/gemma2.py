"""Gemma 2: Gemma 3's layer without q / k norms, with soft-capped attention scores and
final logits, and sliding-window layers (the even ones) between global ones, all with
one rope base.

GGUF files do not store the query scale: llama.cpp takes 1/sqrt(dim / heads) for the
46-layer model (Gemma 2 27B, whose query_pre_attn_scalar is 144) and 1/sqrt(head size)
for any other, and so do we.
"""

from __future__ import annotations

import math
from typing import Any

from speculant.models.archs.base import MAX_CONTEXT, MAX_LAYERS, Arch, Fields, gguf_rope, hf_rope

_HF_NORMS = {
    "post_attn_norm": "model.layers.{i}.post_attention_layernorm.weight",
    "ffn_norm": "model.layers.{i}.pre_feedforward_layernorm.weight",
    "post_ffn_norm": "model.layers.{i}.post_feedforward_layernorm.weight",
}


def _shared(out: dict[str, Any]) -> None:
    out.update(sandwich_norm=True, embed_scale=math.sqrt(out["dim"]), activation="gelu_tanh")


def _layers(n: int, period: int) -> tuple[str, ...]:
    """llama.cpp's and transformers' pattern: the last layer of each period is global."""
    return tuple("full" if (i + 1) % period == 0 else "sliding" for i in range(n))


def hf(f: Fields, out: dict[str, Any]) -> None:
    _shared(out)
    if f.get("attention_bias"):
        raise f.refuse("attention_bias", True, "false (no projection biases)")
    act = f.get("hidden_activation", "gelu_pytorch_tanh")
    if act != "gelu_pytorch_tanh":
        raise f.refuse("hidden_activation", act, "gelu_pytorch_tanh")
    f.get("hidden_act")  # older configs: hidden_activation takes precedence
    layer_types = f.get("layer_types")
    if layer_types:
        kinds = tuple("sliding" if t == "sliding_attention" else "full" for t in layer_types)
    else:
        kinds = _layers(out["n_layers"], 2)
    window = f.count("sliding_window", 0, MAX_CONTEXT, 0)
    out.update(
        hf_rope(f, out["head_dim"]).fields(),
        tie_embeddings=bool(f.get("tie_word_embeddings", True)),
        query_scale=float(f.get("query_pre_attn_scalar", out["head_dim"])) ** -0.5,
        sliding_window=window or None,
        layer_types=kinds if window else (),
        attn_softcap=f.get("attn_logit_softcapping"),
        final_logit_softcap=f.get("final_logit_softcapping"),
    )


def gguf(f: Fields, out: dict[str, Any], index: Any) -> None:
    _shared(out)
    period = f.count("attention.sliding_window_pattern", 1, MAX_LAYERS, 2)
    base = gguf_rope(f, index, out["head_dim"])
    local = float(f.get("rope.freq_base_swa", base.theta))
    dim, heads = out["dim"], out["n_heads"]
    scale = (dim // heads) ** -0.5 if out["n_layers"] == 46 else out["head_dim"] ** -0.5
    out.update(
        base.fields(),
        rope_local_theta=None if local == base.theta else local,
        query_scale=scale,
        sliding_window=f.count("attention.sliding_window", 1, MAX_CONTEXT, 4096),
        layer_types=_layers(out["n_layers"], period),
        attn_softcap=f.get("attn_logit_softcapping"),
        final_logit_softcap=f.get("final_logit_softcapping"),
    )


ARCH = Arch(
    "gemma2",
    ("gemma2",),
    hf,
    gguf,
    hf_norm_plus_one=True,
    hf_names=_HF_NORMS,
)
