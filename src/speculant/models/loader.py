"""Weight loaders: GGUF files (dequantized with `gguf`) and Hugging Face directories.

Both produce a `ModelConfig` and a `Weights` object in our canonical layout:
fused QKV and gate/up projections, Gemma norms as effective (1 + w) multipliers,
rotate-half RoPE ordering for Q and K.
"""

from __future__ import annotations

import json
import math
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from speculant.models.config import ModelConfig
from speculant.models.decoder import LayerWeights, Weights
from speculant.models.gguf_file import GGUFError, GGUFIndex, read_gguf


class ModelLoadError(ValueError):
    """A model file or folder that cannot be loaded, with the reason."""


# ----------------------------------------------------------------------------- assembly
def _assemble(
    config: ModelConfig,
    get: Callable[[str], Tensor | None],
    names: dict[str, str],
    dtype: torch.dtype,
) -> Weights:
    """Build Weights from a source. `names` maps our roles to the source's names, with
    "{i}" for the layer index; `get` returns a float32 tensor or None when absent."""

    def need(role: str, i: int | None = None) -> Tensor:
        name = names[role].format(i=i)
        t = get(name)
        if t is None:
            raise ModelLoadError(f"tensor {name!r} is missing")
        return t

    def cast(t: Tensor) -> Tensor:
        return t.to(dtype).contiguous()

    def opt(role: str, i: int | None = None, wanted: bool = True) -> Tensor | None:
        t = get(names[role].format(i=i)) if wanted and role in names else None
        return None if t is None else cast(t)

    emb = cast(need("embed"))
    out = opt("output", wanted=not config.tie_embeddings)
    output = emb if out is None else out
    layers = []
    for i in range(config.n_layers):
        q, k, v = need("q", i), need("k", i), need("v", i)
        bias = None
        if config.qkv_bias:
            bias = cast(torch.cat([need("q_bias", i), need("k_bias", i), need("v_bias", i)]))
        gate, up = need("gate", i), need("up", i)
        layers.append(
            LayerWeights(
                attn_norm=cast(need("attn_norm", i)),
                wqkv=cast(torch.cat([q, k, v])),
                wo=cast(need("o", i)),
                ffn_norm=cast(need("ffn_norm", i)),
                w_gate_up=cast(torch.cat([gate, up])),
                w_down=cast(need("down", i)),
                bqkv=bias,
                q_norm=opt("q_norm", i, config.qk_norm),
                k_norm=opt("k_norm", i, config.qk_norm),
                post_attn_norm=opt("post_attn_norm", i, config.sandwich_norm),
                post_ffn_norm=opt("post_ffn_norm", i, config.sandwich_norm),
            )
        )
    return Weights(tok_embeddings=emb, norm=cast(need("norm")), output=output, layers=layers)


# --------------------------------------------------------------------------- HF folders
_HF_NAMES = {
    "embed": "model.embed_tokens.weight",
    "norm": "model.norm.weight",
    "output": "lm_head.weight",
    "attn_norm": "model.layers.{i}.input_layernorm.weight",
    "q": "model.layers.{i}.self_attn.q_proj.weight",
    "k": "model.layers.{i}.self_attn.k_proj.weight",
    "v": "model.layers.{i}.self_attn.v_proj.weight",
    "o": "model.layers.{i}.self_attn.o_proj.weight",
    "q_bias": "model.layers.{i}.self_attn.q_proj.bias",
    "k_bias": "model.layers.{i}.self_attn.k_proj.bias",
    "v_bias": "model.layers.{i}.self_attn.v_proj.bias",
    "q_norm": "model.layers.{i}.self_attn.q_norm.weight",
    "k_norm": "model.layers.{i}.self_attn.k_norm.weight",
    "gate": "model.layers.{i}.mlp.gate_proj.weight",
    "up": "model.layers.{i}.mlp.up_proj.weight",
    "down": "model.layers.{i}.mlp.down_proj.weight",
}
_HF_FFN_NORM = "model.layers.{i}.post_attention_layernorm.weight"  # llama / qwen2
_GEMMA_NORMS = {
    "post_attn_norm": "model.layers.{i}.post_attention_layernorm.weight",
    "ffn_norm": "model.layers.{i}.pre_feedforward_layernorm.weight",
    "post_ffn_norm": "model.layers.{i}.post_feedforward_layernorm.weight",
}
_HF_ARCH = {"llama": "llama", "qwen2": "qwen2", "gemma3_text": "gemma3", "gemma3": "gemma3"}


def _rope_theta(cfg: dict[str, Any], kind: str | None = None) -> tuple[float, float]:
    """(theta, linear scaling factor) from old (`rope_theta`) or new (`rope_parameters`)."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and kind is not None and kind in params:
        params = params[kind]
    if isinstance(params, dict) and "rope_theta" in params:
        factor = 1.0
        if params.get("rope_type", "default") == "linear":
            factor = float(params.get("factor", 1.0))
        elif params.get("rope_type", "default") != "default":
            raise ModelLoadError(f"rope_type {params.get('rope_type')!r} is not supported")
        return float(params["rope_theta"]), factor
    scaling = cfg.get("rope_scaling") or {}
    factor = float(scaling.get("factor", 1.0)) if scaling.get("rope_type") == "linear" else 1.0
    if kind == "sliding_attention" and "rope_local_base_freq" in cfg:
        return float(cfg["rope_local_base_freq"]), 1.0
    return float(cfg.get("rope_theta", 10000.0)), factor


def config_from_hf(cfg: dict[str, Any]) -> ModelConfig:
    model_type = cfg.get("model_type")
    if model_type == "gemma3" and "text_config" in cfg:
        cfg = {**cfg["text_config"], "model_type": "gemma3_text"}
        model_type = "gemma3_text"
    arch = _HF_ARCH.get(str(model_type))
    if arch is None:
        raise ModelLoadError(
            f"model_type {model_type!r} is not supported: use one of {sorted(_HF_ARCH)}"
        )
    n_heads = int(cfg["num_attention_heads"])
    dim = int(cfg["hidden_size"])
    head_dim = int(cfg.get("head_dim") or dim // n_heads)
    common: dict[str, Any] = dict(
        arch=arch,
        vocab_size=int(cfg["vocab_size"]),
        dim=dim,
        n_layers=int(cfg["num_hidden_layers"]),
        n_heads=n_heads,
        n_kv_heads=int(cfg.get("num_key_value_heads") or n_heads),
        head_dim=head_dim,
        ffn_dim=int(cfg["intermediate_size"]),
        norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_seq_len=int(cfg.get("max_position_embeddings", 4096)),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", arch == "gemma3")),
    )
    if arch == "gemma3":
        theta, factor = _rope_theta(cfg, "full_attention")
        local_theta, _ = _rope_theta(cfg, "sliding_attention")
        layer_types = cfg.get("layer_types") or [
            "full_attention"
            if (i + 1) % int(cfg.get("sliding_window_pattern", 6)) == 0
            else "sliding_attention"
            for i in range(common["n_layers"])
        ]
        return ModelConfig(
            **common,
            rope_theta=theta,
            rope_scaling_factor=factor,
            rope_local_theta=local_theta,
            qk_norm=True,
            sandwich_norm=True,
            embed_scale=math.sqrt(dim),
            query_scale=float(cfg.get("query_pre_attn_scalar", head_dim)) ** -0.5,
            sliding_window=int(cfg["sliding_window"]) if cfg.get("sliding_window") else None,
            layer_types=tuple(
                "sliding" if t == "sliding_attention" else "full" for t in layer_types
            ),
            activation="gelu_tanh",
            final_logit_softcap=cfg.get("final_logit_softcapping"),
        )
    if cfg.get("attn_logit_softcapping"):
        raise ModelLoadError("attention logit softcapping is not supported")
    if arch == "llama" and (cfg.get("mlp_bias") or cfg.get("attention_bias")):
        raise ModelLoadError("llama checkpoints with attention_bias / mlp_bias are not supported")
    theta, factor = _rope_theta(cfg)
    return ModelConfig(
        **common, rope_theta=theta, rope_scaling_factor=factor, qkv_bias=arch == "qwen2"
    )


def load_hf_dir(path: Path, dtype: torch.dtype) -> tuple[ModelConfig, Weights]:
    from safetensors import safe_open

    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ModelLoadError(f"{path} has no config.json: not a Hugging Face model folder")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path} has no *.safetensors weights")
    config = config_from_hf(json.loads(cfg_file.read_text()))
    # canonical name -> (file handle, name in the file); multimodal wrappers nest the
    # text model under "language_model".
    source: dict[str, tuple[Any, str]] = {}
    for f in files:
        handle = safe_open(str(f), framework="pt")
        for key in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
            canon = key.replace("model.language_model.", "model.", 1)
            source[canon.removeprefix("language_model.")] = (handle, key)

    gemma = config.arch == "gemma3"

    def get(name: str) -> Tensor | None:
        if name not in source:
            return None
        handle, key = source[name]
        t = handle.get_tensor(key).float()
        if gemma and name.endswith("norm.weight"):
            t = t + 1.0  # Gemma RMSNorm multiplies by (1 + w)
        return t

    names = dict(_HF_NAMES)
    if gemma:
        names.update(_GEMMA_NORMS)
    else:
        names["ffn_norm"] = _HF_FFN_NORM
    return config, _assemble(config, get, names, dtype)


# --------------------------------------------------------------------------------- GGUF
_GGUF_NAMES = {
    "embed": "token_embd.weight",
    "norm": "output_norm.weight",
    "output": "output.weight",
    "attn_norm": "blk.{i}.attn_norm.weight",
    "q": "blk.{i}.attn_q.weight",
    "k": "blk.{i}.attn_k.weight",
    "v": "blk.{i}.attn_v.weight",
    "o": "blk.{i}.attn_output.weight",
    "q_bias": "blk.{i}.attn_q.bias",
    "k_bias": "blk.{i}.attn_k.bias",
    "v_bias": "blk.{i}.attn_v.bias",
    "q_norm": "blk.{i}.attn_q_norm.weight",
    "k_norm": "blk.{i}.attn_k_norm.weight",
    "ffn_norm": "blk.{i}.ffn_norm.weight",
    "post_attn_norm": "blk.{i}.post_attention_norm.weight",
    "post_ffn_norm": "blk.{i}.post_ffw_norm.weight",
    "gate": "blk.{i}.ffn_gate.weight",
    "up": "blk.{i}.ffn_up.weight",
    "down": "blk.{i}.ffn_down.weight",
}


def config_from_gguf(index: GGUFIndex) -> ModelConfig:
    meta = index.metadata
    has_output = "output.weight" in index.tensors
    arch = meta.get("general.architecture")
    if arch not in ("llama", "qwen2", "gemma3"):
        raise ModelLoadError(
            f"GGUF architecture {arch!r} is not supported: use llama, qwen2 or gemma3"
        )

    def f(key: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{key}", default)
        if value is None:
            raise ModelLoadError(f"GGUF metadata {arch}.{key} is missing")
        return value

    dim = int(f("embedding_length"))
    n_heads = int(f("attention.head_count"))
    n_kv = f("attention.head_count_kv", n_heads)
    head_dim = int(f("attention.key_length", dim // n_heads))
    n_layers = int(f("block_count"))
    if "token_embd.weight" not in index.tensors:
        raise ModelLoadError(f"{index.path}: tensor token_embd.weight is missing")
    emb = index.tensors["token_embd.weight"]
    common: dict[str, Any] = dict(
        arch=arch,
        vocab_size=int(emb.shape[-1]),  # gguf shapes are (in, out)
        dim=dim,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=int(n_kv),
        head_dim=head_dim,
        ffn_dim=int(f("feed_forward_length")),
        norm_eps=float(f("attention.layer_norm_rms_epsilon", 1e-6)),
        max_seq_len=int(f("context_length", 4096)),
        tie_embeddings=not has_output,
    )
    scaling_type = meta.get(f"{arch}.rope.scaling.type", "none")
    factor = 1.0
    if scaling_type == "linear":
        factor = float(f("rope.scaling.factor", 1.0))
    elif scaling_type not in ("none", None):
        raise ModelLoadError(f"rope scaling {scaling_type!r} is not supported")
    theta = float(f("rope.freq_base", 10000.0))
    if arch == "gemma3":
        # llama.cpp's gemma3 conventions: every 6th layer is global, local rope base 10k.
        pattern = int(meta.get("gemma3.attention.sliding_window_pattern", 6) or 6)
        return ModelConfig(
            **common,
            rope_theta=theta,
            rope_scaling_factor=factor,
            rope_local_theta=10000.0,
            qk_norm=True,
            sandwich_norm=True,
            embed_scale=math.sqrt(dim),
            query_scale=head_dim**-0.5,
            sliding_window=int(f("attention.sliding_window")),
            layer_types=tuple(
                "full" if (i + 1) % pattern == 0 else "sliding" for i in range(n_layers)
            ),
            activation="gelu_tanh",
        )
    return ModelConfig(
        **common, rope_theta=theta, rope_scaling_factor=factor, qkv_bias=arch == "qwen2"
    )


def _unpermute_rope(w: Tensor, n_heads: int) -> Tensor:
    """Undo the llama.cpp converter's Q/K row permutation (interleaved -> rotate-half)."""
    rows = w.shape[0]
    return (
        w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)
    )


def _rope_heads(config: ModelConfig, name: str) -> int | None:
    """Heads of a llama Q / K projection whose rows need `_unpermute_rope`, else None."""
    if config.arch == "llama" and name.endswith(("attn_q.weight", "attn_k.weight")):
        return config.n_heads if "attn_q" in name else config.n_kv_heads
    return None


def _dequantized(index: GGUFIndex, config: ModelConfig, name: str) -> Tensor:
    """Tensor `name` as float32 in our layout ([out, in], rotate-half Q / K rows)."""
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize

    info = index.tensors[name]
    arr = dequantize(index.raw(name), GGMLQuantizationType(info.ggml_type))
    shape = tuple(reversed(info.shape))  # gguf lists (in, out)
    out = torch.from_numpy(np.array(arr, dtype=np.float32)).reshape(shape)
    heads = _rope_heads(config, name)
    return out if heads is None else _unpermute_rope(out, heads)


def _open_gguf(
    path: Path, progress: Callable[[int, int], None] | None
) -> tuple[GGUFIndex, ModelConfig, Callable[[], None]]:
    """The file's index, its config, and a tick() that reports one more tensor read."""
    try:
        index = read_gguf(path)
    except GGUFError as exc:
        raise ModelLoadError(str(exc)) from exc
    done = [0]

    def tick() -> None:
        done[0] += 1
        if progress is not None:
            progress(done[0], len(index.tensors))

    return index, config_from_gguf(index), tick


def load_gguf(
    path: Path, dtype: torch.dtype, progress: Callable[[int, int], None] | None = None
) -> tuple[ModelConfig, Weights]:
    index, config, tick = _open_gguf(path, progress)

    def get(name: str) -> Tensor | None:
        if name not in index.tensors:
            return None
        out = _dequantized(index, config, name)
        tick()
        return out

    return config, _assemble(config, get, _GGUF_NAMES, dtype)


def load_gguf_native(
    path: Path, progress: Callable[[int, int], None] | None = None
) -> tuple[ModelConfig, Weights]:
    """Load a GGUF file for the native kernels: projections, the LM head and the
    embedding table stay in their stored blocks (memory-mapped, nothing dequantized);
    norms and biases become float32. A projection in a format the kernels do not execute
    (F16, BF16, Q5_K, ...) is dequantized to float32 instead."""
    from speculant.models.formats import GGUFWeight
    from speculant.native import SUPPORTED_TYPES, NativeMatrix, row_bytes

    index, config, tick = _open_gguf(path, progress)

    def stored(name: str) -> tuple[int, Tensor, int] | None:
        """(type, row bytes as uint8 [rows * row_bytes], rows), or None when the kernels
        cannot run this tensor's format."""
        info = index.tensors[name]
        k, n = int(info.shape[0]), int(info.shape[-1])
        if info.ggml_type not in SUPPORTED_TYPES or row_bytes(info.ggml_type, k) == 0:
            return None
        with warnings.catch_warnings():  # read-only mapping: the kernels only read it
            warnings.simplefilter("ignore", UserWarning)
            raw = torch.from_numpy(np.asarray(index.raw(name)).view(np.uint8).reshape(n, -1))
        heads = _rope_heads(config, name)
        if heads is not None:
            raw = _unpermute_rope(raw, heads).contiguous()  # whole rows move, blocks intact
        return info.ggml_type, raw.reshape(-1), n

    def need(role: str, i: int | None = None) -> str:
        name = _GGUF_NAMES[role].format(i=i)
        if name not in index.tensors:
            raise ModelLoadError(f"tensor {name!r} is missing")
        return name

    def projection(*names: str, lookup: bool = False) -> Tensor | GGUFWeight:
        """`lookup`: an embedding table, read by row (packed only if also multiplied)."""
        parts = [stored(n) for n in names]
        for _ in names:
            tick()
        if any(p is None for p in parts):
            return torch.cat([_dequantized(index, config, n) for n in names]).contiguous()
        k = int(index.tensors[names[0]].shape[0])
        matrix = NativeMatrix([p for p in parts if p is not None], k, keep_stored=lookup)
        return GGUFWeight(matrix if lookup else matrix.pack())

    def need_vec(role: str, i: int | None = None) -> Tensor:
        tick()
        return _dequantized(index, config, need(role, i)).contiguous()

    def vec(role: str, i: int, wanted: bool) -> Tensor | None:
        present = _GGUF_NAMES[role].format(i=i) in index.tensors
        return need_vec(role, i) if wanted and present else None

    emb = projection(need("embed"), lookup=True)
    output = emb
    if not config.tie_embeddings:
        output = projection(need("output"))
    elif isinstance(emb, GGUFWeight):
        emb.matrix.pack()  # the LM head too
    layers = []
    for i in range(config.n_layers):
        bias = None
        if config.qkv_bias:
            bias = torch.cat([need_vec("q_bias", i), need_vec("k_bias", i), need_vec("v_bias", i)])
        layers.append(
            LayerWeights(
                attn_norm=need_vec("attn_norm", i),
                wqkv=projection(need("q", i), need("k", i), need("v", i)),
                wo=projection(need("o", i)),
                ffn_norm=need_vec("ffn_norm", i),
                w_gate_up=projection(need("gate", i), need("up", i)),
                w_down=projection(need("down", i)),
                bqkv=bias,
                q_norm=vec("q_norm", i, config.qk_norm),
                k_norm=vec("k_norm", i, config.qk_norm),
                post_attn_norm=vec("post_attn_norm", i, config.sandwich_norm),
                post_ffn_norm=vec("post_ffn_norm", i, config.sandwich_norm),
            )
        )
    weights = Weights(tok_embeddings=emb, norm=need_vec("norm"), output=output, layers=layers)
    return config, weights


# ----------------------------------------------------------------------------- names
def builtin_model_path(name: str, progress: bool = True) -> Path:
    """The GGUF file of the built-in model `name`, pulled on first use. Anything else that
    is not an existing path is refused, naming what is allowed. The download registry is
    reached only here, and only for a name (`load_model` of a path never imports it)."""
    from speculant.models import registry

    if name in registry.KNOWN_MODELS:
        return registry.pull(name, progress=progress)
    if name.endswith(".gguf") or "/" in name or name.startswith("."):
        raise ModelLoadError(f"model file or folder {name!r} does not exist")
    known = ", ".join(sorted(registry.KNOWN_MODELS))
    raise registry.UnknownModelError(
        f"unknown model {name!r}: use a built-in name ({known}), a .gguf file, "
        "or a Hugging Face folder with config.json and *.safetensors"
    )
