"""Row padding that makes a token's logits independent of how many rows share its pass.

CPU matmul kernels pick different code paths by row count (a matrix-vector kernel for
one row, small-tile kernels for a few, a remainder path for a partial tile), and each
path rounds differently. Which counts agree depends on the CPU, the library build and
the matrix shapes: on one machine bf16 rows agree for every count >= 2, on another only
for even counts >= 4. A verify pass over k+1 rows and a plain step over one row must
agree bitwise, or a near-tie argmax flips and greedy speculative output drifts.

So the padding is not assumed, it is measured: `calibrate` runs the decoder's own ops
(the projections with the model's real weights, both attention matmuls at the model's
head layout) at every padded row count up to CALIBRATION_ROWS, each row at every place
in the pass, and the projections also behind other sequences' rows (a batched pass),
and keeps the first (least rows, row multiple) rule under which every row is bitwise
the same in all of them. The answer is remembered per dtype, shapes and thread count.

Random inputs hide most differences: two float32 sums of the same products in another
order differ by a few float32 ulps, and rounding the result to bfloat16 (8 bits) erases
that in all but ~1 of 10^5 outputs (on an AVX-512 BF16 EPYC, SmolLM2's down projection
at one row against two rows: 2 of 6 million outputs, yet greedy speculative output
drifted in 15 of 20 runs). So each calibration row is made sensitive (`_sensitive_rows`):
two of its inputs are set so that one of its outputs cancels to ~2^-18 of its terms,
where a reordered sum shows in the rounded result.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from speculant.models.attention import attend_values
from speculant.models.formats import linear

if TYPE_CHECKING:
    from speculant.models.config import ModelConfig
    from speculant.models.formats import Linear, Weights

Padding = tuple[int, int]  # (least rows, row multiple)
CANDIDATES: tuple[Padding, ...] = (
    (1, 1),
    (2, 1),
    (2, 2),
    (4, 2),
    (4, 4),
    (8, 4),
    (8, 8),
    (16, 8),
    (16, 16),
)
MAX_PADDING = 16  # the most rows a padded pass adds (the cache's slack covers it)
CALIBRATION_ROWS = 24  # verify passes up to this many rows are checked
_KNOWN: dict[tuple[object, ...], Padding] = {}


def padded_rows(n: int, padding: Padding) -> int:
    least, multiple = padding
    n = max(n, least)
    return -(-n // multiple) * multiple


def _row_counts(padding: Padding) -> list[int]:
    return sorted({padded_rows(n, padding) for n in range(1, CALIBRATION_ROWS + 1)})


def _sensitive_rows(
    op: Callable[[Tensor], Tensor], width: int, n: int, dtype: torch.dtype, gen: torch.Generator
) -> Tensor:
    """n random [width] rows for op (row-wise affine), each with one output (a different
    one per row) cancelled to ~2^-18 of its terms' size: there any change in the order of
    op's float32 sum shows in the rounded result. Two inputs per row carry the
    cancellation, set one after the other from op's own columns (op of unit rows)."""
    x = torch.randn(n, width, generator=gen)
    probes = torch.randperm(width, generator=gen)[:16]
    units = torch.zeros(len(probes), width)
    units[torch.arange(len(probes)), probes] = 1.0
    zero = op(torch.zeros(1, width).to(dtype)).reshape(1, -1).float()
    cols = op(units.to(dtype)).reshape(len(probes), -1).float() - zero  # [probes, outs]
    reach = cols.abs().amax(dim=0)  # outputs some probed input moves
    candidates = torch.nonzero(reach > 0).flatten()
    if len(candidates) == 0:
        return x.to(dtype)
    targets = candidates[torch.randint(len(candidates), (n,), generator=gen)]
    rows = torch.arange(n)
    order = cols[:, targets].abs().argsort(dim=0, descending=True)  # [probes, n]
    first, second = probes[order[0]], probes[order[1]]
    x[rows, first] = 0.0
    x[rows, second] = 0.0
    for inp, rank in ((first, 0), (second, 1)):
        w = cols[order[rank], targets]  # [n]: d output / d input
        y = (op(x.to(dtype)).reshape(n, -1).float() - zero)[rows, targets]
        step = torch.where(w != 0, -y / torch.where(w != 0, w, 1.0), 0.0)
        x[rows, inp] = x[rows, inp] + step
    return x.to(dtype)


def _invariant(op: Callable[[Tensor], Tensor], x: Tensor, counts: list[int], shifted: bool) -> bool:
    """op maps [m, ...] rows to [m, ...] rows; True when every row is the same at every
    m and at every place in a pass of m rows, and (`shifted`) when a segment placed
    after other padded segments in a batched pass (an offset that is itself a padded
    count) gets the same rows as alone."""
    top = counts[-1]
    ref = op(x[:top])
    for m in counts[:-1]:
        for start in range(0, top - m + 1, m):
            if not torch.equal(op(x[start : start + m]), ref[start : start + m]):
                return False
    if not shifted:
        return True
    for offset in (counts[0], counts[0] + counts[1] if len(counts) > 1 else 2 * counts[0]):
        for m in counts[:3]:
            other = torch.flip(x[:offset], dims=[0])  # some other sequence's rows
            if not torch.equal(op(torch.cat([other, x[:m]]))[offset:], ref[:m]):
                return False
    return True


def _ops(
    config: ModelConfig, weights: Weights, dtype: torch.dtype
) -> list[Callable[[Tensor], Tensor]]:
    """The decoder's row-dependent ops, as functions of [T, width] inputs."""
    c = config
    lw = weights.layers[0]
    nh, nkv, hd = c.n_heads, c.n_kv_heads, c.head_dim
    rep = nh // nkv
    gen = torch.Generator().manual_seed(0)
    span = 128
    keys = torch.randn(nkv, span, hd, generator=gen).to(dtype)  # [nkv, span, hd]

    def grouped(x: Tensor, width: int) -> Tensor:  # [T, nh * width] -> [nkv, rep*T, width]
        t = x.shape[0]
        return x.view(t, nh, width).transpose(0, 1).reshape(nkv, rep * t, width)

    def ungrouped(y: Tensor, t: int) -> Tensor:  # [nkv, rep*T, w] -> [T, nkv, rep, w]
        return y.view(nkv, rep, t, -1).permute(2, 0, 1, 3)

    def scores(x: Tensor) -> Tensor:
        return ungrouped(torch.matmul(grouped(x, hd), keys.transpose(1, 2)), x.shape[0])

    def mix(x: Tensor) -> Tensor:
        return ungrouped(attend_values(grouped(x, span), keys), x.shape[0])

    def projection(w: Linear, bias: Tensor | None) -> Callable[[Tensor], Tensor]:
        return lambda x: linear(x, w, bias)

    ops: list[Callable[[Tensor], Tensor]] = [scores, mix]
    ops.append(projection(lw.wqkv, lw.bqkv))
    for w in (lw.wo, lw.w_gate_up, lw.w_down, weights.output):
        ops.append(projection(w, None))
    return ops


def _in_features(w: object) -> int:
    if isinstance(w, Tensor):
        return int(w.shape[1])
    return int(getattr(w, "in_features"))  # noqa: B009 (Int8Weight / Int4Weight)


def calibrate(config: ModelConfig, weights: Weights, dtype: torch.dtype) -> Padding:
    """The least padding rule under which this model's ops are row-count invariant here."""
    lw = weights.layers[0]
    widths = [
        config.n_heads * config.head_dim,  # attention scores: queries
        config.n_heads * 128,  # attention mix: probabilities over a 128-key span
        config.dim,  # qkv projection
        _in_features(lw.wo),
        config.dim,  # gate/up projection
        _in_features(lw.w_down),
        config.dim,  # LM head
    ]
    key = (
        dtype,
        type(lw.w_down).__name__,
        config.dim,
        config.n_heads,
        config.n_kv_heads,
        config.head_dim,
        tuple(widths),
        config.vocab_size,
        torch.get_num_threads(),
    )
    if key in _KNOWN:
        return _KNOWN[key]
    gen = torch.Generator().manual_seed(1)
    ops = _ops(config, weights, dtype)
    with torch.inference_mode():
        inputs = [_sensitive_rows(op, w, 32, dtype, gen) for op, w in zip(ops, widths, strict=True)]
    chosen: Padding | None = None
    with torch.inference_mode():
        for padding in CANDIDATES:
            counts = _row_counts(padding)
            # ops[0:2] are attention (run per segment); the rest see batched rows
            if all(
                _invariant(op, x, counts, shifted=i >= 2)
                for i, (op, x) in enumerate(zip(ops, inputs, strict=True))
            ):
                chosen = padding
                break
    if chosen is None:
        chosen = CANDIDATES[-1]
        warnings.warn(
            f"no row padding up to {chosen} makes {dtype} matmuls row-count invariant on "
            "this CPU: greedy speculative output may differ from plain decoding here "
            "(a .gguf model on the native kernels is row invariant by construction)",
            RuntimeWarning,
            stacklevel=2,
        )
    _KNOWN[key] = chosen
    return chosen
