"""OpenAI request bodies, checked by hand so that every bad value gets an OpenAI error
object naming the parameter and what is allowed (never a framework's own format)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from speculant.sampling import SamplingParams

MAX_STOP = 16
ROLES = ("system", "user", "assistant", "tool", "developer")


class APIError(Exception):
    """An error answered as {"error": {"message", "type", "param", "code"}}."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        param: str | None = None,
        code: str | None = None,
        type: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = code
        self.type = type

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


@dataclass(frozen=True)
class ParsedRequest:
    """A checked completion or chat request, before tokenisation."""

    model: str | None
    prompt_text: str | None  # completions with a text prompt
    prompt_ids: list[int] | None  # completions with token ids
    messages: list[dict[str, str]] | None  # chat
    max_tokens: int | None
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: tuple[str, ...]
    ignore_eos: bool
    stream: bool
    include_usage: bool


def _bad(param: str, message: str) -> APIError:
    return APIError(f"{param}: {message}", param=param, code="invalid_value")


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _number(body: dict[str, Any], name: str, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _bad(name, f"expected a number, got {_type_name(value)} {value!r}")
    if not math.isfinite(value):
        raise _bad(name, f"{value!r} is not a finite number")
    return float(value)


def _integer(body: dict[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(name, f"expected an integer, got {_type_name(value)} {value!r}")
    return value


def _boolean(body: dict[str, Any], name: str, default: bool = False) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise _bad(name, f"expected true or false, got {_type_name(value)} {value!r}")
    return value


def _stop(body: dict[str, Any]) -> tuple[str, ...]:
    value = body.get("stop")
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise _bad("stop", f"expected a string or a list of strings, got {value!r}")
    if len(items) > MAX_STOP:
        raise _bad("stop", f"{len(items)} stop strings: use at most {MAX_STOP}")
    if any(s == "" for s in items):
        raise _bad("stop", "stop strings must be non-empty")
    return tuple(items)


def _content(value: Any, where: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        parts = []
        for i, part in enumerate(value):
            if not (isinstance(part, dict) and part.get("type") == "text"):
                raise _bad(f"{where}[{i}]", "only text content parts are supported")
            text = part.get("text")
            if not isinstance(text, str):
                raise _bad(f"{where}[{i}].text", f"expected a string, got {_type_name(text)}")
            parts.append(text)
        return "".join(parts)
    if value is None:
        return ""
    raise _bad(where, f"expected a string or a list of text parts, got {_type_name(value)}")


def _messages(body: dict[str, Any]) -> list[dict[str, str]]:
    value = body.get("messages")
    if not isinstance(value, list) or not value:
        raise _bad("messages", f"expected a non-empty list of messages, got {value!r}"[:200])
    out = []
    for i, msg in enumerate(value):
        if not isinstance(msg, dict):
            raise _bad(f"messages[{i}]", f"expected an object, got {_type_name(msg)}")
        role = msg.get("role")
        if role not in ROLES:
            raise _bad(f"messages[{i}].role", f"{role!r} is not one of {', '.join(ROLES)}")
        out.append(
            {"role": role, "content": _content(msg.get("content"), f"messages[{i}].content")}
        )
    return out


def _prompt(body: dict[str, Any]) -> tuple[str | None, list[int] | None]:
    value = body.get("prompt")
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str | list):
        value = value[0]  # one prompt in a list
    if isinstance(value, str):
        return value, None
    if (
        isinstance(value, list)
        and value
        and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
    ):
        return None, list(value)
    if isinstance(value, list) and value and all(isinstance(p, str | list) for p in value):
        raise _bad("prompt", f"{len(value)} prompts in one request: send one prompt per request")
    raise _bad(
        "prompt",
        "expected a string or a list of token ids"
        + ("" if value is not None else ", and it is missing"),
    )


def parse_request(body: Any, chat: bool) -> ParsedRequest:
    if not isinstance(body, dict):
        raise APIError(f"the request body must be a JSON object, got {_type_name(body)}")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise _bad("model", f"expected a string, got {_type_name(model)}")
    n = _integer(body, "n")
    if n is not None and n != 1:
        raise APIError(
            f"n={n} is not supported: this server returns one choice per request (send n requests)",
            param="n",
            code="unsupported_value",
        )
    if chat:
        messages = _messages(body)
        prompt_text, prompt_ids = None, None
        max_tokens = _integer(body, "max_completion_tokens")
        if max_tokens is None:
            max_tokens = _integer(body, "max_tokens")
    else:
        messages = None
        prompt_text, prompt_ids = _prompt(body)
        max_tokens = _integer(body, "max_tokens")
    if max_tokens is not None and max_tokens < 1:
        raise _bad("max_tokens", f"{max_tokens} is out of range: use an integer >= 1")
    temperature = _number(body, "temperature", 1.0)
    if temperature < 0:
        raise _bad("temperature", f"{temperature:g} is out of range: use a number >= 0")
    top_p = _number(body, "top_p", 1.0)
    if not 0 < top_p <= 1:
        raise _bad("top_p", f"{top_p:g} is out of range: use a number in (0, 1]")
    top_k = _integer(body, "top_k")
    if top_k is not None and top_k < -1:
        raise _bad("top_k", f"{top_k} is out of range: use -1 or 0 (off) or a positive integer")
    seed = _integer(body, "seed")
    if seed is not None and seed < 0:
        raise _bad("seed", f"{seed} is out of range: use an integer >= 0")
    stream = _boolean(body, "stream")
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not isinstance(options, dict):
            raise _bad("stream_options", f"expected an object, got {_type_name(options)}")
        if not stream:
            raise _bad("stream_options", "only allowed with stream: true")
        include_usage = _boolean(options, "include_usage")
    return ParsedRequest(
        model=model,
        prompt_text=prompt_text,
        prompt_ids=prompt_ids,
        messages=messages,
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=max(top_k or 0, 0),
        seed=seed,
        stop=_stop(body),
        ignore_eos=_boolean(body, "ignore_eos"),
        stream=stream,
        include_usage=include_usage,
    )


def sampling_params(req: ParsedRequest, prompt_len: int, max_model_len: int) -> SamplingParams:
    """The request's sampling parameters, with max_tokens checked against the context."""
    if prompt_len >= max_model_len:
        raise APIError(
            f"the prompt has {prompt_len} tokens and this model's context holds "
            f"{max_model_len}: shorten the prompt",
            param="messages" if req.messages is not None else "prompt",
            code="context_length_exceeded",
        )
    room = max_model_len - prompt_len
    max_tokens = room if req.max_tokens is None else req.max_tokens
    if max_tokens > room:
        param = "max_completion_tokens" if req.messages is not None else "max_tokens"
        raise APIError(
            f"max_tokens={max_tokens} is too large: the prompt has {prompt_len} tokens and "
            f"this model's context holds {max_model_len}, so use at most {room}",
            param=param,
            code="context_length_exceeded",
        )
    return SamplingParams(
        temperature=req.temperature,
        top_k=req.top_k,
        top_p=req.top_p,
        max_tokens=max_tokens,
        seed=req.seed,
        ignore_eos=req.ignore_eos,
        stop=req.stop,
    )
