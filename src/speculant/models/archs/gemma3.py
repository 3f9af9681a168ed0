"""Gemma 3 (text): q/k norms, norms after attention and around the MLP, RMSNorms that
multiply by (1 + w), a scaled embedding, GELU, and sliding-window layers with their
own rope base between global ones."""

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
    out.update(
        qk_norm=True,
        sandwich_norm=True,
        embed_scale=math.sqrt(out["dim"]),
        activation="gelu_tanh",
    )


def hf(f: Fields, out: dict[str, Any]) -> None:
    _shared(out)
    full = hf_rope(f, out["head_dim"], "full_attention")
    local = hf_rope(f, out["head_dim"], "sliding_attention")
    if local.linear_factor != 1.0 or local.inv_freq:
        raise f.refuse("rope_parameters", "sliding_attention scaling", "no scaling")
    if "rope_local_base_freq" in f.values:
        local_theta = float(f.get("rope_local_base_freq"))
    else:
        local_theta = local.theta
    pattern = f.count("sliding_window_pattern", 1, MAX_LAYERS, 6)
    layer_types = f.get("layer_types") or [
        "full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
        for i in range(out["n_layers"])
    ]
    act = f.get("hidden_activation", "gelu_pytorch_tanh")
    if act != "gelu_pytorch_tanh":
        raise f.refuse("hidden_activation", act, "gelu_pytorch_tanh")
    window = f.count("sliding_window", 0, MAX_CONTEXT, 0)
    out.update(
        full.fields(),
        rope_local_theta=local_theta,
        tie_embeddings=bool(f.get("tie_word_embeddings", True)),
        query_scale=float(f.get("query_pre_attn_scalar", out["head_dim"])) ** -0.5,
        sliding_window=window or None,
        layer_types=tuple("sliding" if t == "sliding_attention" else "full" for t in layer_types),
        final_logit_softcap=f.get("final_logit_softcapping"),
    )
    if f.get("attn_logit_softcapping"):
        raise f.refuse("attn_logit_softcapping", f.get("attn_logit_softcapping"), "none")


def gguf(f: Fields, out: dict[str, Any], index: Any) -> None:
    _shared(out)
    # llama.cpp's gemma3 conventions: every 6th layer is global, local rope base 10k.
    pattern = f.count("attention.sliding_window_pattern", 1, MAX_LAYERS, 6)
    out.update(
        gguf_rope(f, index, out["head_dim"]).fields(),
        rope_local_theta=10000.0,
        query_scale=out["head_dim"] ** -0.5,
        sliding_window=f.count("attention.sliding_window", 1, MAX_CONTEXT),
        layer_types=tuple(
            "full" if (i + 1) % pattern == 0 else "sliding" for i in range(out["n_layers"])
        ),
        final_logit_softcap=f.get("final_logit_softcapping"),
    )


ARCH = Arch(
    "gemma3",
    ("gemma3_text", "gemma3"),
    hf,
    gguf,
    hf_norm_plus_one=True,
    hf_names=_HF_NORMS,
)
