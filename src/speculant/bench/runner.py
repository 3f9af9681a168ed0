"""The benchmark runner: every method and every peer on the same prompt ids, against the
plain baseline measured in the same run. Peers that run as processes of their own
(llama.cpp's tools) take their turn on each prompt right after our methods, so that the
machine's drift over a run moves both sides of a ratio alike; peers that load a model into
this process (Hugging Face, llama-cpp-python) run after all of ours, once our engines are
unloaded.

    from speculant.bench import BenchConfig, run_bench
    result = run_bench(target, draft, BenchConfig(workloads=["code"], limit=2))
    result.rows       # one dict per (workload, method); workload "all" pools them

What runs is in bench/specs.py (MethodSpec, BenchConfig), what is recorded and how rows
are aggregated in bench/rows.py (Sample, BenchResult); this module is the run itself.
"""

from __future__ import annotations

import gc
import sys
import time
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from speculant.anomaly import AcceptanceBaseline
from speculant.bench.measure import (
    EnergyMeter,
    MemoryProbe,
    measured,
    record_steps,
)
from speculant.bench.peers import (
    LLAMA_CLI_PEERS,
    Peer,
    PeerSampling,
    PeerUnavailable,
    expand_peers,
    open_peer,
)
from speculant.bench.rows import (
    BenchResult,
    Method,
    Sample,
    add_peer_output,
    add_stats,
    build_meta,
    build_rows,
)
from speculant.bench.specs import BASELINE, BenchConfig, MethodSpec, parse_methods
from speculant.bench.workloads import Workload, encode_turn, load_workloads
from speculant.engine import Engine
from speculant.models.model import Model
from speculant.sampling import SamplingParams


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

    def build(spec: MethodSpec) -> Engine:
        return Engine(
            target,
            draft=draft if spec.method == "draft" else None,
            method=spec.method,
            num_speculative_tokens=spec.k if spec.k is not None else 5,
            proposer_options={
                **spec.options,
                **({"eagle_head": eagle_head} if spec.method == "eagle" else {}),
            },
        )

    for spec in specs:
        t0 = time.perf_counter()
        engine = build(spec)
        setup = time.perf_counter() - t0
        take = record_steps(engine)
        if cfg.warmup:
            engine.generate(warm_ids, SamplingParams(max_tokens=4, seed=0))
        take()
        engines[spec.label] = (engine, take)
        methods[spec.label] = _our_method(spec, engine, target, draft, target_bytes, setup, cfg)

    samples: list[Sample] = []
    skipped: list[str] = []
    eos = tuple(sorted(target.tokenizer.eos_token_ids)) if target.tokenizer else ()
    sampling = PeerSampling(
        cfg.max_tokens, cfg.temperature, cfg.top_k, cfg.top_p, cfg.seed, eos, cfg.ignore_eos
    )
    inline_specs = [p for p in peer_specs if p.name in LLAMA_CLI_PEERS]
    later_specs = [p for p in peer_specs if p.name not in LLAMA_CLI_PEERS]
    dead: set[str] = set()  # inline peers that could not open or failed

    def run_inline(key: tuple[str, str], turns: list[list[int]], base: list[list[int]]) -> None:
        """Each out-of-process peer on one prompt's turns, right after our methods."""
        context = max(len(i) for i in turns) + cfg.max_tokens + 64
        for pspec in inline_specs:
            if pspec.label in dead:
                for _ in turns:
                    sink.advance(f"peer {pspec.label}: skipped")
                continue
            try:
                t0 = time.perf_counter()
                peer = open_peer(pspec, target, draft, context, torch.get_num_threads())
                setup = time.perf_counter() - t0
            except PeerUnavailable as exc:
                dead.add(pspec.label)
                skipped.append(f"peer {pspec.label} skipped: {exc}")
                sink.message(skipped[-1])
                for _ in turns:
                    sink.advance(f"peer {pspec.label}: skipped")
                continue
            sample = Sample(key[0], key[1], pspec.label, "peer")
            try:
                if pspec.label not in methods:
                    methods[pspec.label] = _peer_method(peer, setup)
                    if cfg.warmup:
                        peer.generate(warm_ids, PeerSampling(4, eos=eos))
                _peer_turns(peer, sample, turns, base, sampling, (energy, memory), sink)
                samples.append(sample)
            except Exception as exc:  # another engine's failure must not end the benchmark
                dead.add(pspec.label)
                samples[:] = [s for s in samples if s.method != pspec.label]
                methods.pop(pspec.label, None)
                skipped.append(f"peer {pspec.label} failed: {type(exc).__name__}: {exc}")
                sink.message(skipped[-1])
                for _ in range(len(turns) - sample.turns):
                    sink.advance(f"peer {pspec.label}: failed")
            finally:
                peer.close()

    prompt_ids: dict[tuple[str, str], list[list[int]]] = {}
    baseline_tokens: dict[tuple[str, str], list[list[int]]] = {}
    limit = min(e.max_seq_len for e, _ in engines.values())
    done_prompts: dict[str, int] = {}
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
                    if cfg.fresh_engines and spec.method != BASELINE:
                        # a first request: nothing learned by -k auto or the proposer
                        engine = build(spec)
                        take = record_steps(engine)
                    sample = runs[spec.label]
                    with measured(energy, memory) as usage:
                        res = engine.generate(ids, params)
                    sample.add_usage(usage, res.stats.elapsed_s)
                    add_stats(sample, len(ids), res, take())
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
            done_prompts[wl.name] = done_prompts.get(wl.name, 0) + 1
            if inline_specs and (cfg.peer_limit is None or done_prompts[wl.name] <= cfg.peer_limit):
                run_inline(key, turn_ids, base)

    # Peers in this process: one at a time, on the prompt ids our baseline saw, then unloaded.
    del engines
    gc.collect()
    peer_prompts = _peer_prompts(prompt_ids, cfg.peer_limit)
    max_context = max((len(i) for ids in peer_prompts.values() for i in ids), default=64)
    max_context = max_context + cfg.max_tokens + 64
    n_runs = sum(len(ids) for ids in peer_prompts.values())
    for pspec in later_specs:
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
        ran: list[Sample] = []  # this peer's prompts, the one under way last
        try:
            if cfg.warmup:
                peer.generate(warm_ids, PeerSampling(4, eos=eos))
            for key, turns in peer_prompts.items():
                ran.append(Sample(key[0], key[1], pspec.label, "peer"))
                _peer_turns(
                    peer, ran[-1], turns, baseline_tokens[key], sampling, (energy, memory), sink
                )
                samples.append(ran[-1])
        except Exception as exc:  # another engine's failure must not end the benchmark
            done = sum(sample.turns for sample in ran)
            samples[:] = [s for s in samples if s.method != pspec.label]
            methods.pop(pspec.label, None)
            skipped.append(f"peer {pspec.label} failed: {type(exc).__name__}: {exc}")
            sink.message(skipped[-1])
            for _ in range(n_runs - done):
                sink.advance(f"peer {pspec.label}: failed")
        finally:
            peer.close()

    rows = build_rows(samples, methods, cfg, [w.name for w in wls])
    failures = [
        f"{r['workload']}/{r['method']}: {r['identical_share']:.0%} identical"
        for r in rows
        if r["lossless_expected"] and r["identical_share"] is not None and r["identical_share"] < 1
    ]
    meta = build_meta(target, draft, cfg, wls, specs, peer_specs, energy, memory, command)
    meta["duration_s"] = time.time() - started
    return BenchResult(meta, rows, [s.to_dict() for s in samples], skipped, failures)


def _peer_turns(
    peer: Peer,
    sample: Sample,
    turns: list[list[int]],
    base: list[list[int]],
    sampling: PeerSampling,
    meters: tuple[EnergyMeter, MemoryProbe],
    sink: Progress,
) -> None:
    """`peer` over one prompt's turns, measured into `sample` (sample.turns counts the
    turns done, should one fail), judged against our baseline's tokens `base`."""
    for ids in turns:
        with measured(*meters) as usage:
            out = peer.generate(ids, sampling)
        sample.add_usage(usage, out.seconds)
        add_peer_output(sample, len(ids), out)
        speed = out_tok_s(out)
        sink.advance(f"{sample.workload} {sample.prompt_id} {sample.method}: {speed:.1f} tok/s")
    sample.identical = sample.token_ids == base


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
