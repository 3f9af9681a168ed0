"""Attention pieces of the decoder: rotary tables, and scaled dot-product attention over
a cache whose result does not depend on the key span (see `attend_values`)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from speculant.cache import KEY_BLOCK
from speculant.models.archs.base import default_inv_freq


def rope_tables(
    head_dim: int,
    theta: float,
    n_pos: int,
    scaling: float = 1.0,
    inv_freq: tuple[float, ...] = (),
    attn_factor: float = 1.0,
    rope_dim: int = 0,
    start: int = 0,
) -> Tensor:
    """cos/sin per position start .. start+n_pos-1: [2, n_pos, head_dim] float32
    (rotate-half layout).

    `inv_freq` [rope_dim / 2], where given, replaces theta's frequencies (a scaling rule's);
    `attn_factor` multiplies cos and sin (YaRN's attention factor). `rope_dim` < head_dim
    (partial rotary): each half of the head holds its rope_dim / 2 rotated dimensions first,
    then the others, whose cos is 1 and sin 0 (the loader orders the q / k rows so)."""
    rot = rope_dim or head_dim
    freq = torch.tensor(inv_freq, dtype=torch.float32) if inv_freq else default_inv_freq(rot, theta)
    pos = torch.arange(start, start + n_pos, dtype=torch.float32) / scaling
    freqs = torch.outer(pos, freq)  # [n_pos, rot / 2]
    cos, sin = freqs.cos(), freqs.sin()
    if attn_factor != 1.0:
        cos, sin = cos * attn_factor, sin * attn_factor
    if rot < head_dim:  # the unrotated dimensions: cos = 1, sin = 0
        rest = (head_dim - rot) // 2
        cos = torch.cat([cos, torch.ones(n_pos, rest)], dim=-1)
        sin = torch.cat([sin, torch.zeros(n_pos, rest)], dim=-1)
    return torch.stack([torch.cat([cos, cos], dim=-1), torch.cat([sin, sin], dim=-1)])


ROPE_BLOCK = 1024  # positions of a rotary table computed at a time (see extend_rope)


def extend_rope(
    table: Tensor, n: int, dtype: torch.dtype, limit: int | None = None, **kw: Any
) -> Tensor:
    """`table` [2, have, head_dim] (rope_tables(**kw) rows) grown to cover positions
    0 .. n-1 at least: to twice its rows (but not past `limit` where n does not ask for
    more), a block of ROPE_BLOCK positions at a time. Each block is computed alone, by the
    same call whenever it is made, so a position's values never depend on when the table
    grew: keys cached before a growth and queries after it see the same bits."""
    have = table.shape[1]
    if n <= have:
        return table
    want = max(n, 2 * have if limit is None else min(2 * have, limit))
    blocks = [
        rope_tables(n_pos=ROPE_BLOCK, start=b * ROPE_BLOCK, **kw).to(dtype)
        for b in range(have // ROPE_BLOCK, -(-want // ROPE_BLOCK))
    ]
    return torch.cat([table, *blocks], dim=1)


def identity_rope(rows: int, head_dim: int, dtype: torch.dtype) -> Tensor:
    """cos = 1, sin = 0 for a layer without a rotary embedding: [2, rows, head_dim]."""
    return torch.stack([torch.ones(rows, head_dim), torch.zeros(rows, head_dim)]).to(dtype)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x: [1, heads, T, head_dim]; cos, sin: [T, head_dim] in x's dtype."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def attend_values(probs: Tensor, values: Tensor) -> Tensor:
    """probs [b, M, span] @ values [b, span, hd] -> [b, M, hd], span a multiple of
    KEY_BLOCK, computed so that the result does not depend on the span.

    One matmul over the whole span picks its reduction blocking by the span's length,
    so extending the span with masked (zero-probability) keys changed the last bits on
    one project CPU (span 1088 vs 1152). Here every KEY_BLOCK of keys is its own small
    matmul (one batched call) and the blocks are added in order in float32: blocks past
    the query's keys add exact zeros, whatever the span."""
    b, m, span = probs.shape
    nb = span // KEY_BLOCK
    parts = torch.matmul(
        probs.view(b, m, nb, KEY_BLOCK).transpose(1, 2),  # [b, nb, M, block]
        values.view(b, nb, KEY_BLOCK, values.shape[-1]),  # [b, nb, block, hd]
    )  # [b, nb, M, hd]
    out = parts[:, 0].float()
    for i in range(1, nb):
        out = out + parts[:, i].float()
    return out.to(probs.dtype)


def attend(
    q: Tensor, keys: Tensor, values: Tensor, mask: Tensor, scale: float, softcap: float = 0.0
) -> Tensor:
    """q [1, nh, T, hd] against keys / values [1, nkv, span, hd] under mask [T, span]
    -> [nh, T, hd]. Query heads are grouped under their kv head: no copy of the keys for
    grouped-query attention. `softcap` > 0: each score s becomes softcap * tanh(s / softcap)."""
    nh, t, hd = q.shape[1], q.shape[2], q.shape[3]
    nkv = keys.shape[1]
    rep = nh // nkv
    qg = q[0].reshape(nkv, rep * t, hd)  # [nkv, rep*T, hd]
    scores = torch.matmul(qg, keys[0].transpose(1, 2)) * scale  # [nkv, rep*T, span]
    if softcap > 0:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.view(nkv, rep, t, -1).masked_fill(~mask, float("-inf"))
    probs = scores.float().softmax(dim=-1).to(q.dtype).view(nkv, rep * t, -1)
    out = attend_values(probs, values[0])  # [nkv, rep*T, hd]
    return out.view(nh, t, hd)
