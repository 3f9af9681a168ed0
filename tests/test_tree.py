"""The lossless rule on draft trees (recursive rejection over siblings): greedy follows
the target's argmax, and sampled output follows the target's distribution exactly,
with deterministic (top-k) and with sampled candidates."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from test_distribution import chi2_rejects

from speculant.models.segment import Segment
from speculant.rejection import verify

VOCAB = 6
# root -> [a=2, b=4]; a -> [c=1, d=3]; b -> [e=0]
TOKENS = [2, 4, 1, 3, 0]
PARENTS = [-1, -1, 0, 0, 1]


def _tables(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """First-token distribution P1 [vocab] and second-token P2 [vocab, vocab]."""
    g = torch.Generator().manual_seed(seed)
    p1 = torch.softmax(torch.randn(VOCAB, generator=g) * 1.5, -1)
    p2 = torch.softmax(torch.randn(VOCAB, VOCAB, generator=g) * 1.5, -1)
    return p1, p2


def _p_rows(p1: torch.Tensor, p2: torch.Tensor) -> torch.Tensor:
    """Row 0: after the root; row i+1: after node i (its path's tokens)."""
    rows = [p1]
    for i, tok in enumerate(TOKENS):
        depth_one = PARENTS[i] == -1
        rows.append(p2[tok] if depth_one else torch.full((VOCAB,), 1.0 / VOCAB))
    return torch.stack(rows)


def test_greedy_follows_the_argmax_path() -> None:
    p = torch.zeros(len(TOKENS) + 1, VOCAB)
    p[0, 2] = 1  # the target wants a (node 0)
    p[1, 3] = 1  # then d (node 3)
    p[4, 5] = 1  # then 5 after d: the bonus
    v = verify(TOKENS, None, p, None, parents=PARENTS)
    assert v.path == [0, 3] and v.token_ids == [2, 3, 5]
    p[1] = 0
    p[1, 5] = 1  # after a the target wants 5: no child matches
    v = verify(TOKENS, None, p, None, parents=PARENTS)
    assert v.path == [0] and v.token_ids == [2, 5]
    p[0] = 0
    p[0, 3] = 1  # neither a nor b
    v = verify(TOKENS, None, p, None, parents=PARENTS)
    assert v.path == [] and v.token_ids == [3]


@pytest.mark.parametrize("sampled", [False, True])
def test_sampled_tree_output_follows_target(sampled: bool) -> None:
    p1, p2 = _tables(3)
    p_rows = _p_rows(p1, p2)
    q = None
    tokens = list(TOKENS)
    g = torch.Generator().manual_seed(0)
    n = 6000
    first: Counter = Counter()  # type: ignore[type-arg]
    second: Counter = Counter()  # type: ignore[type-arg]
    accepted_a = 0
    draft_q = torch.softmax(torch.randn(VOCAB, generator=torch.Generator().manual_seed(9)), -1)
    for _ in range(n):
        if sampled:
            # siblings drawn i.i.d. from q at the root; deeper nodes kept fixed, with q
            # a point mass there (a mix of both kinds in one tree)
            a, b = (int(t) for t in torch.multinomial(draft_q, 2, True, generator=g))
            tokens = [a, b, 1, 3, 0]
            q = torch.stack([draft_q, draft_q, *torch.eye(VOCAB)[[1, 3, 0]]])
            p_rows = torch.stack([p1, p2[a], p2[b], *[torch.full((VOCAB,), 1.0 / VOCAB)] * 3])
        v = verify(tokens, q, p_rows, g, parents=PARENTS)
        first[v.token_ids[0]] += 1
        if v.token_ids[0] == tokens[0] and v.path[:1] == [0]:
            accepted_a += 1
        if len(v.token_ids) > 1 and v.token_ids[0] == 2:
            second[v.token_ids[1]] += 1
    expected = {t: float(p1[t]) for t in range(VOCAB)}
    rejected, stat, crit = chi2_rejects(first, expected, n)
    assert not rejected, f"first token does not follow p: chi2={stat:.1f} > {crit:.1f}"
    assert 0 < accepted_a < n
    if not sampled:
        # after the first token 2 (node a, always accepted when emitted), the second
        # token follows P2[2]
        m = sum(second.values())
        rejected, stat, crit = chi2_rejects(second, {t: float(p2[2, t]) for t in range(VOCAB)}, m)
        assert not rejected, f"second token does not follow p: chi2={stat:.1f} > {crit:.1f}"
    # power: the same counts reject a wrong distribution
    wrong = {t: float(v) for t, v in enumerate(torch.softmax(torch.zeros(VOCAB), -1))}
    assert chi2_rejects(first, wrong, n)[0]


def test_tree_shape_is_checked() -> None:
    p = torch.full((3, VOCAB), 1.0 / VOCAB)
    with pytest.raises(ValueError, match="parents must come first"):
        verify([1, 2], None, p, None, parents=[1, -1])
    with pytest.raises(ValueError, match="rows"):
        verify([1, 2, 3], None, p, None, parents=[-1, 0, 0])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_tree_pass_matches_each_path_bitwise_and_keeps_the_path(
    tiny_root, arch: str, dtype: str
) -> None:  # type: ignore[no-untyped-def]
    """One tree pass gives every node bitwise the logits its path gets as a plain
    chain (each path is attended as that chain), and keeping an accepted path leaves
    the cache bitwise as a chain run over it would."""
    from conftest import tiny_model

    m = tiny_model(tiny_root, arch, seed=4, dtype=dtype)
    context = [5, 17, 3, 42, 8, 11, 30]
    tokens = [7, 9, 12, 14, 20, 2, 33, 21]
    parents = [-1, -1, 0, 0, 2, 1, 4, 2]  # a 4-level tree, 3 leaves
    start = len(context) - 1
    tree_cache = m.new_cache(40)
    m.prefill(context[:-1], tree_cache)
    # the root (last committed token) is fed with the tree, as the verify pass does
    seg = Segment(
        torch.tensor([context[-1], *tokens]), tree_cache, start, [-1, *[p + 1 for p in parents]]
    )
    all_logits, _ = m.net.forward_batch([seg])
    assert all_logits is not None
    logits, kv = all_logits[0], seg.tree_kv
    assert tree_cache.length == start

    def path_of(i: int) -> list[int]:
        out = []
        while i >= 0:
            out.append(i)
            i = parents[i]
        return out[::-1]

    for i in range(len(tokens)):
        chain = [context[-1], *[tokens[j] for j in path_of(i)]]
        cache = m.new_cache(40)
        m.prefill(context[:-1], cache)
        ref = m.forward(chain, cache, start)
        assert torch.equal(logits[i + 1], ref[-1]), i
        assert torch.equal(logits[0], ref[0])
    path = path_of(6)  # nodes 0, 2, 4, 6
    tree_cache.keep_path(start, kv, [0, *[j + 1 for j in path]])
    chain_cache = m.new_cache(40)
    m.prefill(context[:-1], chain_cache)
    m.forward([context[-1], *[tokens[j] for j in path]], chain_cache, start)
    assert tree_cache.length == chain_cache.length == start + 1 + len(path)
    n = tree_cache.length
    assert torch.equal(tree_cache.k[:, :, :, :n], chain_cache.k[:, :, :, :n])
    assert torch.equal(tree_cache.v[:, :, :, :n], chain_cache.v[:, :, :, :n])
    # decoding goes on from the kept path exactly as from the chain's cache
    nxt = [tokens[path[-1]] + 1]
    assert torch.equal(m.forward(nxt, tree_cache, n), m.forward(nxt, chain_cache, n))


def test_tree_layout_helpers() -> None:
    """Depths and root-to-leaf paths of hand-made trees; bad parents are refused."""
    from speculant.tree import tree_depths, tree_paths

    parents = [-1, 0, 0, 1, 1, 2, -1]
    assert tree_depths(parents) == [0, 1, 1, 2, 2, 2, 0]
    assert tree_paths(parents) == [[0, 1, 3], [0, 1, 4], [0, 2, 5], [6]]
    assert tree_paths([-1, 0, 1]) == [[0, 1, 2]]  # a chain is one path
    with pytest.raises(ValueError, match="parents must come first"):
        tree_depths([-1, 2, 0])


def test_tree_positions_and_path_masks(tiny_root) -> None:  # type: ignore[no-untyped-def]
    """A hand-made tree: every node's rotary position is start + depth, and each path
    is attended as a chain (row r sees the context and rows start..start+r)."""
    from conftest import tiny_model

    from speculant.models.segment import Segment

    m = tiny_model(tiny_root, "llama", seed=4)
    parents = [-1, 0, 0, 1, -1]  # two roots; node 3 under 1 under 0
    start = 10
    seg = Segment(torch.tensor([1, 2, 3, 4, 5]), m.new_cache(40), start, parents)
    ctx = m.net._segment_context(seg, 5)
    table = m.net._rope_full
    for node, depth in enumerate([0, 1, 1, 2, 0]):
        assert torch.equal(ctx.rope_full[:, node], table[:, start + depth])
    assert ctx.paths is not None
    assert [p.nodes.tolist() for p in ctx.paths] == [[0, 2], [0, 1, 3], [4]]
    # each node is computed by exactly one path
    owned = sorted(int(p.nodes[j]) for p in ctx.paths for j in p.own.tolist())
    assert owned == [0, 1, 2, 3, 4]
    for path in ctx.paths:
        n = path.nodes.numel()
        for r in range(n):
            row = path.causal[r]
            assert row[: start + r + 1].all() and not row[start + r + 1 :].any()
