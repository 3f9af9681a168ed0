"""Granite (3.x): Llama with four multipliers: on the embedding, on each block's output
before it is added back, on the attention scores (in place of 1/sqrt(head_dim)), and a
divisor of the logits."""

from __future__ import annotations

from typing import Any

from speculant.models.archs.base import Arch, Fields, gguf_rope, hf_rope


def hf(f: Fields, out: dict[str, Any]) -> None:
    for key in ("attention_bias", "mlp_bias"):
        if f.get(key):
            raise f.refuse(key, True, "false (no projection biases)")
    out.update(
        hf_rope(f, out["head_dim"]).fields(),
        embed_scale=float(f.get("embedding_multiplier", 1.0)),
        residual_scale=float(f.get("residual_multiplier", 1.0)),
        query_scale=float(f.get("attention_multiplier", 1.0)),
        logit_scale=float(f.get("logits_scaling", 1.0)),
    )


def gguf(f: Fields, out: dict[str, Any], index: Any) -> None:
    # llama.cpp's reading: an absent (or zero) scale is no scaling; the attention's is
    # then 1/sqrt(head_dim).
    f.get("rope.scaling.finetuned")  # whether the rope scaling was trained: no math
    out.update(
        gguf_rope(f, index, out["head_dim"]).fields(),
        embed_scale=float(f.get("embedding_scale") or 1.0),
        residual_scale=float(f.get("residual_scale") or 1.0),
        query_scale=float(f.get("attention.scale") or out["head_dim"] ** -0.5),
        logit_scale=float(f.need("logit_scale")),
    )


ARCH = Arch("granite", ("granite",), hf, gguf, gguf_qk_interleaved=True)
