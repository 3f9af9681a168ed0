"""Preallocated key/value cache: written at explicit positions, rolled back by truncate
(after a verify pass: `commit`, which keeps the accepted rows of a chain or a tree).

The cache never reallocates during a request. Rows past `length` may hold stale
values (rejected drafts, padding rows): nothing reads them, because attention only
looks at keys below the query's own position, and the next write overwrites them.
"""

from __future__ import annotations

import torch
from torch import Tensor

# Attention reads keys in whole blocks of this many positions (see decoder: reductions
# over a fixed-size, zero-padded row keep results independent of the pass's length).
KEY_BLOCK = 64


class CacheFullError(RuntimeError):
    """A write would go past the cache's capacity."""


class KVCache:
    """Keys and values for every layer of one sequence.

    k, v: [n_layers, 1, n_kv_heads, rows, head_dim], rows >= capacity + slack rounded up
    to KEY_BLOCK. The slack absorbs the padding rows of a forward (decoder.padded_rows),
    so a padded pass at the very end of the context never writes out of bounds. Rows
    never written stay zero (finite), so masked keys contribute exact zeros.
    """

    def __init__(
        self,
        n_layers: int,
        n_kv_heads: int,
        head_dim: int,
        capacity: int,
        dtype: torch.dtype,
        slack: int = 16,
    ) -> None:
        if capacity < 1:
            raise ValueError(f"cache capacity={capacity} must be >= 1")
        # Rows rounded up to KEY_BLOCK so attention can always read whole blocks.
        rows = -(-(capacity + slack) // KEY_BLOCK) * KEY_BLOCK
        shape = (n_layers, 1, n_kv_heads, rows, head_dim)
        self.k: Tensor = torch.zeros(shape, dtype=dtype)
        self.v: Tensor = torch.zeros(shape, dtype=dtype)
        self.capacity = capacity
        self.rows = rows
        self.length = 0  # number of valid positions, [0, length)
        # Which of its model's rotary tables rotates this sequence's keys: 1 for
        # LongRoPE's long one (set by the model's new_cache), else 0.
        self.rope_variant = 0

    def write(self, layer: int, start: int, k_new: Tensor, v_new: Tensor) -> None:
        """k_new, v_new: [1, n_kv_heads, t, head_dim] for positions start .. start+t-1."""
        t = k_new.shape[2]
        self.check_rows(start, t)
        self.k[layer, :, :, start : start + t] = k_new
        self.v[layer, :, :, start : start + t] = v_new

    def check_rows(self, start: int, t: int) -> None:
        """Raise CacheFullError unless rows start .. start+t-1 exist."""
        if start + t > self.rows:
            raise CacheFullError(
                f"writing positions {start}..{start + t - 1} exceeds the cache capacity "
                f"{self.capacity}"
            )

    def key_span(self, end: int) -> int:
        """How many positions attention reads to see [0, end): end rounded up to a block."""
        return min(-(-end // KEY_BLOCK) * KEY_BLOCK, self.rows)

    def view(self, layer: int, span: int) -> tuple[Tensor, Tensor]:
        """Keys and values of positions [0, span): each [1, n_kv_heads, span, head_dim]."""
        return self.k[layer, :, :, :span], self.v[layer, :, :, :span]

    def commit(
        self, start: int, rows: list[int], tree_kv: list[tuple[Tensor, Tensor]] | None = None
    ) -> None:
        """After a verify pass at `start`: keep the pass's rows `rows` (the accepted path,
        root first: row 0 is the token fed at `start`) and drop the rest, so the cache
        holds start + len(rows) positions.

        A chain pass (no `tree_kv`) wrote its rows in place: its accepted rows are a
        prefix 0..m-1 and the rest is rolled back. A tree pass left every node's keys
        and values in `tree_kv` (`Segment.tree_kv`): the accepted path's are
        written at rows start, start+1, .... Rows before `start` are untouched."""
        if tree_kv:
            self.keep_path(start, tree_kv, rows)
            return
        if rows != list(range(len(rows))):
            raise ValueError(f"commit({start}, rows={rows}): a chain keeps a prefix of its rows")
        self.truncate(start + len(rows))

    def truncate(self, length: int) -> None:
        """Roll back to the first `length` positions."""
        if not 0 <= length <= self.capacity:
            raise ValueError(f"truncate({length}) outside [0, {self.capacity}]")
        self.length = length

    def keep_path(self, start: int, tree_kv: list[tuple[Tensor, Tensor]], nodes: list[int]) -> None:
        """After a tree pass at `start`: write the keys and values of the tree nodes
        `nodes` (the accepted path, root first) at rows start, start+1, ..., and set
        length to start + len(nodes). tree_kv: per layer ([1, nkv, n, hd] keys, values)
        of every node (models.segment.Segment.tree_kv). Rows before `start` are untouched."""
        if len(tree_kv) != self.k.shape[0]:
            raise ValueError(f"tree_kv has {len(tree_kv)} layers, the cache {self.k.shape[0]}")
        n = tree_kv[0][0].shape[2] if tree_kv else 0
        if any(not 0 <= j < n for j in nodes) or start + len(nodes) > self.capacity:
            raise ValueError(f"keep_path({start}, nodes={nodes}): nodes must be in 0..{n - 1}")
        idx = torch.tensor(nodes, dtype=torch.long)
        dst = slice(start, start + len(nodes))
        for layer, (k, v) in enumerate(tree_kv):
            self.k[layer, :, :, dst] = k[:, :, idx]
            self.v[layer, :, :, dst] = v[:, :, idx]
        self.length = start + len(nodes)

    def copy_from(self, other: KVCache) -> None:
        """Take `other`'s positions [0, other.length) (a prompt prefilled once, shared by
        several sequences); the two caches stay independent afterwards."""
        if self.k.shape[:3] != other.k.shape[:3] or self.k.shape[4] != other.k.shape[4]:
            raise ValueError(
                f"cache shapes differ: {tuple(self.k.shape)} vs {tuple(other.k.shape)}"
            )
        if other.length > self.capacity:
            raise ValueError(f"{other.length} positions do not fit a capacity of {self.capacity}")
        n = other.length
        self.k[:, :, :, :n] = other.k[:, :, :, :n]
        self.v[:, :, :, :n] = other.v[:, :, :, :n]
        self.length = n
        self.rope_variant = other.rope_variant  # its keys' rotary table goes on

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2
