"""The OpenAI-compatible HTTP app: /v1/models, /v1/completions, /v1/chat/completions
(plain JSON or SSE streaming), /health and /metrics, on any `EngineClient`."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from speculant.anomaly import AnomalyVerdict
from speculant.cadence import Ticker, TokenSplitter, wait_for_slot
from speculant.models.chat_template import ChatTemplateError
from speculant.requests import (
    GenerationResult,
    GenerationStats,
    RequestError,
    StreamChunk,
    check_token_ids,
)
from speculant.sampling import TokenLogprob
from speculant.server.async_engine import (
    ABORT,
    EngineClient,
    EngineDraining,
    QueueFull,
    RequestOutput,
)
from speculant.server.limits import MAX_BODY_BYTES, BodyLimits
from speculant.server.schema import (
    APIError,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ErrorResponse,
    ParsedRequest,
    parse_chat,
    parse_completion,
    sampling_params,
    validation_error,
)

log = logging.getLogger("speculant.server")
PROMETHEUS_TYPE = "text/plain; version=0.0.4; charset=utf-8"


ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse, "description": what}
    for code, what in [
        (400, "a bad parameter (named in error.param)"),
        (401, "missing or wrong API key"),
        (404, "the model is not served here"),
        (413, "the body is too large"),
        (429, "too many requests wait already (see the Retry-After header)"),
        (500, "generation failed"),
        (503, "the server is shutting down"),
    ]
}
STREAMED = {"text/event-stream": {"schema": {"type": "string"}}}


def create_app(
    engine: EngineClient,
    api_key: str | None = None,
    stream_cadence_s: float | None = None,
    max_body_bytes: int = MAX_BODY_BYTES,
) -> FastAPI:
    """The app; `engine.start()` / `engine.shutdown()` run with its lifespan when present.

    stream_cadence_s: emit streamed tokens one per event at this fixed cadence (see
    speculant.cadence: hides which tokens were accepted together).
    max_body_bytes: larger request bodies get a 413."""
    if stream_cadence_s is not None and not stream_cadence_s > 0:
        raise ValueError(f"stream cadence {stream_cadence_s} s is out of range: use > 0")

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        start = getattr(engine, "start", None)
        if start is not None:
            start()
        try:
            yield
        finally:
            stop = getattr(engine, "shutdown", None)
            if stop is not None:
                stop()

    app = FastAPI(title="speculant", lifespan=lifespan)
    metrics = engine.metrics
    app.add_middleware(
        BodyLimits,
        max_bytes=max_body_bytes,
        on_refuse=lambda status: metrics.errors.labels(status=str(status)).inc(),
    )

    app.add_middleware(_Gate, engine=engine, api_key=api_key)

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        metrics.errors.labels(status=str(exc.status)).inc()
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return await api_error(request, validation_error(exc.errors(), exc.body))

    @app.get("/health", responses={503: {"description": "draining: shutting down"}})
    async def health() -> JSONResponse:
        if _draining(engine):
            return JSONResponse({"status": "draining"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.exposition(), media_type=PROMETHEUS_TYPE)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": engine.model_name,
                    "object": "model",
                    "created": 0,
                    "owned_by": "speculant",
                    "max_model_len": engine.max_model_len,
                }
            ],
        }

    @app.post(
        "/v1/completions",
        response_model=CompletionResponse,
        responses={200: {"content": STREAMED}, **ERRORS},
    )
    async def completions(body: CompletionRequest, request: Request) -> Response:
        """Complete a prompt (text or token ids); SSE events when stream is true."""
        return await _serve(engine, request, parse_completion(body), False, stream_cadence_s)

    @app.post(
        "/v1/chat/completions",
        response_model=ChatCompletionResponse,
        responses={200: {"content": STREAMED}, **ERRORS},
    )
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        """Answer a conversation through the model's chat template; SSE when stream is true."""
        return await _serve(engine, request, parse_chat(body), True, stream_cadence_s)

    return app


def _draining_error() -> APIError:
    return APIError(
        "the server is shutting down and accepts no new requests: retry on another replica",
        status=503,
        type="server_error",
        code="server_draining",
    )


def _draining(engine: EngineClient) -> bool:
    return bool(getattr(engine, "draining", False))


async def _serve(
    engine: EngineClient, request: Request, req: ParsedRequest, chat: bool, cadence_s: float | None
) -> Response:
    arrival = time.perf_counter()
    if req.model is not None and req.model != engine.model_name:
        raise APIError(
            f"model {req.model!r} is not served here: use {engine.model_name!r}",
            status=404,
            param="model",
            code="model_not_found",
        )
    prompt_ids = _tokenize(engine, req)
    try:
        prompt_ids = engine.check_prompt(prompt_ids)
    except RequestError as exc:
        if len(prompt_ids) >= engine.max_model_len:
            sampling_params(req, len(prompt_ids), engine.max_model_len)  # the OpenAI error
        raise APIError(str(exc), param="prompt") from None
    params = sampling_params(req, len(prompt_ids), engine.max_model_len)
    for name, ids in (
        ("logit_bias", [t for t, _ in req.logit_bias]),
        ("stop_token_ids", list(req.stop_token_ids)),
    ):
        try:
            check_token_ids(ids, engine.vocab_size)
        except RequestError as exc:
            raise APIError(f"{name}: {exc}", param=name, code="invalid_value") from None
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
    scored = req.logprobs if req.echo else None
    echo = _echo_text(engine, req, prompt_ids) if req.echo else ""
    reply = _Reply(engine, req, rid, chat, prompt_ids, echo)
    try:  # submitted here, refused here: nothing is queued for a refused request
        outputs = engine.generate(prompt_ids, params, arrival, prompt_logprobs=scored, n=req.n)
    except QueueFull as exc:
        raise APIError(
            str(exc),
            status=429,
            type="rate_limit_error",
            code="queue_full",
            headers={"Retry-After": str(exc.retry_after)},
        ) from None
    except EngineDraining:
        raise _draining_error() from None
    if req.stream:
        return StreamingResponse(
            _sse(reply, outputs, cadence_s),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    return await _whole(reply, request, outputs)


def _echo_text(engine: EngineClient, req: ParsedRequest, prompt_ids: list[int]) -> str:
    if req.prompt_text is not None:
        return req.prompt_text
    return engine.tokenizer.decode(prompt_ids, skip_special_tokens=False)


def _tokenize(engine: EngineClient, req: ParsedRequest) -> list[int]:
    tok = engine.tokenizer
    if req.messages is not None:
        if not tok.chat_template:
            raise APIError(
                f"model {engine.model_name!r} has no chat template: use /v1/completions",
                param="messages",
            )
        try:
            text = tok.apply_chat_template(req.messages)
        except ChatTemplateError as exc:  # the template refuses these messages, or runs away
            raise APIError(str(exc), param="messages", code="chat_template_error") from None
        return tok.encode(text, add_special_tokens=False)
    if req.prompt_ids is not None:
        return req.prompt_ids
    assert req.prompt_text is not None
    return tok.encode(req.prompt_text)


def _usage(
    engine: EngineClient,
    prompt_len: int,
    results: Sequence[GenerationResult],
    anomaly: AnomalyVerdict | None = None,
) -> dict[str, Any]:
    """Token counts and speculation figures, summed over the choices."""
    s = GenerationStats.total([r.stats for r in results])
    n = s.num_generated
    return {
        "prompt_tokens": prompt_len,
        "completion_tokens": n,
        "total_tokens": prompt_len + n,
        "speculation": {
            "method": engine.method,
            "num_speculative_tokens": engine.num_speculative_tokens,
            "drafted_tokens": s.num_drafted,
            "accepted_tokens": s.num_accepted,
            "acceptance_rate": s.acceptance_rate if s.num_drafted else None,
            "mean_accepted_length": s.mean_accepted_length,
            "target_forwards": s.target_forwards,
            "accepted_per_position": list(s.accepted_per_position),
            **(anomaly.to_dict() if anomaly is not None else {}),
        },
    }


def _finish(result: GenerationResult) -> str:
    """OpenAI's finish_reason; "abort" (vLLM's) when the server ended the request."""
    if result.finish_reason in ("length", ABORT):
        return result.finish_reason
    return "stop"


LOGPROB_FLOOR = -9999.0  # a token top-k / top-p dropped has -inf, which JSON cannot carry


class _Reply:
    """What the answer to one request is built from: its ids, the echoed prompt, and
    the token texts and bytes its logprobs name."""

    def __init__(
        self,
        engine: EngineClient,
        req: ParsedRequest,
        rid: str,
        chat: bool,
        prompt_ids: list[int],
        echo: str,
    ) -> None:
        self.engine = engine
        self.req = req
        self.rid = rid
        self.chat = chat
        self.prompt_ids = prompt_ids
        self.echo = echo
        self.offsets: dict[int, int] = {}  # per choice: text_offset of its next token
        self._texts: dict[int, str] = {}

    def token_text(self, token: int) -> str:
        text = self._texts.get(token)
        if text is None:
            text = self.engine.tokenizer.decode([token], skip_special_tokens=False)
            self._texts[token] = text
        return text

    def choice(
        self,
        text: str,
        finish: str | None,
        delta: bool,
        first: bool,
        logprobs: Any = None,
        index: int = 0,
    ) -> dict[str, Any]:
        head: dict[str, Any] = {"index": index}
        if not self.chat:
            return {**head, "text": text, "logprobs": logprobs, "finish_reason": finish}
        if delta:
            body: dict[str, Any] = {"content": text} if text or not first else {}
            if first:
                body = {"role": "assistant", "content": text}
            return {**head, "delta": body, "logprobs": logprobs, "finish_reason": finish}
        message = {"role": "assistant", "content": text}
        return {**head, "message": message, "logprobs": logprobs, "finish_reason": finish}

    def logprobs(
        self, entries: Sequence[TokenLogprob | None], prompt: bool = False, index: int = 0
    ) -> Any:
        """The OpenAI logprobs object of these tokens (completions' parallel lists, or
        chat's content list); None when the request did not ask for logprobs."""
        if self.req.logprobs is None:
            return None
        if self.chat:
            return {"content": [self._chat_entry(e) for e in entries if e is not None]}
        ids = self.prompt_ids if prompt else [e.token for e in entries if e is not None]
        tokens, offsets = [], []
        offset = 0 if prompt else self.offsets.get(index, 0)
        for token in ids:
            tokens.append(self.token_text(token))
            offsets.append(offset)
            offset += len(tokens[-1])
        # after the echoed prompt, the completion's text starts where the prompt's ends
        self.offsets[index] = len(self.echo) if prompt else offset
        return {
            "tokens": tokens,
            "token_logprobs": [None if e is None else _floor(e.logprob) for e in entries],
            "top_logprobs": [
                None if e is None else {self.token_text(t): _floor(v) for t, v in e.top}
                for e in entries
            ],
            "text_offset": offsets,
        }

    def _chat_entry(self, e: TokenLogprob) -> dict[str, Any]:
        def one(token: int, value: float) -> dict[str, Any]:
            text = self.token_text(token)
            return {"token": text, "logprob": _floor(value), "bytes": list(text.encode())}

        return {**one(e.token, e.logprob), "top_logprobs": [one(t, v) for t, v in e.top]}


class _Gate:
    """ASGI middleware in front of /v1: refuses while draining (503) and without the
    API key (401). Pure ASGI, not `@app.middleware("http")`: that wrapper hides a
    client's hang-up from the endpoint, so a non-streaming request whose client left
    ran to its last token."""

    def __init__(self, app: Any, engine: Any, api_key: str | None) -> None:
        self.app = app
        self.engine = engine
        self.api_key = api_key

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not str(scope.get("path", "")).startswith("/v1"):
            await self.app(scope, receive, send)
            return
        metrics = self.engine.metrics
        refusal: tuple[int, dict[str, Any]] | None = None
        if _draining(self.engine):
            refusal = (503, _draining_error().body())
        elif self.api_key:
            given = dict(scope.get("headers") or []).get(b"authorization", b"").decode("latin-1")
            scheme, _, token = given.partition(" ")
            ok = scheme.lower() == "bearer" and hmac.compare_digest(
                token.strip().encode(), self.api_key.encode()
            )
            if not ok:
                err = APIError(
                    "missing or invalid API key: send 'Authorization: Bearer <key>'",
                    status=401,
                    code="invalid_api_key",
                    type="authentication_error",
                )
                refusal = (401, err.body())
        if refusal is None:
            await self.app(scope, receive, send)
            return
        status, body = refusal
        metrics.errors.labels(status=str(status)).inc()
        await JSONResponse(body, status_code=status)(scope, receive, send)


def _floor(value: float) -> float:
    return value if value >= LOGPROB_FLOOR else LOGPROB_FLOOR  # -inf (and NaN) -> the floor


def _error_of(out: RequestOutput) -> APIError:
    return APIError(
        f"generation failed: {out.error}", status=500, type="server_error", code="engine_error"
    )


async def _whole(
    reply: _Reply, request: Request, outputs: AsyncIterator[RequestOutput]
) -> Response:
    prompt_scores: list[TokenLogprob | None] = []
    results: dict[int, RequestOutput] = {}

    async def collect() -> RequestOutput | None:
        async for out in outputs:
            if out.error is not None:
                return out
            if out.prompt_logprobs is not None:
                prompt_scores.extend(out.prompt_logprobs)
            if out.result is not None:
                results[out.index] = out
        return None

    task = asyncio.ensure_future(collect())
    # A client that disconnects cancels its sequences instead of using the batch for nothing.
    while not task.done():
        done, _ = await asyncio.wait({task}, timeout=0.25)
        if not done and await request.is_disconnected():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await outputs.aclose()  # type: ignore[attr-defined]
            return Response(status_code=499)
    failed = task.result()
    if failed is not None or len(results) != reply.req.n:
        raise _error_of(failed or RequestOutput("", [], error="the request ended early"))
    req, engine = reply.req, reply.engine
    choices = []
    finals: list[GenerationResult] = []
    for index in range(req.n):
        result = results[index].result
        assert result is not None
        finals.append(result)
        if req.echo and req.logprobs is not None:
            logprobs = reply.logprobs(prompt_scores, True, index)
            more = reply.logprobs(result.logprobs or [], False, index)
            logprobs = {key: logprobs[key] + more[key] for key in logprobs}
        else:
            logprobs = reply.logprobs(result.logprobs or [], False, index)
        text = reply.echo + result.text
        choices.append(reply.choice(text, _finish(result), False, False, logprobs, index))
    return JSONResponse(
        {
            "id": reply.rid,
            "object": "chat.completion" if reply.chat else "text_completion",
            "created": int(time.time()),
            "model": engine.model_name,
            "choices": choices,
            "usage": _usage(engine, len(reply.prompt_ids), finals, results[0].anomaly),
        }
    )


async def _sse(
    reply: _Reply, outputs: AsyncIterator[RequestOutput], cadence_s: float | None
) -> AsyncIterator[bytes]:
    engine, req, chat = reply.engine, reply.req, reply.chat
    created = int(time.time())
    kind = "chat.completion.chunk" if chat else "text_completion"
    ticker = Ticker(cadence_s) if cadence_s else None
    tok = engine.tokenizer
    splitters = [
        TokenSplitter(lambda ids: tok.decode(ids, skip_special_tokens=True)) for _ in range(req.n)
    ]

    def event(choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> bytes:
        body: dict[str, Any] = {
            "id": reply.rid,
            "object": kind,
            "created": created,
            "model": engine.model_name,
            "choices": choices,
        }
        if req.include_usage:
            body["usage"] = usage
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n".encode()

    first = [not chat] * req.n  # chat's first event per choice carries the role
    finals: list[GenerationResult] = []
    try:
        for i in range(req.n):
            if chat:
                yield event([reply.choice("", None, True, True, index=i)])
            elif req.echo and req.logprobs is None:
                yield event([reply.choice(reply.echo, None, True, True, index=i)])
        async for out in outputs:
            if out.error is not None:
                yield f"data: {json.dumps(_error_of(out).body())}\n\n".encode()
                break
            if out.prompt_logprobs is not None:  # echo with logprobs: the scored prompt
                for i in range(req.n):
                    lps = reply.logprobs(out.prompt_logprobs, True, i)
                    yield event([reply.choice(reply.echo, None, True, False, lps, i)])
                continue
            i = out.index
            result = out.result
            finish = _finish(result) if result is not None else None
            scores = out.logprobs or []
            if ticker is not None:
                # One event per token, each at its slot: timing says nothing of acceptance.
                pieces = splitters[i].split(StreamChunk(out.token_ids, out.text))
                for j, piece in enumerate(pieces):
                    await wait_for_slot(ticker)
                    last = finish if j == len(pieces) - 1 else None
                    lps = reply.logprobs(scores[j : j + 1], False, i) if j < len(scores) else None
                    yield event([reply.choice(piece, last, True, first[i], lps, i)])
                    first[i] = False
            elif out.text or scores or finish is not None:
                lps = reply.logprobs(scores, False, i) if scores else None
                yield event([reply.choice(out.text, finish, True, first[i], lps, i)])
                first[i] = False
            if result is not None:
                finals.append(result)
                if req.include_usage and len(finals) == req.n:
                    yield event([], _usage(engine, len(reply.prompt_ids), finals, out.anomaly))
        yield b"data: [DONE]\n\n"
    finally:
        await outputs.aclose()  # type: ignore[attr-defined]
