"""Continuous batching of speculative steps: every running sequence drafts, then ONE
target pass verifies all of them, and each keeps its own accepted length.

One step, for the sequences s = 1..B that are running:

    k_s       = policy_s.choose(budget_s)                 how many to draft
    drafts_s  = lane_s.proposer.propose(tokens_s, k_s)    (batched when the proposer can)
    logits    = target.verify([tokens_s[-1], *drafts_s] for every s)   one batched pass
    verdict_s = rejection.verify(drafts_s, q_s, p_s)      accept / resample / bonus (or coupled)
    cache_s.commit(start_s, verdict_s.rows)               keep the accepted rows only

A sequence that joins is prefilled on its own, then takes part in the next step (or,
with a token budget, its prompt is prefilled in chunks that ride along in the steps'
verify passes, so a long prompt does not stall the running sequences); one that ends
(EOS, stop string, max_tokens, context, or cancelled) leaves at once and its lane
(proposer + speculation-length policy) goes back to the pool for the next request.
Each segment of the batched pass is padded as it would be alone, so a sequence's tokens
do not depend on which others share its steps: greedy output is the same at any
concurrency (tested).

`Engine` runs one sequence through this same code, so the single-request path and the
batched path share every line of the loop.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from speculant.adaptive import Others, Policy, StepCost, choose_batch
from speculant.cache import KVCache
from speculant.detokenize import TextTracker
from speculant.models.model import Model
from speculant.models.segment import Segment
from speculant.prefix_cache import PrefixCache
from speculant.proposers import Draft, Proposer
from speculant.proposers.base import CachesPrompt, DraftsTogether, UsesFeatures
from speculant.rejection import Verdict, verify
from speculant.requests import GenerationResult, GenerationStats, StreamChunk
from speculant.sampling import (
    Coupled,
    SamplingParams,
    TokenLogprob,
    coupling,
    make_generator,
    penalize,
    process_logits,
    token_logprobs,
)
from speculant.tree import with_root


@dataclass(frozen=True)
class StepEvent:
    """What one step did to one sequence: its new chunk, and its result once finished."""

    seq: SequenceState
    chunk: StreamChunk
    drafted: int
    accepted: int
    result: GenerationResult | None


@dataclass
class Lane:
    """What a running sequence drafts with; reused by the next request when it ends."""

    proposer: Proposer
    policy: Policy


class SequenceState:
    """One request inside the scheduler: its tokens, cache, lane, text and stats.

    Invariant between steps: the cache holds every committed token but the last one,
    which is fed at the head of the next verify pass together with the drafts."""

    def __init__(
        self,
        request_id: Any,
        target: Model,
        prompt: list[int],
        params: SamplingParams,
        lane: Lane,
        max_seq_len: int,
    ) -> None:
        self.request_id = request_id
        self.params = params
        self.prompt_len = len(prompt)
        self.lane = lane
        self.t0 = time.perf_counter()
        self.stats = GenerationStats(prompt_tokens=len(prompt))
        self.capacity = min(max_seq_len, len(prompt) + params.max_tokens)
        self.cache: KVCache = target.new_cache(self.capacity)
        self.generator = make_generator(params.seed)
        tokenizer = target.tokenizer
        eos = frozenset() if params.ignore_eos or tokenizer is None else tokenizer.eos_token_ids
        self.eos = eos | frozenset(params.stop_token_ids)
        self.text = TextTracker(target, params.stop)
        self.tokens = list(prompt)
        self.output: list[int] = []
        self.logprobs: list[TokenLogprob] | None = None if params.logprobs is None else []
        self.finish: str | None = None
        self.draft = Draft([])
        self.k = 0
        self.prompt_hidden: torch.Tensor | None = None  # the prompt's features, for EAGLE
        self.prefilled = 0  # prompt positions (of all but the last token) in the cache
        self.followers: list[SequenceState] = []  # choices waiting to copy this prefill
        self.retired = False  # left the scheduler; its lane went back to the pool

    @property
    def prefill_done(self) -> bool:
        return self.prefilled >= self.prompt_len - 1

    def coupled(self) -> Coupled | None:
        """The coupled rule for a greedy or seeded request (see sampling.py)."""
        return coupling(self.params, len(self.tokens))

    @property
    def budget(self) -> int:
        """Tokens this sequence may still commit."""
        return min(self.params.max_tokens - len(self.output), self.capacity - len(self.tokens) + 1)

    def commit(self, token_ids: Sequence[int]) -> StreamChunk:
        """Append a verdict's tokens up to the first that ends the request."""
        committed: list[int] = []
        done = False
        for token in token_ids:
            committed.append(token)
            if token in self.eos or self.text.push(token):
                self.finish, done = "stop", True
                break
            if len(self.output) + len(committed) >= self.params.max_tokens:
                done = True
                break
        self.tokens.extend(committed)
        self.output.extend(committed)
        if not self.stats.time_to_first_token_s:
            self.stats.time_to_first_token_s = time.perf_counter() - self.t0
        if not done and self.budget <= 0:
            done = True
        if done and self.finish is None:
            self.finish = "length"
        return StreamChunk(committed, self.text.release(final=done))

    def result(self) -> GenerationResult:
        self.stats.num_generated = len(self.output)
        self.stats.elapsed_s = time.perf_counter() - self.t0
        return GenerationResult(
            list(self.output),
            self.text.final_text(),
            self.finish or "length",
            self.stats,
            None if self.logprobs is None else list(self.logprobs),
        )


class Scheduler:
    """Runs many sequences in lock-step; `step()` advances every one of them by one
    verify pass. Not thread-safe: one thread owns it (the server's engine thread)."""

    PREFILL_FLOOR = 16  # prompt rows a step takes even when decoding fills the budget
    PREFILL_CHUNK = 256  # most rows of one prompt in one pass

    def __init__(
        self,
        target: Model,
        new_lane: Callable[[], Lane],
        max_seq_len: int,
        max_num_batched_tokens: int | None = None,
        prefix_cache: PrefixCache | None = None,
    ) -> None:
        """max_num_batched_tokens: rows per target pass that decoding and prompt chunks
        share (vLLM's meaning): the running sequences' verify rows come first, and the
        rest (at least PREFILL_FLOOR) prefills waiting prompts, oldest first, in the same
        pass. None: a prompt is prefilled whole when it joins.
        prefix_cache: where finished sequences leave their cache rows and joining ones
        look for their prompt's longest cached prefix (see speculant.prefix_cache)."""
        if max_num_batched_tokens is not None and max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens={max_num_batched_tokens} is out of range: use >= 1"
            )
        self.target = target
        self.new_lane = new_lane
        self.max_seq_len = max_seq_len
        self.budget = max_num_batched_tokens
        self.prefix_cache = prefix_cache
        self.running: list[SequenceState] = []
        self.prefilling: list[SequenceState] = []  # joined, prompt not yet in the cache
        self._idle: list[Lane] = []

    @property
    def busy(self) -> bool:
        """Whether any sequence is decoding or still being prefilled."""
        return bool(self.running or self.prefilling)

    def add(
        self,
        request_id: Any,
        prompt: list[int],
        params: SamplingParams,
        *,
        share_prefill_with: SequenceState | None = None,
    ) -> SequenceState:
        """Prefill a new sequence; it takes part from the next step on.

        share_prefill_with: a sequence with the same prompt that has not stepped yet (the
        first choice of an n > 1 request): its prompt cache is copied, not recomputed."""
        source = share_prefill_with
        if source is not None and (source.tokens != prompt or source.output):
            raise ValueError("share_prefill_with needs a sequence of the same prompt, not started")
        lane = self._idle.pop() if self._idle else self.new_lane()
        seq = SequenceState(request_id, self.target, prompt, params, lane, self.max_seq_len)
        lane.proposer.begin(prompt, seq.capacity)
        try:
            if source is not None and not source.prefill_done:
                source.followers.append(seq)  # starts when the source's prefill is done
                return seq
            if source is not None:
                self._copy_prefill(source, seq)
            else:
                # EAGLE drafts from the target's features of every prompt position, which
                # a cached prefix does not have: its prompts are computed.
                if self.prefix_cache is not None and not _needs_features(lane):
                    seq.prefilled = self.prefix_cache.lookup(prompt, seq.cache, len(prompt) - 1)
                if self.budget is not None and not seq.prefill_done:
                    self.prefilling.append(seq)  # chunks ride along in the next steps
                    return seq
                hidden = self.target.prefill(
                    prompt[seq.prefilled : -1],
                    seq.cache,
                    seq.prefilled,
                    return_hidden=_needs_features(lane),
                )
                seq.prefilled = len(prompt) - 1
                self._observe_prompt(seq, hidden)
        except BaseException:
            lane.proposer.end(prompt)
            self._idle.append(lane)
            raise
        self.running.append(seq)
        return seq

    def _observe_prompt(self, seq: SequenceState, hidden: torch.Tensor | None) -> None:
        """Hand prompt features to an EAGLE proposer (kept while choices may copy them)."""
        user = _feature_user(seq.lane)
        if hidden is None or user is None:
            return
        part = hidden if seq.prompt_hidden is None else torch.cat([seq.prompt_hidden, hidden])
        seq.prompt_hidden = part
        user.observe(hidden)

    def _copy_prefill(self, source: SequenceState, seq: SequenceState) -> None:
        seq.cache.copy_from(source.cache)
        seq.prefilled = source.prefilled
        self._observe_prompt(seq, source.prompt_hidden)

    def _prefill_done(self, seq: SequenceState) -> None:
        """A chunked prefill is complete: the sequence (and the choices that share its
        prompt) decode from the next step on."""
        self.prefilling.remove(seq)
        self.running.append(seq)
        for follower in seq.followers:
            self._copy_prefill(seq, follower)
            self.running.append(follower)
        seq.followers = []

    def _prefill_chunks(self, decode_rows: int) -> list[tuple[SequenceState, int, int]]:
        """(sequence, first, end) prompt positions to prefill in this step's pass."""
        if self.budget is None or not self.prefilling:
            return []
        left = max(self.budget - decode_rows, min(self.budget, self.PREFILL_FLOOR))
        chunks = []
        for seq in self.prefilling:
            if left <= 0:
                break
            n = min(seq.prompt_len - 1 - seq.prefilled, left, self.PREFILL_CHUNK)
            chunks.append((seq, seq.prefilled, seq.prefilled + n))
            left -= n
        return chunks

    def cancel(self, seq: SequenceState) -> GenerationResult:
        """Stop a sequence now (its client went away); it leaves the batch."""
        seq.finish = "cancelled"
        self._retire(seq)
        return seq.result()

    def _retire(self, seq: SequenceState) -> None:
        if seq.retired:
            return
        seq.retired = True
        for source in self.prefilling:  # a choice that never started
            if seq in source.followers:
                source.followers.remove(seq)
        if seq in self.prefilling:
            self.prefilling.remove(seq)
            for follower in seq.followers:  # its choices prefill on their own now
                follower.prefilled = 0
                self.prefilling.append(follower)
            seq.followers = []
        if seq in self.running:
            self.running.remove(seq)
        if self.prefix_cache is not None:
            self.prefix_cache.store(seq.tokens, seq.cache)
        seq.lane.proposer.end(seq.tokens)
        self._idle.append(seq.lane)

    def step(self) -> list[StepEvent]:
        """One verify pass for every running sequence (carrying prompt chunks of joining
        sequences when there is a token budget)."""
        seqs = list(self.running)
        if not seqs and not self.prefilling:
            return []
        behind = [seq.k == 0 for seq in seqs]  # drafted nothing last step (or is new)
        for seq in seqs:
            seq.prompt_hidden = None  # sequences share a prefill only before their first step
        _choose_all(seqs)
        t_draft = time.perf_counter()
        _propose_all(seqs)
        t_verify = time.perf_counter()
        segments = []
        for seq in seqs:
            start = len(seq.tokens) - 1
            tokens = torch.tensor([seq.tokens[-1], *seq.draft.token_ids], dtype=torch.long)
            parents = seq.draft.parents
            tree = None if parents is None else with_root(parents)
            segments.append(Segment(tokens, seq.cache, start, tree))
        decode_rows = sum(seg.tokens.shape[0] for seg in segments)
        chunks = self._prefill_chunks(decode_rows)
        for seq, lo, hi in chunks:
            part = torch.tensor(seq.tokens[lo:hi], dtype=torch.long)
            segments.append(Segment(part, seq.cache, lo, logits=False))
        lanes = [seq.lane for seq in seqs] + [seq.lane for seq, _, _ in chunks]
        need_hidden = any(_needs_features(lane) for lane in lanes)
        all_logits, hidden = self.target.verify(segments, features=need_hidden)  # [k_s + 1, vocab]
        for j, (seq, _, hi) in enumerate(chunks):
            seq.prefilled = hi
            self._observe_prompt(seq, None if hidden is None else hidden[len(seqs) + j])
            if isinstance(seq.lane.proposer, CachesPrompt):  # its own prompt rows, in step
                seq.lane.proposer.prefill_to(hi)
            if seq.prefill_done:
                self._prefill_done(seq)
        if not seqs:
            return []
        events = []
        verdicts: list[Verdict] = []
        emitted_rows: list[list[int]] = []  # the logits row of each token a verdict emits
        decoded = zip(seqs, all_logits[: len(seqs)], segments[: len(seqs)], strict=True)
        for i, (seq, logits, seg) in enumerate(decoded):
            if seq.params.penalized:  # each row sees the drafts before it as output
                logits = penalize(logits, seq.params, _row_histories(seq), seq.prompt_len)
                all_logits[i] = logits  # logprobs come from the same rows
            # Greedy verification needs only each row's argmax: the logits serve.
            p_target = logits if seq.params.greedy else process_logits(logits, seq.params)
            draft = seq.draft
            verdict = verify(
                draft.token_ids,
                draft.q_probs,
                p_target,
                seq.generator,
                seq.coupled(),
                draft.parents,
            )
            rows = verdict.rows  # the rows behind the emitted tokens, root first
            seq.cache.commit(seg.start, rows, seg.tree_kv)  # keep them, drop the rejected
            user = _feature_user(seq.lane)
            if hidden is not None and user is not None:
                user.observe(hidden[i][rows])
            verdicts.append(verdict)
            emitted_rows.append(rows)
        t_done = time.perf_counter()
        draft_s, verify_s = t_verify - t_draft, t_done - t_verify
        # A proposer that drafts after drafting nothing catches up on the tokens it has
        # not seen (the prompt, plain steps' tokens): a one-off, not a per-step cost.
        caught_up = not any(b and seq.k > 0 for b, seq in zip(behind, seqs, strict=True))
        cost = StepCost(
            rows=decode_rows + sum(hi - lo for _, lo, hi in chunks),
            verify_s=verify_s,
            draft_depth=_draft_depth(seqs),
            draft_s=draft_s if caught_up else None,
        )
        for seq, verdict, logits, rows in zip(
            seqs, verdicts, all_logits[: len(seqs)], emitted_rows, strict=True
        ):
            drafted = seq.draft.depth  # a tree counts its longest path
            seq.lane.policy.observe(drafted, verdict.num_accepted, draft_s, verify_s, cost)
            seq.stats.record(drafted, verdict.num_accepted)
            chunk = seq.commit(verdict.token_ids)
            if seq.logprobs is not None and seq.params.logprobs is not None:
                ids = chunk.token_ids
                lps = token_logprobs(logits[rows[: len(ids)]], ids, seq.params, seq.params.logprobs)
                seq.logprobs.extend(lps)
                chunk = StreamChunk(ids, chunk.text, lps)
            result = None
            if seq.finish is not None:
                tail = seq.text.release(final=True)
                if tail:
                    chunk = StreamChunk(chunk.token_ids, chunk.text + tail, chunk.logprobs)
                self._retire(seq)
                result = seq.result()
            events.append(StepEvent(seq, chunk, drafted, verdict.num_accepted, result))
        return events


def _choose_all(seqs: list[SequenceState]) -> None:
    """Pick every sequence's k for this step, weighing the whole batch (see
    adaptive.choose_batch): sequences whose proposers are of one kind are chosen
    together, the others count by their last k (their rows and expected tokens)."""
    groups: dict[type, list[SequenceState]] = {}
    for seq in seqs:
        groups.setdefault(type(seq.lane.proposer), []).append(seq)
    for kind, members in groups.items():
        rest = [s for s in seqs if type(s.lane.proposer) is not kind]
        base = Others(
            sum(s.k + 1 for s in rest), sum(s.lane.policy.expected_tokens(s.k) for s in rest)
        )
        ks = choose_batch(
            [s.lane.policy for s in members],
            [s.budget - 1 for s in members],
            [s.k for s in members],
            _drafts_together(kind),
            base,
        )
        for seq, k in zip(members, ks, strict=True):
            seq.k = k


def _draft_depth(seqs: list[SequenceState]) -> int:
    """Draft calls of a step: per proposer kind, the deepest draft when it drafts all its
    sequences at once (one batched call per position), else the sum of their depths."""
    groups: dict[type, list[int]] = {}
    for seq in seqs:
        if seq.draft.depth > 0:
            groups.setdefault(type(seq.lane.proposer), []).append(seq.draft.depth)
    return sum(max(ks) if _drafts_together(kind) else sum(ks) for kind, ks in groups.items())


def _drafts_together(kind: type) -> bool:
    return issubclass(kind, DraftsTogether)


def _propose_all(seqs: list[SequenceState]) -> None:
    """Fill seq.draft for every sequence; proposers of one kind that can draft for
    several sequences at once (`propose_many`) do so in one batched call."""
    groups: dict[type, list[SequenceState]] = {}
    for seq in seqs:
        seq.draft = Draft([])
        if seq.k > 0:
            groups.setdefault(type(seq.lane.proposer), []).append(seq)
    for kind, members in groups.items():
        if issubclass(kind, DraftsTogether) and len(members) > 1:
            drafts = kind.propose_many(
                [s.lane.proposer for s in members],
                [s.tokens for s in members],
                [s.k for s in members],
                [s.params for s in members],
                [s.generator for s in members],
            )
        else:
            drafts = [
                s.lane.proposer.propose(s.tokens, s.k, s.params, s.generator) for s in members
            ]
        for seq, draft in zip(members, drafts, strict=True):
            if draft.parents is not None:  # a tree: its proposer kept within depth k
                if draft.depth > seq.k:
                    raise ValueError(f"{kind.__name__} drafted a tree deeper than k={seq.k}")
                seq.draft = draft
                continue
            q = draft.q_probs[: seq.k] if draft.q_probs is not None else None
            seq.draft = Draft(draft.token_ids[: seq.k], q)


def _row_histories(seq: SequenceState) -> list[list[int]]:
    """The tokens before each row of the sequence's verify segment: its committed tokens,
    then the drafts on the row's path (a chain's drafts before it, a tree node's
    ancestors)."""
    drafts, parents = seq.draft.token_ids, seq.draft.parents
    rows = [list(seq.tokens)]
    for j, token in enumerate(drafts):
        before = rows[j] if parents is None else rows[parents[j] + 1]
        rows.append([*before, token])
    return rows


def _feature_user(lane: Lane) -> UsesFeatures | None:
    """The lane's proposer when it drafts from the target's features (EAGLE)."""
    proposer = lane.proposer
    return proposer if isinstance(proposer, UsesFeatures) and proposer.needs_features else None


def _needs_features(lane: Lane) -> bool:
    return _feature_user(lane) is not None
