"""Weight formats and the one matrix product every projection goes through.

- a plain tensor (float32 / bfloat16): `F.linear`;
- `Int8Weight` / `Int4Weight`: weight-only quantized copies for PyTorch's packed kernels
  (bfloat16 activations);
- `GGUFWeight`: the GGUF file's own blocks (Q4_0 .. Q6_K), executed as stored by the
  native kernels (speculant.native), float32 activations.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from speculant.native import NativeMatrix


@dataclass
class Int8Weight:
    """Weight-only int8: per-output-channel symmetric scales, bf16 activations.

    Computed by one fused kernel (`_weight_int8pack_mm`) that reads half the bytes of
    bf16; its rows are independent of the row count, so verify and decode agree.
    """

    q: Tensor  # [out, in] int8
    scales: Tensor  # [out] bfloat16

    @classmethod
    def quantize(cls, w: Tensor) -> Int8Weight:
        wf = w.float()
        scales = (wf.abs().amax(dim=1) / 127.0).clamp_min(1e-10)  # [out]
        q = torch.round(wf / scales[:, None]).clamp_(-127, 127).to(torch.int8)
        return cls(q.contiguous(), scales.to(torch.bfloat16))

    @property
    def nbytes(self) -> int:
        return self.q.numel() + self.scales.numel() * 2

    @property
    def in_features(self) -> int:
        return int(self.q.shape[1])


INT4_GROUP = 32  # weights per (scale, zero) pair: 4 + 32/32 bits = 5 bits a weight


@dataclass
class Int4Weight:
    """Weight-only int4, group-wise asymmetric: w = (q - 8) * scale + zero per group of
    `group` input weights, bf16 activations, PyTorch's packed CPU kernel
    (`_weight_int4pack_mm_for_cpu`). Needs out % 16 == 0 and in % group == 0."""

    packed: Tensor  # [out, in / 2] uint8, the kernel's layout
    scales_zeros: Tensor  # [in / group, out, 2] bfloat16
    group: int

    @staticmethod
    def fits(w: Tensor, group: int = INT4_GROUP) -> bool:
        return w.shape[0] % 16 == 0 and w.shape[1] % group == 0

    @classmethod
    def quantize(cls, w: Tensor, group: int = INT4_GROUP) -> Int4Weight:
        out, inp = w.shape
        wg = w.float().reshape(out, inp // group, group)
        lo = wg.amin(dim=-1, keepdim=True)
        hi = wg.amax(dim=-1, keepdim=True)
        scale = ((hi - lo) / 15).clamp_min(1e-8)  # [out, in/group, 1]
        q = torch.round((wg - lo) / scale).clamp_(0, 15).to(torch.int32).reshape(out, inp)
        zero = lo + 8 * scale  # so that w = (q - 8) * scale + zero
        sz = torch.cat([scale, zero], dim=-1).transpose(0, 1).contiguous()  # [in/group, out, 2]
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 2)
        return cls(packed, sz.to(torch.bfloat16), group)

    def dequantize(self) -> Tensor:
        """The float32 weight [out, in] this stands for (reference and tests)."""
        out = self.packed.shape[0]
        eye = torch.eye(self.in_features, dtype=torch.bfloat16)
        return linear(eye, self).float().T.reshape(out, self.in_features)

    @property
    def in_features(self) -> int:
        return int(self.packed.shape[1]) * 2

    @property
    def nbytes(self) -> int:
        return self.packed.numel() + self.scales_zeros.numel() * 2


@dataclass
class GGUFWeight:
    """A projection [out, in] kept in its GGUF formats (the parts of a fused projection
    may differ: Q5_0 queries beside Q8_0 values), computed by the native kernels."""

    matrix: NativeMatrix

    @property
    def in_features(self) -> int:
        return self.matrix.k

    @property
    def out_features(self) -> int:
        return self.matrix.n

    @property
    def nbytes(self) -> int:
        return self.matrix.nbytes

    def rows(self, ids: Tensor) -> Tensor:
        """Dequantized rows `ids` as float32 [len(ids), in] (embedding lookups)."""
        return self.matrix.rows(ids)


Linear = Tensor | Int8Weight | Int4Weight | GGUFWeight


def linear(x: Tensor, w: Linear, bias: Tensor | None = None) -> Tensor:
    """x: [T, in] -> [T, out]."""
    if isinstance(w, Tensor):
        return F.linear(x, w, bias)
    if isinstance(w, GGUFWeight):
        y = w.matrix.matmul(x)
    elif isinstance(w, Int8Weight):
        y = torch.ops.aten._weight_int8pack_mm(x.contiguous(), w.q, w.scales)
    else:
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.contiguous(), w.packed, w.group, w.scales_zeros
        )
    return y if bias is None else y + bias


def embed_rows(table: Tensor | GGUFWeight, ids: Tensor) -> Tensor:
    """Rows `ids` of an embedding table: [len(ids), dim] in the table's dtype
    (float32 for a GGUF table)."""
    if isinstance(table, GGUFWeight):
        return table.rows(ids)
    return F.embedding(ids, table)


@dataclass
class LayerWeights:
    attn_norm: Tensor | None  # [dim]; None: no norm before attention (OLMo 2)
    wqkv: Linear  # [(n_heads + 2 * n_kv_heads) * head_dim, dim]
    wo: Linear  # [dim, n_heads * head_dim]
    ffn_norm: Tensor | None  # [dim]; None: no norm before the MLP (OLMo 2)
    w_gate_up: Linear  # [2 * ffn_dim, dim]
    w_down: Linear  # [dim, ffn_dim]
    bqkv: Tensor | None = None  # [(n_heads + 2 * n_kv_heads) * head_dim]
    q_norm: Tensor | None = None  # [head_dim], or [n_heads * head_dim] (qk_norm_all_heads)
    k_norm: Tensor | None = None  # [head_dim], or [n_kv_heads * head_dim]
    post_attn_norm: Tensor | None = None  # [dim]
    post_ffn_norm: Tensor | None = None  # [dim]


@dataclass
class Weights:
    tok_embeddings: Tensor | GGUFWeight  # [vocab, dim]
    norm: Tensor  # [dim]
    output: Linear  # [vocab, dim] (the embedding itself when tied)
    layers: list[LayerWeights] = field(default_factory=list)

    def tensors(self) -> list[Tensor]:
        out: list[Tensor] = []
        for value in [self.tok_embeddings, self.norm, self.output, *self._layer_values()]:
            if isinstance(value, Int8Weight):
                out.extend([value.q, value.scales])
            elif isinstance(value, Int4Weight):
                out.extend([value.packed, value.scales_zeros])
            elif isinstance(value, GGUFWeight):
                out.extend(value.matrix.tensors())
            elif isinstance(value, Tensor):
                out.append(value)
        return out

    def _layer_values(self) -> list[object]:
        return [v for lw in self.layers for v in vars(lw).values()]

    def nbytes(self) -> int:
        seen: set[int] = set()
        total = 0
        for t in self.tensors():
            if t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                total += t.numel() * t.element_size()
        return total

    def quantize(self, fmt: str) -> None:
        """Replace every projection and the LM head by weight-only `fmt` ("int8" or
        "int4"; int4 shapes the kernel cannot take stay int8). Embedding lookups stay
        in the activation dtype."""
        if fmt not in ("int8", "int4"):
            raise ValueError(f"weight format {fmt!r} is not supported: use int8 or int4")

        def convert(w: Linear) -> Linear:
            if not isinstance(w, Tensor):
                return w
            if fmt == "int4" and Int4Weight.fits(w):
                return Int4Weight.quantize(w)
            return Int8Weight.quantize(w)

        for lw in self.layers:
            for name in ("wqkv", "wo", "w_gate_up", "w_down"):
                setattr(lw, name, convert(getattr(lw, name)))
        self.output = convert(self.output)

    @property
    def weight_format(self) -> str | None:
        """ "gguf", "int4" or "int8" when the projections are quantized, else None."""
        w = self.layers[0].w_gate_up if self.layers else self.output
        if isinstance(w, GGUFWeight):
            return "gguf"
        if isinstance(w, Int4Weight):
            return "int4"
        if isinstance(w, Int8Weight):
            return "int8"
        return None
