"""The server under load and at shutdown: a full waiting queue answers 429 with
Retry-After and keeps serving, --request-timeout ends old requests with finish_reason
"abort", and SIGTERM drains `speculant serve` (503 for new requests, /health says
draining, running streams end properly, exit status 0)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx2 as httpx
import pytest
from serving import free_port, metrics, serving
from tiny import tiny_chat_model

from speculant import Engine, SamplingParams
from speculant.models.model import Model
from speculant.server import AsyncEngine

LONG = 800  # tokens: seconds of decoding with the slowed steps below


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Model, Model]:
    root = tmp_path_factory.mktemp("fault-models")
    return (
        tiny_chat_model(root / "target", seed=1, layers=3),
        tiny_chat_model(root / "draft", seed=2, layers=1),
    )


def _engine(models: tuple[Model, Model], step_delay: float, **kw: Any) -> AsyncEngine:
    """An AsyncEngine whose every step takes at least step_delay seconds, so that a long
    request is still running when the test acts, on any machine."""
    target, draft = models
    engine = AsyncEngine(
        Engine(target, draft=draft, num_speculative_tokens=3), model_name="tiny", **kw
    )
    step = engine._sched.step

    def slowed() -> Any:
        time.sleep(step_delay)
        return step()

    engine._sched.step = slowed  # type: ignore[method-assign]
    return engine


def _body(max_tokens: int, stream: bool = False, **kw: Any) -> dict[str, Any]:
    """A completion of max_tokens; streamed with logprobs, so that every step sends an
    event (a random model's text is mostly partial UTF-8, which is held back)."""
    if stream:
        kw.setdefault("logprobs", 0)
    return {
        "prompt": "red green",
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0,
        "stream": stream,
        **kw,
    }


def _events(lines: list[str]) -> list[Any]:
    """The data of an SSE stream's events; the stream must end with [DONE]."""
    data = [line[6:] for line in lines if line.startswith("data: ")]
    assert data and data[-1] == "[DONE]", lines[-3:]
    return [json.loads(d) for d in data[:-1]]


def _finish_reasons(events: list[Any]) -> list[str]:
    return [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]]


def test_full_queue_gets_429_with_retry_after(models: tuple[Model, Model]) -> None:
    engine = _engine(models, 0.02, max_num_seqs=1, max_waiting=1)
    with serving(engine) as url:
        key = "speculant:request_errors_total{status=429}"
        before = metrics(url).get(key, 0.0)
        waiter: dict[str, Any] = {}

        def wait_in_line() -> None:
            waiter["r"] = httpx.post(url + "/v1/completions", json=_body(4), timeout=60)

        thread = threading.Thread(target=wait_in_line)
        with (
            httpx.Client(timeout=60) as http,
            http.stream("POST", url + "/v1/completions", json=_body(LONG, True)) as running,
        ):
            assert running.status_code == 200
            lines = running.iter_lines()  # kept: a dropped iterator closes the stream
            next(line for line in lines if line.startswith("data: "))
            thread.start()  # the one place in the queue
            deadline = time.monotonic() + 20
            while len(engine._waiting) < 1:
                assert time.monotonic() < deadline, "the second request did not queue"
                time.sleep(0.01)
            refused = httpx.post(url + "/v1/completions", json=_body(4), timeout=30)
            assert refused.status_code == 429
            assert refused.json() == {
                "error": {
                    "message": "too many requests: 1 already wait for a slot and at most 1 "
                    "may wait (--max-waiting); retry after 1 s",
                    "type": "rate_limit_error",
                    "param": None,
                    "code": "queue_full",
                }
            }
            assert refused.headers["Retry-After"] == "1"  # no request has finished yet
            assert len(engine._waiting) == 1  # nothing was queued for the refused one
        # the long stream hung up: the queued request runs, and so do new ones
        thread.join(timeout=30)
        assert waiter["r"].status_code == 200
        assert waiter["r"].json()["choices"][0]["finish_reason"] == "length"
        again = httpx.post(url + "/v1/completions", json=_body(4), timeout=30)
        assert again.status_code == 200 and again.json()["usage"]["completion_tokens"] == 4
        assert metrics(url)[key] == before + 1

        engine.max_waiting = 0  # no waiting room: what does not fit now is refused
        with (
            httpx.Client(timeout=60) as http,
            http.stream("POST", url + "/v1/completions", json=_body(LONG, True)) as running,
        ):
            lines = running.iter_lines()  # kept: a dropped iterator closes the stream
            next(line for line in lines if line.startswith("data: "))
            refused = httpx.post(
                url + "/v1/chat/completions",
                json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
                timeout=30,
            )
            assert refused.status_code == 429
            error = refused.json()["error"]
            assert error["code"] == "queue_full"
            assert "0 already wait for a slot and at most 0 may wait" in error["message"]
            assert int(refused.headers["Retry-After"]) >= 1
        assert metrics(url)[key] == before + 2


def test_request_timeout_ends_requests_with_abort(models: tuple[Model, Model]) -> None:
    timeout = 1.0
    engine = _engine(models, 0.02, max_num_seqs=1, request_timeout=timeout)
    with serving(engine) as url:
        key = "speculant:request_success_total{finished_reason=timeout}"
        before = metrics(url).get(key, 0.0)

        async def run() -> tuple[list[str], httpx.Response, float]:
            async with httpx.AsyncClient(timeout=60) as http:
                t0 = time.monotonic()

                async def streamed() -> list[str]:
                    body = _body(LONG, True, stream_options={"include_usage": True})
                    async with http.stream("POST", url + "/v1/completions", json=body) as r:
                        assert r.status_code == 200
                        return [line async for line in r.aiter_lines()]

                async def whole() -> httpx.Response:
                    await asyncio.sleep(0.1)  # arrives second: waits, then runs
                    return await http.post(url + "/v1/completions", json=_body(LONG))

                lines, response = await asyncio.gather(streamed(), whole())
                return lines, response, time.monotonic() - t0

        lines, response, elapsed = asyncio.run(run())
        # both ended by the timeout, far before their 800 tokens
        assert timeout <= elapsed < 15
        events = _events(lines)
        assert _finish_reasons(events) == ["abort"]
        usage = events[-1]["usage"]
        text = "".join(c["text"] for e in events for c in e["choices"])
        assert 0 < usage["completion_tokens"] < LONG and text
        assert response.status_code == 200
        body = response.json()
        assert body["choices"][0]["finish_reason"] == "abort"
        assert body["usage"]["completion_tokens"] < LONG
        # a request within its time is untouched, and the server goes on
        short = httpx.post(url + "/v1/completions", json=_body(3), timeout=30).json()
        assert short["choices"][0]["finish_reason"] == "length"
        m = metrics(url)
        assert m[key] == before + 2
        assert m["speculant:num_requests_running"] == 0
        assert not engine._active and not engine._waiting and engine.idle


def test_sigterm_drains_and_exits_0(models: tuple[Model, Model], tmp_path: Path) -> None:
    # A context of 8192 tokens: the long request cannot finish within the drain.
    folders = []
    for model in models:
        folder = tmp_path / Path(str(model.source)).name
        shutil.copytree(str(model.source), folder)
        config = json.loads((folder / "config.json").read_text())
        config["max_position_embeddings"] = 8192
        (folder / "config.json").write_text(json.dumps(config))
        folders.append(str(folder))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    drain = 6.0
    cmd = [sys.executable, "-c", "import sys; from speculant.cli import main; sys.exit(main())"]
    cmd += ["serve", "--model", folders[0], "--speculative-model", folders[1]]
    cmd += ["--dtype", "float32", "--draft-dtype", "float32", "--port", str(port)]
    cmd += ["--drain-timeout", str(drain), "--log-level", "warning"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.communicate()[0]
            assert time.monotonic() < deadline, "the server did not start"
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        outcome = asyncio.run(_drain_scenario(url, proc, drain))
        code = proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    log = proc.communicate()[0]
    assert code == 0, log
    assert "draining" in log and "Traceback" not in log, log

    short, short2, long_, whole, signalled_at, ended_at = outcome
    for lines in (short, short2):  # finished within the drain, properly
        assert _finish_reasons(_events(lines)) == ["length"]
    events = _events(long_)  # ended at the drain's deadline
    assert _finish_reasons(events) == ["abort"]
    assert events[-1]["usage"]["completion_tokens"] > 0
    assert drain - 1 < ended_at - signalled_at < drain + 10
    assert whole.status_code == 200
    body = whole.json()
    assert body["choices"][0]["finish_reason"] == "abort"
    assert body["choices"][0]["text"] and body["usage"]["completion_tokens"] > 0


async def _drain_scenario(url: str, proc: subprocess.Popen[str], drain: float) -> Any:
    started = [asyncio.Event() for _ in range(3)]
    ended: list[float] = []
    async with httpx.AsyncClient(timeout=60) as http:

        async def stream(i: int, max_tokens: int) -> list[str]:
            body = _body(max_tokens, True, stream_options={"include_usage": True})
            lines = []
            async with http.stream("POST", url + "/v1/completions", json=body) as r:
                assert r.status_code == 200
                async for line in r.aiter_lines():
                    lines.append(line)
                    started[i].set()
            ended.append(time.monotonic())
            return lines

        tasks = [
            asyncio.ensure_future(stream(0, 150)),
            asyncio.ensure_future(stream(1, 150)),
            asyncio.ensure_future(stream(2, 8000)),
            asyncio.ensure_future(http.post(url + "/v1/completions", json=_body(8000))),
        ]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), timeout=30)
        assert not ended, "a stream ended before the signal"
        signalled_at = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        # draining: /health says so and new requests are refused, while the others run
        deadline = time.monotonic() + 5
        while (health := await http.get(url + "/health")).status_code == 200:
            assert time.monotonic() < deadline, "/health did not report draining"
            await asyncio.sleep(0.02)
        assert health.status_code == 503 and health.json() == {"status": "draining"}
        refused = await http.post(url + "/v1/completions", json=_body(4))
        assert refused.status_code == 503
        assert refused.json()["error"]["code"] == "server_draining"
        assert refused.json()["error"]["type"] == "server_error"
        assert proc.poll() is None and len(ended) < 3
        short, short2, long_, whole = await asyncio.wait_for(
            asyncio.gather(*tasks), timeout=drain + 20
        )
    return short, short2, long_, whole, signalled_at, max(ended)


if os.name == "nt":  # pragma: no cover
    pytestmark = pytest.mark.skip("SIGTERM drain is POSIX")


def test_flags_and_their_errors(
    models: tuple[Model, Model], capsys: pytest.CaptureFixture[str]
) -> None:
    from speculant.cli import build_parser

    args = build_parser().parse_args(["serve"])
    assert (args.max_waiting, args.request_timeout, args.drain_timeout) == (64, None, 30.0)
    args = build_parser().parse_args(
        ["serve", "--max-waiting", "0", "--request-timeout", "2.5", "--drain-timeout", "0"]
    )
    assert (args.max_waiting, args.request_timeout, args.drain_timeout) == (0, 2.5, 0.0)
    for flag, value, allowed in (
        ("--max-waiting", "-1", "-1 is out of range: use >= 0"),
        ("--request-timeout", "0", "0.0 is out of range: use a number of seconds > 0"),
        ("--drain-timeout", "soon", "'soon': use a number of seconds >= 0"),
        ("--drain-timeout", "inf", "inf is out of range: use a number of seconds >= 0"),
    ):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", flag, value])
        assert allowed in capsys.readouterr().err
    target, _ = models
    for kw, message in (
        ({"max_waiting": -1}, "max_waiting=-1 is out of range: use >= 0"),
        ({"request_timeout": 0.0}, "request_timeout=0.0 is out of range: use > 0 seconds"),
    ):
        with pytest.raises(ValueError, match=re.escape(message)):
            AsyncEngine(Engine(target), model_name="tiny", **kw)


def test_mixed_load_loses_nothing(models: tuple[Model, Model]) -> None:
    """48 concurrent clients through the openai client against a server that prefills in
    chunks and caches prefixes: short and long prompts (several sharing a long header),
    streaming and not, two slow readers, two clients that hang up mid-stream. Every
    finished text equals its solo greedy output, the hung-up requests are cancelled, the
    server still answers, and the counters add up to what the clients received."""
    import openai

    target, draft = models
    assert target.tokenizer is not None
    header = "system: answer in colors. " * 12  # a long shared prefix
    prompts = [
        (header if i % 3 == 0 else "") + f"copy {i}: red green blue {i % 7}" for i in range(48)
    ]
    solo = Engine(target, draft=draft, num_speculative_tokens=3)
    expected = [
        solo.generate(
            target.tokenizer.encode(p), SamplingParams(max_tokens=8, ignore_eos=True)
        ).text
        for p in prompts
    ]
    engine = AsyncEngine(
        Engine(target, draft=draft, num_speculative_tokens=3),
        model_name="tiny",
        max_num_seqs=8,
        max_num_batched_tokens=8,
        prefix_cache_bytes=1 << 24,
    )
    hang_up = {5, 17}
    slow = {7, 20}
    with serving(engine) as url:
        before = metrics(url)

        async def one(client: openai.AsyncOpenAI, i: int) -> tuple[str | None, int]:
            kw: dict[str, Any] = dict(model="tiny", prompt=prompts[i], max_tokens=8, temperature=0)
            if i in hang_up:  # one event, then gone
                async with httpx.AsyncClient(timeout=60) as http:
                    body = {**_body(200, stream=True), "prompt": prompts[i]}
                    async with http.stream("POST", url + "/v1/completions", json=body) as r:
                        async for line in r.aiter_lines():
                            if line.startswith("data: "):
                                break
                return None, 0
            if i % 2:
                stream = await client.completions.create(
                    **kw, stream=True, extra_body={"ignore_eos": True}
                )
                text, n = "", 0
                async for chunk in stream:
                    if i in slow:
                        await asyncio.sleep(0.2)
                    text += chunk.choices[0].text if chunk.choices else ""
                    n += 1
                return text, 8
            res = await client.completions.create(**kw, extra_body={"ignore_eos": True})
            assert res.usage is not None
            return res.choices[0].text, res.usage.completion_tokens

        async def run() -> list[tuple[str | None, int]]:
            client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
            async with client:
                jobs = [one(client, i) for i in range(48)]
                return await asyncio.wait_for(asyncio.gather(*jobs), timeout=240)

        got = asyncio.run(run())
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not engine.idle:
            time.sleep(0.1)
        after = metrics(url)
        ok = httpx.post(url + "/v1/completions", json=_body(2), timeout=30)
        assert ok.status_code == 200
    for i, (text, _) in enumerate(got):
        if i not in hang_up:
            assert text == expected[i], i

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert delta("speculant:request_success_total{finished_reason=length}") == 46
    assert delta("speculant:request_success_total{finished_reason=cancelled}") == 2
    finished_tokens = sum(n for i, (_, n) in enumerate(got) if i not in hang_up)
    generated = delta("speculant:generation_tokens_total")
    assert finished_tokens == 46 * 8 and generated >= finished_tokens
    assert delta("speculant:prefix_cache_hits_total") > 0  # the shared header
