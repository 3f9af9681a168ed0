"""The tests' own GGUF writer: a tiny transformers model of any implemented architecture,
written as llama.cpp's converter (`convert_hf_to_gguf.py`) writes it.

It follows the converter's choices, not our loader's (checked against the converter's
output for each family: the same metadata keys, tensor names, shapes and row order):
- Q / K rows interleaved for llama.cpp's "normal" rope (llama, granite, smollm3);
- Llama 3.1 scaling as a `rope_freqs.weight` tensor of per-frequency divisors;
- YaRN as rope.scaling.* keys; Granite's multipliers as its four scale keys;
- SmolLM3's no-rope layers as nothing at all (llama.cpp's fixed interval of 4).

Matrices are written in `qtype` (Q8_0 runs on the native kernels, F32 through PyTorch);
`round_trip` then gives the transformers model the same (dequantized) weights, so it is
the exact float32 reference of the file.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "the quick brown fox jumps over the lazy dog",
    "copy this list: red, green, blue, red, green, blue",
]
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
INTERLEAVED = {"llama", "granite", "smollm3", "mistral"}  # llama.cpp's "normal" rope
GGUF_ARCH = {"mistral": "llama"}


def tiny_tokenizer() -> Any:
    """A byte-level BPE of 300 tokens trained on a few lines (the first three special)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 10, trainer)
    return tok


def interleave(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Per head, rows (i, i + d/2) of rotate-half order become rows (2i, 2i + 1)."""
    rows = w.shape[0]
    return w.reshape(n_heads, 2, rows // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_rope_freqs(cfg: Any) -> np.ndarray:
    """The converter's rope_freqs: 1 for short wavelengths, `factor` for long ones, the
    reciprocal of the smooth blend between."""
    params = cfg.rope_parameters
    base = params["rope_theta"]
    dim = cfg.head_dim
    factor = params.get("factor", 8.0)
    low, high = params.get("low_freq_factor", 1.0), params.get("high_freq_factor", 4.0)
    orig = params.get("original_max_position_embeddings", 8192)
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    low_wavelen, high_wavelen = orig / low, orig / high
    out = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(factor)
        else:
            smooth = (orig / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def _quantize(w: torch.Tensor, qtype: Any) -> tuple[np.ndarray, torch.Tensor]:
    from gguf.quants import dequantize, quantize

    arr = w.detach().float().numpy()
    if qtype.name == "F32":
        return arr, w.detach().float()
    data = quantize(arr, qtype)
    back = torch.from_numpy(np.array(dequantize(data, qtype), dtype=np.float32)).reshape(w.shape)
    return data, back


def write_gguf(
    model: Any,
    path: Path,
    qtype_name: str = "Q8_0",
    round_trip: bool = True,
    chat_template: str = CHATML,
    renamed: dict[int, str] | None = None,
) -> Path:
    """Write `model` (a transformers CausalLM) as a GGUF file at `path`; with
    round_trip, the model's matrices become their dequantized values."""
    import gguf

    qtype = gguf.GGMLQuantizationType[qtype_name]
    cfg = model.config
    hf_arch = cfg.model_type
    arch = GGUF_ARCH.get(hf_arch, hf_arch)
    n_heads, n_kv = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // n_heads
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(n_heads)
    w.add_head_count_kv(n_kv)
    params = cfg.rope_parameters
    if arch != "gemma2":  # Gemma 2's converter leaves llama.cpp's default base
        w.add_rope_freq_base(params["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    if arch in ("llama", "granite", "smollm3"):
        w.add_vocab_size(cfg.vocab_size)
        w.add_rope_dimension_count(head_dim)
    if arch not in ("granite", "phi3"):  # written where config.json has head_dim
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    rope_type = params.get("rope_type", "default")
    if arch == "phi3":  # the converter writes Phi-3's own set of keys
        rot = int(params.get("partial_rotary_factor", 1.0) * cfg.hidden_size) // n_heads
        w.add_rope_dimension_count(rot)
        w.add_rope_scaling_orig_ctx_len(params["original_max_position_embeddings"])
        w.add_sliding_window(cfg.sliding_window or 0)
        if rope_type == "longrope":
            scale = cfg.max_position_embeddings / params["original_max_position_embeddings"]
            orig = params["original_max_position_embeddings"]
            attn = math.sqrt(1 + math.log(scale) / math.log(orig)) if scale > 1.0 else 1.0
            w.add_rope_scaling_attn_factors(attn)
    if arch == "gemma2":
        w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        w.add_final_logit_softcapping(cfg.final_logit_softcapping)
        w.add_sliding_window(cfg.sliding_window)
    if rope_type == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(params["factor"])
        w.add_rope_scaling_orig_ctx_len(params["original_max_position_embeddings"])
    elif rope_type == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(params["factor"])
    if arch == "granite":
        w.add_float32(f"{arch}.attention.scale", cfg.attention_multiplier)
        w.add_float32(f"{arch}.embedding_scale", cfg.embedding_multiplier)
        w.add_float32(f"{arch}.residual_scale", cfg.residual_multiplier)
        w.add_float32(f"{arch}.logit_scale", cfg.logits_scaling)

    tok = tiny_tokenizer()
    spec = json.loads(tok.to_str())
    vocab: dict[str, int] = spec["model"]["vocab"]
    tokens = [""] * len(vocab)
    for token, idx in vocab.items():
        tokens[idx] = token
    tokens += [f"<|unused{i}|>" for i in range(cfg.vocab_size - len(tokens))]
    if arch.startswith("gemma"):  # transformers' Gemma tokenizer adds one if it is missing
        tokens[-1] = "<mask>"
    for idx, token in (renamed or {}).items():  # a vocabulary that differs at these ids
        tokens[idx] = token
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_merges(merges)
    control = set(SPECIALS) | {"<mask>"}
    w.add_token_types([3 if t in control or t.startswith("<|unused") else 1 for t in tokens])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(chat_template)

    if rope_type == "llama3":
        w.add_tensor("rope_freqs.weight", llama3_rope_freqs(cfg))
    if rope_type == "longrope":
        for kind in ("long", "short"):
            factors = np.array(params[f"{kind}_factor"], dtype=np.float32)
            w.add_tensor(f"rope_factors_{kind}.weight", factors)
    names = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    sandwich = arch in ("gemma2", "gemma3", "olmo2")
    per_layer = {
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "post_attention_norm" if sandwich else "ffn_norm",
        "pre_feedforward_layernorm": "ffn_norm",
        "post_feedforward_layernorm": "post_ffw_norm",
        "self_attn.qkv_proj": "attn_qkv",
        "mlp.gate_up_proj": "ffn_up",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "self_attn.q_norm": "attn_q_norm",
        "self_attn.k_norm": "attn_k_norm",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }
    tied = cfg.tie_word_embeddings
    with torch.no_grad():
        for name, p in model.named_parameters():
            if tied and name == "lm_head.weight":
                continue
            if name in names:
                out = names[name]
            else:
                parts = name.split(".")  # model.layers.{i}.<module...>.{weight|bias}
                module = ".".join(parts[3:-1])
                out = f"blk.{parts[2]}.{per_layer[module]}.{parts[-1]}"
            t = p.detach()
            if arch in INTERLEAVED and out.endswith(("attn_q.weight", "attn_k.weight")):
                t = interleave(t, n_heads if "attn_q" in out else n_kv)
            if t.dim() == 2:
                data, back = _quantize(t, qtype)
                w.add_tensor(out, data, raw_dtype=qtype if qtype_name != "F32" else None)
                if round_trip:
                    if arch in INTERLEAVED and out.endswith(("attn_q.weight", "attn_k.weight")):
                        heads = n_heads if "attn_q" in out else n_kv
                        back = _deinterleave(back, heads)
                    p.copy_(back)
            else:
                if arch.startswith("gemma") and out.endswith("norm.weight"):
                    t = t + 1  # the converter stores Gemma's (1 + w)
                w.add_tensor(out, t.float().numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _deinterleave(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
