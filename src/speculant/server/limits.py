"""Limits on request bodies, checked before anything parses them: a body larger than
`max_bytes` gets a 413, one nested deeper than `max_depth` a 400 (a JSON parser would
otherwise recurse through it), both as OpenAI error objects."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from speculant.server.schema import APIError

MAX_BODY_BYTES = 4 * 1024 * 1024
MAX_DEPTH = 32
_STRINGS = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


def json_depth(raw: bytes, limit: int) -> int:
    """How deep the brackets of a JSON text nest (strings skipped), counting up to
    limit + 1 at most: a linear scan that never recurses."""
    brackets = _STRINGS.sub(b"", raw).translate(None, _NOT_BRACKETS)
    depth = deepest = 0
    for b in brackets:
        depth += 1 if b in (0x5B, 0x7B) else -1
        if depth > deepest:
            deepest = depth
            if deepest > limit:
                break
    return deepest


class BodyLimits:
    """ASGI middleware: reads a POST body once, checks its size and nesting, and hands
    the same bytes on to the app, as JSON."""

    def __init__(
        self,
        app: ASGIApp,
        max_bytes: int = MAX_BODY_BYTES,
        max_depth: int = MAX_DEPTH,
        on_refuse: Callable[[int], None] | None = None,
    ) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.max_depth = max_depth
        self.on_refuse = on_refuse  # called with the status of each refusal (metrics)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") != "POST":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._refuse(send, self._too_large(int(declared)))
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await self._refuse(send, self._too_large(size, at_least=True))
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        raw = b"".join(chunks)
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            err = APIError(
                f"the request body is not UTF-8 (byte {exc.start} is {raw[exc.start]:#04x}): "
                "send JSON encoded as UTF-8",
                code="invalid_value",
            )
            await self._refuse(send, err)
            return
        depth = json_depth(raw, self.max_depth)
        if depth > self.max_depth:
            err = APIError(
                f"the request body nests more than {self.max_depth} levels deep: "
                f"use at most {self.max_depth}",
                code="invalid_value",
            )
            await self._refuse(send, err)
            return
        # The API takes JSON bodies only: read them as JSON whatever Content-Type says
        # (`curl -d` sends form encoding), so the framework does not treat them as bytes.
        headers = [(k, v) for k, v in scope.get("headers") or [] if k != b"content-type"]
        scope = {**scope, "headers": [*headers, (b"content-type", b"application/json")]}
        sent = False

        async def replay() -> Message:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": raw, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    def _too_large(self, size: int, at_least: bool = False) -> APIError:
        told = f"more than {self.max_bytes}" if at_least else str(size)
        return APIError(
            f"the request body has {told} bytes: at most {self.max_bytes} are accepted",
            status=413,
            code="request_too_large",
        )

    async def _refuse(self, send: Send, err: APIError) -> None:
        if self.on_refuse is not None:
            self.on_refuse(err.status)
        body = json.dumps(err.body()).encode()
        headers: list[Any] = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
        ]
        await send({"type": "http.response.start", "status": err.status, "headers": headers})
        await send({"type": "http.response.body", "body": body})
