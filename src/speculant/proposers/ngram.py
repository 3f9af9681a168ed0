"""Prompt lookup: draft what followed the most recent earlier occurrence of the last n
tokens (n from ngram_max down to ngram_min), in the prompt and the output so far.

How many of the k tokens to draft follows the evidence: the match is extended backwards
past the n-gram (up to 64 tokens), and a match of L tokens drafts max(2, 2L // 3) of
them (`match_scaled`, the default). A two- or three-token coincidence in free text then
costs two extra rows in the verify pass, while a long copied span (an edit, code that
repeats its input) drafts all k. On the shipped code / edit / chat / extraction prompts
with the 1.5B's greedy outputs, at k = 6, scaling by the match (then max(1, L // 2))
drafted fewer wasted rows and gave +2-19% more tokens per unit of verify cost than
drafting k on every match. Replaying the 1.5B's greedy outputs on nine workloads
(scripts/replay_ngram.py; code, edit, chat, extraction: ten prompts each;
summarization, translation, qa, math, rag: five) with the pass costs of the Intel Xeon
and the Zen 4 EPYC, max(2, 2L // 3) gave 1.023x / 1.011x the predicted decoding speed of
max(1, L // 2) (geometric means over the workloads; 0.99-1.06x each): a second row costs
little beside a pass's first one, and a short match's first two tokens land together
often enough to pay for it.

Which earlier occurrence: the one that ends the longest matching suffix, up to
ngram_max = 8 tokens (ties: the most recent). Replaying the 1.5B's greedy outputs on all
ten prompts of each of those workloads (scripts/replay_ngram.py), n-grams of up to 8
tokens with k = 7 gave 1.04-1.06x the tokens per unit of verify cost of 4 tokens with
k = 5 on code and edits (pass costs of the Zen 4 and Intel machines), and the same on chat
and extraction; end to end, code took 0.93x the time and edits 0.97x.

No model, so no distribution: the drafts are a point mass q = one_hot(x). The engine's
rule then accepts x with probability p(x) and, on rejection, draws from p with x
removed and renormalised: exactly the target's distribution, so this stays lossless.

An index from each n-gram to the positions where it ends is updated incrementally as
committed tokens arrive, so a lookup costs O(ngram_max) whatever the context length.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from speculant.proposers.base import Draft, register
from speculant.sampling import SamplingParams


@register("ngram")
class NgramProposer:
    name = "ngram"

    def __init__(
        self,
        target: Any = None,
        draft: Any = None,
        *,
        ngram_max: int = 8,
        ngram_min: int = 2,
        match_scaled: bool = True,
        **_: Any,
    ) -> None:
        if not 1 <= ngram_min <= ngram_max:
            raise ValueError(
                f"ngram_min={ngram_min}, ngram_max={ngram_max}: need 1 <= ngram_min <= ngram_max"
            )
        self.ngram_max = ngram_max
        self.ngram_min = ngram_min
        self.match_scaled = match_scaled
        self._tokens: list[int] = []
        # (n-gram) -> end position (exclusive) of its latest occurrence, and of the one
        # before it: the suffix itself is always the latest, so lookups use the earlier.
        self._last: dict[tuple[int, ...], int] = {}
        self._prev: dict[tuple[int, ...], int] = {}

    def begin(self, prompt_ids: Sequence[int], capacity: int) -> None:
        self._tokens = []
        self._last.clear()
        self._prev.clear()

    def end(self, tokens: Sequence[int] = ()) -> None:
        self.begin((), 0)

    def spawn(self) -> NgramProposer:
        return NgramProposer(
            ngram_max=self.ngram_max, ngram_min=self.ngram_min, match_scaled=self.match_scaled
        )

    def _extend(self, context: Sequence[int]) -> None:
        start = len(self._tokens)
        # Committed tokens never change within a request, so checking the boundary token
        # suffices; anything else is a different sequence: rebuild (the engine never does).
        if len(context) < start or (start and context[start - 1] != self._tokens[-1]):
            self.begin((), 0)
            start = 0
        for pos in range(start, len(context)):
            self._tokens.append(int(context[pos]))
            end = pos + 1
            for n in range(self.ngram_min, self.ngram_max + 1):
                if end < n:
                    break
                gram = tuple(self._tokens[end - n : end])
                if gram in self._last:
                    self._prev[gram] = self._last[gram]
                self._last[gram] = end

    def propose(
        self,
        context: Sequence[int],
        k: int,
        params: SamplingParams,
        generator: torch.Generator,
    ) -> Draft:
        if k <= 0:
            return Draft([])
        self._extend(context)
        toks = self._tokens
        for n in range(min(self.ngram_max, len(toks)), self.ngram_min - 1, -1):
            gram = tuple(toks[-n:])
            end = self._prev.get(gram)
            if end is not None:
                continuation = toks[end : end + k]
                if continuation:
                    if self.match_scaled:
                        continuation = continuation[: scaled_take(_match_length(toks, end, n))]
                    return Draft(list(continuation))
        return Draft([])


MATCH_CAP = 64  # the longest match measured backwards (drafts never need more)
MIN_TAKE = 2  # what even the shortest match drafts (the module docstring says why)


def scaled_take(match_length: int) -> int:
    """How many tokens a match of `match_length` tokens drafts (k caps it): two thirds of
    the match, at least MIN_TAKE."""
    return max(MIN_TAKE, 2 * match_length // 3)


def _match_length(toks: list[int], end: int, n: int) -> int:
    """How many tokens before `end` equal the ones before the context's end (at least n,
    the n-gram that matched; at most MATCH_CAP)."""
    last = len(toks)
    length = n
    while (
        length < MATCH_CAP
        and end - length - 1 >= 0
        and toks[end - length - 1] == toks[last - length - 1]
    ):
        length += 1
    return length
