"""Core benchmark: plain vs draft-model speculative decoding on the default pair, the cost
of a verify pass by width, and transformers' bf16 generate on the same prompts.

    python scripts/bench_core.py --out bench-out/core.json

Prints a table and writes a JSON report. Speeds are medians over prompts; every
speculative run is checked token for token against the plain run (greedy).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from speculant import Engine, SamplingParams, load_model

CODE_PROMPTS = [
    "Write a Python function `is_prime(n)` that returns True when n is prime. Include a docstring.",
    "Write a Python function that merges two sorted lists into one sorted list.",
    "Implement binary search in Python as `bsearch(xs, target)`, returning the index or -1.",
    "Write a Python class `Stack` with push, pop, peek and is_empty methods.",
    "Write a Python function that counts the words in a text file and returns the 10 most common.",
]


def forward_cost(model, widths, repeats=5):  # type: ignore[no-untyped-def]
    """Median ms of one forward over w new tokens after a 64-token context."""
    out = {}
    ctx = list(range(100, 164))
    for w in widths:
        times = []
        for _ in range(repeats):
            cache = model.new_cache(128)
            model.prefill(ctx, cache)
            t0 = time.perf_counter()
            model.forward(list(range(200, 200 + w)), cache, len(ctx))
            times.append((time.perf_counter() - t0) * 1e3)
        out[w] = statistics.median(times)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("-k", type=int, default=5)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--draft-dtype", default="int8")
    ap.add_argument("--limit", type=int, default=len(CODE_PROMPTS))
    ap.add_argument("--no-transformers", action="store_true")
    ap.add_argument("--out", default="bench-out/core.json")
    args = ap.parse_args()
    torch.manual_seed(0)
    target = load_model(args.target, dtype=args.dtype)
    draft = load_model(args.draft, dtype=args.draft_dtype)
    tok = target.tokenizer
    assert tok is not None
    prompts = [
        tok.encode(
            tok.apply_chat_template([{"role": "user", "content": p}]), add_special_tokens=False
        )
        for p in CODE_PROMPTS[: args.limit]
    ]
    params = SamplingParams(max_tokens=args.max_tokens)
    plain = Engine(target)
    spec = Engine(target, draft=draft, num_speculative_tokens=args.k)
    plain.generate(prompts[0][:16], SamplingParams(max_tokens=4))  # warm-up
    rows = []
    for i, ids in enumerate(prompts):
        a = plain.generate(ids, params)
        b = spec.generate(ids, params)
        rows.append(
            {
                "prompt": i,
                "new_tokens": len(a.token_ids),
                "plain_tok_s": a.stats.tokens_per_second,
                "spec_tok_s": b.stats.tokens_per_second,
                "speedup": b.stats.tokens_per_second / a.stats.tokens_per_second,
                "acceptance_rate": b.stats.acceptance_rate,
                "mean_accepted_length": b.stats.mean_accepted_length,
                "identical": a.token_ids == b.token_ids,
            }
        )
        r = rows[-1]
        print(
            f"prompt {i}: plain {r['plain_tok_s']:.2f} tok/s, spec {r['spec_tok_s']:.2f} tok/s "
            f"(x{r['speedup']:.2f}), acceptance {r['acceptance_rate']:.2f}, "
            f"tokens/pass {r['mean_accepted_length']:.2f}, identical {r['identical']}",
            flush=True,
        )
    costs_t = forward_cost(target, [1, 2, 4, 6, 8, 16])
    costs_d = forward_cost(draft, [1, 2])
    del target.net, draft.net  # free memory before loading the reference implementation
    print("target forward ms by width:", {k: round(v, 1) for k, v in costs_t.items()})
    print("draft forward ms by width:", {k: round(v, 1) for k, v in costs_d.items()})
    hf = None
    if not args.no_transformers:
        hf = transformers_plain(target, prompts, args.max_tokens)
        print(f"transformers bf16 generate: median {hf['median_tok_s']:.2f} tok/s")
    report = {
        "target": args.target,
        "draft": args.draft,
        "k": args.k,
        "max_tokens": args.max_tokens,
        "dtype": args.dtype,
        "draft_dtype": args.draft_dtype,
        "command": " ".join(sys.argv),
        "threads": torch.get_num_threads(),
        "rows": rows,
        "median_plain_tok_s": statistics.median(r["plain_tok_s"] for r in rows),
        "median_spec_tok_s": statistics.median(r["spec_tok_s"] for r in rows),
        "median_speedup": statistics.median(r["speedup"] for r in rows),
        "all_identical": all(r["identical"] for r in rows),
        "target_forward_ms": costs_t,
        "draft_forward_ms": costs_d,
        "transformers": hf,
    }
    if hf:
        report["plain_vs_transformers"] = report["median_plain_tok_s"] / hf["median_tok_s"]
    print(json.dumps({k: v for k, v in report.items() if k != "rows"}, indent=1))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    return 0


def transformers_plain(model, prompts, max_tokens):  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM

    src = model.source
    ref = AutoModelForCausalLM.from_pretrained(
        str(src.parent), gguf_file=src.name, dtype=torch.bfloat16
    ).eval()
    speeds = []
    for ids in prompts:
        x = torch.tensor([ids])
        t0 = time.perf_counter()
        with torch.no_grad():
            out = ref.generate(
                x, max_new_tokens=max_tokens, do_sample=False, min_new_tokens=max_tokens
            )
        dt = time.perf_counter() - t0
        speeds.append((out.shape[1] - len(ids)) / dt)
    return {"median_tok_s": statistics.median(speeds), "tok_s": speeds}


if __name__ == "__main__":
    sys.exit(main())
