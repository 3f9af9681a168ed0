"""`speculant bench --serve`: speculation under server load.

    from speculant.bench.serve import ServeConfig, run_serve_bench
    result = run_serve_bench(target, draft, ServeConfig(methods=["ngram:3"], concurrency=[1, 4]))
    result.load   # one row per (configuration, prefix caching, budget, concurrency)

The load sweep: for each configuration (METHOD[:K...], as `speculant bench --methods`,
plain decoding `none` first), each prefix-caching setting, each prefill budget
(--max-num-batched-tokens) and each concurrency level c, the real app (`speculant
serve`'s, uvicorn on a loopback port, the continuous-batching engine behind it) is
started in this process on the loaded models and c streaming chat requests are sent at
once with the official `openai` client. Each row has time to first token and the gaps
between a stream's content chunks (p50 / p99), aggregate tokens/s and requests/s,
acceptance and tokens per target pass (from the responses' `usage.speculation`), the
speedup over plain decoding at the same c, and, for greedy or seeded runs, whether
every response's text equals plain decoding's.

Optional scenarios, on the scheduler the server runs:
- long_prompt_join: a chat stream runs alone, then again while a long prompt joins at
  its 5th step, once per budget; the stream's per-token latency is taken from the join
  until the long request's first token.
- chat_second_turn: a chat's first turn and its second turn (the first, its answer, a
  new question), with and without the prefix cache: time to first token of each.
- batch: N chat requests decoded together in one scheduler, plain against each
  configuration, each configuration twice on one engine (the second run knows the pass
  costs the first measured, as a long-running server does).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import statistics
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from speculant.bench.measure import machine_info, model_info, now_utc, percentile, threads_text
from speculant.bench.specs import BASELINE, MethodSpec, parse_methods
from speculant.bench.workloads import load_workload
from speculant.engine import Engine
from speculant.models.model import Model
from speculant.sampling import SamplingParams

SERVE_PLOT = "serve_concurrency.png"
DEFAULT_SERVE_METHODS = ["draft:3", "ngram:3"]
SERVED_NAME = "bench"
JOIN_STEP = 5  # the long prompt joins at the stream's 5th step
# The long prompt and the chat history: the text of a source file of ours (as shipped).
FILLER = Path(__file__).resolve().parents[1] / "scheduler.py"
QUESTION = "Write a Python function that merges two sorted lists, with a docstring and tests."
WARMUP = "Say hello."
ASKS = (
    "Write a Python function that merges two sorted lists.",
    "Explain what a binary heap is.",
    "Fix the bug: def add(a, b): return a - b",
    "Write a SQL query for the top 5 customers by revenue.",
    "Rewrite as a list comprehension: out = []\nfor x in xs:\n    if x > 0:\n        out.append(x)",
    "What does git rebase do?",
    "Write a bash one-liner that counts lines in all .py files.",
    "Implement fizzbuzz in Python.",
)


@dataclass
class ServeConfig:
    methods: list[str] | None = None  # METHOD[:K...]; None: DEFAULT_SERVE_METHODS
    ks: list[int | str] = field(default_factory=lambda: [5])  # for methods given without K
    concurrency: list[int] = field(default_factory=lambda: [1, 4, 8])
    prefix_caching: list[bool] = field(default_factory=lambda: [True])
    budgets: list[int] = field(default_factory=lambda: [32])  # 0: prefill whole
    workload: str = "code"
    max_tokens: int = 32
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = 0
    load: bool = True
    long_prompt_join: bool = False
    long_tokens: int = 512
    stream_tokens: int = 64
    chat_second_turn: bool = False
    history_tokens: int = 512
    batch: bool = False
    batch_seqs: int = 8
    eagle_head: str | None = None
    warmup: bool = True

    def __post_init__(self) -> None:
        for name, values, least in (
            ("concurrency", self.concurrency, 1),
            ("max_num_batched_tokens", self.budgets, 0),
        ):
            if not values:
                raise ValueError(f"{name}: give at least one value")
            for v in values:
                if v < least:
                    raise ValueError(f"{name}={v} is out of range: use integers >= {least}")
        for name, value in (
            ("max_tokens", self.max_tokens),
            ("long_tokens", self.long_tokens),
            ("stream_tokens", self.stream_tokens),
            ("history_tokens", self.history_tokens),
            ("batch_seqs", self.batch_seqs),
        ):
            if value < 1:
                raise ValueError(f"{name}={value} is out of range: use >= 1")
        if not self.prefix_caching:
            raise ValueError("prefix_caching: give on, off or both")

    @property
    def specs(self) -> list[MethodSpec]:
        """Every configuration, plain decoding first (the speedups' baseline)."""
        return parse_methods(self.methods or DEFAULT_SERVE_METHODS, self.ks)

    @property
    def scenario_specs(self) -> list[MethodSpec]:
        """The configurations the long-prompt and chat scenarios run: those asked for
        (plain decoding only when it was named, or is all there is)."""
        specs = self.specs
        named = [str(m).split(":")[0] for m in self.methods or DEFAULT_SERVE_METHODS]
        chosen = [s for s in specs if s.method != BASELINE or BASELINE in named]
        return chosen or specs[:1]

    @property
    def reproducible(self) -> bool:
        return self.temperature == 0 or self.seed is not None


@dataclass
class ServeResult:
    meta: dict[str, Any]
    load: list[dict[str, Any]] = field(default_factory=list)
    long_prompt_join: list[dict[str, Any]] = field(default_factory=list)
    chat_second_turn: list[dict[str, Any]] = field(default_factory=list)
    batch: list[dict[str, Any]] = field(default_factory=list)

    @property
    def lossless_failures(self) -> list[str]:
        out = [
            f"{r['label']} at c={r['concurrency']}"
            for r in self.load
            if r["identical_to_plain"] is False
        ]
        out += [f"batch {r['config']} run {r['run']}" for r in self.batch if r["same"] is False]
        return out

    @property
    def lossless_checked(self) -> bool:
        return bool(self.meta["sampling"]["reproducible"] and (self.load or self.batch))

    def to_dict(self) -> dict[str, Any]:
        return {
            "meta": self.meta,
            "load": self.load,
            "long_prompt_join": self.long_prompt_join,
            "chat_second_turn": self.chat_second_turn,
            "batch": self.batch,
            "lossless": {
                "checked": self.lossless_checked,
                "identical": (not self.lossless_failures) if self.lossless_checked else None,
                "failures": self.lossless_failures,
            },
        }


# ---------------------------------------------------------------- the run


def _say(text: str) -> None:
    import sys

    print(text, file=sys.stderr, flush=True)


def run_serve_bench(
    target: Model,
    draft: Model | None,
    config: ServeConfig | None = None,
    *,
    command: str | None = None,
    log: Callable[[str], None] = _say,
) -> ServeResult:
    cfg = config or ServeConfig()
    specs = cfg.specs
    if draft is None and any(s.method == "draft" for s in specs):
        raise ValueError("method 'draft' needs a draft model: pass one or drop the method")
    if target.tokenizer is None:
        raise ValueError(f"model {target.name!r} has no tokenizer: the server bench needs one")
    eagle_head = None
    if any(s.method == "eagle" for s in specs):
        if cfg.eagle_head is None:
            raise ValueError("method 'eagle' needs a trained head: pass --eagle-head DIR")
        from speculant.eagle.head import load_head

        eagle_head = load_head(cfg.eagle_head)

    def engine(spec: MethodSpec) -> Engine:
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

    result = ServeResult(_meta(target, draft, cfg, specs, command))
    if cfg.load:
        result.load = _load_sweep(engine, specs, cfg, log)
    scenario = cfg.scenario_specs
    if cfg.long_prompt_join or cfg.chat_second_turn:
        for spec in scenario:
            if cfg.long_prompt_join:
                rows = long_prompt_join(engine(spec), cfg, log)
                result.long_prompt_join += [{"config": spec.label, **r} for r in rows]
            if cfg.chat_second_turn:
                rows = chat_second_turn(engine(spec), cfg, log)
                result.chat_second_turn += [{"config": spec.label, **r} for r in rows]
    if cfg.batch:
        result.batch = batch_runs(engine, specs, cfg, log)
    result.meta["finished_utc"] = now_utc()
    return result


def _meta(
    target: Model,
    draft: Model | None,
    cfg: ServeConfig,
    specs: Sequence[MethodSpec],
    command: str | None,
) -> dict[str, Any]:
    import speculant

    return {
        "mode": "serve",
        "speculant_version": speculant.__version__,
        "command": command,
        "started_utc": now_utc(),
        "target": model_info(target),
        "draft": model_info(draft if any(s.method == "draft" for s in specs) else None),
        "machine": machine_info(),
        "configs": [s.label for s in specs],
        "concurrency": list(cfg.concurrency),
        "prefix_caching": list(cfg.prefix_caching),
        "max_num_batched_tokens": list(cfg.budgets),
        "workload": cfg.workload,
        "max_tokens": cfg.max_tokens,
        "sampling": {
            "temperature": cfg.temperature,
            "top_k": cfg.top_k,
            "top_p": cfg.top_p,
            "seed": cfg.seed,
            "ignore_eos": True,
            "reproducible": cfg.reproducible,
        },
        "scenarios": {
            "load": cfg.load,
            "long_prompt_join": {"long_tokens": cfg.long_tokens, "stream_tokens": cfg.stream_tokens}
            if cfg.long_prompt_join
            else None,
            "chat_second_turn": {"history_tokens": cfg.history_tokens}
            if cfg.chat_second_turn
            else None,
            "batch": {"seqs": cfg.batch_seqs} if cfg.batch else None,
        },
    }


# ---------------------------------------------------------------- load sweep


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def serving(async_engine: Any) -> Iterator[str]:
    """The app on 127.0.0.1:<free port> in a thread of this process, stopped after."""
    import uvicorn

    from speculant.server import create_app

    port = _free_port()
    config = uvicorn.Config(
        create_app(async_engine), host="127.0.0.1", port=port, log_level="error"
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="bench-server", daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the benchmark server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=60)


def require_openai() -> Any:
    try:
        import openai
    except ImportError:
        raise RuntimeError(
            "speculant bench --serve sends its requests with the official openai client: "
            "pip install openai"
        ) from None
    return openai


async def _one(
    client: Any, prompt: str, n: int, cfg: ServeConfig, seed: int | None
) -> dict[str, Any]:
    t0 = time.perf_counter()
    last = None
    first = None
    gaps: list[float] = []
    text: list[str] = []
    usage = None
    extra: dict[str, Any] = {"ignore_eos": True}
    if cfg.top_k > 0:
        extra["top_k"] = cfg.top_k
    kwargs: dict[str, Any] = {} if seed is None else {"seed": seed}
    stream = await client.chat.completions.create(
        model=SERVED_NAME,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=n,
        temperature=cfg.temperature,
        top_p=cfg.top_p,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=extra,
        **kwargs,
    )
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            now = time.perf_counter()
            if first is None:
                first = now - t0
            else:
                assert last is not None
                gaps.append(now - last)
            last = now
            text.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            usage = chunk.usage
    if usage is None:
        raise RuntimeError("the server sent no usage in its stream")
    spec = (usage.model_extra or {}).get("speculation") or {}
    return {
        "ttft": first if first is not None else time.perf_counter() - t0,
        "gaps": gaps,
        "text": "".join(text),
        "tokens": usage.completion_tokens,
        "drafted": spec.get("drafted_tokens", 0),
        "accepted": spec.get("accepted_tokens", 0),
        "forwards": spec.get("target_forwards", 0),
    }


async def _level(url: str, prompts: Sequence[str], n: int, cfg: ServeConfig) -> dict[str, Any]:
    """len(prompts) streaming requests sent at once; their figures pooled."""
    openai = require_openai()
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="bench", max_retries=0)
    async with client:
        t0 = time.perf_counter()
        try:
            runs = await asyncio.gather(
                *[
                    _one(client, p, n, cfg, None if cfg.seed is None else cfg.seed + i)
                    for i, p in enumerate(prompts)
                ]
            )
        except openai.APIError as exc:  # e.g. a prompt longer than the model's context
            raise RuntimeError(f"the benchmark server refused a request: {exc}") from None
        wall = time.perf_counter() - t0
    tokens = sum(r["tokens"] for r in runs)
    drafted = sum(r["drafted"] for r in runs)
    forwards = sum(r["forwards"] for r in runs)
    ttfts = [r["ttft"] for r in runs]
    gaps = [g for r in runs for g in r["gaps"]]
    return {
        "concurrency": len(prompts),
        "requests": len(runs),
        "wall_s": wall,
        "tokens": tokens,
        "tokens_requested": n * len(prompts),
        "tok_s": tokens / wall,
        "requests_s": len(runs) / wall,
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p99_s": percentile(ttfts, 99),
        "itl_p50_ms": 1000 * percentile(gaps, 50) if gaps else None,
        "itl_p99_ms": 1000 * percentile(gaps, 99) if gaps else None,
        "chunks": len(gaps) + len(runs),
        "drafted": drafted,
        "accepted": sum(r["accepted"] for r in runs),
        "target_forwards": forwards,
        "mean_accepted_length": tokens / forwards if forwards else None,
        "acceptance_rate": sum(r["accepted"] for r in runs) / drafted if drafted else None,
        "texts": [r["text"] for r in runs],
    }


def _label(spec: MethodSpec, cached: bool, budget: int, cfg: ServeConfig) -> str:
    label = spec.label
    if len(cfg.prefix_caching) > 1:
        label += " cache " + ("on" if cached else "off")
    if len(cfg.budgets) > 1:
        label += f" budget {budget or 'whole'}"
    return label


def _fresh_draft_cache(engine: Engine) -> None:
    """A draft model keeps a prefix cache of its own across schedulers: drop it, so that
    each level starts as cold as the target's (the next scheduler makes a new one)."""
    from speculant.proposers.base import CachesPrompt

    if isinstance(engine.proposer, CachesPrompt):
        engine.proposer.prefix_cache = None


def _load_sweep(
    make: Callable[..., Engine],
    specs: Sequence[MethodSpec],
    cfg: ServeConfig,
    log: Callable[[str], None],
) -> list[dict[str, Any]]:
    from speculant.server import AsyncEngine

    require_openai()  # fail before any work when the client is missing
    prompts = [p.turns[0] for p in load_workload(cfg.workload).prompts]
    while len(prompts) < max(cfg.concurrency):
        prompts += prompts
    rows: list[dict[str, Any]] = []
    for spec in specs:
        for cached in cfg.prefix_caching:
            for budget in cfg.budgets:
                # One engine per setting: -k auto's learned pass costs carry over between
                # its levels (as in a long-running server), nothing between settings.
                engine = make(spec)
                for c in cfg.concurrency:
                    _fresh_draft_cache(engine)
                    aeng = AsyncEngine(
                        engine,
                        model_name=SERVED_NAME,
                        max_num_seqs=c,
                        max_waiting=None,
                        max_num_batched_tokens=budget or None,
                        prefix_cache_bytes=(1 << 30) if cached else 0,
                    )
                    with serving(aeng) as url:
                        if cfg.warmup:
                            asyncio.run(_level(url, [WARMUP], 4, cfg))
                        row = asyncio.run(_level(url, prompts[:c], cfg.max_tokens, cfg))
                    aeng.shutdown()
                    row.update(
                        label=_label(spec, cached, budget, cfg),
                        config=spec.label,
                        method=spec.method,
                        k=spec.k,
                        prefix_caching=cached,
                        max_num_batched_tokens=budget,
                    )
                    rows.append(row)
                    log(
                        f"serve {row['label']} c={c}: {row['tok_s']:.2f} tok/s, TTFT p50 "
                        f"{row['ttft_p50_s']:.2f}s, {_f(row['mean_accepted_length'], '.2f')} "
                        "tok/pass"
                    )
    base = {
        (r["prefix_caching"], r["max_num_batched_tokens"], r["concurrency"]): r
        for r in rows
        if r["method"] == BASELINE
    }
    for r in rows:
        b = base.get((r["prefix_caching"], r["max_num_batched_tokens"], r["concurrency"]))
        r["speedup"] = r["tok_s"] / b["tok_s"] if b else None
        r["identical_to_plain"] = r["texts"] == b["texts"] if b and cfg.reproducible else None
    for r in rows:
        r["texts"] = [t[:200] for t in r["texts"]]  # kept short in the report
    return rows


# ---------------------------------------------------------------- scenarios


def _chat_ids(engine: Engine, messages: list[dict[str, str]]) -> list[int]:
    tok = engine.target.tokenizer
    assert tok is not None
    return list(tok.encode(tok.apply_chat_template(messages), add_special_tokens=False))


def _filler(engine: Engine) -> list[int]:
    tok = engine.target.tokenizer
    assert tok is not None
    return list(tok.encode(FILLER.read_text(encoding="utf-8")))


def stream_under_join(
    engine: Engine, short: list[int], long_ids: list[int] | None, budget: int, n: int
) -> dict[str, Any]:
    """A stream of n tokens alone (long_ids None), or while long_ids joins at its 5th
    step under the budget (0: whole prefill): the stream's per-token latency (a step's
    interval over the tokens it committed), from the join to the long request's first
    token."""
    sched = engine.scheduler(budget or None)
    sched.add("stream", short, SamplingParams(max_tokens=n, ignore_eos=True))
    last, steps = time.perf_counter(), 0
    gaps: list[float] = []
    joined: float | None = None
    ttft_long: float | None = None
    while sched.busy:
        if long_ids is not None and steps == JOIN_STEP:
            joined = time.perf_counter()
            sched.add("long", long_ids, SamplingParams(max_tokens=4, ignore_eos=True))
        events = sched.step()
        steps += 1
        now = time.perf_counter()
        for e in events:
            ids = e.chunk.token_ids
            if e.seq.request_id == "long" and ids and ttft_long is None and joined is not None:
                ttft_long = now - joined
            if e.seq.request_id == "stream" and ids:
                measuring = long_ids is None or (joined is not None and ttft_long is None)
                if measuring and steps > 1:
                    gaps += [(now - last) / len(ids)] * len(ids)
                last = now
        if ttft_long is not None:
            break
    return {
        "budget": budget,
        "long_prompt": len(long_ids) if long_ids else 0,
        "itl_p50_ms": 1000 * statistics.median(gaps) if gaps else None,
        "itl_p99_ms": 1000 * _p(gaps, 0.99) if gaps else None,
        "itl_max_ms": 1000 * max(gaps) if gaps else None,
        "ttft_long_s": ttft_long,
        "stream_tokens_measured": len(gaps),
    }


def _engine_label(engine: Engine) -> str:
    k = engine.num_speculative_tokens
    return engine.method if engine.method == BASELINE else f"{engine.method}:{k}"


def _p(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def long_prompt_join(
    engine: Engine, cfg: ServeConfig, log: Callable[[str], None]
) -> list[dict[str, Any]]:
    """The stream alone, then while a cfg.long_tokens prompt joins, once per budget."""
    short = _chat_ids(engine, [{"role": "user", "content": QUESTION}])
    filler = _filler(engine)
    if len(filler) < cfg.long_tokens:
        raise ValueError(
            f"long_tokens={cfg.long_tokens} is out of range: the filler text has "
            f"{len(filler)} tokens"
        )
    long_ids = filler[: cfg.long_tokens]
    room = engine.max_seq_len
    if cfg.long_tokens + 4 > room or len(short) + cfg.stream_tokens > room:
        raise ValueError(
            f"long_tokens={cfg.long_tokens} / stream_tokens={cfg.stream_tokens} do not fit "
            f"the context of {room} tokens"
        )
    if cfg.warmup:
        engine.generate(short, SamplingParams(max_tokens=8))
    rows = [stream_under_join(engine, short, None, 0, cfg.stream_tokens)]
    for budget in cfg.budgets:
        rows.append(stream_under_join(engine, short, long_ids, budget, cfg.stream_tokens))
    solo = rows[0]["itl_p99_ms"]
    for r in rows:
        p99 = r["itl_p99_ms"]
        r["p99_over_alone"] = p99 / solo if p99 is not None and solo else None
        what = f"{r['long_prompt']} tokens join, budget {r['budget'] or 'whole'}"
        log(
            f"long-prompt join {_engine_label(engine)} "
            + (what if r["long_prompt"] else "stream alone")
            + f": stream ITL p50 {_f(r['itl_p50_ms'], '.0f')} ms, p99 "
            f"{_f(r['itl_p99_ms'], '.0f')} ms, long TTFT {_f(r['ttft_long_s'], '.2f')} s"
        )
    return rows


def chat_second_turn(
    engine: Engine, cfg: ServeConfig, log: Callable[[str], None]
) -> list[dict[str, Any]]:
    """A chat's first and second turn, without then with the prefix cache."""
    from speculant.prefix_cache import PrefixCache

    tok = engine.target.tokenizer
    assert tok is not None
    history = tok.decode(_filler(engine)[: cfg.history_tokens])

    def ttft(messages: list[dict[str, str]], store: PrefixCache | None) -> tuple[float, str, int]:
        prompt = _chat_ids(engine, messages)
        sched = engine.scheduler(None, store)
        t0 = time.perf_counter()
        sched.add("turn", prompt, SamplingParams(max_tokens=24, ignore_eos=True))
        first, text = 0.0, ""
        while sched.busy:
            for e in sched.step():
                if not first and e.chunk.token_ids:
                    first = time.perf_counter() - t0
                if e.result is not None:
                    text = e.result.text
        return first, text, len(prompt)

    rows = []
    for cached in (False, True):
        store = PrefixCache(1 << 30) if cached else None
        turn1 = [{"role": "user", "content": history}]
        t1, answer, n1 = ttft(turn1, store)
        turn2 = [
            *turn1,
            {"role": "assistant", "content": answer},
            {"role": "user", "content": "Why?"},
        ]
        t2, _, n2 = ttft(turn2, store)
        row = {
            "prefix_cache": cached,
            "prompt_tokens": [n1, n2],
            "ttft_turn1_s": t1,
            "ttft_turn2_s": t2,
            "turn2_over_turn1": t2 / t1 if t1 else None,
            "target_hits": store.hits if store else 0,
        }
        log(
            f"chat second turn {_engine_label(engine)}, prefix cache "
            f"{'on' if cached else 'off'}: TTFT {t1:.2f} s then {t2:.2f} s"
        )
        rows.append(row)
    _fresh_draft_cache(engine)
    return rows


def _batch_once(
    engine: Engine, prompts: list[list[int]], n: int, max_tokens: int
) -> dict[str, Any]:
    sched = engine.scheduler()
    for i in range(n):
        sched.add(
            i, prompts[i % len(prompts)], SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        )
    t0 = time.perf_counter()
    tokens = passes = drafted = accepted = 0
    outs: dict[int, list[int]] = {}
    while sched.busy:
        events = sched.step()
        passes += 1
        for e in events:
            tokens += len(e.chunk.token_ids)
            drafted += e.drafted
            accepted += e.accepted
            if e.result is not None:
                outs[e.seq.request_id] = list(e.result.token_ids)
    seconds = time.perf_counter() - t0
    return {
        "tokens": tokens,
        "tok_s": tokens / seconds,
        "passes": passes,
        "drafted": drafted,
        "accepted": accepted,
        "outs": outs,
    }


def batch_runs(
    make: Callable[..., Engine],
    specs: Sequence[MethodSpec],
    cfg: ServeConfig,
    log: Callable[[str], None],
) -> list[dict[str, Any]]:
    """cfg.batch_seqs chat requests decoded together, each configuration twice on one
    engine; plain decoding's first run is the baseline."""
    rows: list[dict[str, Any]] = []
    base_outs: dict[int, list[int]] | None = None
    base_rate = 0.0
    for spec in specs:
        engine = make(spec)
        prompts = [_chat_ids(engine, [{"role": "user", "content": a}]) for a in ASKS]
        if cfg.warmup:
            engine.generate(prompts[0], SamplingParams(max_tokens=8))  # warm up, alone
        for attempt in (1, 2):
            r = _batch_once(engine, prompts, cfg.batch_seqs, cfg.max_tokens)
            outs = r.pop("outs")
            if base_outs is None:  # specs[0] is plain decoding
                base_outs, base_rate = outs, r["tok_s"]
            r.update(config=spec.label, method=spec.method, k=spec.k, run=attempt)
            r["seqs"] = cfg.batch_seqs
            r["same"] = outs == base_outs
            r["vs_plain"] = r["tok_s"] / base_rate
            rows.append(r)
            log(
                f"batch {spec.label} run {attempt}: {r['tok_s']:.1f} tok/s, "
                f"{r['passes']} passes, same as plain: {_yes(r['same'])}"
            )
    return rows


# ---------------------------------------------------------------- output


def _f(value: float | None, fmt: str, suffix: str = "") -> str:
    return "—" if value is None else f"{value:{fmt}}{suffix}"


def _yes(value: bool | None) -> str:
    return "—" if value is None else ("yes" if value else "NO")


LOAD_HEAD = (
    "config",
    "c",
    "tok/s",
    "speedup",
    "req/s",
    "TTFT p50 s",
    "TTFT p99 s",
    "ITL p50 ms",
    "ITL p99 ms",
    "accept",
    "tok/pass",
    "same",
)


def _load_cells(r: dict[str, Any]) -> list[str]:
    return [
        r["label"],
        str(r["concurrency"]),
        f"{r['tok_s']:.2f}",
        _f(r["speedup"], ".2f", "x"),
        f"{r['requests_s']:.3f}",
        f"{r['ttft_p50_s']:.2f}",
        f"{r['ttft_p99_s']:.2f}",
        _f(r["itl_p50_ms"], ".0f"),
        _f(r["itl_p99_ms"], ".0f"),
        _f(r["acceptance_rate"], ".2f"),
        _f(r["mean_accepted_length"], ".2f"),
        _yes(r["identical_to_plain"]),
    ]


JOIN_HEAD = (
    "config",
    "long prompt joins",
    "budget",
    "stream ITL p50 ms",
    "p99 ms",
    "p99 / alone",
    "max ms",
    "long TTFT s",
)


def _join_cells(r: dict[str, Any]) -> list[str]:
    joined = r["long_prompt"]
    return [
        r["config"],
        f"{joined} tokens" if joined else "no (alone)",
        "-" if not joined else str(r["budget"] or "whole"),
        _f(r["itl_p50_ms"], ".0f"),
        _f(r["itl_p99_ms"], ".0f"),
        _f(r["p99_over_alone"], ".1f", "x"),
        _f(r["itl_max_ms"], ".0f"),
        _f(r["ttft_long_s"], ".1f") if r["ttft_long_s"] else "-",
    ]


CHAT_HEAD = (
    "config",
    "prefix cache",
    "prompt tokens",
    "TTFT turn 1 s",
    "TTFT turn 2 s",
    "turn 2 / turn 1",
)


def _chat_cells(r: dict[str, Any]) -> list[str]:
    return [
        r["config"],
        "on" if r["prefix_cache"] else "off",
        f"{r['prompt_tokens'][0]}, {r['prompt_tokens'][1]}",
        f"{r['ttft_turn1_s']:.1f}",
        f"{r['ttft_turn2_s']:.2f}",
        _f(r["turn2_over_turn1"], ".2f", "x"),
    ]


BATCH_HEAD = ("method", "k", "run", "tok/s", "passes", "drafted", "accepted", "same", "vs plain")


def _batch_cells(r: dict[str, Any]) -> list[str]:
    return [
        r["method"],
        "0" if r["k"] is None else str(r["k"]),
        str(r["run"]),
        f"{r['tok_s']:.1f}",
        str(r["passes"]),
        str(r["drafted"]),
        str(r["accepted"]),
        _yes(r["same"]),
        f"{r['vs_plain']:.2f}x",
    ]


def _sections(
    data: dict[str, Any],
) -> list[tuple[str, Sequence[str], list[list[str]]]]:
    out: list[tuple[str, Sequence[str], list[list[str]]]] = []
    if data["load"]:
        out.append(("Server load", LOAD_HEAD, [_load_cells(r) for r in data["load"]]))
    if data["long_prompt_join"]:
        rows = [_join_cells(r) for r in data["long_prompt_join"]]
        out.append(("A long prompt joins a running stream", JOIN_HEAD, rows))
    if data["chat_second_turn"]:
        rows = [_chat_cells(r) for r in data["chat_second_turn"]]
        out.append(("A chat's second turn", CHAT_HEAD, rows))
    if data["batch"]:
        out.append(
            (
                "Speculation beside a busy batch",
                BATCH_HEAD,
                [_batch_cells(r) for r in data["batch"]],
            )
        )
    return out


def _lossless_line(data: dict[str, Any]) -> str:
    lossless = data["lossless"]
    if not lossless["checked"]:
        return "Identical text: not checked (unseeded sampling, or no load / batch run)."
    if lossless["identical"]:
        return "Identical text: every configuration returned plain decoding's text."
    return "Identical text: FAILED for " + "; ".join(lossless["failures"]) + "."


def markdown(data: dict[str, Any]) -> str:
    """The tables of a `bench --serve` results.json as Markdown."""
    meta = data["meta"]
    draft = f", draft {meta['draft']['name']}" if meta.get("draft") else ""
    lines = [
        f"Command: `{meta.get('command') or 'run_serve_bench(...)'}`  ",
        f"Target {meta['target']['name']}{draft}; {meta['max_tokens']} new tokens per "
        f"request; workload `{meta['workload']}`.  ",
        f"Machine: {meta['machine']['cpu']}, torch {meta['machine']['torch']}, "
        f"{threads_text(meta['machine'])}.",
        "",
        _lossless_line(data),
    ]
    for title, head, rows in _sections(data):
        lines += ["", f"### {title}", "", "| " + " | ".join(head) + " |"]
        lines.append("|" + "---|" * len(head))
        lines += ["| " + " | ".join(cells) + " |" for cells in rows]
    return "\n".join(lines) + "\n"


def render_tables(result: ServeResult) -> list[Any]:
    """rich Tables, one per section that ran."""
    from rich.table import Table

    data = result.to_dict()
    meta = data["meta"]
    tables = []
    for title, head, rows in _sections(data):
        caption = None
        if title == "Server load":
            caption = (
                "tok/s and req/s: aggregate over the level's wall time, prefill included. "
                "speedup: tok/s over plain decoding's at the same c. ITL: gaps between a "
                "stream's content chunks. tok/pass: tokens per target pass. same: every "
                "text equals plain decoding's."
            )
        table = Table(title=f"{title}: {meta['target']['name']}", caption=caption)
        for i, col in enumerate(head):
            table.add_column(col, justify="left" if i == 0 else "right")
        for cells in rows:
            table.add_row(*[f"[bold red]{c}[/]" if c == "NO" else c for c in cells])
        tables.append(table)
    return tables


def write_serve_outputs(result: ServeResult, out: Path, plots: bool = True) -> list[Path]:
    """results.json, results.md and (unless plots=False or no load sweep ran) the plot."""
    out.mkdir(parents=True, exist_ok=True)
    data = result.to_dict()
    paths = [out / "results.json", out / "results.md"]
    paths[0].write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    paths[1].write_text(markdown(data), encoding="utf-8")
    if plots and result.load:
        paths.append(write_plot(result.load, out / SERVE_PLOT))
    return paths


def write_plot(rows: Sequence[dict[str, Any]], path: Path) -> Path:
    """TTFT (p50) and aggregate tokens/s against concurrency, a line per configuration."""
    from speculant.bench.report import _pyplot

    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11.0, 4.5))
    colors = plt.get_cmap("tab10")
    for i, label in enumerate(dict.fromkeys(r["label"] for r in rows)):
        mine = sorted((r for r in rows if r["label"] == label), key=lambda r: r["concurrency"])
        cs = [r["concurrency"] for r in mine]
        style = {"marker": "o", "label": label, "color": colors(i % 10)}
        if mine[0]["method"] == BASELINE:
            style["linestyle"] = "--"
        left.plot(cs, [r["ttft_p50_s"] for r in mine], **style)
        right.plot(cs, [r["tok_s"] for r in mine], **style)
    for ax, ylabel in ((left, "time to first token, p50 (s)"), (right, "tokens/s (aggregate)")):
        ax.set_xlabel("concurrent requests")
        ax.set_ylabel(ylabel)
        ax.set_xticks(sorted({r["concurrency"] for r in rows}))
        ax.grid(alpha=0.3)
    left.set_title("Time to first token vs concurrency")
    right.set_title("Throughput vs concurrency")
    right.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
