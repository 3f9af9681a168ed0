"""What an architecture description is, and the parsing every description shares.

An `Arch` names its Hugging Face `model_type`s and its GGUF `general.architecture`,
says how its tensors are named where they differ from Llama's, and reads the config
keys of its own (`hf` / `gguf`: a `Fields` in, ModelConfig fields out). The loader and
the decoder read only that: a new family is one file beside this one.

Config keys are read through `Fields`, which remembers what was read. After a GGUF
file's description has run, every `{arch}.*` key it left unread is refused by name; for
a config.json, every key of `MATH_KEYS` that was left unread and is not at its neutral
value is. So a key that changes the math and that no description implements is never
ignored.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch


class ArchError(ValueError):
    """A config or file whose architecture, or one of its settings, is not implemented."""


_MISSING = object()


class Fields:
    """The keys of one config, read through `get` / `need`, which remember each key read.

    `prefix` is prepended to every key (a GGUF file's "{arch}."); `where` names the
    source in errors."""

    def __init__(self, values: Mapping[str, Any], where: str, prefix: str = "") -> None:
        self.values = values
        self.where = where
        self.prefix = prefix
        self.read: set[str] = set()

    def has(self, key: str) -> bool:
        return self.prefix + key in self.values

    def get(self, key: str, default: Any = None) -> Any:
        full = self.prefix + key
        self.read.add(full)
        value = self.values.get(full, _MISSING)
        return default if value is _MISSING or value is None else value

    def need(self, key: str) -> Any:
        value = self.get(key, _MISSING)
        if value is _MISSING:
            raise ArchError(f"{self.where}: {self.prefix + key} is missing")
        return value

    def count(self, key: str, lo: int, hi: int, default: Any = _MISSING) -> int:
        """An integer setting within [lo, hi] (a missing key: `default`, or refused)."""
        value = self.get(key, default) if default is not _MISSING else self.need(key)
        return self.bounded(key, value, lo, hi)

    def bounded(self, key: str, value: Any, lo: int, hi: int) -> int:
        """`value` (read from `key`) if it is an integer within [lo, hi], else refused."""
        if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
            raise self.refuse(key, value, f"an integer from {lo} to {hi}")
        return value

    def number(self, key: str, lo: float, hi: float, default: Any = _MISSING) -> float:
        """A finite number within [lo, hi] (a missing key: `default`, or refused)."""
        value = self.get(key, default) if default is not _MISSING else self.need(key)
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        if not ok or not math.isfinite(value) or not lo <= value <= hi:
            raise self.refuse(key, value, f"a number from {lo:g} to {hi:g}")
        return float(value)

    def refuse(self, key: str, value: Any, allowed: str) -> ArchError:
        shown = repr(value)
        if len(shown) > 80:  # an array: its start
            shown = shown[:77] + "..."
        return ArchError(f"{self.where}: {self.prefix + key}={shown} is not supported: {allowed}")


# Config keys of Hugging Face families that change a model's math, with the value that
# leaves it unchanged. A key present with another value that no description read is
# refused by name.
MATH_KEYS: dict[str, Any] = {
    "rope_scaling": None,
    "attn_logit_softcapping": None,
    "final_logit_softcapping": None,
    "embedding_multiplier": 1.0,
    "residual_multiplier": 1.0,
    "attention_multiplier": None,
    "logits_scaling": 1.0,
    "use_sliding_window": False,
    "no_rope_layers": None,
    "no_rope_layer_interval": None,
    "partial_rotary_factor": 1.0,
    "attention_bias": False,
    "mlp_bias": False,
    "query_pre_attn_scalar": None,
    "hidden_act": "silu",
    "hidden_activation": "silu",
}


@dataclass(frozen=True)
class Arch:
    """One architecture: see the module docstring."""

    name: str  # GGUF general.architecture
    hf_types: tuple[str, ...]  # Hugging Face model_type values
    hf: Callable[[Fields, dict[str, Any]], None]  # adds ModelConfig fields from config.json
    gguf: Callable[[Fields, dict[str, Any], Any], None]  # ... from GGUF metadata (and index)
    # llama.cpp's converter interleaves the Q / K rows of these (its "normal" rope); the
    # loader puts them back in rotate-half order.
    gguf_qk_interleaved: bool = False
    hf_norm_plus_one: bool = False  # the file stores w of an RMSNorm that multiplies by 1 + w
    partial_rotary: bool = False  # implements heads that rotate fewer than all dimensions
    # SGLang's class for an EAGLE head of this family's targets (speculant eagle export);
    # None: EAGLE heads are not built for its targets
    eagle_class: str | None = None
    hf_names: Mapping[str, str] = field(default_factory=dict)  # role -> name, where not Llama's
    gguf_names: Mapping[str, str] = field(default_factory=dict)


# ------------------------------------------------------------------- shared parsing
# Bounds of the shapes a config may ask for: beyond the largest published models, and
# small enough that nothing derived from them overflows or asks for absurd memory.
MAX_DIM = 1 << 16
MAX_LAYERS = 1024
MAX_HEADS = 1024
MAX_HEAD_DIM = 1024
MAX_FFN = 1 << 20
MAX_CONTEXT = 1 << 24  # positions; nothing is allocated for them until a sequence needs it
MAX_VOCAB = 1 << 21


def _heads(f: Fields, out: dict[str, Any], heads_key: str, kv_key: str) -> None:
    """The checks between width, heads and kv heads; head_dim from them where the config
    gives none."""
    dim, n_heads, n_kv = out["dim"], out["n_heads"], out["n_kv_heads"]
    if n_heads % n_kv:
        raise f.refuse(kv_key, n_kv, f"a divisor of the {n_heads} query heads")
    if "head_dim" not in out:
        if dim % n_heads:
            raise f.refuse(heads_key, n_heads, f"a divisor of width {dim}")
        out["head_dim"] = dim // n_heads


def common_hf(f: Fields) -> dict[str, Any]:
    """The fields every family's config.json spells the same way."""
    n_heads = f.count("num_attention_heads", 1, MAX_HEADS)
    out: dict[str, Any] = dict(
        vocab_size=f.count("vocab_size", 1, MAX_VOCAB),
        dim=f.count("hidden_size", 1, MAX_DIM),
        n_layers=f.count("num_hidden_layers", 1, MAX_LAYERS),
        n_heads=n_heads,
        n_kv_heads=f.count("num_key_value_heads", 1, MAX_HEADS, n_heads),
        ffn_dim=f.count("intermediate_size", 1, MAX_FFN),
        norm_eps=f.number("rms_norm_eps", 0.0, 1.0, 1e-6),
        max_seq_len=f.count("max_position_embeddings", 1, MAX_CONTEXT, 4096),
        tie_embeddings=bool(f.get("tie_word_embeddings", False)),
    )
    if f.get("head_dim") is not None:
        out["head_dim"] = f.count("head_dim", 2, MAX_HEAD_DIM)
    _heads(f, out, "num_attention_heads", "num_key_value_heads")
    return out


def common_gguf(f: Fields, index: Any) -> dict[str, Any]:
    """The fields every family's GGUF metadata spells the same way (keys "{arch}.*")."""
    dim = f.count("embedding_length", 1, MAX_DIM)
    n_heads = f.count("attention.head_count", 1, MAX_HEADS)
    n_kv = f.get("attention.head_count_kv", n_heads)
    if isinstance(n_kv, list):  # per layer: only one count for every layer is implemented
        if len(set(n_kv)) != 1:
            raise f.refuse("attention.head_count_kv", n_kv, "one count for every layer")
        n_kv = n_kv[0]
    n_kv = f.bounded("attention.head_count_kv", n_kv, 1, MAX_HEADS)
    out: dict[str, Any] = dict(dim=dim, n_heads=n_heads, n_kv_heads=n_kv)
    if f.has("attention.key_length"):
        out["head_dim"] = f.count("attention.key_length", 2, MAX_HEAD_DIM)
    _heads(f, out, "attention.head_count", "attention.head_count_kv")
    head_dim = out["head_dim"]
    value_dim = f.count("attention.value_length", 1, MAX_HEAD_DIM, head_dim)
    if value_dim != head_dim:
        raise f.refuse("attention.value_length", value_dim, f"only {head_dim} (key_length)")
    rope_dim = f.count("rope.dimension_count", 1, MAX_HEAD_DIM, head_dim)
    if rope_dim % 2 or not 0 < rope_dim <= head_dim:
        raise f.refuse("rope.dimension_count", rope_dim, f"an even count up to {head_dim}")
    if "token_embd.weight" not in index.tensors:
        raise ArchError(f"{f.where}: tensor token_embd.weight is missing")
    emb = index.tensors["token_embd.weight"].shape  # gguf shapes are (in, out)
    if len(emb) != 2 or emb[0] != dim:
        raise ArchError(
            f"{f.where}: tensor token_embd.weight has shape {list(emb)}: need [{dim}, vocab] "
            "(embedding_length values per token)"
        )
    vocab = int(emb[1])
    if vocab > MAX_VOCAB:
        raise ArchError(f"{f.where}: {vocab} embedding rows: at most {MAX_VOCAB}")
    f.get("vocab_size")  # the tokenizer's count; the table's rows are the model's
    out.update(
        vocab_size=vocab,
        n_layers=f.count("block_count", 1, MAX_LAYERS),
        ffn_dim=f.count("feed_forward_length", 1, MAX_FFN),
        norm_eps=f.number("attention.layer_norm_rms_epsilon", 0.0, 1.0, 1e-6),
        max_seq_len=f.count("context_length", 1, MAX_CONTEXT, 4096),
        tie_embeddings="output.weight" not in index.tensors,
        rope_dim=0 if rope_dim == head_dim else rope_dim,
    )
    return out


def window_on_every_layer(f: Fields, out: dict[str, Any], key: str) -> None:
    """A sliding window (config key `key`) that every layer applies (Mistral, Phi-3); 0
    or none is no window, and so is one no narrower than the context (the layers can
    then run fused)."""
    window = f.count(key, 0, MAX_CONTEXT, 0)
    if window and window < out["max_seq_len"]:
        out["sliding_window"] = window
        out["layer_types"] = ("sliding",) * out["n_layers"]


# ---------------------------------------------------------------------------- rope
def default_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    """theta ** (-2i / head_dim), [head_dim / 2] float32, computed as transformers does."""
    exps = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    return 1.0 / (theta**exps)


def llama3_inv_freq(
    head_dim: int,
    theta: float,
    factor: float,
    low_freq_factor: float,
    high_freq_factor: float,
    original_context: int,
) -> torch.Tensor:
    """Llama 3.1's frequencies: long wavelengths divided by `factor`, short ones kept,
    a smooth blend between (float32, in transformers' order of operations)."""
    inv_freq = default_inv_freq(head_dim, theta)
    low_freq_wavelen = original_context / low_freq_factor
    high_freq_wavelen = original_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (original_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


def yarn_inv_freq(
    head_dim: int,
    theta: float,
    factor: float,
    original_context: int,
    beta_fast: float = 32.0,
    beta_slow: float = 1.0,
    truncate: bool = True,
) -> torch.Tensor:
    """YaRN's frequencies: each a blend of theta's (extrapolation, the fast-turning
    ones) and theta's divided by `factor` (interpolation, the slow ones), with a linear
    ramp between the dimensions where `beta_fast` and `beta_slow` rotations fit into the
    original context (float32, in transformers' order of operations)."""

    def correction_dim(rotations: float) -> float:
        turns = original_context / (rotations * 2 * math.pi)
        return head_dim * math.log(turns) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # a ramp of one step
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolate = 1 - ramp
    pos_freqs = theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate


def yarn_attn_factor(factor: float, mscale: float = 1.0) -> float:
    """YaRN's default attention factor (cos and sin are multiplied by it)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def longrope_inv_freq(rope_dim: int, theta: float, factors: Any) -> torch.Tensor:
    """LongRoPE's frequencies: theta's, each divided by its own factor (float32, in
    transformers' order of operations)."""
    ext = torch.as_tensor(factors, dtype=torch.float32).reshape(-1)
    shape = torch.arange(0, rope_dim, 2, dtype=torch.int64).float() / rope_dim
    return 1.0 / (ext * theta**shape)


def longrope_attn_factor(factor: float, original_context: int) -> float:
    """LongRoPE's default attention factor (cos and sin are multiplied by it)."""
    return 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original_context))


@dataclass(frozen=True)
class Rope:
    theta: float
    linear_factor: float = 1.0
    inv_freq: tuple[float, ...] = ()
    attn_factor: float = 1.0
    inv_freq_long: tuple[float, ...] = ()  # LongRoPE: past long_context positions
    long_context: int = 0

    def fields(self) -> dict[str, Any]:
        return dict(
            rope_theta=self.theta,
            rope_scaling_factor=self.linear_factor,
            rope_inv_freq=self.inv_freq,
            rope_attn_factor=self.attn_factor,
            rope_inv_freq_long=self.inv_freq_long,
            rope_long_context=self.long_context,
        )


def hf_rope(f: Fields, head_dim: int, kind: str | None = None) -> Rope:
    """The rotary embedding a config.json asks for: transformers 5's `rope_parameters`
    (per layer kind where nested), or the older `rope_theta` + `rope_scaling`.
    Implemented types: default, linear, llama3; any other is refused by name."""
    params = f.get("rope_parameters")
    if isinstance(params, dict) and kind is not None and kind in params:
        params = params[kind]
    scaling = f.get("rope_scaling")
    if isinstance(params, dict) and "rope_theta" in params:
        theta = float(params["rope_theta"])
        spec = params
    else:
        theta = float(f.get("rope_theta", 10000.0))
        spec = scaling if isinstance(scaling, dict) else {}
    rope_type = spec.get("rope_type", spec.get("type", "default"))
    if rope_type == "default":
        return Rope(theta)
    if rope_type == "linear":
        return Rope(theta, linear_factor=float(spec.get("factor", 1.0)))
    if rope_type == "llama3":
        inv = llama3_inv_freq(
            head_dim,
            theta,
            float(spec["factor"]),
            float(spec.get("low_freq_factor", 1.0)),
            float(spec.get("high_freq_factor", 4.0)),
            int(spec["original_max_position_embeddings"]),
        )
        return Rope(theta, inv_freq=tuple(inv.tolist()))
    if rope_type == "yarn":
        original = int(spec["original_max_position_embeddings"])
        factor = spec.get("factor") or int(f.get("max_position_embeddings")) / original
        attn = spec.get("attention_factor")
        if attn is None:
            mscale, mscale_all = spec.get("mscale"), spec.get("mscale_all_dim")
            if mscale and mscale_all:
                attn = yarn_attn_factor(factor, mscale) / yarn_attn_factor(factor, mscale_all)
            else:
                attn = yarn_attn_factor(factor)
        inv = yarn_inv_freq(
            head_dim,
            theta,
            float(factor),
            original,
            float(spec.get("beta_fast") or 32),
            float(spec.get("beta_slow") or 1),
            bool(spec.get("truncate", True)),
        )
        return Rope(theta, inv_freq=tuple(inv.tolist()), attn_factor=float(attn))
    key = "rope_parameters" if isinstance(params, dict) else "rope_scaling"
    if rope_type in ("longrope", "su"):  # "su": the first Phi-3 128k configs' name
        if "long_factor" not in spec or "short_factor" not in spec:
            raise f.refuse(key, spec, "longrope needs long_factor and short_factor")
        original = int(
            spec.get("original_max_position_embeddings")
            or f.need("original_max_position_embeddings")
        )
        factor = spec.get("factor") or int(f.need("max_position_embeddings")) / original
        attn = spec.get("attention_factor")
        attn = longrope_attn_factor(float(factor), original) if attn is None else float(attn)
        return Rope(
            theta,
            inv_freq=tuple(longrope_inv_freq(head_dim, theta, spec["short_factor"]).tolist()),
            attn_factor=attn,
            inv_freq_long=tuple(longrope_inv_freq(head_dim, theta, spec["long_factor"]).tolist()),
            long_context=original,
        )
    raise f.refuse(
        key, {"rope_type": rope_type}, "rope types default, linear, llama3, yarn, longrope"
    )


def gguf_rope(f: Fields, index: Any, head_dim: int) -> Rope:
    """The rotary embedding a GGUF file asks for: its base, a linear scaling, the
    per-frequency divisors of a `rope_freqs.weight` tensor (Llama 3.1's scaling as
    llama.cpp's converter writes it), or LongRoPE's `rope_factors_short` / `_long`
    (Phi-3's). `head_dim`: the rotated dimensions of a head."""
    theta = float(f.get("rope.freq_base", 10000.0))
    scaling = f.get("rope.scaling.type", "linear")  # llama.cpp's default
    factor = float(f.get("rope.scaling.factor", 1.0))
    original = int(f.get("rope.scaling.original_context_length", f.get("context_length", 4096)))
    attn = float(f.get("rope.scaling.attn_factor", 1.0))
    if scaling == "yarn":
        ext = float(f.get("rope.scaling.yarn_ext_factor", 1.0))
        if ext != 1.0:
            raise f.refuse("rope.scaling.yarn_ext_factor", ext, "1.0")
        inv = yarn_inv_freq(
            head_dim,
            theta,
            factor,
            original,
            float(f.get("rope.scaling.yarn_beta_fast", 32.0)),
            float(f.get("rope.scaling.yarn_beta_slow", 1.0)),
        )
        yarn_attn = f.get("rope.scaling.yarn_attn_factor")  # the checkpoint's own, if set
        attn *= float(yarn_attn) if yarn_attn else yarn_attn_factor(factor)
        return Rope(theta, inv_freq=tuple(inv.tolist()), attn_factor=attn)
    if scaling not in ("linear", "none"):
        raise f.refuse("rope.scaling.type", scaling, "none, linear or yarn")
    if scaling == "none":
        factor = 1.0
    if "rope_factors_long.weight" in index.tensors:
        factors = {}
        for kind in ("short", "long"):
            name = f"rope_factors_{kind}.weight"
            if name not in index.tensors:
                raise ArchError(f"{f.where}: {name} is missing beside rope_factors_long.weight")
            factors[kind] = gguf_float(index, name)
            if factors[kind].numel() != head_dim // 2:
                raise ArchError(
                    f"{f.where}: {name} has {factors[kind].numel()} values: need "
                    f"{head_dim // 2} (half the rotated dimensions)"
                )
        return Rope(
            theta,
            linear_factor=factor,
            inv_freq=tuple(longrope_inv_freq(head_dim, theta, factors["short"]).tolist()),
            attn_factor=attn,
            inv_freq_long=tuple(longrope_inv_freq(head_dim, theta, factors["long"]).tolist()),
            long_context=original,
        )
    inv_freq: tuple[float, ...] = ()
    if "rope_freqs.weight" in index.tensors:
        divisors = gguf_float(index, "rope_freqs.weight").reshape(-1)
        if divisors.numel() != head_dim // 2:
            raise ArchError(
                f"{f.where}: rope_freqs.weight has {divisors.numel()} values: need "
                f"{head_dim // 2} (half the head size)"
            )
        inv_freq = tuple((default_inv_freq(head_dim, theta) / divisors).tolist())
    return Rope(theta, linear_factor=factor, inv_freq=inv_freq, attn_factor=attn)


def gguf_float(index: Any, name: str) -> torch.Tensor:
    """A GGUF tensor (any block type) as float32, flat."""
    import numpy as np
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize

    info = index.tensors[name]
    arr = dequantize(index.raw(name), GGMLQuantizationType(info.ggml_type))
    return torch.from_numpy(np.array(arr, dtype=np.float32)).reshape(-1)


def check_unread(f: Fields, keys: list[str]) -> None:
    """Refuse the first of `keys` (a GGUF file's "{arch}.*" keys) no description read."""
    for key in keys:
        if key.startswith(f.prefix) and key not in f.read:
            raise ArchError(
                f"{f.where}: metadata {key}={f.values[key]!r} is not implemented for "
                f"architecture {f.prefix.rstrip('.')!r}, and it may change the model's math"
            )


def check_math_keys(f: Fields) -> None:
    """Refuse a config.json key of MATH_KEYS no description read that is not neutral."""
    for key, neutral in MATH_KEYS.items():
        if key in f.read or key not in f.values:
            continue
        value = f.values[key]
        if value in (neutral, None):
            continue
        raise ArchError(
            f"{f.where}: {key}={value!r} is not implemented for model_type "
            f"{f.values.get('model_type')!r}, and it changes the model's math"
        )
