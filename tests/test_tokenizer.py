"""Tests of speculant.models.tokenizer: a tiny tokenizer built in code, and the real models."""

from __future__ import annotations

import json
import os
import random
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from conftest import real_model_path
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from speculant.detokenize import IncrementalDecoder, TextTracker
from speculant.models import tokenizer as tokmod
from speculant.models.tokenizer import Tokenizer

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

CHATML = (
    "{% for m in messages %}"
    "{% if m['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('bad role: ' + m['role']) }}{% endif %}"
    "{{ bos_token if loop.first else '' }}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if tools %}<tools>{{ tools | tojson }}</tools>\n{% endif %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

CORPUS = [
    "hello world, héllo wörld! naïve café résumé",
    "日本語のテキスト 中文字符 한국어",
    "emoji 😀🎉👩‍👩‍👧 ok",
    "def f(x):\n\treturn x + 1\n\n    pass",
    "the quick brown fox jumps over the lazy dog 12345 3.14",
]

# Multi-byte text: the tiny vocabulary has few merges, so characters split across tokens.
STREAM_TEXTS = [
    "héllo 日本語 😀🎉 wörld, naïve 👩‍👩‍👧!",
    "plain ascii text\n\twith tabs",
    "中文字符和한국어 mixed with café",
]

VARIED_TEXTS = [
    "Hello world",
    "",
    " leading space and trailing   ",
    "def f(x):\n\tif x:\n\t\treturn  x**2  # comment\n\n\n    pass\n",
    "naïve café — résumé, Ångström, Željko",
    "日本語のテキスト 中文 한국어 😀🎉 👩‍👩‍👧 🇫🇷",
    "12345 3.14159 1,000,000 0x1F -42 2024-01-01",
    "a  b   c    d\n\n\n\r\n e\t\tf",
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n",
    "<start_of_turn>user\nhi<end_of_turn>\n<bos>x<eos>",
    "<|endoftext|>text after eot",
]

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Write a haiku about café 😀 and\n  indentation."},
    {"role": "assistant", "content": "Héllo, 世界!\n\tdone"},
    {"role": "user", "content": "again"},
]


# ---------------------------------------------------------------- tiny tokenizer


def _train_tiny() -> HFTokenizer:
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=330,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 10, trainer)
    return tok


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-tokenizer")
    _train_tiny().save(str(path / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "chat_template": CHATML,
        "clean_up_tokenization_spaces": False,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    return path


@pytest.fixture(scope="module")
def tiny(tiny_dir: Path) -> Tokenizer:
    tok = Tokenizer.from_hf_dir(tiny_dir)
    assert tok is not None
    return tok


def test_from_hf_dir_none_without_tokenizer_files(tmp_path: Path) -> None:
    assert Tokenizer.from_hf_dir(tmp_path) is None
    (tmp_path / "config.json").write_text("{}")
    assert Tokenizer.from_hf_dir(tmp_path) is None
    assert Tokenizer.from_hf_dir(tmp_path / "missing") is None


def test_tiny_attributes(tiny: Tokenizer) -> None:
    assert tiny.vocab_size == 330
    assert tiny.bos_token_id == 1
    assert tiny.eos_token_id == 2
    # eos + generation_config's list + the ChatML end-of-turn tokens
    assert tiny.eos_token_ids == frozenset({0, 2})
    assert tiny.chat_template == CHATML
    assert tiny.special_token_ids >= {0, 1, 2}
    assert len(tiny.fingerprint()) == 64


def test_tiny_encode_decode(tiny: Tokenizer) -> None:
    for text in VARIED_TEXTS:
        ids = tiny.encode(text, add_special_tokens=False)
        assert all(0 <= i < tiny.vocab_size for i in ids)
        assert tiny.decode(ids) == text
    ids = tiny.encode("a<|im_start|>b<|im_end|>")
    assert 1 in ids and 2 in ids
    assert tiny.decode(ids, skip_special_tokens=True) == "ab"


def test_tiny_matches_transformers(tiny_dir: Path, tiny: Tokenizer) -> None:
    transformers = pytest.importorskip("transformers")
    ref = transformers.AutoTokenizer.from_pretrained(str(tiny_dir))
    for text in VARIED_TEXTS:
        for special in (True, False):
            ids = tiny.encode(text, add_special_tokens=special)
            assert ids == ref.encode(text, add_special_tokens=special), text
            for skip in (True, False):
                assert tiny.decode(ids, skip_special_tokens=skip) == ref.decode(
                    ids, skip_special_tokens=skip
                )
    for gen in (True, False):
        expected = ref.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=gen)
        assert tiny.apply_chat_template(MESSAGES, add_generation_prompt=gen) == expected
    tools = [{"type": "function", "function": {"name": "f", "description": "é"}}]
    expected = ref.apply_chat_template(MESSAGES, tools=tools, tokenize=False)
    assert tiny.apply_chat_template(MESSAGES, False, tools=tools) == expected


def test_tiny_without_transformers_same(tiny_dir: Path, tiny: Tokenizer) -> None:
    plain = tokmod._hf_dir_without_transformers(tiny_dir, [2, 0])
    assert plain.fingerprint() == tiny.fingerprint()
    assert plain.eos_token_ids == tiny.eos_token_ids
    assert plain.bos_token_id == tiny.bos_token_id
    assert plain.chat_template == tiny.chat_template
    for text in VARIED_TEXTS:
        assert plain.encode(text) == tiny.encode(text)
    assert plain.apply_chat_template(MESSAGES) == tiny.apply_chat_template(MESSAGES)


def test_chat_template_rendering(tiny: Tokenizer) -> None:
    out = tiny.apply_chat_template([{"role": "user", "content": "hi"}])
    assert out == "<|im_start|><|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    out = tiny.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=False)
    assert not out.endswith("assistant\n")
    with pytest.raises(Exception, match="bad role"):
        tiny.apply_chat_template([{"role": "wizard", "content": "x"}])
    with pytest.raises(ValueError):
        tiny.apply_chat_template([])
    # the environment is sandboxed
    evil = "{{ messages.__class__.__mro__ }}"
    with pytest.raises(Exception):  # noqa: B017
        tiny.apply_chat_template([{"role": "user", "content": "x"}], chat_template=evil)


def _stream(tok: Tokenizer, ids: list[int], chunks: list[int]) -> list[str]:
    """The text a TextTracker releases after each chunk of ids, then at the end."""
    tracker = TextTracker(SimpleNamespace(tokenizer=tok), ())  # type: ignore[arg-type]
    out: list[str] = []
    pos = 0
    for n in [*chunks, len(ids)]:
        for t in ids[pos : pos + n]:
            tracker.push(t)
        out.append(tracker.release(final=False))
        pos += n
    out.append(tracker.release(final=True))
    return out


def _check_stream(tok: Tokenizer, text: str, seed: int = 0) -> None:
    ids = tok.encode(text, add_special_tokens=False)
    rng = random.Random(seed)
    one_by_one = _stream(tok, ids, [1] * len(ids))
    assert "".join(one_by_one) == tok.decode(ids, skip_special_tokens=True)
    # nothing but the final release may carry a replacement character
    assert not any("\ufffd" in piece for piece in one_by_one[:-1])
    chunks = [rng.randint(1, 4) for _ in range(len(ids))]
    assert "".join(_stream(tok, ids, chunks)) == tok.decode(ids, skip_special_tokens=True)
    ids_sp = [*ids[:3], *tok.encode("<|im_end|>", False), *ids[3:]]
    if tok.eos_token_id is not None:
        ids_sp.append(tok.eos_token_id)
    pieces = _stream(tok, ids_sp, [1] * len(ids_sp))
    assert "".join(pieces) == tok.decode(ids_sp, skip_special_tokens=True)
    for skip in (False, True):  # the decoder under it, after every id, either way
        dec = IncrementalDecoder(lambda xs, s=skip: tok.decode(xs, skip_special_tokens=s))
        for i, t in enumerate(ids_sp):
            dec.ids.append(t)
            assert dec.text == tok.decode(ids_sp[: i + 1], skip_special_tokens=skip)


def test_stream_decoder_tiny(tiny: Tokenizer) -> None:
    for i, text in enumerate(STREAM_TEXTS):
        ids = tiny.encode(text, add_special_tokens=False)
        # the tiny vocabulary splits multi-byte characters, so some pushes are held back
        assert text.isascii() or any("\ufffd" in tiny.decode(ids[:k]) for k in range(1, len(ids)))
        _check_stream(tiny, text, seed=i)


def test_stream_decoder_holds_incomplete_utf8(tiny: Tokenizer) -> None:
    ids = tiny.encode("😀", add_special_tokens=False)
    assert len(ids) > 1
    tracker = TextTracker(SimpleNamespace(tokenizer=tiny), ())  # type: ignore[arg-type]
    held = []
    for t in ids[:-1]:
        tracker.push(t)
        held.append(tracker.release(final=False))
    assert held == [""] * (len(ids) - 1)
    tracker.push(ids[-1])
    assert tracker.release(final=False) == "😀"
    assert tracker.release(final=True) == ""
    # an incomplete character left at the end comes out on the final release
    tracker = TextTracker(SimpleNamespace(tokenizer=tiny), ())  # type: ignore[arg-type]
    tracker.push(ids[0])
    assert tracker.release(final=False) == ""
    assert tracker.release(final=True) == tiny.decode(ids[:1])


# ---------------------------------------------------------------- GGUF + cache


def _write_tiny_gguf(path: Path) -> HFTokenizer:
    gguf = pytest.importorskip("gguf")
    import numpy as np

    tok = _train_tiny()
    spec = json.loads(tok.to_str())
    vocab: dict[str, int] = spec["model"]["vocab"]
    tokens = [""] * len(vocab)
    for token, idx in vocab.items():
        tokens[idx] = token
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(8)
    w.add_feed_forward_length(16)
    w.add_head_count(2)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_merges(merges)
    w.add_token_types([3 if t in SPECIALS else 1 for t in tokens])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(CHATML)
    w.add_tensor("token_embd.weight", np.zeros((len(tokens), 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return tok


def test_gguf_metadata_reader(tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    _write_tiny_gguf(path)
    md = tokmod.read_gguf_metadata(path)
    assert md["general.architecture"] == "llama"
    assert md["tokenizer.ggml.model"] == "gpt2"
    assert md["tokenizer.ggml.tokens"] == 330  # string arrays are counted unless asked for
    assert md["tokenizer.ggml.eos_token_id"] == 2
    assert md["tokenizer.chat_template"] == CHATML
    full = tokmod.read_gguf_metadata(path, string_arrays=True)
    assert full["tokenizer.ggml.tokens"][:3] == SPECIALS
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"NOPE" + bytes(32))
    with pytest.raises(tokmod.TokenizerError):
        tokmod.read_gguf_metadata(bad)


def test_from_gguf_and_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    transformers = pytest.importorskip("transformers")
    path = tmp_path / "tiny-model.gguf"
    _write_tiny_gguf(path)
    tok = Tokenizer.from_gguf(path)
    cache = tmp_path / "tiny-model.tokenizer"
    assert (cache / "tokenizer.json").is_file()
    meta = json.loads((cache / "speculant_tokenizer.json").read_text(encoding="utf-8"))
    assert meta["key"]["size"] == path.stat().st_size
    assert not [p for p in cache.iterdir() if p.name.endswith(".tmp")]
    assert tok.vocab_size == 330
    assert tok.bos_token_id == 1
    assert tok.eos_token_ids == frozenset({0, 2})
    assert tok.chat_template == CHATML

    ref = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    for text in VARIED_TEXTS:
        for special in (True, False):
            assert tok.encode(text, special) == ref.encode(text, add_special_tokens=special)
    expected = ref.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert tok.apply_chat_template(MESSAGES) == expected

    # a second load comes from the cache, without transformers
    t0 = time.perf_counter()
    again = Tokenizer.from_gguf(path)
    assert time.perf_counter() - t0 < 1.0
    assert again.fingerprint() == tok.fingerprint()
    assert again.eos_token_ids == tok.eos_token_ids
    assert again.encode(VARIED_TEXTS[5]) == tok.encode(VARIED_TEXTS[5])

    def no_convert(p: Path) -> Any:
        raise AssertionError("converted again")

    with monkeypatch.context() as m:
        m.setattr(tokmod, "_convert_gguf", no_convert)
        assert Tokenizer.from_gguf(path).fingerprint() == tok.fingerprint()

    # a changed file (mtime) invalidates the cache; a corrupt cache is rebuilt
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 5_000_000_000))
    (cache / "tokenizer.json").write_text("{corrupt", encoding="utf-8")
    rebuilt = Tokenizer.from_gguf(path)
    assert rebuilt.fingerprint() == tok.fingerprint()
    meta = json.loads((cache / "speculant_tokenizer.json").read_text(encoding="utf-8"))
    assert meta["key"]["mtime_ns"] == path.stat().st_mtime_ns


# ---------------------------------------------------------------- real models

REAL = ["smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct"]
REAL += ["gemma-3-270m"]

# Ids from transformers' AutoTokenizer.from_pretrained(dir, gguf_file=...), with special tokens.
KNOWN_IDS: dict[str, dict[str, list[int]]] = {
    "qwen2.5-coder-0.5b-instruct": {
        "Hello world": [9707, 1879],
        "def f(x):\n\treturn  x  # é": [750, 282, 2075, 982, 853, 220, 856, 220, 671, 3958],
        "日本語 😀 café 12345": [101059, 102819, 90316, 51950, 220, 16, 17, 18, 19, 20],
    },
    "gemma-3-270m": {
        "Hello world": [2, 9259, 1902],
        "def f(x):\n\treturn  x  # é": [
            2,
            2063,
            517,
            236769,
            236781,
            1473,
            107,
            255968,
            2060,
            138,
            236781,
            138,
            236865,
            1559,
        ],
        "日本語 😀 café 12345": [
            2,
            94951,
            163543,
            33443,
            236743,
            236770,
            236778,
            236800,
            236812,
            236810,
        ],
    },
    "smollm2-135m-instruct": {
        "Hello world": [19556, 905],
        "def f(x):\n\treturn  x  # é": [
            1604,
            275,
            24,
            104,
            727,
            198,
            197,
            5406,
            216,
            1792,
            216,
            907,
            26411,
        ],
        "日本語 😀 café 12345": [
            23274,
            115,
            40993,
            179,
            120,
            248,
            40303,
            218,
            37366,
            216,
            33,
            34,
            35,
            36,
            37,
        ],
    },
}
KNOWN_IDS["qwen2.5-coder-1.5b-instruct"] = KNOWN_IDS["qwen2.5-coder-0.5b-instruct"]

END_OF_TURN = {
    "smollm2-135m-instruct": "<|im_end|>",
    "qwen2.5-coder-0.5b-instruct": "<|im_end|>",
    "qwen2.5-coder-1.5b-instruct": "<|im_end|>",
    "gemma-3-270m": "<end_of_turn>",
}

_LOADED: dict[str, Tokenizer] = {}


def real_tokenizer(name: str) -> Tokenizer:
    if name not in _LOADED:
        _LOADED[name] = Tokenizer.from_gguf(real_model_path(name))
    return _LOADED[name]


@pytest.mark.real
@pytest.mark.parametrize("name", REAL)
def test_real_tokenizer(name: str) -> None:
    tok = real_tokenizer(name)
    for text, ids in KNOWN_IDS[name].items():
        assert tok.encode(text) == ids, text
    for text in VARIED_TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == text
    end = tok.token_to_id(END_OF_TURN[name])
    assert end is not None and end in tok.eos_token_ids
    assert tok.eos_token_id in tok.eos_token_ids
    assert tok.vocab_size >= 49152
    if name != "gemma-3-270m":
        rendered = tok.apply_chat_template(MESSAGES)
        assert rendered.rstrip().endswith("assistant")
        ids = tok.encode(rendered, add_special_tokens=False)
        assert tok.token_to_id("<|im_start|>") in ids
        assert tok.decode(ids) == rendered


@pytest.mark.real
@pytest.mark.parametrize("name", REAL)
def test_real_stream_decoder(name: str) -> None:
    tok = real_tokenizer(name)
    for i, text in enumerate([*STREAM_TEXTS, VARIED_TEXTS[5], VARIED_TEXTS[3]]):
        _check_stream(tok, text, seed=i)


@pytest.mark.real
def test_real_fingerprints() -> None:
    small = real_tokenizer("qwen2.5-coder-0.5b-instruct")
    large = real_tokenizer("qwen2.5-coder-1.5b-instruct")
    smol = real_tokenizer("smollm2-135m-instruct")
    gemma = real_tokenizer("gemma-3-270m")
    assert small.fingerprint() == large.fingerprint()
    assert small.vocab_size == large.vocab_size == 151936
    assert len({small.fingerprint(), smol.fingerprint(), gemma.fingerprint()}) == 3


@pytest.mark.real
def test_real_cached_load_is_fast() -> None:
    path = real_model_path("smollm2-135m-instruct")
    first = real_tokenizer("smollm2-135m-instruct")  # builds the cache if needed
    t0 = time.perf_counter()
    again = Tokenizer.from_gguf(path)
    assert time.perf_counter() - t0 < 1.0
    assert again.fingerprint() == first.fingerprint()


@pytest.fixture(scope="module")
def smol_reference() -> Iterator[Any]:
    transformers = pytest.importorskip("transformers")
    path = real_model_path("smollm2-135m-instruct")
    yield transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.mark.real
def test_real_smollm2_matches_transformers(smol_reference: Any) -> None:
    tok = real_tokenizer("smollm2-135m-instruct")
    ref = smol_reference
    for gen in (True, False):
        expected = ref.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=gen)
        assert tok.apply_chat_template(MESSAGES, add_generation_prompt=gen) == expected
    texts = [*VARIED_TEXTS, ref.apply_chat_template(MESSAGES, tokenize=False)]
    for text in texts:
        for special in (True, False):
            ids = tok.encode(text, add_special_tokens=special)
            assert ids == ref.encode(text, add_special_tokens=special), text
            for skip in (True, False):
                assert tok.decode(ids, skip_special_tokens=skip) == ref.decode(
                    ids, skip_special_tokens=skip
                )
    assert tok.bos_token_id == ref.bos_token_id
    assert tok.eos_token_id == ref.eos_token_id
    assert tok.vocab_size == len(ref)


@pytest.mark.real
@pytest.mark.parametrize("name", ["smollm2-135m-instruct", "gemma-3-270m"])
def test_streamed_text_equals_a_whole_decode_in_linear_work(name: str) -> None:
    """The scheduler's TextTracker decodes incrementally: after every token its text is
    what decoding all the ids at once gives (long whitespace tokens, multi-byte
    characters split over byte tokens, special tokens, a space-prefix tokenizer), and
    the ids it decodes in all grow linearly with the output, not quadratically."""
    import random
    from types import SimpleNamespace

    from speculant.detokenize import TextTracker

    tok = real_tokenizer(name)
    decoded = [0]

    class Counting:
        def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
            decoded[0] += len(ids)
            return tok.decode(ids, skip_special_tokens=skip_special_tokens)

    text = "".join(VARIED_TEXTS) + "def f(x):\n" + " " * 40 + "return x  # ünïcödé 漢字 🙂\n"
    ids = tok.encode(text * 4, add_special_tokens=False)
    rng = random.Random(0)
    noise = [rng.randrange(tok.vocab_size) for _ in range(300)]
    for seq in (ids, noise):
        decoded[0] = 0
        tracker = TextTracker(SimpleNamespace(tokenizer=Counting()), ("never-here",))  # type: ignore[arg-type]
        for i, t in enumerate(seq):
            tracker.push(t)
            assert tracker.text == tok.decode(seq[: i + 1], skip_special_tokens=True), i
        n = len(seq)
        assert decoded[0] < n * n / 8, (decoded[0], n)


@pytest.mark.parametrize(
    ("template", "message"),
    [
        # ten billion loop steps: stopped by the time budget
        (
            "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
            "s budget",
        ),
        ("{{ 'x' * 5000000000 }}", "a repeated value of 5000000000 characters"),
        ("{% for i in range(100000) %}{{ 'x' * 50000 }}{% endfor %}", "the rendered prompt"),
        ("{{ 'x' | center(1000000000) }}", "an argument of 1000000000"),
        ("{{ 'x'.ljust(1000000000) }}", "an argument of 1000000000"),
        ("{{ 2 ** 100000000 }}", "an exponent"),
        ("{{ range(10000000) | list }}", "10000000"),
        ("{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}", "RecursionError"),
        ("{{ messages.__class__.__mro__ }}", "failed"),
        ("{{ cycler.__init__.__globals__ }}", "failed"),
        ("{{ lipsum.__globals__['os'] }}", "failed"),
        ("{% for %}", "failed"),  # not a template
    ],
)
def test_templates_are_bounded_and_fail_in_one_line(
    tiny: Tokenizer, monkeypatch: pytest.MonkeyPatch, template: str, message: str
) -> None:
    """A template that loops, multiplies, pads, recurses or reaches past the sandbox is
    stopped within its time and output budget, with one ChatTemplateError (a ValueError)
    naming the template, before it allocates what it asks for."""
    import time

    import jinja2

    from speculant.models import chat_template

    monkeypatch.setattr(chat_template, "TIME_BUDGET_S", 0.5)
    t0 = time.monotonic()
    with pytest.raises(chat_template.ChatTemplateError, match=message) as info:
        tiny.apply_chat_template([{"role": "user", "content": "x"}], chat_template=template)
    assert time.monotonic() - t0 < 30  # a bound on a hang (the budget is 0.5 s)
    assert str(info.value).startswith("the chat template given failed")
    assert isinstance(info.value, ValueError) and isinstance(info.value, jinja2.TemplateError)
    assert "\n" not in str(info.value)
