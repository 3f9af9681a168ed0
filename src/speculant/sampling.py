"""Sampling parameters and the pure logits -> probabilities transform.

The same `process_logits` is applied to the target's logits (p) and to the draft's
logits (q): that is what keeps speculative sampling lossless under temperature,
top-k and top-p. Drafts are then sampled from exactly the q returned here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor


class SamplingError(ValueError):
    """An out-of-range sampling parameter."""


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens. Validated once, here, at construction.

    temperature: 0 means greedy (argmax); otherwise logits are divided by it.
    top_k: keep the k most probable tokens; 0 disables.
    top_p: keep the smallest set of most probable tokens whose cumulative probability
        reaches top_p (HF / vLLM convention); 1.0 disables.
    max_tokens: at most this many new tokens.
    seed: seeds the request's random generator (None: nondeterministic).
    ignore_eos: keep generating past end-of-sequence tokens.
    stop: strings that end generation; the text is cut before the first one.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    max_tokens: int = 128
    seed: int | None = None
    ignore_eos: bool = False
    stop: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        t = self.temperature
        if not isinstance(t, int | float) or math.isnan(t) or t < 0 or math.isinf(t):
            raise SamplingError(f"temperature={t!r} is out of range: use a finite number >= 0")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            raise SamplingError(f"top_k={self.top_k!r} is out of range: use an integer >= 0")
        p = self.top_p
        if not isinstance(p, int | float) or math.isnan(p) or not (0.0 < p <= 1.0):
            raise SamplingError(f"top_p={p!r} is out of range: use a number in (0, 1]")
        mt = self.max_tokens
        if not isinstance(mt, int) or isinstance(mt, bool) or mt < 1:
            raise SamplingError(f"max_tokens={mt!r} is out of range: use an integer >= 1")
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0):
            raise SamplingError(f"seed={self.seed!r} is out of range: use an integer >= 0")
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            raise SamplingError(f"stop={self.stop!r}: every stop string must be non-empty")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def process_logits(logits: Tensor, params: SamplingParams) -> Tensor:
    """Turn raw logits into the distribution tokens are drawn from.

    logits: [n, vocab] (any float dtype) -> probs: [n, vocab] float32, rows sum to 1.
    Greedy (temperature 0) gives a one-hot row at the argmax (first index on ties),
    so the rejection rule reduces exactly to "accept iff draft == target argmax".
    """
    logits = logits.float()
    if params.greedy:
        probs = torch.zeros_like(logits)
        probs.scatter_(-1, logits.argmax(dim=-1, keepdim=True), 1.0)
        return probs
    logits = logits / params.temperature
    vocab = logits.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]  # [n, 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=False)
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)  # ascending
        # Drop the low tail whose mass stays <= 1 - top_p; the top token always survives.
        drop_sorted = cum <= (1.0 - params.top_p)
        drop_sorted[..., -1] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(dim=-1)


def sample(probs: Tensor, generator: torch.Generator | None) -> Tensor:
    """Draw one token per row. probs: [n, vocab] -> ids: [n] (int64).

    When every row holds all its mass on one token (every greedy row does), that token
    is the draw: no randomness is needed, and multinomial over a 150k vocabulary costs
    ~3 ms on a CPU core, a tenth of a 1.5B decode step."""
    top, ids = probs.max(dim=-1)
    if bool((top == 1.0).all()) and bool(((probs > 0).sum(dim=-1) == 1).all()):
        return ids
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def make_generator(seed: int | None) -> torch.Generator:
    gen = torch.Generator(device="cpu")
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(seed)
    return gen
