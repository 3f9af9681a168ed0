"""The OpenAI-compatible server on a loopback port, driven by the official `openai`
client and by raw HTTP: text equality with the engine and the CLI, streaming, usage
and metrics accounting, every documented bad input, auth, disconnects and a bounded
concurrent load."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx2 as httpx
import openai
import pytest
import torch
from serving import metrics, serving
from tiny import tiny_chat_model

from speculant import Engine, SamplingParams
from speculant.models.model import Model
from speculant.server import AsyncEngine

API_KEY = "test-key-123"
MODEL = "tiny-target"
CONTEXT = 200
MAX_SEQS = 4


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Model, Model]:
    root = tmp_path_factory.mktemp("server-models")
    return (
        tiny_chat_model(root / "target", seed=1, layers=3),
        tiny_chat_model(root / "draft", seed=2, layers=1),
    )


@pytest.fixture(scope="module")
def server(models: tuple[Model, Model]) -> Iterator[tuple[str, AsyncEngine]]:
    target, draft = models
    engine = Engine(target, draft=draft, num_speculative_tokens=3, max_seq_len=CONTEXT)
    async_engine = AsyncEngine(engine, model_name=MODEL, max_num_seqs=MAX_SEQS, draft_name="d")
    with serving(async_engine, API_KEY) as url:
        yield url, async_engine


@pytest.fixture(scope="module")
def client(server: tuple[str, AsyncEngine]) -> openai.OpenAI:
    return openai.OpenAI(base_url=server[0] + "/v1", api_key=API_KEY, max_retries=0)


def _expected(models: tuple[Model, Model], prompt: str, n: int) -> tuple[str, list[int]]:
    """Greedy text of a fresh engine (the same pair, k=3) for a completions prompt."""
    target, draft = models
    engine = Engine(target, draft=draft, num_speculative_tokens=3)
    assert target.tokenizer is not None
    res = engine.generate(
        target.tokenizer.encode(prompt), SamplingParams(max_tokens=n, ignore_eos=True)
    )
    return res.text, res.token_ids


def test_models_and_health(server: tuple[str, AsyncEngine], client: openai.OpenAI) -> None:
    ids = [m.id for m in client.models.list()]
    assert ids == [MODEL]
    assert httpx.get(server[0] + "/health").json() == {"status": "ok"}


def test_completion_equals_engine_and_cli(
    models: tuple[Model, Model], client: openai.OpenAI, tmp_path: Path
) -> None:
    from speculant.cli import main

    prompt = "copy this list: red, green"
    text, ids = _expected(models, prompt, 12)
    res = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    assert res.choices[0].text == text
    assert res.choices[0].finish_reason == "length"
    assert res.usage is not None and res.usage.completion_tokens == len(ids) == 12
    target, draft = models
    argv = ["generate", prompt, "--target", str(target.source), "--draft", str(draft.source)]
    argv += ["--dtype", "float32", "--draft-dtype", "float32", "-k", "3", "--max-tokens", "12"]
    argv += ["--ignore-eos", "--json"]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(argv) == 0
    assert json.loads(out.getvalue())["text"] == res.choices[0].text


def test_stream_equals_whole_and_usage_adds_up(client: openai.OpenAI) -> None:
    kw = dict(model=MODEL, prompt="the quick brown fox", max_tokens=20, temperature=0)
    whole = client.completions.create(**kw, extra_body={"ignore_eos": True})  # type: ignore[call-overload]
    chunks = list(
        client.completions.create(  # type: ignore[call-overload]
            **kw,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and all(f is None for f in finishes[:-1])
    usage = chunks[-1].usage
    assert usage is not None and not chunks[-1].choices
    assert usage.completion_tokens == 20
    assert usage.total_tokens == usage.prompt_tokens + 20
    spec = usage.model_extra["speculation"]  # type: ignore[index]
    assert spec["method"] == "draft" and spec["num_speculative_tokens"] == 3
    assert 0 <= spec["accepted_tokens"] <= spec["drafted_tokens"]
    # every pass emits its accepted drafts plus one token of the target's own
    assert spec["accepted_tokens"] + spec["target_forwards"] >= 20
    assert sum(spec["accepted_per_position"]) == spec["accepted_tokens"]
    whole_spec = whole.usage.model_extra["speculation"]  # type: ignore[union-attr,index]
    assert whole_spec["accepted_tokens"] == spec["accepted_tokens"]


def test_chat_stream_and_whole(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "hello there"}]
    whole = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_completion_tokens=15,
        temperature=0,  # type: ignore[arg-type]
    )
    assert whole.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=15,
        temperature=0,
        stream=True,  # type: ignore[arg-type]
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_seeded_sampling_is_reproducible(client: openai.OpenAI) -> None:
    kw = dict(model=MODEL, prompt="red green", max_tokens=16, temperature=0.9, top_p=0.9, seed=7)
    a = client.completions.create(**kw)  # type: ignore[call-overload]
    b = client.completions.create(**kw)  # type: ignore[call-overload]
    assert a.choices[0].text == b.choices[0].text


def test_metrics_move_by_the_request(
    server: tuple[str, AsyncEngine], client: openai.OpenAI
) -> None:
    url = server[0]
    before = metrics(url)
    res = client.completions.create(
        model=MODEL,
        prompt="blue red",
        max_tokens=10,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    spec = res.usage.model_extra["speculation"]  # type: ignore[union-attr,index]
    after = metrics(url)

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert delta("speculant:spec_decode_num_draft_tokens_total") == spec["drafted_tokens"]
    assert delta("speculant:spec_decode_num_accepted_tokens_total") == spec["accepted_tokens"]
    per_pos = sum(
        after[k] - before.get(k, 0.0)
        for k in after
        if k.startswith("speculant:spec_decode_num_accepted_tokens_per_pos_total")
    )
    assert per_pos == spec["accepted_tokens"]
    assert delta("speculant:generation_tokens_total") == 10
    assert delta("speculant:request_success_total{finished_reason=length}") == 1
    assert delta("speculant:time_to_first_token_seconds_count") == 1
    assert delta("speculant:e2e_request_latency_seconds_count") == 1
    assert delta("speculant:spec_decode_num_drafts_total") >= 1
    rate = after["speculant:spec_decode_acceptance_rate"]
    assert 0.0 <= rate <= 1.0
    assert after["speculant:num_requests_running"] == 0


BAD = [
    ("completions", b"{not json", 400, None),
    ("completions", b"[1, 2]", 400, None),
    ("completions", {"prompt": "hi", "temperature": -1}, 400, "temperature"),
    ("completions", {"prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    ("completions", {"prompt": "hi", "top_p": 0}, 400, "top_p"),
    ("completions", {"prompt": "hi", "top_p": 1.5}, 400, "top_p"),
    ("completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("completions", {"prompt": "hi", "max_tokens": CONTEXT + 1}, 400, "max_tokens"),
    ("completions", {"prompt": "hi", "max_tokens": "many"}, 400, "max_tokens"),
    ("completions", {"prompt": "hi " * 400}, 400, "prompt"),
    ("completions", {"prompt": "hi", "n": 17}, 400, "n"),
    ("completions", {"prompt": "hi", "n": 0}, 400, "n"),
    ("completions", {"prompt": "hi", "seed": -3}, 400, "seed"),
    ("completions", {"prompt": "hi", "stop": 5}, 400, "stop"),
    ("completions", {"prompt": "hi", "stream": "yes"}, 400, "stream"),
    ("completions", {"prompt": ["a", "b"]}, 400, "prompt"),
    ("completions", {"prompt": [1, 99999]}, 400, "prompt"),
    ("completions", {}, 400, "prompt"),
    ("completions", {"prompt": "hi", "model": "other-model"}, 404, "model"),
    ("chat/completions", {"messages": "hello"}, 400, "messages"),
    ("chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, None),
    ("chat/completions", {"messages": [{"role": "user", "content": 3}]}, 400, None),
    # typed: no coercion of strings or booleans into numbers
    ("completions", {"prompt": "hi", "max_tokens": True}, 400, "max_tokens"),
    ("completions", {"prompt": "hi", "temperature": "0.5"}, 400, "temperature"),
    ("completions", {"prompt": "hi", "logprobs": 21}, 400, "logprobs"),
    ("completions", {"prompt": "hi", "stop_token_ids": [-1]}, 400, "stop_token_ids[0]"),
    # every parameter works or is refused by name (never a silent 200)
    ("completions", {"prompt": "hi", "frobnicate": 1}, 400, "frobnicate"),
    ("completions", {"prompt": "hi", "suffix": "end"}, 400, "suffix"),
    ("completions", {"prompt": "hi", "frequency_penalty": 2.5}, 400, "frequency_penalty"),
    ("completions", {"prompt": "hi", "presence_penalty": "high"}, 400, "presence_penalty"),
    ("completions", {"prompt": "hi", "repetition_penalty": 0}, 400, "repetition_penalty"),
    ("completions", {"prompt": "hi", "logit_bias": {"abc": 10}}, 400, "logit_bias"),
    ("completions", {"prompt": "hi", "logit_bias": {"5": 200}}, 400, "logit_bias.5"),
    ("completions", {"prompt": "hi", "logit_bias": {"99999": 1}}, 400, "logit_bias"),
    ("completions", {"prompt": "hi", "stop_token_ids": [99999]}, 400, "stop_token_ids"),
    (
        "chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "tools": []},
        400,
        "tools",
    ),
    (
        "chat/completions",
        {
            "messages": [{"role": "user", "content": "x"}],
            "response_format": {"type": "json_object"},
        },
        400,
        "response_format.type",
    ),
    (
        "chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
        400,
        "top_logprobs",
    ),
    ("chat/completions", {"messages": [{"role": "user", "content": "x", "nick": 1}]}, 400, None),
    ("chat/completions", {"messages": []}, 400, "messages"),
    # limits: nesting a parser would recurse through, and a body over the size limit
    ("completions", b"[" * 5000 + b"]" * 5000, 400, None),
    ("completions", b'{"prompt": "' + b"x" * (5 * 1024 * 1024) + b'"}', 413, None),
]


@pytest.mark.parametrize(("route", "body", "status", "param"), BAD)
def test_bad_input_gets_an_openai_error(
    server: tuple[str, AsyncEngine],
    route: str,
    body: object,
    status: int,
    param: str | None,
) -> None:
    url = server[0]
    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(f"{url}/v1/{route}", content=raw, headers=headers, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["message"] and err["type"]
    if param is not None:
        assert err["param"] == param
    if body == {"prompt": "hi " * 400}:
        assert err["code"] == "context_length_exceeded"
    refused = err["code"] in ("unsupported_parameter", "unsupported_value")
    if isinstance(body, dict) and param in body and param != "prompt" and not refused:
        # the message names the parameter and the value it got
        value, message = body[param], err["message"]
        parts = value if isinstance(value, list | dict) else []  # a list's items, a map's keys
        shown = [repr(value)[:20], str(value), *(str(k) for k in parts)]
        assert param in message and any(v in message for v in shown), message
    # the server keeps serving
    ok = httpx.post(
        f"{url}/v1/completions",
        json={"prompt": "hi", "max_tokens": 2},
        headers=headers,
        timeout=30,
    )
    assert ok.status_code == 200


def test_error_messages_say_what_is_allowed(server: tuple[str, AsyncEngine]) -> None:
    url = server[0]
    headers = {"Authorization": f"Bearer {API_KEY}"}

    def error(body: object, route: str = "completions") -> str:
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        r = httpx.post(f"{url}/v1/{route}", content=raw, headers=headers, timeout=30)
        assert r.status_code == 400, r.text
        return str(r.json()["error"]["message"])

    assert error({"prompt": "hi", "temperature": -1}) == (
        "temperature: input should be greater than or equal to 0, got -1"
    )
    assert error({"prompt": 5}) == (
        "prompt: expected a string, a list of token ids, or a list holding one of those, got int 5"
    )
    assert "this server accepts:" in error({"prompt": "hi", "frobnicate": 1})
    assert "echo" in error({"prompt": "hi", "frobnicate": 1})
    assert error({"prompt": "hi", "suffix": "x"}) == (
        "suffix: insertion after a suffix is not supported"
    )
    msg = error({"messages": [{"role": "wizard", "content": "x"}]}, "chat/completions")
    assert msg.startswith("messages[0].role:") and "'wizard'" in msg and "'user'" in msg
    assert "32 levels" in error(b"[" * 40 + b"]" * 40)


def test_openapi_describes_the_requests(server: tuple[str, AsyncEngine]) -> None:
    doc = httpx.get(server[0] + "/openapi.json").json()
    schemas = doc["components"]["schemas"]
    completion = schemas["CompletionRequest"]
    assert completion["required"] == ["prompt"]
    assert completion["additionalProperties"] is False
    for name in ("max_tokens", "temperature", "top_p", "seed", "stop", "logprobs", "echo"):
        assert name in completion["properties"], name
    assert completion["properties"]["logprobs"]["anyOf"][0]["maximum"] == 20
    chat = schemas["ChatCompletionRequest"]
    assert {"messages", "max_completion_tokens", "top_logprobs"} <= set(chat["properties"])
    assert set(schemas["Message"]["properties"]["role"]["enum"]) == {
        "system",
        "user",
        "assistant",
        "tool",
        "developer",
    }
    post = doc["paths"]["/v1/completions"]["post"]
    body_ref = post["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    assert body_ref.endswith("/CompletionRequest")
    assert {"200", "400", "413"} <= set(post["responses"])


def _plain_logprobs(
    models: tuple[Model, Model], prompt_ids: list[int], n: int, top: int
) -> list[tuple[int, float, dict[int, float]]]:
    """Greedy logprobs of plain decoding (no drafts) through the engine."""
    target, _ = models
    res = Engine(target).generate(
        prompt_ids, SamplingParams(max_tokens=n, ignore_eos=True, logprobs=top)
    )
    assert res.logprobs is not None
    return [(e.token, e.logprob, dict(e.top)) for e in res.logprobs]


def test_completion_logprobs_and_echo(models: tuple[Model, Model], client: openai.OpenAI) -> None:
    """logprobs through the openai client: the speculating server's numbers are plain
    decoding's, bitwise; echo returns the prompt, scored token by token."""
    target, _ = models
    tok = target.tokenizer
    assert tok is not None
    prompt = "copy this list: red, green"
    ids = tok.encode(prompt)
    expected = _plain_logprobs(models, ids, 10, 3)
    res = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=10,
        temperature=0,
        logprobs=3,
        extra_body={"ignore_eos": True},
    )
    lp = res.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and lp.top_logprobs is not None
    assert lp.token_logprobs == [v for _, v, _ in expected]
    assert lp.tokens == [tok.decode([t]) for t, _, _ in expected]
    assert "".join(lp.tokens) == res.choices[0].text
    for top, (_, _, want) in zip(lp.top_logprobs, expected, strict=True):
        assert top == {tok.decode([t]): v for t, v in want.items()}
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(10)]

    echoed = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=10,
        temperature=0,
        logprobs=1,
        echo=True,
        extra_body={"ignore_eos": True},
    )
    choice = echoed.choices[0]
    assert choice.text == prompt + res.choices[0].text
    elp = choice.logprobs
    assert elp is not None and elp.token_logprobs is not None and elp.text_offset is not None
    assert len(elp.token_logprobs) == len(ids) + 10
    assert elp.token_logprobs[0] is None  # nothing predicts the first token
    assert elp.token_logprobs[len(ids) :] == lp.token_logprobs
    assert elp.text_offset[len(ids)] == len(prompt)
    # the prompt's scores: the model's log-probability of each next prompt token
    cache = target.new_cache(len(ids))
    logp = torch.log_softmax(target.forward(ids[:-1], cache, 0), dim=-1)
    want = [float(logp[i, t]) for i, t in enumerate(ids[1:])]
    assert elp.token_logprobs[1 : len(ids)] == pytest.approx(want, abs=1e-5)

    stream = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=10,
        temperature=0,
        logprobs=3,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    streamed = [v for c in stream for v in (c.choices[0].logprobs.token_logprobs or [])]  # type: ignore[union-attr]
    assert streamed == lp.token_logprobs


def test_penalties_and_logit_bias(models: tuple[Model, Model], client: openai.OpenAI) -> None:
    """Penalties and logit_bias through the openai client: the speculating server's text
    is plain decoding's with the same parameters, and they change the text."""
    target, _ = models
    assert target.tokenizer is not None
    prompt = "copy this list: red, green, red, green"
    ids = target.tokenizer.encode(prompt)
    kw = dict(frequency_penalty=1.2, presence_penalty=0.4, logit_bias=((5, 4.0),))
    plain = Engine(target).generate(
        ids,
        SamplingParams(max_tokens=16, ignore_eos=True, **kw),  # type: ignore[arg-type]
    )
    res = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=16,
        temperature=0,
        frequency_penalty=1.2,
        presence_penalty=0.4,
        logit_bias={"5": 4.0},
        extra_body={"ignore_eos": True},
    )
    assert res.choices[0].text == plain.text
    free = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=16, temperature=0, extra_body={"ignore_eos": True}
    )
    assert free.choices[0].text != plain.text


def test_n_choices(client: openai.OpenAI) -> None:
    """n > 1: choice i is the single request with seed + i (they share one prefill),
    streamed choices interleave by index and add up to the whole answer, and usage
    counts every choice's tokens."""
    kw = dict(model=MODEL, prompt="red green", max_tokens=12, temperature=0.9, top_p=0.9)
    extra = {"extra_body": {"ignore_eos": True}}
    many = client.completions.create(**kw, n=3, seed=7, **extra)  # type: ignore[call-overload]
    singles = [
        client.completions.create(**kw, seed=7 + i, **extra).choices[0].text  # type: ignore[call-overload]
        for i in range(3)
    ]
    assert [c.index for c in many.choices] == [0, 1, 2]
    assert [c.text for c in many.choices] == singles
    assert len(set(singles)) > 1
    assert many.usage is not None and many.usage.completion_tokens == 36
    stream = client.completions.create(**kw, n=3, seed=7, stream=True, **extra)  # type: ignore[call-overload]
    texts = ["", "", ""]
    finishes = [None, None, None]
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.text
            finishes[c.index] = c.finish_reason or finishes[c.index]
    assert texts == singles and finishes == ["length"] * 3
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=6,
        temperature=0,
        n=2,
    )
    assert len(chat.choices) == 2
    assert chat.choices[0].message.content == chat.choices[1].message.content  # greedy


def test_chat_logprobs_and_stop_token_ids(
    models: tuple[Model, Model], client: openai.OpenAI
) -> None:
    target, _ = models
    tok = target.tokenizer
    assert tok is not None
    messages = [{"role": "user", "content": "hello there"}]
    ids = tok.encode(tok.apply_chat_template(messages), add_special_tokens=False)
    expected = _plain_logprobs(models, ids, 8, 2)
    res = client.chat.completions.create(
        model=MODEL,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=8,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    content = res.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None
    assert [c.logprob for c in content] == [v for _, v, _ in expected]
    assert [c.token for c in content] == [tok.decode([t]) for t, _, _ in expected]
    assert all(len(c.top_logprobs) == 2 for c in content)
    assert all(bytes(c.bytes or []) == c.token.encode() for c in content)
    # stop_token_ids (vLLM's parameter): the text ends at the first such token
    stop = expected[4][0]
    first = [t for t, _, _ in expected].index(stop)
    cut = client.chat.completions.create(
        model=MODEL,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=8,
        temperature=0,
        extra_body={"ignore_eos": True, "stop_token_ids": [stop]},
    )
    assert cut.choices[0].finish_reason == "stop"
    assert cut.usage is not None and cut.usage.completion_tokens == first + 1
    assert cut.choices[0].message.content == tok.decode([t for t, _, _ in expected[:first]])


def test_chunked_prefill_and_prefix_cache(models: tuple[Model, Model]) -> None:
    """A server that prefills in chunks of 8 rows and caches prefixes gives the texts of
    plain decoding, concurrent or not, and its second chat turn copies the first turn's
    rows (Prometheus counts the hits)."""
    target, draft = models
    engine = Engine(target, draft=draft, num_speculative_tokens=3, max_seq_len=CONTEXT)
    aengine = AsyncEngine(
        engine,
        model_name=MODEL,
        max_num_seqs=3,
        max_num_batched_tokens=8,
        prefix_cache_bytes=1 << 24,
    )
    prompts = [f"copy {i}: red green blue yellow {i} " * 3 for i in range(4)]
    expected = [_expected(models, p, 10)[0] for p in prompts]
    with serving(aengine) as url:
        aclient = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0)

        async def one(prompt: str) -> str:
            res = await aclient.completions.create(
                model=MODEL,
                prompt=prompt,
                max_tokens=10,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            return res.choices[0].text

        async def run() -> list[str]:
            async with aclient:
                return await asyncio.gather(*[one(p) for p in prompts])

        assert asyncio.run(run()) == expected
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        history = [{"role": "user", "content": "tell me about red and green and blue " * 4}]
        first = client.chat.completions.create(
            model=MODEL,
            messages=history,
            max_tokens=12,
            temperature=0,  # type: ignore[arg-type]
        )
        before = metrics(url)
        history += [
            {"role": "assistant", "content": first.choices[0].message.content or ""},
            {"role": "user", "content": "and yellow?"},
        ]
        client.chat.completions.create(
            model=MODEL,
            messages=history,
            max_tokens=12,
            temperature=0,  # type: ignore[arg-type]
        )
        after = metrics(url)
    hits = after["speculant:prefix_cache_hits_total"] - before["speculant:prefix_cache_hits_total"]
    assert hits >= 32  # the first turn's prompt, in whole blocks
    assert after["speculant:prefix_cache_blocks"] > 0


def test_auth(server: tuple[str, AsyncEngine]) -> None:
    url = server[0]
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions")):
            r = httpx.request(method, url + path, headers=headers, json={"prompt": "x"})
            assert r.status_code == 401, (headers, path)
            assert r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(url + "/health").status_code == 200
    assert httpx.get(url + "/metrics").status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="nope", max_retries=0).models.list()


def _slow_steps(engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch, seconds: float) -> None:
    sched = engine._sched
    step = sched.step

    def slow_step():  # type: ignore[no-untyped-def]
        time.sleep(seconds)
        return step()

    monkeypatch.setattr(sched, "step", slow_step)


def _hang_up_whole(url: str, prompt: str) -> None:
    """A non-streaming request whose client gives up: a read timeout closes it."""
    headers = {"Authorization": f"Bearer {API_KEY}"}
    body = {"prompt": prompt, "max_tokens": 120, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=0.3)


def _hang_up_httpx_stream(url: str, prompt: str) -> None:
    """A raw streaming client reads one chunk, then hangs up."""
    headers = {"Authorization": f"Bearer {API_KEY}"}
    body = {"prompt": prompt, "max_tokens": 150, "stream": True, "ignore_eos": True}
    with (
        httpx.Client(timeout=30) as http,
        http.stream("POST", url + "/v1/completions", json=body, headers=headers) as r,
    ):
        for line in r.iter_lines():
            if line.startswith("data: "):
                break  # one chunk, then hang up


def _hang_up_openai_stream(url: str, prompt: str) -> None:
    """The openai client reads one streamed chunk, then closes the stream."""
    client = openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0)
    stream = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=150, stream=True, extra_body={"ignore_eos": True}
    )
    next(iter(stream))
    stream.close()


@pytest.mark.parametrize(
    ("how", "step_s", "prompt"),
    [
        pytest.param("whole", 0.02, "red", id="whole-mid-decode"),  # 150 tokens: 3 s or more
        # every step 0.6 s: the client (0.3 s) hangs up during the prompt's pass
        pytest.param("whole", 0.6, "red green blue " * 10, id="whole-mid-prefill"),
        pytest.param("openai stream", 0.02, "red", id="openai-stream"),
        pytest.param("httpx stream", 0.02, "red", id="httpx-stream"),
    ],
)
def test_a_client_that_hangs_up_cancels_its_request(
    server: tuple[str, AsyncEngine],
    monkeypatch: pytest.MonkeyPatch,
    how: str,
    step_s: float,
    prompt: str,
) -> None:
    """A client that goes away, streaming or not, mid-prefill or mid-decode: its request
    is cancelled and the batch freed within 2 s (before, a non-streaming one ran to its
    last token)."""
    url, engine = server
    _slow_steps(engine, monkeypatch, step_s)
    before = metrics(url).get("speculant:request_success_total{finished_reason=cancelled}", 0.0)
    hang_up = {
        "whole": _hang_up_whole,
        "openai stream": _hang_up_openai_stream,
        "httpx stream": _hang_up_httpx_stream,
    }[how]
    hang_up(url, prompt)
    hung_up = time.monotonic()
    while time.monotonic() < hung_up + 10:
        m = metrics(url)
        done = m.get("speculant:request_success_total{finished_reason=cancelled}", 0.0)
        if done > before and m["speculant:num_requests_running"] == 0:
            break
        time.sleep(0.05)
    else:
        pytest.fail("the abandoned request kept running")
    assert time.monotonic() - hung_up < 2.0, "cancelled, but later than 2 s after the hang-up"
    assert not engine._active


def test_a_body_that_is_not_utf8_gets_an_openai_error(server: tuple[str, AsyncEngine]) -> None:
    url, _ = server
    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    r = httpx.post(url + "/v1/completions", content=b'{"prompt": "\xff\xfe"}', headers=headers)
    assert r.status_code == 400
    error = r.json()["error"]
    assert "not UTF-8" in error["message"] and "byte 12 is 0xff" in error["message"]
    assert error["type"] == "invalid_request_error"


def test_32_concurrent_streams(
    models: tuple[Model, Model], server: tuple[str, AsyncEngine]
) -> None:
    url, engine = server
    prompts = [f"copy {i}: red green blue {i}" for i in range(32)]
    lengths = [6 + (i % 5) * 3 for i in range(32)]
    expected = [_expected(models, p, n)[0] for p, n in zip(prompts, lengths, strict=True)]
    engine.peak_running = 0

    async def one(aclient: openai.AsyncOpenAI, prompt: str, n: int) -> str:
        stream = await aclient.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=n,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        return "".join([c.choices[0].text async for c in stream if c.choices])

    async def run() -> list[str]:
        aclient = openai.AsyncOpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0)
        async with aclient:
            jobs = [one(aclient, p, n) for p, n in zip(prompts, lengths, strict=True)]
            return await asyncio.wait_for(asyncio.gather(*jobs), timeout=180)

    texts = asyncio.run(run())
    assert texts == expected
    assert 2 <= engine.peak_running <= MAX_SEQS  # batched, and bounded by --max-num-seqs


def test_serve_cli_builds_the_vllm_shaped_server(models: tuple[Model, Model]) -> None:
    from speculant.cli import build_parser
    from speculant.server.cli import build_server

    target, draft = models
    args = build_parser().parse_args(
        ["serve", "--model", str(target.source), "--speculative-model", str(draft.source)]
        + ["--num-speculative-tokens", "4", "--dtype", "float32", "--max-model-len", "128"]
    )
    assert (args.host, args.port, args.max_num_seqs) == ("127.0.0.1", 8000, 8)
    assert (args.max_num_batched_tokens, args.enable_prefix_caching) == (32, True)
    app, engine = build_server(args)
    assert engine._sched.budget == 32 and engine.prefix_cache is not None
    assert engine.prefix_cache.max_bytes == 2**30
    off = build_parser().parse_args(
        ["serve", "--no-enable-prefix-caching", "--max-num-batched-tokens", "0"]
    )
    assert (off.max_num_batched_tokens, off.enable_prefix_caching) == (0, False)
    assert engine.method == "draft" and engine.num_speculative_tokens == 4
    assert engine.max_model_len == 128 and engine.model_name == str(target.source)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--num-speculative-tokens", "99"])


def test_serve_takes_vllms_speculative_config(models: tuple[Model, Model]) -> None:
    from speculant.cli import build_parser
    from speculant.server.cli import build_server

    target, draft = models
    base = ["serve", "--model", str(target.source), "--dtype", "float32"]
    config = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}'
    _, engine = build_server(build_parser().parse_args([*base, "--speculative-config", config]))
    assert engine.method == "ngram" and engine.num_speculative_tokens == 4
    assert engine.engine.proposer.ngram_max == 3
    config = json.dumps({"model": str(draft.source), "num_speculative_tokens": "auto"})
    args = build_parser().parse_args(
        [*base, "--draft-dtype", "float32", "--speculative-config", config]
    )
    _, engine = build_server(args)
    assert engine.method == "draft" and engine.num_speculative_tokens == "auto"
    for bad in (
        "{not json",
        '{"method": "medusa", "model": "x"}',
        '{"method": "ngram", "draft_tensor_parallel_size": 2}',
        '{"method": "eagle"}',
        '{"method": "ngram", "num_speculative_tokens": 99}',
    ):
        with pytest.raises(SystemExit):
            build_parser().parse_args([*base, "--speculative-config", bad])
    mixed = [*base, "--speculative-config", '{"method": "ngram"}', "--speculative-method", "suffix"]
    with pytest.raises(ValueError, match="use one form"):
        build_server(build_parser().parse_args(mixed))
