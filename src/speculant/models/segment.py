"""`Segment`: one sequence's part of a target pass, the input of `Model.verify`."""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import Tensor

from speculant.cache import KVCache


@dataclass
class Segment:
    """One sequence's part of a batched pass: tokens [T] written to cache rows
    start..start+T-1, attending causally (a chain).

    A draft tree sets `tree_parents`: token i's parent among the T tokens (-1: the
    committed context; see speculant.tree). Each token then attends to the context and
    to its own ancestors only, at the rotary position start + its depth, and gets
    bitwise the logits it would get at the end of its path run as a chain. The pass
    leaves the cache's rows from `start` on unspecified and fills `tree_kv` (every
    node's keys and values, per layer); `KVCache.commit` then writes the accepted
    path's rows."""

    tokens: Tensor  # [T] int64
    cache: KVCache
    start: int
    tree_parents: list[int] | None = None  # [T]
    tree_kv: list[tuple[Tensor, Tensor]] = field(default_factory=list)
    logits: bool = True  # False: a prefill chunk; its logits come back empty [0, vocab]
