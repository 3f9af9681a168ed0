"""`speculant bench --pass-cost` end to end on tiny random models: the report's rows, the
ratios to one token, llama.cpp's row when llama-bench is absent, and argument errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tiny import tiny_chat_model

from speculant.cli import main
from speculant.models.model import Model


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Model, Model]:
    root = tmp_path_factory.mktemp("pass-cost-models")
    return (
        tiny_chat_model(root / "target", seed=1, layers=2),
        tiny_chat_model(root / "draft", seed=2, layers=1),
    )


def test_pass_cost_end_to_end(
    pair: tuple[Model, Model], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target, draft = pair
    monkeypatch.setenv("SPECULANT_LLAMA_CPP_BIN", str(tmp_path / "no-llama"))
    out = tmp_path / "out"
    argv = ["bench", "--pass-cost", "--target", str(target.source), "--draft", str(draft.source)]
    argv += ["--dtype", "float32", "--draft-dtype", "float32", "--pass-widths", "4,2"]
    argv += ["--pass-reps", "2", "--pass-context", "8", "--max-tokens", "4", "--out", str(out)]
    argv += ["--pass-kv-dtypes", "float32,float16"]  # PyTorch-run weights keep their own
    assert main(argv) == 0
    for name in ("results.json", "results.md", "pass_cost.png"):
        assert (out / name).is_file(), name
    data = json.loads((out / "results.json").read_text())
    assert data["config"]["widths"] == [1, 2, 4]  # w=1 added, sorted
    ours = [r for r in data["rows"] if r["engine"] == "speculant"]
    assert [r["role"] for r in ours] == ["target", "draft"]
    for r in ours:
        assert set(r["pass_ms"]) == {"1", "2", "4"}
        assert all(ms > 0 for ms in r["pass_ms"].values())
        assert r["plain_tok_s"] > 0 and "kv_dtype" not in r
    # not GGUF files: llama.cpp's rows say why instead of a number
    peers = [r for r in data["rows"] if r["engine"] == "llama.cpp"]
    assert len(peers) == 2 and all("GGUF" in r["unavailable"] for r in peers)
    md = (out / "results.md").read_text()
    assert "| target |" in md and "(1.00x)" in md


def test_pass_cost_compares_weight_formats(
    pair: tuple[Model, Model], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--pass-dtypes: the target in each weight format, one row per (format, threads),
    taking turns; auto resolving to a format already asked for is measured once; the
    threads of PyTorch-run weights are --pass-threads'; llama.cpp's row comes once."""
    target, _ = pair
    monkeypatch.setenv("SPECULANT_LLAMA_CPP_BIN", str(tmp_path / "no-llama"))
    out = tmp_path / "out"
    argv = ["bench", "--pass-cost", "--target", str(target.source), "--draft", "none"]
    argv += ["--pass-dtypes", "float32,auto,int8,int4,bfloat16", "--pass-threads", "2,1"]
    argv += ["--pass-widths", "2", "--pass-reps", "1", "--pass-context", "8"]
    argv += ["--max-tokens", "2", "--no-plots", "--out", str(out)]
    assert main(argv) == 0
    data = json.loads((out / "results.json").read_text())
    ours = [r for r in data["rows"] if r["engine"] == "speculant"]
    # auto is bfloat16 for a folder: measured once, where auto came
    assert [(r["dtype"], r["threads"]) for r in ours] == [
        (dtype, threads) for dtype in ("float32", "bfloat16", "int8", "int4") for threads in (2, 1)
    ]
    for r in ours:
        assert r["role"] == "target" and r["kernel_path"] == "torch"
        assert set(r["pass_ms"]) == {"1", "2"}
        assert all(ms > 0 for ms in r["pass_ms"].values())
        assert r["plain_tok_s"] > 0
    peers = [r for r in data["rows"] if r["engine"] == "llama.cpp"]
    assert len(peers) == 1 and "GGUF" in peers[0]["unavailable"]
    md = (out / "results.md").read_text()
    for dtype in ("float32", "bfloat16", "int8", "int4"):
        assert f"| speculant {dtype} | 2 |" in md and f"| speculant {dtype} | 1 |" in md


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--pass-widths", "0"], "0 is out of range"),
        (["--pass-threads", "two"], "'two'"),
        (["--kernel-paths", "sse9"], "kernel path 'sse9'"),
        (["--pass-dtypes", "float32,fp8"], "dtype 'fp8'"),
        (["--pass-kv-dtypes", "float16,bfloat16"], "kv dtype 'bfloat16'"),
        (["--serve"], "run one at a time"),
    ],
)
def test_pass_cost_bad_arguments_are_named(
    pair: tuple[Model, Model], extra: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    target, _ = pair
    argv = ["bench", "--pass-cost", "--target", str(target.source), "--draft", "none"]
    argv += ["--dtype", "float32", *extra]
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse refuses a malformed value
        code = exc.code
    assert code != 0
    assert message in capsys.readouterr().err


def test_pass_cost_context_longer_than_the_prompt_once(
    pair: tuple[Model, Model], monkeypatch: pytest.MonkeyPatch
) -> None:
    """--pass-context past what 64 copies of the prompt give: the prompt repeats further
    (it once stopped there: 384 tokens on the Qwen2.5 tokenizer)."""
    from speculant.bench import pass_cost
    from speculant.native import autotune

    monkeypatch.setattr(autotune, "PROMPT", "x ")
    target, _ = pair
    assert target.tokenizer is not None
    context = len(target.tokenizer.encode(autotune.PROMPT * 64)) + 5
    assert context < 200  # within the tiny model's positions
    cfg = pass_cost.PassCostConfig(widths=[1], context=context, new=2, reps=1, llama_cpp=False)
    rows = pass_cost.measure_models([target], "target", cfg, say=lambda _: None)
    assert len(rows) == 1 and rows[0]["pass_ms"][1] > 0


@pytest.mark.parametrize("takes_depth", [True, False])
def test_llama_bench_runs_at_the_same_context(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, takes_depth: bool
) -> None:
    """llama-bench gets `-d CONTEXT` where it takes it (its passes then follow the same
    context as ours), and the report says so where it does not."""
    from types import SimpleNamespace

    from speculant.bench import pass_cost

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "args.txt"
    depth_help = "  -d, --n-depth <n>  (default: 0)" if takes_depth else ""
    tool = bin_dir / "llama-bench"
    tool.write_text(
        "#!/bin/sh\n"
        f'if [ "$1" = --help ]; then echo "usage"; echo "{depth_help}"; exit 0; fi\n'
        f'echo "$@" > {log}\n'
        'echo \'[{"n_prompt": 1, "n_gen": 0, "avg_ts": 20.0},'
        ' {"n_prompt": 4, "n_gen": 0, "avg_ts": 50.0},'
        ' {"n_prompt": 0, "n_gen": 8, "avg_ts": 19.0}]\'\n'
    )
    tool.chmod(0o755)
    monkeypatch.setenv("SPECULANT_LLAMA_CPP_BIN", str(bin_dir))
    model = SimpleNamespace(name="m", source=tmp_path / "m.gguf")
    cfg = pass_cost.PassCostConfig(widths=[1, 4], context=300, new=8, reps=1, threads=[2])
    [row] = pass_cost.llama_bench_rows(model, "target", cfg, say=lambda _: None)  # type: ignore[arg-type]
    args = log.read_text().split()
    assert ("-d" in args) is takes_depth
    if takes_depth:
        assert args[args.index("-d") + 1] == "300"
    assert row["depth"] == (300 if takes_depth else 0)
    assert row["pass_ms"] == {1: 50.0, 4: 80.0} and row["plain_tok_s"] == 19.0
    data = {"config": {"context": 300}, "rows": [row]}
    assert ("from an empty context" in pass_cost._peer_depth(data)) is not takes_depth


def test_pass_cost_context_past_the_models_positions_is_refused(
    pair: tuple[Model, Model],
) -> None:
    from speculant.bench import pass_cost

    target, _ = pair
    limit = target.config.max_seq_len
    cfg = pass_cost.PassCostConfig(widths=[1, 8], context=limit, new=2, reps=1, llama_cpp=False)
    with pytest.raises(ValueError, match=f"--pass-context {limit} .* has {limit}"):
        pass_cost.measure_models([target], "target", cfg, say=lambda _: None)


@pytest.mark.real
def test_pass_cost_compares_cache_types(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--pass-kv-dtypes: a GGUF model's float32 and float16 caches take turns, one row each."""
    from conftest import real_model_path

    monkeypatch.setenv("SPECULANT_LLAMA_CPP_BIN", str(tmp_path / "no-llama"))
    out = tmp_path / "out"
    path = real_model_path("smollm2-135m-instruct")
    argv = ["bench", "--pass-cost", "--target", str(path), "--draft", "none"]
    argv += ["--pass-kv-dtypes", "float32,float16", "--pass-widths", "2", "--pass-reps", "1"]
    argv += ["--pass-context", "8", "--max-tokens", "2", "--no-plots", "--out", str(out)]
    assert main(argv) == 0
    data = json.loads((out / "results.json").read_text())
    ours = [r for r in data["rows"] if r["engine"] == "speculant"]
    assert [(r["dtype"], r["kv_dtype"]) for r in ours] == [("gguf", "float32"), ("gguf", "float16")]
    assert all(r["pass_ms"]["2"] > 0 and r["plain_tok_s"] > 0 for r in ours)
    assert " kv float16 |" in (out / "results.md").read_text()
