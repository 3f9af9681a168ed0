"""Self-speculation: the target with some layers skipped drafts for the full target.

The draft shares every weight tensor with the target (no second model in memory); only
its KV cache is its own, since a layer's inputs differ once earlier layers are skipped.
Drafting then works exactly like a separate draft model.

Which layers to skip: either an explicit list, or a one-pass calibration on sample text
(ShortGPT's block influence): run the full target once, and for each layer measure
1 - cos(residual before, residual after), averaged over tokens. Layers that barely
turn the residual stream change the output least; the `skip_ratio` least influential
ones are skipped. The first and last layers are always kept.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from speculant.models.decoder import Transformer, Weights
from speculant.proposers.base import register
from speculant.proposers.draft_model import DraftModelProposer

if TYPE_CHECKING:
    from speculant.models.model import Model

log = logging.getLogger(__name__)

CALIBRATION_TEXT = (
    "def merge_sorted(a, b):\n"
    '    """Merge two sorted lists into one sorted list."""\n'
    "    out, i, j = [], 0, 0\n"
    "    while i < len(a) and j < len(b):\n"
    "        if a[i] <= b[j]:\n"
    "            out.append(a[i]); i += 1\n"
    "        else:\n"
    "            out.append(b[j]); j += 1\n"
    "    return out + a[i:] + b[j:]\n\n"
    "The committee met on Tuesday to review the budget. After a long discussion, the "
    "members agreed to fund the new library and to postpone the road repairs until spring."
)


def block_influence(model: Model, token_ids: Sequence[int]) -> list[float]:
    """Per layer: mean over tokens of 1 - cos(residual in, residual out)."""
    trace: list[torch.Tensor] = []
    cache = model.new_cache(len(token_ids) + 8)
    model.net.forward(torch.as_tensor(list(token_ids)), cache, 0, logits=False, trace=trace)
    return [
        float(1.0 - F.cosine_similarity(a.float(), b.float(), dim=-1).mean())
        for a, b in zip(trace[:-1], trace[1:], strict=True)
    ]


def calibration_ids(model: Model, text: str | None = None) -> list[int]:
    if model.tokenizer is not None:
        return model.tokenizer.encode(text or CALIBRATION_TEXT)[:512]
    # A bare model (token ids only): a fixed varied sequence still ranks the layers.
    return [(7 * i + 3) % model.vocab_size for i in range(96)]


def choose_skipped_layers(model: Model, skip_ratio: float, text: str | None = None) -> list[int]:
    n = model.config.n_layers
    influence = block_influence(model, calibration_ids(model, text))
    candidates = sorted(range(1, n - 1), key=lambda i: influence[i])
    count = min(len(candidates), round(skip_ratio * n))
    return sorted(candidates[:count])


def skipped_view(model: Model, skip: Sequence[int]) -> Model:
    """A Model that runs only the layers not in `skip`, sharing the target's tensors."""
    from speculant.models.model import Model

    c = model.config
    kept = [i for i in range(c.n_layers) if i not in set(skip)]
    w = model.net.weights
    weights = Weights(w.tok_embeddings, w.norm, w.output, [w.layers[i] for i in kept])
    types = tuple(c.layer_types[i] for i in kept) if c.layer_types else ()
    no_rope = tuple(j for j, i in enumerate(kept) if i in c.no_rope_layers)
    config = dataclasses.replace(c, n_layers=len(kept), layer_types=types, no_rope_layers=no_rope)
    net = Transformer(config, weights, model.dtype)
    return Model(f"{model.name} without layers {list(skip)}", config, net, model.tokenizer)


@register("layer-skip")
class LayerSkipProposer(DraftModelProposer):
    name = "layer-skip"

    def __init__(
        self,
        target: Model,
        draft: Model | None = None,
        *,
        skip_layers: Sequence[int] | None = None,
        skip_ratio: float = 0.5,
        calibration_text: str | None = None,
        **_: Any,
    ) -> None:
        n = target.config.n_layers
        if skip_layers is None:
            if not 0.0 < skip_ratio < 1.0:
                raise ValueError(f"skip_ratio={skip_ratio} is out of range: use (0, 1)")
            skip_layers = choose_skipped_layers(target, skip_ratio, calibration_text)
        bad = [i for i in skip_layers if not 0 <= i < n]
        if bad or len(set(skip_layers)) >= n:
            raise ValueError(
                f"skip_layers={list(skip_layers)}: use distinct indices in 0..{n - 1}, "
                "keeping at least one layer"
            )
        self.skip_layers = sorted(set(skip_layers))
        log.info("layer-skip drafts with layers %s skipped", self.skip_layers)
        super().__init__(target, skipped_view(target, self.skip_layers))
