"""The one proposer protocol every drafting method implements, and a registry of them.

The engine only ever calls `begin`, `propose` and `end`; it never asks which method it
is talking to. A proposer may return fewer drafts than asked (none, even): the engine
then verifies what it got, and a zero-length draft is simply a plain decoding step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch
from torch import Tensor

from speculant.sampling import SamplingParams
from speculant.tree import check_parents, tree_depth

if TYPE_CHECKING:
    from speculant.models.model import Model
    from speculant.prefix_cache import PrefixCache


@dataclass(frozen=True)
class Draft:
    """Drafted continuation of the committed tokens.

    token_ids: k' <= k drafted ids.
    q_probs: [k', vocab_q] the processed distributions the drafts were sampled from, or
        None when drafts are deterministic (a point mass: prompt lookup, suffix match).
    parents: None for a chain; for a draft tree, each token's parent index among
        token_ids (-1: it follows the last committed token), parents first. Siblings
        are verified in the order given (best first).
    """

    token_ids: list[int]
    q_probs: Tensor | None = None
    parents: list[int] | None = None

    def __post_init__(self) -> None:
        if self.q_probs is not None and self.q_probs.shape[0] != len(self.token_ids):
            raise ValueError(
                f"q_probs has {self.q_probs.shape[0]} rows for {len(self.token_ids)} drafts"
            )
        if self.parents is not None:
            check_parents(self.parents, len(self.token_ids))

    @property
    def depth(self) -> int:
        """Tokens on the longest path (k for a chain)."""
        if self.parents is None:
            return len(self.token_ids)
        return tree_depth(self.parents)


EMPTY_DRAFT = Draft([])


class Proposer(Protocol):
    """Drafts tokens for the target to verify.

    begin: a request starts; `prompt_ids` is its prompt, `capacity` the most positions
        the request can reach (prompt + new tokens).
    propose: `context` is every committed token so far (prompt + accepted output); draft
        up to k tokens that follow it, sampling from the processed q under `params` with
        `generator` when the proposer is stochastic. The proposer brings its own state in
        step with `context` itself (rolling back what the target rejected).
    end: the request is over; `tokens` is every committed token (prompt + output).
        Release per-request state (a proposer may keep what it learned across requests).
    Optional abilities are protocols of their own, checked with isinstance: `Spawns`
    (concurrent requests), `DraftsTogether` (batched drafting), `UsesFeatures` (drafts
    from the target's features) and `CachesPrompt` (a cache of its own).
    """

    name: str

    def begin(self, prompt_ids: Sequence[int], capacity: int) -> None: ...

    def propose(
        self,
        context: Sequence[int],
        k: int,
        params: SamplingParams,
        generator: torch.Generator,
    ) -> Draft: ...

    def end(self, tokens: Sequence[int]) -> None: ...


@runtime_checkable
class Spawns(Protocol):
    """A proposer that can serve concurrent requests: `spawn` makes a fresh one of the
    same kind and settings, sharing what is read-only (a draft model, a calibration)."""

    def spawn(self) -> Proposer: ...


@runtime_checkable
class DraftsTogether(Protocol):
    """A proposer kind that drafts for several of its proposers at once (`propose_many`,
    a staticmethod: one batched draft-model pass per position for every sequence),
    giving each bitwise the draft its own `propose` would."""

    @staticmethod
    def propose_many(
        proposers: Sequence[Any],
        contexts: Sequence[Sequence[int]],
        ks: Sequence[int],
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator],
    ) -> list[Draft]: ...


@runtime_checkable
class UsesFeatures(Protocol):
    """A proposer that drafts from the target's final hidden states (EAGLE): when
    `needs_features` is true the scheduler asks the target pass for them and hands each
    sequence's rows (prompt rows, then the rows behind every emitted token) to `observe`."""

    needs_features: bool

    def observe(self, features: torch.Tensor) -> None: ...


@runtime_checkable
class CachesPrompt(Protocol):
    """A proposer with a key/value cache of its own (a draft model): it can compute its
    prompt rows in chunks alongside the target's chunked prefill (`prefill_to`) instead
    of all at once when it first drafts, and reuse cached prefixes of earlier requests
    (`prefix_cache`, a PrefixCache of its own model's rows, shared by its spawns)."""

    prefix_cache: PrefixCache | None

    def prefill_to(self, end: int) -> None:
        """Make sure the cache holds the prompt's first `end` positions."""
        ...


class NoProposer:
    """Plain decoding: never drafts, so every step is one target forward, one token."""

    name = "none"

    def begin(self, prompt_ids: Sequence[int], capacity: int) -> None:
        return None

    def propose(
        self,
        context: Sequence[int],
        k: int,
        params: SamplingParams,
        generator: torch.Generator,
    ) -> Draft:
        return EMPTY_DRAFT

    def end(self, tokens: Sequence[int]) -> None:
        return None

    def spawn(self) -> NoProposer:
        return self


def spawn_proposer(proposer: Proposer) -> Proposer:
    """A proposer for one more concurrent request (see Proposer.spawn)."""
    if not isinstance(proposer, Spawns):
        raise ValueError(
            f"proposer {proposer.name!r} cannot serve concurrent requests: it has no spawn()"
        )
    return proposer.spawn()


ProposerFactory = Callable[..., Proposer]
_REGISTRY: dict[str, ProposerFactory] = {}


def register(name: str) -> Callable[[ProposerFactory], ProposerFactory]:
    """Class decorator: make a proposer available under `name` (CLI --method)."""

    def deco(factory: ProposerFactory) -> ProposerFactory:
        _REGISTRY[name] = factory
        return factory

    return deco


def available_methods() -> list[str]:
    return ["none", *sorted(_REGISTRY)]


def make_proposer(
    method: str, target: Model, draft: Model | None = None, **options: Any
) -> Proposer:
    """Build the proposer registered as `method` for `target` (and `draft` if it needs one)."""
    if method == "none":
        return NoProposer()
    factory = _REGISTRY.get(method)
    if factory is None:
        raise ValueError(f"unknown method {method!r}: use one of {', '.join(available_methods())}")
    return factory(target=target, draft=draft, **options)
