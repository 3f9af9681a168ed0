"""Schema-driven fuzzing of the server: request bodies generated from the server's own
/openapi.json (hypothesis-jsonschema), valid ones and ones with a field or a name
broken, sent to the real app on loopback with a tiny model behind it. No answer may be
a 5xx (nor a streamed server error), every refusal is an OpenAI error object, and the
server still answers a plain request after each case. Bounded: a fixed number of
examples, derandomized, so a run is the same every time."""

from __future__ import annotations

import copy
import json
from collections import Counter
from collections.abc import Iterator
from typing import Any

import httpx2 as httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis_jsonschema import from_schema
from serving import serving
from tiny import tiny_chat_model

from speculant import Engine
from speculant.server import AsyncEngine

EXAMPLES = 120  # per route
CONTEXT = 64  # keeps every generation short
SENT: Counter[str] = Counter()  # requests sent, by route and answer status


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    root = tmp_path_factory.mktemp("fuzz-models")
    target = tiny_chat_model(root / "target", seed=1, layers=2)
    draft = tiny_chat_model(root / "draft", seed=2, layers=1)
    engine = Engine(target, draft=draft, num_speculative_tokens=2, max_seq_len=CONTEXT)
    with serving(AsyncEngine(engine, model_name="tiny", max_num_seqs=2)) as base:
        yield base
    print(f"\nfuzzed requests sent: {dict(sorted(SENT.items()))}")


def _inline(node: Any, schemas: dict[str, Any]) -> Any:
    """The schema with every '#/components/schemas/X' reference replaced by X itself."""
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#/components/schemas/"):
            return _inline(schemas[ref.rsplit("/", 1)[1]], schemas)
        return {k: _inline(v, schemas) for k, v in node.items()}
    if isinstance(node, list):
        return [_inline(v, schemas) for v in node]
    return node


_SCHEMAS: dict[str, dict[str, Any]] = {}


def _request_schema(url: str, name: str) -> dict[str, Any]:
    """A request body's schema from the running server's /openapi.json."""
    if not _SCHEMAS:
        schemas = httpx.get(url + "/openapi.json", timeout=30).json()["components"]["schemas"]
        _SCHEMAS.update({k: _inline(copy.deepcopy(v), schemas) for k, v in schemas.items()})
    return _SCHEMAS[name]


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=8,
)


_STRATEGIES: dict[str, st.SearchStrategy[Any]] = {}
_IDS = {"type": "integer", "minimum": 0, "maximum": 255}
_NULL = {"type": "null"}
# Narrower values for some fields, so that more generated requests reach the engine
# (the served model's name, lengths within the context, token ids within the vocabulary).
_NARROW = {
    "model": {"anyOf": [{"const": "tiny"}, _NULL]},
    "max_tokens": {"anyOf": [{"type": "integer", "minimum": 1, "maximum": 24}, _NULL]},
    "max_completion_tokens": {"anyOf": [{"type": "integer", "minimum": 1, "maximum": 24}, _NULL]},
    "prompt": {
        "anyOf": [
            {"type": "string", "maxLength": 40},
            {"type": "array", "items": _IDS, "minItems": 1, "maxItems": 16},
        ]
    },
    "stop_token_ids": {"anyOf": [{"type": "array", "items": _IDS, "maxItems": 3}, _NULL]},
    "logit_bias": {
        "anyOf": [
            {
                "type": "object",
                "propertyNames": {"pattern": "^[0-9]{1,2}$"},
                "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100},
                "maxProperties": 3,
            },
            _NULL,
        ]
    },
}


def _narrowed(schema: dict[str, Any]) -> dict[str, Any]:
    props = {**schema["properties"]}
    props.update({k: v for k, v in _NARROW.items() if k in props})
    return {**schema, "properties": props}


def _bodies(url: str, name: str) -> st.SearchStrategy[Any]:
    """Valid bodies, valid bodies with one field's value or one name broken, any JSON."""
    if name in _STRATEGIES:
        return _STRATEGIES[name]
    schema = _request_schema(url, name)
    valid = from_schema(schema) | from_schema(_narrowed(schema))

    @st.composite
    def broken(draw: st.DrawFn) -> Any:
        body = dict(draw(valid))
        if body and draw(st.booleans()):
            body[draw(st.sampled_from(sorted(body)))] = draw(JSON)
        else:
            body[draw(st.text(min_size=1, max_size=12))] = draw(JSON)
        return body

    _STRATEGIES[name] = st.one_of(valid, broken(), JSON)
    return _STRATEGIES[name]


def _check(url: str, route: str, body: Any) -> None:
    raw = json.dumps(body).encode()
    r = httpx.post(f"{url}/v1/{route}", content=raw, timeout=60)
    SENT[f"{route} {r.status_code}"] += 1
    assert r.status_code in (200, 400, 404, 413), (r.status_code, body, r.text[:300])
    if r.status_code != 200:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"], r.text
    elif isinstance(body, dict) and body.get("stream") is True:
        assert r.text.rstrip().endswith("data: [DONE]"), r.text[-300:]
        assert "server_error" not in r.text, r.text[-300:]
    else:
        assert r.json()["choices"], r.text
    ok = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 1}, timeout=60)
    assert ok.status_code == 200, ok.text


FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


@FUZZ
@given(data=st.data())
def test_fuzz_completions(url: str, data: st.DataObject) -> None:
    _check(url, "completions", data.draw(_bodies(url, "CompletionRequest")))


@FUZZ
@given(data=st.data())
def test_fuzz_chat(url: str, data: st.DataObject) -> None:
    _check(url, "chat/completions", data.draw(_bodies(url, "ChatCompletionRequest")))
