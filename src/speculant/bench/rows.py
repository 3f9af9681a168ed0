"""What a benchmark records: one `Sample` per method and prompt, the `Method` a row
describes, the rows aggregated from them (per workload, and pooled as "all"), the run's
metadata, and the `BenchResult` that goes into results.json."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from speculant.bench.measure import (
    EnergyMeter,
    MemoryProbe,
    StepRecord,
    expected_tokens_per_step,
    machine_info,
    model_info,
    now_utc,
    percentile,
    spec_figures,
    theoretical_speedup,
)
from speculant.bench.specs import BASELINE, BenchConfig, MethodSpec

if TYPE_CHECKING:
    from speculant.bench.peers import PeerSpec
    from speculant.bench.workloads import Workload
    from speculant.models.model import Model

ALL = "all"  # the workload label of rows pooled over every workload


# ---------------------------------------------------------------- records


@dataclass
class Sample:
    """One method on one prompt (all its turns)."""

    workload: str
    prompt_id: str
    method: str
    kind: str  # "speculant" or "peer"
    turns: int = 0
    prompt_tokens: int = 0
    new_tokens: int = 0
    seconds: float = 0.0
    ttft_s: list[float] = field(default_factory=list)
    token_ids: list[list[int]] = field(default_factory=list)
    identical: bool | None = None
    joules: float = 0.0
    peak_rss: int = 0
    working_bytes: int = 0
    num_drafted: int | None = 0
    num_accepted: int | None = 0
    target_forwards: int | None = 0
    finish: list[str] = field(default_factory=list)
    steps: StepRecord = field(default_factory=StepRecord)
    anomalies: int = 0  # generations flagged by the acceptance anomaly signal
    zscores: list[float | None] = field(default_factory=list)

    @property
    def tok_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def decode_tok_s(self) -> float:
        """Tokens after each turn's first, over the time after it: prefill left out."""
        seconds = self.seconds - sum(self.ttft_s)
        tokens = self.new_tokens - self.turns
        return tokens / seconds if seconds > 0 and tokens > 0 else 0.0

    def add_usage(self, usage: Any, seconds: float | None = None) -> None:
        """Add a measured block; `seconds` replaces its wall time (a peer's own clock)."""
        self.seconds += usage.seconds if seconds is None else seconds
        self.joules += usage.joules
        self.peak_rss = max(self.peak_rss, usage.peak_rss)
        self.working_bytes = max(self.working_bytes, usage.working_bytes)

    def to_dict(self) -> dict[str, Any]:
        return {
            "workload": self.workload,
            "prompt_id": self.prompt_id,
            "method": self.method,
            "kind": self.kind,
            "turns": self.turns,
            "prompt_tokens": self.prompt_tokens,
            "new_tokens": self.new_tokens,
            "seconds": self.seconds,
            "tok_s": self.tok_s,
            "decode_tok_s": self.decode_tok_s,
            "ttft_s": statistics.fmean(self.ttft_s) if self.ttft_s else None,
            "identical_to_baseline": self.identical,
            "joules": self.joules,
            "peak_rss_mb": self.peak_rss / 1e6,
            "working_mb": self.working_bytes / 1e6,
            "num_drafted": self.num_drafted,
            "num_accepted": self.num_accepted,
            "target_forwards": self.target_forwards,
            "finish_reason": self.finish,
            "acceptance_zscores": self.zscores,
            "anomalies": self.anomalies,
        }


@dataclass
class Method:
    """What a row describes: one of our methods or one peer."""

    label: str
    kind: str
    engine: str
    proposer: str
    k: int | str | None
    description: str
    settings: dict[str, Any]
    weights_bytes: int
    setup_s: float
    lossless: bool  # expected to reproduce the baseline token for token (greedy or seeded)


@dataclass
class BenchResult:
    meta: dict[str, Any]
    rows: list[dict[str, Any]]
    samples: list[dict[str, Any]]
    skipped: list[str]
    lossless_failures: list[str]

    def to_dict(self) -> dict[str, Any]:
        return {
            "meta": self.meta,
            "rows": self.rows,
            "samples": self.samples,
            "skipped": self.skipped,
            "lossless_failures": self.lossless_failures,
        }


def add_stats(sample: Sample, n_prompt: int, res: Any, steps: StepRecord) -> None:
    s = res.stats
    sample.turns += 1
    sample.prompt_tokens += n_prompt
    sample.new_tokens += len(res.token_ids)
    sample.ttft_s.append(s.time_to_first_token_s)
    sample.token_ids.append(list(res.token_ids))
    sample.finish.append(res.finish_reason)
    sample.num_drafted = (sample.num_drafted or 0) + s.num_drafted
    sample.num_accepted = (sample.num_accepted or 0) + s.num_accepted
    sample.target_forwards = (sample.target_forwards or 0) + s.target_forwards
    sample.steps.extend(steps)


def add_peer_output(sample: Sample, n_prompt: int, out: Any) -> None:
    sample.turns += 1
    sample.prompt_tokens += n_prompt
    sample.new_tokens += len(out.token_ids)
    sample.ttft_s.append(out.ttft_s)
    sample.token_ids.append(list(out.token_ids))
    if out.steps is None or sample.target_forwards is None:
        sample.target_forwards = None
    else:
        sample.target_forwards += out.steps
    if out.drafted is None or sample.num_drafted is None or out.steps is None:
        sample.num_drafted = sample.num_accepted = None
    else:
        sample.num_drafted += out.drafted
        # every step yields its accepted drafts plus one token of the target's own
        sample.num_accepted = (sample.num_accepted or 0) + max(0, len(out.token_ids) - out.steps)


# ---------------------------------------------------------------- aggregation


def build_rows(
    samples: list[Sample], methods: dict[str, Method], cfg: BenchConfig, workloads: list[str]
) -> list[dict[str, Any]]:
    rows = []
    order = list(methods)
    groups = [*workloads, ALL] if len(workloads) > 1 else workloads
    for wl in groups:
        sel = [s for s in samples if wl in (ALL, s.workload)]
        base = {(s.workload, s.prompt_id): s for s in sel if s.method == BASELINE}
        base_steps = StepRecord()
        for s in base.values():
            base_steps.extend(s.steps)
        base_step_ms = spec_figures(base_steps).step_ms
        for label in order:
            mine = [s for s in sel if s.method == label]
            if mine:
                rows.append(_row(wl, methods[label], mine, base, base_step_ms, cfg))
    return rows


def _row(
    workload: str,
    method: Method,
    mine: list[Sample],
    base: dict[tuple[str, str], Sample],
    base_step_ms: float | None,
    cfg: BenchConfig,
) -> dict[str, Any]:
    speeds = [s.tok_s for s in mine]
    ratios = [
        s.tok_s / b.tok_s
        for s in mine
        if (b := base.get((s.workload, s.prompt_id))) is not None and b.tok_s > 0
    ]
    decode_ratios = [
        s.decode_tok_s / b.decode_tok_s
        for s in mine
        if (b := base.get((s.workload, s.prompt_id))) is not None and b.decode_tok_s > 0
    ]
    new_tokens = sum(s.new_tokens for s in mine)
    steps = StepRecord()
    for s in mine:
        steps.extend(s.steps)
    fig = spec_figures(steps)
    drafted = _total(s.num_drafted for s in mine)
    accepted = _total(s.num_accepted for s in mine)
    forwards = _total(s.target_forwards for s in mine)
    acceptance = None
    if drafted and accepted is not None:
        acceptance = accepted / drafted
    elif drafted == 0 and method.proposer != BASELINE:
        acceptance = 0.0  # a proposer that never drafted
    cost_ratio = None
    theory = None
    expected = None
    if method.kind == "speculant" and fig.draft_ms_per_token is not None and base_step_ms:
        cost_ratio = fig.draft_ms_per_token / base_step_ms
    if (
        fig.alpha is not None
        and fig.mean_draft_length is not None
        and cost_ratio is not None
        and fig.draft_step_share is not None
    ):
        share = fig.draft_step_share
        expected = 1 - share + share * expected_tokens_per_step(fig.alpha, fig.mean_draft_length)
        theory = theoretical_speedup(fig.alpha, fig.mean_draft_length, cost_ratio, share)
    working = max(s.working_bytes for s in mine)
    ttfts = [t for s in mine for t in s.ttft_s]
    # The lossless check only means something for greedy runs: sampled runs differ by design.
    identical = sum(1 for s in mine if s.identical) / len(mine) if cfg.reproducible else None
    return {
        "workload": workload,
        "method": method.label,
        "kind": method.kind,
        "engine": method.engine,
        "proposer": method.proposer,
        "k": method.k,
        "description": method.description,
        "settings": method.settings,
        "prompts": len(mine),
        "generations": sum(s.turns for s in mine),
        "new_tokens": new_tokens,
        "tok_s_median": statistics.median(speeds),
        "tok_s_p25": percentile(speeds, 25),
        "tok_s_p75": percentile(speeds, 75),
        "tok_s_min": min(speeds),
        "tok_s_max": max(speeds),
        "speedup": statistics.median(ratios) if ratios else None,
        "speedup_min": min(ratios) if ratios else None,
        "speedup_max": max(ratios) if ratios else None,
        "decode_tok_s_median": statistics.median(s.decode_tok_s for s in mine),
        "decode_speedup": statistics.median(decode_ratios) if decode_ratios else None,
        "acceptance_rate": acceptance,
        "mean_accepted_length": (new_tokens / forwards if forwards else None)
        if forwards is not None
        else None,
        "acceptance_by_position": fig.acceptance_by_position if fig.drafting_steps else None,
        "drafted_by_position": fig.drafted_by_position if fig.drafting_steps else None,
        "alpha": fig.alpha,
        "mean_draft_length": fig.mean_draft_length,
        "draft_step_share": fig.draft_step_share,
        "draft_ms_per_token": fig.draft_ms_per_token,
        "step_ms": fig.step_ms,
        "baseline_step_ms": base_step_ms,
        "cost_ratio": cost_ratio,
        "expected_tokens_per_step": expected,
        "theoretical_speedup": theory,
        "ttft_s_median": statistics.median(ttfts) if ttfts else None,
        "peak_rss_mb": max(s.peak_rss for s in mine) / 1e6,
        "working_mb": working / 1e6,
        "weights_mb": method.weights_bytes / 1e6,
        "peak_memory_mb": (method.weights_bytes + working) / 1e6,
        "energy_j": sum(s.joules for s in mine),
        "energy_j_per_token": sum(s.joules for s in mine) / new_tokens if new_tokens else None,
        "identical_share": identical,
        "lossless_expected": method.lossless,
        "anomalies": sum(s.anomalies for s in mine) if method.kind == "speculant" else None,
        "setup_s": method.setup_s,
    }


def _total(values: Any) -> int | None:
    total = 0
    for v in values:
        if v is None:
            return None
        total += v
    return total


def build_meta(
    target: Model,
    draft: Model | None,
    cfg: BenchConfig,
    wls: Sequence[Workload],
    specs: Sequence[MethodSpec],
    peers: Sequence[PeerSpec],
    energy: EnergyMeter,
    memory: MemoryProbe,
    command: str | None,
) -> dict[str, Any]:
    import speculant

    return {
        "speculant_version": speculant.__version__,
        "command": command,
        "started_utc": now_utc(),
        "target": model_info(target),
        "draft": model_info(draft),
        "machine": machine_info(),
        "energy_source": energy.source,
        "energy_measured": energy.measured,
        "memory_source": "VmHWM after clear_refs (per generation)"
        if memory.resettable
        else "ru_maxrss (peak since process start)",
        "sampling": {
            "temperature": cfg.temperature,
            "top_k": cfg.top_k,
            "top_p": cfg.top_p,
            "seed": cfg.seed,
            "ignore_eos": cfg.ignore_eos,
            "greedy": cfg.greedy,
        },
        "max_tokens": cfg.max_tokens,
        "limit": cfg.limit,
        "peer_limit": cfg.peer_limit,
        "fresh_engines": cfg.fresh_engines,
        "ks": list(cfg.ks),
        "methods": [s.label for s in specs],
        "peers": [p.label for p in peers],
        "workloads": [
            {
                "name": w.name,
                "source": w.source,
                "license": w.license,
                "prompts": [p.id for p in w.prompts],
            }
            for w in wls
        ],
    }
