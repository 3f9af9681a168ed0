"""Preallocated key/value cache: written at explicit positions, rolled back by truncate.

The cache never reallocates during a request. Rows past `length` may hold stale
values (rejected drafts, padding rows): nothing reads them, because attention only
looks at keys below the query's own position, and the next write overwrites them.
"""

from __future__ import annotations

import torch
from torch import Tensor


class CacheFullError(RuntimeError):
    """A write would go past the cache's capacity."""


class KVCache:
    """Keys and values for every layer of one sequence.

    k, v: [n_layers, 1, n_kv_heads, capacity + slack, head_dim]. `slack` rows past the
    capacity absorb the padding rows of a forward (see Transformer.min_rows), so a
    padded pass at the very end of the context never writes out of bounds.
    """

    def __init__(
        self,
        n_layers: int,
        n_kv_heads: int,
        head_dim: int,
        capacity: int,
        dtype: torch.dtype,
        slack: int = 8,
    ) -> None:
        if capacity < 1:
            raise ValueError(f"cache capacity={capacity} must be >= 1")
        shape = (n_layers, 1, n_kv_heads, capacity + slack, head_dim)
        self.k: Tensor = torch.zeros(shape, dtype=dtype)
        self.v: Tensor = torch.zeros(shape, dtype=dtype)
        self.capacity = capacity
        self.slack = slack
        self.length = 0  # number of valid positions, [0, length)

    def write(self, layer: int, start: int, k_new: Tensor, v_new: Tensor) -> None:
        """k_new, v_new: [1, n_kv_heads, t, head_dim] for positions start .. start+t-1."""
        t = k_new.shape[2]
        if start + t > self.capacity + self.slack:
            raise CacheFullError(
                f"writing positions {start}..{start + t - 1} exceeds the cache capacity "
                f"{self.capacity}"
            )
        self.k[layer, :, :, start : start + t] = k_new
        self.v[layer, :, :, start : start + t] = v_new

    def view(self, layer: int, end: int) -> tuple[Tensor, Tensor]:
        """Keys and values of positions [0, end): each [1, n_kv_heads, end, head_dim]."""
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]

    def truncate(self, length: int) -> None:
        """Roll back to the first `length` positions (the only rollback operation)."""
        if not 0 <= length <= self.capacity:
            raise ValueError(f"truncate({length}) outside [0, {self.capacity}]")
        self.length = length

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2
