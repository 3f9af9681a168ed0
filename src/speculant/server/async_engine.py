"""The engine as the server sees it: requests submitted from the event loop, decoded
together by one engine thread that owns the scheduler (continuous batching), and their
chunks handed back to the loop as they are committed.

The server depends only on `EngineClient` (below); `AsyncEngine` is the real one, and
tests may give the app anything with the same members.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from speculant.anomaly import AcceptanceBaseline, AnomalyVerdict
from speculant.engine import Engine
from speculant.models.tokenizer import Tokenizer
from speculant.sampling import SamplingParams, TokenLogprob
from speculant.scheduler import GenerationResult, SequenceState, check_prompt
from speculant.scoring import prompt_logprobs
from speculant.server.metrics import ServerMetrics

log = logging.getLogger("speculant.server")


@dataclass(frozen=True)
class RequestOutput:
    """One step's news for one request; `result` is set on the last one."""

    text: str
    token_ids: list[int]
    result: GenerationResult | None = None
    error: str | None = None
    anomaly: AnomalyVerdict | None = None  # with the result: acceptance vs the baseline
    logprobs: list[TokenLogprob] | None = None  # one per token id, when asked for
    prompt_logprobs: list[TokenLogprob | None] | None = None  # first output, when asked for
    index: int = 0  # which choice of an n > 1 request


class EngineClient(Protocol):
    """What the HTTP layer needs from an engine."""

    model_name: str
    max_model_len: int
    tokenizer: Tokenizer
    metrics: ServerMetrics
    method: str
    num_speculative_tokens: int | str

    def check_prompt(self, prompt_ids: Sequence[int]) -> list[int]: ...

    def generate(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        arrival: float,
        prompt_logprobs: int | None = None,
        n: int = 1,
    ) -> AsyncIterator[RequestOutput]: ...


@dataclass
class _Request:
    id: int
    prompt: list[int]
    params: SamplingParams
    arrival: float
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput]
    prompt_logprobs: int | None = None  # score the prompt first, with this many alternatives
    n: int = 1  # choices, decoded as n sequences that share the prompt's prefill
    seqs: list[SequenceState] = field(default_factory=list)
    finished: int = 0  # choices done
    cancelled: bool = False
    last_emit: float = 0.0
    first_token: bool = field(default=True)

    def send(self, out: RequestOutput) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, out)


class AsyncEngine:
    """Continuous batching behind an async interface.

    max_num_seqs sequences run at once; more requests wait in arrival order. A request
    whose consumer stops iterating (the client went away) is cancelled at the next step.
    """

    def __init__(
        self,
        engine: Engine,
        *,
        model_name: str,
        max_num_seqs: int = 8,
        draft_name: str | None = None,
        anomaly_z: float = -3.0,
    ) -> None:
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs={max_num_seqs} is out of range: use >= 1")
        tokenizer = engine.target.tokenizer
        if tokenizer is None:
            raise ValueError(f"model {model_name!r} has no tokenizer: the server needs one")
        self.engine = engine
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len = engine.max_seq_len
        self.max_num_seqs = max_num_seqs
        self.method = engine.method
        self.num_speculative_tokens = engine.num_speculative_tokens
        self.metrics = ServerMetrics(model_name, draft_name, engine.method)
        self.baseline = AcceptanceBaseline(threshold=anomaly_z)
        self._sched = engine.scheduler()
        self._waiting: deque[_Request] = deque()
        self._active: dict[int, _Request] = {}
        self._cv = threading.Condition()
        self._ids = itertools.count()
        self._stop = False
        self._thread: threading.Thread | None = None
        self.peak_running = 0  # most sequences decoded together so far

    # -- lifecycle ----------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is None:
            self._stop = False
            self._thread = threading.Thread(target=self._loop, name="speculant-engine", daemon=True)
            self._thread.start()

    def shutdown(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None

    # -- the client side (event loop) ---------------------------------------------------

    def check_prompt(self, prompt_ids: Sequence[int]) -> list[int]:
        return check_prompt(prompt_ids, self.engine.target.vocab_size, self.max_model_len)

    async def generate(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        arrival: float,
        prompt_logprobs: int | None = None,
        n: int = 1,
    ) -> AsyncIterator[RequestOutput]:
        """The request's outputs as they are committed; with prompt_logprobs, the first
        carries the prompt's scores (see speculant.scoring) and no tokens. With n > 1,
        outputs of the n choices interleave (`index`); choice i samples with seed + i
        when a seed is set, so it is exactly the single request with that seed."""
        req = _Request(
            next(self._ids),
            prompt_ids,
            params,
            arrival,
            asyncio.get_running_loop(),
            asyncio.Queue(),
            prompt_logprobs,
            n,
        )
        with self._cv:
            self._waiting.append(req)
            self.metrics.waiting.set(len(self._waiting))
            self._cv.notify_all()
        finished = False
        results = 0
        try:
            while True:
                out = await req.queue.get()
                results += out.result is not None
                if results == n or out.error is not None:
                    finished = True
                yield out
                if finished:
                    return
        finally:
            if not finished:
                with self._cv:
                    req.cancelled = True
                    self._cv.notify_all()

    # -- the engine thread --------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._stop and not self._waiting and not self._active:
                    self._cv.wait()
                if self._stop:
                    break
                cancelled = [r for r in self._active.values() if r.cancelled]
                admit: list[_Request] = []
                running = sum(r.n - r.finished for r in self._active.values())
                while self._waiting and (
                    running + self._waiting[0].n <= self.max_num_seqs
                    or not (self._active or admit)  # n > max_num_seqs: runs alone
                ):
                    req = self._waiting.popleft()
                    if not req.cancelled:
                        admit.append(req)
                        running += req.n
                self.metrics.waiting.set(len(self._waiting))
            for req in cancelled:
                self._cancel(req)
            for req in admit:
                self._admit(req)
            self.metrics.running.set(len(self._active))
            self.peak_running = max(self.peak_running, len(self._active))
            if not self._active:
                continue
            try:
                events = self._sched.step()
            except Exception as exc:  # a failing step must not kill the server
                log.exception("engine step failed")
                for req in list(self._active.values()):
                    for seq in req.seqs:
                        self._sched.cancel(seq)
                    self._active.pop(req.id, None)
                    req.send(RequestOutput("", [], error=f"{type(exc).__name__}: {exc}"))
                continue
            now = time.perf_counter()
            for event in events:
                rid, index = event.seq.request_id  # (request, choice)
                owner = self._active.get(rid)
                if owner is None:
                    continue
                self._account(owner, event.chunk.token_ids, event.drafted, event.accepted, now)
                verdict = None
                if event.result is not None:
                    verdict = self._judge(owner, event.result)
                chunk = event.chunk
                owner.send(
                    RequestOutput(
                        chunk.text,
                        chunk.token_ids,
                        event.result,
                        None,
                        verdict,
                        chunk.logprobs,
                        index=index,
                    )
                )
                if event.result is not None:
                    self.metrics.requests.labels(finished_reason=event.result.finish_reason).inc()
                    owner.finished += 1
                    if owner.finished == owner.n:
                        self._active.pop(owner.id, None)
                        self.metrics.e2e.observe(now - owner.arrival)
            self.metrics.running.set(len(self._active))
        # Shutting down: tell whoever still waits.
        for req in [*self._active.values(), *self._waiting]:
            req.send(RequestOutput("", [], error="the server is shutting down"))

    def _admit(self, req: _Request) -> None:
        try:
            if req.prompt_logprobs is not None:
                scores = prompt_logprobs(
                    self.engine.target, req.prompt, req.params, req.prompt_logprobs
                )
                req.send(RequestOutput("", [], prompt_logprobs=scores))
            for i in range(req.n):
                params = req.params
                if i and params.seed is not None:
                    params = dataclasses.replace(params, seed=params.seed + i)
                first = req.seqs[0] if req.seqs else None
                seq = self._sched.add((req.id, i), req.prompt, params, share_prefill_with=first)
                req.seqs.append(seq)
        except Exception as exc:
            log.exception("could not start request %s", req.id)
            for seq in req.seqs:
                self._sched.cancel(seq)
            req.send(RequestOutput("", [], error=f"{type(exc).__name__}: {exc}"))
            return
        req.last_emit = time.perf_counter()
        self._active[req.id] = req
        self.metrics.prompt_tokens.inc(len(req.prompt))

    def _judge(self, req: _Request, result: GenerationResult) -> AnomalyVerdict:
        s = result.stats
        verdict = self.baseline.judge(s.num_drafted, s.num_accepted)
        if verdict.flagged:
            self.metrics.anomalies.inc()
            log.warning(
                "request %s flagged: acceptance %.0f%% against a baseline of %.0f%% (z = %.1f); "
                "inputs the draft predicts this badly are often out of distribution "
                "(prompt injection, jailbreak attempts)",
                req.id,
                100 * (verdict.acceptance_rate or 0.0),
                100 * (verdict.baseline_acceptance or 0.0),
                verdict.zscore,
            )
        return verdict

    def _cancel(self, req: _Request) -> None:
        self._active.pop(req.id, None)
        for seq in req.seqs:
            if seq.finish is None:
                self._sched.cancel(seq)
                self.metrics.requests.labels(finished_reason="cancelled").inc()

    def _account(
        self, req: _Request, tokens: list[int], drafted: int, accepted: int, now: float
    ) -> None:
        m = self.metrics
        m.record_step(drafted, accepted)
        if not tokens:
            return
        m.generation_tokens.inc(len(tokens))
        if req.first_token:
            m.ttft.observe(now - req.arrival)
            req.first_token = False
        else:
            m.itl.observe((now - req.last_emit) / len(tokens))
        req.last_emit = now
