"""Export a head in the EAGLE-1 checkpoint layout that vLLM and SGLang load.

Both engines load a one-layer Llama-style draft model whose tensors are named without a
`model.` prefix and take the embedding and the LM head from the target:

    fc.weight                                   [dim, 2*dim]   (embedding first)
    layers.0.self_attn.{q,k,v,o}_proj.weight    (+ q/k/v biases for Qwen2 targets)
    layers.0.mlp.{gate,up,down}_proj.weight
    layers.0.post_attention_layernorm.weight    (no input_layernorm: EAGLE-1 skips it)

They differ in two places, so the export writes one folder for each:

* vllm/: `fc` has no bias, and the architecture is "LlamaForCausalLM" (vLLM renames it
  to EagleLlamaForCausalLM itself; it has no Qwen2 EAGLE class, so a Qwen2 head is
  described as Llama with "qkv_bias": true, which gives the same q/k/v biases).
* sglang/: `fc.bias` is always read (zeros here, as this engine trains without it),
  and the architecture must already name the EAGLE class: "LlamaForCausalLMEagle" or
  "Qwen2ForCausalLMEagle".

A reduced draft vocabulary has no place in the EAGLE-1 layout (vLLM reads one only for
EAGLE-3): those engines draft over the full vocabulary with the target's LM head. The
draft vocabulary is written beside the SGLang folder as hot_token_ids.pt for SGLang's
--speculative-token-map. See docs/eagle.md for the commands and what was checked.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import Tensor

from speculant.eagle.head import EagleHead, HeadConfig, load_head
from speculant.models import archs

# our parameter name -> the EAGLE checkpoint's
_NAMES = {
    "fc.weight": "fc.weight",
    "q_proj.weight": "layers.0.self_attn.q_proj.weight",
    "k_proj.weight": "layers.0.self_attn.k_proj.weight",
    "v_proj.weight": "layers.0.self_attn.v_proj.weight",
    "q_proj.bias": "layers.0.self_attn.q_proj.bias",
    "k_proj.bias": "layers.0.self_attn.k_proj.bias",
    "v_proj.bias": "layers.0.self_attn.v_proj.bias",
    "o_proj.weight": "layers.0.self_attn.o_proj.weight",
    "post_attention_layernorm": "layers.0.post_attention_layernorm.weight",
    "gate_proj.weight": "layers.0.mlp.gate_proj.weight",
    "up_proj.weight": "layers.0.mlp.up_proj.weight",
    "down_proj.weight": "layers.0.mlp.down_proj.weight",
}


def eagle_tensors(head: EagleHead, *, fc_bias: bool) -> dict[str, Tensor]:
    """The head's weights under EAGLE checkpoint names (bfloat16, contiguous)."""
    state = head.state_dict()
    out = {
        theirs: state[ours].detach().to(torch.bfloat16).contiguous()
        for ours, theirs in _NAMES.items()
        if ours in state
    }
    if fc_bias:
        bias = state.get("fc.bias")
        out["fc.bias"] = (
            bias.detach().to(torch.bfloat16)
            if bias is not None
            else torch.zeros(head.cfg.dim, dtype=torch.bfloat16)
        )
    return out


def eagle_config(cfg: HeadConfig, engine: str, max_positions: int = 32768) -> dict[str, object]:
    """config.json of the exported head for `engine` ("vllm" or "sglang")."""
    if engine == "vllm":
        arch, model_type = "LlamaForCausalLM", "llama"
    else:
        arch = archs.ARCHS[cfg.arch].eagle_class or "LlamaForCausalLMEagle"
        model_type = cfg.arch
    config: dict[str, object] = {
        "architectures": [arch],
        "model_type": model_type,
        "hidden_size": cfg.dim,
        "intermediate_size": cfg.ffn_dim,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "num_hidden_layers": 1,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": max_positions,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }
    if engine == "vllm" and cfg.qkv_bias:
        config["qkv_bias"] = True  # q/k/v biases on vLLM's Llama layer (no "bias" key!)
        config["attention_bias"] = False
    return config


def export_head(
    head_dir: str | Path, out: str | Path, *, trust_unverified: bool = False
) -> dict[str, Path]:
    """Write out/vllm and out/sglang (model.safetensors + config.json each)."""
    from safetensors.torch import save_file

    head = load_head(head_dir, trust_unverified=trust_unverified)
    out = Path(out)
    paths = {}
    for engine in ("vllm", "sglang"):
        folder = out / engine
        folder.mkdir(parents=True, exist_ok=True)
        tensors = eagle_tensors(head, fc_bias=engine == "sglang")
        tmp = folder / "model.safetensors.tmp"
        save_file(tensors, str(tmp), metadata={"format": "pt"})
        tmp.replace(folder / "model.safetensors")
        (folder / "config.json").write_text(
            json.dumps(eagle_config(head.cfg, engine), indent=2) + "\n"
        )
        paths[engine] = folder
    if head.cfg.draft_vocab_size < head.cfg.vocab_size:
        torch.save(head.draft_vocab.clone(), out / "sglang" / "hot_token_ids.pt")  # type: ignore[operator]
    return paths


def import_eagle(folder: str | Path, like: HeadConfig) -> EagleHead:
    """Read an exported EAGLE checkpoint back into a head shaped like `like` (the
    round-trip check: exported tensors must rebuild the same head)."""
    from safetensors.torch import load_file

    tensors = load_file(str(Path(folder) / "model.safetensors"))
    head = EagleHead(like)
    state = head.state_dict()
    for ours, theirs in _NAMES.items():
        if ours in state:
            state[ours] = tensors[theirs].float()
    if like.fc_bias:
        state["fc.bias"] = tensors["fc.bias"].float()
    head.load_state_dict(state)
    return head
