"""The architectures Speculant implements, one description each (see `base`).

`config_from_hf` / `config_from_gguf` turn a config.json or a GGUF header into the
decoder's `ModelConfig` through the description of its architecture; `tensor_names`
gives the loader its tensor names. An architecture that is not listed here is refused
by name, as is any setting of a listed one that its description does not implement.
"""

from __future__ import annotations

from typing import Any

from speculant.models.archs import (
    gemma2,
    gemma3,
    granite,
    llama,
    olmo2,
    phi3,
    qwen2,
    qwen3,
    smollm3,
)
from speculant.models.archs.base import (
    Arch,
    ArchError,
    Fields,
    check_math_keys,
    check_unread,
    common_gguf,
    common_hf,
)
from speculant.models.config import ModelConfig

__all__ = ["ARCHS", "Arch", "ArchError", "config_from_gguf", "config_from_hf", "for_config"]

ARCHS: dict[str, Arch] = {
    a.name: a
    for a in (
        llama.ARCH,
        qwen2.ARCH,
        qwen3.ARCH,
        gemma2.ARCH,
        gemma3.ARCH,
        granite.ARCH,
        olmo2.ARCH,
        phi3.ARCH,
        smollm3.ARCH,
    )
}
_BY_HF_TYPE = {t: a for a in ARCHS.values() for t in a.hf_types}

# Our roles -> tensor names, Llama's spelling; an Arch overrides the names that differ.
HF_NAMES = {
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
    "ffn_norm": "model.layers.{i}.post_attention_layernorm.weight",
    "gate": "model.layers.{i}.mlp.gate_proj.weight",
    "up": "model.layers.{i}.mlp.up_proj.weight",
    "down": "model.layers.{i}.mlp.down_proj.weight",
}
GGUF_NAMES = {
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


def for_config(config: ModelConfig) -> Arch:
    return ARCHS[config.arch]


def check_eagle_target(config: ModelConfig) -> str:
    """The SGLang class of an EAGLE head for a target of `config`'s family; a family whose
    description names none is refused by name."""
    name = ARCHS[config.arch].eagle_class
    if name is None:
        allowed = ", ".join(sorted(a.name for a in ARCHS.values() if a.eagle_class))
        raise ArchError(f"EAGLE heads support {allowed} targets, not {config.arch!r}")
    return name


def hf_names(arch: Arch) -> dict[str, str]:
    return {**HF_NAMES, **arch.hf_names}


def gguf_names(arch: Arch) -> dict[str, str]:
    return {**GGUF_NAMES, **arch.gguf_names}


def config_from_hf(cfg: dict[str, Any], where: str = "config.json") -> ModelConfig:
    """The ModelConfig of a Hugging Face config.json (multimodal wrappers: their text
    model's)."""
    model_type = cfg.get("model_type")
    if isinstance(cfg.get("text_config"), dict):
        inner = cfg["text_config"]
        cfg = {**inner, "model_type": inner.get("model_type", f"{model_type}_text")}
        model_type = cfg["model_type"]
    arch = _BY_HF_TYPE.get(str(model_type))
    if arch is None:
        raise ArchError(
            f"{where}: model_type {model_type!r} is not supported: use one of "
            f"{', '.join(sorted(_BY_HF_TYPE))}"
        )
    f = Fields(cfg, where)
    f.get("model_type")
    out: dict[str, Any] = {"arch": arch.name, **common_hf(f)}
    arch.hf(f, out)
    check_math_keys(f)
    return _config(out, where)


def config_from_gguf(index: Any) -> ModelConfig:
    """The ModelConfig of a GGUF file's header (`gguf_file.GGUFIndex`)."""
    name = index.metadata.get("general.architecture")
    arch = ARCHS.get(str(name))
    if arch is None:
        raise ArchError(
            f"{index.path}: GGUF architecture {name!r} is not supported: use one of "
            f"{', '.join(sorted(ARCHS))}"
        )
    f = Fields(index.metadata, str(index.path), prefix=f"{arch.name}.")
    out: dict[str, Any] = {"arch": arch.name, **common_gguf(f, index)}
    if out["rope_dim"] and not arch.partial_rotary:
        raise f.refuse("rope.dimension_count", out["rope_dim"], f"{out['head_dim']} (all)")
    arch.gguf(f, out, index)
    check_unread(f, list(index.metadata))
    return _config(out, str(index.path))


def _config(fields: dict[str, Any], where: str) -> ModelConfig:
    try:
        return ModelConfig(**fields)
    except ValueError as exc:  # fields that contradict each other
        raise ArchError(f"{where}: {exc}") from None
