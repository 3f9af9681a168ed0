"""`speculant bench --quant-quality` end to end on a tiny random model: one row per weight
format, the reference agreeing with itself, and argument errors named."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from tiny import tiny_chat_model

from speculant.cli import main


def test_quant_quality_end_to_end(tmp_path: Path) -> None:
    target = tiny_chat_model(tmp_path / "target", seed=1, layers=2)
    out = tmp_path / "out"
    argv = ["bench", "--quant-quality", "float32,int8", "--target", str(target.source)]
    argv += ["--quant-prompts", "1", "--quant-docs", "2", "--quant-doc-tokens", "24"]
    argv += ["--max-tokens", "6", "--out", str(out)]
    assert main(argv) == 0
    data = json.loads((out / "results.json").read_text())
    assert [r["dtype"] for r in data["rows"]] == ["float32", "int8"]
    ref, quant = data["rows"]
    assert ref["agreement_prefix_mean"] == 1.0 and ref["identical_share"] == 1.0
    assert 0.0 <= quant["agreement_prefix_mean"] <= 1.0
    for r in data["rows"]:
        assert math.isfinite(r["perplexity"]) and r["perplexity"] > 1.0
        assert r["weights_gb"] > 0 and r["tok_s_median"] > 0 and r["doc_tokens"] == 24
    assert quant["weights_gb"] < ref["weights_gb"]  # int8 layers take a quarter of float32
    assert "| int8 |" in (out / "results.md").read_text()


def test_quant_quality_bad_dtype_is_named(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["bench", "--quant-quality", "bfloat16,int3"])
    assert "dtype 'int3': use one of" in capsys.readouterr().err
