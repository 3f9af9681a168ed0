"""Sampling parameters, the pure logits -> probabilities transform, and the draws.

The same `process_logits` is applied to the target's logits (p) and to the draft's
logits (q): that is what keeps speculative sampling lossless under temperature,
top-k and top-p. Drafts are then sampled from exactly the q returned here.

Two ways to draw. An unseeded request draws from its own random generator (`sample`),
and speculation uses the standard accept / resample rule. A seeded request draws the
token at output position t as argmax_i p_i / E_i, where E is a vector of exponential
variates that depends on (seed, t) alone (`position_noise`, counter-based): an exact
draw from p (the exponential race, equivalent to the Gumbel-max trick), so the text is
a function of (model, prompt, parameters, seed), whatever proposes the drafts and
whatever k is. A draft coupled to the same noise is accepted exactly when it is the
target's own choice; see docs/sampling.md for what this costs in acceptance.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

MAX_LOGPROBS = 20  # most likely alternatives reported per token (OpenAI's limit)
GREEDY_BELOW = 1e-5  # temperatures below this are greedy (as in vLLM)


class SamplingError(ValueError):
    """An out-of-range sampling parameter."""


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens. Validated once, here, at construction.

    temperature: 0 means greedy (argmax), and so does anything below 1e-5; otherwise
        logits are divided by it.
    top_k: keep the k most probable tokens; 0 disables.
    top_p: keep the smallest set of most probable tokens whose cumulative probability
        reaches top_p (HF / vLLM convention); 1.0 disables.
    max_tokens: at most this many new tokens.
    seed: makes sampling reproducible: the token at each output position is drawn with
        noise that depends on (seed, position) alone, so the same seed gives the same
        text with any proposer and any k (None: nondeterministic).
    ignore_eos: keep generating past end-of-sequence tokens.
    stop: strings that end generation; the text is cut before the first one.
    stop_token_ids: token ids that end generation like an end-of-sequence token (even
        with ignore_eos); the token is kept in the ids, not in the text.
    logprobs: None, or report each new token's log-probability with this many most
        likely alternatives (0..20), from the target's processed distribution (see
        `token_logprobs`): the same numbers whatever proposes the drafts.
    frequency_penalty, presence_penalty: subtracted from a token's logit per time it
        occurs in the output so far / once if it occurs (OpenAI's meaning, -2..2).
    repetition_penalty: a token seen in the prompt or output has its logit divided by
        this when positive, multiplied when negative (1 is off; > 0).
    logit_bias: {token id: bias} added to the logits (-100..100).
    See `penalize`: they apply to every row of a verify pass with the drafts before it
    counted as output, and to the draft model's q alike, so speculation stays lossless.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    max_tokens: int = 128
    seed: int | None = None
    ignore_eos: bool = False
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    logprobs: int | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = field(default_factory=tuple)  # or a dict

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
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if any(not _is_int(t) or t < 0 for t in self.stop_token_ids):
            raise SamplingError(
                f"stop_token_ids={self.stop_token_ids!r}: use token ids (integers >= 0)"
            )
        lp = self.logprobs
        if lp is not None and (not _is_int(lp) or not 0 <= lp <= MAX_LOGPROBS):
            raise SamplingError(
                f"logprobs={lp!r} is out of range: use an integer 0..{MAX_LOGPROBS} or None"
            )
        for name in ("frequency_penalty", "presence_penalty"):
            v = getattr(self, name)
            if not _is_number(v) or not -2.0 <= v <= 2.0:
                raise SamplingError(f"{name}={v!r} is out of range: use a number in [-2, 2]")
        r = self.repetition_penalty
        if not _is_number(r) or not 0 < r < math.inf:
            raise SamplingError(f"repetition_penalty={r!r} is out of range: use a number > 0")
        bias = self.logit_bias
        pairs = tuple(sorted(bias.items() if isinstance(bias, dict) else bias))
        for token, value in pairs:
            if not _is_int(token) or token < 0:
                raise SamplingError(f"logit_bias: key {token!r} is not a token id (integer >= 0)")
            if not _is_number(value) or not -100.0 <= value <= 100.0:
                raise SamplingError(
                    f"logit_bias[{token}]={value!r} is out of range: use a number in [-100, 100]"
                )
        object.__setattr__(self, "logit_bias", tuple((t, float(v)) for t, v in pairs))

    @property
    def greedy(self) -> bool:
        """Temperature 0, or one so small that dividing by it overflows the logits."""
        return self.temperature < GREEDY_BELOW

    @property
    def penalized(self) -> bool:
        """Whether the logits depend on the history (penalties) or are biased."""
        return bool(
            self.frequency_penalty
            or self.presence_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
        )


def penalize(
    logits: Tensor, params: SamplingParams, histories: Sequence[Sequence[int]], prompt_len: int
) -> Tensor:
    """Logits with `params`' bias and penalties applied (the input itself when there are
    none); comes before temperature, top-k and top-p, for p and q alike.

    logits: [n, vocab]; histories[i]: every token before row i's position, the prompt
    (its first prompt_len tokens) then the output, drafts before the row included: row j
    of a verify pass sees the drafts 0..j-1 as output, exactly as plain decoding would
    have when it reached that position. Ids beyond the row's vocabulary are ignored."""
    if not params.penalized:
        return logits
    out = logits.float().clone()
    vocab = out.shape[-1]
    if params.logit_bias:
        ids = torch.tensor([t for t, _ in params.logit_bias if t < vocab], dtype=torch.long)
        bias = torch.tensor([b for t, b in params.logit_bias if t < vocab])
        out[:, ids] += bias
    freq, pres, rep = params.frequency_penalty, params.presence_penalty, params.repetition_penalty
    for row, history in zip(out, histories, strict=True):
        if rep != 1.0:
            seen = torch.tensor(history, dtype=torch.long).unique()
            seen = seen[seen < vocab]
            values = row[seen]
            row[seen] = torch.where(values > 0, values / rep, values * rep)
        if (freq or pres) and len(history) > prompt_len:
            ids, counts = torch.tensor(history[prompt_len:], dtype=torch.long).unique(
                return_counts=True
            )
            keep = ids < vocab
            row[ids[keep]] -= freq * counts[keep].float() + pres
    return out


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
    return _shaped(logits, params).softmax(dim=-1)


def _shaped(logits: Tensor, params: SamplingParams) -> Tensor:
    """Float logits divided by the temperature, with what top-k and top-p drop at -inf."""
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
    return logits


@dataclass(frozen=True)
class TokenLogprob:
    """One emitted (or prompt) token's log-probability and the most likely alternatives
    at its position, as (token id, log-probability), most likely first."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def token_logprobs(
    logits: Tensor, tokens: list[int], params: SamplingParams, top_n: int
) -> list[TokenLogprob]:
    """Log-probabilities of `tokens` under the target's rows `logits` ([len(tokens),
    vocab]): of the distribution tokens are drawn from (temperature, top-k, top-p
    applied; a token they drop has -inf), and for a greedy request, whose processed
    distribution is a point mass, of the model's own distribution (temperature 1).
    A row's numbers depend on that row alone, so they are the same whatever was drafted."""
    rows = logits.float()
    shaped = rows if params.greedy else _shaped(rows, params)
    logp = torch.log_softmax(shaped, dim=-1)
    ids = torch.tensor(tokens, dtype=torch.long)
    chosen = logp.gather(-1, ids[:, None])[:, 0].tolist()
    if top_n > 0:
        values, order = torch.topk(logp, min(top_n, logp.shape[-1]), dim=-1)
        tops = [
            tuple(zip(o, v, strict=True))
            for o, v in zip(order.tolist(), values.tolist(), strict=True)
        ]
    else:
        tops = [()] * len(tokens)
    return [TokenLogprob(t, c, top) for t, c, top in zip(tokens, chosen, tops, strict=True)]


def sample(probs: Tensor, generator: torch.Generator | None) -> Tensor:
    """Draw one token per row. probs: [n, vocab] (rows sum to 1, up to rounding) ->
    ids: [n] (int64).

    One uniform per row is located in the row's cumulative sum (float64):
    `torch.multinomial` over a 150k vocabulary costs ~3.5 ms on a CPU core, a tenth of
    a 1.5B decode step; this costs a few tenths. A one-hot row gives its token. (Greedy
    requests do not come here: they take each row's argmax, see `Coupled`.)"""
    cdf = probs.double().cumsum(dim=-1)  # [n, vocab]
    u = torch.rand(probs.shape[0], 1, generator=generator, dtype=torch.float64)
    picked = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).squeeze(-1)
    # u * total < total, so picked < vocab; a token of zero mass shares its cdf value with
    # the token before it and is never the first index whose cdf exceeds the target.
    return picked.clamp_max(probs.shape[-1] - 1)


_NOISE_KEPT = 32  # positions whose noise is kept: a step's drafts and verify reuse them
_noise: OrderedDict[tuple[int, int], Tensor] = OrderedDict()


def position_noise(seed: int, position: int, size: int) -> Tensor:
    """The first `size` exponential variates (float32, > 0) of the stream for
    (seed, position): counter-based, so any position is drawn without the ones before
    it, and a shorter vector is a prefix of a longer one (a draft's smaller vocabulary
    sees the same noise for the same ids)."""
    key = (seed, position)
    kept = _noise.get(key)
    if kept is None or kept.shape[0] < size:
        gen = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, position])))
        values = gen.standard_exponential(size, dtype=np.float32)
        kept = torch.from_numpy(values).clamp_min_(torch.finfo(torch.float32).tiny)
        _noise[key] = kept
        while len(_noise) > _NOISE_KEPT:
            _noise.popitem(last=False)
    _noise.move_to_end(key)
    return kept[:size]


def seeded_pick(probs: Tensor, seed: int, position: int, ids: Tensor | None = None) -> int:
    """The seeded draw at `position`: argmax_i probs_i / E_i over the position's noise E.

    probs: [vocab] (or [1, vocab]) over token ids 0..vocab-1, or over the ids in `ids`
    (a draft vocabulary that is a subset of the target's); returns a token id. For any
    distribution this is an exact draw from it, and two distributions at one position
    (a draft's q and the target's p) pick the same token as often as the coupling allows.
    """
    row = probs.reshape(-1).float()
    if ids is None:
        noise = position_noise(seed, position, row.shape[0])
        return int((row / noise).argmax())
    noise = position_noise(seed, position, int(ids.max()) + 1)[ids]
    return int(ids[int((row / noise).argmax())])


def draw(
    probs: Tensor,
    params: SamplingParams,
    generator: torch.Generator | None,
    position: int,
    ids: Tensor | None = None,
) -> int:
    """One token from probs ([1, vocab] or [vocab]) as `params` asks: the argmax when
    greedy, the seeded draw at `position` (the token's index in the whole sequence) when
    a seed is set, else a draw from `generator`. `ids` maps probs' columns to token ids."""
    row = probs.reshape(-1)
    if params.greedy:
        idx = int(row.argmax())
    elif params.seed is not None:
        return seeded_pick(row, params.seed, position, ids)
    else:
        idx = int(sample(row[None], generator)[0])
    return idx if ids is None else int(ids[idx])


@dataclass(frozen=True)
class Coupled:
    """Verification when the target's token at each position is a function of its row
    and the position alone: the argmax when greedy (`seed` None), else the seeded draw
    at sequence position `start + offset`. A draft is kept exactly when it equals that
    token, so the text is the target's own, whatever was drafted."""

    seed: int | None
    start: int

    def pick(self, row: Tensor, offset: int) -> int:
        """row: the target's processed distribution ([vocab]); when greedy its raw
        logits serve as well (the same argmax, first index on ties)."""
        if self.seed is None:
            return int(row.argmax())
        return seeded_pick(row, self.seed, self.start + offset)


def coupling(params: SamplingParams, position: int) -> Coupled | None:
    """The coupled rule for a greedy or seeded request whose next token sits at
    `position`; None for unseeded sampling (the standard accept / resample rule)."""
    if params.greedy:
        return Coupled(None, position)
    if params.seed is None:
        return None
    return Coupled(params.seed, position)


def make_generator(seed: int | None) -> torch.Generator:
    gen = torch.Generator(device="cpu")
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(seed)
    return gen
