"""Reference decoders the tests compare the engine with: no engine machinery."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from speculant.models.model import Model


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
