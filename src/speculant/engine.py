"""The speculative decoding loop: propose -> verify -> accept -> truncate -> commit.

Invariant between steps: the target's cache holds every committed token but the last
one, which is fed at the head of the next verify pass together with the drafts:

    tokens    = prompt + output              (committed)
    cache     = keys/values of tokens[:-1]
    verify in = [tokens[-1], d_1 .. d_k]     -> p_target [k+1, vocab]

After the verdict (n drafts kept, plus one new token) the cache is truncated to
len(tokens) + n: the one rollback, in one place. With k = 0 this is plain decoding,
so the baseline and the speculative runs share every line but the proposer's.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from speculant.adaptive import AdaptiveK, FixedK
from speculant.models.model import Model
from speculant.proposers import Draft, Proposer, make_proposer
from speculant.rejection import verify_chain
from speculant.sampling import SamplingParams, make_generator, process_logits


class RequestError(ValueError):
    """A request the engine cannot serve (empty prompt, ids out of range, too long)."""


@dataclass
class GenerationStats:
    """Per-request speculation figures (acceptance is counted as the verifier decided)."""

    prompt_tokens: int = 0
    num_generated: int = 0
    num_drafted: int = 0
    num_accepted: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # [max k drafted]
    target_forwards: int = 0
    elapsed_s: float = 0.0
    time_to_first_token_s: float = 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted / self.num_drafted if self.num_drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Emitted tokens per target forward (1.0 for plain decoding)."""
        return self.num_generated / self.target_forwards if self.target_forwards else 0.0

    @property
    def tokens_per_second(self) -> float:
        """New tokens over the request's wall time, prefill included."""
        return self.num_generated / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def record(self, num_drafted: int, num_accepted: int) -> None:
        self.target_forwards += 1
        self.num_drafted += num_drafted
        self.num_accepted += num_accepted
        if len(self.accepted_per_position) < num_drafted:
            self.accepted_per_position.extend([0] * (num_drafted - len(self.accepted_per_position)))
        for j in range(num_accepted):
            self.accepted_per_position[j] += 1

    def to_dict(self) -> dict[str, object]:
        return {
            "num_drafted": self.num_drafted,
            "num_accepted": self.num_accepted,
            "acceptance_rate": self.acceptance_rate,
            "mean_accepted_length": self.mean_accepted_length,
            "accepted_per_position": list(self.accepted_per_position),
            "target_forwards": self.target_forwards,
            "tokens_per_second": self.tokens_per_second,
        }


@dataclass(frozen=True)
class GenerationResult:
    token_ids: list[int]  # new tokens; an end-of-sequence token that stopped it is included
    text: str  # decoded new text, cut before a stop string, special tokens skipped
    finish_reason: str  # "stop" (EOS or stop string) or "length" (max_tokens or context)
    stats: GenerationStats


@dataclass(frozen=True)
class StreamChunk:
    token_ids: list[int]  # tokens committed by this step
    text: str  # text that became final with them (may be "" while a stop string could start)


class Stream:
    """Iterate for chunks as they are committed; `result` is set once iteration ends."""

    def __init__(self, chunks: Iterator[StreamChunk]) -> None:
        self._chunks = chunks
        self.result: GenerationResult | None = None

    def __iter__(self) -> Iterator[StreamChunk]:
        return self._chunks


class Engine:
    """Speculative decoding for one target.

    Engine(target) alone decodes plainly; Engine(target, draft=small) drafts with the
    small model; `method` names any registered proposer ("none", "draft", ...), and
    `proposer` accepts a ready-made one (tests pass scripted proposers this way).
    """

    def __init__(
        self,
        target: Model,
        draft: Model | None = None,
        *,
        method: str | None = None,
        proposer: Proposer | None = None,
        num_speculative_tokens: int | str = 5,
        max_seq_len: int | None = None,
        proposer_options: dict[str, Any] | None = None,
    ) -> None:
        self.target = target
        if proposer is None:
            method = method or ("draft" if draft is not None else "none")
            proposer = make_proposer(method, target=target, draft=draft, **(proposer_options or {}))
        self.proposer = proposer
        self.policy = _policy(num_speculative_tokens, plain=proposer.name == "none")
        limit = target.config.max_seq_len
        if draft is not None:
            limit = min(limit, draft.config.max_seq_len)
        if max_seq_len is not None:
            if max_seq_len < 2 or max_seq_len > limit:
                raise ValueError(f"max_seq_len={max_seq_len} is out of range: use 2..{limit}")
            limit = max_seq_len
        self.max_seq_len = limit

    @property
    def num_speculative_tokens(self) -> int | str:
        return self.policy.k if isinstance(self.policy, FixedK) else "auto"

    @property
    def method(self) -> str:
        return self.proposer.name

    def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> GenerationResult:
        stream = self.stream(prompt_ids, params)
        for _ in stream:
            pass
        assert stream.result is not None
        return stream.result

    def stream(self, prompt_ids: Sequence[int], params: SamplingParams) -> Stream:
        prompt = self._check_prompt(prompt_ids)
        stream = Stream(iter(()))
        stream._chunks = self._run(prompt, params, stream)
        return stream

    def _check_prompt(self, prompt_ids: Sequence[int]) -> list[int]:
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise RequestError("the prompt is empty: give at least one token")
        vocab = self.target.vocab_size
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise RequestError(f"prompt token id {bad[0]} is out of range: ids are 0..{vocab - 1}")
        if len(prompt) >= self.max_seq_len:
            raise RequestError(
                f"the prompt has {len(prompt)} tokens, the context holds {self.max_seq_len}: "
                "shorten it"
            )
        return prompt

    def _run(
        self, prompt: list[int], params: SamplingParams, stream: Stream
    ) -> Iterator[StreamChunk]:
        t0 = time.perf_counter()
        stats = GenerationStats(prompt_tokens=len(prompt))
        capacity = min(self.max_seq_len, len(prompt) + params.max_tokens)
        cache = self.target.new_cache(capacity)
        generator = make_generator(params.seed)
        tokenizer = self.target.tokenizer
        eos = frozenset() if params.ignore_eos or tokenizer is None else tokenizer.eos_token_ids
        text = _TextTracker(self.target, params.stop)
        output: list[int] = []
        finish = "length"
        tokens = list(prompt)
        self.proposer.begin(prompt, capacity)
        try:
            self.target.prefill(prompt[:-1], cache)
            done = False
            while not done:
                budget = min(params.max_tokens - len(output), capacity - len(tokens) + 1)
                if budget <= 0:
                    break
                k = self.policy.choose(budget - 1)
                t_draft = time.perf_counter()
                draft = self.proposer.propose(tokens, k, params, generator) if k > 0 else Draft([])
                draft_ids = draft.token_ids[:k]
                q = draft.q_probs[:k] if draft.q_probs is not None else None
                start = len(tokens) - 1
                t_verify = time.perf_counter()
                logits = self.target.forward([tokens[-1], *draft_ids], cache, start)
                p_target = process_logits(logits, params)  # [k'+1, vocab]
                verdict = verify_chain(draft_ids, q, p_target, generator)
                cache.truncate(len(tokens) + verdict.num_accepted)  # the one rollback
                t_done = time.perf_counter()
                self.policy.observe(
                    len(draft_ids), verdict.num_accepted, t_verify - t_draft, t_done - t_verify
                )
                stats.record(len(draft_ids), verdict.num_accepted)
                committed: list[int] = []
                for token in verdict.token_ids:
                    committed.append(token)
                    if token in eos:
                        finish, done = "stop", True
                        break
                    if text.push(token):
                        finish, done = "stop", True
                        break
                    if len(output) + len(committed) >= params.max_tokens:
                        done = True
                        break
                tokens.extend(committed)
                output.extend(committed)
                if not stats.time_to_first_token_s:
                    stats.time_to_first_token_s = time.perf_counter() - t0
                yield StreamChunk(committed, text.release(final=done))
            tail = text.release(final=True)
            if tail:
                yield StreamChunk([], tail)
        finally:
            self.proposer.end(tokens)
        stats.num_generated = len(output)
        stats.elapsed_s = time.perf_counter() - t0
        stream.result = GenerationResult(output, text.final_text(), finish, stats)


def _policy(k: int | str, plain: bool) -> FixedK | AdaptiveK:
    """num_speculative_tokens: an integer 0..64, or "auto" (chosen per step)."""
    if plain:
        return FixedK(0)
    if k == "auto":
        return AdaptiveK()
    if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= 64:
        raise ValueError(f"num_speculative_tokens={k!r} is out of range: use 0..64 or 'auto'")
    return FixedK(k)


class _TextTracker:
    """Decoded output text, stop-string detection, and what is safe to stream so far.

    The text is decoded once per step (when it is released), or once per token only
    when stop strings must be checked token by token."""

    def __init__(self, model: Model, stop: tuple[str, ...]) -> None:
        self.tokenizer = model.tokenizer
        self.stop = stop
        self.ids: list[int] = []
        self._text = ""
        self._decoded = 0  # len(ids) when _text was decoded
        self.cut: int | None = None  # index of a found stop string
        self.released = 0
        if stop and self.tokenizer is None:
            raise RequestError("stop strings need a tokenizer, and this model has none")

    @property
    def text(self) -> str:
        if self._decoded != len(self.ids) and self.tokenizer is not None:
            self._text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
            self._decoded = len(self.ids)
        return self._text

    def push(self, token: int) -> bool:
        """Add a token; True when a stop string is now complete."""
        self.ids.append(token)
        if not self.stop:
            return False
        text = self.text
        # A new token can only complete a stop string that ends in its own text.
        lo = max(0, len(text) - max(len(s) for s in self.stop) - 32)
        hits = [i for s in self.stop if (i := text.find(s, lo)) >= 0]
        if hits:
            self.cut = min(hits)
            return True
        return False

    def final_text(self) -> str:
        text = self.text
        return text if self.cut is None else text[: self.cut]

    def release(self, final: bool) -> str:
        """Text that can no longer change: hold back an incomplete UTF-8 character and any
        tail that could still grow into a stop string."""
        text = self.final_text()
        end = len(text)
        if not final and self.cut is None:
            if text.endswith("\ufffd"):
                end = len(text.rstrip("\ufffd"))
            for s in self.stop:
                for n in range(min(len(s) - 1, end), 0, -1):
                    if text[:end].endswith(s[:n]):
                        end = min(end, len(text[:end]) - n)
                        break
        if end <= self.released:
            return ""
        out = text[self.released : end]
        self.released = end
        return out


def plain_greedy(model: Model, prompt_ids: Sequence[int], max_tokens: int) -> list[int]:
    """Reference greedy decoding, one token per forward, no engine machinery."""
    cache = model.new_cache(len(prompt_ids) + max_tokens)
    model.prefill(list(prompt_ids[:-1]), cache)
    tokens = list(prompt_ids)
    out = []
    for _ in range(max_tokens):
        logits = model.forward([tokens[-1]], cache, len(tokens) - 1)
        token = int(torch.argmax(logits[-1]))
        tokens.append(token)
        out.append(token)
    return out
