"""The OpenAI-compatible HTTP app: /v1/models, /v1/completions, /v1/chat/completions
(plain JSON or SSE streaming), /health and /metrics, on any `EngineClient`."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from speculant.anomaly import AnomalyVerdict
from speculant.cadence import Ticker, TokenSplitter, wait_for_slot
from speculant.scheduler import GenerationResult, RequestError, StreamChunk
from speculant.server.async_engine import EngineClient, RequestOutput
from speculant.server.schema import APIError, ParsedRequest, parse_request, sampling_params

log = logging.getLogger("speculant.server")
PROMETHEUS_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def create_app(
    engine: EngineClient, api_key: str | None = None, stream_cadence_s: float | None = None
) -> FastAPI:
    """The app; `engine.start()` / `engine.shutdown()` run with its lifespan when present.

    stream_cadence_s: emit streamed tokens one per event at this fixed cadence (see
    speculant.cadence: hides which tokens were accepted together)."""
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

    @app.middleware("http")
    async def auth(
        request: Request, call_next: Callable[[Request], Awaitable[Response]]
    ) -> Response:
        if api_key and request.url.path.startswith("/v1"):
            given = request.headers.get("authorization", "")
            scheme, _, token = given.partition(" ")
            ok = scheme.lower() == "bearer" and hmac.compare_digest(
                token.strip().encode(), api_key.encode()
            )
            if not ok:
                metrics.errors.labels(status="401").inc()
                err = APIError(
                    "missing or invalid API key: send 'Authorization: Bearer <key>'",
                    status=401,
                    code="invalid_api_key",
                    type="authentication_error",
                )
                return JSONResponse(err.body(), status_code=401)
        return await call_next(request)

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        metrics.errors.labels(status=str(exc.status)).inc()
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

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

    @app.post("/v1/completions", response_model=None)
    async def completions(request: Request) -> Response:
        return await _serve(engine, request, False, stream_cadence_s)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(request: Request) -> Response:
        return await _serve(engine, request, True, stream_cadence_s)

    return app


async def _serve(
    engine: EngineClient, request: Request, chat: bool, cadence_s: float | None
) -> Response:
    arrival = time.perf_counter()
    raw = await request.body()
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise APIError(f"the request body is not valid JSON: {exc}", code="invalid_json") from None
    req = parse_request(body, chat=chat)
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
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
    outputs = engine.generate(prompt_ids, params, arrival)
    if req.stream:
        return StreamingResponse(
            _sse(engine, req, rid, chat, len(prompt_ids), outputs, cadence_s),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    return await _whole(engine, request, req, rid, chat, len(prompt_ids), outputs)


def _tokenize(engine: EngineClient, req: ParsedRequest) -> list[int]:
    tok = engine.tokenizer
    if req.messages is not None:
        if not tok.chat_template:
            raise APIError(
                f"model {engine.model_name!r} has no chat template: use /v1/completions",
                param="messages",
            )
        text = tok.apply_chat_template(req.messages)
        return tok.encode(text, add_special_tokens=False)
    if req.prompt_ids is not None:
        return req.prompt_ids
    assert req.prompt_text is not None
    return tok.encode(req.prompt_text)


def _usage(
    engine: EngineClient,
    prompt_len: int,
    result: GenerationResult,
    anomaly: AnomalyVerdict | None = None,
) -> dict[str, Any]:
    s = result.stats
    n = len(result.token_ids)
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
    return "length" if result.finish_reason == "length" else "stop"


def _choice(chat: bool, text: str, finish: str | None, delta: bool, first: bool) -> dict[str, Any]:
    if not chat:
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
    if delta:
        body: dict[str, Any] = {"content": text} if text or not first else {}
        if first:
            body = {"role": "assistant", "content": text}
        return {"index": 0, "delta": body, "logprobs": None, "finish_reason": finish}
    message = {"role": "assistant", "content": text}
    return {"index": 0, "message": message, "logprobs": None, "finish_reason": finish}


def _error_of(out: RequestOutput) -> APIError:
    return APIError(
        f"generation failed: {out.error}", status=500, type="server_error", code="engine_error"
    )


async def _whole(
    engine: EngineClient,
    request: Request,
    req: ParsedRequest,
    rid: str,
    chat: bool,
    prompt_len: int,
    outputs: AsyncIterator[RequestOutput],
) -> Response:
    async def collect() -> RequestOutput:
        last = RequestOutput("", [])
        async for out in outputs:
            last = out
        return last

    task = asyncio.ensure_future(collect())
    # A client that disconnects cancels its sequence instead of using the batch for nothing.
    while not task.done():
        done, _ = await asyncio.wait({task}, timeout=0.25)
        if not done and await request.is_disconnected():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await outputs.aclose()  # type: ignore[attr-defined]
            return Response(status_code=499)
    last = task.result()
    if last.error is not None or last.result is None:
        raise _error_of(last)
    result = last.result
    return JSONResponse(
        {
            "id": rid,
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": engine.model_name,
            "choices": [_choice(chat, result.text, _finish(result), delta=False, first=False)],
            "usage": _usage(engine, prompt_len, result, last.anomaly),
        }
    )


async def _sse(
    engine: EngineClient,
    req: ParsedRequest,
    rid: str,
    chat: bool,
    prompt_len: int,
    outputs: AsyncIterator[RequestOutput],
    cadence_s: float | None,
) -> AsyncIterator[bytes]:
    created = int(time.time())
    kind = "chat.completion.chunk" if chat else "text_completion"
    ticker = Ticker(cadence_s) if cadence_s else None
    tok = engine.tokenizer
    splitter = (
        TokenSplitter(lambda ids: tok.decode(ids, skip_special_tokens=True)) if ticker else None
    )

    def event(choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> bytes:
        body: dict[str, Any] = {
            "id": rid,
            "object": kind,
            "created": created,
            "model": engine.model_name,
            "choices": choices,
        }
        if req.include_usage:
            body["usage"] = usage
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n".encode()

    first = True
    try:
        if chat:
            yield event([_choice(chat, "", None, delta=True, first=True)])
            first = False
        async for out in outputs:
            if out.error is not None:
                yield f"data: {json.dumps(_error_of(out).body())}\n\n".encode()
                break
            result = out.result
            finish = _finish(result) if result is not None else None
            if ticker is not None and splitter is not None:
                # One event per token, each at its slot: timing says nothing of acceptance.
                pieces = splitter.split(StreamChunk(out.token_ids, out.text))
                for i, piece in enumerate(pieces):
                    await wait_for_slot(ticker)
                    last = finish if i == len(pieces) - 1 else None
                    yield event([_choice(chat, piece, last, delta=True, first=first)])
                    first = False
            elif out.text or finish is not None:
                yield event([_choice(chat, out.text, finish, delta=True, first=first)])
                first = False
            if result is not None and req.include_usage:
                yield event([], _usage(engine, prompt_len, result, out.anomaly))
        yield b"data: [DONE]\n\n"
    finally:
        await outputs.aclose()  # type: ignore[attr-defined]
