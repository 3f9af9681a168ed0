"""Statistical tests that speculative sampling emits the target's distribution exactly.

Exact distributions are enumerated on tiny models (vocab 8), the sampled frequencies are
compared with a chi-square test at the 0.1% level, and the same samples must *fail*
against the draft's own distribution: the test has power, it is not a rubber stamp.
Every sample uses its own fixed seed, so the test is deterministic.
"""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
from conftest import tiny_model

from speculant import Engine, SamplingParams
from speculant.models.model import Model
from speculant.rejection import verify
from speculant.sampling import penalize, process_logits, sample

VOCAB = 8
SMALL = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1)


def chi2_critical(dof: int, z: float = 3.09) -> float:
    """Upper 0.1% point of chi-square (Wilson-Hilferty approximation)."""
    a = 2.0 / (9.0 * dof)
    return dof * (1.0 - a + z * math.sqrt(a)) ** 3


def chi2_rejects(counts: Counter, expected: dict, n: int) -> tuple[bool, float, float]:  # type: ignore[type-arg]
    """Pool bins whose expected count is < 5; returns (rejected, statistic, critical)."""
    stat, pooled_obs, pooled_exp, bins = 0.0, 0.0, 0.0, 0
    for outcome in set(expected) | set(counts):
        e = expected.get(outcome, 0.0) * n
        o = counts.get(outcome, 0)
        if e < 5:
            pooled_obs += o
            pooled_exp += e
            continue
        stat += (o - e) ** 2 / e
        bins += 1
    if pooled_exp > 0:
        stat += (pooled_obs - pooled_exp) ** 2 / max(pooled_exp, 1e-9)
        bins += 1
    elif pooled_obs > 0:
        return True, math.inf, 0.0  # outcomes the distribution says are impossible
    crit = chi2_critical(max(bins - 1, 1))
    return stat > crit, stat, crit


def exact_two_token(model: Model, prompt: list[int], params: SamplingParams) -> dict:  # type: ignore[type-arg]
    """P(t1, t2 | prompt) under `params`' processing, by enumeration."""
    logits = model.forward(prompt, model.new_cache(16), 0)[-1:]
    n = len(prompt)
    p1 = process_logits(penalize(logits, params, [prompt], n), params)[0]
    out = {}
    for t1 in range(VOCAB):
        if p1[t1] == 0:
            continue
        l2 = model.forward([*prompt, t1], model.new_cache(16), 0)[-1:]
        p2 = process_logits(penalize(l2, params, [[*prompt, t1]], n), params)[0]
        for t2 in range(VOCAB):
            if p2[t2] > 0:
                out[(t1, t2)] = float(p1[t1] * p2[t2])
    return out


SETTINGS = [
    SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True),
    SamplingParams(temperature=0.7, top_k=4, max_tokens=3, ignore_eos=True),
    SamplingParams(temperature=1.3, top_p=0.8, max_tokens=3, ignore_eos=True),
    SamplingParams(
        temperature=1.0,
        max_tokens=3,
        ignore_eos=True,
        frequency_penalty=1.0,
        presence_penalty=0.5,
        repetition_penalty=1.5,
        logit_bias={3: 1.0},
    ),
]


def unseeded(monkeypatch, start: int) -> None:  # type: ignore[no-untyped-def]
    """Make unseeded requests (the standard accept / resample rule) reproducible: each
    request's generator gets the next seed of a counter instead of fresh entropy."""
    import itertools

    import speculant.scheduler

    counter = itertools.count(start)
    monkeypatch.setattr(
        speculant.scheduler,
        "make_generator",
        lambda _: torch.Generator().manual_seed(next(counter)),
    )


@pytest.mark.parametrize(
    "params", SETTINGS, ids=["T1", "T0.7-topk4", "T1.3-topp0.8", "T1-penalties"]
)
@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("rule", ["standard", "coupled"])
def test_engine_samples_follow_target(
    tiny_root, monkeypatch, params: SamplingParams, k: int, rule: str
) -> None:  # type: ignore[no-untyped-def]
    """Unseeded requests take the standard rule, seeded ones the coupled rule: both emit
    the target's distribution, and neither the draft's."""
    target = tiny_model(tiny_root, "llama", seed=11, **SMALL)
    draft = tiny_model(tiny_root, "llama", seed=12, **SMALL)
    prompt = [1, 5, 2]
    engine = Engine(target, draft=draft, num_speculative_tokens=k)
    n = 2500
    counts: Counter = Counter()  # type: ignore[type-arg]
    drafted = accepted = 0
    unseeded(monkeypatch, 1000 * k)
    for i in range(n):
        seed = 1000 * k + i if rule == "coupled" else None
        p = SamplingParams(**{**params.__dict__, "seed": seed})
        res = engine.generate(prompt, p)
        counts[tuple(res.token_ids[:2])] += 1
        drafted += res.stats.num_drafted
        accepted += res.stats.num_accepted
    assert 0 < accepted < drafted  # both acceptance and rejection were exercised
    rejected, stat, crit = chi2_rejects(counts, exact_two_token(target, prompt, params), n)
    assert not rejected, f"samples do not follow the target: chi2={stat:.1f} > {crit:.1f}"
    rejected, stat, crit = chi2_rejects(counts, exact_two_token(draft, prompt, params), n)
    assert rejected, f"test has no power: draft distribution not rejected (chi2={stat:.1f})"
    if params.penalized:  # and the penalties are live: the unpenalized target is rejected
        free = SamplingParams(temperature=params.temperature, max_tokens=3, ignore_eos=True)
        rejected, stat, crit = chi2_rejects(counts, exact_two_token(target, prompt, free), n)
        assert rejected, f"penalties changed nothing measurable (chi2={stat:.1f})"


@pytest.mark.parametrize("point_mass", [False, True])
@pytest.mark.parametrize("rule", ["standard", "coupled"])
def test_rule_alone_preserves_p(point_mass: bool, rule: str) -> None:
    """verify on fixed rows, one seed per trial: the first emitted token follows
    p[0], the second (when the first draft was kept) follows p[1], for stochastic and
    point-mass drafts, under the standard rule (drafts drawn from q with the trial's
    generator) and the coupled one (drafts drawn from q with the position noise)."""
    from speculant.sampling import Coupled, seeded_pick

    g = torch.Generator().manual_seed(0)
    p_rows = torch.softmax(torch.randn(3, 6, generator=g) * 1.5, -1)  # [k+1, vocab]
    q_rows = torch.softmax(torch.randn(2, 6, generator=g) * 1.5, -1)  # [k, vocab]
    n = 20000
    first: Counter = Counter()  # type: ignore[type-arg]
    second: Counter = Counter()  # type: ignore[type-arg]
    n_second = 0
    for i in range(n):
        gen = torch.Generator().manual_seed(i)
        coupled = Coupled(seed=i, start=40) if rule == "coupled" else None
        if point_mass:
            drafts = [2, 4]
        elif coupled is not None:
            drafts = [seeded_pick(q_rows[j], i, 40 + j) for j in range(2)]
        else:
            drafts = [int(torch.multinomial(q_rows[j], 1, generator=gen)) for j in range(2)]
        verdict = verify(drafts, None if point_mass else q_rows, p_rows, gen, coupled)
        assert verdict.token_ids[: verdict.num_accepted] == drafts[: verdict.num_accepted]
        first[verdict.token_ids[0]] += 1
        if verdict.num_accepted >= 1:
            second[verdict.token_ids[1]] += 1
            n_second += 1
    expected_first = {t: float(p_rows[0, t]) for t in range(6)}
    assert not chi2_rejects(first, expected_first, n)[0]
    assert not chi2_rejects(second, {t: float(p_rows[1, t]) for t in range(6)}, n_second)[0]
    wrong = {t: float(q_rows[0, t]) for t in range(6)} if not point_mass else {2: 1.0}
    assert chi2_rejects(first, wrong, n)[0]
    if rule == "coupled" and point_mass:  # kept exactly when p's draw is the draft: p(2)
        assert abs(n_second / n - float(p_rows[0, 2])) < 4 * (0.25 / n) ** 0.5
    elif rule == "coupled":  # coupled through the noise: above independent draws' sum p q
        independent = float((p_rows[0] * q_rows[0]).sum())
        assert n_second / n > independent + 0.05


def test_greedy_rule_is_argmax() -> None:
    p = process_logits(torch.tensor([[0.1, 2.0, 0.3], [1.0, 0.0, 5.0]]), SamplingParams())
    q = process_logits(torch.tensor([[0.1, 2.0, 0.3]]), SamplingParams())
    v = verify([1], q, p, torch.Generator().manual_seed(0))
    assert v.num_accepted == 1 and v.token_ids == [1, 2]
    v = verify([0], None, p, torch.Generator().manual_seed(0))
    assert v.num_accepted == 0 and v.token_ids == [1]


@pytest.mark.parametrize("method", ["ngram", "layer-skip", "suffix"])
@pytest.mark.parametrize("k", [2, "auto"])
def test_every_proposer_samples_follow_target(tiny_root, method: str, k) -> None:  # type: ignore[no-untyped-def]
    """Seeded requests (the coupled rule) with every other proposer."""
    from speculant.proposers import available_methods

    if method not in available_methods():
        pytest.fail(f"method {method} is not registered")
    target = tiny_model(tiny_root, "llama", seed=11, **{**SMALL, "num_hidden_layers": 3})
    prompt = [1, 5, 2, 1, 5]  # repeats, so lookup-based proposers find drafts
    engine = Engine(target, method=method, num_speculative_tokens=k)
    params = SamplingParams(temperature=1.0, top_k=6, max_tokens=3, ignore_eos=True)
    n = 2500
    counts: Counter = Counter()  # type: ignore[type-arg]
    drafted = 0
    for i in range(n):
        res = engine.generate(prompt, SamplingParams(**{**params.__dict__, "seed": 77_000 + i}))
        counts[tuple(res.token_ids[:2])] += 1
        drafted += res.stats.num_drafted
    assert drafted > 0
    rejected, stat, crit = chi2_rejects(counts, exact_two_token(target, prompt, params), n)
    assert not rejected, f"{method}: samples do not follow the target: chi2={stat:.1f} > {crit:.1f}"


def test_int4_draft_samples_follow_target(tiny_root) -> None:  # type: ignore[no-untyped-def]
    """A draft quantized to int4 drafts from its own (coarser) q; the rule corrects it
    to the fp32 target's distribution exactly."""
    params = SETTINGS[0]
    target = tiny_model(tiny_root, "llama", seed=11, **SMALL)
    draft = tiny_model(tiny_root, "llama", seed=12, dtype="int4", **SMALL)
    assert draft.weight_format == "int4"
    prompt = [1, 5, 2]
    engine = Engine(target, draft=draft, num_speculative_tokens=2)
    n = 2500
    counts: Counter = Counter()  # type: ignore[type-arg]
    for i in range(n):
        res = engine.generate(prompt, SamplingParams(**{**params.__dict__, "seed": 7000 + i}))
        counts[tuple(res.token_ids[:2])] += 1
    rejected, stat, crit = chi2_rejects(counts, exact_two_token(target, prompt, params), n)
    assert not rejected, f"samples do not follow the target: chi2={stat:.1f} > {crit:.1f}"
    rejected, stat, crit = chi2_rejects(counts, exact_two_token(draft, prompt, params), n)
    assert rejected, f"test has no power: draft distribution not rejected (chi2={stat:.1f})"


def test_a_draft_with_zero_q_is_refused() -> None:
    """u * q < p would accept a token the draft could not have sampled (q = 0) whenever
    p > 0, silently leaving the target's distribution: it is an error, chain and tree."""
    p = torch.tensor([[0.5, 0.5, 0.0], [0.2, 0.3, 0.5]])
    q = torch.tensor([[1.0, 0.0, 0.0]])
    g = torch.Generator().manual_seed(0)
    with pytest.raises(ValueError, match="draft token 1 at draft position 0 has probability 0"):
        verify([1], q, p, g)
    with pytest.raises(ValueError, match="draft token 1 at draft position 0 has probability 0"):
        verify([1], q, p, g, parents=[-1])
    assert verify([0], q, p, g).token_ids[0] in (0, 1)  # q > 0: the rule as before


def test_seeded_tree_rule_follows_p() -> None:
    """verify's coupled rule on a tree: the emitted first token follows p[0] and the walk
    follows the child holding the target's draw."""
    from speculant.sampling import Coupled

    g = torch.Generator().manual_seed(1)
    p_rows = torch.softmax(torch.randn(4, 5, generator=g) * 1.5, -1)  # root + 3 nodes
    tokens, parents = [1, 3, 0], [-1, -1, 0]  # two children of the root, one grandchild
    n = 20000
    first: Counter = Counter()  # type: ignore[type-arg]
    for i in range(n):
        v = verify(tokens, None, p_rows, None, Coupled(i, 7), parents)
        first[v.token_ids[0]] += 1
        if v.path:
            assert v.path[0] in (0, 1) and v.token_ids[0] == tokens[v.path[0]]
        if v.path[:1] == [0]:
            assert v.path == [0, 2] or v.token_ids[1] != 0
    assert not chi2_rejects(first, {t: float(p_rows[0, t]) for t in range(5)}, n)[0]


def test_position_noise_is_counter_based() -> None:
    """Noise depends on (seed, position) only, a shorter vector is a prefix of a longer
    one, a draft vocabulary given as ids sees the target's noise at those ids, and every
    variate is positive (p / E is never 0 / 0)."""
    from speculant.sampling import _noise, position_noise, seeded_pick

    long = position_noise(3, 10, 1000).clone()
    _noise.clear()
    assert torch.equal(position_noise(3, 10, 100), long[:100])
    assert torch.equal(position_noise(3, 10, 1000), long)
    assert not torch.equal(position_noise(3, 11, 1000), long)
    assert not torch.equal(position_noise(4, 10, 1000), long)
    assert bool((long > 0).all())
    probs = torch.softmax(torch.randn(1000, generator=torch.Generator().manual_seed(0)), -1)
    ids = torch.tensor([5, 17, 300, 999])
    sub = probs[ids] / probs[ids].sum()
    assert seeded_pick(sub, 3, 10, ids) == int(ids[int((sub / long[ids]).argmax())])
    assert seeded_pick(probs, 3, 10) == int((probs / long).argmax())


def test_sample_draws_only_tokens_with_mass() -> None:
    """The inverse-cdf draw never lands on a token of zero probability, first or last,
    and a one-hot row gives its token."""
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0]] * 4000)
    ids = sample(probs, torch.Generator().manual_seed(0))
    assert set(ids.tolist()) == {1, 3}
    assert abs(float((ids == 1).float().mean()) - 0.5) < 0.04
    one_hot = torch.zeros(3, 5)
    one_hot[[0, 1, 2], [0, 4, 2]] = 1.0  # the first, the last and a middle id
    assert sample(one_hot, torch.Generator().manual_seed(1)).tolist() == [0, 4, 2]
