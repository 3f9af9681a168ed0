"""Suffix decoding proposer: trie consistency against brute force, drafting rules on
hand-written token lists, cross-request memory, eviction, and greedy equivalence through
the real engine on a tiny random model."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Sequence

import pytest
import torch
from conftest import tiny_model
from oracles import plain_greedy

from speculant import Engine, SamplingParams
from speculant.proposers.base import make_proposer
from speculant.proposers.suffix import SuffixProposer, _Node, _Trie

PARAMS = SamplingParams()


def propose(p: SuffixProposer, context: Sequence[int], k: int = 8) -> list[int]:
    return p.propose(list(context), k, PARAMS, torch.Generator()).token_ids


def one_shot(context: Sequence[int], k: int = 8, **options: object) -> list[int]:
    """Draft for `context` as the prompt of a fresh request."""
    p = SuffixProposer(None, **options)  # type: ignore[arg-type]
    p.begin(context, len(context) + 64)
    ids = propose(p, context, k)
    p.end()
    return ids


# -- the trie against brute force ----------------------------------------------------------


def substring_counts(seqs: Sequence[Sequence[int]], depth: int) -> Counter[tuple[int, ...]]:
    counts: Counter[tuple[int, ...]] = Counter()
    for s in seqs:
        for i in range(len(s)):
            for j in range(i + 1, min(i + depth, len(s)) + 1):
                counts[tuple(s[i:j])] += 1
    return counts


def trie_count(trie: _Trie, path: Sequence[int]) -> int:
    cur = trie.descend(path)
    if cur is None:
        return 0
    node, extra = cur
    return 1 if node.count == 1 else node.count


def check_trie(trie: _Trie, seqs: Sequence[Sequence[int]], alive: Sequence[list[int]]) -> None:
    depth = trie.max_depth
    truth = substring_counts(seqs, depth)
    for path, count in truth.items():
        assert trie_count(trie, path) == count, path
    # Nothing that never occurred is found (a few one-token extensions of true strings).
    vocab = {t for s in seqs for t in s} | {max((t for s in seqs for t in s), default=0) + 1}
    for path in list(truth)[:200]:
        if len(path) < depth:
            for t in vocab:
                ext = (*path, t)
                assert trie_count(trie, ext) == truth.get(ext, 0), ext
    # Structural invariants: counts, cont sums, node total, references alive.
    seen = 0
    stack: list[_Node] = [trie.root]
    while stack:
        node = stack.pop()
        if node is not trie.root:
            seen += 1
            assert node.count >= 1
            assert any(node.seq is s for s in alive)
            if node.count == 1:
                assert node.children is None
        if node.children:
            assert node.cont == sum(c.count for c in node.children.values())
            assert all(c.depth == node.depth + 1 <= depth for c in node.children.values())
            stack.extend(node.children.values())
    assert seen == trie.nodes


@pytest.mark.parametrize("seed", range(6))
def test_incremental_trie_matches_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    depth = rng.choice([2, 3, 5, 8])
    seq: list[int] = []
    trie = _Trie(depth)
    actives: list[_Node] = []
    tokens = [rng.randrange(3) for _ in range(40)] + [1, 2] * 10 + [0] * 8
    for t in tokens:
        actives = trie.extend(seq, actives, t)
    check_trie(trie, [seq], [seq])


def test_global_trie_add_remove_matches_brute_force() -> None:
    rng = random.Random(7)
    depth = 5
    trie = _Trie(depth)
    held: list[list[int]] = []
    for round_ in range(12):
        base = [rng.randrange(4) for _ in range(rng.randrange(1, 25))]
        tokens = base + base[: rng.randrange(len(base) + 1)] if round_ % 2 else base
        held.append(trie.add(tokens))
        if len(held) > 3:
            trie.remove(held.pop(0))
        check_trie(trie, held, held)
    while held:
        trie.remove(held.pop(0))
    assert trie.nodes == 0 and trie.root.children is None


# -- drafting rules --------------------------------------------------------------------------


def test_no_repeats_no_draft() -> None:
    assert one_shot([1, 2, 3, 4, 5, 6, 7]) == []


def test_repeat_drafts_the_continuation() -> None:
    assert one_shot([10, 11, 12, 13, 14, 10, 11], k=3) == [12, 13, 14]


def test_periodic_overlapping_matches() -> None:
    assert one_shot([1, 2, 1, 2, 1, 2], k=5) == [1, 2, 1, 2, 1]
    assert one_shot([7, 7, 7, 7], k=6) == [7] * 6
    # The occurrence being copied reaches the present and runs on into the drafts.
    assert one_shot([10, 11, 12, 13, 14, 10, 11], k=10) == [12, 13, 14, 10, 11] * 2


def test_long_match_gives_exactly_k() -> None:
    context = list(range(20, 60)) + list(range(20, 45))
    assert one_shot(context, k=4) == [45, 46, 47, 48]
    assert one_shot(context, k=12) == list(range(45, 57))
    assert one_shot(context, k=12, max_spec=2) == [45, 46]


def test_depth_cap_reanchors_for_long_drafts() -> None:
    # The match is capped at max_depth - 1 tokens; the walk re-anchors on shorter suffixes.
    context = list(range(100)) + list(range(40))
    assert one_shot(context, k=30, max_depth=8) == list(range(40, 70))


def test_most_frequent_continuation_wins() -> None:
    context = [5, 6, 7, 1, 5, 6, 8, 2, 5, 6, 7, 3, 5, 6, 7, 4, 5, 6]
    assert one_shot(context, k=1) == [7]  # 7 followed "5 6" three times, 8 once
    # p(7) = 3/4; then 1, 3 and 4 followed "5 6 7" once each: 3/4 * 1/3 < 0.5, stop.
    assert one_shot(context, k=8, min_prob=0.5) == [7]
    # With a lower bar the walk goes on; equal counts go to the most recent (4).
    assert one_shot(context, k=2, min_prob=0.2) == [7, 4]


def test_low_confidence_gives_shorter_drafts() -> None:
    confident = [5, 6, 1, 2, 8, 5, 6, 1, 2, 8, 5, 6, 1, 2, 8, 5, 6]
    branching = [5, 6, 1, 2, 8, 5, 6, 1, 2, 9, 5, 6, 1, 2, 10, 5, 6]
    assert one_shot(confident, k=8, min_prob=0.5) == [1, 2, 8, 5, 6, 1, 2, 8]
    # Three continuations of "5 6 1 2" seen once each: p = 1/3 < 0.5, so stop there.
    assert one_shot(branching, k=8, min_prob=0.5) == [1, 2]
    # Similar counts from the very first token: nothing is confident enough.
    assert one_shot([5, 6, 1, 5, 6, 2, 5, 6, 3, 5, 6], k=8, min_prob=0.5) == []


def test_incremental_context_between_proposes() -> None:
    p = SuffixProposer(None)  # type: ignore[arg-type]
    prompt = [1, 2, 3, 4]
    p.begin(prompt, 64)
    assert propose(p, prompt) == []
    ctx = prompt + [9, 1, 2]
    assert propose(p, ctx, k=3) == [3, 4, 9]
    ctx += [3, 4, 9, 7]
    assert propose(p, ctx, k=2) == []  # "9 7" and "7" are new
    ctx += [1]
    assert propose(p, ctx, k=3) == [2, 3, 4]  # "1": most recent continuation
    p.end()


# -- cross-request memory and eviction ---------------------------------------------------------


def run_request(p: SuffixProposer, prompt: list[int], output: list[int], k: int = 4) -> None:
    """begin, propose at every committed length, end: as the engine would."""
    p.begin(prompt, len(prompt) + len(output) + 8)
    for n in range(len(output) + 1):
        propose(p, prompt + output[:n], k)
    p.end()


def test_cross_request_memory() -> None:
    p = SuffixProposer(None)  # type: ignore[arg-type]
    out_a = [40, 41, 42, 43, 44, 45, 46]
    run_request(p, [1, 2, 3], out_a)
    assert p.global_requests == 1 and p.global_tokens == len(out_a)
    prompt_b = [9, 8, 40, 41, 42]
    p.begin(prompt_b, 32)
    assert propose(p, prompt_b, k=3) == [43, 44, 45]
    p.end()
    # A fresh proposer has no memory of A.
    assert one_shot(prompt_b, k=3) == []


def test_own_request_wins_ties_and_global_wins_longer_matches() -> None:
    p = SuffixProposer(None)  # type: ignore[arg-type]
    run_request(p, [1], [50, 51, 52, 53, 60])
    # Own match "52 53" (then 70) vs global "52 53" (then 60): equal length, own wins.
    prompt = [52, 53, 70, 52, 53]
    p.begin(prompt, 32)
    assert propose(p, prompt, k=1) == [70]
    p.end()
    # Global match "51 52 53" is longer than own "52 53": global wins.
    prompt = [52, 53, 70, 51, 52, 53]
    p.begin(prompt, 32)
    assert propose(p, prompt, k=1) == [60]
    p.end()


def test_eviction_forgets_oldest_and_bounds_memory() -> None:
    p = SuffixProposer(None, max_tree_tokens=10)  # type: ignore[arg-type]
    out_a = [40, 41, 42, 43, 44, 45]
    out_b = [60, 61, 62, 63, 64, 65]
    run_request(p, [1], out_a)
    run_request(p, [2], out_b)  # 6 + 6 > 10: A is evicted
    assert p.global_requests == 1 and p.global_tokens == 6
    assert one_shot_with(p, [9, 40, 41]) == []
    assert one_shot_with(p, [9, 60, 61]) == [62, 63, 64]
    rng = random.Random(0)
    for _ in range(30):
        out = [rng.randrange(5) for _ in range(rng.randrange(1, 30))]
        run_request(p, [rng.randrange(5)], out)
        assert p.global_tokens <= 10
        assert p.global_nodes <= 10 * 8  # depth-capped trie over at most 10 tokens
    # A request longer than the cap keeps only its last tokens.
    run_request(p, [1], list(range(100, 130)))
    assert p.global_tokens == 10 and p.global_requests == 1
    assert one_shot_with(p, [7, 124, 125]) == [126, 127, 128]
    assert one_shot_with(p, [7, 100, 101]) == []


def test_node_cap_evicts() -> None:
    p = SuffixProposer(None, max_tree_nodes=50)  # type: ignore[arg-type]
    for i in range(10):
        run_request(p, [1], [200 + i] + list(range(30)) * 2, k=2)
        assert p.global_nodes <= 50
    assert p.global_requests <= 1


def one_shot_with(p: SuffixProposer, prompt: list[int], k: int = 3) -> list[int]:
    p.begin(prompt, len(prompt) + 8)
    ids = propose(p, prompt, k)
    p.end()
    return ids


def test_options_validated_and_registered() -> None:
    for bad in ({"max_depth": 1}, {"max_tree_tokens": -1}, {"min_prob": 1.5}, {"max_spec": -1}):
        with pytest.raises(ValueError):
            SuffixProposer(None, **bad)  # type: ignore[arg-type]
    p = make_proposer("suffix", target=None, max_depth=16)  # type: ignore[arg-type]
    assert isinstance(p, SuffixProposer) and p.name == "suffix" and p.max_depth == 16
    assert one_shot([1, 2, 3], k=0) == []


# -- through the engine ------------------------------------------------------------------------


def test_greedy_equivalence_through_engine(tiny_root) -> None:  # type: ignore[no-untyped-def]
    target = tiny_model(tiny_root, "llama", seed=1, dtype="bfloat16")
    engine = Engine(target, proposer=SuffixProposer(target), num_speculative_tokens=6)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    prompt_a = [3, 17, 42, 5, 9, 11] * 3
    res = engine.generate(prompt_a, params)
    assert res.token_ids == plain_greedy(target, prompt_a, 40)
    assert res.stats.num_drafted > 0
    # Second request: its prompt ends with a piece of A's output, so the global trie helps.
    prompt_b = [60, 61, *res.token_ids[10:16]]
    res_b = engine.generate(prompt_b, params)
    assert res_b.token_ids == plain_greedy(target, prompt_b, 40)
    assert res_b.stats.num_drafted > 0
