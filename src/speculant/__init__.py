"""Speculant: lossless speculative decoding.

from speculant import load_model, Engine, SamplingParams
target = load_model("qwen2.5-coder-1.5b-instruct")
draft = load_model("qwen2.5-coder-0.5b-instruct")
engine = Engine(target, draft=draft, num_speculative_tokens=5)
res = engine.generate(target.tokenizer.encode("def fib(n):"), SamplingParams(max_tokens=64))
"""

from speculant.engine import Engine, GenerationResult, GenerationStats, RequestError, StreamChunk
from speculant.models.model import Model, load_model
from speculant.sampling import SamplingError, SamplingParams

__all__ = [
    "Engine",
    "GenerationResult",
    "GenerationStats",
    "Model",
    "RequestError",
    "SamplingError",
    "SamplingParams",
    "StreamChunk",
    "load_model",
]
__version__ = "0.1.0"
