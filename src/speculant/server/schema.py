"""OpenAI request and response bodies as typed models.

FastAPI validates every request against these models and describes them in
/openapi.json. A body that fails gets an OpenAI error object (never the framework's
422) naming the parameter and what is allowed (`validation_error`). Every parameter
either works or is refused with a 400 that names it: an unknown parameter is refused,
not ignored, so a client never gets an answer to a question it did not ask.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from speculant.sampling import MAX_LOGPROBS, SamplingParams

MAX_STOP = 16
MAX_N = 16  # choices per request
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
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = code
        self.type = type
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


# -- requests ------------------------------------------------------------------------


class _Body(BaseModel):
    # strict: "1" is not a number and 1 is not true; extra: an unknown name is refused
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Body):
    include_usage: bool = False


class TextPart(_Body):
    type: Literal["text"]
    text: str


class Message(_Body):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[TextPart] | None = None


class ResponseFormat(_Body):
    type: Literal["text"] = Field(
        description="only plain text: structured output (json_object, json_schema) is refused"
    )


TokenId = Annotated[int, Field(ge=0)]
Logprobs = Annotated[int, Field(ge=0, le=MAX_LOGPROBS)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]


class _Sampling(_Body):
    model: str | None = Field(None, description="the served model's id, or omitted")
    max_tokens: int | None = Field(
        None, ge=1, description="new tokens at most (default: what the context leaves)"
    )
    temperature: float | None = Field(None, ge=0.0, description="0 is greedy (default 1)")
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, description="-1 or 0 is off")
    n: int | None = Field(
        None,
        ge=1,
        le=MAX_N,
        description="choices, sharing the prompt's prefill; choice i uses seed + i",
    )
    seed: int | None = Field(
        None, ge=0, description="the same seed gives the same text with any method"
    )
    stop: str | list[str] | None = Field(None, description=f"up to {MAX_STOP} stop strings")
    stop_token_ids: list[TokenId] | None = Field(None, description="token ids that end the text")
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool | None = False
    frequency_penalty: Penalty | None = Field(
        None, description="subtracted from a token's logit per time it occurs in the output"
    )
    presence_penalty: Penalty | None = Field(
        None, description="subtracted from the logit of every token the output holds"
    )
    repetition_penalty: float | None = Field(
        None, gt=0.0, description="divides the positive logits of prompt and output tokens"
    )
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = Field(
        None, description="token id (as a string) -> bias added to its logit"
    )
    user: str | None = Field(None, description="an end-user id; not used")


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: Logprobs | None = Field(
        None, description="report this many most likely alternatives per token (0-20)"
    )
    echo: bool | None = Field(False, description="return the prompt before the completion")


class ChatCompletionRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = False
    top_logprobs: Logprobs | None = None
    response_format: ResponseFormat | None = None


# Refused parameters that clients send, with the reason (any other unknown name gets a
# generic refusal that lists what is accepted).
UNSUPPORTED = {
    "tools": "tool calling is not supported",
    "tool_choice": "tool calling is not supported",
    "functions": "function calling is not supported",
    "function_call": "function calling is not supported",
    "parallel_tool_calls": "tool calling is not supported",
    "suffix": "insertion after a suffix is not supported",
    "best_of": "best_of is not supported: send several requests with different seeds",
    "audio": "only text output is supported",
    "modalities": "only text output is supported",
    "prediction": "predicted outputs are not supported",
    "name": "participant names are not supported",
    "tool_calls": "tool calling is not supported",
}
_UNIONS = {
    "prompt": "a string, a list of token ids, or a list holding one of those",
    "stop": "a string or a list of strings",
    "content": "a string or a list of text parts",
}
_FIELDS = frozenset(
    name
    for cls in (CompletionRequest, ChatCompletionRequest, Message, TextPart, StreamOptions)
    for name in cls.model_fields
)


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _param(loc: Sequence[Any]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _walk(body: Any, loc: Sequence[Any]) -> Any:
    for part in loc:
        try:
            body = body[part]
        except (KeyError, IndexError, TypeError):
            return None
    return body


def validation_error(errors: Sequence[Any], body: Any) -> APIError:
    """The first failed check of a request body, as an OpenAI error naming the parameter
    (its path, e.g. messages[0].role), the value given and what is allowed."""
    err = errors[0]
    loc = [p for p in err["loc"] if p != "body"] if err["loc"][:1] == ("body",) else err["loc"]
    kind = err["type"]
    if kind == "json_invalid":
        reason = (err.get("ctx") or {}).get("error", "")
        return APIError(f"the request body is not valid JSON: {reason}", code="invalid_json")
    if kind == "extra_forbidden":
        name = str(loc[-1])
        param = _param(loc)
        why = UNSUPPORTED.get(name)
        if why is None:
            where = loc[:-1]
            fields = _fields_at(where, body)
            why = f"unknown parameter; this server accepts: {', '.join(fields)}"
        return APIError(f"{param}: {why}", param=param, code="unsupported_parameter")
    # Union members add their own names to the path ('str', 'list[int]', ...): drop them
    # (keeping field names, list indices and logit_bias's token-id keys).
    path = [p for p in loc if isinstance(p, int) or p in _FIELDS or str(p).isdigit()]
    if not path:
        return APIError(f"the request body must be a JSON object, got {_type_name(body)}")
    param = _param(path)
    if kind == "missing":
        return APIError(f"{param}: required, and it is missing", param=param, code="missing")
    value = _walk(body, path)
    field = next((p for p in reversed(path) if isinstance(p, str)), "")
    if field in _UNIONS and len(loc) > len(path) and not err["msg"].startswith("Value error"):
        message = f"expected {_UNIONS[field]}, got {_type_name(value)} {_show(value)}"
    else:
        message = f"{err['msg'][0].lower()}{err['msg'][1:]}, got {_show(value)}"
    return APIError(f"{param}: {message}", param=param, code="invalid_value")


def _fields_at(loc: Sequence[Any], body: Any) -> list[str]:
    if not loc:
        chat = isinstance(body, dict) and "messages" in body
        return sorted((ChatCompletionRequest if chat else CompletionRequest).model_fields)
    last = next((p for p in reversed(loc) if isinstance(p, str)), "")
    nested: dict[str, type[BaseModel]] = {
        "messages": Message,
        "stream_options": StreamOptions,
        "content": TextPart,
        "response_format": ResponseFormat,
    }
    cls = nested.get(last)
    return sorted(cls.model_fields) if cls is not None else []


# -- checked requests ----------------------------------------------------------------


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
    stop_token_ids: tuple[int, ...]
    ignore_eos: bool
    stream: bool
    include_usage: bool
    n: int = 1  # choices
    logprobs: int | None = None  # alternatives per token, None when not asked for
    echo: bool = False  # completions: the prompt (and its logprobs) before the text
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()


def _bad(param: str, message: str, code: str = "invalid_value") -> APIError:
    return APIError(f"{param}: {message}", param=param, code=code)


def _common(req: _Sampling) -> dict[str, Any]:
    bias = []
    for key, value in (req.logit_bias or {}).items():
        if not key.isdigit():
            raise _bad("logit_bias", f'key {key!r} is not a token id: use ids like "50256"')
        bias.append((int(key), value))
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    if len(stop) > MAX_STOP:
        raise _bad("stop", f"{len(stop)} stop strings: use at most {MAX_STOP}")
    if any(s == "" for s in stop):
        raise _bad("stop", "stop strings must be non-empty")
    stream = bool(req.stream)
    if req.stream_options is not None and not stream:
        raise _bad("stream_options", "only allowed with stream: true")
    return dict(
        model=req.model,
        n=req.n or 1,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=max(req.top_k or 0, 0),
        seed=req.seed,
        stop=stop,
        stop_token_ids=tuple(req.stop_token_ids or ()),
        ignore_eos=bool(req.ignore_eos),
        stream=stream,
        include_usage=req.stream_options is not None and req.stream_options.include_usage,
        frequency_penalty=req.frequency_penalty or 0.0,
        presence_penalty=req.presence_penalty or 0.0,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        logit_bias=tuple(bias),
    )


def parse_completion(req: CompletionRequest) -> ParsedRequest:
    prompt: Any = req.prompt
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # one prompt in a list
    text, ids = None, None
    if isinstance(prompt, str):
        text = prompt
    elif prompt and all(isinstance(t, int) for t in prompt):
        ids = list(prompt)
    elif prompt:
        raise _bad("prompt", f"{len(prompt)} prompts in one request: send one prompt per request")
    else:
        raise _bad("prompt", "expected a string or a non-empty list of token ids, got []")
    return ParsedRequest(
        prompt_text=text,
        prompt_ids=ids,
        messages=None,
        max_tokens=req.max_tokens,
        logprobs=req.logprobs,
        echo=bool(req.echo),
        **_common(req),
    )


def parse_chat(req: ChatCompletionRequest) -> ParsedRequest:
    messages = []
    for m in req.messages:
        content = m.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        messages.append({"role": m.role, "content": content or ""})
    if req.top_logprobs is not None and not req.logprobs:
        raise _bad("top_logprobs", f"{req.top_logprobs} is only allowed with logprobs: true")
    max_tokens = req.max_completion_tokens if req.max_completion_tokens else req.max_tokens
    return ParsedRequest(
        prompt_text=None,
        prompt_ids=None,
        messages=messages,
        max_tokens=max_tokens,
        logprobs=(req.top_logprobs or 0) if req.logprobs else None,
        **_common(req),
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
        stop_token_ids=req.stop_token_ids,
        logprobs=req.logprobs,
        frequency_penalty=req.frequency_penalty,
        presence_penalty=req.presence_penalty,
        repetition_penalty=req.repetition_penalty,
        logit_bias=req.logit_bias,
    )


# -- responses (described in /openapi.json) -------------------------------------------


class ErrorObject(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorObject


class Speculation(BaseModel):
    method: str
    num_speculative_tokens: int | str
    drafted_tokens: int
    accepted_tokens: int
    acceptance_rate: float | None
    mean_accepted_length: float
    target_forwards: int
    accepted_per_position: list[int]
    model_config = ConfigDict(extra="allow")  # the anomaly verdict's fields


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    speculation: Speculation


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: Literal["stop", "length"] | None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None
    refusal: None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: Literal["stop", "length"] | None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
