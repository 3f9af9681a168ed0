"""`speculant bench --serve` end to end on tiny random models: the real server on
loopback, the openai client, the scenarios, the report files, and its argument errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tiny import tiny_chat_model

from speculant.cli import main
from speculant.models.model import Model

pytest.importorskip("openai")


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Model, Model]:
    root = tmp_path_factory.mktemp("serve-bench-models")
    return (
        tiny_chat_model(root / "target", seed=1, layers=2),
        tiny_chat_model(root / "draft", seed=2, layers=1),
    )


def test_bench_serve_end_to_end(pair: tuple[Model, Model], tmp_path: Path) -> None:
    target, draft = pair
    out = tmp_path / "out"
    argv = ["bench", "--serve", "--target", str(target.source), "--draft", str(draft.source)]
    argv += ["--dtype", "float32", "--draft-dtype", "float32", "--workloads", "qa"]
    argv += ["--methods", "ngram:2,draft:2", "--concurrency", "1,3", "--max-tokens", "6"]
    argv += ["--long-prompt-join", "--long-tokens", "64", "--stream-tokens", "40"]
    argv += ["--max-num-batched-tokens", "0,16"]
    argv += ["--chat-second-turn", "--history-tokens", "48"]
    argv += ["--batch", "--batch-seqs", "3", "--out", str(out)]
    assert main(argv) == 0
    for name in ("results.json", "results.md", "serve_concurrency.png"):
        assert (out / name).is_file(), name
    assert (out / "serve_concurrency.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = json.loads((out / "results.json").read_text())
    assert {"meta", "load", "long_prompt_join", "chat_second_turn", "batch", "lossless"} <= set(
        data
    )
    meta = data["meta"]
    assert meta["command"].startswith("speculant ")
    assert meta["configs"] == ["none", "ngram:2", "draft:2"]
    assert meta["concurrency"] == [1, 3] and meta["max_tokens"] == 6

    load = data["load"]
    # 3 configurations x 2 budgets x 2 levels (prefix caching: on only, the default).
    assert len(load) == 3 * 2 * 2
    for r in load:
        assert r["requests"] == r["concurrency"]
        assert r["tokens"] == r["tokens_requested"] == 6 * r["concurrency"]
        assert 0 < r["ttft_p50_s"] <= r["ttft_p99_s"]
        assert r["chunks"] >= r["concurrency"]
        if r["chunks"] > r["concurrency"]:  # a stream's tokens may come in one chunk
            assert 0 < r["itl_p50_ms"] <= r["itl_p99_ms"]
        assert r["tok_s"] > 0 and r["requests_s"] > 0 and r["speedup"] > 0
        assert r["mean_accepted_length"] >= 1.0
        assert r["identical_to_plain"] is True, r["label"]
        assert r["prefix_caching"] is True and r["max_num_batched_tokens"] in (0, 16)
        if r["method"] == "none":
            assert r["speedup"] == pytest.approx(1.0) and r["acceptance_rate"] is None
            assert r["mean_accepted_length"] == pytest.approx(1.0)
        else:
            assert r["drafted"] > 0 and 0 <= r["acceptance_rate"] <= 1
    assert any(r["itl_p50_ms"] is not None for r in load)
    # Greedy: every configuration's texts are plain decoding's, level by level.
    plain = {(r["max_num_batched_tokens"], r["concurrency"]): r["texts"] for r in load}
    for r in load:
        assert r["texts"] == plain[(r["max_num_batched_tokens"], r["concurrency"])]
    assert data["lossless"] == {"checked": True, "identical": True, "failures": []}

    # The scenarios run on the configurations named (not the implicit `none`).
    join = data["long_prompt_join"]
    assert [(r["config"], r["budget"], r["long_prompt"]) for r in join] == [
        (c, b, n) for c in ("ngram:2", "draft:2") for b, n in ((0, 0), (0, 64), (16, 64))
    ]
    for r in join:
        assert r["itl_p50_ms"] <= r["itl_p99_ms"] <= r["itl_max_ms"]
        assert (r["ttft_long_s"] is None) == (r["long_prompt"] == 0)
    chats = data["chat_second_turn"]
    assert [(r["config"], r["prefix_cache"]) for r in chats] == [
        ("ngram:2", False),
        ("ngram:2", True),
        ("draft:2", False),
        ("draft:2", True),
    ]
    for r in chats:
        assert r["ttft_turn1_s"] > 0 and r["ttft_turn2_s"] > 0
        assert r["prompt_tokens"][1] > r["prompt_tokens"][0]
        assert (r["target_hits"] > 0) == r["prefix_cache"]
    batch = data["batch"]
    assert [(r["config"], r["run"]) for r in batch] == [
        (c, n) for c in ("none", "ngram:2", "draft:2") for n in (1, 2)
    ]
    assert all(r["same"] and r["tokens"] == 3 * 6 for r in batch)

    md = (out / "results.md").read_text()
    assert "every configuration returned plain decoding's text" in md
    for title in ("Server load", "long prompt joins", "second turn", "busy batch"):
        assert title in md


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (["--concurrency", "0"], "argument --concurrency: 0 is out of range"),
        (["--concurrency", "2,x"], "argument --concurrency: 'x'"),
        (["--max-num-batched-tokens", "-1"], "argument --max-num-batched-tokens: -1 is out"),
        (["--prefix-caching", "maybe"], "argument --prefix-caching: 'maybe'"),
    ],
)
def test_bench_serve_refuses_bad_flags(
    flags: list[str], said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--serve", *flags])
    assert exc.value.code == 2
    assert said in capsys.readouterr().err


def test_bench_serve_refuses_unknown_config(
    pair: tuple[Model, Model], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target, _ = pair
    argv = ["bench", "--serve", "--target", str(target.source), "--methods", "ngram:2,warp:3"]
    assert main([*argv, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "unknown method 'warp'" in err and "ngram" in err
    assert main(["bench", "--serve", "--no-load", "--out", str(tmp_path)]) == 2
    assert "--no-load leaves nothing to run" in capsys.readouterr().err
    assert not (tmp_path / "results.json").exists()
