"""Logits processing against transformers' own warpers, and parameter validation."""

from __future__ import annotations

import math

import pytest
import torch

from speculant import SamplingError, SamplingParams
from speculant.sampling import process_logits


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"),
    [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8), (0.9, 10, 0.5), (2.0, 1, 1.0), (1.0, 0, 0.01)],
)
def test_matches_transformers_warpers(temperature: float, top_k: int, top_p: float) -> None:
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0)) * 3
    ref = logits.clone()
    ref = TemperatureLogitsWarper(temperature)(None, ref)
    if top_k:
        ref = TopKLogitsWarper(top_k)(None, ref)
    if top_p < 1.0:
        ref = TopPLogitsWarper(top_p)(None, ref)
    expected = ref.softmax(-1)
    got = process_logits(logits, SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p))
    torch.testing.assert_close(got, expected)
    assert torch.equal(got > 0, expected > 0)  # identical support, not just close values


def test_greedy_is_one_hot_at_argmax() -> None:
    logits = torch.tensor([[0.0, 3.0, 3.0, -1.0]])
    probs = process_logits(logits, SamplingParams(temperature=0.0))
    assert probs.tolist() == [[0.0, 1.0, 0.0, 0.0]]  # first index on ties, like argmax


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"temperature": -0.5}, "temperature=-0.5"),
        ({"temperature": float("nan")}, "temperature=nan"),
        ({"top_p": 0.0}, r"top_p=0.0 .*\(0, 1\]"),
        ({"top_p": 1.5}, "top_p=1.5"),
        ({"top_k": -1}, "top_k=-1"),
        ({"max_tokens": 0}, "max_tokens=0"),
        ({"seed": -3}, "seed=-3"),
        ({"stop": ("",)}, "stop"),
    ],
)
def test_out_of_range_values_are_named(kwargs: dict, match: str) -> None:  # type: ignore[type-arg]
    with pytest.raises(SamplingError, match=match):
        SamplingParams(**kwargs)


def test_stop_accepts_a_single_string() -> None:
    assert SamplingParams(stop="\n\n").stop == ("\n\n",)  # type: ignore[arg-type]


def test_a_vanishing_temperature_is_greedy() -> None:
    """Dividing logits by 1e-194 overflows them to inf (NaN probabilities, NaN logprobs):
    temperatures below 1e-5 are greedy, as 0 is (found by the server's fuzzing)."""
    from speculant.sampling import token_logprobs

    logits = torch.tensor([[0.5, 2.0, -1.0, 1.5]])
    for t in (0.0, 1e-194, 9e-6):
        params = SamplingParams(temperature=t)
        assert params.greedy
        assert process_logits(logits, params).tolist() == [[0.0, 1.0, 0.0, 0.0]]
        (lp,) = token_logprobs(logits, [1], params, 2)
        assert math.isfinite(lp.logprob) and lp.top[0][0] == 1
    assert not SamplingParams(temperature=1e-5).greedy
