"""Draft-free proposers, self-speculation and adaptive k: matchers on hand-written
sequences, greedy equivalence for every method, and the adaptive-k controller."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model
from oracles import plain_greedy

from speculant import Engine, SamplingParams
from speculant.adaptive import AdaptiveK
from speculant.proposers import available_methods, make_proposer
from speculant.proposers.layer_skip import LayerSkipProposer, block_influence, calibration_ids
from speculant.proposers.ngram import NgramProposer, scaled_take

GREEDY = SamplingParams()
GEN = torch.Generator()


def ngram_draft(context: list[int], k: int, **kw: int) -> list[int]:
    """The matcher alone: every match drafts k (match_scaled off unless asked)."""
    kw.setdefault("match_scaled", False)
    p = NgramProposer(**kw)
    p.begin(context, 100)
    return p.propose(context, k, GREEDY, GEN).token_ids


def test_ngram_no_repeat_drafts_nothing() -> None:
    assert ngram_draft([1, 2, 3, 4, 5, 6], 4) == []


def test_ngram_repeat_at_end_drafts_its_continuation() -> None:
    assert ngram_draft([7, 8, 9, 10, 11, 3, 7, 8], 3) == [9, 10, 11]


def test_ngram_prefers_the_longest_and_most_recent_match() -> None:
    # (2, 3) continued with 4 early and 9 late; the 3-gram (1, 2, 3) pins the early one.
    ctx = [1, 2, 3, 4, 5, 0, 2, 3, 9, 0, 1, 2, 3]
    assert ngram_draft(ctx, 2, ngram_max=3) == [4, 5]
    assert ngram_draft(ctx, 2, ngram_max=2) == [9, 0]  # most recent 2-gram match


def test_ngram_default_matches_suffixes_of_up_to_eight_tokens() -> None:
    # (3, 4, 5, 6) last continued with 80; the 7-gram (9, 1, ..., 6) only with 70
    ctx = [9, 1, 2, 3, 4, 5, 6, 70, 71, 0, 3, 4, 5, 6, 80, 81, 0, 9, 1, 2, 3, 4, 5, 6]
    assert NgramProposer().ngram_max == 8
    assert ngram_draft(ctx, 2) == [70, 71]
    assert ngram_draft(ctx, 2, ngram_max=4) == [80, 81]


def test_ngram_overlapping_and_longer_than_k() -> None:
    assert ngram_draft([1, 2, 1, 2, 1, 2], 5) == [1, 2]  # overlap: what exists so far
    long = list(range(20)) + [50] + list(range(5))
    assert ngram_draft(long, 4) == [5, 6, 7, 8]  # the match continues past k: exactly k


def test_ngram_drafts_as_many_as_the_match_is_long() -> None:
    """match_scaled (the default): a match of L tokens drafts max(2, 2L // 3) of the k."""
    # (7, 8) matched 2 tokens back: two draft tokens, the least any match drafts
    assert ngram_draft([7, 8, 9, 10, 11, 3, 7, 8], 3, match_scaled=True) == [9, 10]
    # ... unless the continuation ends first
    assert ngram_draft([7, 8, 9, 7, 8], 3, match_scaled=True) == [9, 7]
    assert ngram_draft([7, 8, 7, 8], 3, match_scaled=True) == [7, 8]
    # a 6-token copy (the 4-gram, then 2 more before it): 4 tokens
    ctx = [5, 6, 1, 2, 3, 4, 40, 41, 42, 43, 0, 5, 6, 1, 2, 3, 4]
    assert ngram_draft(ctx, 8, match_scaled=True) == [40, 41, 42, 43]
    assert ngram_draft(ctx, 8) == [40, 41, 42, 43, 0, 5, 6, 1]  # unscaled: k
    # a 7-token copy: still 4 (two thirds, rounded down); 9 tokens: 6
    head = [21, 22, 8, 5, 6, 1, 2, 3, 4]
    ctx = head + [40, 41, 42, 43, 0]
    assert ngram_draft(ctx + head[2:], 8, match_scaled=True) == [40, 41, 42, 43]
    assert ngram_draft(ctx + head, 8, match_scaled=True) == [40, 41, 42, 43, 0, 21]
    assert [scaled_take(n) for n in (1, 2, 3, 5, 6, 9, 12)] == [2, 2, 2, 3, 4, 6, 8]
    # a long copied span drafts all k; k still caps it
    span = list(range(100, 140))
    assert ngram_draft(span + [0] + span[:30], 6, match_scaled=True) == span[30:36]
    spawned = NgramProposer(ngram_max=3).spawn()
    assert spawned.match_scaled and spawned.ngram_max == 3


def test_ngram_incremental_index_matches_fresh_index() -> None:
    p = NgramProposer(ngram_max=3, ngram_min=1)
    seq = [int(x) for x in torch.randint(0, 5, (60,), generator=torch.Generator().manual_seed(0))]
    p.begin(seq[:5], 100)
    for end in range(5, 60):
        assert p.propose(seq[:end], 3, GREEDY, GEN).token_ids == ngram_draft(
            seq[:end], 3, ngram_max=3, ngram_min=1, match_scaled=True
        )


def test_ngram_bad_options() -> None:
    with pytest.raises(ValueError, match="ngram_min=3"):
        NgramProposer(ngram_min=3, ngram_max=2)


REPEATING = [3, 17, 42, 5, 9, 11, 3, 17, 42, 5, 9, 11, 3, 17]


def _method_kwargs(method: str, target, tiny_root):  # type: ignore[no-untyped-def]
    if method == "draft":
        return {"draft": tiny_model(tiny_root, "llama", seed=2, num_hidden_layers=1)}
    if method == "eagle":
        from conftest import tiny_eagle_options

        return {"proposer_options": tiny_eagle_options(target)}
    return {}


@pytest.mark.parametrize("method", [m for m in available_methods()])
@pytest.mark.parametrize("k", [3, "auto"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_every_method_is_greedy_equivalent(tiny_root, method: str, k, dtype: str) -> None:  # type: ignore[no-untyped-def]
    target = tiny_model(tiny_root, "llama", seed=1, dtype=dtype, num_hidden_layers=4)
    kwargs = _method_kwargs(method, target, tiny_root)
    if "draft" in kwargs:
        kwargs["draft"] = tiny_model(tiny_root, "llama", seed=2, dtype=dtype, num_hidden_layers=1)
    engine = Engine(target, method=method, num_speculative_tokens=k, **kwargs)
    reference = plain_greedy(target, REPEATING, 40)
    drafted = 0
    for _ in range(2):  # a second request exercises cross-request state
        res = engine.generate(REPEATING, SamplingParams(max_tokens=40, ignore_eos=True))
        assert res.token_ids == reference
        assert sum(res.stats.accepted_per_position) == res.stats.num_accepted
        assert res.stats.mean_accepted_length == pytest.approx(40 / res.stats.target_forwards)
        drafted += res.stats.num_drafted
    if method in ("draft", "layer-skip"):
        assert drafted > 0  # auto may settle on plain steps for a bad draft by request 2


def test_layer_skip_calibration_and_explicit_list(tiny_root) -> None:  # type: ignore[no-untyped-def]
    target = tiny_model(tiny_root, "qwen2", seed=1, num_hidden_layers=6)
    influence = block_influence(target, calibration_ids(target))
    assert len(influence) == 6 and all(x >= 0 for x in influence)
    auto = LayerSkipProposer(target, skip_ratio=0.5)
    assert len(auto.skip_layers) == 3 and 0 not in auto.skip_layers and 5 not in auto.skip_layers
    assert auto.skip_layers == sorted(sorted(range(1, 5), key=lambda i: influence[i])[:3])
    explicit = LayerSkipProposer(target, skip_layers=[2, 3])
    assert explicit.model.config.n_layers == 4
    # The skipped view shares the target's tensors: no second copy of the weights.
    assert explicit.model.net.weights.layers[0].wqkv is target.net.weights.layers[0].wqkv
    with pytest.raises(ValueError, match="skip_layers"):
        LayerSkipProposer(target, skip_layers=[9])
    with pytest.raises(ValueError, match="skip_ratio"):
        LayerSkipProposer(target, skip_ratio=1.5)


def test_methods_are_registered_not_branched() -> None:
    assert {"none", "draft", "ngram", "layer-skip"} <= set(available_methods())
    with pytest.raises(ValueError, match="unknown method"):
        make_proposer("nope", target=None)  # type: ignore[arg-type]


def _feed(policy: AdaptiveK, steps: int, accept_all: bool, verify_cost, draft_cost=0.0):  # type: ignore[no-untyped-def]
    for _ in range(steps):
        k = policy.choose(64)
        accepted = k if accept_all else 0
        policy.observe(k, accepted, draft_cost * k, verify_cost(k + 1))


def test_adaptive_k_falls_to_plain_when_drafts_fail() -> None:
    policy = AdaptiveK(k_max=8, probe_every=16)
    _feed(policy, 200, accept_all=False, verify_cost=lambda w: 0.2 + 0.01 * w, draft_cost=0.05)
    tail = list(policy.history)[-160:]
    assert tail.count(0) >= 145  # plain steps, with a one-token probe every 16
    assert max(tail) == 1


def test_adaptive_k_grows_when_drafts_are_good_and_verify_is_flat() -> None:
    policy = AdaptiveK(k_max=8)
    _feed(policy, 100, accept_all=True, verify_cost=lambda w: 0.2, draft_cost=0.0)
    assert list(policy.history)[-20:] == [8] * 20


def test_adaptive_k_balances_costly_drafts() -> None:
    # 70% acceptance, drafting one token costs a third of a verify pass.
    policy = AdaptiveK(k_max=8)
    g = torch.Generator().manual_seed(0)
    for _ in range(400):
        k = policy.choose(64)
        accepted = 0
        while accepted < k and float(torch.rand(1, generator=g)) < 0.7:
            accepted += 1
        policy.observe(k, accepted, 0.07 * k, 0.2)
    best = max(range(9), key=lambda k: sum(0.7**j for j in range(k + 1)) / (0.2 + 0.07 * k))
    assert abs(sorted(list(policy.history)[-100:])[50] - best) <= 1


def test_adaptive_k_estimates_conditional_acceptance_without_bias() -> None:
    """Positions after the first rejection are not judged, so they must not count as
    tried: with 90% conditional acceptance every position should read about 0.9."""
    policy = AdaptiveK(k_max=8, decay=1.0)
    g = torch.Generator().manual_seed(1)
    for _ in range(600):
        k = 8
        accepted = 0
        while accepted < k and float(torch.rand(1, generator=g)) < 0.9:
            accepted += 1
        policy.observe(k, accepted, 0.01 * k, 0.2)
    assert all(abs(r - 0.9) < 0.05 for r in policy.rates()[:5]), policy.rates()


def test_optional_abilities_are_protocols(tiny_root) -> None:  # type: ignore[no-untyped-def]
    """Each built-in proposer has exactly the optional abilities docs/proposers.md lists,
    seen through the protocols the scheduler checks (no attribute probing)."""
    from speculant.proposers import CachesPrompt, DraftsTogether, Spawns, UsesFeatures

    target = tiny_model(tiny_root, "llama", seed=1, num_hidden_layers=4)
    want = {
        "none": set(),
        "ngram": set(),
        "suffix": set(),
        "draft": {"DraftsTogether", "CachesPrompt"},
        "layer-skip": {"DraftsTogether", "CachesPrompt"},
        "eagle": {"UsesFeatures"},
    }
    assert set(want) == set(available_methods())
    for method, abilities in want.items():
        kwargs = _method_kwargs(method, target, tiny_root)
        options = kwargs.pop("proposer_options", {})
        proposer = make_proposer(method, target, kwargs.get("draft"), **options)
        assert isinstance(proposer, Spawns), method  # every built-in serves concurrent requests
        have = {
            name
            for name, ok in [
                ("DraftsTogether", issubclass(type(proposer), DraftsTogether)),
                ("CachesPrompt", isinstance(proposer, CachesPrompt)),
                ("UsesFeatures", isinstance(proposer, UsesFeatures)),
            ]
            if ok
        }
        assert have == abilities, method
