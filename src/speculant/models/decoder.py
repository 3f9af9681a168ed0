"""A compact decoder for the Llama / Qwen2 / Gemma 3 family, written for KV-cached decoding.

Weights live in plain tensors (no autograd, no nn.Module machinery): the loaders fill a
`Weights` object, and `Transformer.forward` runs T new tokens at positions
start .. start+T-1 against a `KVCache`.

Numerics: CPU matmul kernels round differently by row count (a matrix-vector kernel for
one row, remainder paths for partial tiles; which counts agree depends on the CPU and
the shapes), and PyTorch's fused attention rounds differently by key length. A verify
pass over k+1 rows and a plain step over one row would then disagree in the last bits
and a near-tie argmax could flip, making greedy speculative output drift from plain
output. So every pass is padded to a row count the kernels treat alike (a rule measured
on this machine for this model: see numerics.py), and attention is written as two
matmuls whose masked tail contributes exact zeros. Tests check the bitwise invariance.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from speculant import native
from speculant.cache import KVCache
from speculant.models.attention import (  # noqa: F401 (re-exported)
    ROPE_BLOCK,
    apply_rope,
    attend,
    attend_values,
    extend_rope,
    identity_rope,
    rope_tables,
)
from speculant.models.config import ModelConfig
from speculant.models.formats import (  # noqa: F401 (re-exported)
    INT4_GROUP,
    GGUFWeight,
    Int4Weight,
    Int8Weight,
    LayerWeights,
    Linear,
    Weights,
    embed_rows,
    linear,
)
from speculant.models.numerics import Padding, calibrate, padded_rows
from speculant.models.segment import Segment
from speculant.tree import tree_depth, tree_depths, tree_paths

# The keys [lo, hi) each query row sees on the native path: (causal lo, sliding-window lo,
# hi), each [rows] int64.
KeyRanges = tuple[Tensor, Tensor, Tensor]


@dataclass
class _TreePath:
    """One root-to-leaf path of a tree, run as a chain: `nodes` its node indices by
    depth, `own` the positions along it whose results this path provides (each node
    is computed by exactly one path)."""

    nodes: Tensor  # [L] int64
    own: Tensor  # [m] int64 positions along the path
    rows: int  # L padded like a chain of L tokens
    causal: Tensor  # [rows, span] bool
    window: Tensor  # [rows, span] bool
    ranges: KeyRanges | None = None  # see _SegmentContext


@dataclass
class _SegmentContext:
    causal: Tensor  # [rows, span] bool
    window: Tensor  # [rows, span] bool (sliding-window layers)
    rope_full: Tensor  # [2, rows, head_dim]
    rope_local: Tensor  # [2, rows, head_dim]
    paths: list[_TreePath] | None = None  # a tree segment's chains
    ranges: KeyRanges | None = None  # the native path's visible keys (masks stay empty)


def _visible(
    v: _SegmentContext | _TreePath, sliding: bool
) -> tuple[Tensor, tuple[Tensor, Tensor] | None]:
    """(mask [rows, span], None) on the torch path; (empty, (lo, hi)) on the native one."""
    if v.ranges is not None:
        lo, lo_window, hi = v.ranges
        return v.causal, (lo_window if sliding else lo, hi)
    return (v.window if sliding else v.causal), None


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """x: [..., d] -> [..., d]; computed in float32, returned in x's dtype."""
    if x.dtype == torch.float32 and not x.requires_grad and _native_rows(x.shape[-1]):
        return native.rms_norm(x, weight, eps)  # each row on its own, by construction
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * weight.float()).to(x.dtype)


def _native_rows(d: int) -> bool:
    """Whether float32 norms and attention over rows of d values run natively."""
    return d % 8 == 0 and native.available()


def _uses_native(weights: Weights) -> bool:
    return isinstance(weights.layers[0].wqkv, GGUFWeight) if weights.layers else False


class Transformer:
    """The decoder: `forward_batch` runs segments of several sequences in one pass
    (`forward` one sequence); each writes the caches it is given.

    With GGUF weights on the native kernels (float32 activations), every reduction of a
    pass is row-invariant by construction: the matmuls, the norms and attention (native
    too) compute each row alone. Passes then run unpadded, and no calibration is needed."""

    def __init__(self, config: ModelConfig, weights: Weights, dtype: torch.dtype) -> None:
        self.config = config
        self.weights = weights
        self.dtype = dtype
        self.native_ops = (
            dtype == torch.float32 and _uses_native(weights) and _native_rows(config.head_dim)
        )
        self.kv_dtype = dtype  # the caches' element type (set_kv_dtype)
        self._row_padding: Padding | None = (1, 1) if self.native_ops else None
        self._layer_table: native.LayerTable | None = None
        self._unfusable = False  # decided: these layers cannot run in one call
        self._fused_window = False  # the fused layers all slide (Mistral, Phi-3)
        self.fuse_layers = True  # False: the layers one operation at a time (tests, A/B)
        # Rotary tables cover the positions the caches so far need (extend_rope): a
        # file's context length costs nothing until a sequence reaches it.
        self._rope_positions = 0
        empty = torch.empty(2, 0, config.head_dim, dtype=dtype)
        self._rope_full = empty
        self._rope_long = empty  # LongRoPE: sequences past the original context
        self._rope_local = empty  # sliding layers' own base (rope_local_theta), if any
        self._rope_none: Tensor | None = None  # cos 1, sin 0: layers without rope
        self._cover_positions(min(config.max_seq_len + 16, ROPE_BLOCK))
        self._residual = torch.tensor(config.residual_scale, dtype=dtype)

    def _cover_positions(self, n: int) -> None:
        """Rotary tables for positions 0 .. n-1 at least (extend_rope: block by block,
        the same bits whenever a block is made)."""
        if n <= self._rope_positions:
            return
        c, dtype, limit = self.config, self.dtype, self.config.max_seq_len + 16
        full = dict(
            head_dim=c.head_dim,
            theta=c.rope_theta,
            scaling=c.rope_scaling_factor,
            attn_factor=c.rope_attn_factor,
            rope_dim=c.rope_dim,
        )
        self._rope_full = extend_rope(
            self._rope_full, n, dtype, limit, inv_freq=c.rope_inv_freq, **full
        )
        self._rope_positions = self._rope_full.shape[1]
        if c.rope_inv_freq_long:
            self._rope_long = extend_rope(
                self._rope_long, n, dtype, limit, inv_freq=c.rope_inv_freq_long, **full
            )
        if c.rope_local_theta:
            self._rope_local = extend_rope(
                self._rope_local,
                n,
                dtype,
                limit,
                head_dim=c.head_dim,
                theta=c.rope_local_theta,
                rope_dim=c.rope_dim,
            )
        if c.no_rope_layers:
            self._rope_none = identity_rope(self._rope_positions, c.head_dim, dtype)

    @property
    def row_padding(self) -> Padding:
        """(least rows, row multiple) of every pass, measured once on first use."""
        if self._row_padding is None:
            self._row_padding = calibrate(self.config, self.weights, self.dtype)
        return self._row_padding

    def _check_kv_dtype(self, kv_dtype: torch.dtype) -> torch.dtype:
        """kv_dtype if this model's caches can hold it: the activations' dtype, or float16
        on the native path (keys and values rounded to float16 as they are written;
        attention computes in float32 over them, on every path the same bits)."""
        if kv_dtype != self.dtype and not (kv_dtype == torch.float16 and self.native_ops):
            have = "the native kernels" if self.native_ops else f"{self.dtype} through PyTorch"
            raise ValueError(
                f"kv_dtype {str(kv_dtype).removeprefix('torch.')} is not available for this "
                f"model (it runs {have}): use {str(self.dtype).removeprefix('torch.')}, or "
                "float16 with GGUF weights on the native kernels (--dtype gguf)"
            )
        return kv_dtype

    def set_kv_dtype(self, kv_dtype: torch.dtype) -> None:
        """The element type of the caches `new_cache` makes by default."""
        self.kv_dtype = self._check_kv_dtype(kv_dtype)

    def new_cache(self, capacity: int, kv_dtype: torch.dtype | None = None) -> KVCache:
        """A cache of `capacity` positions, of kv_dtype (default: set_kv_dtype's)."""
        c = self.config
        dtype = self.kv_dtype if kv_dtype is None else self._check_kv_dtype(kv_dtype)
        cache = KVCache(c.n_layers, c.n_kv_heads, c.head_dim, capacity, dtype)
        if c.rope_inv_freq_long and capacity > c.rope_long_context:
            cache.rope_variant = 1  # LongRoPE: a context past the original one
        return cache

    @torch.inference_mode()
    def forward(
        self,
        tokens: Tensor,
        cache: KVCache,
        start: int,
        *,
        logits: bool = True,
        return_hidden: bool = False,
        trace: list[Tensor] | None = None,
    ) -> tuple[Tensor | None, Tensor | None]:
        """Run tokens [T] at positions start .. start+T-1.

        Returns (logits [T, vocab] float32 or None, hidden [T, dim] or None); the hidden
        state is the final-normed feature the LM head reads. Sets cache.length = start+T.
        `trace`, when given, receives the residual stream [T, dim] before the first layer
        and after each layer (layer-skip calibration reads it).
        """
        out_logits, hidden = self.forward_batch(
            [Segment(tokens, cache, start)],
            logits=logits,
            return_hidden=return_hidden,
            trace=trace,
        )
        return (
            out_logits[0] if out_logits is not None else None,
            hidden[0] if hidden is not None else None,
        )

    @torch.inference_mode()
    def forward_batch(
        self,
        segments: list[Segment],
        *,
        logits: bool = True,
        return_hidden: bool = False,
        trace: list[Tensor] | None = None,
    ) -> tuple[list[Tensor] | None, list[Tensor] | None]:
        """Run several sequences in one pass: each segment's tokens [T_i] at its own
        positions against its own cache. The projections (where the weights are read)
        see every segment's rows at once; attention runs per segment.

        Each segment is padded on its own to `padded_rows`, so its rows sit in the same
        kernel tiles as when it runs alone: a segment's logits are bitwise the same in a
        batch and alone (tested). Returns per-segment logits [T_i, vocab] / hidden [T_i, dim].
        """
        c = self.config
        w = self.weights
        parts: list[Tensor] = []
        spans: list[tuple[int, int, int]] = []  # (row offset, padded rows, real rows)
        offset = 0
        for seg in segments:
            n_real = seg.tokens.shape[0]
            reach = n_real  # positions the segment occupies
            if seg.tree_parents is not None:
                reach = tree_depth(seg.tree_parents)
            if seg.start + reach > seg.cache.capacity:
                raise ValueError(
                    f"positions up to {seg.start + reach} exceed the context capacity "
                    f"{seg.cache.capacity}"
                )
            rows = padded_rows(n_real, self.row_padding)
            tokens = seg.tokens
            if rows > n_real:  # same-kernel padding, see the module docstring
                tokens = torch.cat([tokens, tokens.new_zeros(rows - n_real)])
            parts.append(tokens)
            spans.append((offset, rows, n_real))
            offset += rows
        x = embed_rows(w.tok_embeddings, torch.cat(parts)).to(self.dtype)  # [sum rows, dim]
        if c.embed_scale != 1.0:
            x = x * torch.tensor(c.embed_scale, dtype=self.dtype)
        for seg in segments:
            seg.tree_kv = []
        ctx = [
            self._segment_context(seg, rows)
            for seg, (_, rows, _) in zip(segments, spans, strict=True)
        ]
        if trace is not None:
            trace.append(x[: spans[0][2]])
        fused = trace is None and all(sc.paths is None for sc in ctx) and self._fusable()
        for i, lw in enumerate([] if fused else w.layers):
            sliding = c.is_sliding(i)
            h = x if lw.attn_norm is None else rms_norm(x, lw.attn_norm, c.norm_eps)
            h = self._attention(h, lw, i, sliding, segments, spans, ctx)
            if lw.post_attn_norm is not None:
                h = rms_norm(h, lw.post_attn_norm, c.norm_eps)
            x = x + (h if c.residual_scale == 1.0 else h * self._residual)
            h = x if lw.ffn_norm is None else rms_norm(x, lw.ffn_norm, c.norm_eps)
            h = self._mlp(h, lw)
            if lw.post_ffn_norm is not None:
                h = rms_norm(h, lw.post_ffn_norm, c.norm_eps)
            x = x + (h if c.residual_scale == 1.0 else h * self._residual)
            if trace is not None:
                trace.append(x[: spans[0][2]])
        if fused:
            x = self._fused_layers(x, segments, spans, ctx)
        for seg, (_, _, n_real) in zip(segments, spans, strict=True):
            seg.cache.length = seg.start + (n_real if seg.tree_parents is None else 0)
        hidden = rms_norm(x, w.norm, c.norm_eps)  # [sum rows, dim]
        out_logits = None
        if logits:
            # Only the segments that want logits go through the output head, each with its
            # padded rows, so every row keeps its place in the kernel tiles.
            wanted = [i for i, seg in enumerate(segments) if seg.logits]
            if len(wanted) < len(segments):
                picked = [hidden[o : o + rows] for o, rows, _ in (spans[i] for i in wanted)]
                head_in = torch.cat(picked) if picked else None
            else:
                head_in = hidden
            if head_in is None:  # prefill chunks only
                full = torch.zeros(0, c.vocab_size)
            else:
                full = linear(head_in, w.output).float()  # [wanted rows, vocab]
            if c.logit_scale != 1.0:
                full = full / c.logit_scale
            if c.final_logit_softcap and head_in is not None:
                cap = c.final_logit_softcap
                full = torch.tanh(full / cap) * cap
            out_logits = []
            at = 0
            for seg, (_, rows, n) in zip(segments, spans, strict=True):
                if seg.logits:
                    out_logits.append(full[at : at + n])
                    at += rows
                else:
                    out_logits.append(full[:0])
        hiddens = [hidden[o : o + n] for o, _, n in spans] if return_hidden else None
        return out_logits, hiddens

    def _fusable(self) -> bool:
        """Whether the layers run natively in one call (`_fused_layers`): GGUF weights on
        the native kernels, and pre-norm layers of the plain Llama / Qwen2 kind (no q/k
        norms, no post-norms, SiLU, one sliding window for every layer or none, every
        layer rotated, no residual scale, no soft-cap). Decided once per model."""
        if not self.fuse_layers:
            return False
        if self._layer_table is None and not self._unfusable:
            self._layer_table = self._build_layer_table()
            self._unfusable = self._layer_table is None
        return self._layer_table is not None

    def _build_layer_table(self) -> native.LayerTable | None:
        c = self.config
        if not self.native_ops or c.activation != "silu":
            return None
        if c.no_rope_layers or c.residual_scale != 1.0 or c.attn_softcap:
            return None
        sliding = {c.is_sliding(i) for i in range(c.n_layers)}
        if len(sliding) > 1:  # one key range per row serves every layer, or none
            return None
        self._fused_window = sliding == {True}  # every layer sees the same window
        parts: list[native.LayerParts] = []
        for lw in self.weights.layers:
            if lw.q_norm is not None or lw.post_attn_norm is not None:
                return None
            if lw.post_ffn_norm is not None or lw.attn_norm is None or lw.ffn_norm is None:
                return None
            qkv, wo, gate_up, down = lw.wqkv, lw.wo, lw.w_gate_up, lw.w_down
            if not (
                isinstance(qkv, GGUFWeight)
                and isinstance(wo, GGUFWeight)
                and isinstance(gate_up, GGUFWeight)
                and isinstance(down, GGUFWeight)
            ):
                return None
            parts.append(
                (
                    lw.attn_norm,
                    lw.ffn_norm,
                    qkv.matrix,
                    lw.bqkv,
                    wo.matrix,
                    gate_up.matrix,
                    down.matrix,
                )
            )
        return native.LayerTable(parts, (c.n_heads, c.n_kv_heads, c.head_dim), c.norm_eps, c.scale)

    def _fused_layers(
        self,
        x: Tensor,
        segments: list[Segment],
        spans: list[tuple[int, int, int]],
        ctx: list[_SegmentContext],
    ) -> Tensor:
        """Every layer in one native call: the same operations as the loop in
        `forward_batch` (bitwise, tested), without a Python step between them."""
        assert self._layer_table is not None
        parts = []
        for seg, (_, t, _) in zip(segments, spans, strict=True):
            seg.cache.check_rows(seg.start, t)
            parts.append((t, seg.cache.k, seg.cache.v, seg.start))
        los, his = [], []
        for sc in ctx:
            assert sc.ranges is not None  # chains on the native path
            los.append(sc.ranges[1] if self._fused_window else sc.ranges[0])
            his.append(sc.ranges[2])
        lo, hi = torch.cat(los), torch.cat(his)
        cos = torch.cat([sc.rope_full[0] for sc in ctx])
        sin = torch.cat([sc.rope_full[1] for sc in ctx])
        return native.run_layers(self._layer_table, x, parts, cos, sin, lo, hi)

    def _full_table(self, cache: KVCache) -> Tensor:
        """The full layers' rotary table of a sequence: LongRoPE's long one where its cache
        holds more than the original context (`new_cache` decides: llama.cpp's rule, with
        the sequence's context), else the usual one."""
        return self._rope_long if cache.rope_variant == 1 else self._rope_full

    def _local_table(self, full_table: Tensor) -> Tensor:
        """The sliding layers' rotary table: their own base's, or the full layers'."""
        return self._rope_local if self.config.rope_local_theta else full_table

    def _segment_context(self, seg: Segment, rows: int) -> _SegmentContext:
        """Masks and rotary tables of one segment's padded rows."""
        self._cover_positions(seg.cache.rows)
        start, end = seg.start, seg.start + rows
        if seg.tree_parents is not None:
            return self._tree_context(seg, rows)
        q_pos = torch.arange(start, end)  # rotary positions = cache rows
        rope = slice(start, end)
        full_table = self._full_table(seg.cache)
        full = full_table[:, rope]
        local = self._local_table(full_table)[:, rope]
        if self.native_ops:
            empty = torch.empty(0, dtype=torch.bool)
            return _SegmentContext(empty, empty, full, local, ranges=self._ranges(q_pos))
        causal, window = self._masks(q_pos, seg.cache.key_span(end))
        return _SegmentContext(causal, window, full, local)

    def _ranges(self, q_pos: Tensor) -> KeyRanges:
        """The keys [lo, hi) that queries at q_pos see, causal and sliding-window."""
        lo = torch.zeros_like(q_pos)
        window = self.config.sliding_window
        lo_window = (q_pos - window + 1).clamp_min(0) if window else lo
        return lo, lo_window, q_pos + 1

    def _masks(self, q_pos: Tensor, span: int) -> tuple[Tensor, Tensor]:
        """(causal, sliding-window) visibility [rows, span] of queries at q_pos."""
        k_pos = torch.arange(span)
        causal = k_pos[None, :] <= q_pos[:, None]
        window = self.config.sliding_window
        if window:
            return causal, causal & (q_pos[:, None] - k_pos[None, :] < window)
        return causal, causal

    def _tree_context(self, seg: Segment, rows: int) -> _SegmentContext:
        """A tree runs as its root-to-leaf paths: each path is attended exactly as a
        chain of its length (its keys at rows start.., the chain's padding, span and
        masks), so every node's result is bitwise its path's chain result. Summing
        attention over a tree's own key layout (siblings masked between ancestors)
        rounds differently, which could flip a near-tie argmax and break greedy
        equivalence."""
        assert seg.tree_parents is not None
        n = seg.tokens.shape[0]
        depths = tree_depths(seg.tree_parents, n)  # validates the layout
        deepest = max(depths, default=-1)
        q_pos = torch.tensor(
            [seg.start + d for d in depths] + [seg.start + deepest + 1 + r for r in range(rows - n)]
        ).clamp_max(self._rope_full.shape[1] - 1)  # padding rows: any finite position
        paths: list[_TreePath] = []
        done = [False] * n
        for path in tree_paths(seg.tree_parents):
            own = [j for j, node in enumerate(path) if not done[node]]
            for node in path:
                done[node] = True
            length = len(path)
            chain_rows = padded_rows(length, self.row_padding)
            end = seg.start + chain_rows
            nodes, owned = torch.tensor(path), torch.tensor(own)
            if self.native_ops:
                e = torch.empty(0, dtype=torch.bool)
                ranges = self._ranges(torch.arange(seg.start, end))
                paths.append(_TreePath(nodes, owned, chain_rows, e, e, ranges))
                continue
            causal, window = self._masks(torch.arange(seg.start, end), seg.cache.key_span(end))
            paths.append(_TreePath(nodes, owned, chain_rows, causal, window))
        empty = torch.empty(0, dtype=torch.bool)
        full_table = self._full_table(seg.cache)
        local = self._local_table(full_table)
        return _SegmentContext(empty, empty, full_table[:, q_pos], local[:, q_pos], paths)

    def _attention(
        self,
        x: Tensor,
        lw: LayerWeights,
        layer: int,
        sliding: bool,
        segments: list[Segment],
        spans: list[tuple[int, int, int]],
        ctx: list[_SegmentContext],
    ) -> Tensor:
        """x: [sum rows, dim] -> [sum rows, dim]; projections batched, attention per segment."""
        c = self.config
        hd, nh, nkv = c.head_dim, c.n_heads, c.n_kv_heads
        qkv = linear(x, lw.wqkv, lw.bqkv)  # [sum rows, (nh + 2 nkv) hd]
        outs = []
        none = self._rope_none if layer in c.no_rope_layers else None
        for seg, (o, t, n_real), sc in zip(segments, spans, ctx, strict=True):
            cs = sc.rope_local if sliding else sc.rope_full
            if none is not None:
                cs = none[:, :t]
            mask, keys = _visible(sc, sliding)
            if keys is not None and sc.paths is None and lw.q_norm is None:
                # one native call: rotary, cache write and attention of a chain (the
                # same float operations as the torch lines below, so bitwise the same)
                cache = seg.cache
                cache.check_rows(seg.start, t)
                outs.append(
                    native.rope_attend(
                        qkv[o : o + t],
                        (nh, nkv, hd),
                        cs[0],
                        cs[1],
                        cache.k[layer, 0],
                        cache.v[layer, 0],
                        seg.start,
                        *keys,
                        c.scale,
                        softcap=c.attn_softcap or 0.0,
                    )
                )
                continue
            q, k, v = qkv[o : o + t].split([nh * hd, nkv * hd, nkv * hd], dim=-1)
            if c.qk_norm_all_heads and lw.q_norm is not None and lw.k_norm is not None:
                q = rms_norm(q.contiguous(), lw.q_norm, c.norm_eps)
                k = rms_norm(k.contiguous(), lw.k_norm, c.norm_eps)
            q = q.view(t, nh, hd).transpose(0, 1)[None]  # [1, nh, T, hd]
            k = k.view(t, nkv, hd).transpose(0, 1)[None]  # [1, nkv, T, hd]
            v = v.view(t, nkv, hd).transpose(0, 1)[None]
            if not c.qk_norm_all_heads and lw.q_norm is not None and lw.k_norm is not None:
                q = rms_norm(q, lw.q_norm, c.norm_eps)
                k = rms_norm(k, lw.k_norm, c.norm_eps)
            q = apply_rope(q, cs[0], cs[1])
            k = apply_rope(k, cs[0], cs[1])
            if sc.paths is None:
                seg.cache.write(layer, seg.start, k, v)
                out = self._attend(q, seg.cache, layer, mask, keys)
            else:
                seg.tree_kv.append((k[:, :, :n_real].clone(), v[:, :, :n_real].clone()))
                out = q.new_zeros(nh, t, hd)
                for path in sc.paths:
                    length = path.nodes.shape[0]
                    seg.cache.write(layer, seg.start, k[:, :, path.nodes], v[:, :, path.nodes])
                    qp = q[:, :, path.nodes]
                    if path.rows > length:  # the chain's padding rows
                        qp = torch.cat([qp, qp.new_zeros(1, nh, path.rows - length, hd)], dim=2)
                    res = self._attend(qp, seg.cache, layer, *_visible(path, sliding))
                    out[:, path.nodes[path.own]] = res[:, path.own]
            outs.append(out.transpose(0, 1).reshape(t, nh * hd))
        return linear(torch.cat(outs) if len(outs) > 1 else outs[0], lw.wo)

    def _attend(
        self,
        q: Tensor,
        cache: KVCache,
        layer: int,
        mask: Tensor,
        key_range: tuple[Tensor, Tensor] | None,
    ) -> Tensor:
        """q [1, nh, T, hd] against the cache's keys under mask [T, span] (torch), or
        the key range [lo, hi) of each row (native) -> [nh, T, hd]."""
        c = self.config
        if key_range is not None:
            keys, values = cache.k[layer, 0], cache.v[layer, 0]  # [nkv, rows, hd]
            return native.attend(
                q[0].contiguous(), keys, values, *key_range, c.scale, softcap=c.attn_softcap or 0.0
            )
        keys, values = cache.view(layer, mask.shape[-1])  # [1, nkv, span, hd]
        return attend(q, keys, values, mask, c.scale, c.attn_softcap or 0.0)

    def _mlp(self, x: Tensor, lw: LayerWeights) -> Tensor:
        silu = self.config.activation == "silu"
        if silu and self.native_ops:  # the kernels' SiLU: the same bits as _fused_layers
            return linear(native.silu_mul(linear(x, lw.w_gate_up)), lw.w_down)
        gate, up = linear(x, lw.w_gate_up).chunk(2, dim=-1)
        act = F.silu(gate) if silu else F.gelu(gate, approximate="tanh")
        return linear(act * up, lw.w_down)
