"""Prompt scoring: the target's log-probability of each prompt token given the ones
before it (OpenAI's `echo` with `logprobs`, the way evaluation harnesses score text)."""

from __future__ import annotations

from collections.abc import Sequence

from speculant.models.model import Model
from speculant.sampling import SamplingParams, TokenLogprob, token_logprobs


def prompt_logprobs(
    model: Model, prompt: Sequence[int], params: SamplingParams, top_n: int, chunk: int = 64
) -> list[TokenLogprob | None]:
    """One entry per prompt token: None for the first (nothing predicts it), then each
    token's log-probability under the same distribution `token_logprobs` reports for
    generated tokens. Runs on a cache of its own, `chunk` positions per pass (the logits
    of a whole long prompt over a 150k vocabulary would not fit in memory at once)."""
    ids = [int(t) for t in prompt]
    out: list[TokenLogprob | None] = [None]
    if len(ids) < 2:
        return out
    cache = model.new_cache(len(ids))
    for i in range(0, len(ids) - 1, chunk):
        part = ids[i : min(i + chunk, len(ids) - 1)]
        logits = model.forward(part, cache, i)
        out.extend(token_logprobs(logits, ids[i + 1 : i + 1 + len(part)], params, top_n))
    return out
