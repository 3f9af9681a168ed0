"""The benchmark runner: every method, then every peer, on the same prompt ids in one
process, against the plain baseline measured in the same run.

    from speculant.bench import BenchConfig, run_bench
    result = run_bench(target, draft, BenchConfig(workloads=["code"], limit=2))
    result.rows       # one dict per (workload, method); workload "all" pools them
"""

from __future__ import annotations

import datetime as _dt
import gc
import platform
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from speculant.anomaly import AcceptanceBaseline
from speculant.bench.measure import (
    DEFAULT_WATTS_PER_CORE,
    EnergyMeter,
    MemoryProbe,
    StepRecord,
    cpu_description,
    expected_tokens_per_step,
    measured,
    percentile,
    record_steps,
    spec_figures,
    theoretical_speedup,
)
from speculant.bench.peers import (
    Peer,
    PeerSampling,
    PeerSpec,
    PeerUnavailable,
    expand_peers,
    open_peer,
)
from speculant.bench.workloads import Workload, encode_turn, load_workloads
from speculant.engine import Engine
from speculant.models.model import Model
from speculant.sampling import SamplingParams

BASELINE = "none"
ALL = "all"  # the workload label of rows pooled over every workload


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


class Progress(Protocol):
    def start(self, total: int) -> None: ...

    def advance(self, text: str) -> None: ...

    def message(self, text: str) -> None: ...


class _Quiet:
    def start(self, total: int) -> None:
        return None

    def advance(self, text: str) -> None:
        return None

    def message(self, text: str) -> None:
        print(text, file=sys.stderr)


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


# ---------------------------------------------------------------- the run


def run_bench(
    target: Model,
    draft: Model | None = None,
    config: BenchConfig | None = None,
    *,
    workloads: Sequence[Workload] | None = None,
    progress: Progress | None = None,
    command: str | None = None,
) -> BenchResult:
    """Run the benchmark. `workloads` overrides config.workloads with ready-made ones."""
    cfg = config or BenchConfig()
    sink: Progress = progress or _Quiet()
    wls = list(workloads) if workloads is not None else load_workloads(cfg.workloads, cfg.limit)
    if workloads is not None and cfg.limit is not None:
        wls = [w.limited(cfg.limit) for w in wls]
    specs = parse_methods(cfg.methods, cfg.ks)
    peer_specs = expand_peers(cfg.peers, cfg.ks)
    if any(s.method == "draft" for s in specs) and draft is None:
        raise ValueError("method 'draft' needs a draft model: pass one or drop the method")
    eagle_head = None
    if any(s.method == "eagle" for s in specs):
        if cfg.eagle_head is None:
            raise ValueError("method 'eagle' needs a trained head: pass --eagle-head DIR")
        from speculant.eagle.head import load_head

        eagle_head = load_head(cfg.eagle_head)
    started = time.time()
    energy = EnergyMeter(cfg.watts_per_core)
    memory = MemoryProbe()
    params = SamplingParams(
        temperature=cfg.temperature,
        top_k=cfg.top_k,
        top_p=cfg.top_p,
        max_tokens=cfg.max_tokens,
        seed=cfg.seed,
        ignore_eos=cfg.ignore_eos,
    )
    total_turns = sum(len(p.turns) for w in wls for p in w.prompts)
    peer_turns = sum(
        len(p.turns) for w in wls for p in w.limited(cfg.peer_limit).prompts if peer_specs
    )
    sink.start(total_turns * len(specs) + peer_turns * len(peer_specs))

    # Our engines, built once (layer-skip calibrates here) and warmed up.
    engines: dict[str, tuple[Engine, Any]] = {}
    baselines = {spec.label: AcceptanceBaseline() for spec in specs}
    methods: dict[str, Method] = {}
    target_bytes = target.net.weights.nbytes()
    warm_ids = _warmup_ids(target, wls)
    for spec in specs:
        t0 = time.perf_counter()
        engine = Engine(
            target,
            draft=draft if spec.method == "draft" else None,
            method=spec.method,
            num_speculative_tokens=spec.k if spec.k is not None else 5,
            proposer_options={
                **spec.options,
                **({"eagle_head": eagle_head} if spec.method == "eagle" else {}),
            },
        )
        setup = time.perf_counter() - t0
        take = record_steps(engine)
        if cfg.warmup:
            engine.generate(warm_ids, SamplingParams(max_tokens=4, seed=0))
        take()
        engines[spec.label] = (engine, take)
        methods[spec.label] = _our_method(spec, engine, target, draft, target_bytes, setup, cfg)

    samples: list[Sample] = []
    prompt_ids: dict[tuple[str, str], list[list[int]]] = {}
    baseline_tokens: dict[tuple[str, str], list[list[int]]] = {}
    skipped: list[str] = []
    limit = min(e.max_seq_len for e, _ in engines.values())
    for wl in wls:
        for prompt in wl.prompts:
            key = (wl.name, prompt.id)
            runs = {s.label: Sample(wl.name, prompt.id, s.label, "speculant") for s in specs}
            replies: list[str] = []
            turn_ids: list[list[int]] = []
            ok = True
            for t in range(len(prompt.turns)):
                ids = encode_turn(target, wl, prompt.turns[: t + 1], replies)
                if len(ids) + cfg.max_tokens > limit:
                    skipped.append(
                        f"{wl.name}/{prompt.id}: {len(ids)} prompt tokens + {cfg.max_tokens} "
                        f"new do not fit the {limit}-token context; prompt skipped"
                    )
                    sink.message(skipped[-1])
                    ok = False
                    break
                turn_ids.append(ids)
                for spec in specs:
                    engine, take = engines[spec.label]
                    sample = runs[spec.label]
                    with measured(energy, memory) as usage:
                        res = engine.generate(ids, params)
                    sample.add_usage(usage, res.stats.elapsed_s)
                    _add_stats(sample, len(ids), res, take())
                    verdict = baselines[spec.label].judge(
                        res.stats.num_drafted, res.stats.num_accepted
                    )
                    sample.zscores.append(verdict.zscore)
                    sample.anomalies += verdict.flagged
                    speed = res.stats.tokens_per_second
                    sink.advance(f"{wl.name} {prompt.id} {spec.label}: {speed:.1f} tok/s")
                replies.append(_reply_text(target, runs[BASELINE].token_ids[-1]))
            if not ok:
                remaining = len(prompt.turns) - len(turn_ids)
                for _ in range(remaining * len(specs) + len(prompt.turns) * len(peer_specs)):
                    sink.advance(f"{wl.name} {prompt.id}: skipped")
                continue
            base = runs[BASELINE].token_ids
            for sample in runs.values():
                sample.identical = sample.token_ids == base
                samples.append(sample)
            prompt_ids[key] = turn_ids
            baseline_tokens[key] = base

    # Peers: one at a time, on the prompt ids our baseline saw, then unloaded.
    del engines
    gc.collect()
    eos = tuple(sorted(target.tokenizer.eos_token_ids)) if target.tokenizer else ()
    sampling = PeerSampling(
        cfg.max_tokens, cfg.temperature, cfg.top_k, cfg.top_p, cfg.seed, eos, cfg.ignore_eos
    )
    peer_prompts = _peer_prompts(prompt_ids, cfg.peer_limit)
    max_context = max((len(i) for ids in peer_prompts.values() for i in ids), default=64)
    max_context = max_context + cfg.max_tokens + 64
    n_runs = sum(len(ids) for ids in peer_prompts.values())
    for pspec in peer_specs:
        try:
            t0 = time.perf_counter()
            peer = open_peer(pspec, target, draft, max_context, torch.get_num_threads())
            setup = time.perf_counter() - t0
        except PeerUnavailable as exc:
            skipped.append(f"peer {pspec.label} skipped: {exc}")
            sink.message(skipped[-1])
            for _ in range(n_runs):
                sink.advance(f"peer {pspec.label}: skipped")
            continue
        methods[pspec.label] = _peer_method(peer, setup)
        done = 0
        try:
            if cfg.warmup:
                peer.generate(warm_ids, PeerSampling(4, eos=eos))
            for key, turns in peer_prompts.items():
                sample = Sample(key[0], key[1], pspec.label, "peer")
                for ids in turns:
                    with measured(energy, memory) as usage:
                        out = peer.generate(ids, sampling)
                    sample.add_usage(usage, out.seconds)
                    _add_peer_output(sample, len(ids), out)
                    done += 1
                    sink.advance(f"{key[0]} {key[1]} {pspec.label}: {out_tok_s(out):.1f} tok/s")
                sample.identical = sample.token_ids == baseline_tokens[key]
                samples.append(sample)
        except Exception as exc:  # another engine's failure must not end the benchmark
            samples[:] = [s for s in samples if s.method != pspec.label]
            methods.pop(pspec.label, None)
            skipped.append(f"peer {pspec.label} failed: {type(exc).__name__}: {exc}")
            sink.message(skipped[-1])
            for _ in range(n_runs - done):
                sink.advance(f"peer {pspec.label}: failed")
        finally:
            peer.close()

    rows = _rows(samples, methods, cfg, [w.name for w in wls])
    failures = [
        f"{r['workload']}/{r['method']}: {r['identical_share']:.0%} identical"
        for r in rows
        if r["lossless_expected"] and r["identical_share"] is not None and r["identical_share"] < 1
    ]
    meta = _meta(target, draft, cfg, wls, specs, peer_specs, energy, memory, command)
    meta["duration_s"] = time.time() - started
    return BenchResult(meta, rows, [s.to_dict() for s in samples], skipped, failures)


def _peer_prompts(
    prompt_ids: dict[tuple[str, str], list[list[int]]], peer_limit: int | None
) -> dict[tuple[str, str], list[list[int]]]:
    """The first `peer_limit` prompts of each workload (all when None): peers are slow,
    and their per-prompt speedups stay comparable on a subset."""
    if peer_limit is None:
        return prompt_ids
    seen: dict[str, int] = {}
    out = {}
    for key, ids in prompt_ids.items():
        seen[key[0]] = seen.get(key[0], 0) + 1
        if seen[key[0]] <= peer_limit:
            out[key] = ids
    return out


def out_tok_s(out: Any) -> float:
    return len(out.token_ids) / out.seconds if out.seconds > 0 else 0.0


def _warmup_ids(target: Model, wls: Sequence[Workload]) -> list[int]:
    for wl in wls:
        for prompt in wl.prompts:
            return encode_turn(target, wl, prompt.turns[:1], [])[:32]
    return [1, 2, 3, 4]


def _reply_text(target: Model, ids: list[int]) -> str:
    tok = target.tokenizer
    if tok is None:
        return ""
    eos = tok.eos_token_ids
    return tok.decode([t for t in ids if t not in eos], skip_special_tokens=True)


def _add_stats(sample: Sample, n_prompt: int, res: Any, steps: StepRecord) -> None:
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


def _add_peer_output(sample: Sample, n_prompt: int, out: Any) -> None:
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


def _our_method(
    spec: MethodSpec,
    engine: Engine,
    target: Model,
    draft: Model | None,
    target_bytes: int,
    setup: float,
    cfg: BenchConfig,
) -> Method:
    weights = target_bytes
    settings: dict[str, Any] = {"k": spec.k, **spec.options}
    if spec.method == BASELINE:
        text = "speculant plain decoding (the baseline)"
        settings = {}
    elif spec.method == "draft":
        assert draft is not None
        weights += draft.net.weights.nbytes()
        text = f"speculant, draft model {draft.name}, k={spec.k}"
        settings["draft"] = draft.name
    elif spec.method == "eagle":
        runtime = getattr(engine.proposer, "runtime", None)
        text = f"speculant, EAGLE head, depth {spec.k}"
        if spec.tree is not None and spec.tree[0] > 1:
            text += f", dynamic tree (top-{spec.tree[0]}, {spec.tree[1]} tokens)"
        else:
            text += ", chain"
        if runtime is not None:
            weights += runtime.nbytes
            settings["draft_vocab"] = int(runtime.draft_vocab.numel())
    else:
        text = f"speculant, {spec.method} proposer, k={spec.k}"
        skip = getattr(engine.proposer, "skip_layers", None)
        if skip is not None:
            settings["skip_layers"] = list(skip)
            text += f", layers {list(skip)} skipped"
    return Method(
        label=spec.label,
        kind="speculant",
        engine="speculant",
        proposer=spec.method,
        k=spec.k,
        description=text,
        settings=settings,
        weights_bytes=weights,
        setup_s=setup,
        lossless=cfg.reproducible,
    )


def _peer_method(peer: Peer, setup: float) -> Method:
    return Method(
        label=peer.spec.label,
        kind="peer",
        engine=peer.engine,
        proposer=peer.spec.name,
        k=peer.spec.k,
        description=peer.description,
        settings=peer.settings,
        weights_bytes=peer.weights_bytes,
        setup_s=setup,
        lossless=False,
    )


# ---------------------------------------------------------------- aggregation


def _rows(
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


def _meta(
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

    def model_info(m: Model | None) -> dict[str, Any] | None:
        if m is None:
            return None
        return {
            "name": m.name,
            "source": str(m.source) if m.source else None,
            "arch": m.config.arch,
            "layers": m.config.n_layers,
            "dtype": m.dtype_name,
            "weights_mb": m.net.weights.nbytes() / 1e6,
        }

    return {
        "speculant_version": speculant.__version__,
        "command": command,
        "started_utc": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "target": model_info(target),
        "draft": model_info(draft),
        "machine": {
            "cpu": cpu_description(),
            "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(),
            "python": platform.python_version(),
            "platform": platform.platform(),
        },
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
