"""GGUF files of real model shapes with random weights (`speculant bench --synthetic
SHAPE:MIX`), for measuring what no file here can be had of: a pass's cost depends on the
shapes and block types, not on the values of the weights.

A file is valid for Speculant and for llama.cpp alike: the architecture's metadata, every
tensor of the shape in the mix's block types (random codes, small finite scales), F32
norms, and no tokenizer (`tokenizer.ggml.model` "none"): it runs on token ids. Files
are written once into $SPECULANT_HOME/synthetic/ and reused.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np


@dataclass(frozen=True)
class Shape:
    arch: str  # GGUF general.architecture
    dim: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    head_dim: int = 0  # 0: dim / heads
    tied: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    rope_theta: float = 10000.0
    context: int = 32768


SHAPES: dict[str, Shape] = {
    "llama-3.1-8b": Shape("llama", 4096, 32, 32, 8, 14336, 128256, rope_theta=500000.0),
    "llama-3.2-1b": Shape("llama", 2048, 16, 32, 8, 8192, 128256, 64, True, rope_theta=500000.0),
    "qwen2.5-0.5b": Shape("qwen2", 896, 24, 14, 2, 4864, 151936, tied=True, qkv_bias=True),
    "qwen2.5-7b": Shape("qwen2", 3584, 28, 28, 4, 18944, 152064, qkv_bias=True),
    "qwen2.5-14b": Shape("qwen2", 5120, 48, 40, 8, 13824, 152064, qkv_bias=True),
    "qwen3-0.6b": Shape("qwen3", 1024, 28, 16, 8, 3072, 151936, 128, True, qk_norm=True),
    "qwen3-8b": Shape("qwen3", 4096, 36, 32, 8, 12288, 151936, 128, qk_norm=True),
    # for tests: the smallest shape the K-quants allow
    "tiny": Shape("llama", 256, 2, 4, 2, 512, 512),
}
MIXES = ("Q4_K_M", "Q8_0", "Q4_0", "Q6_K")


def _more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's Q4_K_M choice of the layers whose attn_v / ffn_down get Q6_K: the
    first eighth, the last (from 7/8 of the layers), and every third in between."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def _types(mix: str, name: str, layer: int | None, layers: int) -> str:
    if name.endswith("norm.weight") or name.endswith(".bias"):
        return "F32"
    if mix != "Q4_K_M":
        return mix
    if name == "output.weight":
        return "Q6_K"
    if layer is not None and name.endswith(("attn_v.weight", "ffn_down.weight")):
        return "Q6_K" if _more_bits(layer, layers) else "Q4_K"
    return "Q4_K"


def tensors(shape: Shape, mix: str) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, gguf shape (row length first), block type) of every tensor, in file order."""
    hd = shape.head_dim or shape.dim // shape.heads
    q, kv = shape.heads * hd, shape.kv_heads * hd
    out: list[tuple[str, tuple[int, ...]]] = [("token_embd.weight", (shape.dim, shape.vocab))]
    for i in range(shape.layers):
        p = f"blk.{i}."
        out += [
            (p + "attn_norm.weight", (shape.dim,)),
            (p + "attn_q.weight", (shape.dim, q)),
            (p + "attn_k.weight", (shape.dim, kv)),
            (p + "attn_v.weight", (shape.dim, kv)),
        ]
        if shape.qkv_bias:
            out += [
                (p + "attn_q.bias", (q,)),
                (p + "attn_k.bias", (kv,)),
                (p + "attn_v.bias", (kv,)),
            ]
        if shape.qk_norm:
            out += [(p + "attn_q_norm.weight", (hd,)), (p + "attn_k_norm.weight", (hd,))]
        out += [
            (p + "attn_output.weight", (q, shape.dim)),
            (p + "ffn_norm.weight", (shape.dim,)),
            (p + "ffn_gate.weight", (shape.dim, shape.ffn)),
            (p + "ffn_up.weight", (shape.dim, shape.ffn)),
            (p + "ffn_down.weight", (shape.ffn, shape.dim)),
        ]
    out.append(("output_norm.weight", (shape.dim,)))
    if not shape.tied:
        out.append(("output.weight", (shape.dim, shape.vocab)))
    typed: list[tuple[str, tuple[int, ...], str]] = []
    for name, dims in out:
        layer = int(name.split(".")[1]) if name.startswith("blk.") else None
        typed.append((name, dims, _types(mix, name, layer, shape.layers)))
    return typed


# byte offsets of the fp16 scales of each block type, set small and finite
_SCALES = {"Q4_0": (0,), "Q8_0": (0,), "Q4_K": (0, 2), "Q6_K": (208,)}


def _random_blocks(qtype: Any, dims: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    from gguf.constants import GGML_QUANT_SIZES

    if qtype.name == "F32":
        return (1.0 + 0.1 * rng.standard_normal(dims[::-1])).astype(np.float32)
    per, nbytes = GGML_QUANT_SIZES[qtype]
    rows = int(np.prod(dims[1:]))
    blocks = rng.integers(0, 256, size=(rows, dims[0] // per, nbytes), dtype=np.uint8)
    for off in _SCALES[qtype.name]:
        scales = (rng.standard_normal(blocks.shape[:2]) * 0.002).astype(np.float16)
        blocks[:, :, off : off + 2] = scales.view(np.uint8).reshape(*blocks.shape[:2], 2)
    return blocks.reshape(rows, -1)


def synthetic_path(name: str, mix: str) -> Path:
    from speculant.models.registry import speculant_home

    return speculant_home() / "synthetic" / f"{name}.{mix}.gguf"


def parse(spec: str) -> tuple[str, str]:
    """'SHAPE:MIX' (MIX default Q4_K_M), checked against the known ones."""
    name, _, mix = spec.partition(":")
    mix = mix or "Q4_K_M"
    if name not in SHAPES:
        raise ValueError(
            f"--synthetic {spec!r}: unknown shape {name!r}: use one of {', '.join(SHAPES)}"
        )
    if mix not in MIXES:
        raise ValueError(
            f"--synthetic {spec!r}: unknown mix {mix!r}: use one of {', '.join(MIXES)}"
        )
    return name, mix


def write(name: str, mix: str, path: Path | None = None, seed: int = 0) -> Path:
    """The synthetic file of shape `name` in `mix` (written once, then reused)."""
    import gguf

    shape = SHAPES[name]
    path = path or synthetic_path(name, mix)
    if path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.partial")
    hd = shape.head_dim or shape.dim // shape.heads
    w = gguf.GGUFWriter(str(tmp), shape.arch)
    w.add_name(f"synthetic {name} {mix} (random weights)")
    w.add_block_count(shape.layers)
    w.add_context_length(shape.context)
    w.add_embedding_length(shape.dim)
    w.add_feed_forward_length(shape.ffn)
    w.add_head_count(shape.heads)
    w.add_head_count_kv(shape.kv_heads)
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_rope_freq_base(shape.rope_theta)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_vocab_size(shape.vocab)  # llama.cpp takes the count from here without a tokenizer
    w.add_tokenizer_model("none")
    specs = tensors(shape, mix)
    rng = np.random.default_rng(seed)
    for tname, dims, qname in specs:
        qtype = gguf.GGMLQuantizationType[qname]
        per, nbytes = gguf.constants.GGML_QUANT_SIZES[qtype]
        size = int(np.prod(dims)) // per * nbytes
        if qname == "F32":  # numpy's order: the row length last
            w.add_tensor_info(tname, dims[::-1], np.dtype(np.float32), size)
        else:  # the bytes of each row
            rows = tuple(reversed(dims[1:]))
            w.add_tensor_info(
                tname, (*rows, dims[0] // per * nbytes), np.dtype(np.uint8), size, qtype
            )
    try:
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for _, dims, qname in specs:
            w.write_tensor_data(_random_blocks(gguf.GGMLQuantizationType[qname], dims, rng))
        w.close()
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path
