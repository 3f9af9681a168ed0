"""SmolLM3: Llama in which every fourth layer (by default) applies no rotary embedding.

Its config.json lists the layers as `no_rope_layers`, where 1 means the layer *does*
rotate (transformers' reading); llama.cpp's GGUF files carry no such key and use the
default interval of 4, so layers 3, 7, 11, ... are not rotated."""

from __future__ import annotations

from typing import Any

from speculant.models.archs.base import MAX_LAYERS, Arch, Fields, gguf_rope, hf_rope

DEFAULT_INTERVAL = 4


def _interval(n_layers: int, interval: int) -> tuple[int, ...]:
    return tuple(i for i in range(n_layers) if (i + 1) % interval == 0)


def hf(f: Fields, out: dict[str, Any]) -> None:
    for key in ("attention_bias", "mlp_bias", "use_sliding_window"):
        if f.get(key):
            raise f.refuse(key, True, "false")
    f.get("sliding_window")  # unused while use_sliding_window is false
    f.get("max_window_layers")
    f.get("layer_types")
    n = out["n_layers"]
    uses_rope = f.get("no_rope_layers")
    interval = f.count("no_rope_layer_interval", 1, MAX_LAYERS, DEFAULT_INTERVAL)
    if uses_rope is None:
        skipped = _interval(n, interval)
    elif len(uses_rope) != n:
        raise f.refuse("no_rope_layers", uses_rope, f"one 0 or 1 per layer ({n})")
    else:
        skipped = tuple(i for i, use in enumerate(uses_rope) if not use)
    out.update(hf_rope(f, out["head_dim"]).fields(), no_rope_layers=skipped)


def gguf(f: Fields, out: dict[str, Any], index: Any) -> None:
    out.update(
        gguf_rope(f, index, out["head_dim"]).fields(),
        no_rope_layers=_interval(out["n_layers"], DEFAULT_INTERVAL),
    )


ARCH = Arch("smollm3", ("smollm3",), hf, gguf, gguf_qk_interleaved=True)
