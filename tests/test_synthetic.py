"""`speculant bench --synthetic`: GGUF files of real shapes with random weights."""

from __future__ import annotations

from pathlib import Path

import pytest

from speculant import load_model
from speculant.bench import synthetic
from speculant.models.gguf_file import read_gguf


@pytest.mark.parametrize("mix", ["Q4_K_M", "Q8_0"])
def test_a_synthetic_file_loads_natively_and_runs_on_ids(mix: str, tmp_path: Path) -> None:
    path = synthetic.write("tiny", mix, tmp_path / f"tiny.{mix}.gguf")
    index = read_gguf(path)
    shape = synthetic.SHAPES["tiny"]
    assert len(index.tensors) == len(synthetic.tensors(shape, mix))
    assert index.metadata["llama.vocab_size"] == shape.vocab  # llama.cpp's count
    model = load_model(path, progress=False)
    assert model.tokenizer is None and model.net.native_ops and model.net._fusable()
    assert (model.config.dim, model.config.n_layers, model.config.vocab_size) == (256, 2, 512)
    logits = model.forward([1, 2, 3], model.new_cache(8), 0)
    assert logits.shape == (3, 512) and logits.isfinite().all()
    assert synthetic.write("tiny", mix, path) == path  # written once, then reused


def test_q4_k_m_follows_llama_cpps_mix() -> None:
    """Q6_K for the LM head and for attn_v / ffn_down of the first eighth of the layers,
    the last (from 7/8) and every third between (llama.cpp's rule for those tensors);
    Q4_K elsewhere; F32 norms and biases."""
    types = {name: q for name, _, q in synthetic.tensors(synthetic.SHAPES["qwen2.5-7b"], "Q4_K_M")}
    assert types["output.weight"] == "Q6_K" and types["token_embd.weight"] == "Q4_K"
    six = [i for i in range(28) if types[f"blk.{i}.ffn_down.weight"] == "Q6_K"]
    assert six == [0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 24, 25, 26, 27]
    assert types["blk.4.attn_q.bias"] == "F32" and types["blk.4.attn_q.weight"] == "Q4_K"


def test_bad_specs_are_named() -> None:
    with pytest.raises(ValueError, match="unknown shape 'llama-9b'"):
        synthetic.parse("llama-9b")
    with pytest.raises(ValueError, match="unknown mix 'Q3_K'"):
        synthetic.parse("llama-3.1-8b:Q3_K")
    assert synthetic.parse("qwen3-8b") == ("qwen3-8b", "Q4_K_M")
