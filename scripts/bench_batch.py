"""Speculation under load: aggregate decode tokens/s of N sequences decoded together in
one scheduler (the server's), plain against each method, the same chat prompts, one
process. Each configuration runs twice on one engine (the second run knows the pass
costs the first measured, as a long-running server does). Prints and saves JSON.

    python scripts/bench_batch.py --seqs 8 --max-tokens 64 --out bench-batch.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from speculant import Engine, SamplingParams, load_model

ASKS = [
    "Write a Python function that merges two sorted lists.",
    "Explain what a binary heap is.",
    "Fix the bug: def add(a, b): return a - b",
    "Write a SQL query for the top 5 customers by revenue.",
    "Rewrite as a list comprehension: out = []\nfor x in xs:\n    if x > 0:\n        out.append(x)",
    "What does git rebase do?",
    "Write a bash one-liner that counts lines in all .py files.",
    "Implement fizzbuzz in Python.",
]


def run(engine: Engine, prompts: list[list[int]], n: int, max_tokens: int) -> dict[str, Any]:
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
                outs[e.seq.request_id] = e.result.token_ids
    seconds = time.perf_counter() - t0
    return {
        "tok_s": tokens / seconds,
        "passes": passes,
        "drafted": drafted,
        "accepted": accepted,
        "outs": outs,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--seqs", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--configs", default="none:0,draft:auto,draft:3,ngram:auto,ngram:3")
    ap.add_argument("--out", type=Path, default=Path("bench-batch.json"))
    args = ap.parse_args()
    target = load_model(args.target, dtype="auto")
    draft = load_model(args.draft, dtype="auto")
    tok = target.tokenizer
    assert tok is not None
    prompts = [
        tok.encode(
            tok.apply_chat_template([{"role": "user", "content": a}]), add_special_tokens=False
        )
        for a in ASKS
    ]
    rows = []
    base_outs: dict[int, list[int]] | None = None
    base_rate = 0.0
    for spec in args.configs.split(","):
        method, k_text = spec.split(":")
        k: int | str = k_text if k_text == "auto" else int(k_text)
        engine = Engine(
            target,
            draft=draft if method == "draft" else None,
            method=method,
            num_speculative_tokens=k,
        )
        engine.generate(prompts[0], SamplingParams(max_tokens=8))  # warm up, alone
        for attempt in (1, 2):
            r = run(engine, prompts, args.seqs, args.max_tokens)
            outs = r.pop("outs")
            if base_outs is None:  # the first configuration (none:0) is the baseline
                base_outs, base_rate = outs, r["tok_s"]
            r.update(method=method, k=k, run=attempt, seqs=args.seqs)
            r["same"] = outs == base_outs
            r["vs_first_plain"] = r["tok_s"] / base_rate
            rows.append(r)
            print(json.dumps(r), flush=True)
    args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
