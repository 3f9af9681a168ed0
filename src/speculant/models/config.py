"""Architecture description shared by the loaders and the decoder."""

from __future__ import annotations

from dataclasses import dataclass

ARCHITECTURES = ("llama", "qwen2", "gemma3")


@dataclass(frozen=True)
class ModelConfig:
    """One decoder-only transformer of the Llama / Qwen2 / Gemma 3 family.

    Norm weights are stored as the effective multiplier: Gemma's (1 + w) is folded in
    at load time, so the decoder has one RMSNorm for every family.
    """

    arch: str
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
    qkv_bias: bool = False  # qwen2
    # gemma3 only
    qk_norm: bool = False
    sandwich_norm: bool = False  # post-attention and pre/post feed-forward norms
    embed_scale: float = 1.0
    query_scale: float | None = None  # None: head_dim ** -0.5
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()  # per layer: "full" or "sliding"; () = all full
    rope_local_theta: float | None = None  # rope base of sliding layers
    rope_scaling_factor: float = 1.0  # linear position scaling of full layers
    activation: str = "silu"  # or "gelu_tanh"
    final_logit_softcap: float | None = None

    def __post_init__(self) -> None:
        if self.arch not in ARCHITECTURES:
            raise ValueError(f"architecture {self.arch!r} is not supported: use {ARCHITECTURES}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} is not a multiple of {self.n_kv_heads}")
        if self.layer_types and len(self.layer_types) != self.n_layers:
            raise ValueError("layer_types must list every layer")
        if any(t not in ("full", "sliding") for t in self.layer_types):
            raise ValueError(f"layer_types {self.layer_types} may hold 'full' or 'sliding'")
        if self.activation not in ("silu", "gelu_tanh"):
            raise ValueError(f"activation {self.activation!r} is not supported")

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
