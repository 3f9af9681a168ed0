"""The decoder's view of a model: its shapes and the few ways its layers differ.

Each architecture's description (speculant.models.archs) reads its own config keys and
fills these fields; the decoder reads only the fields, never the architecture's name.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelConfig:
    """One decoder-only transformer of the Llama family and its variations.

    Norm weights are stored as the effective multiplier: Gemma's (1 + w) is folded in
    at load time, so the decoder has one RMSNorm for every family.
    """

    arch: str  # the name of its description in speculant.models.archs
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    norm_eps: float
    rope_theta: float
    max_seq_len: int
    tie_embeddings: bool = True
    qkv_bias: bool = False  # biases on the q, k and v projections
    qk_norm: bool = False  # RMSNorm of each query and key head before the rotary embedding
    qk_norm_all_heads: bool = False  # ... of all query / all key heads at once (OLMo 2)
    pre_norm: bool = True  # RMSNorms before attention and the MLP (OLMo 2 has none)
    sandwich_norm: bool = False  # post-attention and pre/post feed-forward norms
    embed_scale: float = 1.0  # multiplies the embedding rows
    residual_scale: float = 1.0  # multiplies each block's output before it is added back
    logit_scale: float = 1.0  # divides the logits
    query_scale: float | None = None  # None: head_dim ** -0.5
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()  # per layer: "full" or "sliding"; () = all full
    no_rope_layers: tuple[int, ...] = ()  # layers whose queries and keys are not rotated
    rope_local_theta: float | None = None  # rope base of sliding layers
    rope_scaling_factor: float = 1.0  # linear position scaling of full layers
    # The full layers' rotary frequencies [head_dim / 2] where a scaling rule sets them
    # (Llama 3.1's, a GGUF file's rope_freqs); () = theta ** (-2i / head_dim).
    rope_inv_freq: tuple[float, ...] = ()
    rope_attn_factor: float = 1.0  # multiplies cos and sin (YaRN's attention factor)
    # Rotated dimensions of each head (0: all). Fewer (partial rotary, Phi-4-mini): the
    # loader moves each head's rotated pairs to the front of either half, and the rest
    # get cos = 1, sin = 0.
    rope_dim: int = 0
    # LongRoPE (Phi-3): a sequence whose cache holds more than rope_long_context
    # positions rotates with these frequencies instead of rope_inv_freq (the short ones).
    rope_inv_freq_long: tuple[float, ...] = ()
    rope_long_context: int = 0
    attn_softcap: float | None = None  # scores s -> cap * tanh(s / cap) (Gemma 2)
    activation: str = "silu"  # or "gelu_tanh"
    final_logit_softcap: float | None = None

    def __post_init__(self) -> None:
        lists = ("layer_types", "no_rope_layers", "rope_inv_freq", "rope_inv_freq_long")
        for name in lists:  # JSON gives lists
            object.__setattr__(self, name, tuple(getattr(self, name)))
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} is not a multiple of {self.n_kv_heads}")
        if self.layer_types and len(self.layer_types) != self.n_layers:
            raise ValueError("layer_types must list every layer")
        if any(t not in ("full", "sliding") for t in self.layer_types):
            raise ValueError(f"layer_types {self.layer_types} may hold 'full' or 'sliding'")
        if self.activation not in ("silu", "gelu_tanh"):
            raise ValueError(f"activation {self.activation!r} is not supported")
        if self.rope_dim % 2 or not 0 <= self.rope_dim <= self.head_dim:
            raise ValueError(f"rope_dim {self.rope_dim}: an even count up to {self.head_dim}")
        for freqs in (self.rope_inv_freq, self.rope_inv_freq_long):
            if freqs and len(freqs) != self.rotary_dim // 2:
                raise ValueError(
                    f"{len(freqs)} rotary frequencies for {self.rotary_dim} rotated "
                    f"dimensions: need {self.rotary_dim // 2}"
                )
        if any(not 0 <= i < self.n_layers for i in self.no_rope_layers):
            raise ValueError(f"no_rope_layers {self.no_rope_layers} outside 0..{self.n_layers - 1}")

    @property
    def rotary_dim(self) -> int:
        return self.rope_dim or self.head_dim

    def is_sliding(self, layer: int) -> bool:
        return bool(self.layer_types) and self.layer_types[layer] == "sliding"

    @property
    def scale(self) -> float:
        return self.query_scale if self.query_scale is not None else self.head_dim**-0.5

    @property
    def num_params(self) -> int:
        d, hd = self.dim, self.head_dim
        attn = d * hd * (self.n_heads * 2 + self.n_kv_heads * 2)
        ffn = 3 * d * self.ffn_dim
        emb = self.vocab_size * d * (1 if self.tie_embeddings else 2)
        return self.n_layers * (attn + ffn) + emb
