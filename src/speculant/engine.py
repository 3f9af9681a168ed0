"""The speculative decoding loop: propose -> verify -> accept -> truncate -> commit.

Invariant between steps: the target's cache holds every committed token but the last
one, which is fed at the head of the next verify pass together with the drafts:

    tokens    = prompt + output              (committed)
    cache     = keys/values of tokens[:-1]
    verify in = [tokens[-1], d_1 .. d_k]     -> p_target [k+1, vocab]

After the verdict (n drafts kept, plus one new token) the cache keeps len(tokens) + n
rows (a chain is truncated, a tree keeps its accepted path; scheduler.Scheduler.step).
With k = 0
this is plain decoding, so the baseline and the speculative runs share every line but
the proposer's. `Engine` runs one request at a time through the same scheduler that
batches many requests in the server.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from speculant.adaptive import FixedK, PassCosts, make_policy
from speculant.models.model import Model
from speculant.prefix_cache import PrefixCache
from speculant.proposers import Proposer, make_proposer, spawn_proposer
from speculant.proposers.base import CachesPrompt
from speculant.requests import (
    GenerationResult,
    GenerationStats,
    RequestError,
    StreamChunk,
    check_prompt,
)
from speculant.sampling import SamplingParams
from speculant.scheduler import Lane, Scheduler

__all__ = [
    "Engine",
    "GenerationResult",
    "GenerationStats",
    "RequestError",
    "Stream",
    "StreamChunk",
]


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
        self._k = num_speculative_tokens
        # Pass costs measured for -k auto: every lane runs this target and this kind of
        # proposer, so all of them share one table.
        self.costs = PassCosts()
        self.policy = make_policy(
            num_speculative_tokens, plain=proposer.name == "none", costs=self.costs
        )
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
        return check_prompt(prompt_ids, self.target.vocab_size, self.max_seq_len)

    def new_lane(self) -> Lane:
        """A proposer and policy for one more concurrent request, sharing what is
        read-only (models, calibration) with this engine's own."""
        return Lane(
            spawn_proposer(self.proposer),
            make_policy(self._k, plain=self.proposer.name == "none", costs=self.costs),
        )

    def scheduler(
        self, max_num_batched_tokens: int | None = None, prefix_cache: PrefixCache | None = None
    ) -> Scheduler:
        """A scheduler over this engine's target; its first lane is the engine's own
        (so what a proposer or policy learns carries over between requests).
        max_num_batched_tokens: prefill prompts in chunks within this many rows per pass
        (see Scheduler); None prefills each prompt whole when it joins.
        prefix_cache: share computed prompt prefixes between requests (see
        speculant.prefix_cache)."""
        draft = self.proposer
        if prefix_cache is not None and isinstance(draft, CachesPrompt) and not draft.prefix_cache:
            # The draft's rows get a store of their own (its spawns share it), as large.
            draft.prefix_cache = PrefixCache(prefix_cache.max_bytes)
        own = [Lane(self.proposer, self.policy)]

        def lane() -> Lane:
            return own.pop() if own else self.new_lane()

        return Scheduler(self.target, lane, self.max_seq_len, max_num_batched_tokens, prefix_cache)

    def _run(
        self, prompt: list[int], params: SamplingParams, stream: Stream
    ) -> Iterator[StreamChunk]:
        sched = self.scheduler()
        sched.add(None, prompt, params)
        try:
            while sched.running:
                for event in sched.step():
                    if event.chunk.token_ids or event.chunk.text:
                        yield event.chunk
                    if event.result is not None:
                        stream.result = event.result
        finally:
            for seq in list(sched.running):  # the caller stopped iterating early
                stream.result = sched.cancel(seq)
