"""A separate, smaller model of the same family drafts autoregressively.

It keeps its own KV cache and the list of ids that cache holds. Each `propose` first
brings the cache in step with the committed context: the common prefix with what it
holds stays, the rest (rejected drafts) is rolled back with one truncate, and the
missing committed tokens are fed. Then it samples k tokens from its processed q.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from speculant.cache import KVCache
from speculant.proposers.base import Draft, register
from speculant.sampling import SamplingParams, draw, penalize, process_logits

if TYPE_CHECKING:
    from speculant.models.model import Model
    from speculant.prefix_cache import PrefixCache


class TokenizerMismatchError(ValueError):
    """Target and draft do not share a tokenizer, so draft ids mean nothing to the target."""


def check_pairing(target: Model, draft: Model) -> int:
    """Refuse a draft whose token ids do not mean the same text as the target's; return
    how many of the draft's logits it drafts from (ids the target also has).

    The two vocabularies are compared token by token, whatever the models are called: a
    draft whose tokens are the target's, or the target's and more after them (a superset
    where the ids agree), drafts; the first id whose token differs is named otherwise."""
    tt, dt = target.tokenizer, draft.tokenizer
    problem = None
    if tt is None and dt is None:
        if draft.vocab_size != target.vocab_size:
            problem = f"vocab sizes {draft.vocab_size} vs {target.vocab_size}"
    elif tt is None or dt is None:
        problem = "only one of them has a tokenizer"
    else:
        ours, theirs = tt.tokens(), dt.tokens()
        first = next(
            (i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b), None
        )
        if first is not None:
            problem = (
                f"token id {first} is {theirs[first]!r} in the draft but {ours[first]!r} in "
                "the target"
            )
        elif len(theirs) < len(ours):
            problem = (
                f"the draft's vocabulary stops at {len(theirs)} tokens, the target's has "
                f"{len(ours)}"
            )
    if problem is not None:
        raise TokenizerMismatchError(
            f"draft {draft.name!r} cannot draft for target {target.name!r}: {problem}. "
            "Use a draft whose vocabulary is the target's (for example "
            "qwen2.5-coder-0.5b-instruct for qwen2.5-coder-1.5b-instruct), or a draft-free "
            "method."
        )
    # a larger draft vocabulary (a superset): its extra ids are never drafted
    return min(draft.vocab_size, target.vocab_size)


@register("draft")
class DraftModelProposer:
    name = "draft"

    def __init__(self, target: Model, draft: Model | None = None, **_: Any) -> None:
        if draft is None:
            raise ValueError("method 'draft' needs a draft model (--draft NAME)")
        self._limit = check_pairing(target, draft)  # logits drafted from: ids both have
        self.model = draft
        self._cache: KVCache | None = None
        self._cached_ids: list[int] = []  # ids whose keys/values are in the cache, in order
        self._committed = 0  # leading cached ids known to be committed (never rolled back)
        self._prompt: list[int] = []
        self._prompt_len = 0  # output starts here (frequency and presence penalties)
        self.prefix_cache: PrefixCache | None = None  # shared by spawns (see CachesPrompt)

    def begin(self, prompt_ids: Sequence[int], capacity: int) -> None:
        # Room for the context plus the drafts fed after it.
        self._cache = self.model.new_cache(capacity + 16)
        self._prompt = list(prompt_ids)
        self._prompt_len = len(prompt_ids)
        n = 0
        if self.prefix_cache is not None:
            n = self.prefix_cache.lookup(self._prompt, self._cache, len(self._prompt) - 1)
        self._cached_ids = self._prompt[:n]
        self._committed = n

    def prefill_to(self, end: int) -> None:
        """Compute the prompt rows [cached, end) now (a chunk of the target's prefill)."""
        assert self._cache is not None, "begin() was not called"
        have = len(self._cached_ids)
        if self._committed < have or end <= have:
            return  # rows beyond the prompt, or nothing new: drafting catches up itself
        part = self._prompt[have:end]
        self.model.prefill(part, self._cache, have)
        self._cached_ids.extend(part)
        self._committed = len(self._cached_ids)

    def end(self, tokens: Sequence[int] = ()) -> None:
        if self.prefix_cache is not None and self._cache is not None:
            # The rows of committed tokens: the cached ids up to the first that differs.
            valid = 0
            for cached, token in zip(self._cached_ids, tokens, strict=False):
                if cached != token:
                    break
                valid += 1
            self._cache.length = min(self._cache.length, valid)
            self.prefix_cache.store(list(tokens[:valid]), self._cache)
        self._cache = None
        self._cached_ids = []

    def spawn(self) -> DraftModelProposer:
        """Shares the draft model (weights, calibration); its own cache and ids."""
        fresh = copy.copy(self)
        fresh._cache = None
        fresh._cached_ids = []
        fresh._committed = 0
        return fresh

    def _plan(self, context: Sequence[int]) -> list[int]:
        """Roll the cache back to the longest prefix it shares with context[:-1]; return
        the committed tokens still to feed (at least the last one)."""
        assert self._cache is not None, "begin() was not called"
        limit = min(len(self._cached_ids), len(context) - 1)
        keep = min(self._committed, limit)
        if keep and self._cached_ids[keep - 1] != context[keep - 1]:
            keep = 0  # not the request we were following: compare from the start
        # Only the drafts after the committed prefix can differ from the context.
        while keep < limit and self._cached_ids[keep] == context[keep]:
            keep += 1
        self._cache.truncate(keep)  # roll back rejected drafts
        del self._cached_ids[keep:]
        missing = list(context[keep:])
        self._cached_ids.extend(missing)
        self._committed = len(context)
        return missing

    @staticmethod
    def propose_many(
        proposers: Sequence[DraftModelProposer],
        contexts: Sequence[Sequence[int]],
        ks: Sequence[int],
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator],
    ) -> list[Draft]:
        """Draft for several sequences with one batched draft pass per position.

        Every sequence samples from its own processed q with its own generator, in the
        same order as `propose` would, and each segment of a batched pass is bitwise
        what it is alone: the drafts are exactly those of separate `propose` calls."""
        model = proposers[0].model
        if any(p.model is not model for p in proposers):
            return [
                p.propose(c, k, s, g)
                for p, c, k, s, g in zip(proposers, contexts, ks, params, generators, strict=True)
            ]
        batch = []
        for p, ctx in zip(proposers, contexts, strict=True):
            missing = p._plan(ctx)
            assert p._cache is not None
            if len(missing) > 1:  # a new prompt, or all drafts kept
                model.prefill(missing[:-1], p._cache, len(ctx) - len(missing))
            batch.append((missing[-1:], p._cache, len(ctx) - 1))
        last = [rows[-1] for rows in model.forward_batch(batch)]  # [vocab] each
        ids: list[list[int]] = [[] for _ in proposers]
        rows: list[list[torch.Tensor]] = [[] for _ in proposers]
        for i in range(max(ks)):
            active = [j for j, k in enumerate(ks) if i < k]
            feed = []
            for j in active:
                # the target's penalties too (each draft counted as output): q closer to p
                history = [[*contexts[j], *ids[j]]] if params[j].penalized else []
                row = last[j][: proposers[j]._limit]  # ids the target has too
                logits = penalize(row[None], params[j], history, proposers[j]._prompt_len)
                q = process_logits(logits, params[j])  # [1, vocab_q]
                token = draw(q, params[j], generators[j], len(contexts[j]) + i)
                ids[j].append(token)
                rows[j].append(q[0])
                if i + 1 < ks[j]:
                    cache = proposers[j]._cache
                    assert cache is not None
                    feed.append((j, ([token], cache, len(contexts[j]) + i)))
                    proposers[j]._cached_ids.append(token)
            if feed:
                out = model.forward_batch([item for _, item in feed])
                for (j, _), logits in zip(feed, out, strict=True):
                    last[j] = logits[-1]
        return [
            Draft(t, torch.stack(r)) if t else Draft([]) for t, r in zip(ids, rows, strict=True)
        ]

    def propose(
        self,
        context: Sequence[int],
        k: int,
        params: SamplingParams,
        generator: torch.Generator,
    ) -> Draft:
        if k <= 0:
            return Draft([])
        return DraftModelProposer.propose_many([self], [context], [k], [params], [generator])[0]
