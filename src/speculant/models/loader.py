"""Weight loaders: GGUF files (dequantized with `gguf`) and Hugging Face directories.

Both produce a `ModelConfig` and a `Weights` object in our canonical layout:
fused QKV and gate/up projections, Gemma norms as effective (1 + w) multipliers,
rotate-half RoPE ordering for Q and K.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from speculant.models import archs
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
        fused = get(names["qkv"].format(i=i)) if "qkv" in names else None  # Phi-3's
        qkv = fused if fused is not None else torch.cat([need("q", i), need("k", i), need("v", i)])
        bias = None
        if config.qkv_bias:
            bias = cast(torch.cat([need("q_bias", i), need("k_bias", i), need("v_bias", i)]))
        if "gate_up" in names:
            gate_up = need("gate_up", i)
        else:
            gate_up = torch.cat([need("gate", i), need("up", i)])
        layers.append(
            LayerWeights(
                attn_norm=cast(need("attn_norm", i)) if config.pre_norm else None,
                wqkv=cast(qkv),
                wo=cast(need("o", i)),
                ffn_norm=cast(need("ffn_norm", i)) if config.pre_norm else None,
                w_gate_up=cast(gate_up),
                w_down=cast(need("down", i)),
                bqkv=bias,
                q_norm=opt("q_norm", i, config.qk_norm),
                k_norm=opt("k_norm", i, config.qk_norm),
                post_attn_norm=opt("post_attn_norm", i, config.sandwich_norm),
                post_ffn_norm=opt("post_ffn_norm", i, config.sandwich_norm),
            )
        )
    return Weights(tok_embeddings=emb, norm=cast(need("norm")), output=output, layers=layers)


# ------------------------------------------------------------------------ shapes
def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Each role's shape in our layout ([out, in] for a matrix), from the config: what
    a file's tensors are checked against before anything is read."""
    c = config
    q, kv = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
    return {
        "embed": (c.vocab_size, c.dim),
        "output": (c.vocab_size, c.dim),
        "norm": (c.dim,),
        "attn_norm": (c.dim,),
        "ffn_norm": (c.dim,),
        "post_attn_norm": (c.dim,),
        "post_ffn_norm": (c.dim,),
        "q": (q, c.dim),
        "k": (kv, c.dim),
        "v": (kv, c.dim),
        "qkv": (q + 2 * kv, c.dim),
        "o": (c.dim, q),
        "q_bias": (q,),
        "k_bias": (kv,),
        "v_bias": (kv,),
        "q_norm": (q,) if c.qk_norm_all_heads else (c.head_dim,),
        "k_norm": (kv,) if c.qk_norm_all_heads else (c.head_dim,),
        "gate": (c.ffn_dim, c.dim),
        "up": (c.ffn_dim, c.dim),
        "gate_up": (2 * c.ffn_dim, c.dim),
        "down": (c.dim, c.ffn_dim),
    }


def check_shapes(
    config: ModelConfig, names: dict[str, str], shapes: dict[str, tuple[int, ...]], where: str
) -> None:
    """Refuse the first tensor of `shapes` ({name: shape in our layout}) whose shape is
    not what the config makes of its role (a transposed matrix, a norm of another width,
    a fused tensor of the wrong size). Phi-3's GGUF `ffn_up` holds gate and up: its
    role is gate_up where the names say so."""
    want = expected_shapes(config)
    fused = {names[role] for role in ("qkv", "gate_up") if role in names}
    for role, pattern in names.items():
        if role not in want or (pattern in fused and role not in ("qkv", "gate_up")):
            continue  # a fused tensor's name is checked for the fused role only
        for i in range(config.n_layers if "{i}" in pattern else 1):
            name = pattern.format(i=i)
            if name not in shapes:
                continue
            shape, expected = tuple(shapes[name]), want[role]
            if shape != expected:
                raise ModelLoadError(
                    f"{where}: tensor {name} has shape {list(shape)}; the config makes it "
                    f"{list(expected)} ({role}; [out, in] for a matrix)"
                )


_TOKEN_ID_KEYS = (
    "bos_token_id",
    "eos_token_id",
    "eot_token_id",
    "eom_token_id",
    "padding_token_id",
    "unknown_token_id",
    "seperator_token_id",  # sic: llama.cpp's spelling
    "cls_token_id",
    "mask_token_id",
)


def check_gguf_tokenizer(index: GGUFIndex, config: ModelConfig) -> None:
    """Before a GGUF tokenizer is converted: no more tokens than the model has embedding
    rows, and every special token id a token of the list."""
    meta = index.metadata
    count = meta.get("tokenizer.ggml.tokens")  # the list's length (not read)
    if count is None:
        return
    if not isinstance(count, int) or count > config.vocab_size:
        raise ModelLoadError(
            f"{index.path}: tokenizer.ggml.tokens holds {count} tokens but the model has "
            f"{config.vocab_size} embedding rows: a token past them could never be decoded"
        )
    for key in ("token_type", "scores"):  # one per token, where present
        other = meta.get(f"tokenizer.ggml.{key}")
        if isinstance(other, list) and len(other) != count:
            raise ModelLoadError(
                f"{index.path}: tokenizer.ggml.{key} has {len(other)} entries for "
                f"{count} tokens: need one per token"
            )
    for key in _TOKEN_ID_KEYS:
        value = meta.get(f"tokenizer.ggml.{key}")
        for v in value if isinstance(value, list) else [value]:
            if v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < count:
                raise ModelLoadError(
                    f"{index.path}: metadata tokenizer.ggml.{key}={v!r} is not allowed: a "
                    f"token id from 0 to {count - 1}"
                )


# --------------------------------------------------------------------------- HF folders
def config_from_hf(cfg: dict[str, Any], where: str = "config.json") -> ModelConfig:
    try:
        return archs.config_from_hf(cfg, where)
    except archs.ArchError as exc:
        raise ModelLoadError(str(exc)) from None


def load_hf_dir(path: Path, dtype: torch.dtype) -> tuple[ModelConfig, Weights]:
    from safetensors import safe_open

    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ModelLoadError(f"{path} has no config.json: not a Hugging Face model folder")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path} has no *.safetensors weights")
    config = config_from_hf(json.loads(cfg_file.read_text()), str(cfg_file))
    # canonical name -> (file handle, name in the file); multimodal wrappers nest the
    # text model under "language_model".
    source: dict[str, tuple[Any, str]] = {}
    for f in files:
        handle = safe_open(str(f), framework="pt")
        for key in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
            canon = key.replace("model.language_model.", "model.", 1)
            source[canon.removeprefix("language_model.")] = (handle, key)

    plus_one = archs.for_config(config).hf_norm_plus_one
    names = archs.hf_names(archs.for_config(config))
    check_shapes(
        config,
        names,
        {name: tuple(h.get_slice(k).get_shape()) for name, (h, k) in source.items()},
        str(path),
    )

    def get(name: str) -> Tensor | None:
        if name not in source:
            return None
        handle, key = source[name]
        t = handle.get_tensor(key).float()
        if plus_one and name.endswith("norm.weight"):
            t = t + 1.0  # an RMSNorm that multiplies by (1 + w)
        order = _partial_rotary_rows(config, names, name)
        return t if order is None else t[order]

    return config, _assemble(config, get, names, dtype)


# --------------------------------------------------------------------------------- GGUF
def config_from_gguf(index: GGUFIndex) -> ModelConfig:
    try:
        return archs.config_from_gguf(index)
    except archs.ArchError as exc:
        raise ModelLoadError(str(exc)) from None


def _unpermute_rope(w: Tensor, n_heads: int) -> Tensor:
    """Undo the llama.cpp converter's Q/K row permutation (interleaved -> rotate-half)."""
    rows = w.shape[0]
    return (
        w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)
    )


def _partial_rotary_rows(config: ModelConfig, names: dict[str, str], name: str) -> Tensor | None:
    """Where a head rotates only its first rope_dim dimensions (partial rotary), the rows
    of a q / k projection (or the fused qkv, or a bias) in the decoder's order: each
    head's rotated pairs first in either half, its unrotated dimensions after them (see
    attention.rope_tables). None for any other tensor, or a fully rotated model."""
    hd, rot = config.head_dim, config.rotary_dim
    if rot == hd:
        return None
    role = _role_of(names, name)
    if role not in ("q", "k", "qkv", "q_bias", "k_bias"):
        return None
    half, rest = rot // 2, (hd - rot) // 2
    head = torch.cat(
        [
            torch.arange(half),
            torch.arange(rot, rot + rest),
            torch.arange(half, rot),
            torch.arange(rot + rest, hd),
        ]
    )

    def heads(n: int, base: int) -> Tensor:
        return torch.cat([base + h * hd + head for h in range(n)])

    nh, nkv = config.n_heads, config.n_kv_heads
    if role in ("q", "q_bias"):
        return heads(nh, 0)
    if role in ("k", "k_bias"):
        return heads(nkv, 0)
    v = torch.arange((nh + nkv) * hd, (nh + 2 * nkv) * hd)
    return torch.cat([heads(nh, 0), heads(nkv, nh * hd), v])


def _role_of(names: dict[str, str], name: str) -> str | None:
    """The role whose per-layer name pattern ("...{i}...") `name` is."""
    for role, pattern in names.items():
        before, sep, after = pattern.partition("{i}")
        if sep and name.startswith(before) and name.endswith(after):
            middle = name[len(before) : len(name) - len(after)]
            if middle.isdigit():
                return role
    return None


def _rope_heads(config: ModelConfig, name: str) -> int | None:
    """Heads of a llama Q / K projection whose rows need `_unpermute_rope`, else None."""
    interleaved = archs.for_config(config).gguf_qk_interleaved
    if interleaved and name.endswith(("attn_q.weight", "attn_k.weight")):
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
    if heads is not None:
        out = _unpermute_rope(out, heads)
    order = _partial_rotary_rows(config, archs.gguf_names(archs.for_config(config)), name)
    return out if order is None else out[order]


def _open_gguf(
    path: Path, progress: Callable[[int, int], None] | None
) -> tuple[GGUFIndex, ModelConfig, Callable[[], None]]:
    """The file's index, its config (its tensors' shapes checked against it), and a
    tick() that reports one more tensor read."""
    try:
        index = read_gguf(path)
    except GGUFError as exc:
        raise ModelLoadError(str(exc)) from exc
    config = config_from_gguf(index)
    names = archs.gguf_names(archs.for_config(config))
    check_shapes(
        config, names, {n: tuple(reversed(t.shape)) for n, t in index.tensors.items()}, str(path)
    )
    check_gguf_tokenizer(index, config)
    done = [0]

    def tick() -> None:
        done[0] += 1
        if progress is not None:
            progress(done[0], len(index.tensors))

    return index, config, tick


def check_gguf(path: Path) -> ModelConfig:
    """The config of a GGUF file whose header passes every check a load makes (its
    metadata, tensor table, shapes and tokenizer), read without its tensors."""
    return _open_gguf(path, None)[1]


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

    return config, _assemble(config, get, archs.gguf_names(archs.for_config(config)), dtype)


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
    names = archs.gguf_names(archs.for_config(config))

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
        order = _partial_rotary_rows(config, names, name)
        if order is not None:
            raw = raw[order]  # whole rows move (a copy), blocks intact
        return info.ggml_type, raw.reshape(-1), n

    def need(role: str, i: int | None = None) -> str:
        name = names[role].format(i=i)
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
        present = names[role].format(i=i) in index.tensors
        return need_vec(role, i) if wanted and present else None

    emb = projection(need("embed"), lookup=True)
    output = emb
    if not config.tie_embeddings:
        # its stored rows stay mapped (no copy) for EAGLE heads, which read LM-head rows
        output = projection(need("output"), lookup=True)
        if isinstance(output, GGUFWeight):
            output.matrix.pack()
    elif isinstance(emb, GGUFWeight):
        emb.matrix.pack()  # the LM head too
    layers = []
    for i in range(config.n_layers):
        bias = None
        if config.qkv_bias:
            bias = torch.cat([need_vec("q_bias", i), need_vec("k_bias", i), need_vec("v_bias", i)])
        if "qkv" in names and names["qkv"].format(i=i) in index.tensors:  # Phi-3's fused
            wqkv = projection(need("qkv", i))
        else:
            wqkv = projection(need("q", i), need("k", i), need("v", i))
        if "gate_up" in names:
            gate_up = projection(need("gate_up", i))
        else:
            gate_up = projection(need("gate", i), need("up", i))
        layers.append(
            LayerWeights(
                attn_norm=need_vec("attn_norm", i) if config.pre_norm else None,
                wqkv=wqkv,
                wo=projection(need("o", i)),
                ffn_norm=need_vec("ffn_norm", i) if config.pre_norm else None,
                w_gate_up=gate_up,
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
    """The GGUF file of the built-in model `name`, pulled on first use, or the file or
    folder a user recorded under `name` (speculant models add). Anything else that is not
    an existing path is refused, naming what is allowed. The download registry is
    reached only here, and only for a name (`load_model` of a path never imports it)."""
    from speculant.models import added, registry

    if name in registry.KNOWN_MODELS:
        return registry.pull(name, progress=progress)
    recorded = added.path_of(name)
    if recorded is not None:
        if not recorded.exists():
            raise ModelLoadError(
                f"model {name!r} was added from {recorded}, which no longer exists: add it "
                "again (speculant models add PATH --name NAME) or remove it"
            )
        return recorded
    if name.endswith(".gguf") or "/" in name or name.startswith("."):
        raise ModelLoadError(f"model file or folder {name!r} does not exist")
    known = ", ".join(sorted(registry.KNOWN_MODELS))
    mine = ", ".join(sorted(added.records()))
    raise registry.UnknownModelError(
        f"unknown model {name!r}: use a built-in name ({known})"
        + (f", an added one ({mine})" if mine else "")
        + ", a .gguf file, or a Hugging Face folder with config.json and *.safetensors"
    )
