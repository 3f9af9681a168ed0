"""Our decoder against transformers' own implementation, and the numerics invariants."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from conftest import tiny_model
from tiny import hf_model

from speculant.models.loader import ModelLoadError
from speculant.models.model import load_model
from speculant.models.registry import UnknownModelError


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_logits_match_transformers(arch: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    ref = hf_model(arch, seed=3)
    ref.save_pretrained(tmp_path)
    ours = load_model(tmp_path, dtype="float32", progress=False)
    ids = torch.randint(0, ours.vocab_size, (24,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = ref(ids[None]).logits[0]
    got = ours.forward(ids.tolist(), ours.new_cache(64), 0)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    # Incremental decoding through the cache gives the same logits as one full pass.
    cache = ours.new_cache(64)
    ours.prefill(ids[:10].tolist(), cache)
    steps = [ours.forward([int(t)], cache, 10 + i) for i, t in enumerate(ids[10:])]
    torch.testing.assert_close(torch.cat(steps), expected[10:], rtol=1e-4, atol=1e-4)


def test_gemma_sliding_window_matters(tmp_root_factory=None, tmp_path=None) -> None:  # type: ignore[no-untyped-def]
    """Beyond the window, a sliding layer must not see old tokens: check that logits of a
    long sequence differ from full attention (guards against a silently ignored window)."""
    ref = hf_model("gemma3", seed=4)
    ids = torch.randint(0, 96, (1, 30), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        windowed = ref(ids).logits[0, -1]
        ref.config.sliding_window = 10_000
        for layer in ref.model.layers:
            layer.self_attn.sliding_window = None
        unwindowed = ref(ids).logits[0, -1]
    assert not torch.allclose(windowed, unwindowed, atol=1e-3)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8"])
def test_row_count_invariance(dtype: str, tiny_root) -> None:  # type: ignore[no-untyped-def]
    """A token's logits are bitwise the same whether it runs alone or inside a verify
    pass of several rows: the property greedy equivalence rests on."""
    m = tiny_model(tiny_root, "qwen2", seed=5, dtype=dtype)
    ids = torch.randint(0, m.vocab_size, (16,), generator=torch.Generator().manual_seed(3)).tolist()
    cache = m.new_cache(32)
    m.prefill(ids[:8], cache)
    multi = m.forward(ids[8:14], cache, 8)  # 6 rows at positions 8..13
    cache.truncate(8)
    singles = []
    for i in range(6):
        singles.append(m.forward([ids[8 + i]], cache, 8 + i))
    assert torch.equal(torch.cat(singles), multi)


def test_unknown_name_lists_known_models() -> None:
    with pytest.raises(UnknownModelError, match="smollm2-135m-instruct"):
        load_model("no-such-model")


def test_missing_file_is_named() -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model("/nonexistent/model.gguf")


def test_bad_dtype_is_refused(tiny_root) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match="float16x"):
        load_model("smollm2-135m-instruct", dtype="float16x")


def test_not_a_gguf_file(tmp_path) -> None:  # type: ignore[no-untyped-def]
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"not a gguf file at all")
    with pytest.raises(ModelLoadError, match="not a GGUF"):
        load_model(bad)


def test_int8_weights_stay_close_to_bf16(tiny_root) -> None:  # type: ignore[no-untyped-def]
    exact = tiny_model(tiny_root, "llama", seed=6, dtype="float32")
    quant = tiny_model(tiny_root, "llama", seed=6, dtype="int8")
    assert quant.int8 and not exact.int8
    ids = list(range(3, 19))
    a = exact.forward(ids, exact.new_cache(32), 0)
    b = quant.forward(ids, quant.new_cache(32), 0)
    assert (a - b).abs().max() < 0.1 * a.abs().max()
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() > 0.8


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8"])
@pytest.mark.parametrize("arch", ["qwen2", "gemma3"])
def test_batched_pass_is_bitwise_solo(dtype: str, arch: str, tiny_root) -> None:  # type: ignore[no-untyped-def]
    """Sequences of different lengths at different positions in one batched pass get
    exactly the logits (and caches) they get alone: what lets the server batch greedy
    requests without changing any of them."""
    m = tiny_model(tiny_root, arch, seed=5, dtype=dtype)
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, m.vocab_size, (n,), generator=gen).tolist() for n in (5, 9, 20)]
    steps = [3, 1, 6]  # rows each sequence runs in the batched pass
    solo, solo_caches = [], []
    for ids, n in zip(prompts, steps, strict=True):
        cache = m.new_cache(40)
        m.prefill(ids[:-n], cache)
        solo.append(m.forward(ids[-n:], cache, len(ids) - n))
        solo_caches.append(cache)
    caches = []
    for ids, n in zip(prompts, steps, strict=True):
        cache = m.new_cache(40)
        m.prefill(ids[:-n], cache)
        caches.append(cache)
    batched = m.forward_batch(
        [(ids[-n:], c, len(ids) - n) for ids, n, c in zip(prompts, steps, caches, strict=True)]
    )
    for a, b, ca, cb in zip(solo, batched, solo_caches, caches, strict=True):
        assert torch.equal(a, b)
        assert ca.length == cb.length
        assert torch.equal(ca.k[:, :, :, : ca.length], cb.k[:, :, :, : cb.length])


def test_quantization_round_trip_error_bounds() -> None:
    """int8 (per channel) and int4 (groups of 32) reconstruct a weight within their
    resolution: |w - w'| <= half a step of the channel / group range."""
    from speculant.models.decoder import Int4Weight, Int8Weight, linear

    gen = torch.Generator().manual_seed(0)
    w = torch.randn(64, 256, generator=gen)
    q8 = Int8Weight.quantize(w)
    back8 = q8.q.float() * q8.scales.float()[:, None]
    step8 = w.abs().amax(dim=1, keepdim=True) / 127
    # half a step, plus the bf16 rounding of the scale (up to 127 x scale x 2^-8)
    assert ((back8 - w).abs() <= step8 * (0.5 + 127 / 256)).all()
    q4 = Int4Weight.quantize(w)
    back4 = q4.dequantize()
    groups = w.view(64, 8, 32)
    step4 = ((groups.amax(-1) - groups.amin(-1)) / 15).repeat_interleave(32, dim=1)
    # half a step, plus the bf16 rounding of scale and zero
    assert ((back4 - w).abs() <= step4 * 0.5 + 0.02 * w.abs().amax()).all()
    assert (back4 - w).norm() / w.norm() < 0.1
    assert q4.nbytes * 8 / w.numel() == 5.0  # 4 bits + a bf16 scale and zero per 32
    x = torch.randn(3, 256, generator=gen).bfloat16()
    ref = x.float() @ back4.T
    assert (linear(x, q4).float() - ref).abs().max() < 0.02 * ref.abs().max()


def test_int4_greedy_draft_is_lossless(tiny_root) -> None:  # type: ignore[no-untyped-def]
    from oracles import plain_greedy

    from speculant import Engine, SamplingParams

    target = tiny_model(tiny_root, "qwen2", seed=8, dtype="bfloat16")
    draft = tiny_model(tiny_root, "qwen2", seed=8, dtype="int4")
    assert draft.weight_format == "int4"
    prompt = [5, 9, 14, 2, 33]
    res = Engine(target, draft=draft, num_speculative_tokens=4).generate(
        prompt, SamplingParams(max_tokens=40, ignore_eos=True)
    )
    assert res.token_ids == plain_greedy(target, prompt, 40)
    assert 0 < res.stats.num_accepted < res.stats.num_drafted  # agreement, imperfect


def test_attention_values_do_not_depend_on_the_span() -> None:
    """Extending the key span with masked keys (zero probability) leaves the attention
    output bitwise unchanged; one plain matmul over the span did not (span 1088 vs 1152
    on one project CPU), and greedy output drifted on long prompts."""
    from speculant.models.decoder import attend_values

    gen = torch.Generator().manual_seed(0)
    for span in (64, 512, 1088, 1536):
        values = torch.randn(2, span + 128, 128, generator=gen).bfloat16()
        probs = torch.softmax(torch.randn(2, 6, span, generator=gen), -1).bfloat16()
        a = attend_values(probs, values[:, :span])
        for extra in (64, 128):
            padded = torch.cat([probs, torch.zeros(2, 6, extra, dtype=probs.dtype)], -1)
            assert torch.equal(attend_values(padded, values[:, : span + extra]), a), span
        ref = torch.matmul(probs.float(), values[:, :span].float())
        assert torch.allclose(a.float(), ref, atol=2e-2)


def _rowwise(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w.T in float32, one row at a time (a float32 matmul's own order can depend on
    its row count)."""
    return torch.stack([w.float() @ row.float() for row in x])


def _reordered_at_one_row(w: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """x @ w.T in float32 rounded to bfloat16, whose one-row path adds its three partial
    sums in another order: the kind of difference CPU kernels have between row counts."""
    k = w.shape[1]
    parts = [slice(0, k // 3), slice(k // 3, 2 * k // 3), slice(2 * k // 3, k)]

    def op(x: torch.Tensor) -> torch.Tensor:
        a, b, c = (_rowwise(x[:, s], w[:, s]) for s in parts)
        y = a + (b + c) if x.shape[0] == 1 else (a + b) + c
        return y.to(torch.bfloat16)

    return op


def test_calibration_sees_a_reordered_sum() -> None:
    """A float32 reordering shows in a bfloat16 result for ~1 of 10^4 random outputs; the
    calibration's sensitive rows must catch it at every run, and must not flag an op that
    has no reordering."""
    from speculant.models.numerics import _invariant, _row_counts, _sensitive_rows

    counts = _row_counts((1, 1))
    for seed in range(5):
        gen = torch.Generator().manual_seed(seed)
        w = torch.randn(64, 768, generator=gen).to(torch.bfloat16)
        reordered = _reordered_at_one_row(w)
        x = _sensitive_rows(reordered, 768, 32, torch.bfloat16, gen)
        assert not _invariant(reordered, x, counts, shifted=False)

        def same_order(x: torch.Tensor, w: torch.Tensor = w) -> torch.Tensor:
            return _rowwise(x, w).to(torch.bfloat16)

        y = _sensitive_rows(same_order, 768, 32, torch.bfloat16, gen)
        assert _invariant(same_order, y, counts, shifted=True)


def test_rotary_tables_grow_without_changing_a_bit() -> None:
    """A table grown in steps equals one grown at once, and each block equals the table
    rope_tables computes for it: positions keep their bits whenever the table grows."""
    from speculant.models.attention import ROPE_BLOCK, extend_rope, rope_tables

    kw = dict(head_dim=64, theta=500000.0, attn_factor=1.1, rope_dim=48)
    empty = torch.empty(2, 0, 64)
    stepwise = empty
    for n in (5, 1500, 1501, 5000):
        stepwise = extend_rope(stepwise, n, torch.float32, **kw)
    at_once = extend_rope(empty, 5000, torch.float32, **kw)
    assert stepwise.shape[1] >= 5000 and torch.equal(stepwise[:, :5000], at_once[:, :5000])
    block = rope_tables(n_pos=ROPE_BLOCK, start=2 * ROPE_BLOCK, **kw)
    assert torch.equal(at_once[:, 2 * ROPE_BLOCK : 3 * ROPE_BLOCK], block)
    assert extend_rope(at_once, 10, torch.float32, **kw) is at_once  # nothing to add
