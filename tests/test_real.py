"""Golden checks on real models pulled from the registry (SmolLM2 135M in CI)."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import real_model_path
from oracles import plain_greedy
from test_engine import ScriptedProposer

from speculant import Engine, SamplingParams, load_model
from speculant.cli import main
from speculant.proposers import TokenizerMismatchError

pytestmark = pytest.mark.real

CODE = 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'


@pytest.fixture(scope="module")
def smol_fp32():  # type: ignore[no-untyped-def]
    return load_model(real_model_path("smollm2-135m-instruct"), dtype="float32", progress=False)


def test_gguf_logits_and_greedy_match_transformers(smol_fp32) -> None:  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM

    path = smol_fp32.source
    ref = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    ids = smol_fp32.tokenizer.encode(CODE)
    with torch.no_grad():
        expected = ref(torch.tensor([ids])).logits[0]
        hf_out = ref.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False)[0]
    got = smol_fp32.forward(ids, smol_fp32.new_cache(64), 0)
    torch.testing.assert_close(got, expected, rtol=1e-3, atol=1e-3)
    ours = Engine(smol_fp32).generate(ids, SamplingParams(max_tokens=24, ignore_eos=True))
    assert ours.token_ids == hf_out[len(ids) :].tolist()


@pytest.mark.parametrize("wrong_at", [0, 2, 5])
def test_real_model_greedy_equivalence_bf16(smollm2, wrong_at: int) -> None:  # type: ignore[no-untyped-def]
    ids = smollm2.tokenizer.encode(CODE)
    reference = plain_greedy(smollm2, ids, 64)
    params = SamplingParams(max_tokens=64, ignore_eos=True)
    assert Engine(smollm2).generate(ids, params).token_ids == reference
    scripted = ScriptedProposer(ids, reference + [0] * 8, wrong_at, smollm2.vocab_size)
    res = Engine(smollm2, proposer=scripted, num_speculative_tokens=5).generate(ids, params)
    assert res.token_ids == reference
    assert res.stats.num_accepted == sum(min(wrong_at, r) for r in scripted.requested)


def test_real_self_draft_accepts_all(smollm2) -> None:  # type: ignore[no-untyped-def]
    ids = smollm2.tokenizer.encode(CODE)
    res = Engine(smollm2, draft=smollm2, num_speculative_tokens=4).generate(
        ids, SamplingParams(max_tokens=40, ignore_eos=True)
    )
    assert res.token_ids == plain_greedy(smollm2, ids, 40)
    assert res.stats.acceptance_rate == 1.0


def test_stop_string_and_eos(smollm2) -> None:  # type: ignore[no-untyped-def]
    tok = smollm2.tokenizer
    ids = tok.encode(
        tok.apply_chat_template([{"role": "user", "content": "What is 2+2?"}]),
        add_special_tokens=False,
    )
    res = Engine(smollm2).generate(ids, SamplingParams(max_tokens=100))
    assert res.finish_reason == "stop" and res.token_ids[-1] in tok.eos_token_ids
    full = Engine(smollm2).generate(ids, SamplingParams(max_tokens=100))
    word = full.text.split()[2]
    cut = Engine(smollm2, draft=smollm2).generate(ids, SamplingParams(max_tokens=100, stop=(word,)))
    assert cut.finish_reason == "stop"
    assert cut.text == full.text[: full.text.index(word)]


def test_tokenizer_mismatch_is_refused(smollm2) -> None:  # type: ignore[no-untyped-def]
    other = load_model(real_model_path("gemma-3-270m"), progress=False)
    with pytest.raises(TokenizerMismatchError, match="cannot draft"):
        Engine(smollm2, draft=other)


def test_cli_json(capsys) -> None:  # type: ignore[no-untyped-def]
    real_model_path("smollm2-135m-instruct")
    common = [
        "generate",
        "def add(a, b):",
        "--target",
        "smollm2-135m-instruct",
        "--max-tokens",
        "12",
        "--json",
        "--ignore-eos",
    ]
    # the default dtype (auto): target and draft both run the file's blocks natively, so a
    # self-draft agrees with the target at every position
    rc = main([*common, "--draft", "smollm2-135m-instruct"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == {"text", "token_ids", "finish_reason", "stats"}
    assert len(out["token_ids"]) == 12 and out["finish_reason"] == "length"
    assert set(out["stats"]) == {
        "num_drafted",
        "num_accepted",
        "acceptance_rate",
        "mean_accepted_length",
        "accepted_per_position",
        "target_forwards",
        "tokens_per_second",
    }
    assert out["stats"]["acceptance_rate"] == 1.0
    # An int8 draft changes acceptance, never the greedy tokens.
    assert main([*common, "--draft", "smollm2-135m-instruct", "--draft-dtype", "int8"]) == 0
    int8 = json.loads(capsys.readouterr().out)
    assert main([*common, "--method", "none"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert int8["token_ids"] == plain["token_ids"] == out["token_ids"]
    assert plain["stats"]["num_drafted"] == 0


def test_generate_default_k_follows_the_method(capsys, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Without -k, ngram (whose drafts stop where its match does) drafts up to 7, every
    other method 3; -k always wins."""
    import speculant

    real_model_path("smollm2-135m-instruct")
    seen: list[tuple[str, object]] = []

    class Spy(speculant.Engine):
        def __init__(self, *args, **kw):  # type: ignore[no-untyped-def]
            seen.append((kw["method"], kw["num_speculative_tokens"]))
            super().__init__(*args, **kw)

    monkeypatch.setattr(speculant, "Engine", Spy)
    base = ["generate", "x", "--target", "smollm2-135m-instruct", "--max-tokens", "2", "--json"]
    for extra in ([], ["--method", "suffix"], ["-k", "2"], ["--method", "ngram", "-k", "auto"]):
        assert main([*base, *extra]) == 0
    capsys.readouterr()
    assert seen == [("ngram", 7), ("suffix", 3), ("ngram", 2), ("ngram", "auto")]


def test_cli_bad_input_is_one_clear_line(capsys) -> None:  # type: ignore[no-untyped-def]
    assert main(["generate", "x", "--target", "nope-model", "--method", "none"]) == 2
    err = capsys.readouterr().err
    assert "unknown model 'nope-model'" in err and "Traceback" not in err
    assert main(["generate", "x", "--top-p", "1.5", "--method", "none"]) == 2
    assert "top_p=1.5" in capsys.readouterr().err


@pytest.mark.parametrize("dtype", ["bfloat16", "int8"])
def test_converted_weight_cache_roundtrip(dtype: str) -> None:
    from speculant.models import integrity, weight_cache

    path = real_model_path("smollm2-135m-instruct")
    first = load_model(path, dtype=dtype, progress=False)  # writes the cache if absent
    assert weight_cache.cache_path(path, dtype).is_file()
    again = weight_cache.load(path, dtype, integrity.file_sha256(path, progress=False))
    assert again is not None
    config, weights = again
    assert config == first.config
    from speculant.models.decoder import Transformer

    net = Transformer(config, weights, first.dtype)
    ids = torch.tensor(first.tokenizer.encode(CODE))
    a, _ = first.net.forward(ids, first.new_cache(64), 0)
    b, _ = net.forward(ids, net.new_cache(64), 0)
    assert a is not None and b is not None and torch.equal(a, b)


def test_flipped_byte_is_refused(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import shutil

    from speculant.models import integrity, registry

    src = real_model_path("smollm2-135m-instruct")
    monkeypatch.setenv("SPECULANT_HOME", str(tmp_path))
    dest = registry.model_path("smollm2-135m-instruct")
    dest.parent.mkdir(parents=True)
    shutil.copyfile(src, dest)
    assert integrity.check_integrity(dest, progress=False) is True  # the intact copy passes
    data = bytearray(dest.read_bytes())
    data[-100] ^= 0x01
    dest.write_bytes(bytes(data))
    with pytest.raises(integrity.IntegrityError, match="fails its integrity check") as err:
        load_model("smollm2-135m-instruct", progress=False)
    assert registry.KNOWN_MODELS["smollm2-135m-instruct"].sha256 in str(err.value)
    assert str(dest) in str(err.value)
    # The explicit escape hatch loads it (logged), and a file nothing vouches for loads too.
    assert load_model("smollm2-135m-instruct", progress=False, trust_unverified=True)
    loose = tmp_path / "elsewhere" / "model.gguf"
    loose.parent.mkdir()
    shutil.copyfile(dest, loose)
    assert integrity.check_integrity(loose, progress=False) is False
    # A manifest beside a loose file vouches for it, and is checked.
    (loose.parent / "manifest.json").write_text(
        json.dumps({"file": "model.gguf", "sha256": "0" * 64})
    )
    with pytest.raises(integrity.IntegrityError, match="manifest.json"):
        load_model(loose, progress=False)


# Prompts on which bfloat16 greedy speculation drifted from plain decoding on an AVX-512
# BF16 EPYC before the calibration's rows were made sensitive (first differing tokens 7-10).
DRIFT_PROMPTS = (
    "The three largest cities in France are",
    "Q: What is 17 * 23?\nA:",
    "<ul>\n  <li>apples</li>\n",
)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32", "int8", "int4"])
def test_every_method_equals_plain_on_the_real_model(dtype: str) -> None:
    """Greedy speculative output equals plain decoding token for token on SmolLM2 in every
    format, for every method (the draft is the same model in int4, the EAGLE head untrained
    so its drafts are mostly rejected), over several prompts and 64 tokens, on whichever
    CPU this runs."""
    from conftest import tiny_eagle_options

    from speculant.proposers import available_methods

    path = real_model_path("smollm2-135m-instruct")
    target = load_model(path, dtype=dtype, progress=False)
    draft = load_model(path, dtype="int4", progress=False)
    methods = [m for m in available_methods() if m != "none"]
    assert {"draft", "eagle", "layer-skip", "ngram", "suffix"} <= set(methods)
    params = SamplingParams(max_tokens=64, ignore_eos=True)
    failures = []
    for prompt in DRIFT_PROMPTS:
        ids = target.tokenizer.encode(prompt)
        reference = plain_greedy(target, ids, 64)
        for method in methods:
            options = tiny_eagle_options(target) if method == "eagle" else None
            engine = Engine(
                target,
                draft=draft if method == "draft" else None,
                method=method,
                num_speculative_tokens=3 if method == "layer-skip" else 5,
                proposer_options=options,
            )
            out = engine.generate(ids, params).token_ids
            if out != reference:
                at = next(i for i, (a, b) in enumerate(zip(out, reference, strict=False)) if a != b)
                failures.append(f"{method} on {prompt!r}: first differs at token {at}")
    assert not failures, f"{dtype}, padding {target.net.row_padding}: " + "; ".join(failures)
