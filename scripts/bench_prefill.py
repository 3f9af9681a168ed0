"""Long prompts and chat turns under the scheduler the server runs: what chunked prefill
does to a running stream while a long prompt joins, and what the prefix cache does to a
chat's second turn. Prints a table and saves results.json / results.md.

    python scripts/bench_prefill.py --budgets 0,16,32,64 --long-tokens 1500 --out bench-prefill

Scenario 1: a stream (a chat prompt, --stream-tokens new tokens) runs alone, then again
while a --long-tokens prompt joins at its 5th step. Per-token latency of the stream
(a step's interval over the tokens it committed) is measured from the join until the
long request's first token; budget 0 prefills the long prompt whole when it joins.
Scenario 2: a chat's first turn (a --history-tokens user message) and its second turn
(the first turn, its answer and a new question), with and without the prefix cache:
time to first token of each.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

from speculant import Engine, SamplingParams, load_model
from speculant.prefix_cache import PrefixCache

QUESTION = "Write a Python function that merges two sorted lists, with a docstring and tests."
FILLER = Path(__file__).resolve().parents[1] / "src" / "speculant" / "scheduler.py"


def _p(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def stream_under_join(
    engine: Engine, short: list[int], long_ids: list[int] | None, budget: int, n: int
) -> dict[str, Any]:
    sched = engine.scheduler(budget or None)
    sched.add("stream", short, SamplingParams(max_tokens=n, ignore_eos=True))
    last, gaps, steps = time.perf_counter(), [], 0
    joined: float | None = None
    ttft_long: float | None = None
    while sched.busy:
        if long_ids is not None and steps == 5:
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
        "itl_p50_ms": 1000 * statistics.median(gaps),
        "itl_p99_ms": 1000 * _p(gaps, 0.99),
        "itl_max_ms": 1000 * max(gaps),
        "ttft_long_s": ttft_long,
    }


def chat_turns(engine: Engine, history: str, cached: bool) -> dict[str, Any]:
    tok = engine.target.tokenizer
    assert tok is not None
    store = PrefixCache(1 << 30) if cached else None

    def ttft(messages: list[dict[str, str]]) -> tuple[float, str, int]:
        prompt = tok.encode(tok.apply_chat_template(messages), add_special_tokens=False)
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

    turn1 = [{"role": "user", "content": history}]
    t1, answer, n1 = ttft(turn1)
    turn2 = [*turn1, {"role": "assistant", "content": answer}, {"role": "user", "content": "Why?"}]
    t2, _, n2 = ttft(turn2)
    return {
        "prefix_cache": cached,
        "prompt_tokens": [n1, n2],
        "ttft_turn1_s": t1,
        "ttft_turn2_s": t2,
        "turn2_over_turn1": t2 / t1,
        "target_hits": store.hits if store else 0,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("-k", type=int, default=3)
    ap.add_argument("--budgets", default="0,16,32,64", help="0: whole prefill")
    ap.add_argument("--long-tokens", type=int, default=1500)
    ap.add_argument("--history-tokens", type=int, default=1000)
    ap.add_argument("--stream-tokens", type=int, default=400)
    ap.add_argument("--out", type=Path, default=Path("bench-prefill"))
    args = ap.parse_args()
    target = load_model(args.target, dtype="auto")
    draft = load_model(args.draft, dtype="auto")
    tok = target.tokenizer
    assert tok is not None
    engine = Engine(target, draft=draft, num_speculative_tokens=args.k, max_seq_len=4096)
    short = tok.encode(
        tok.apply_chat_template([{"role": "user", "content": QUESTION}]), add_special_tokens=False
    )
    filler = tok.encode(FILLER.read_text())
    engine.generate(short, SamplingParams(max_tokens=8))  # warm up
    rows = [stream_under_join(engine, short, None, 0, args.stream_tokens)]
    print(json.dumps(rows[-1]), flush=True)
    for budget in [int(b) for b in args.budgets.split(",")]:
        rows.append(
            stream_under_join(engine, short, filler[: args.long_tokens], budget, args.stream_tokens)
        )
        print(json.dumps(rows[-1]), flush=True)
    history = tok.decode(filler[: args.history_tokens])
    chats = [chat_turns(engine, history, cached) for cached in (False, True)]
    for c in chats:
        print(json.dumps(c), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps({"streams": rows, "chats": chats}, indent=1))
    solo = rows[0]["itl_p99_ms"]
    lines = [
        "| long prompt joins | budget | stream ITL p50 ms | p99 ms | p99 / alone | max ms "
        "| long TTFT s |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        join = f"{r['long_prompt']} tokens" if r["long_prompt"] else "no (alone)"
        budget = "-" if not r["long_prompt"] else (r["budget"] or "whole")
        ttft = f"{r['ttft_long_s']:.1f}" if r["ttft_long_s"] else "-"
        lines.append(
            f"| {join} | {budget} | {r['itl_p50_ms']:.0f} | {r['itl_p99_ms']:.0f} | "
            f"{r['itl_p99_ms'] / solo:.1f}x | {r['itl_max_ms']:.0f} | {ttft} |"
        )
    lines += [
        "",
        "| prefix cache | prompt tokens | TTFT turn 1 s | TTFT turn 2 s | turn 2 / turn 1 |",
    ]
    lines.append("|---|---|---|---|---|")
    for c in chats:
        lines.append(
            f"| {'on' if c['prefix_cache'] else 'off'} | {c['prompt_tokens'][0]}, "
            f"{c['prompt_tokens'][1]} | {c['ttft_turn1_s']:.1f} | {c['ttft_turn2_s']:.2f} | "
            f"{c['turn2_over_turn1']:.2f}x |"
        )
    (args.out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
