"""Memory planning: weights of target and draft, their KV caches and working memory, per
dtype, against a budget or a named device.

Formulas (bytes; "rows" = tokens held by a cache):
    weights   = linear weights x bytes/weight (+ per-channel or per-group scales)
                + embedding table (kept in the activation dtype when weights are int)
                + norms and biases
    KV cache  = 2 (K and V) x layers x kv_heads x head_dim x rows x batch x activation bytes
                rows = context + 16 slack, rounded up to 64 (how the engine allocates;
                a draft model's cache holds 16 more positions for its drafts)
    working   = the largest transient of one forward: the prefill chunk (256 rows) through
                the MLP and attention scores over the whole context, or the logits of a
                verify pass, whichever is larger
    runtime   = the framework itself (PyTorch, Python) plus the tokenizer (grows with
                the vocabulary): measured, see RUNTIME_BYTES; plus, for a bfloat16 model on
                a CPU with bf16 instructions, the kernel cache PyTorch's bf16 matmuls keep
                there (one compiled kernel with its scratch per matrix shape and row
                count, ~0.75 MiB each, measured: see KERNEL_CACHE_BYTES)

This is the engine's own layout: int4 is group-wise (4 bits + a bf16 scale and zero per
group of 32: 5 bits a weight; a matrix whose shape the int4 kernel cannot take stays
int8, which the plan ignores). The estimate is checked against the engine's real
allocations in the tests, and against measured peak memory with `--measure`.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from speculant.models.config import ModelConfig

GiB = 1024**3
PREFILL_CHUNK = 256  # rows per prefill forward (Model.prefill)
CACHE_SLACK = 16
KEY_BLOCK = 64
RUNTIME_BYTES = 420 * 1024**2  # PyTorch + Python, measured on CPU
TOKENIZER_BYTES_PER_TOKEN = 700  # a loaded tokenizer's vocabulary and merges, measured
# On a CPU with bf16 instructions (AVX-512 BF16, AMX), PyTorch's oneDNN bf16 matmul keeps a
# kernel and its scratch for each (matrix shape, row count) it has run: ~0.75 MiB each,
# measured on an AVX-512 BF16 EPYC (24 row counts over one shape: 17-22 MiB). A model has 5
# matrix shapes (qkv, output, gate/up, down, LM head) and the engine runs each at the
# calibration's row counts plus prefill chunks and shifted batches (a few more).
KERNEL_CACHE_BYTES = 5 * (24 + 4) * 768 * 1024  # 24: numerics.CALIBRATION_ROWS

# Bytes per weight of the linear layers, and whether the embedding stays in the
# activation dtype (integer formats keep it so: lookups need no matmul kernel).
DTYPES: dict[str, tuple[float, int]] = {
    # name: (bytes per linear weight, activation bytes)
    "float32": (4.0, 4),
    "bfloat16": (2.0, 2),
    "float16": (2.0, 2),
    "int8": (1.0, 2),
    "int4": (5 / 8, 2),
}

# Usable memory of named devices (bytes) and the share an engine can plan for.
DEVICES: dict[str, tuple[int, float, str]] = {
    "A100-40GB": (40 * GiB, 0.9, "NVIDIA A100 40 GB"),
    "A100-80GB": (80 * GiB, 0.9, "NVIDIA A100 80 GB"),
    "H100-80GB": (80 * GiB, 0.9, "NVIDIA H100 80 GB"),
    "H200": (141 * 10**9, 0.9, "NVIDIA H200 141 GB"),
    "L4": (24 * GiB, 0.9, "NVIDIA L4 24 GB"),
    "RTX-4090": (24 * GiB, 0.9, "NVIDIA RTX 4090 24 GB"),
    "RTX-3090": (24 * GiB, 0.9, "NVIDIA RTX 3090 24 GB"),
}

# Shapes of the built-in models (their HF config.json fields), so a plan needs no download.
# They follow the registry's GGUF files: the Qwen pair's files carry their own LM head
# (output.weight), so they are untied here although the HF checkpoints tie them.
REGISTRY_CONFIGS: dict[str, dict[str, Any]] = {
    "qwen2.5-coder-1.5b-instruct": {
        "model_type": "qwen2",
        "vocab_size": 151936,
        "hidden_size": 1536,
        "num_hidden_layers": 28,
        "num_attention_heads": 12,
        "num_key_value_heads": 2,
        "intermediate_size": 8960,
        "max_position_embeddings": 32768,
        "tie_word_embeddings": False,
    },
    "qwen2.5-coder-0.5b-instruct": {
        "model_type": "qwen2",
        "vocab_size": 151936,
        "hidden_size": 896,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "intermediate_size": 4864,
        "max_position_embeddings": 32768,
        "tie_word_embeddings": False,
    },
    "smollm2-135m-instruct": {
        "model_type": "llama",
        "vocab_size": 49152,
        "hidden_size": 576,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "intermediate_size": 1536,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": True,
    },
    "gemma-3-270m": {
        "model_type": "gemma3_text",
        "vocab_size": 262144,
        "hidden_size": 640,
        "num_hidden_layers": 18,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 256,
        "intermediate_size": 2048,
        "max_position_embeddings": 32768,
        "sliding_window": 512,
        "tie_word_embeddings": True,
    },
}


class PlanError(ValueError):
    """A model, dtype, device or size the planner cannot use."""


def resolve_config(name_or_path: str) -> tuple[str, ModelConfig]:
    """A model's shape from a registry name, a .gguf file (header only), a Hugging Face
    folder, or any HF config.json."""
    from speculant.models.loader import config_from_gguf, config_from_hf

    if name_or_path in REGISTRY_CONFIGS:
        return name_or_path, config_from_hf(REGISTRY_CONFIGS[name_or_path])
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        path = path / "config.json"
    if path.suffix == ".gguf" and path.is_file():
        from speculant.models.gguf_file import read_gguf

        return path.name, config_from_gguf(read_gguf(path))
    if path.is_file():
        try:
            cfg = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            raise PlanError(f"{path}: not a readable JSON config ({exc})") from None
        try:
            return path.parent.name or path.name, config_from_hf(cfg)
        except KeyError as exc:
            raise PlanError(f"{path}: config.json lacks the field {exc}") from None
    known = ", ".join(sorted(REGISTRY_CONFIGS))
    raise PlanError(
        f"model {name_or_path!r} not found: use a built-in name ({known}), a .gguf file, "
        "a Hugging Face folder or a config.json"
    )


@dataclass(frozen=True)
class ModelPlan:
    name: str
    dtype: str
    params: int
    weights_bytes: int
    kv_bytes: int
    working_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.kv_bytes + self.working_bytes


def _check_dtype(dtype: str) -> tuple[float, int]:
    if dtype not in DTYPES:
        raise PlanError(f"dtype {dtype!r} is not known: use one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


def weights_bytes(c: ModelConfig, dtype: str) -> int:
    per_weight, act = _check_dtype(dtype)
    d, hd = c.dim, c.head_dim
    qkv_out = (c.n_heads + 2 * c.n_kv_heads) * hd
    layer_out_in = [(qkv_out, d), (d, c.n_heads * hd), (2 * c.ffn_dim, d), (d, c.ffn_dim)]
    linear = c.n_layers * sum(o * i for o, i in layer_out_in)
    head = c.vocab_size * d  # the LM head (a separate copy once quantised, even when tied)
    scales = 0
    if dtype == "int8":  # one bf16 scale per output channel
        scales = 2 * (c.n_layers * sum(o for o, _ in layer_out_in) + c.vocab_size)
    small = c.n_layers * (2 + (2 if c.sandwich_norm else 0)) * d + d
    if c.qkv_bias:
        small += c.n_layers * qkv_out
    if c.qk_norm:
        small += c.n_layers * 2 * hd
    embedding = c.vocab_size * d * act
    integer = dtype in ("int8", "int4")
    tied_float = c.tie_embeddings and not integer
    head_bytes = 0 if tied_float else head * per_weight
    return int(linear * per_weight + head_bytes + embedding + scales + small * act)


def cache_rows(context: int, draft: bool = False) -> int:
    rows = context + (16 if draft else 0) + CACHE_SLACK
    return -(-rows // KEY_BLOCK) * KEY_BLOCK


KV_BYTES = {"float32": 4, "float16": 2}  # the caches' element types besides "auto"


def kv_bytes(
    c: ModelConfig,
    dtype: str,
    context: int,
    batch: int,
    draft: bool = False,
    kv_dtype: str = "auto",
) -> int:
    """The caches' bytes: elements of the activations' size (kv_dtype "auto"), or of
    kv_dtype's (float32, float16: `--kv-dtype`)."""
    _, act = _check_dtype(dtype)
    if kv_dtype != "auto":
        if kv_dtype not in KV_BYTES:
            known = ", ".join(("auto", *KV_BYTES))
            raise PlanError(f"kv dtype {kv_dtype!r} is not known: use {known}")
        act = KV_BYTES[kv_dtype]
    rows = cache_rows(context, draft)
    return 2 * c.n_layers * c.n_kv_heads * c.head_dim * rows * batch * act


def working_bytes(c: ModelConfig, dtype: str, context: int, batch: int, k: int) -> int:
    _, act = _check_dtype(dtype)
    rows = min(PREFILL_CHUNK, context)
    span = cache_rows(context)
    mlp = rows * (2 * c.ffn_dim + c.ffn_dim) * act
    scores = c.n_heads * rows * span * (act + 4 + act)  # scores, float softmax, probs
    hidden = rows * c.dim * act * 6
    prefill = mlp + scores + hidden
    verify_rows = batch * (k + 1)
    verify = verify_rows * c.vocab_size * 4 * 3  # logits, processed p, a working copy
    return int(max(prefill, verify))


def plan_model(
    name: str,
    c: ModelConfig,
    dtype: str,
    context: int,
    batch: int,
    k: int,
    draft: bool,
    kv_dtype: str = "auto",
) -> ModelPlan:
    if context < 1 or batch < 1:
        raise PlanError(f"context={context}, batch={batch}: both must be >= 1")
    if context > c.max_seq_len:
        raise PlanError(
            f"context={context} is beyond {name}'s {c.max_seq_len}-token context: "
            f"use at most {c.max_seq_len}"
        )
    return ModelPlan(
        name=name,
        dtype=dtype,
        params=c.num_params,
        weights_bytes=weights_bytes(c, dtype),
        kv_bytes=kv_bytes(c, dtype, context, batch, draft, kv_dtype),
        working_bytes=working_bytes(c, dtype, context, batch, k if draft else 0),
    )


@dataclass(frozen=True)
class Plan:
    target: ModelPlan
    draft: ModelPlan | None
    context: int
    batch: int
    runtime_bytes: int = RUNTIME_BYTES
    prefix_cache_bytes: int = 0  # the server's prefix cache budget (`--prefix-cache-gib`)

    @property
    def total_bytes(self) -> int:
        parts = [self.target.total_bytes, self.runtime_bytes, self.prefix_cache_bytes]
        if self.draft is not None:
            # Working memory is reused: the draft and the target do not run at once.
            parts.append(self.draft.weights_bytes + self.draft.kv_bytes)
            extra = max(0, self.draft.working_bytes - self.target.working_bytes)
            parts.append(extra)
        return sum(parts)

    def to_dict(self) -> dict[str, Any]:
        def model(m: ModelPlan | None) -> dict[str, Any] | None:
            if m is None:
                return None
            return {
                "name": m.name,
                "dtype": m.dtype,
                "params": m.params,
                "weights_bytes": m.weights_bytes,
                "kv_cache_bytes": m.kv_bytes,
                "working_bytes": m.working_bytes,
            }

        return {
            "target": model(self.target),
            "draft": model(self.draft),
            "context": self.context,
            "batch": self.batch,
            "runtime_bytes": self.runtime_bytes,
            "prefix_cache_bytes": self.prefix_cache_bytes,
            "total_bytes": self.total_bytes,
        }


def make_plan(
    target: str,
    draft: str | None = None,
    *,
    context: int = 4096,
    batch: int = 1,
    target_dtype: str = "bfloat16",
    draft_dtype: str = "int8",
    k: int = 5,
    prefix_cache_bytes: int = 0,
    kv_dtype: str = "auto",
) -> Plan:
    if prefix_cache_bytes < 0:
        raise PlanError(f"prefix cache budget {prefix_cache_bytes} bytes: 0 or more is allowed")
    tname, tcfg = resolve_config(target)
    tplan = plan_model(tname, tcfg, target_dtype, context, batch, k, False, kv_dtype)
    dplan = None
    if draft is not None:
        dname, dcfg = resolve_config(draft)
        if dcfg.vocab_size > tcfg.vocab_size:
            raise PlanError(
                f"draft {dname} has {dcfg.vocab_size} tokens, more than target {tname}'s "
                f"{tcfg.vocab_size}: they cannot share a tokenizer"
            )
        dplan = plan_model(dname, dcfg, draft_dtype, context, batch, k, True, kv_dtype)
    runtime = RUNTIME_BYTES + TOKENIZER_BYTES_PER_TOKEN * tcfg.vocab_size
    if cpu_has_bf16():
        bf16_models = [target_dtype] + ([draft_dtype] if draft is not None else [])
        runtime += KERNEL_CACHE_BYTES * bf16_models.count("bfloat16")
    return Plan(tplan, dplan, context, batch, runtime, prefix_cache_bytes)


def cpu_has_bf16() -> bool:
    """Whether this machine's CPU has bf16 matrix instructions (/proc/cpuinfo flags)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    flags = next((line for line in text.splitlines() if line.startswith("flags")), "")
    return bool({"avx512_bf16", "amx_bf16"} & set(flags.split()))


def machine_memory() -> int:
    """This machine's RAM (MemTotal), or 0 when unknown."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 0


def parse_size(text: str) -> int:
    """'24GiB', '80GB', '512MiB', '1.5TB', or plain bytes."""
    units = {
        "tib": 1024**4,
        "gib": GiB,
        "mib": 1024**2,
        "kib": 1024,
        "tb": 10**12,
        "gb": 10**9,
        "mb": 10**6,
        "kb": 10**3,
        "b": 1,
    }
    raw = text.strip().lower().replace(" ", "")
    number, factor = raw, 1
    for unit, size in units.items():
        if raw.endswith(unit):
            number, factor = raw[: -len(unit)], size
            break
    try:
        value = float(number)
    except ValueError:
        raise PlanError(f"memory {text!r}: use a size like 24GiB, 80GB or 512MiB") from None
    if value <= 0:
        raise PlanError(f"memory {text!r} must be positive")
    return int(value * factor)


def device_budget(name: str) -> tuple[int, str]:
    """(usable bytes, description) of a named device or 'cpu' (this machine's RAM)."""
    if name.lower() in ("cpu", "this-machine", "host"):
        total = machine_memory()
        if not total:
            raise PlanError("this machine's memory size could not be read: pass --memory")
        return int(total * 0.9), f"this machine's RAM ({total / GiB:.1f} GiB, 90% usable)"
    for key, (total, share, text) in DEVICES.items():
        if key.lower() == name.lower():
            return int(total * share), f"{text} ({share:.0%} usable)"
    known = ", ".join([*DEVICES, "cpu"])
    raise PlanError(f"device {name!r} is not known: use one of {known}, or --memory SIZE")
