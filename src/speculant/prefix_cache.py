"""Prefix caching: the keys and values of finished sequences, kept so that a later prompt
that starts the same way (a shared system prompt, the earlier turns of a chat, a
few-shot header) copies them instead of computing them again.

Entries are whole token sequences with their cache rows, found by the hashes of their
leading blocks of BLOCK tokens (each block's hash chains the ones before it, so a hash
names a whole prefix). A lookup walks a prompt's block hashes and takes the longest
prefix some entry holds (checked token by token, so a hash collision can only cost a
miss). Rows are copied, not shared: a hit costs a copy of the rows, which is far less
than computing them, and no entry is ever written by two sequences. Entries are evicted
least recently used under a byte budget.

A row's keys and values depend only on the tokens up to it (every pass computes a row
the same way, whatever else is in it), so a copied prefix gives the sequence exactly
the cache it would have computed: outputs are the same with and without the cache
(tested).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from torch import Tensor

from speculant.cache import KVCache

BLOCK = 16  # tokens per hashed block: prefixes are shared in whole blocks


@dataclass
class _Entry:
    tokens: list[int]
    k: Tensor  # [n_layers, 1, n_kv_heads, len(tokens), head_dim]
    v: Tensor
    keys: list[int]  # its block hashes
    rope_variant: int = 0  # the rotary table its keys were written with (KVCache's)

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()


def block_hashes(tokens: Sequence[int]) -> list[int]:
    """The chained hash of every whole block of `tokens` (the i-th names tokens
    [0, (i + 1) * BLOCK))."""
    out = []
    h = 0
    for i in range(len(tokens) // BLOCK):
        h = hash((h, tuple(tokens[i * BLOCK : (i + 1) * BLOCK])))
        out.append(h)
    return out


class PrefixCache:
    """Cached prefixes of one model, within `max_bytes` (see the module docstring)."""

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError(f"prefix cache of {max_bytes} bytes is out of range: use >= 0")
        self.max_bytes = max_bytes
        self.nbytes = 0
        self._entries: OrderedDict[int, _Entry] = OrderedDict()  # by id, oldest first
        self._by_hash: dict[int, int] = {}  # block hash -> id of the newest entry with it
        self._ids = 0
        self.blocks = 0  # whole blocks of every entry
        self.queries = 0  # prompt tokens looked up
        self.hits = 0  # of those, tokens copied from the cache

    def lookup(self, prompt: Sequence[int], cache: KVCache, limit: int) -> int:
        """Copy the longest cached prefix of prompt[:limit] (whole blocks) into `cache`,
        which must be empty; returns its length (0 on a miss)."""
        self.queries += limit
        best_id, n = 0, 0
        for i, h in enumerate(block_hashes(prompt[:limit])):
            entry_id = self._by_hash.get(h)
            if entry_id is None:
                break
            end = (i + 1) * BLOCK
            if self._entries[entry_id].tokens[:end] != list(prompt[:end]):
                break  # a hash collision
            if self._entries[entry_id].rope_variant != cache.rope_variant:
                break  # keys rotated by another table (LongRoPE's short / long)
            best_id, n = entry_id, end
        if n == 0:
            return 0
        best = self._entries[best_id]
        self._entries.move_to_end(best_id)
        cache.k[:, :, :, :n] = best.k[:, :, :, :n]
        cache.v[:, :, :, :n] = best.v[:, :, :, :n]
        cache.length = n
        self.hits += n
        return n

    def store(self, tokens: Sequence[int], cache: KVCache) -> None:
        """Keep the cache rows of tokens[:cache.length], in whole blocks (a sequence that
        ends: its prompt and output can start the next request)."""
        n = (min(len(tokens), cache.length) // BLOCK) * BLOCK
        if n == 0 or self.max_bytes == 0:
            return
        keys = block_hashes(tokens[:n])
        owner = self._by_hash.get(keys[-1])
        if owner is not None and self._entries[owner].tokens[:n] == list(tokens[:n]):
            self._entries.move_to_end(owner)  # held already, alone or as a longer one's prefix
            return
        entry = _Entry(
            list(tokens[:n]),
            cache.k[:, :, :, :n].clone(),
            cache.v[:, :, :, :n].clone(),
            keys,
            cache.rope_variant,
        )
        if entry.nbytes > self.max_bytes:
            return
        self._ids += 1
        self._entries[self._ids] = entry
        for h in keys:
            self._by_hash[h] = self._ids
        self.nbytes += entry.nbytes
        self.blocks += len(keys)
        while self.nbytes > self.max_bytes:
            self._evict()

    def _evict(self) -> None:
        old_id, old = self._entries.popitem(last=False)
        self.nbytes -= old.nbytes
        self.blocks -= len(old.keys)
        orphaned = [h for h in old.keys if self._by_hash.get(h) == old_id]
        for h in orphaned:
            del self._by_hash[h]
        if orphaned:  # another entry may hold the same prefix: point the hashes at it
            lost = set(orphaned)
            for entry_id, entry in self._entries.items():
                for h in entry.keys:
                    if h in lost:
                        self._by_hash[h] = entry_id
