"""Adaptive k under batching: pass costs by the batch's total rows in one table per
engine, the choice weighing the other sequences of the step, one-off catch-up kept out
of the draft costs, cheap exploration, and bounded state. Costs here are synthetic
(or only their keys are checked), so nothing depends on wall time."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from conftest import tiny_model

from speculant import Engine, SamplingParams
from speculant.adaptive import HISTORY, AdaptiveK, Others, PassCosts, StepCost, choose_batch
from speculant.scheduler import StepEvent


def _feed(
    policy: AdaptiveK,
    steps: int,
    accept: Callable[[int], int],
    verify: Callable[[int], float],
    draft: Callable[[int], float] = lambda k: 0.0,
) -> None:
    for _ in range(steps):
        k = policy.choose(64)
        policy.observe(k, accept(k), draft(k), verify(k + 1))


def _primed(rate: float, verify: dict[int, float], draft: dict[int, float]) -> AdaptiveK:
    """A policy whose acceptance is `rate` at every position, with the given costs."""
    policy = AdaptiveK(k_max=8, costs=PassCosts(dict(verify), dict(draft), steps=10))
    policy.tried = [1000.0] * 8
    policy.accepted = [1000.0 * rate] * 8
    return policy


def test_first_steps_are_plain_and_k_grows_one_past_the_deepest_measured() -> None:
    policy = AdaptiveK(k_max=8)
    for _ in range(3):
        assert policy.choose(32) == 0  # a plain pass is measured first
        policy.observe(0, 0, 0.0, 0.1)
    ks = []
    for _ in range(10):
        ks.append(policy.choose(32))
        policy.observe(ks[-1], ks[-1], 0.001 * ks[-1], 0.1)
    assert ks == [1, 2, 3, 4, 5, 6, 7, 8, 8, 8]


def test_k_falls_to_zero_when_drafts_always_fail() -> None:
    policy = AdaptiveK(k_max=8)
    _feed(policy, 300, lambda k: 0, lambda w: 0.2 + 0.01 * w, lambda k: 0.02 * k)
    tail = list(policy.history)[-200:]
    assert tail.count(0) >= 185 and max(tail) == 1  # plain, and one-token probes


def test_k_grows_when_drafts_are_always_accepted_and_cheap() -> None:
    policy = AdaptiveK(k_max=8)
    _feed(policy, 60, lambda k: k, lambda w: 0.2 + 0.002 * w, lambda k: 0.001 * k)
    assert list(policy.history)[-20:] == [8] * 20


def test_one_early_rejection_does_not_end_drafting_but_failing_drafts_do() -> None:
    # A 1.5B target with a 0.5B draft: a draft call costs 40% of a plain step, and k = 1
    # only pays at ~90% acceptance.
    def verify(rows: int) -> float:
        return 0.040 + 0.009 * (rows - 1)

    def draft(depth: int) -> float:
        return 0.016 * (depth + 1) if depth else 0.0

    def run(accepts: list[bool]) -> list[int]:
        costs = PassCosts({1: verify(1), 2: verify(2)}, {1: draft(1)}, steps=3)
        policy = AdaptiveK(costs=costs)
        ks = []
        for ok in accepts:
            k = policy.choose(64)
            ks.append(k)
            policy.observe(k, k if ok else 0, draft(k), verify(k + 1))
        return ks

    good = run([False] + [True] * 11)
    assert 0 not in good[:6]  # too uncertain to give up after one miss
    assert good[-1] >= 3
    bad = run([False] * 12)
    assert bad[-6:] == [0] * 6  # failing drafts stop within a few steps


def test_history_and_tables_stay_bounded() -> None:
    policy = AdaptiveK(k_max=4)
    _feed(policy, 3 * HISTORY, lambda k: k // 2, lambda w: 0.1 * w, lambda k: 0.01 * k)
    assert len(policy.history) == HISTORY
    assert set(policy.costs.verify_s) <= set(range(1, 6))
    assert set(policy.costs.draft_s) <= set(range(1, 5))


def test_a_step_is_charged_once_to_a_shared_table() -> None:
    costs = PassCosts()
    a, b = AdaptiveK(costs=costs), AdaptiveK(costs=costs)
    costs.observe(StepCost(rows=5, verify_s=1.0, draft_depth=2, draft_s=0.5))
    step = StepCost(rows=5, verify_s=2.0, draft_depth=2, draft_s=1.5)
    a.observe(2, 1, 1.5, 2.0, step)
    b.observe(2, 2, 1.5, 2.0, step)  # the same step, seen by its other sequence
    assert costs.verify_s == {5: pytest.approx(1.5)}  # the mean of the two steps
    assert costs.draft_s == {2: pytest.approx(1.0)}


def test_catch_up_is_kept_out_of_the_draft_costs_and_spaces_probes() -> None:
    policy = AdaptiveK(costs=PassCosts({1: 0.1, 2: 0.12}))
    policy.observe(1, 0, 0.5, 0.12, StepCost(2, 0.12, 1, None))  # drafted after a prompt
    assert policy.costs.draft_s == {}
    # A probe is priced like that catch-up (0.5 s + 0.02 s more verify): at 2% of the
    # time it comes once per 0.52 / 0.02 / 0.1 = 260 plain steps.
    assert policy.probe_interval == 260
    assert AdaptiveK(costs=PassCosts({1: 0.1, 2: 0.1})).probe_interval == 16


def test_no_probes_while_drafts_could_not_pay_even_if_all_accepted() -> None:
    """Beside a batch whose pass is compute-bound (each row costs as much as the rest),
    drafting cannot win even at full acceptance: the policy stops probing (a probe's
    catch-up would be spent for nothing) and starts again when the batch thins out."""
    verify = {r: 0.1 * r for r in range(1, 40)}  # every row costs the same
    draft = {d: 0.05 * d for d in range(1, 9)}
    policy = _primed(0.5, verify, draft)
    policy.steps_at_zero = 1  # settled on plain steps
    busy = Others(rows=7, tokens=7.0, draft_depth=0)
    ks = [policy.choose(64, busy) for _ in range(200)]
    assert ks == [0] * 200
    alone = [policy.choose(64) for _ in range(40)]  # flat enough alone? no: still linear
    assert alone == [0] * 40
    cheap = {d: 0.005 * d for d in range(1, 9)}
    policy.costs = PassCosts({r: 0.1 for r in range(1, 40)}, cheap, steps=10)  # flat, cheap
    ks = [policy.choose(64, busy) for _ in range(40)]
    assert 1 in ks  # drafts could pay again: probes resume


def test_choice_weighs_the_other_sequences_rows() -> None:
    # A pass is flat up to 4 rows, then each row costs as much as the flat part.
    verify = {r: 0.1 * max(1, r - 3) for r in range(1, 20)}
    draft = {d: 1e-6 for d in range(1, 9)}
    policy = _primed(0.9, verify, draft)
    assert policy.choose(8) == 3  # alone: 4 rows, the flat part
    # Another sequence already fills the flat part: a draft now costs a full pass more.
    others = Others(rows=4, tokens=policy.expected_tokens(3), draft_depth=3)
    assert policy.choose(8, others) == 0


def test_choice_weighs_batched_drafting() -> None:
    verify = {r: 0.1 for r in range(1, 40)}
    draft = {d: 0.04 * d for d in range(1, 20)}
    policy = _primed(0.9, verify, draft)
    solo = policy.choose(8)
    assert solo == 4
    # The others are drafted 8 deep in one batched call per position: drafting as deep
    # costs this sequence nothing more.
    tokens = policy.expected_tokens(8)
    assert policy.choose(8, Others(9, tokens, 8, batched_drafts=True)) == 8
    # Drafted apart, every call adds up.
    apart = policy.choose(8, Others(9, tokens, 8, batched_drafts=False))
    assert apart < 8
    rate = [policy.expected_rate(k, Others(9, tokens, 8, batched_drafts=False)) for k in range(9)]
    assert apart == max(range(9), key=rate.__getitem__)


def test_a_batch_drafts_together_or_not_at_all() -> None:
    """A batched draft pass costs the same for one sequence or four: once the others
    draft, one more row looks cheap to each, though plain steps for all are faster.
    The batch is chosen as a whole."""
    costs = PassCosts(
        {r: 0.05 + 0.012 * (r - 1) for r in range(1, 17)},
        {d: 0.07 * d for d in range(1, 9)},
        steps=10,
    )
    policies = []
    for _ in range(4):
        policy = _primed(0.6, {}, {})
        policy.costs = costs
        policies.append(policy)
    previous = [1, 1, 1, 1]
    alone = [p.plan(8, Others(6, 3 * p.expected_tokens(1), 1))[0] for p in policies]
    assert alone == [1, 1, 1, 1]  # each, given the others draft
    assert choose_batch(policies, [8] * 4, previous, batched=True) == [0, 0, 0, 0]
    # Good drafts: every sequence drafts, as deep as pays for the batch.
    good = []
    for _ in range(4):
        policy = _primed(0.97, {}, {})
        policy.costs = PassCosts(costs.verify_s, {d: 0.01 * d for d in range(1, 9)}, steps=10)
        good.append(policy)
    ks = choose_batch(good, [8] * 4, [0, 0, 0, 0], batched=True)
    assert min(ks) >= 2


def test_alone_it_is_tokens_over_verify_plus_draft() -> None:
    verify = {1: 0.10, 2: 0.12, 3: 0.13, 4: 0.15}
    draft = {1: 0.03, 2: 0.05, 3: 0.07}
    policy = _primed(0.7, verify, draft)
    rates = policy.rates()
    for k in range(4):
        tokens = 1.0 + sum(_prod(rates[: j + 1]) for j in range(k))
        expected = tokens / (verify[k + 1] + draft.get(k, 0.0))
        assert policy.expected_rate(k) == pytest.approx(expected)


def _prod(xs: list[float]) -> float:
    out = 1.0
    for x in xs:
        out *= x
    return out


@pytest.mark.parametrize("method", ["draft", "ngram"])
def test_batched_steps_charge_the_total_rows_to_one_shared_table(tiny_root, method: str) -> None:  # type: ignore[no-untyped-def]
    target = tiny_model(tiny_root, "llama", seed=1)
    draft = tiny_model(tiny_root, "llama", seed=1, num_hidden_layers=1)
    engine = Engine(
        target,
        draft=draft if method == "draft" else None,
        method=method,
        num_speculative_tokens="auto",
    )
    sched = engine.scheduler()
    prompts = [[3, 17, 42, 5, 9, 11], [7, 7, 8, 9, 7, 7, 8, 9, 7, 7, 8]]
    for i, prompt in enumerate(prompts):
        sched.add(i, prompt, SamplingParams(max_tokens=30, ignore_eos=True))
    a, b = (seq.lane.policy for seq in sched.running)
    assert isinstance(a, AdaptiveK) and isinstance(b, AdaptiveK)
    assert a.costs is b.costs is engine.costs
    rows, depths = set(), set()
    steps: list[list[StepEvent]] = []
    while len(sched.running) == 2:
        events = sched.step()
        steps.append(events)
        rows.add(sum(e.drafted + 1 for e in events))
        ks = [e.seq.k for e in events]  # what each asked for this step
        drafted = [e.drafted for e in events]
        # A draft model drafts both in one call per position; ngram looks each one up.
        depths.add(max(drafted) if method == "draft" else sum(drafted))
        if len(steps) <= 3:
            assert ks == [0, 0]  # a plain pass is measured first
        if len(steps) == 4:
            # The first drafting step: the proposers caught up on their prompts, which
            # is no per-step draft cost.
            assert ks == [1, 1] and engine.costs.draft_s == {}
    assert len(steps) >= 5
    assert set(engine.costs.verify_s) == rows  # the pass's total rows, not a lane's own
    assert set(engine.costs.draft_s) <= depths - {0}
