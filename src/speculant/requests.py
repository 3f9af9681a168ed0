"""What a request is to the engine and what it gets back: prompt checks, the result and
its speculation figures, and the chunks a stream commits."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from speculant.sampling import TokenLogprob


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

    @classmethod
    def total(cls, parts: Sequence[GenerationStats]) -> GenerationStats:
        """The figures of several sequences (the choices of one request) together."""
        out = cls()
        for s in parts:
            out.prompt_tokens = max(out.prompt_tokens, s.prompt_tokens)
            out.num_generated += s.num_generated
            out.num_drafted += s.num_drafted
            out.num_accepted += s.num_accepted
            out.target_forwards += s.target_forwards
            per = out.accepted_per_position
            per.extend([0] * (len(s.accepted_per_position) - len(per)))
            for j, a in enumerate(s.accepted_per_position):
                per[j] += a
        return out

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
    finish_reason: str  # "stop" (EOS, stop string or stop token), "length", or "cancelled"
    stats: GenerationStats
    logprobs: list[TokenLogprob] | None = None  # one per token id, when params.logprobs


@dataclass(frozen=True)
class StreamChunk:
    token_ids: list[int]  # tokens committed by this step
    text: str  # text that became final with them (may be "" while a stop string could start)
    logprobs: list[TokenLogprob] | None = None  # one per token id, when params.logprobs


def check_token_ids(ids: Sequence[int], vocab: int, what: str = "token id") -> None:
    """Refuse an id outside the vocabulary, naming it and the range."""
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise RequestError(f"{what} {bad[0]} is out of range: ids are 0..{vocab - 1}")


def check_prompt(prompt_ids: Sequence[int], vocab: int, max_seq_len: int) -> list[int]:
    prompt = [int(t) for t in prompt_ids]
    if not prompt:
        raise RequestError("the prompt is empty: give at least one token")
    check_token_ids(prompt, vocab, "prompt token id")
    if len(prompt) >= max_seq_len:
        raise RequestError(
            f"the prompt has {len(prompt)} tokens, the context holds {max_seq_len}: shorten it"
        )
    return prompt
