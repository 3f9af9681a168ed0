"""Prefix caching: finished sequences leave their cache rows, later prompts that start
the same way copy them; outputs are the same with and without it, for every proposer,
with whole and chunked prefill; the store finds the longest whole-block prefix, survives
hash collisions, and evicts least recently used under its byte budget."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model

from speculant import Engine, SamplingParams
from speculant.cache import KVCache
from speculant.prefix_cache import BLOCK, PrefixCache
from speculant.proposers import available_methods


def _cache(length: int, seed: int, capacity: int = 128) -> KVCache:
    c = KVCache(2, 1, 4, capacity, torch.float32)
    g = torch.Generator().manual_seed(seed)
    c.k[:, :, :, :length] = torch.randn(c.k[:, :, :, :length].shape, generator=g)
    c.v[:, :, :, :length] = torch.randn(c.v[:, :, :, :length].shape, generator=g)
    c.length = length
    return c


def test_longest_whole_block_prefix_is_copied() -> None:
    store = PrefixCache(max_bytes=1 << 20)
    a = list(range(100))
    src = _cache(99, seed=1)
    store.store(a, src)  # 96 rows: six whole blocks
    assert store.blocks == 6
    prompt = a[:70] + [999] * 30  # shares 70 tokens: four whole blocks
    dst = KVCache(2, 1, 4, 128, torch.float32)
    n = store.lookup(prompt, dst, len(prompt) - 1)
    assert n == 4 * BLOCK and dst.length == n
    assert torch.equal(dst.k[:, :, :, :n], src.k[:, :, :, :n])
    assert torch.equal(dst.v[:, :, :, :n], src.v[:, :, :, :n])
    assert not dst.k[:, :, :, n:].any()  # nothing beyond the prefix
    # never more than the limit (the prompt's last token is fed to the first pass)
    assert store.lookup(a, KVCache(2, 1, 4, 128, torch.float32), 40) == 2 * BLOCK
    assert store.lookup([5] + a, KVCache(2, 1, 4, 128, torch.float32), 99) == 0
    assert store.hits == 6 * BLOCK and store.queries == 99 + 40 + 99
    held = store.nbytes
    store.store(a[:50], _cache(49, seed=1))  # a prefix of what is held: nothing added
    assert (store.nbytes, store.blocks) == (held, 6)


def test_a_hash_collision_is_a_miss(monkeypatch: pytest.MonkeyPatch) -> None:
    import speculant.prefix_cache as pc

    store = PrefixCache(max_bytes=1 << 20)
    store.store(list(range(40)), _cache(39, seed=2))
    monkeypatch.setattr(pc, "block_hashes", lambda tokens: [hash((0, 1))] * (len(tokens) // BLOCK))
    store._by_hash = {hash((0, 1)): next(iter(store._entries))}
    dst = KVCache(2, 1, 4, 128, torch.float32)
    assert store.lookup(list(range(100, 140)), dst, 39) == 0 and dst.length == 0


def test_eviction_keeps_the_budget_and_the_recent() -> None:
    one = _cache(32, seed=3).k[:, :, :, :32].numel() * 4 * 2  # bytes of a 32-row entry
    store = PrefixCache(max_bytes=2 * one)
    seqs = [[i * 1000 + t for t in range(33)] for i in range(3)]
    store.store(seqs[0], _cache(32, 0))
    store.store(seqs[1], _cache(32, 1))
    fresh = KVCache(2, 1, 4, 128, torch.float32)
    assert store.lookup(seqs[0], fresh, 32) == 32  # seqs[0] is now the most recent
    store.store(seqs[2], _cache(32, 2))  # evicts seqs[1]
    assert store.nbytes <= 2 * one
    lookups = [store.lookup(s, KVCache(2, 1, 4, 128, torch.float32), 32) for s in seqs]
    assert lookups == [32, 0, 32]
    store.store(seqs[2], _cache(32, 2))  # held already: nothing added
    assert store.nbytes == 2 * one and store.blocks == 4


def _engine(tiny_root, method: str) -> Engine:  # type: ignore[no-untyped-def]
    target = tiny_model(tiny_root, "llama", seed=1)
    draft = tiny_model(tiny_root, "llama", seed=1, num_hidden_layers=1)
    options: dict[str, object] = {"skip_layers": [1]} if method == "layer-skip" else {}
    if method == "eagle":
        from conftest import tiny_eagle_options

        options = tiny_eagle_options(target, tree_topk=1)
    return Engine(
        target,
        draft=draft if method == "draft" else None,
        method=method,
        num_speculative_tokens=3,
        proposer_options=options,
    )


def _conversation(engine: Engine, params: SamplingParams, store: PrefixCache | None, budget):  # type: ignore[no-untyped-def]
    """Three turns, each prompt the previous prompt and answer plus a new message."""
    prompt = [(7 * i + 3) % 90 for i in range(40)]
    outs = []
    for turn in range(3):
        sched = engine.scheduler(budget, store)
        sched.add(turn, prompt, params)
        while sched.busy:
            for event in sched.step():
                if event.result is not None:
                    outs.append((event.result.token_ids, event.result.logprobs))
        prompt = prompt + outs[-1][0] + [(11 * i + turn) % 90 for i in range(9)]
    return outs


@pytest.mark.parametrize("method", available_methods())
@pytest.mark.parametrize("budget", [None, 8])
def test_outputs_are_the_same_with_and_without_the_cache(tiny_root, method: str, budget) -> None:  # type: ignore[no-untyped-def]
    engine = _engine(tiny_root, method)
    for params in (
        SamplingParams(max_tokens=20, ignore_eos=True, logprobs=1),
        SamplingParams(
            temperature=0.9, top_p=0.9, max_tokens=20, seed=4, ignore_eos=True, logprobs=1
        ),
    ):
        plain = _conversation(engine, params, None, budget)
        store = PrefixCache(max_bytes=1 << 24)
        cached = _conversation(engine, params, store, budget)
        assert cached == plain, method  # tokens, and logprobs bitwise: the same cache rows
        if method in ("draft", "layer-skip"):  # the draft's own rows are cached too
            draft_store = engine.proposer.prefix_cache  # type: ignore[attr-defined]
            assert draft_store is not None and draft_store.hits > 0
        if method != "eagle":  # EAGLE needs every prompt position's features: no lookups
            # turns 2 and 3 copied their history (all but the partial last block)
            assert store.hits >= 2 * ((40 + 20) // BLOCK) * BLOCK, (store.hits, store.queries)
        else:
            assert store.hits == 0
