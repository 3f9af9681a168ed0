"""What a benchmark runs: our methods at their settings (`MethodSpec`, parsed from
METHOD[:K[:...]] by `parse_methods`) and the run's configuration (`BenchConfig`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from speculant.bench.measure import DEFAULT_WATTS_PER_CORE

BASELINE = "none"


# ---------------------------------------------------------------- configuration


@dataclass(frozen=True)
class MethodSpec:
    """One of our methods at one setting: `none`, or a proposer with its k."""

    method: str
    k: int | str | None = None
    skip_ratio: float | None = None  # layer-skip only
    tree: tuple[int, int] | None = None  # eagle only: (top-k per node, tree tokens)

    @property
    def label(self) -> str:
        if self.method == BASELINE:
            return BASELINE
        out = f"{self.method}:{self.k}"
        if self.tree is not None:
            return f"{out}:{self.tree[0]}:{self.tree[1]}"
        return out if self.skip_ratio is None else f"{out}:{self.skip_ratio:g}"

    @property
    def options(self) -> dict[str, Any]:
        if self.tree is not None:
            return {"tree_topk": self.tree[0], "tree_tokens": self.tree[1]}
        return {} if self.skip_ratio is None else {"skip_ratio": self.skip_ratio}


def parse_k(text: str | int) -> int | str:
    if text == "auto" or isinstance(text, int):
        value: int | str = text
    else:
        try:
            value = int(text)
        except ValueError:
            raise ValueError(f"k={text!r}: use an integer 1..64 or 'auto'") from None
    if isinstance(value, int) and not 1 <= value <= 64:
        raise ValueError(f"k={value} is out of range: use 1..64 or 'auto'")
    return value


def parse_methods(specs: Sequence[str] | None, ks: Sequence[int | str]) -> list[MethodSpec]:
    """METHOD[:K[:SKIP_RATIO]] specs (eagle: eagle[:K[:TOPK[:TOKENS]]], the tree shape);
    a METHOD without K runs once per k in `ks` (the k sweep). The plain baseline `none`
    always runs, first. The default (every proposer) leaves out eagle, which needs a
    trained head."""
    from speculant.proposers import available_methods

    known = available_methods()
    out = [MethodSpec(BASELINE)]
    for raw in specs if specs is not None else [m for m in known if m != "eagle"]:
        parts = raw.strip().split(":")
        method = parts[0]
        if not method:
            continue
        if method not in known:
            raise ValueError(f"unknown method {method!r}: use one of {', '.join(known)}")
        if method == BASELINE:
            continue
        sweep = [parse_k(parts[1])] if len(parts) > 1 and parts[1] else [parse_k(k) for k in ks]
        ratio = None
        tree: tuple[int, int] | None = None
        if method == "eagle":
            try:
                shape = [int(x) for x in parts[2:4]]
            except ValueError:
                raise ValueError(f"{raw!r}: use eagle:K:TOPK:TOKENS with integers") from None
            if len(parts) > 4:
                raise ValueError(f"{raw!r}: use eagle:K:TOPK:TOKENS")
            full = shape + [1, 16][len(shape) :]
            tree = (full[0], full[1])
        elif len(parts) > 2:
            if method != "layer-skip":
                raise ValueError(f"{raw!r}: only layer-skip takes a third field (skip ratio)")
            ratio = float(parts[2])
        for k in sweep:
            spec = MethodSpec(method, k, ratio, tree)
            if spec not in out:
                out.append(spec)
    return out


@dataclass
class BenchConfig:
    workloads: list[str] | None = None  # shipped workload names; None: all
    methods: list[str] | None = None  # METHOD[:K[:RATIO]]; None: every proposer
    ks: list[int | str] = field(default_factory=lambda: [5])
    peers: list[str] = field(default_factory=list)  # peers or groups (all, hf, llama, llama-cli)
    limit: int | None = None  # prompts per workload
    peer_limit: int | None = None  # prompts per workload for the peers (None: as `limit`)
    eagle_head: str | None = None  # head folder for method eagle
    max_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = 0
    ignore_eos: bool = False
    warmup: bool = True
    # A new engine for every request of each method other than the baseline (its setup,
    # layer-skip's calibration included, is not timed): every run is a first request,
    # with nothing learned by -k auto or the proposer.
    fresh_engines: bool = False
    watts_per_core: float = DEFAULT_WATTS_PER_CORE

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def reproducible(self) -> bool:
        """Greedy or seeded: every method must give the baseline's tokens exactly (a
        seeded request's text does not depend on the method); unseeded sampling only
        follows the same distribution."""
        return self.greedy or self.seed is not None
