"""Greedy equivalence of speculative and plain decoding, forced partial acceptance,
stop conditions and request validation, on tiny random models."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from conftest import tiny_model
from oracles import plain_greedy

from speculant import Engine, RequestError, SamplingParams
from speculant.proposers import Draft, TokenizerMismatchError


class ScriptedProposer:
    """Drafts the reference continuation but corrupts draft position `wrong_at` (0-based),
    so the verifier must keep exactly `wrong_at` drafts each step (k if wrong_at >= k)."""

    name = "scripted"

    def __init__(self, prompt: Sequence[int], reference: Sequence[int], wrong_at: int, vocab: int):
        self.full = list(prompt) + list(reference)
        self.wrong_at = wrong_at
        self.vocab = vocab
        self.requested: list[int] = []

    def begin(self, prompt_ids: Sequence[int], capacity: int) -> None:
        return None

    def end(self, tokens: Sequence[int]) -> None:
        return None

    def propose(self, context, k, params, generator):  # type: ignore[no-untyped-def]
        n = len(context)
        assert list(context) == self.full[:n], "engine committed a token plain decoding would not"
        ids = self.full[n : n + k]
        if self.wrong_at < len(ids):
            ids[self.wrong_at] = (ids[self.wrong_at] + 1) % self.vocab
        self.requested.append(len(ids))
        return Draft(ids)


PROMPT = [3, 17, 42, 5, 9, 11]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8"])
@pytest.mark.parametrize("wrong_at", [0, 1, 2, 3, 4, 5])
def test_scripted_rejection_at_each_position(tiny_root, dtype: str, wrong_at: int) -> None:  # type: ignore[no-untyped-def]
    target = tiny_model(tiny_root, "llama", seed=1, dtype=dtype)
    reference = plain_greedy(target, PROMPT, 40)
    k = 5
    proposer = ScriptedProposer(PROMPT, reference + [0] * 8, wrong_at, target.vocab_size)
    engine = Engine(target, proposer=proposer, num_speculative_tokens=k)
    res = engine.generate(PROMPT, SamplingParams(max_tokens=40, ignore_eos=True))
    assert res.token_ids == reference
    assert res.finish_reason == "length"
    s = res.stats
    # The verifier kept exactly min(wrong_at, r) drafts at every step that drafted r.
    steps = proposer.requested
    assert s.num_accepted == sum(min(wrong_at, r) for r in steps)
    for j in range(k):
        assert s.accepted_per_position[j] == sum(1 for r in steps if r > j and j < wrong_at)
    assert s.num_drafted == sum(steps)
    assert s.mean_accepted_length == pytest.approx(len(reference) / s.target_forwards)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
@pytest.mark.parametrize("k", [1, 3, 5])
def test_random_draft_model_greedy_equivalence(tiny_root, arch: str, k: int) -> None:  # type: ignore[no-untyped-def]
    target = tiny_model(tiny_root, arch, seed=1, dtype="bfloat16")
    draft = tiny_model(tiny_root, arch, seed=2, dtype="int8", num_hidden_layers=1)
    params = SamplingParams(max_tokens=48, ignore_eos=True)
    plain = Engine(target).generate(PROMPT, params)
    spec = Engine(target, draft=draft, num_speculative_tokens=k).generate(PROMPT, params)
    assert spec.token_ids == plain.token_ids == plain_greedy(target, PROMPT, 48)
    assert spec.stats.num_drafted > 0
    assert plain.stats.num_drafted == 0 and plain.stats.target_forwards == 48


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_draft_equal_to_target_accepts_everything(tiny_root, dtype: str) -> None:  # type: ignore[no-untyped-def]
    target = tiny_model(tiny_root, "qwen2", seed=1, dtype=dtype)
    params = SamplingParams(max_tokens=36, ignore_eos=True)
    res = Engine(target, draft=target, num_speculative_tokens=5).generate(PROMPT, params)
    assert res.token_ids == plain_greedy(target, PROMPT, 36)
    assert res.stats.acceptance_rate == 1.0
    assert res.stats.target_forwards == 6  # 36 tokens, 6 per pass (5 drafts + bonus)
    assert res.stats.accepted_per_position == [6, 6, 6, 6, 6]
    assert res.stats.mean_accepted_length == 6.0


def test_seeded_sampling_is_reproducible(tiny_root) -> None:  # type: ignore[no-untyped-def]
    target = tiny_model(tiny_root, "llama", seed=1)
    draft = tiny_model(tiny_root, "llama", seed=2, num_hidden_layers=1)
    engine = Engine(target, draft=draft, num_speculative_tokens=3)
    params = SamplingParams(temperature=0.9, top_p=0.9, max_tokens=30, seed=7, ignore_eos=True)
    a = engine.generate(PROMPT, params).token_ids
    b = engine.generate(PROMPT, params).token_ids
    c = engine.generate(PROMPT, SamplingParams(**{**params.__dict__, "seed": 8})).token_ids
    assert a == b
    assert a != c


def test_max_tokens_cuts_inside_an_accepted_run(tiny_root) -> None:  # type: ignore[no-untyped-def]
    target = tiny_model(tiny_root, "qwen2", seed=1)
    res = Engine(target, draft=target, num_speculative_tokens=5).generate(
        PROMPT, SamplingParams(max_tokens=8, ignore_eos=True)
    )
    assert len(res.token_ids) == 8
    assert res.token_ids == plain_greedy(target, PROMPT, 8)


def test_context_limit_finishes_with_length(tiny_root) -> None:  # type: ignore[no-untyped-def]
    target = tiny_model(tiny_root, "llama", seed=1)
    engine = Engine(target, draft=target, num_speculative_tokens=5, max_seq_len=20)
    res = engine.generate(PROMPT, SamplingParams(max_tokens=100, ignore_eos=True))
    assert res.finish_reason == "length"
    assert len(PROMPT) + len(res.token_ids) == 21  # the last token needs no cache slot
    assert res.token_ids == plain_greedy(target, PROMPT, 15)


def test_bad_requests_are_named(tiny_root) -> None:  # type: ignore[no-untyped-def]
    target = tiny_model(tiny_root, "llama", seed=1)
    engine = Engine(target, max_seq_len=16)
    with pytest.raises(RequestError, match="empty"):
        engine.generate([], SamplingParams())
    with pytest.raises(RequestError, match="9999"):
        engine.generate([1, 9999], SamplingParams())
    with pytest.raises(RequestError, match="16"):
        engine.generate(list(range(20)), SamplingParams())
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        Engine(target, draft=target, num_speculative_tokens=-1)
    with pytest.raises(ValueError, match="unknown method 'magic'"):
        Engine(target, method="magic")
    with pytest.raises(ValueError, match="needs a draft"):
        Engine(target, method="draft")


def test_vocab_mismatch_is_refused(tiny_root) -> None:  # type: ignore[no-untyped-def]
    target = tiny_model(tiny_root, "llama", seed=1)
    other = tiny_model(tiny_root, "llama", seed=2, vocab_size=80)
    with pytest.raises(TokenizerMismatchError, match="cannot draft"):
        Engine(target, draft=other)


def test_stream_chunks_add_up(tiny_root) -> None:  # type: ignore[no-untyped-def]
    target = tiny_model(tiny_root, "qwen2", seed=1)
    draft = tiny_model(tiny_root, "qwen2", seed=2, num_hidden_layers=1)
    engine = Engine(target, draft=draft, num_speculative_tokens=4)
    stream = engine.stream(PROMPT, SamplingParams(max_tokens=25, ignore_eos=True))
    ids: list[int] = []
    for chunk in stream:
        ids.extend(chunk.token_ids)
    assert stream.result is not None
    assert ids == stream.result.token_ids == plain_greedy(target, PROMPT, 25)
    assert torch.tensor(ids).numel() == 25


def test_stop_string_completed_by_a_long_token_is_found() -> None:
    """A stop string that starts in earlier text and ends early in a long token (code
    tokenizers have tokens of 30+ spaces) is found, and the text is cut before it."""
    from types import SimpleNamespace

    from speculant.detokenize import TextTracker

    pieces = {0: "x = 1\nEN", 1: "D!" + " " * 60, 2: "more"}

    class Pieces:
        def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
            return "".join(pieces[i] for i in ids)

    model = SimpleNamespace(tokenizer=Pieces())
    tracker = TextTracker(model, ("END!",))  # type: ignore[arg-type]
    assert not tracker.push(2)
    assert not tracker.push(0)
    assert tracker.push(1)
    assert tracker.final_text() == "morex = 1\n"
