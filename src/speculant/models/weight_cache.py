"""Converted-weights cache: a GGUF dequantized once is saved as safetensors beside it.

Dequantizing the 1.5B Q4_K_M model takes ~30 s on 2 cores; reading the converted
tensors back takes a few seconds. The cache is keyed by the GGUF's size and mtime and
by the target format, and bound by a digest record (``<file>.source.json``, see
``speculant.models.derived``) to its own SHA-256 and the GGUF's: before a tensor is read
the file is hashed again, and one that differs from its record, or was built from
another GGUF, is reported in one line and rebuilt from the GGUF. It is written
atomically and ignored (with a warning) when the folder is read-only or the entry is
stale or broken.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from speculant.models import derived
from speculant.models.config import ModelConfig
from speculant.models.decoder import Int4Weight, Int8Weight, LayerWeights, Weights

log = logging.getLogger(__name__)
FORMAT_VERSION = 3  # 2: rope and scale fields; 3: partial rotary, LongRoPE, soft-cap, OLMo 2


def cache_path(gguf: Path, label: str) -> Path:
    return gguf.with_name(f"{gguf.stem}.{label}.safetensors")


def _key(gguf: Path, label: str) -> dict[str, Any]:
    st = gguf.stat()
    return {
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
        "label": label,
        "version": FORMAT_VERSION,
    }


def _flatten(weights: Weights) -> dict[str, Tensor]:
    out: dict[str, Tensor] = {}

    def put(name: str, value: object) -> None:
        if isinstance(value, Int8Weight):
            out[f"{name}.q"] = value.q
            out[f"{name}.scales"] = value.scales
        elif isinstance(value, Int4Weight):
            out[f"{name}.q4"] = value.packed
            out[f"{name}.sz"] = value.scales_zeros
        elif isinstance(value, Tensor):
            out[name] = value.contiguous()

    put("tok_embeddings", weights.tok_embeddings)
    put("norm", weights.norm)
    if weights.output is not weights.tok_embeddings:
        put("output", weights.output)
    for i, lw in enumerate(weights.layers):
        for field in dataclasses.fields(lw):
            put(f"layers.{i}.{field.name}", getattr(lw, field.name))
    return out


def _get(tensors: dict[str, Tensor], name: str) -> Tensor | Int8Weight | Int4Weight | None:
    if name in tensors:
        return tensors[name]
    if f"{name}.q" in tensors:
        return Int8Weight(tensors[f"{name}.q"], tensors[f"{name}.scales"])
    if f"{name}.q4" in tensors:
        packed, sz = tensors[f"{name}.q4"], tensors[f"{name}.sz"]
        return Int4Weight(packed, sz, packed.shape[1] * 2 // sz.shape[0])
    return None


def save(gguf: Path, label: str, config: ModelConfig, weights: Weights, source_sha256: str) -> None:
    """Write the cache file atomically, then its digest record bound to source_sha256
    (the GGUF's digest); a folder that cannot be written only costs a warning."""
    from safetensors.torch import save_file

    target = cache_path(gguf, label)
    meta = {"key": json.dumps(_key(gguf, label)), "config": json.dumps(dataclasses.asdict(config))}
    written = False
    try:
        with derived.atomic_path(target) as tmp:
            save_file(_flatten(weights), str(tmp), metadata=meta)
        written = True
        derived.write_record(target, gguf, source_sha256)
    except OSError as exc:
        log.warning("could not cache converted weights at %s: %s", target, exc)
        if written:  # no cache file left without its record
            with contextlib.suppress(OSError):
                target.unlink()


def load(gguf: Path, label: str, source_sha256: str) -> tuple[ModelConfig, Weights] | None:
    """The cached weights of `gguf` in format `label`, or None when there is no usable
    entry. The file is hashed and checked against its digest record, bound to
    source_sha256 (the GGUF's verified digest), before anything in it is read; a
    mismatch is logged in one line naming the file and both digests."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    path = cache_path(gguf, label)
    if not path.is_file():
        return None
    why = derived.problem(path, source_sha256)
    if why is not None:
        log.warning("weight cache not used: %s; rebuilding it from %s", why, gguf.name)
        return None
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
        if json.loads(meta.get("key", "{}")) != _key(gguf, label):
            return None
        raw = json.loads(meta["config"])
        raw["layer_types"] = tuple(raw.get("layer_types", ()))
        config = ModelConfig(**raw)
        tensors = load_file(str(path))
        layers = []
        for i in range(config.n_layers):
            values = {
                field.name: _get(tensors, f"layers.{i}.{field.name}")
                for field in dataclasses.fields(LayerWeights)
            }
            layers.append(LayerWeights(**values))  # type: ignore[arg-type]
        emb = tensors["tok_embeddings"]
        output = _get(tensors, "output")
        weights = Weights(emb, tensors["norm"], emb if output is None else output, layers)
        return config, weights
    except Exception as exc:  # a broken cache entry must never stop a load
        log.warning("ignoring unreadable weight cache %s: %s", path, exc)
        return None


def dtype_label(dtype: torch.dtype, quant: str | None) -> str:
    return quant or str(dtype).removeprefix("torch.")
