"""The engine as the server sees it: requests submitted from the event loop, decoded
together by one engine thread that owns the scheduler (continuous batching), and their
chunks handed back to the loop as they are committed.

Under load it pushes back: at most `max_waiting` requests wait for a slot (a request
beyond that is refused at submission with `QueueFull`), a request older than
`request_timeout` is ended with finish_reason "abort", and `drain()` stops admitting
(`EngineDraining`), lets what runs and waits finish, and aborts the rest at its deadline.

The server depends only on `EngineClient` (below); `AsyncEngine` is the real one, and
tests may give the app anything with the same members.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import math
import threading
import time
import weakref
from collections import deque
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from speculant.anomaly import AcceptanceBaseline, AnomalyVerdict
from speculant.engine import Engine
from speculant.models.tokenizer import Tokenizer
from speculant.prefix_cache import PrefixCache
from speculant.requests import GenerationResult, GenerationStats, check_prompt
from speculant.sampling import SamplingParams, TokenLogprob
from speculant.scheduler import SequenceState
from speculant.scoring import prompt_logprobs
from speculant.server.metrics import ServerMetrics

log = logging.getLogger("speculant.server")

ABORT = "abort"  # the finish_reason of a request the server ended (timeout, drain)


class QueueFull(Exception):
    """Refused at submission: `limit` requests already wait for a slot."""

    def __init__(self, waiting: int, limit: int, retry_after: int) -> None:
        super().__init__(
            f"too many requests: {waiting} already wait for a slot and at most {limit} may "
            f"wait (--max-waiting); retry after {retry_after} s"
        )
        self.waiting = waiting
        self.limit = limit
        self.retry_after = retry_after


class EngineDraining(Exception):
    """Refused at submission: the server is shutting down and admits nothing new."""

    def __init__(self) -> None:
        super().__init__("the server is shutting down and accepts no new requests")


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
    vocab_size: int
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
    admitted: float = 0.0  # when its sequences joined the batch
    sent: dict[int, int] = field(default_factory=dict)  # per choice: text characters sent
    done: bool = False  # its last output is sent (or it was cancelled): no longer counted

    def send(self, out: RequestOutput) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, out)


class AsyncEngine:
    """Continuous batching behind an async interface.

    max_num_seqs sequences run at once; more requests wait in arrival order, at most
    max_waiting of them (None: no bound; 0: a request runs at once or is refused). A
    request whose consumer stops iterating (the client went away) is cancelled at the next
    step; one older than request_timeout seconds (since arrival) is ended with
    finish_reason "abort" and the text it has. max_num_batched_tokens: prompts are
    prefilled in chunks within the steps' passes (None: whole, when they join);
    prefix_cache_bytes: memory for cached prefixes (0: no prefix caching).
    """

    def __init__(
        self,
        engine: Engine,
        *,
        model_name: str,
        max_num_seqs: int = 8,
        draft_name: str | None = None,
        anomaly_z: float = -3.0,
        max_waiting: int | None = 64,
        request_timeout: float | None = None,
        max_num_batched_tokens: int | None = None,
        prefix_cache_bytes: int = 0,
    ) -> None:
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs={max_num_seqs} is out of range: use >= 1")
        if max_waiting is not None and max_waiting < 0:
            raise ValueError(f"max_waiting={max_waiting} is out of range: use >= 0 (or None)")
        if request_timeout is not None and not request_timeout > 0:
            raise ValueError(
                f"request_timeout={request_timeout} is out of range: use > 0 seconds (or None)"
            )
        tokenizer = engine.target.tokenizer
        if tokenizer is None:
            raise ValueError(f"model {model_name!r} has no tokenizer: the server needs one")
        self.engine = engine
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len = engine.max_seq_len
        self.vocab_size = engine.target.vocab_size
        self.max_num_seqs = max_num_seqs
        self.max_waiting = max_waiting
        self.request_timeout = request_timeout
        self.method = engine.method
        self.num_speculative_tokens = engine.num_speculative_tokens
        self.metrics = ServerMetrics(model_name, draft_name, engine.method)
        self.baseline = AcceptanceBaseline(threshold=anomaly_z)
        self.prefix_cache = PrefixCache(prefix_cache_bytes) if prefix_cache_bytes else None
        self._sched = engine.scheduler(max_num_batched_tokens, self.prefix_cache)
        self._prefix_seen = (0, 0)  # (queries, hits) already counted in the metrics
        self._waiting: deque[_Request] = deque()
        self._active: dict[int, _Request] = {}
        self._cv = threading.Condition()
        self._ids = itertools.count()
        self._stop = False
        self._thread: threading.Thread | None = None
        self.peak_running = 0  # most sequences decoded together so far
        self._occupied = 0  # sequences of admitted, unfinished requests (under _cv)
        self._unfinished = 0  # requests submitted whose last output is not sent (under _cv)
        self._abort_all = False  # end every request now (the drain's deadline passed)
        self.draining = False  # set once: new requests are refused with EngineDraining
        self._durations: deque[float] = deque(maxlen=32)  # recent admission-to-finish times

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
        return check_prompt(prompt_ids, self.vocab_size, self.max_model_len)

    def generate(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        arrival: float,
        prompt_logprobs: int | None = None,
        n: int = 1,
    ) -> AsyncIterator[RequestOutput]:
        """Submit a request and return its outputs as they are committed; with
        prompt_logprobs, the first carries the prompt's scores (see speculant.scoring) and
        no tokens. With n > 1, outputs of the n choices interleave (`index`); choice i
        samples with seed + i when a seed is set, so it is exactly the single request with
        that seed.

        Raises at once, queueing nothing: `EngineDraining` while draining, `QueueFull`
        when the request would have to wait and max_waiting requests already do."""
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
            if self.draining:
                raise EngineDraining()
            if self.max_waiting is not None:
                waiting = self._must_wait([*self._waiting, req])
                if waiting > self.max_waiting:
                    raise QueueFull(waiting - 1, self.max_waiting, self._retry_after())
            self._waiting.append(req)
            self._unfinished += 1
            self.metrics.waiting.set(len(self._waiting))
            self._cv.notify_all()
        outputs = self._outputs(req)
        # Never iterated (the client left before its response started): cancel it when the
        # iterator is collected, as its `finally` does not run then.
        weakref.finalize(outputs, setattr, req, "cancelled", True)
        return outputs

    async def _outputs(self, req: _Request) -> AsyncIterator[RequestOutput]:
        finished = False
        results = 0
        try:
            while True:
                out = await req.queue.get()
                results += out.result is not None
                if results == req.n or out.error is not None:
                    finished = True
                yield out
                if finished:
                    return
        finally:
            if not finished:
                with self._cv:
                    req.cancelled = True
                    self._cv.notify_all()

    def _must_wait(self, queue: Sequence[_Request]) -> int:
        """How many of these queued requests find no slot now (under _cv): the engine
        admits in order while the batch has room, and a request wider than the batch
        alone when nothing runs."""
        running = self._occupied
        waiting = 0
        for req in queue:
            if req.cancelled:
                continue
            if not waiting and self._fits(running, req.n):
                running += req.n
            else:
                waiting += 1
        return waiting

    def _fits(self, running: int, n: int) -> bool:
        """Whether n more sequences join a batch of `running` now: while there is room,
        and a request wider than the batch when nothing runs (alone)."""
        return running + n <= self.max_num_seqs or running == 0

    def _retry_after(self) -> int:
        """Seconds until a waiting place likely frees: a slot frees every mean service
        time / max_num_seqs (recent requests, admission to finish), at least 1."""
        if not self._durations:
            return 1
        mean = sum(self._durations) / len(self._durations)
        return max(1, math.ceil(mean / self.max_num_seqs))

    # -- draining -----------------------------------------------------------------------

    def begin_drain(self) -> None:
        """Admit nothing new from now on (no lock: safe from a signal handler)."""
        self.draining = True

    @property
    def idle(self) -> bool:
        """Every submitted request has had its last output (or was cancelled)."""
        return self._unfinished == 0

    def abort_all(self) -> None:
        """End every running and waiting request now, with finish_reason "abort"."""
        with self._cv:
            self._abort_all = True
            self._cv.notify_all()

    async def drain(self, timeout: float, grace: float = 30.0) -> bool:
        """Stop admitting, let running and waiting requests finish for up to `timeout`
        seconds, then end the rest with finish_reason "abort" (their clients get the text
        so far; `abort_all()` ends them sooner). Returns whether everything finished by
        itself, once the engine has sent every request its last output (or after `grace`
        more seconds if a step hangs)."""
        self.begin_drain()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max(0.0, timeout)
        while not self.idle and not self._abort_all and loop.time() < deadline:
            await asyncio.sleep(0.02)
        if self.idle and not self._abort_all:
            return True
        if not self._abort_all:
            log.warning(
                "drain timeout (%g s) passed: ending %d request(s) with finish_reason abort",
                timeout,
                self._unfinished,
            )
            self.abort_all()
        deadline = loop.time() + grace
        while not self.idle and loop.time() < deadline:
            await asyncio.sleep(0.02)
        return False

    # -- the engine thread --------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._stop and not self._waiting and not self._active:
                    self._cv.wait()
                if self._stop:
                    break
                cancelled = [r for r in self._active.values() if r.cancelled]
                ended = self._overdue()  # (request, why): timeout or abort
                admit: list[_Request] = []
                running = sum(r.n - r.finished for r in self._active.values())
                while self._waiting and self._fits(running, self._waiting[0].n):
                    req = self._waiting.popleft()
                    if not req.cancelled:
                        admit.append(req)
                        running += req.n
                    else:
                        self._retire(req)
                self._occupied = running
                self.metrics.waiting.set(len(self._waiting))
            for req in cancelled:
                self._cancel(req)
            for req, why in ended:
                self._abort(req, why)
            for req in admit:
                self._admit(req)
            self.metrics.running.set(len(self._active))
            self.peak_running = max(self.peak_running, len(self._active))
            if not self._active:
                self._settle()
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
                    self._retire(req)
                self._settle()
                continue
            now = time.perf_counter()
            durations = []
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
                owner.sent[index] = owner.sent.get(index, 0) + len(chunk.text)
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
                        durations.append(now - owner.admitted)
                        self._retire(owner)
            self._settle(durations)
            self.metrics.running.set(len(self._active))
            self._count_prefix_cache()
        # Shutting down: tell whoever still waits.
        for req in [*self._active.values(), *self._waiting]:
            req.send(RequestOutput("", [], error="the server is shutting down"))
        with self._cv:
            self._unfinished = 0

    def _overdue(self) -> list[tuple[_Request, str]]:
        """Requests to end now (under _cv): all of them once the drain's deadline passed,
        else those older than request_timeout; waiting ones leave the queue."""
        if self._abort_all:
            why = ABORT
            chosen = [*self._active.values(), *self._waiting]
        elif self.request_timeout is not None:
            why = "timeout"
            oldest = time.perf_counter() - self.request_timeout
            chosen = [r for r in [*self._active.values(), *self._waiting] if r.arrival < oldest]
        else:
            return []
        chosen = [r for r in chosen if not r.cancelled]
        if chosen:
            gone = {r.id for r in chosen}
            self._waiting = deque(r for r in self._waiting if r.id not in gone)
        return [(r, why) for r in chosen]

    def _retire(self, req: _Request) -> None:
        """The request has had its last output (or was cancelled): it no longer counts."""
        with self._cv:
            if not req.done:
                req.done = True
                self._unfinished -= 1

    def _count_prefix_cache(self) -> None:
        cache = self.prefix_cache
        if cache is None:
            return
        queries, hits = self._prefix_seen
        self.metrics.prefix_queries.inc(cache.queries - queries)
        self.metrics.prefix_hits.inc(cache.hits - hits)
        self.metrics.prefix_blocks.set(cache.blocks)
        self._prefix_seen = (cache.queries, cache.hits)

    def _settle(self, durations: Sequence[float] = ()) -> None:
        with self._cv:
            self._occupied = sum(r.n - r.finished for r in self._active.values())
            self._durations.extend(durations)

    def _abort(self, req: _Request, why: str) -> None:
        """End a request now: each unfinished choice gets the text it has not streamed
        yet and a result with finish_reason "abort" (why: the metrics label)."""
        self._active.pop(req.id, None)
        started = {seq.request_id[1]: seq for seq in req.seqs}
        for i in range(req.n):
            seq = started.get(i)
            if seq is None:  # still waiting: nothing generated
                stats = GenerationStats(prompt_tokens=len(req.prompt))
                result = GenerationResult([], "", ABORT, stats)
            elif seq.finish is not None:  # this choice had finished: its result is sent
                continue
            else:
                result = dataclasses.replace(self._sched.cancel(seq), finish_reason=ABORT)
            rest = result.text[req.sent.get(i, 0) :]
            req.send(RequestOutput(rest, [], result, logprobs=None, index=i))
            self.metrics.requests.labels(finished_reason=why).inc()
        if why == "timeout":
            log.warning(
                "request %s ended: older than the request timeout (%s s)",
                req.id,
                self.request_timeout,
            )
        self._retire(req)

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
            self._retire(req)
            return
        req.last_emit = req.admitted = time.perf_counter()
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
        self._retire(req)

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
